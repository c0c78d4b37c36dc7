"""Helpers for the concurrent-session tests of streampos: connections,
queries, durability, waiting and server control. Fixtures are in conftest.py.

The runner (scripts/test) starts a cluster with streampos preloaded and sets
STREAMPOS_PGHOST, STREAMPOS_PGPORT and STREAMPOS_PGDATA.
"""

import contextlib
import os
import re
import shutil
import subprocess
import time

import psycopg
import pytest

PGHOST = os.environ.get("STREAMPOS_PGHOST", "127.0.0.1")
PGPORT = int(os.environ.get("STREAMPOS_PGPORT", "54330"))
PGDATA = os.environ.get("STREAMPOS_PGDATA")
PGUSER = os.environ.get("STREAMPOS_PGUSER", "postgres")
PG_BIN = os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin")
DBNAME = "streampos_pytest"


def _extension_version():
    """The version this source builds (Cargo.toml's), which a fresh
    CREATE EXTENSION and ALTER EXTENSION ... UPDATE reach."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "Cargo.toml")
    with open(path) as f:
        return re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)


EXTENSION_VERSION = _extension_version()

# A SQL file run in every scratch database after CREATE EXTENSION (e.g. to
# try SQL objects against the tests without rebuilding the extension).
EXTRA_SQL = os.environ.get("STREAMPOS_TEST_EXTRA_SQL")

# The contract (docs/contract.md): stream_positions is "caught up within a
# second of a commit"; in-flight IDs of a terminated or disconnected session
# are released when its backend exits, which takes well under that. Tests
# allow three: CI's two cores also run other suites' servers, and a 1 s
# bound failed there once with nothing wrong but the load (the worker
# stores every 200 ms).
CATCH_UP_SECONDS = 3.0


def _conninfo(dbname):
    return dict(host=PGHOST, port=PGPORT, user=PGUSER, dbname=dbname, connect_timeout=10)


def conninfo_string(dbname=DBNAME):
    """The libpq connection string of a database of the test server."""
    return psycopg.conninfo.make_conninfo(**_conninfo(dbname))


def connect_raw(dbname=DBNAME, **kwargs):
    """An autocommit connection (not tracked: the caller closes it)."""
    params = _conninfo(dbname)
    params.update(kwargs)
    return psycopg.connect(autocommit=True, **params)


# --------------------------------------------------------------- queries


def one(conn, sql, params=None):
    """First column of the single row a statement returns."""
    row = conn.execute(sql, params).fetchone()
    assert row is not None, f"no row from {sql!r}"
    return row[0]


def rows(conn, sql, params=None):
    return conn.execute(sql, params).fetchall()


def force_parallel_setting(conn):
    """The setting that makes every query parallel: force_parallel_mode,
    named debug_parallel_query from PostgreSQL 16 on."""
    return "debug_parallel_query" if conn.info.server_version >= 160000 else "force_parallel_mode"


def expect_error(conn, sql, params=None, sqlstate=None):
    """Run a statement that must fail; return the psycopg error.

    Asserts the SQLSTATE when one is given."""
    with pytest.raises(psycopg.Error) as info:
        conn.execute(sql, params)
    err = info.value
    if sqlstate is not None:
        assert err.diag.sqlstate == sqlstate, (
            f"{sql!r}: expected SQLSTATE {sqlstate}, got {err.diag.sqlstate}: {err}"
        )
    return err


def create_stream(conn, stream, backwards=False, writers=None):
    """streampos.create_stream(); returns the sequence's name (regclass text)."""
    return one(
        conn,
        "SELECT streampos.create_stream(%s, backwards => %s, writers => %s::text[])::text",
        (stream, backwards, writers),
    )


def commit_ids(conn, stream, writer, n=1):
    """n IDs allocated and committed in a transaction of their own (with a
    WAL record of its own, so the commit flushes)."""
    with conn.transaction():
        ids = one(conn, "SELECT streampos.next_ids(%s, %s, %s)", (stream, writer, n))
        conn.execute("SELECT pg_catalog.pg_logical_emit_message(true, 'streampos-test', '')")
    return ids


def frontier(conn, stream):
    return one(conn, "SELECT streampos.frontier(%s)", (stream,))


def next_id(conn, stream, writer):
    return one(conn, "SELECT streampos.next_id(%s, %s)", (stream, writer))


def next_ids(conn, stream, writer, n):
    return one(conn, "SELECT streampos.next_ids(%s, %s, %s::int)", (stream, writer, n))


def max_allocated(conn, stream):
    return one(conn, "SELECT streampos.max_allocated(%s)", (stream,))


def writer_position(conn, stream, writer):
    return one(conn, "SELECT streampos.writer_position(%s, %s)", (stream, writer))


def samples_missing_rows(samples, final):
    """The (kind, frontier, rows) samples whose rows are not exactly the
    final committed rows at or below their frontier, as (kind, frontier,
    missed, extra)."""
    missed = []
    for kind, f, seen in samples:
        expected = frozenset(i for i in final if i <= f)
        if seen != expected:
            missed.append((kind, f, sorted(expected - seen), sorted(seen - expected)))
    return missed


def paused_next_id(pool, observer, conn, stream, writer, delay_ms):
    """Start next_id on `conn` in a transaction of its own, paused for
    `delay_ms` after it published its lower bound (test-hooks build), and
    return once `observer` sees that lower bound in in_flight(): (the call's
    future, when it started)."""
    conn.execute(f"SET streampos.test_allocation_delay_ms = {int(delay_ms)}")
    pid = backend_pid(conn)
    conn.execute("BEGIN")
    started = time.monotonic()
    future = pool.submit(next_id, conn, stream, writer)
    wait_until(
        lambda: [r for r in in_flight(observer, stream) if r[1] == pid],
        timeout=2,
        interval=0.002,
        message="the paused allocation's lower bound in in_flight()",
    )
    return future, started


def ensure_login_role(name, dbname=DBNAME):
    """A LOGIN role `name` with nothing beyond PUBLIC's privileges (created
    unless it exists, from a session of `dbname`); returns its name."""
    with connect_raw(dbname) as admin:
        admin.execute(
            f"DO $$ BEGIN CREATE ROLE {name} LOGIN; "
            f"EXCEPTION WHEN duplicate_object THEN NULL; END $$"
        )
    return name


def sequence_value(conn, seq):
    """The sequence's last handed-out value (last_value, or one less when
    is_called is false)."""
    last, called = conn.execute(f"SELECT last_value, is_called FROM {seq}").fetchone()
    return last if called else last - 1


def in_flight(conn, stream):
    return rows(
        conn,
        "SELECT instance_name, pid, xid::text, min_id, max_id, ids, since "
        "FROM streampos.in_flight(%s) ORDER BY min_id",
        (stream,),
    )


def stored_positions(conn, stream):
    """{instance_name: stream_id} from streampos.stream_positions."""
    return dict(
        rows(
            conn,
            "SELECT instance_name, stream_id FROM streampos.stream_positions "
            "WHERE stream_name = %s",
            (stream,),
        )
    )


def backend_pid(conn):
    return one(conn, "SELECT pg_backend_pid()")


# --------------------------------------------------------------- durability
#
# streampos counts an ID as finished only once its transaction ended AND the
# WAL that made its sequence value durable is flushed (otherwise a crash could
# hand the ID out again). The extension flushes that WAL itself when a
# transaction that allocated aborts, or commits without having written WAL of
# its own; only asynchronous commits (synchronous_commit = off) wait for the
# WAL writer. durable_commit() makes a test's commit write WAL like a real
# writer's, so both paths are exercised.

WAL_MARK = "SELECT pg_catalog.pg_logical_emit_message(true, 'streampos-pytest', '')"


def durable_commit(conn):
    """COMMIT the open transaction after writing a WAL record in it (as the
    rows a real writer persists would), so the commit flushes the WAL."""
    conn.execute(WAL_MARK)
    conn.execute("COMMIT")


def flush_wal(conn):
    """Flush the WAL up to now (a tiny synchronous commit of an autocommit
    session): every ID allocated so far is durable afterwards."""
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    conn.execute(WAL_MARK)


# --------------------------------------------------------------- waiting


def wait_until(predicate, timeout=5.0, interval=0.02, message="condition"):
    """Poll ``predicate`` until it returns a truthy value, at most ``timeout``
    seconds; returns that value or fails the test with the last value seen."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}; last value: {last!r}")
        time.sleep(interval)


# --------------------------------------------------------------- streams


def drop_streams(prefix):
    """Drop every stream whose name starts with ``prefix``: a dropped
    stream's registry slot can be reused, while the slots of streams in a
    dropped database stay taken until the server restarts
    (streampos.max_streams is cluster-wide)."""
    with connect_raw(connect_timeout=5) as c:
        c.execute("SET lock_timeout = '2s'")
        names = rows(
            c,
            "SELECT stream_name FROM streampos.streams WHERE starts_with(stream_name, %s)",
            (prefix,),
        )
        for (name,) in names:
            try:
                c.execute("SELECT streampos.drop_stream(%s)", (name,))
            except psycopg.Error:
                pass


# --------------------------------------------------------------- scratch databases


def drop_all_streams(dbname):
    """Drop every stream of a database (its registry slots are freed only
    this way: those of a dropped database stay taken until a restart)."""
    with connect_raw(dbname, connect_timeout=5) as c:
        c.execute("SET lock_timeout = '2s'")
        if one(c, "SELECT count(*) FROM pg_catalog.pg_extension WHERE extname = 'streampos'") == 0:
            return
        for (name,) in rows(c, "SELECT stream_name FROM streampos.streams"):
            try:
                c.execute("SELECT streampos.drop_stream(%s)", (name,))
            except psycopg.Error:
                pass


def drop_database(dbname):
    with connect_raw("postgres") as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


@contextlib.contextmanager
def scratch_database(dbname, template=None, extension=True):
    """A database of its own for a test (a copy of ``template`` if given,
    with the extension unless ``extension`` is false); its streams and the
    database are dropped afterwards."""
    drop_database(dbname)
    with connect_raw("postgres") as admin:
        clause = f' TEMPLATE "{template}"' if template else ""
        admin.execute(f'CREATE DATABASE "{dbname}"{clause}')
    try:
        if extension:
            with connect_raw(dbname) as c:
                c.execute("CREATE EXTENSION IF NOT EXISTS streampos")
                if EXTRA_SQL:
                    with open(EXTRA_SQL, encoding="utf-8") as f:
                        c.execute(f.read())
        yield dbname
    finally:
        try:
            drop_all_streams(dbname)
        finally:
            drop_database(dbname)


# --------------------------------------------------------------- server control


def _as_postgres(args):
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--"] + args
    return args


def pg_ctl(*args, timeout=120):
    if not PGDATA:
        pytest.skip("STREAMPOS_PGDATA is not set: cannot control the server")
    env = dict(os.environ, RUST_BACKTRACE="0", RUST_LIB_BACKTRACE="0")
    cmd = _as_postgres([os.path.join(PG_BIN, "pg_ctl"), "-D", PGDATA, *args])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed: {proc.stdout}{proc.stderr}"
    return proc


def stop_server(mode="immediate"):
    pg_ctl("-m", mode, "-w", "-t", "60", "stop")


def start_server(options=None):
    args = ["-l", os.path.join(PGDATA or "", "server.log"), "-w", "-t", "60"]
    if options:
        args += ["-o", options]
    pg_ctl(*args, "start")
    wait_for_server()


def restart_server(mode="immediate", options=None):
    """Stop the server (``-m immediate`` simulates a crash) and start it again."""
    stop_server(mode)
    start_server(options)


def wait_for_server(timeout=60.0):
    """Wait until the test database accepts connections (e.g. after a crash
    restart triggered by a killed backend)."""

    def ready():
        try:
            with connect_raw() as c:
                return one(c, "SELECT NOT pg_is_in_recovery()")
        except psycopg.OperationalError:
            return False

    wait_until(ready, timeout=timeout, interval=0.1, message="the server to accept connections")




# --------------------------------------------------------------- a hot standby


def _pg_tool(name, *args, timeout=120, check=True):
    env = dict(os.environ, RUST_BACKTRACE="0", RUST_LIB_BACKTRACE="0")
    cmd = _as_postgres([os.path.join(PG_BIN, name), *args])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed: {proc.stdout}{proc.stderr}"
    return proc


def start_standby(path, port):
    """A streaming hot standby of the test server (pg_basebackup -R into
    ``path``, removed first), started on ``port``; returns its conninfo
    keyword arguments for the test database. Stop it with stop_standby."""
    if not PGDATA:
        pytest.skip("STREAMPOS_PGDATA is not set: cannot make a standby")
    stop_standby(path)
    _pg_tool("pg_basebackup", "-h", PGHOST, "-p", str(PGPORT), "-U", PGUSER,
             "-D", path, "-R", "-X", "stream", "-c", "fast")
    _pg_tool("pg_ctl", "-D", path, "-l", os.path.join(path, "server.log"),
             "-o", f"-p {port} -c hot_standby=on", "-w", "-t", "60", "start")
    return dict(host=PGHOST, port=port, user=PGUSER, dbname=DBNAME)


def stop_standby(path):
    """Stop the standby at ``path`` (if it runs) and remove it."""
    if os.path.exists(os.path.join(path, "postmaster.pid")):
        _pg_tool("pg_ctl", "-D", path, "-m", "immediate", "-w", "-t", "60", "stop", check=False)
    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------- settings and the server log


@contextlib.contextmanager
def server_settings(settings):
    """ALTER SYSTEM SET each setting of the dict (reloaded) for the block,
    then RESET."""
    with connect_raw("postgres") as admin:
        for name, value in settings.items():
            admin.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        admin.execute("SELECT pg_reload_conf()")
    # The reload reaches every process (the position worker too) within a
    # moment.
    time.sleep(0.3)
    try:
        yield
    finally:
        with connect_raw("postgres") as admin:
            for name in settings:
                admin.execute(f"ALTER SYSTEM RESET {name}")
            admin.execute("SELECT pg_reload_conf()")
        time.sleep(0.3)


class ServerLog:
    """The server log (STREAMPOS_PGDATA/server.log) from the moment this was
    made: ``lines()`` returns what was written since."""

    def __init__(self):
        if not PGDATA:
            pytest.skip("STREAMPOS_PGDATA is not set: cannot read the server log")
        self.path = os.path.join(PGDATA, "server.log")
        self.start = os.path.getsize(self.path)

    def lines(self):
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read().decode("utf-8", "replace").splitlines()
