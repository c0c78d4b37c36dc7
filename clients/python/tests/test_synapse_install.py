"""streampos.synapse.install() and the launcher, against the installed
Synapse (the pinned matrix-synapse). No server needed: what the generator
does against a database is tested inside Synapse's own harness
(test/synapse/streampos_trial, run by scripts/synapse-tests)."""

import inspect
import subprocess
import sys

import pytest

pytest.importorskip("synapse")

from synapse.storage.util import id_generators  # noqa: E402

import streampos.synapse  # noqa: E402
from streampos.synapse import StreamposIdGenerator  # noqa: E402
from streampos.synapse._install import _check_signature  # noqa: E402
from streampos.synapse.generator import SYNAPSE_MULTI_WRITER_ID_GENERATOR  # noqa: E402

# Every module of synapse.storage.databases.main that imports the class by
# name (docs/synapse-streams.md lists the 17 constructions they make).
EXPECTED = {
    f"synapse.storage.databases.main.{m}"
    for m in (
        "account_data cache deviceinbox devices end_to_end_keys events_worker presence profile "
        "push_rule pusher receipts room sticky_events stream thread_subscriptions"
    ).split()
}


def test_install_rebinds_every_store_module():
    replaced = streampos.synapse.install()
    assert set(replaced) == EXPECTED
    for name in replaced:
        assert sys.modules[name].MultiWriterIdGenerator is StreamposIdGenerator
    # The defining module keeps Synapse's class, and Synapse's isinstance
    # checks accept the replacement.
    assert id_generators.MultiWriterIdGenerator is SYNAPSE_MULTI_WRITER_ID_GENERATOR
    assert issubclass(StreamposIdGenerator, id_generators.MultiWriterIdGenerator)
    assert issubclass(StreamposIdGenerator, id_generators.AbstractStreamIdGenerator)
    assert streampos.synapse.install() == replaced  # idempotent
    assert streampos.synapse.installed() == replaced


def test_constructor_is_synapses():
    ours = inspect.signature(StreamposIdGenerator.__init__)
    theirs = inspect.signature(SYNAPSE_MULTI_WRITER_ID_GENERATOR.__init__)
    assert list(ours.parameters) == list(theirs.parameters)
    for name, p in theirs.parameters.items():
        assert ours.parameters[name].kind == p.kind
        assert ours.parameters[name].default == p.default


def test_another_signature_is_refused():
    class Newer:
        def __init__(self, *, db_conn, db, notifier, stream_name, server_name, instance_name, tables,
                     sequence_name, writers, positive=True, shard=None):
            pass

    with pytest.raises(RuntimeError, match="1.163.2"):
        _check_signature(Newer)


def test_launcher_runs_synapses_entry_point():
    # --help is parsed by Synapse's own entry point, after install().
    proc = subprocess.run(
        [sys.executable, "-m", "streampos.synapse", "synapse.app.homeserver", "--help"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--config-path" in proc.stdout


@pytest.mark.parametrize("argv", [[], ["-c", "homeserver.yaml"], ["os"]])
def test_launcher_usage(argv):
    proc = subprocess.run(
        [sys.executable, "-m", "streampos.synapse", *argv], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2
    assert "streampos.synapse" in proc.stderr


def test_sqlite_gives_synapses_class(monkeypatch):
    """On SQLite (a monolith) the replacement constructs Synapse's own class
    with the same arguments."""
    import types

    from synapse.storage.engines import create_engine

    from streampos.synapse import generator

    made = []

    class Stock:
        def __init__(self, **kwargs):
            made.append(kwargs)

    monkeypatch.setattr(generator, "SYNAPSE_MULTI_WRITER_ID_GENERATOR", Stock)
    db = types.SimpleNamespace(engine=create_engine({"name": "sqlite3", "args": {"database": ":memory:"}}))
    kwargs = dict(db_conn=object(), notifier=object(), stream_name="events", server_name="hs",
                  instance_name="master", tables=[("events", "instance_name", "stream_ordering")],
                  sequence_name="events_stream_seq", writers=["master"], positive=True)
    g = StreamposIdGenerator(db=db, **kwargs)
    assert isinstance(g, Stock)
    assert made == [dict(db=db, **kwargs)]
