"""Crashes and restarts (docs/contract.md, invariants 3 and 4): after any restart nothing
is in flight and the frontier equals the sequence's value; stored positions
are never ahead of it; allocation continues above it.

Every test here is marked restarts_server, so it runs after all others.
"""

import os
import signal

import psycopg
import pytest

from support import (
    CATCH_UP_SECONDS,
    PGDATA,
    backend_pid,
    connect_raw,
    create_stream,
    expect_error,
    frontier,
    in_flight,
    max_allocated,
    next_ids,
    one,
    restart_server,
    rows,
    sequence_value,
    start_server,
    stop_server,
    stored_positions,
    wait_for_server,
    wait_until,
)

pytestmark = pytest.mark.skipif(not PGDATA, reason="STREAMPOS_PGDATA is not set")


def table_ids(conn, table):
    return sorted(r[0] for r in rows(conn, f"SELECT id FROM {table}"))


def setup_stream_with_rows(conn, stream, backwards=False):
    seq = create_stream(conn, stream, backwards=backwards)
    table = f"{stream}_t"
    conn.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, writer text)")
    conn.execute("SELECT streampos.add_table(%s, %s::regclass, 'id', 'writer')", (stream, table))
    for w in ("a", "b"):
        conn.execute("SELECT streampos.instance_id(%s)", (f"{stream}_{w}",))
    return seq, table


def write(conn, stream, table, writer, n, commit=True):
    conn.execute("BEGIN")
    ids = next_ids(conn, stream, writer, n)
    for i in ids:
        conn.execute(f"INSERT INTO {table} VALUES (%s, %s)", (i, writer))
    if commit:
        conn.execute("COMMIT")
    return ids


def assert_consistent_after_restart(conn, stream, seq, sign, before):
    """Nothing in flight; frontier == max_allocated == the sequence's value
    (negated for a backward stream); not behind the frontier seen before;
    stored positions not ahead; check_stream() ok. Returns the frontier."""
    value = sequence_value(conn, seq)
    assert in_flight(conn, stream) == []
    assert (frontier(conn, stream), max_allocated(conn, stream)) == (sign * value, sign * value)
    assert abs(frontier(conn, stream)) >= abs(before), "the frontier went backwards across the restart"
    for name, pos in stored_positions(conn, stream).items():
        assert abs(pos) <= value, f"stored position of {name} ({pos}) is ahead of the sequence ({value})"
    bad = [c for c in rows(conn, "SELECT * FROM streampos.check_stream(%s)", (stream,)) if not c[1]]
    assert bad == []
    return sign * value


@pytest.mark.restarts_server
def test_immediate_shutdown_releases_in_flight_ids_and_frontier_equals_sequence(connect, stream):
    """With IDs committed and IDs in flight, `pg_ctl stop -m immediate` and a
    start leave nothing in flight: frontier = max_allocated = the sequence's
    value (possibly up to 32 ahead), committed rows all at or below it, stored
    positions not ahead of it, and the next ID above it. Same for a backward
    stream."""
    db = connect()
    seq, table = setup_stream_with_rows(db, stream)
    back = f"{stream}_bk"
    back_seq, back_table = setup_stream_with_rows(db, back, backwards=True)
    a, b, c = connect(), connect(), connect()
    wa, wb = f"{stream}_a", f"{stream}_b"
    assert write(a, stream, table, wa, 5) == [1, 2, 3, 4, 5]
    assert write(a, stream, table, wa, 3, commit=False) == [6, 7, 8]  # in flight
    assert write(b, stream, table, wb, 1) == [9]
    assert write(c, back, back_table, f"{back}_a", 2) == [-1, -2]
    assert write(c, back, back_table, f"{back}_a", 2, commit=False) == [-3, -4]
    before, back_before = frontier(db, stream), frontier(db, back)
    assert (before, back_before) == (5, -2)
    wait_until(
        lambda: stored_positions(db, stream) == {wa: 5, wb: 9},
        timeout=CATCH_UP_SECONDS,
        message="stored positions before the crash",
    )

    restart_server("immediate")

    db = connect()
    f = assert_consistent_after_restart(db, stream, seq, 1, before)
    assert f >= 9, "a committed ID is above the frontier after the restart"
    assert table_ids(db, table) == [1, 2, 3, 4, 5, 9]
    assert max(stored_positions(db, stream).values()) <= f
    assert next_ids(db, stream, wa, 2) == [f + 1, f + 2]
    assert frontier(db, stream) == f + 2

    bf = assert_consistent_after_restart(db, back, back_seq, -1, back_before)
    assert bf <= -2
    assert table_ids(db, back_table) == [-2, -1]
    assert next_ids(db, back, f"{back}_a", 1) == [bf - 1]


@pytest.mark.restarts_server
def test_killed_backend_crash_restart_releases_its_ids(connect, stream):
    """SIGKILL of a backend holding IDs makes the postmaster reinitialise
    shared memory; afterwards nothing is in flight, the frontier equals the
    sequence's value, and allocation continues above it."""
    db = connect()
    seq, table = setup_stream_with_rows(db, stream)
    a, victim = connect(), connect()
    assert write(a, stream, table, f"{stream}_a", 3) == [1, 2, 3]
    pid = backend_pid(victim)
    assert write(victim, stream, table, f"{stream}_b", 2, commit=False) == [4, 5]
    assert frontier(db, stream) == 3
    try:
        os.kill(pid, signal.SIGKILL)
    except PermissionError:
        pytest.skip("cannot signal the server's backends")
    # Wait until the postmaster noticed and finished the crash restart.
    wait_until(
        lambda: _down_or_restarted(pid),
        timeout=30,
        interval=0.1,
        message="the crash restart",
    )
    wait_for_server()

    db = connect()
    f = assert_consistent_after_restart(db, stream, seq, 1, 3)
    assert f >= 3
    assert table_ids(db, table) == [1, 2, 3]
    assert next_ids(db, stream, f"{stream}_a", 1) == [f + 1]


def _down_or_restarted(killed_pid):
    try:
        with psycopg.connect(
            host=os.environ.get("STREAMPOS_PGHOST", "127.0.0.1"),
            port=int(os.environ.get("STREAMPOS_PGPORT", "54330")),
            user="postgres",
            dbname="postgres",
            autocommit=True,
            connect_timeout=2,
        ) as c:
            # The crash restart terminated every backend: none predates it.
            return one(c, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (killed_pid,)) == 0
    except psycopg.OperationalError:
        return False


@pytest.mark.restarts_server
def test_clean_restart_keeps_positions(connect, stream):
    """After a fast (clean) shutdown right after a commit, stored positions
    are not ahead of the sequence and the frontier is exactly the last
    committed ID (a clean shutdown does not skip sequence values)."""
    db = connect()
    seq, table = setup_stream_with_rows(db, stream)
    wa = f"{stream}_a"
    assert write(db, stream, table, wa, 4) == [1, 2, 3, 4]
    db.close()
    restart_server("fast")
    db = connect()
    assert assert_consistent_after_restart(db, stream, seq, 1, 4) == 4
    assert stored_positions(db, stream).get(wa, 0) <= 4


@pytest.mark.restarts_server
def test_without_preload_token_types_work_and_registry_functions_fail_with_55000_and_hint(connect, stream):
    """Without shared_preload_libraries the token types keep working and the
    registry functions fail with SQLSTATE 55000 and a HINT naming the setting;
    with the preload back, the stream works again."""
    db = connect()
    create_stream(db, stream)
    assert next_ids(db, stream, "w", 2) == [1, 2]
    db.close()
    stop_server("fast")
    try:
        start_server(options="-c shared_preload_libraries=")
        db = connect()
        assert one(db, "SHOW shared_preload_libraries") == ""
        assert one(db, "SELECT 'm56~3.59~2.58'::streampos.room_stream_token::text") == "m56~2.58~3.59"
        for sql in (
            "SELECT streampos.next_id(%s, 'w')",
            "SELECT streampos.frontier(%s)",
            "SELECT * FROM streampos.in_flight(%s)",
        ):
            err = expect_error(db, sql, (stream,), "55000")
            assert "shared_preload_libraries" in (err.diag.message_hint or ""), err.diag.message_hint
        db.close()
        # CREATE EXTENSION without the preload says so at once (a WARNING
        # with the way out), and succeeds: the token types work.
        with connect_raw("postgres") as admin:
            admin.execute("DROP DATABASE IF EXISTS streampos_no_preload")
            admin.execute("CREATE DATABASE streampos_no_preload")
        try:
            with connect_raw("streampos_no_preload") as fresh:
                notices = []
                # A notice's fields are readable only inside the handler.
                fresh.add_notice_handler(
                    lambda d: notices.append((d.severity_nonlocalized, d.message_primary, d.message_hint)))
                fresh.execute("CREATE EXTENSION streampos")
                # (The test server's postgresql.conf sets a setting that
                # exists only while preloading: PostgreSQL says it removes
                # it, as for any unknown streampos.* name.)
                warned = [n for n in notices if n[0] == "WARNING" and
                          "streampos.standby_wakeup_rmgr_id" not in n[1]]
                assert [n[1] for n in warned] == ["streampos is not in shared_preload_libraries"]
                assert "restart the server" in warned[0][2]
        finally:
            with connect_raw("postgres") as admin:
                admin.execute("DROP DATABASE IF EXISTS streampos_no_preload")
    finally:
        restart_server("fast")
    db = connect()
    assert frontier(db, stream) == 2
    assert next_ids(db, stream, "w", 1) == [3]
