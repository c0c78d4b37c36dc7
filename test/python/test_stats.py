"""Statistics (issue 21): streampos.stat_streams, streampos.stat_registry
and streampos.stat_reset(), counted in shared memory since start-up, with
real concurrent sessions; and the position worker that leaves when it has
nothing to do."""

import threading
import time
import uuid

import psycopg
import pytest

from support import (
    backend_pid,
    commit_ids,
    connect_raw,
    create_stream,
    ensure_login_role,
    expect_error,
    next_id,
    one,
    restart_server,
    rows,
    scratch_database,
    wait_until,
)


def stat(conn, stream):
    """The stream's row of streampos.stat_streams, as a dict."""
    cur = conn.execute("SELECT * FROM streampos.stat_streams WHERE stream_name = %s", (stream,))
    names = [d.name for d in cur.description]
    row = cur.fetchone()
    assert row is not None, f"no statistics for {stream}"
    return dict(zip(names, row))


def registry_stat(conn):
    cur = conn.execute("SELECT * FROM streampos.stat_registry")
    return dict(zip([d.name for d in cur.description], cur.fetchone()))


def counters(conn, stream):
    s = stat(conn, stream)
    return s["ids_allocated"], s["xact_commit"], s["xact_rollback"]


def test_counters_count_ids_commits_and_rollbacks(connect, db, stream):
    create_stream(db, stream)
    assert counters(db, stream) == (0, 0, 0)
    w = connect()
    commit_ids(w, stream, "w1")  # 1 ID, a commit
    commit_ids(w, stream, "w2", 5)  # 5 IDs, a commit
    with pytest.raises(psycopg.errors.RaiseException):
        with w.transaction():  # 1 ID, a rollback
            next_id(w, stream, "w1")
            w.execute("DO $$ BEGIN RAISE 'roll back'; END $$")
    with w.transaction():  # two writers, one transaction: 2 IDs, one commit
        next_id(w, stream, "w1")
        next_id(w, stream, "w2")
    with w.transaction():  # a rolled-back savepoint's ID is the transaction's
        w.execute("SAVEPOINT a")
        next_id(w, stream, "w1")
        w.execute("ROLLBACK TO SAVEPOINT a")
    held = one(w, "SELECT streampos.hold_ids(%s, 'w3', 2)", (stream,))  # 2 IDs, a commit
    w.execute("SELECT streampos.release_ids(%s, %s)", (stream, held))  # no allocation
    assert counters(db, stream) == (1 + 5 + 1 + 2 + 1 + 2, 5, 1)
    # A session terminated in the middle of its transaction rolls it back.
    doomed = connect()
    doomed.execute("BEGIN")
    next_id(doomed, stream, "w1")
    db.execute("SELECT pg_terminate_backend(%s)", (backend_pid(doomed),))
    wait_until(lambda: counters(db, stream) == (13, 5, 2), message="the terminated transaction's rollback")


def test_in_flight_lag_and_who_holds_the_stream_back(connect, db, stream):
    create_stream(db, stream)
    holder = connect()
    holder.execute("BEGIN")
    held_id = next_id(holder, stream, "slow_writer")
    w = connect()
    commit_ids(w, stream, "fast_writer", 3)
    time.sleep(1.2)
    s = stat(db, stream)
    assert s["max_allocated"] == held_id + 3
    assert s["frontier"] == held_id - 1
    assert s["frontier_lag_ids"] == 4
    # The worker saw the frontier stop when the holder allocated.
    assert 0.6 <= s["frontier_lag_seconds"] < 10
    assert s["ids_in_flight"] == 1
    assert 1.0 <= s["oldest_in_flight_seconds"] < 10
    assert s["oldest_in_flight_pid"] == backend_pid(holder)
    assert s["oldest_in_flight_instance"] == "slow_writer"
    # Another role sees how long, not which backend (as in in_flight()).
    role = ensure_login_role("streampos_stats_reader")
    other = connect(user=role)
    seen = stat(other, stream)
    assert seen["oldest_in_flight_pid"] is None
    assert seen["oldest_in_flight_instance"] == "slow_writer"
    assert seen["oldest_in_flight_seconds"] >= 1.0
    assert seen["frontier_lag_ids"] == 4
    holder.execute("COMMIT")
    s = stat(db, stream)
    assert (s["frontier_lag_ids"], s["frontier_lag_seconds"], s["ids_in_flight"]) == (0, 0, 0)
    assert s["oldest_in_flight_seconds"] is None and s["oldest_in_flight_pid"] is None


def test_followers_waiting_are_counted_until_they_leave(connect, db, stream, pool):
    create_stream(db, stream)
    commit_ids(db, stream, "w1")
    target = one(db, "SELECT streampos.next_id(%s, 'w1')", (stream,))  # committed: 2
    held = connect()
    held.execute("BEGIN")
    next_id(held, stream, "w1")  # 3, in flight
    waiters = [connect() for _ in range(4)]
    woken = [pool.submit(w.execute, "SELECT streampos.wait_for(%s, 3, 20000)", (stream,)) for w in waiters[:2]]
    terminated = pool.submit(waiters[2].execute, "SELECT streampos.updates(%s, %s, timeout_ms => 20000)",
                             (stream, str(target)))
    cancelled = pool.submit(waiters[3].execute, "SELECT streampos.wait_for(%s, 3, 20000)", (stream,))
    wait_until(lambda: stat(db, stream)["followers_waiting"] == 4, message="four followers waiting")
    # Cancelled (an ERROR) and terminated (a FATAL) followers count
    # themselves out.
    db.execute("SELECT pg_cancel_backend(%s)", (waiters[3].info.backend_pid,))
    with pytest.raises(psycopg.errors.QueryCanceled):
        cancelled.result(timeout=10)
    wait_until(lambda: stat(db, stream)["followers_waiting"] == 3, message="the cancelled follower out")
    db.execute("SELECT pg_terminate_backend(%s)", (waiters[2].info.backend_pid,))
    wait_until(lambda: stat(db, stream)["followers_waiting"] == 2, message="the terminated follower out")
    held.execute("COMMIT")
    wait_until(lambda: stat(db, stream)["followers_waiting"] == 0, message="the woken followers out")
    # Every client call ended before the connections are closed (closing
    # one while its thread still reads the answer crashed the client).
    for future in woken:
        future.result(timeout=10)
    with pytest.raises(psycopg.OperationalError):
        terminated.result(timeout=10)


def test_store_lag_while_the_worker_cannot_store(connect, db, stream):
    """An operator's lock on stream_positions: the worker does not wait for
    it (nor log anything), the stored positions trail, and the statistics
    say by how much and since when; once it is gone the next pass stores."""
    create_stream(db, stream)
    commit_ids(db, stream, "w1")
    wait_until(lambda: stat(db, stream)["store_lag_ids"] == 0 and stat(db, stream)["last_store"],
               message="the first store")
    stored_at = stat(db, stream)["last_store"]
    locker = connect()
    locker.execute("BEGIN")
    locker.execute("LOCK TABLE streampos.stream_positions IN ACCESS EXCLUSIVE MODE")
    try:
        commit_ids(db, stream, "w1", 2)
        time.sleep(1.5)
        s = stat(db, stream)
        assert s["frontier"] == 3 and s["stored_frontier"] == 1
        assert s["store_lag_ids"] == 2
        assert s["store_lag_seconds"] >= 1.0
        assert s["last_store"] == stored_at
        # The worker is not stuck behind the lock: it still prunes and
        # stores nothing else meanwhile, and holds no lock anyone waits for.
        assert rows(
            db,
            "SELECT pid FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
            "WHERE NOT l.granted AND a.backend_type = 'streampos position worker'",
        ) == []
    finally:
        locker.execute("ROLLBACK")
    wait_until(lambda: stat(db, stream)["store_lag_ids"] == 0, message="the store after the lock")
    s = stat(db, stream)
    assert s["store_lag_seconds"] == 0 and s["last_store"] > stored_at and s["stored_frontier"] == 3


def test_registry_statistics(connect, db, stream):
    create_stream(db, stream)
    commit_ids(db, stream, "w1")
    r = registry_stat(db)
    assert r["streams_max"] == one(db, "SELECT current_setting('streampos.max_streams')::int")
    assert 1 <= r["streams_loaded"] <= r["streams_used"] <= r["streams_max"]
    assert r["ring_size"] >= 65536
    assert 0 <= r["ring_used"] <= r["ring_used_max"] and r["ring_used_max"] >= 1
    assert r["position_workers"] >= 1
    # Readers that copy while writers commit throw some copies away.
    before = r["reader_retries"] + r["reader_lock_fallbacks"]
    for _ in range(5):
        stop = threading.Event()

        def write(n):
            c = connect()
            while not stop.is_set():
                c.execute("SELECT streampos.next_id(%s, %s)", (stream, f"w{n}"))

        def read():
            c = connect()
            while not stop.is_set():
                c.execute("SELECT streampos.frontier(%s)", (stream,))

        threads = [threading.Thread(target=write, args=(n,)) for n in range(3)]
        threads += [threading.Thread(target=read) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        stop.set()
        for t in threads:
            t.join()
        r = registry_stat(db)
        if r["reader_retries"] + r["reader_lock_fallbacks"] > before:
            break
    assert r["reader_retries"] + r["reader_lock_fallbacks"] > before


def test_stat_reset_is_not_for_public_and_starts_the_counters_again(connect, db, stream):
    create_stream(db, stream)
    commit_ids(db, stream, "w1", 3)
    role = ensure_login_role("streampos_stats_reader")
    other = connect(user=role)
    expect_error(other, "SELECT streampos.stat_reset()", sqlstate="42501")
    assert counters(db, stream) == (3, 1, 0)
    assert stat(db, stream)["stats_reset"] is None or stat(db, stream)["stats_reset"]
    db.execute("SELECT streampos.stat_reset()")
    s = stat(db, stream)
    assert (s["ids_allocated"], s["xact_commit"], s["xact_rollback"]) == (0, 0, 0)
    assert s["stats_reset"] is not None
    r = registry_stat(db)
    assert r["stats_reset"] is not None and r["ring_folds"] == 0 and r["reader_retries"] == 0
    commit_ids(db, stream, "w1")
    assert counters(db, stream) == (1, 1, 0)


def worker_pids(conn, dbname):
    return [
        pid
        for (pid,) in rows(
            conn,
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'streampos position worker' "
            "AND datname = %s",
            (dbname,),
        )
    ]


def test_the_worker_leaves_when_idle_and_the_next_allocation_brings_it_back():
    """About 2 s with nothing to do (nothing in flight, no generation
    moved, nothing to store): the worker leaves, so that DROP DATABASE
    works; a transaction in flight keeps it; the next allocation starts a
    new one, which stores."""
    with scratch_database(f"streampos_idle_{uuid.uuid4().hex[:6]}") as name, connect_raw(name) as c:
        create_stream(c, "events")
        commit_ids(c, "events", "w1")
        assert wait_until(lambda: worker_pids(c, name), message="the worker")
        wait_until(lambda: not worker_pids(c, name), timeout=5, message="the idle worker to leave")
        with connect_raw(name) as holder:
            holder.execute("BEGIN")
            next_id(holder, "events", "w1")
            first = wait_until(lambda: worker_pids(c, name), message="a new worker")
            time.sleep(3)
            assert worker_pids(c, name) == first  # kept by the transaction in flight
            holder.execute("COMMIT")
        wait_until(lambda: one(c, "SELECT stream_id FROM streampos.stream_frontiers "
                                  "WHERE stream_name = 'events'") == 2, message="the store")
        wait_until(lambda: not worker_pids(c, name), timeout=5, message="the worker to leave again")


@pytest.mark.restarts_server
def test_statistics_start_from_zero_after_a_restart(connect, stream):
    c = connect()
    create_stream(c, stream)
    commit_ids(c, stream, "w1", 2)
    c.execute("SELECT streampos.stat_reset()")
    commit_ids(c, stream, "w1", 2)
    assert counters(c, stream) == (2, 1, 0)
    restart_server(mode="fast")
    with connect_raw() as after:
        s = stat(after, stream)
        assert (s["ids_allocated"], s["xact_commit"], s["xact_rollback"]) == (0, 0, 0)
        assert s["stats_reset"] is None and s["last_store"] is None
        assert s["frontier"] == 4
        assert registry_stat(after)["stats_reset"] is None
