"""The Debian package's maintainer scripts (scripts/package-prerm and
-postinst, with @MAJOR@ filled in as scripts/package does): removing the
package while a cluster of its version preloads the library is refused
with the way out; installing says what to do next. No server needed."""

import os
import subprocess

import pytest

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))


def script(name, tmp_path, major="15"):
    text = open(os.path.join(ROOT, "scripts", f"package-{name}")).read().replace("@MAJOR@", major)
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o755)
    return path


def cluster(etc, major="15", name="main", conf="", auto=None, conf_d=None):
    conf_dir = etc / major / name
    (conf_dir / "conf.d").mkdir(parents=True)
    data = etc.parent / f"data-{major}-{name}"
    data.mkdir()
    (conf_dir / "postgresql.conf").write_text(f"data_directory = '{data}'\n{conf}")
    if auto is not None:
        (data / "postgresql.auto.conf").write_text(auto)
    if conf_d is not None:
        (conf_dir / "conf.d" / "local.conf").write_text(conf_d)
    return conf_dir


def run(path, *args, **env):
    return subprocess.run(["sh", str(path), *args], capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=30)


@pytest.mark.parametrize("where", ["postgresql.conf", "conf.d", "postgresql.auto.conf"])
def test_removing_while_a_cluster_preloads_it_is_refused_with_the_way_out(tmp_path, where):
    etc = tmp_path / "etc"
    line = "shared_preload_libraries = 'pg_stat_statements,streampos'\n"
    cluster(etc, conf=line if where == "postgresql.conf" else "",
            conf_d=line if where == "conf.d" else None,
            auto=line if where == "postgresql.auto.conf" else None)
    prerm = script("prerm", tmp_path)
    refused = run(prerm, "remove", STREAMPOS_PG_ETC=str(etc))
    assert refused.returncode == 1
    assert "still in shared_preload_libraries" in refused.stderr and where in refused.stderr
    assert "STREAMPOS_FORCE_REMOVE=1" in refused.stderr
    assert run(prerm, "purge", STREAMPOS_PG_ETC=str(etc)).returncode == 1
    forced = run(prerm, "remove", STREAMPOS_PG_ETC=str(etc), STREAMPOS_FORCE_REMOVE="1")
    assert forced.returncode == 0 and "anyway" in forced.stderr
    # An upgrade of the package replaces the library: nothing to refuse.
    assert run(prerm, "upgrade", "0.4.0", STREAMPOS_PG_ETC=str(etc)).returncode == 0


@pytest.mark.parametrize("conf", [
    "SHARED_PRELOAD_LIBRARIES='$libdir/streampos'\n",            # names are case-insensitive
    "shared_preload_libraries = streampos  # unquoted\n",
    "shared_preload_libraries = 'pg_stat_statements'\nshared_preload_libraries = 'streampos'\n",
])
def test_the_setting_is_read_as_postgresql_reads_it(tmp_path, conf):
    etc = tmp_path / "etc"
    cluster(etc, conf=conf)
    assert run(script("prerm", tmp_path), "remove", STREAMPOS_PG_ETC=str(etc)).returncode == 1


@pytest.mark.parametrize("conf,auto", [
    # The last setting wins: ALTER SYSTEM took it out.
    ("shared_preload_libraries = 'streampos'\n", "shared_preload_libraries = 'pg_stat_statements'\n"),
    # Another library, a comment naming streampos.
    ("shared_preload_libraries = 'streampos_other'  # not streampos\n", None),
])
def test_a_setting_without_streampos_is_not_refused(tmp_path, conf, auto):
    etc = tmp_path / "etc"
    cluster(etc, conf=conf, auto=auto)
    done = run(script("prerm", tmp_path), "remove", STREAMPOS_PG_ETC=str(etc))
    assert done.returncode == 0, done.stderr


def test_removing_is_allowed_when_nothing_preloads_it(tmp_path):
    etc = tmp_path / "etc"
    prerm = script("prerm", tmp_path)
    assert run(prerm, "remove", STREAMPOS_PG_ETC=str(etc)).returncode == 0  # no cluster at all
    cluster(etc, conf="#shared_preload_libraries = 'streampos'\nshared_preload_libraries = 'pg_stat_statements'\n")
    # Another version's cluster is another package's.
    cluster(etc, major="16", conf="shared_preload_libraries = 'streampos'\n")
    done = run(prerm, "remove", STREAMPOS_PG_ETC=str(etc))
    assert done.returncode == 0, done.stderr


def test_installing_says_what_to_do_next(tmp_path):
    postinst = script("postinst", tmp_path, major="17")
    done = run(postinst, "configure")
    assert done.returncode == 0
    assert "shared_preload_libraries" in done.stdout and "CREATE EXTENSION streampos" in done.stdout
    assert "/usr/share/postgresql/17/streampos/" in done.stdout
