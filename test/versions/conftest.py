"""Servers of several PostgreSQL versions at once, for the tests across
versions (pg_upgrade, tokens in binary from one version to another).

scripts/test --all-versions runs these after every version's suite has
installed streampos into that version, and names each version's programs
in STREAMPOS_PG_BIN_<major> (e.g. STREAMPOS_PG_BIN_17=/…/bin). Servers live
under STREAMPOS_VERSIONS_DIR, on ports from STREAMPOS_VERSIONS_PORT up. A
test whose versions are not named fails: it is never skipped.
"""

import os
import pwd
import shutil
import subprocess
import sys

import psycopg
import pytest

# catalog() of test/python/test_upgrade.py describes every object of the
# extension: the same description on every version is the same catalog.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

BASE_DIR = os.environ.get("STREAMPOS_VERSIONS_DIR", "/tmp/streampos-versions")
BASE_PORT = int(os.environ.get("STREAMPOS_VERSIONS_PORT", "54370"))
USER = "postgres"


def bin_dir(version):
    path = os.environ.get(f"STREAMPOS_PG_BIN_{version}")
    assert path, (
        f"STREAMPOS_PG_BIN_{version} is not set: PostgreSQL {version} with streampos "
        "installed is needed (scripts/test --all-versions)"
    )
    return path


def as_postgres(args):
    if os.geteuid() == 0:
        return ["runuser", "-u", USER, "--"] + args
    return args


def run(args, cwd=None, timeout=600):
    # Each version's programs find their own libraries (their run path):
    # a loader path set for one version must not reach another's.
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env.update(RUST_BACKTRACE="0", RUST_LIB_BACKTRACE="0")
    proc = subprocess.run(as_postgres(args), capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def own(path):
    if os.geteuid() == 0:
        pw = pwd.getpwnam(USER)
        os.chown(path, pw.pw_uid, pw.pw_gid)


def work_dir(name):
    """An empty directory the postgres user owns."""
    os.makedirs(BASE_DIR, exist_ok=True)
    own(BASE_DIR)
    path = os.path.join(BASE_DIR, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    own(path)
    return path


class Server:
    """A cluster of one version with streampos preloaded."""

    def __init__(self, version, data, port):
        self.version = version
        self.bin = bin_dir(version)
        self.data = data
        self.port = port

    def tool(self, name):
        return os.path.join(self.bin, name)

    def initdb(self):
        # The same encoding and locale on every version, and no data
        # checksums (18's initdb default, which pg_upgrade from a cluster
        # without them refuses).
        args = [self.tool("initdb"), "-D", self.data, "-A", "trust", "-U", USER, "-E", "UTF8", "--locale=C"]
        if self.version >= 18:
            args.append("--no-data-checksums")
        run(args)
        with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
            f.write(
                "shared_preload_libraries = 'streampos'\n"
                f"port = {self.port}\n"
                "listen_addresses = '127.0.0.1'\n"
                "unix_socket_directories = '/tmp'\n"
                "fsync = on\n"
            )
        return self

    def start(self):
        run([self.tool("pg_ctl"), "-D", self.data, "-l", os.path.join(self.data, "server.log"), "-w", "-t", "60", "start"])
        return self

    def stop(self, mode="fast"):
        if os.path.exists(os.path.join(self.data, "postmaster.pid")):
            run([self.tool("pg_ctl"), "-D", self.data, "-m", mode, "-w", "-t", "60", "stop"])

    def connect(self, dbname="postgres"):
        return psycopg.connect(host="127.0.0.1", port=self.port, user=USER, dbname=dbname, autocommit=True)

    def server_version(self):
        with self.connect() as c:
            return c.info.server_version // 10000


@pytest.fixture
def servers():
    """``servers(version, name)`` makes (initdb) a server of that version
    in a directory of its own, on the next free port; every one is stopped
    at teardown."""
    made = []

    def make(version, name):
        server = Server(version, os.path.join(work_dir(name), "data"), BASE_PORT + len(made))
        made.append(server)
        return server.initdb()

    yield make
    for server in made:
        try:
            server.stop("immediate")
        except AssertionError:
            pass
