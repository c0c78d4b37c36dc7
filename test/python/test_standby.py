"""A hot standby: allocation is refused (25006), and readers answer from the
durable positions, which replicate in commit order and are never ahead of
the rows the standby can see."""

import os
import random
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg

import pytest

import support
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
    server_settings,
    stored_positions,
    wait_until,
)
from test_ordered import answer as ordered_answer

# Beside the test server's port (scripts/test reserves PORT to PORT+49 for
# each suite it runs at once).
STANDBY_PORT = int(os.environ.get("STREAMPOS_STANDBY_PORT", support.PGPORT + 9))


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
        # A follower on the standby waits for what the standby replays (3
        # is the standby's frontier: 4 is "anything new"; none yet).
        assert one(replica, "SELECT streampos.wait_for(%s, 4, 100)", (stream,)) == 3

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
    consumers tells the lag the primary's does; a consumer's wait on the
    standby answers from what the standby replayed."""
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
        token = one(replica, "SELECT streampos.wait_for_consumer(%s, 'pusher', 100)::text", (stream,))
        assert token == one(replica, "SELECT streampos.current_token(%s)::text", (stream,))


# --------------------------------------------------------------- followers on the standby


def feed_table(primary, stream, writers=None):
    create_stream(primary, stream, writers=writers)
    primary.execute(f"CREATE TABLE {stream}_ev (id bigint PRIMARY KEY, instance_name text, body text)")
    primary.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, f"{stream}_ev"))


def insert_rows(conn, stream, writer, n=1, rollback=False):
    with conn.transaction():
        for _ in range(n):
            conn.execute(f"INSERT INTO {stream}_ev VALUES (streampos.next_id(%s, %s), %s, 'x')",
                         (stream, writer, writer))
        if rollback:
            raise psycopg.Rollback()


def follow_once(conn, stream, since, max_rows=100, timeout_ms=0, ordered=False):
    """One updates_json call: (token, limited, [row ids in ID order])."""
    return ordered_answer(conn, stream, since, ordered, max_rows, timeout_ms)


def replayed(replica, stream, frontier):
    return lambda: one(replica, "SELECT streampos.frontier(%s)", (stream,)) >= frontier


def test_a_follower_on_the_standby_is_woken_by_replay(connect, stream, standby):
    """A long-polling follower on the standby returns the row a primary
    commit wrote once the standby replays the worker's stored positions and
    its record: within about a store interval, not the standby's 1 s
    re-check (the primary logs the records: every test server sets
    streampos.standby_wakeup_rmgr_id). Five commits, each answered well
    inside the re-check interval."""
    primary = connect()
    feed_table(primary, stream)
    insert_rows(primary, stream, "w1")
    with server_settings({"streampos.position_interval_ms": "50"}), \
            connect_raw(port=standby["port"]) as replica:
        wait_until(replayed(replica, stream, 1), timeout=10, message="the standby to replay the first row")
        since, _, ids = follow_once(replica, stream, "0")
        assert ids == [1]
        # PostgreSQL 14 has no custom WAL resource managers: its standby's
        # followers look again every 100 ms instead.
        wakeups = int(one(replica, "SHOW server_version_num")) >= 150000
        assert (one(replica, "SELECT streampos.standby_wakeups_replayed()") > 0) == wakeups
        assert one(primary, "SELECT streampos.standby_wakeups_replayed()") == 0
        latencies = []
        with ThreadPoolExecutor(1) as pool:
            for k in range(5):
                waiting = pool.submit(follow_once, replica, stream, since, 100, 10000)
                time.sleep(0.3)  # the follower is asleep by now
                started = time.monotonic()
                insert_rows(primary, stream, "w1")
                since, _, ids = waiting.result(timeout=15)
                latencies.append(time.monotonic() - started)
                assert ids == [k + 2], ids
        print("standby follower latencies:", [round(x, 3) for x in latencies])
        assert max(latencies) < 0.5, latencies


def test_followers_on_the_standby_get_every_row_exactly_once(connect, stream, standby):
    """Writers commit and roll back on the primary while a follower and an
    ordered follower long-poll on the standby: after a drain, each got every
    committed row exactly once, the ordered one in ID order, and never a row
    the standby could not see (each answer's rows are below its token and
    visible in a snapshot taken after it)."""
    primary = connect()
    feed_table(primary, stream, writers=["w1", "w2", "w3"])
    stop = threading.Event()

    def writer(name, seed):
        rng = random.Random(seed)
        with connect_raw() as w:
            while not stop.is_set():
                insert_rows(w, stream, name, n=rng.randint(1, 3), rollback=rng.random() < 0.1)
                time.sleep(rng.random() * 0.01)

    def follower(ordered):
        got, since = [], "0"
        with connect_raw(port=standby["port"]) as replica:
            while not stop.is_set():
                since, _, ids = follow_once(replica, stream, since, 50, 500, ordered)
                got.extend(ids)
        return got, since

    with ThreadPoolExecutor(5) as pool:
        writers = [pool.submit(writer, f"w{k}", k) for k in (1, 2, 3)]
        followers = [pool.submit(follower, ordered) for ordered in (False, True)]
        time.sleep(4)
        stop.set()
        for w in writers:
            w.result(timeout=30)
        results = [f.result(timeout=30) for f in followers]
    committed = sorted(r[0] for r in rows(primary, f"SELECT id FROM {stream}_ev"))
    assert len(committed) > 100
    with connect_raw(port=standby["port"]) as replica:
        wait_until(lambda: one(replica, f"SELECT count(*) FROM {stream}_ev") == len(committed) and
                   replayed(replica, stream, committed[-1])(), timeout=15, message="the standby to catch up")
        for (got, since), ordered in zip(results, (False, True)):
            limited = True
            while limited:
                since, limited, ids = follow_once(replica, stream, since, 1000, 0, ordered)
                got.extend(ids)
            assert len(got) == len(set(got)), "a row delivered twice"
            assert sorted(got) == committed
            if ordered:
                assert got == sorted(got)


def test_a_token_in_a_lost_range_is_refused_on_the_standby(connect, stream, standby):
    """A standby has no registry: it reads the lost ranges from the
    replicated history marks, and a follower whose token lies in one is
    told to resynchronise (72000) as on a primary. A token ahead of what the
    standby replayed waits instead (it may only lag)."""
    primary = connect()
    feed_table(primary, stream)
    insert_rows(primary, stream, "w1", n=3)
    primary.execute("INSERT INTO streampos.history_marks (history, stream_name, have, ceiling) "
                    "VALUES (424242, %s, 10, 20)", (stream,))
    with connect_raw(port=standby["port"]) as replica:
        wait_until(lambda: one(replica, "SELECT count(*) FROM streampos.history_marks WHERE stream_name = %s",
                               (stream,)) == 1 and replayed(replica, stream, 3)(),
                   timeout=10, message="the standby to replay the mark")
        err = expect_error(replica, "SELECT streampos.updates_json(%s, '15', 10)", (stream,), sqlstate="72000")
        assert "not in this server's history" in str(err)
        expect_error(replica, "SELECT streampos.wait_for(%s, 16, 10)", (stream,), sqlstate="72000")
        # Ahead of the standby, outside any lost range: it waits (and times out).
        token, _, ids = follow_once(replica, stream, "30", 10, 100)
        assert (token, ids) == ("30", [])


def test_a_consumer_reads_on_the_standby_and_acknowledges_on_the_primary(connect, stream, standby):
    """The Python client's Consumer with read_conn: batches come from the
    standby, each is processed and acknowledged in a primary transaction;
    every committed row is processed exactly once, and a batch whose block
    raised is read again."""
    from streampos import Consumer

    primary = connect()
    feed_table(primary, stream, writers=["w1", "w2"])
    primary.execute(f"CREATE TABLE {stream}_done (id bigint PRIMARY KEY)")
    primary.execute("SELECT streampos.register_consumer(%s, 'pusher')", (stream,))
    for k in range(30):
        insert_rows(primary, stream, f"w{k % 2 + 1}", n=2, rollback=k % 7 == 3)
    committed = sorted(r[0] for r in rows(primary, f"SELECT id FROM {stream}_ev"))
    with connect_raw(port=standby["port"]) as replica, connect_raw() as work:
        consumer = Consumer(work, stream, "pusher", max_rows=7, timeout_ms=2000, read_conn=replica)
        failed_once = False
        done = 0
        while done < len(committed):
            try:
                with consumer.batch() as batch:
                    ids = [int(r[0]) for t in batch.tables.values() for r in t.rows]
                    for i in ids:
                        work.execute(f"INSERT INTO {stream}_done VALUES (%s)", (i,))
                    if ids and not failed_once:
                        failed_once = True
                        raise RuntimeError("the block fails once")
                done += len(ids)
            except RuntimeError:
                pass
        assert failed_once
    assert sorted(r[0] for r in rows(primary, f"SELECT id FROM {stream}_done")) == committed
    position = one(primary, "SELECT position::text FROM streampos.consumer_positions "
                            "WHERE stream_name = %s AND consumer_name = 'pusher'", (stream,))
    assert position == one(primary, "SELECT streampos.current_token(%s)::text", (stream,))


def test_a_standby_follower_gets_every_row_once_across_replay_conflicts(connect, stream, standby):
    """Replay conflicts on the standby (hot_standby_feedback off,
    max_standby_streaming_delay 100 ms; the primary updates and vacuums a
    table all the time, so replay removes row versions the standby's
    snapshots may still see): followers on the standby, asking again with
    the same token when a conflict cancelled their call (40001) or ended
    their session, get every committed row exactly once. (Here, hundreds of
    calls are cancelled in 5 s: replay lags behind the churn, so its grace
    time is spent before a call's snapshot is taken.)"""
    primary = connect()
    feed_table(primary, stream, writers=["w1", "w2"])
    primary.execute(f"CREATE TABLE {stream}_churn (k int PRIMARY KEY, v int)")
    primary.execute(f"INSERT INTO {stream}_churn SELECT k, 0 FROM generate_series(1, 50) k")
    conflicts = ("SELECT confl_snapshot + confl_lock + confl_bufferpin + confl_deadlock "
                 "FROM pg_stat_database_conflicts WHERE datname = current_database()")
    with connect_raw(port=standby["port"]) as replica:
        replica.execute("ALTER SYSTEM SET max_standby_streaming_delay = '100ms'")
        replica.execute("SELECT pg_reload_conf()")
        conflicts_before = one(replica, conflicts)
    stop = threading.Event()
    cancelled = []

    def writer(name, seed):
        rng = random.Random(seed)
        with connect_raw() as w:
            while not stop.is_set():
                insert_rows(w, stream, name, n=rng.randint(1, 2), rollback=rng.random() < 0.1)
                time.sleep(rng.random() * 0.01)

    def churn():
        with connect_raw() as c:
            while not stop.is_set():
                c.execute(f"UPDATE {stream}_churn SET v = v + 1")
                c.execute(f"VACUUM {stream}_churn")
                time.sleep(0.02)

    def follower(ordered):
        got, since = [], "0"
        replica = connect_raw(port=standby["port"])
        try:
            while not stop.is_set():
                try:
                    since, _, ids = follow_once(replica, stream, since, 50, 1000, ordered)
                    got.extend(ids)
                except psycopg.errors.SerializationFailure as e:
                    # Cancelled by replay: ask again from the same token.
                    cancelled.append(type(e).__name__)
                except psycopg.OperationalError as e:
                    # Its session ended by replay (FATAL): reconnect, as a
                    # client's follower does, and ask again from the same token.
                    cancelled.append(type(e).__name__)
                    replica.close()
                    replica = connect_raw(port=standby["port"])
        finally:
            replica.close()
        return got, since

    try:
        with ThreadPoolExecutor(6) as pool:
            writers = [pool.submit(writer, f"w{k}", k) for k in (1, 2)]
            churner = pool.submit(churn)
            followers = [pool.submit(follower, ordered) for ordered in (False, True, False)]
            time.sleep(5)
            stop.set()
            for f in writers + [churner]:
                f.result(timeout=30)
            results = [f.result(timeout=30) for f in followers]
        committed = sorted(r[0] for r in rows(primary, f"SELECT id FROM {stream}_ev"))
        assert len(committed) > 100
        with connect_raw(port=standby["port"]) as replica:
            wait_until(lambda: one(replica, f"SELECT count(*) FROM {stream}_ev") == len(committed) and
                       replayed(replica, stream, committed[-1])(), timeout=15,
                       message="the standby to catch up")
            for (got, since), ordered in zip(results, (False, True, False)):
                limited = True
                while limited:
                    since, limited, ids = follow_once(replica, stream, since, 1000, 0, ordered)
                    got.extend(ids)
                assert len(got) == len(set(got)), "a row delivered twice"
                assert sorted(got) == committed, "a row missed"
                if ordered:
                    assert got == sorted(got)
            # The load made conflicts (else the test proves nothing of them).
            print(f"replay conflicts: {one(replica, conflicts) - conflicts_before}, calls ended by them: "
                  f"{sorted((k, cancelled.count(k)) for k in set(cancelled))}")
            assert one(replica, conflicts) > conflicts_before, "no replay conflict happened"
            assert cancelled, "no follower's call was ended by a conflict"
    finally:
        with connect_raw(port=standby["port"]) as replica:
            replica.execute("ALTER SYSTEM RESET max_standby_streaming_delay")
            replica.execute("SELECT pg_reload_conf()")
