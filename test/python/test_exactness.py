"""Exactness: one answer per portal and snapshot, never backwards, and a
permanent sequence. Each test reproduces a way 0.1.0 broke "no missed rows"
or "never backwards" with real sessions (docs/design.md, "One answer per
snapshot" and "Never backwards").

Tests that need a small finished ring run on a cluster of their own
(cluster.py), as the ring's size is fixed at start-up.
"""

import threading
import time

import pytest

from cluster import Clusters
from support import commit_ids, create_stream, expect_error, frontier, one, rows






# ----------------------------------------------------------------- portals


@pytest.mark.parametrize("how", ["declare", "named_cursor"])
def test_cursor_answers_the_same_across_fetches(connect, db, stream, how):
    """Rows stored in the order 4, 1, 3 and ID 2 in flight: a cursor over the
    rows at or below frontier() fetches one row (the frontier is 1, so row 4
    was filtered out), the holder of 2 aborts, and the rest of the cursor
    must go on with frontier 1 (0.1.0 recomputed it at each FETCH and
    returned row 3 with frontier 4: a position past row 4, which the cursor
    never returned)."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint)")
    assert commit_ids(db, stream, "w") == [1]
    holder = connect()
    holder.execute("BEGIN")
    assert one(holder, "SELECT streampos.next_id(%s, 'w')", (stream,)) == 2
    assert commit_ids(db, stream, "w", 2) == [3, 4]
    for i in (4, 1, 3):
        db.execute(f"INSERT INTO {table} VALUES (%s)", (i,))
    query = (
        f"SELECT id, streampos.frontier(%s) FROM {table} "
        f"WHERE id <= streampos.frontier(%s)"
    )
    reader = connect()
    reader.execute("SET enable_indexscan = off")
    got = []
    with reader.transaction():
        if how == "declare":
            reader.execute(f"DECLARE c CURSOR FOR {query}", (stream, stream))
            got += reader.execute("FETCH 1 FROM c").fetchall()
            holder.execute("ROLLBACK")
            assert frontier(db, stream) == 4
            got += reader.execute("FETCH ALL FROM c").fetchall()
        else:
            with reader.cursor(name="exactness") as cur:
                cur.itersize = 1
                cur.execute(query, (stream, stream))
                got.append(cur.fetchone())
                holder.execute("ROLLBACK")
                assert frontier(db, stream) == 4
                got += cur.fetchall()
    answers = {f for _, f in got}
    assert answers == {1}, f"one cursor, several frontiers: {got}"
    assert sorted(i for i, _ in got) == [1]


def test_more_than_sixteen_streams_in_one_statement(connect, db, stream):
    """One statement reads 17 streams (0.1.0 kept 16 answers per statement);
    the first stream's holder aborts in the middle: both reads of the first
    stream in that statement answer the same."""
    names = [f"{stream}_{k}" for k in range(17)]
    for n in names:
        create_stream(db, n)
        commit_ids(db, n, "w")
    holder = connect()
    holder.execute("BEGIN")
    assert one(holder, "SELECT streampos.next_id(%s, 'w')", (names[0],)) == 2
    commit_ids(db, names[0], "w")
    reader = connect()
    result = {}

    def read():
        result["row"] = reader.execute(
            "SELECT streampos.frontier(%s), pg_sleep(0.5), "
            "(SELECT array_agg(streampos.frontier(n)) FROM unnest(%s::text[]) n), "
            "streampos.frontier(%s)",
            (names[0], names, names[0]),
        ).fetchone()

    t = threading.Thread(target=read)
    t.start()
    time.sleep(0.2)
    holder.execute("ROLLBACK")
    t.join(timeout=30)
    first, _, all_, last = result["row"]
    assert first == last == all_[0] == 1, result["row"]
    assert frontier(db, names[0]) == 3


def test_imported_snapshots_with_the_same_xmin_and_xmax(connect, db, stream):
    """Two REPEATABLE READ transactions in one simple-query message import
    two snapshots with the same xmin and xmax, exported before and after a
    commit inside that range: each gets the answer for its own snapshot
    (0.1.0 gave the second the first's)."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint)")
    # Another transaction completing between the two exports (the position
    # worker writes after every advance) moves xmax: try again.
    for attempt in range(10):
        x, y, z = connect(), connect(), connect()
        x.execute("BEGIN")
        one(x, "SELECT pg_current_xact_id()")  # the oldest running xid: xmin
        y.execute("BEGIN")
        y_id = one(y, "SELECT streampos.next_id(%s, 'w')", (stream,))
        y.execute(f"INSERT INTO {table} VALUES (%s)", (y_id,))
        with z.transaction():  # a later xid completes: the xmax
            z_id = one(z, "SELECT streampos.next_id(%s, 'w')", (stream,))
            z.execute(f"INSERT INTO {table} VALUES (%s)", (z_id,))
        e1, e2 = connect(), connect()
        e1.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        s1 = one(e1, "SELECT pg_export_snapshot()")
        y.execute("COMMIT")  # below the latest completed xid: xmax does not move
        e2.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        s2 = one(e2, "SELECT pg_export_snapshot()")
        bounds = [
            one(e, "SELECT ARRAY[pg_snapshot_xmin(pg_current_snapshot())::text::bigint, "
                   "pg_snapshot_xmax(pg_current_snapshot())::text::bigint]")
            for e in (e1, e2)
        ]
        if bounds[0] == bounds[1]:
            break
        for c in (x, e1, e2):
            c.execute("ROLLBACK")
        db.execute(f"DELETE FROM {table}")
    else:
        pytest.fail("could not get two snapshots with the same xmin and xmax")
    # The IDs of this attempt: y's in flight for s1, finished for s2.
    lo = min(y_id, z_id) - 1
    reader = connect()
    cur = reader.cursor()
    cur.execute(
        f"BEGIN ISOLATION LEVEL REPEATABLE READ; SET TRANSACTION SNAPSHOT '{s1}'; "
        f"SELECT streampos.frontier('{stream}'), "
        f"(SELECT count(*) FROM {table} WHERE id <= streampos.frontier('{stream}')); COMMIT; "
        f"BEGIN ISOLATION LEVEL REPEATABLE READ; SET TRANSACTION SNAPSHOT '{s2}'; "
        f"SELECT streampos.frontier('{stream}'), "
        f"(SELECT count(*) FROM {table} WHERE id <= streampos.frontier('{stream}')); COMMIT"
    )
    results = []
    while True:
        if cur.description is not None:
            results.extend(cur.fetchall())
        if not cur.nextset():
            break
    assert results == [(lo, 0), (lo + 2, 2)], results
    for c in (x, e1, e2):
        c.execute("ROLLBACK")


# ------------------------------------------------------- the finished ring


SMALL_RING = dict(
    max_connections=12,
    max_worker_processes=4,
    autovacuum_max_workers=1,
    max_wal_senders=0,
    max_replication_slots=0,
    wal_level="minimal",
    streampos__finished_ring_size=16,
    streampos__max_streams_per_transaction=1,
)


@pytest.fixture(scope="module")
def small_ring():
    """A cluster whose finished ring holds a few dozen entries (at least one
    more than every backend slot together), so that it folds quickly."""
    with Clusters() as clusters:
        yield clusters.node(**SMALL_RING)


def ring_capacity(node):
    with node.connect() as c:
        slots = one(c, "SELECT current_setting('max_connections')::int "
                       "+ current_setting('autovacuum_max_workers')::int + 1 "
                       "+ current_setting('max_worker_processes')::int "
                       "+ current_setting('max_wal_senders')::int")
    return max(16, slots + 1)


def test_frontier_never_goes_back_across_ring_folds(small_ring):
    """N holds a long xid; W1 commits ID 1, T (no allocation) starts, W2
    commits ID 2; the ring fills; a REPEATABLE READ transaction reads F; two
    more commits fold W1 and W2 into the summary, whose xid range covers T;
    T commits. The same transaction's next statement, and fresh snapshots,
    must still read at least F (0.1.0 read 0: it asked whether T had
    committed at read time)."""
    node = small_ring
    with node.connect() as admin:
        admin.execute("SELECT streampos.create_stream('fold')")
    n, w, t, rr, fresh = (node.connect() for _ in range(5))
    n.execute("BEGIN")
    one(n, "SELECT pg_current_xact_id()")
    assert commit_ids(w, "fold", "w") == [1]
    t.execute("BEGIN")
    one(t, "SELECT pg_current_xact_id()")
    assert commit_ids(w, "fold", "w") == [2]
    for _ in range(ring_capacity(node) - 2):
        commit_ids(w, "fold", "w")
    rr.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    f = frontier(rr, "fold")
    assert f >= 2
    for _ in range(4):
        commit_ids(w, "fold", "w")
    t.execute("COMMIT")
    assert frontier(rr, "fold") >= f
    assert frontier(fresh, "fold") >= f
    assert one(rr, "SELECT max(x) FROM (SELECT streampos.frontier('fold') x) s") >= f
    rr.execute("COMMIT")
    n.execute("COMMIT")
    assert frontier(fresh, "fold") == one(fresh, "SELECT streampos.max_allocated('fold')")
    for c in (n, w, t, rr, fresh):
        c.close()


def test_a_token_ack_accepted_is_not_past_the_same_snapshots_frontier_after_a_fold(small_ring):
    """As above, with `ack` the REPEATABLE READ transaction's first read:
    its check of the token against the caller's frontier is an answer for
    the snapshot, and the same snapshot must not be told less after the
    ring folds (an adversary's review: an ack checked against an answer it
    did not keep accepted 20, and the same transaction then read a
    frontier of 0 and refused the same ack)."""
    node = small_ring
    with node.connect() as admin:
        admin.execute("SELECT streampos.create_stream('foldack')")
        admin.execute("SELECT streampos.register_consumer('foldack', 'c')")
    n, w, t, rr, fresh = (node.connect() for _ in range(5))
    n.execute("BEGIN")
    one(n, "SELECT pg_current_xact_id()")
    commit_ids(w, "foldack", "w")
    t.execute("BEGIN")
    one(t, "SELECT pg_current_xact_id()")
    commit_ids(w, "foldack", "w")
    for _ in range(18):
        commit_ids(w, "foldack", "w")
    rr.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    one(rr, "SELECT 1")
    token = one(fresh, "SELECT streampos.current_token('foldack')::text")
    accepted = one(rr, "SELECT streampos.ack('foldack', 'c', %s)::text", (token,))
    assert accepted == token
    for _ in range(ring_capacity(node) + 24):
        commit_ids(w, "foldack", "w")
    t.execute("COMMIT")
    assert frontier(rr, "foldack") >= int(token)
    assert one(rr, "SELECT streampos.current_token('foldack')::text") == token
    assert one(rr, "SELECT streampos.ack('foldack', 'c', %s)::text", (token,)) == token
    rr.execute("COMMIT")
    n.execute("COMMIT")
    for c in (n, w, t, rr, fresh):
        c.close()


def test_old_snapshot_after_a_fold_does_not_see_past_a_delayed_commit(small_ring):
    """A commit that is already visible but whose callback is delayed (the
    test hook holds it for a second) while other commits fold the ring: a
    snapshot taken before that commit must not get a frontier past its ID,
    before or after it is folded (0.1.0 read the fold's xid horizon before
    taking the registry lock, and told such a snapshot it saw the summary)."""
    node = small_ring
    with node.connect() as admin:
        admin.execute("SELECT streampos.create_stream('delayed')")
    w, slow, old, fresh = (node.connect() for _ in range(4))
    commit_ids(w, "delayed", "w")
    slow.execute("BEGIN")
    slow_id = one(slow, "SELECT streampos.next_id('delayed', 'w')")
    old.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    one(old, "SELECT 1")  # the snapshot: the slow transaction is running
    slow.execute("SET streampos.test_release_delay_ms = 1500")
    committer = threading.Thread(target=lambda: slow.execute("COMMIT"))
    committer.start()
    time.sleep(0.3)  # the commit is visible; its entry is not released yet
    for _ in range(ring_capacity(node) + 4):
        commit_ids(w, "delayed", "w")
    committer.join(timeout=30)
    for _ in range(ring_capacity(node) + 4):
        commit_ids(w, "delayed", "w")
    assert frontier(old, "delayed") == slow_id - 1
    assert frontier(fresh, "delayed") == one(fresh, "SELECT streampos.max_allocated('delayed')")
    old.execute("COMMIT")
    for c in (w, slow, old, fresh):
        c.close()


# ------------------------------------------------------------- sequences


def test_unlogged_sequences_are_refused(connect, db, stream):
    """An UNLOGGED sequence resets at crash recovery and would hand out its
    IDs again: adopt_stream refuses it, and a stream whose sequence was made
    UNLOGGED stops allocating (55000) until it is permanent again;
    check_stream says why."""
    if db.info.server_version < 150000:
        pytest.skip("PostgreSQL 14 has no unlogged sequences")
    db.execute(f"CREATE UNLOGGED SEQUENCE {stream}_u")
    err = expect_error(db, "SELECT streampos.adopt_stream(%s, %s::regclass)", (stream, f"{stream}_u"), "55000")
    assert "not permanent" in err.diag.message_primary
    assert "UNLOGGED" in err.diag.message_detail
    seq = create_stream(db, stream)
    assert one(db, "SELECT streampos.next_id(%s, 'w')", (stream,)) == 1
    db.execute(f"ALTER SEQUENCE {seq} SET UNLOGGED")
    err = expect_error(db, "SELECT streampos.next_id(%s, 'w')", (stream,), "55000")
    assert "not permanent" in err.diag.message_primary
    checks = {name: (ok, detail) for name, ok, detail in rows(
        db, "SELECT * FROM streampos.check_stream(%s)", (stream,))}
    assert checks["sequence"][0] is False and "UNLOGGED" in checks["sequence"][1], checks
    db.execute(f"ALTER SEQUENCE {seq} SET LOGGED")
    assert one(db, "SELECT streampos.next_id(%s, 'w')", (stream,)) == 2
    temp = connect()
    temp.execute(f"CREATE TEMP SEQUENCE {stream}_tmp")
    err = expect_error(temp, "SELECT streampos.adopt_stream(%s, %s::regclass)", (stream + "x", f"{stream}_tmp"))
    assert err.diag.sqlstate in ("55000", "42501"), err


def test_own_allocation_is_in_flight_for_its_own_transaction(connect, db, stream):
    """A transaction's own IDs are in flight for its own snapshots, even when
    their sequence record is already durable (a snapshot never lists its own
    xid as running, so the snapshot alone does not say so)."""
    create_stream(db, stream)
    assert commit_ids(db, stream, "w", 5) == [1, 2, 3, 4, 5]  # logs ahead, flushed
    w = connect()
    w.execute("BEGIN")
    assert one(w, "SELECT streampos.next_id(%s, 'w')", (stream,)) == 6
    assert one(w, "SELECT streampos.frontier(%s)", (stream,)) == 5
    assert one(w, "SELECT streampos.writer_position(%s, 'w')", (stream,)) == 5
    w.execute("COMMIT")
    assert frontier(db, stream) == 6
