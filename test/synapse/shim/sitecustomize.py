"""Loaded by every Python process of a scripts/synapse-tests run (the shim
directory is on PYTHONPATH; Twisted trial passes it on to its workers).

STREAMPOS_SYNAPSE_TREE   Synapse's unpacked sdist: put first on sys.path, so
                         that `synapse` and `tests` are imported from it.
STREAMPOS_SYNAPSE_MODE   stock      Synapse as it is (the baseline), only counted
                         streampos  streampos.synapse.install(), and the extension
                                    created in every database Synapse's tests
                                    prepare (the base database each trial process
                                    clones per test: tests/utils.py:setupdb)
                         class      as streampos, and the name in Synapse's
                                    id_generators module rebound too, so that
                                    tests of the class itself construct the
                                    replacement (see test/synapse/README.md)
STREAMPOS_SYNAPSE_COUNTS a directory: each process writes there, at exit, which
                         class each module constructed, per stream.
Nothing of Synapse's files is changed: its functions are wrapped at runtime.
"""

import atexit
import json
import os
import sys

_TREE = os.environ.get("STREAMPOS_SYNAPSE_TREE")
_MODE = os.environ.get("STREAMPOS_SYNAPSE_MODE")
_COUNTS = os.environ.get("STREAMPOS_SYNAPSE_COUNTS")


def _count(cls, counts):
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "?")
        key = f"{cls.__name__} {caller} {kwargs.get('stream_name')}"
        counts[key] = counts.get(key, 0) + 1
        init(self, *args, **kwargs)

    __init__.__wrapped__ = init
    cls.__init__ = __init__


def _plant_traps(db_conn):
    """The trap fixture (test/python/traps.py) in the database being
    prepared, before Synapse's schema (so that its tables get the index
    traps) and again after the extension (the token types' operators); the
    databases of the tests are copies. scripts/synapse-tests checks the
    server log after the run. STREAMPOS_TRAPS=0 turns it off."""
    if os.environ.get("STREAMPOS_TRAPS", "1") == "0":
        return
    import subprocess

    cur = db_conn.cursor(txn_name="streampos_traps")
    cur.execute("SELECT pg_catalog.current_database()")
    (dbname,) = cur.fetchone()
    cur.close()
    db_conn.commit()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # Without this shim (PYTHONPATH) in the child: it needs no Synapse.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The server Synapse's tests use (scripts/synapse-tests may run its own).
    env["STREAMPOS_PGHOST"] = os.environ.get("SYNAPSE_POSTGRES_HOST", "127.0.0.1")
    env["STREAMPOS_PGPORT"] = os.environ.get("SYNAPSE_POSTGRES_PORT", "5432")
    subprocess.run(
        [sys.executable, os.path.join(root, "python", "traps.py"), "plant-synapse", dbname], check=True, env=env
    )


def _create_extension_after_prepare():
    """Synapse's tests build one base database per process with
    prepare_database and clone it per test: create the extension in every
    database prepared on PostgreSQL (a superuser runs the tests)."""
    from synapse.storage import prepare_database as module
    from synapse.storage.engines import PostgresEngine

    prepare = module.prepare_database

    def prepare_database(db_conn, database_engine, config, databases=("main", "state")):
        postgres = isinstance(database_engine, PostgresEngine)
        if postgres:
            _plant_traps(db_conn)
        prepare(db_conn, database_engine, config, databases=databases)
        if postgres:
            cur = db_conn.cursor(txn_name="streampos_create_extension")
            cur.execute("CREATE EXTENSION IF NOT EXISTS streampos")
            cur.close()
            db_conn.commit()
            _plant_traps(db_conn)

    prepare_database.__wrapped__ = prepare
    module.prepare_database = prepare_database


def _drop_test_databases_with_force():
    """Synapse's cleanup drops each test's database with a plain DROP
    DATABASE, which fails (after five tries of five seconds) while any other
    session is connected to it, and then leaves the database behind. In the
    multi-worker tests the connections of a worker homeserver's own pool,
    which Synapse's tests replace by the main process's pool and never
    close, outlive the test (stock Synapse leaves those databases behind
    too). With streampos a database left behind keeps its streams' registry
    slots (streampos.max_streams) until it is dropped, and enough of them
    fill the registry (test/synapse/README.md has the measurement). The
    extension's position worker is not the reason: it leaves about 2 s
    after its database's last activity. So the connections to the base
    database, from which the cleanup drops, get a cursor that drops WITH
    (FORCE). Only cleanup changes: the test has finished by then."""
    import re

    import psycopg2
    import psycopg2.extensions

    connect = psycopg2.connect
    drop = re.compile(r"^DROP DATABASE IF EXISTS ([a-z0-9_]+);?$")

    class DropCursor(psycopg2.extensions.cursor):
        def execute(self, query, vars=None):
            m = drop.match(query.strip()) if isinstance(query, str) else None
            if m:
                query = f"DROP DATABASE IF EXISTS {m.group(1)} WITH (FORCE)"
            return super().execute(query, vars)

    def drop_aware_connect(*args, **kwargs):
        if str(kwargs.get("dbname", "")).startswith("_synapse_unit_tests_base_"):
            kwargs.setdefault("cursor_factory", DropCursor)
        return connect(*args, **kwargs)

    psycopg2.connect = drop_aware_connect


def _main():
    if _TREE:
        sys.path.insert(0, _TREE)
    if _MODE not in ("stock", "streampos", "class"):
        return
    counts = {}
    from synapse.storage.util import id_generators

    stock = id_generators.MultiWriterIdGenerator
    if _MODE != "stock":
        import streampos.synapse

        streampos.synapse.install()
        _create_extension_after_prepare()
        # STREAMPOS_SYNAPSE_PLAIN_DROP=1: Synapse's own cleanup, to measure it.
        if os.environ.get("STREAMPOS_SYNAPSE_PLAIN_DROP") != "1":
            _drop_test_databases_with_force()
        _count(streampos.synapse.StreamposIdGenerator, counts)
        if _MODE == "class":
            id_generators.MultiWriterIdGenerator = streampos.synapse.StreamposIdGenerator
    _count(stock, counts)
    if _COUNTS:

        def write():
            if counts:
                path = os.path.join(_COUNTS, f"constructions-{os.getpid()}.json")
                with open(path, "w") as f:
                    json.dump(counts, f, indent=1, sort_keys=True)

        atexit.register(write)


_main()
