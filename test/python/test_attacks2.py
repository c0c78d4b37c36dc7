"""Second round of attacks, on the fixes of the first: the catalog cache
protocol, writers against drop_stream, the per-ID allocation check, the
lost-history refusal after a start from WAL, the position worker and
snapshots from before a promotion.

As in test_attacks.py, each test is one attack. A test whose docstring says
BREAKS fails on the code it was written against (the docstring says what
breaks and why); a test that says WITHSTANDS passes and stays as a
regression test. Tests that need a server of their own (a crash, a standby)
use cluster.py.
"""

import threading
import time

import psycopg
import pytest

from cluster import Clusters
from failover_measure import setup_stream, token_positions, update_rows
from support import (
    commit_ids,
    create_stream,
    expect_error,
    frontier,
    one,
    rows,
    stored_positions,
    wait_until,
)






def own_sequence(db, connect, stream):
    """A sequence of the test's own (adopt_stream leaves it in place when the
    stream is dropped), dropped after the test."""
    seq = f"{stream}_own"
    db.execute(f'CREATE SEQUENCE "{seq}"')

    def drop():
        with psycopg.connect(db.info.dsn, autocommit=True) as c:
            c.execute(f'DROP SEQUENCE IF EXISTS "{seq}"')

    connect.on_teardown(drop)
    return f'"{seq}"'


# =====================================================================
# Writers against drop_stream
# =====================================================================


def waiting_for_lock(db, conn):
    pid = conn.info.backend_pid
    return one(db, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
               (pid,)) == 1


def test_an_allocation_rolled_back_to_a_savepoint_still_blocks_drop_stream(db, connect, stream, pool):
    """WITHSTANDS: the allocation lock of a rolled-back savepoint. The ROW
    EXCLUSIVE lock that allocation takes itself (sequence.rs,
    lock_for_allocation) belongs to the subtransaction and goes with
    ROLLBACK TO SAVEPOINT, while the registry entry, under the stream's
    key, lives until the top-level transaction ends (and the ID is the
    caller's to use: nextval is not transactional). Had that been the only
    lock, drop_stream + adopt_stream of the same sequence would have given
    it a new key with no holder, and frontier() would have passed the held
    ID. nextval's own lock (lock_and_open_sequence) is owned by the
    top-level transaction, so drop_stream still waits: the claim holds,
    through PostgreSQL rather than through the extension's lock."""
    seq = own_sequence(db, connect, stream)
    db.execute(f"SELECT streampos.adopt_stream(%s, '{seq}')", (stream,))
    commit_ids(db, stream, "w", 3)
    table = f'"{stream}_t"'
    db.execute(f"CREATE TABLE {table} (id bigint)")
    connect.on_teardown(lambda: psycopg.connect(db.info.dsn, autocommit=True).execute(
        f"DROP TABLE IF EXISTS {table}"))

    writer = connect()
    writer.execute("BEGIN")
    writer.execute("SAVEPOINT s")
    held = one(writer, "SELECT streampos.next_id(%s, 'w')", (stream,))
    assert held == 4
    writer.execute("ROLLBACK TO SAVEPOINT s")
    assert frontier(db, stream) == 3

    dropper = connect()

    def drop_and_adopt():
        with dropper.transaction():
            dropper.execute("SELECT streampos.drop_stream(%s)", (stream,))
            dropper.execute(f"SELECT streampos.adopt_stream(%s, '{seq}')", (stream,))

    done = pool.submit(drop_and_adopt)
    time.sleep(0.5)
    blocked = not done.done() and waiting_for_lock(db, dropper)
    seen = frontier(db, stream)
    writer.execute(f"INSERT INTO {table} VALUES (%s)", (held,))
    writer.execute("COMMIT")
    done.result(timeout=10)
    assert blocked, "drop_stream did not wait for a transaction holding an ID of the stream"
    assert seen < held
    assert frontier(db, stream) >= held


@pytest.mark.parametrize("how", ["lock_timeout", "deadlock"])
def test_a_failed_wait_for_the_sequence_lock_is_an_error_not_a_crash(how):
    """BREAKS "never panic" and takes the whole server down. lock_for_allocation
    and lock_against_allocation (sequence.rs, new in the last round) call
    pg_sys::LockRelationOid inside pg_guard_ffi_boundary; pgrx already wraps
    every pg_sys function in that boundary, so an ERROR raised while the
    lock is waited for (lock_timeout, statement_timeout, a query cancel, a
    deadlock) becomes a Rust panic inside the outer boundary's closure, which
    pgrx documents as undefined behaviour: the backend prints "thread caused
    non-unwinding panic. aborting." and dies of SIGABRT, and the postmaster
    restarts every session of the cluster (a crash restart). A writer with
    a lock_timeout that meets a drop_stream (or an ALTER SEQUENCE) in
    progress is enough; so is any deadlock between two drop_streams and
    allocations. with_page (relation_open inside the same wrapper) has the
    same defect for a relation_open that fails (a lock wait cancelled, a
    sequence dropped concurrently).
    Fix: call pg_sys::LockRelationOid (and relation_open, ReadBuffer, …)
    directly: they are already guarded; keep pg_guard_ffi_boundary only for
    the hand-declared functions of ffi.rs (nextval_internal)."""
    with Clusters() as clusters:
        node = clusters.node()
        witness = node.connect()  # an idle session: a crash restart ends it
        a = node.connect()
        b = node.connect()
        a.execute("SELECT streampos.create_stream('s1')")
        a.execute("SELECT streampos.create_stream('s2')")
        failure = []
        if how == "lock_timeout":
            a.execute("BEGIN")
            a.execute("SELECT streampos.drop_stream('s1')")
            b.execute("SET lock_timeout = '300ms'")
            try:
                b.execute("SELECT streampos.next_id('s1', 'w')")
            except psycopg.Error as e:
                failure.append(e)
        else:
            a.execute("BEGIN")
            a.execute("SELECT streampos.next_id('s1', 'wa')")
            b.execute("BEGIN")
            b.execute("SELECT streampos.next_id('s2', 'wb')")
            b.execute("SET LOCAL deadlock_timeout = '100ms'")

            def b_drops():
                try:
                    b.execute("SELECT streampos.drop_stream('s1')")
                except psycopg.Error as e:
                    failure.append(e)

            thread = threading.Thread(target=b_drops)
            thread.start()
            time.sleep(0.3)
            try:
                a.execute("SELECT streampos.drop_stream('s2')")
            except psycopg.Error as e:
                failure.append(e)
            thread.join(timeout=30)
        assert failure, "expected the wait to fail"
        codes = [e.diag.sqlstate for e in failure]
        try:
            witness.execute("SELECT 1")
            crashed = False
        except psycopg.OperationalError:
            crashed = True
            wait_until(node._accepts, timeout=60, message="the server to come back")
        aborts = [line for line in node.log_tail(200).splitlines() if "non-unwinding panic" in line
                  or "terminated by signal" in line]
        assert not crashed and ("55P03" in codes or "40P01" in codes), (
            f"the failed lock wait ({codes}) crash-restarted the server: {aborts}"
        )


# =====================================================================
# The catalog cache
# =====================================================================


def test_an_instance_created_by_a_prepared_transaction_that_rolls_back_is_forgotten(db, connect, stream):
    """BREAKS "instance ids never change once committed; their cache is
    dropped after an abort". A transaction that only creates an instance
    (streampos.instance_id) may be prepared: PRE_PREPARE refuses only
    transactions that hold IDs or changed the stream catalog. The backend
    cached the new id (catalog.rs, instance_id) and its transaction ended
    with PREPARE, which runs neither the commit nor the abort callback;
    ROLLBACK PREPARED, from any session, removes the row. The name is
    created again elsewhere with another id, but the preparing backend keeps
    its cached ghost id for good: its allocations register under an id that
    names no instance, and the token a follower gets lists that id
    (instance_name() of it is 42704; Synapse cannot map it to a writer).
    Fix: clear the instance cache at XACT_EVENT_PREPARE (set
    CLEAR_ON_NEXT_USE), or refuse PREPARE after creating an instance."""
    create_stream(db, stream)
    name = f"{stream}_x"
    preparer = connect()
    preparer.execute("BEGIN")
    ghost = one(preparer, "SELECT streampos.instance_id(%s)", (name,))
    gid = f"{stream}_gid"
    try:
        preparer.execute(f"PREPARE TRANSACTION '{gid}'")
    except psycopg.Error as e:
        preparer.execute("ROLLBACK")
        assert e.diag.sqlstate == "0A000", e  # refused: the claim holds
        return
    db.execute(f"ROLLBACK PREPARED '{gid}'")
    real = one(db, "SELECT streampos.instance_id(%s)", (name,))
    assert real != ghost

    # A writer that holds an ID below, so that the preparer's writer is
    # ahead of the frontier and listed in the token.
    holder = connect()
    holder.execute("BEGIN")
    one(holder, "SELECT streampos.next_id(%s, 'holder')", (stream,))
    preparer.execute("BEGIN")
    one(preparer, "SELECT streampos.next_id(%s, %s)", (stream, name))
    preparer.execute("SELECT pg_catalog.pg_logical_emit_message(true, 'x', '')")
    preparer.execute("COMMIT")
    token = one(db, "SELECT streampos.current_token(%s)::text", (stream,))
    holder.execute("ROLLBACK")
    assert f"~{ghost}." not in token, (
        f"the token {token} lists instance id {ghost}, rolled back with its prepared "
        f"transaction; {name} is instance {real}"
    )


def test_a_cursor_from_before_promotion_keeps_its_writers(db):
    """BREAKS "a reader reads the stream's row as its snapshot sees it" (a
    cursor keeps its stream and writers on every FETCH) across a promotion.
    The cache test (catalog.rs, cache_generation) asks a snapshot to see
    the last 16 catalog changers the commit callbacks recorded, and the
    evicted one to precede its xmin; a standby records nothing (replay runs
    no callback) and starts with an empty list and evicted = 0. After
    promotion a new statement caches the stream's row as it is now; the
    cursor's snapshot, taken during recovery before set_writers was
    replayed, passes the test (nothing to check) and gets that row: its
    writer list changes from one FETCH to the next.
    Fix: a snapshot taken during recovery never uses the cache; or, at the
    end of recovery, set `evicted` to the next xid, so that only snapshots
    taken after the promotion pass."""
    with Clusters() as clusters:
        pair = clusters.pair()
        primary, standby = pair
        with primary.connect() as p:
            p.execute("SELECT streampos.create_stream('s', writers => ARRAY['a', 'b'])")
            p.execute("SELECT streampos.next_id('s', 'a')")
            p.execute("SELECT pg_sleep(0.5)")  # the worker stores the positions
        pair.caught_up()
        reader = standby.connect()
        reader.execute("BEGIN")  # READ COMMITTED: each statement a new snapshot
        reader.execute(
            "DECLARE c CURSOR FOR SELECT streampos.writer_position('s', 'b') FROM generate_series(1, 3)"
        )
        first = reader.execute("FETCH 1 FROM c").fetchall()
        with primary.connect() as p:
            p.execute("SELECT streampos.set_writers('s', ARRAY['a'])")
        pair.caught_up()
        pair.failover()
        now = one(reader, "SELECT string_agg(w.instance_name, ',') FROM streampos.writer_positions('s') w")
        try:
            second = reader.execute("FETCH 1 FROM c").fetchall()
        except psycopg.Error as e:
            second = f"ERROR {e.diag.sqlstate}: {e.diag.message_primary}"
        reader.execute("ROLLBACK")
        assert first == [(1,)] and now == "a"
        assert second == first, (
            f"one cursor, one snapshot from before the promotion (writers a and b): "
            f"writer_position(s, b) {first}, then {second}"
        )


# =====================================================================
# Lost history after a start from WAL
# =====================================================================


@pytest.mark.parametrize("tail", ["rows_deleted", "no_table"])
def test_a_caught_up_follower_is_not_told_to_resync_after_a_crash_restart(tail):
    """An ordinary crash restart of a primary told a caught-up follower to
    resynchronise (72000) although nothing was lost (0.2.0 counted as "had"
    only rows at or below the replayed value, or stored positions, which
    trail the frontier: rows are deleted once consumed, a stream may have
    no table). A crash restart of a primary begins no new history
    (docs/design.md, "Lost history"): its frontiers only ever passed IDs
    durable there, and no position it reported is refused afterwards. The
    worker stores positions once a minute here, so that they trail."""
    with Clusters() as clusters:
        node = clusters.node(**{"streampos.position_interval_ms": "60000"})
        with node.connect() as c:
            c.execute("SELECT streampos.create_stream('s')")
            if tail == "rows_deleted":
                c.execute("CREATE TABLE inbox (id bigint PRIMARY KEY, writer text, body text)")
                c.execute("SELECT streampos.add_table('s', 'inbox', 'id')")
            insert = ("INSERT INTO inbox SELECT streampos.next_id('s', 'w'), 'w', 'm'" if tail == "rows_deleted"
                      else "SELECT streampos.next_id('s', 'w'), pg_logical_emit_message(true, 'm', '')")
            for _ in range(5):
                c.execute(insert)
            answer = c.execute("SELECT streampos.updates('s', '3', timeout_ms => 1000)").fetchone()[0]
            token = answer["token"]
            assert token_positions(token) == (5, 5), answer
            if tail == "rows_deleted":
                assert [r[0] for r in update_rows(answer)] == [4, 5]
                c.execute("DELETE FROM inbox WHERE id <= 5")  # delivered: consumed
            # Nothing is lost: every commit was flushed (synchronous_commit).
        node.kill()
        node.start()
        with node.connect() as c:
            assert one(c, "SELECT streampos.frontier('s')") >= 5
            try:
                got = c.execute("SELECT streampos.updates('s', %s, timeout_ms => 0)", (token,)).fetchone()[0]
            except psycopg.Error as e:
                pytest.fail(f"a follower at {token}, every commit of which survived the crash, "
                            f"is told to resynchronise: {e.diag.sqlstate} {e.diag.message_primary}")
            assert got["token"] is not None


@pytest.mark.xfail(strict=True, reason="known limitation, README 'Failover': only synchronous "
                   "replication keeps a follower from holding rows a new primary lacks")
def test_a_follower_holding_lost_rows_below_a_surviving_row_is_told_to_resync():
    """KNOWN LIMITATION (documented in README, "Failover", and design.md):
    "a follower that holds rows from transactions this server never had
    gets 72000" fails after an asynchronous failover, when writers commit out
    of ID order. Refusing every token whose range has an ID without a row
    would also refuse followers after every synchronous failover (aborted
    IDs have no rows), which lose nothing. Writer a holds 21..24 while writer b commits 25; the
    standby receives b's commit, then replication stops; a commits, and a
    follower reads rows 21..25 and token 25 from the old primary. The new
    primary has rows 1..20 and 25. refuse_lost_history (api/follow.rs)
    compares the token's positions with the highest row at or below the
    replayed ceiling: row 25 exists, so the follower carries on from 25 and
    keeps rows 21..24 that this server never had, and never learns it.
    Fix: compare with the rows the server has between the follower's
    positions and its own frontier at the start (e.g. refuse when any ID
    at or below the token's positions and above the stored positions the
    standby replayed is missing from the stream's tables and was not
    aborted), or store, with each commit, the IDs it finished so that the
    new primary knows which of them it has."""
    with Clusters() as clusters:
        pair = clusters.pair()
        primary, standby = pair
        setup_stream(primary, writers=["a", "b"])
        with primary.connect() as p:
            for _ in range(20):
                p.execute("INSERT INTO ev SELECT streampos.next_id('ev', 'a'), 'a', 'r'")
            p.execute("SELECT pg_sleep(0.5)")  # the worker stores the positions
        holder = primary.connect()
        holder.execute("BEGIN")
        holder.execute("INSERT INTO ev SELECT unnest(streampos.next_ids('ev', 'a', 4)), 'a', 'lost'")
        with primary.connect() as p:
            p.execute("INSERT INTO ev SELECT streampos.next_id('ev', 'b'), 'b', 'kept'")
            assert one(p, "SELECT max(id) FROM ev") == 25
        pair.caught_up()
        pair.disconnect()
        holder.execute("COMMIT")
        with primary.connect() as p:
            answer = p.execute("SELECT streampos.updates('ev', '20', timeout_ms => 1000)").fetchone()[0]
        assert [r[0] for r in update_rows(answer)] == [21, 22, 23, 24, 25]
        token = answer["token"]
        assert token_positions(token) == (25, 25)
        pair.failover()
        with standby.connect() as c:
            assert [r[0] for r in rows(c, "SELECT id FROM ev WHERE id > 20 ORDER BY id")] == [25]
            try:
                got = c.execute("SELECT streampos.updates('ev', %s, timeout_ms => 0)", (token,)).fetchone()[0]
            except psycopg.Error as e:
                assert e.diag.sqlstate == "72000", e
                return
            pytest.fail(f"a follower holding rows 21..24, which this server never had, "
                        f"carries on from {token}: {got['token']}")


# =====================================================================
# The per-ID allocation check
# =====================================================================


@pytest.mark.xfail(strict=True, reason="known limitation, README 'Writing': a setval() back "
                   "racing an allocation's registration can hand one ID out twice (never passed by a reader)")
def test_a_sequence_moved_back_during_a_paused_allocation_is_caught(db, connect, stream, pool):
    """KNOWN LIMITATION (README, "Writing"): "a sequence moved back by
    setval() is detected whichever call it hits" and "IDs are never handed
    out twice" fail when the setval lands between an allocation's
    registration and its nextval, though no reader passes the ID. Closing
    it needs one more registry read per allocation, on the hot path. finish_allocation (registry/alloc.rs)
    checks each ID against the stream's highest allocated ID read when the
    call *began* (the published lower bound). Writer b publishes its bound
    (4) and is delayed before nextval (the test hook stands in for a slow
    backend); writer a allocates 4 and commits; the sequence's owner runs
    setval(seq, 3); b's nextval returns 4, which is not below b's bound,
    and b gets ID 4 too: two committed rows with ID 4 from two writers.
    Readers stay safe (b's bound held the frontier at 3), but the sequence
    was moved back under an allocation and nothing noticed; check_stream
    afterwards sees the sequence at 4 and finds nothing wrong.
    Fix: under the lock in finish_allocation, also refuse an ID at or below
    the stream's highest allocated ID *now* unless it lies within the range
    between the call's bound and the IDs other calls registered since (or
    simply: refuse an ID that another entry, active or in the finished ring
    since the bound was published, already registered)."""
    seq = create_stream(db, stream)
    commit_ids(db, stream, "a", 3)
    slow = connect()
    slow.execute("SET streampos.test_allocation_delay_ms = 1500")

    def slow_allocation():
        with slow.transaction():
            got = one(slow, "SELECT streampos.next_id(%s, 'b')", (stream,))
            slow.execute("SELECT pg_catalog.pg_logical_emit_message(true, 'b', '')")
        return got

    b = pool.submit(slow_allocation)
    wait_until(lambda: len(rows(db, "SELECT 1 FROM streampos.in_flight(%s)", (stream,))) == 1,
               timeout=5, message="b to publish its bound")
    a = commit_ids(db, stream, "a", 1)
    db.execute(f"SELECT setval('{seq}', 3)")
    try:
        got_b = b.result(timeout=10)
    except psycopg.Error as e:
        assert e.diag.sqlstate == "55000", e  # caught: the claim holds
        return
    assert got_b != a[0], f"writers a and b were both handed ID {got_b}"


def test_a_cursor_keeps_its_writers_after_more_than_16_catalog_changes(db, connect, stream):
    """WITHSTANDS: evicting the change a cursor's snapshot missed. The cache
    remembers the xids of the last 16 catalog changers; a cursor opened
    before set_writers, followed by 20 more catalog changes (so that
    set_writers' xid is evicted), then a newer statement that caches the
    new row: the cursor's snapshot does not see the 16 latest changers
    either, so it still reads the catalog itself."""
    create_stream(db, stream, writers=["a", "b"])
    commit_ids(db, stream, "b", 2)
    reader = connect()
    reader.execute("BEGIN")
    reader.execute(
        "DECLARE c CURSOR FOR SELECT streampos.writer_position(%s, 'b') FROM generate_series(1, 3)",
        (stream,),
    )
    first = reader.execute("FETCH 1 FROM c").fetchall()
    db.execute("SELECT streampos.set_writers(%s, ARRAY['a'])", (stream,))
    for i in range(20):
        create_stream(db, f"{stream}_{i}")
    assert one(reader, "SELECT count(*) FROM streampos.writer_positions(%s)", (stream,)) == 1
    try:
        second = reader.execute("FETCH 1 FROM c").fetchall()
    except psycopg.Error as e:
        second = f"ERROR {e.diag.sqlstate}: {e.diag.message_primary}"
    reader.execute("ROLLBACK")
    assert first == [(2,)]
    assert second == first


def test_a_catalog_change_that_fails_at_commit_leaves_the_cache_usable(db, connect, stream):
    """WITHSTANDS: an abort after pre-commit. A SERIALIZABLE transaction
    runs set_writers and then fails at COMMIT (40001, a write skew caught at
    commit), after the pre-commit callback counted it in `committing`. The
    abort callback uncounts it and moves the generation: the writer it
    would have removed still allocates, from a backend whose cached row
    predates the attempt, and a later set_writers still takes effect in
    that backend."""
    create_stream(db, stream, writers=["a", "b"])
    table = f'"{stream}_skew"'
    db.execute(f"CREATE TABLE {table} (k int)")
    connect.on_teardown(lambda: psycopg.connect(db.info.dsn, autocommit=True).execute(
        f"DROP TABLE IF EXISTS {table}"))
    writer = connect()
    commit_ids(writer, stream, "b", 1)  # caches the row
    # The position worker stores that commit's positions first: set_writers
    # deletes the positions of the writers it removes, and a row the worker
    # updated after t2's snapshot would fail t2 early (40001 at the DELETE,
    # not at COMMIT).
    wait_until(lambda: stored_positions(db, stream) == {"a": 1, "b": 1}, message="positions stored")
    t1, t2 = connect(), connect()
    t1.execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
    t2.execute("BEGIN ISOLATION LEVEL SERIALIZABLE")
    t1.execute(f"SELECT count(*) FROM {table} WHERE k = 1")
    t2.execute(f"SELECT count(*) FROM {table} WHERE k = 2")
    t1.execute(f"INSERT INTO {table} VALUES (2)")
    t2.execute(f"INSERT INTO {table} VALUES (1)")
    t2.execute("SELECT streampos.set_writers(%s, ARRAY['a'])", (stream,))
    t1.execute("COMMIT")
    with pytest.raises(psycopg.errors.SerializationFailure):
        t2.execute("COMMIT")
    assert commit_ids(writer, stream, "b", 1) == [2]
    db.execute("SELECT streampos.set_writers(%s, ARRAY['a'])", (stream,))
    writer.execute("BEGIN")
    expect_error(writer, "SELECT streampos.next_id(%s, 'b')", (stream,), "55000")
    writer.execute("ROLLBACK")
