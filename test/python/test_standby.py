"""A hot standby: allocation is refused (25006), and readers answer from the
durable positions, which replicate in commit order and are never ahead of
the rows the standby can see."""

import os
import shutil
import subprocess

import pytest

from support import (
    PG_BIN,
    commit_ids,
    PGDATA,
    connect_raw,
    create_stream,
    expect_error,
    flush_wal,
    one,
    rows,
    stored_positions,
    wait_until,
)

STANDBY_PORT = int(os.environ.get("STREAMPOS_STANDBY_PORT", "54339"))


def as_postgres(args):
    return (["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []) + args


@pytest.fixture(scope="module")
def standby(database):
    if not PGDATA:
        pytest.skip("STREAMPOS_PGDATA is not set")
    path = PGDATA.rstrip("/") + "-standby"
    shutil.rmtree(path, ignore_errors=True)
    env = dict(os.environ, RUST_BACKTRACE="0", RUST_LIB_BACKTRACE="0")
    port = os.environ.get("STREAMPOS_PGPORT", "54330")
    subprocess.run(
        as_postgres([os.path.join(PG_BIN, "pg_basebackup"), "-h", "127.0.0.1", "-p", port, "-U", "postgres",
                     "-D", path, "-R", "-X", "stream", "-c", "fast"]),
        check=True, capture_output=True, env=env, timeout=120,
    )
    subprocess.run(
        as_postgres([os.path.join(PG_BIN, "pg_ctl"), "-D", path, "-l", os.path.join(path, "server.log"),
                     "-o", f"-p {STANDBY_PORT} -c hot_standby=on", "-w", "-t", "60", "start"]),
        check=True, capture_output=True, env=env, timeout=120,
    )
    yield dict(port=STANDBY_PORT)
    subprocess.run(
        as_postgres([os.path.join(PG_BIN, "pg_ctl"), "-D", path, "-m", "immediate", "-w", "stop"]),
        capture_output=True, env=env, timeout=120,
    )
    shutil.rmtree(path, ignore_errors=True)


def test_standby_reads_stored_positions_and_refuses_allocation(connect, stream, standby):
    primary = connect()
    create_stream(primary, stream, writers=["a", "b"])
    primary.execute(f"CREATE TABLE {stream} (id bigint PRIMARY KEY, instance_name text)")
    for w in ["a", "b", "a"]:
        primary.execute(
            f"INSERT INTO {stream} VALUES (streampos.next_id(%s, %s), %s)", (stream, w, w)
        )
    # A writer holding an ID in flight on the primary: the standby cannot see
    # it, and its sequence already counts it.
    holder = connect()
    holder.execute("BEGIN")
    held = one(holder, "SELECT streampos.next_id(%s, 'b')", (stream,))
    holder.execute(f"INSERT INTO {stream} VALUES (%s, 'b')", (held,))
    # The in-flight ID is durable once any commit flushed the WAL past its
    # sequence record (another writer's, in real life); until then it holds
    # back every writer.
    flush_wal(primary)
    # An idle writer is at the maximum allocated ID; b is held back.
    expected = {"a": 4, "b": 3}
    wait_until(
        lambda: stored_positions(primary, stream) == expected,
        timeout=10,
        message=f"stored positions {expected} (have {stored_positions(primary, stream)})",
    )
    a_id = one(primary, "SELECT streampos.instance_id('a')")

    with connect_raw(port=standby["port"]) as replica:
        wait_until(
            lambda: one(replica, "SELECT count(*) FROM streampos.stream_positions WHERE stream_name = %s",
                        (stream,)) == 2,
            timeout=10,
            message="the standby to replay the positions",
        )
        # Never past the in-flight ID, although the standby's sequence is.
        assert one(replica, "SELECT streampos.frontier(%s)", (stream,)) == 3
        assert one(replica, "SELECT streampos.writer_position(%s, 'b')", (stream,)) == 3
        assert one(replica, "SELECT streampos.current_room_token(%s)::text", (stream,)) == f"m3~{a_id}.4"
        # Every row up to the frontier is visible on the standby.
        assert one(replica, f"SELECT count(*) FROM {stream} WHERE id <= streampos.frontier(%s)", (stream,)) == 3
        expect_error(replica, "SELECT streampos.next_id(%s, 'a')", (stream,), sqlstate="25006")
        expect_error(replica, "SELECT streampos.wait_for(%s, 10, 100)", (stream,), sqlstate="0A000")

        holder.execute("COMMIT")
        wait_until(lambda: stored_positions(primary, stream) == {"a": 4, "b": 4}, message="positions after commit")
        wait_until(
            lambda: one(replica, "SELECT streampos.frontier(%s)", (stream,)) == 4,
            timeout=10,
            message="the standby frontier to advance",
        )
        assert one(replica, f"SELECT count(*) FROM {stream} WHERE id <= 4") == 4


def commit_one(conn, stream, writer):
    """One ID committed durably (its commit writes WAL and flushes)."""
    return commit_ids(conn, stream, writer)[0]


def frontier_is(replica, stream, value):
    return lambda: one(replica, "SELECT streampos.frontier(%s)", (stream,)) == value


def test_a_new_writers_first_transaction_holds_the_standby_back(connect, stream, standby):
    """0.2.0's standby took the lowest stored position as its frontier, and
    stored positions name only writers the position worker can name: a
    writer whose first transaction (which creates its name) still holds ID
    11 was in none, and the standby answered 21 while the primary answered
    10 (the row appeared later, below a frontier already given out)."""
    primary = connect()
    create_stream(primary, stream)
    for _ in range(10):
        commit_one(primary, stream, "old")
    holder = connect()
    holder.execute("BEGIN")
    new_writer = f"{stream}_new"
    assert one(holder, "SELECT streampos.next_id(%s, %s)", (stream, new_writer)) == 11
    for _ in range(10):
        commit_one(primary, stream, "other")
    assert one(primary, "SELECT streampos.frontier(%s)", (stream,)) == 10
    flush_wal(primary)
    with connect_raw(port=standby["port"]) as replica:
        # The worker stores (other: 21, old: 21) and the frontier 10.
        wait_until(
            lambda: one(replica, "SELECT max(stream_id) FROM streampos.stream_positions WHERE stream_name = %s",
                        (stream,)) == 21,
            timeout=10,
            message="the standby to replay the positions",
        )
        assert one(replica, "SELECT streampos.frontier(%s)", (stream,)) == 10
        assert one(replica, "SELECT streampos.current_token(%s)::text", (stream,)).startswith("m10~")
        holder.execute("COMMIT")
        wait_until(frontier_is(replica, stream, 21), timeout=10, message="the standby to catch up")


def test_a_writer_removed_while_it_holds_an_id_holds_the_standby_back(connect, stream, standby):
    """set_writers removing a writer that holds an ID: its stored position
    goes, the others' stay ahead; the standby's frontier must stay below
    the held ID all the same."""
    primary = connect()
    create_stream(primary, stream, writers=["a", "b"])
    for _ in range(3):
        commit_one(primary, stream, "a")
    holder = connect()
    holder.execute("BEGIN")
    assert one(holder, "SELECT streampos.next_id(%s, 'b')", (stream,)) == 4
    primary.execute("SELECT streampos.set_writers(%s, ARRAY['a'])", (stream,))
    for _ in range(3):
        commit_one(primary, stream, "a")
    assert one(primary, "SELECT streampos.frontier(%s)", (stream,)) == 3
    flush_wal(primary)
    with connect_raw(port=standby["port"]) as replica:
        wait_until(
            lambda: rows(replica, "SELECT instance_name, stream_id FROM streampos.stream_positions "
                                  "WHERE stream_name = %s", (stream,)) == [("a", 7)],
            timeout=10,
            message="the standby to replay the positions",
        )
        assert one(replica, "SELECT streampos.frontier(%s)", (stream,)) == 3
        holder.execute("COMMIT")
        wait_until(frontier_is(replica, stream, 7), timeout=10, message="the standby to catch up")


def test_a_standby_follows_more_than_64_writers(connect, stream, standby):
    """0.2.0's standby stopped making progress with more than 64 writers on
    a stream: it stayed at stale stored positions indefinitely."""
    primary = connect()
    create_stream(primary, stream)
    with connect_raw(port=standby["port"]) as replica:
        for rnd in range(3):
            for k in range(80):
                commit_one(primary, stream, f"w{k}")
            top = 80 * (rnd + 1)
            wait_until(frontier_is(replica, stream, top), timeout=10,
                       message=f"the standby frontier to reach {top}")
        assert one(replica, "SELECT count(*) FROM streampos.writer_positions(%s)", (stream,)) == 80


def test_a_standby_tells_a_consumers_lag_from_the_replicated_marks(connect, stream, standby):
    """Consumer positions and frontier marks are rows: the standby's view
    consumers tells the lag the primary's does; waiting is for the primary
    (0A000, as wait_for)."""
    primary = connect()
    create_stream(primary, stream, writers=["a"])
    primary.execute("SELECT streampos.register_consumer(%s, 'pusher')", (stream,))
    commit_one(primary, stream, "a")
    wait_until(
        lambda: one(primary, "SELECT count(*) FROM streampos.frontier_marks WHERE stream_name = %s", (stream,)) == 1,
        timeout=10,
        message="the worker's mark",
    )
    with connect_raw(port=standby["port"]) as replica:
        wait_until(
            lambda: one(replica, "SELECT count(*) FROM streampos.frontier_marks WHERE stream_name = %s",
                        (stream,)) == 1 and frontier_is(replica, stream, 1)(),
            timeout=10,
            message="the standby to replay the mark and the frontier",
        )
        query = ("SELECT lag_ids, extract(epoch FROM now() - lag_time)::float8 FROM streampos.consumers "
                 "WHERE stream_name = %s AND consumer_name = 'pusher'")
        on_primary, on_standby = rows(primary, query, (stream,))[0], rows(replica, query, (stream,))[0]
        assert on_primary[0] == on_standby[0] == 1
        # The same mark: lag_time counts from the same moment.
        assert on_standby[1] == pytest.approx(on_primary[1], abs=0.01)
        expect_error(replica, "SELECT streampos.wait_for_consumer(%s, 'pusher', 100)", (stream,), sqlstate="0A000")
