"""The stream engine with real concurrent sessions: allocation, the in-flight
registry, positions for the caller's snapshot, errors, the durable positions
table and check_stream().

Every session is a separate connection (a separate backend); transactions are
explicit (BEGIN ... COMMIT/ROLLBACK). Threads are used only where a call must
block while the test goes on. Every loop is bounded in time and count.

IDs count as finished once their transaction ended and their sequence values
are durable (see support.durable_commit): positions are asserted exactly
right after a durable commit, and polled (bounded) after an abort or an
asynchronous commit.
"""

import random
import threading
import time

import psycopg
import pytest

from support import (
    CATCH_UP_SECONDS,
    backend_pid,
    create_stream,
    durable_commit,
    expect_error,
    flush_wal,
    frontier,
    in_flight,
    max_allocated,
    next_id,
    next_ids,
    one,
    paused_next_id,
    rows,
    samples_missing_rows,
    sequence_value,
    stored_positions,
    wait_until,
    writer_position,
)

# --------------------------------------------------------------- helpers


def writer_positions(conn, stream):
    return rows(
        conn,
        "SELECT instance_name, instance_id, stream_id FROM streampos.writer_positions(%s) "
        "ORDER BY instance_id",
        (stream,),
    )


def room_token(conn, stream):
    return one(conn, "SELECT streampos.current_room_token(%s)::text", (stream,))


def multi_token(conn, stream):
    return one(conn, "SELECT streampos.current_token(%s)::text", (stream,))


def instance_id(conn, name):
    return one(conn, "SELECT streampos.instance_id(%s)", (name,))


def commit_ids(conn, stream, writer, n):
    """Allocate n IDs in one transaction and commit them (durably)."""
    conn.execute("BEGIN")
    ids = next_ids(conn, stream, writer, n)
    durable_commit(conn)
    return ids


def hold_ids(conn, stream, writer, n=1):
    """Open a transaction holding n IDs in flight (next_id for one, next_ids
    for more); returns the IDs."""
    conn.execute("BEGIN")
    if n == 1:
        return [next_id(conn, stream, writer)]
    return next_ids(conn, stream, writer, n)


def check_rows(conn, stream, repair=False):
    return rows(
        conn,
        "SELECT check_name, ok, detail FROM streampos.check_stream(%s, repair => %s)",
        (stream, repair),
    )


def wait_sleeping(db, pid, timeout=5.0):
    """Wait until backend ``pid`` is inside pg_sleep()."""
    wait_until(
        lambda: one(
            db,
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event = 'PgSleep'",
            (pid,),
        )
        == 1,
        timeout=timeout,
        interval=0.005,
        message=f"backend {pid} to sleep",
    )


# =============================================================== 1. commit order


def test_out_of_order_commits_move_frontier_and_writer_position(connect, db, stream):
    """Four sessions hold 8, 9, 10, 11 after 7 committed IDs; committing them
    in the order 9, 8, 11, 10 moves frontier and writer_position (read from a
    fifth session) to exactly 7, 9, 9, 11."""
    create_stream(db, stream)
    w = f"{stream}_w"
    assert commit_ids(db, stream, w, 7) == list(range(1, 8))

    sessions = {}
    for expected in (8, 9, 10, 11):
        conn = connect()
        assert hold_ids(conn, stream, w) == [expected]
        sessions[expected] = conn

    def observe():
        return (
            frontier(db, stream),
            writer_position(db, stream, w),
            max_allocated(db, stream),
            room_token(db, stream),
        )

    assert observe() == (7, 7, 11, "s7")
    seen = []
    for done in (9, 8, 11, 10):
        durable_commit(sessions[done])
        seen.append(observe())
    assert seen == [
        (7, 7, 11, "s7"),
        (9, 9, 11, "s9"),
        (9, 9, 11, "s9"),
        (11, 11, 11, "s11"),
    ]
    assert in_flight(db, stream) == []


# =============================================================== 2. release


def test_abort_releases_ids(connect, db, stream):
    """A rolled-back transaction's IDs become a gap: the frontier moves past
    them when it ends (at once when the WAL already covers them, else within
    a second, when the WAL writer flushes)."""
    create_stream(db, stream)
    w = f"{stream}_w"
    commit_ids(db, stream, w, 2)
    a, b = connect(), connect()
    assert hold_ids(a, stream, w) == [3]
    assert hold_ids(b, stream, w) == [4]
    durable_commit(b)
    assert frontier(db, stream) == 2
    a.execute("ROLLBACK")
    # B's commit flushed the WAL past A's allocation: released at once.
    assert frontier(db, stream) == 4
    assert writer_position(db, stream, w) == 4
    assert in_flight(db, stream) == []
    # An aborted transaction alone also releases (frontier = max allocated),
    # once the WAL writer has made its sequence values durable.
    assert hold_ids(a, stream, w, 3) == [5, 6, 7]
    assert frontier(db, stream) == 4
    a.execute("ROLLBACK")
    assert in_flight(db, stream) == []
    wait_until(lambda: frontier(db, stream) == 7, timeout=CATCH_UP_SECONDS, message="frontier 7")
    assert (writer_position(db, stream, w), max_allocated(db, stream)) == (7, 7)


def test_terminated_backend_releases_ids(connect, db, stream):
    """pg_terminate_backend() of a session holding IDs releases them within a
    second."""
    create_stream(db, stream)
    w = f"{stream}_w"
    commit_ids(db, stream, w, 1)
    victim = connect()
    pid = backend_pid(victim)
    assert hold_ids(victim, stream, w, 2) == [2, 3]
    other = connect()
    assert hold_ids(other, stream, w) == [4]
    durable_commit(other)
    assert frontier(db, stream) == 1
    assert [r[1] for r in in_flight(db, stream)] == [pid]

    assert one(db, "SELECT pg_terminate_backend(%s)", (pid,)) is True
    wait_until(
        lambda: frontier(db, stream) == 4 and in_flight(db, stream) == [],
        timeout=CATCH_UP_SECONDS,
        interval=0.01,
        message="the terminated session's IDs to be released",
    )
    with pytest.raises(psycopg.OperationalError):
        victim.execute("SELECT 1")


def test_closed_connection_mid_transaction_releases_ids(connect, db, stream):
    """A client that disconnects in the middle of a transaction releases its
    IDs when its backend exits (within a second)."""
    create_stream(db, stream)
    w = f"{stream}_w"
    leaver = connect()
    assert hold_ids(leaver, stream, w, 3) == [1, 2, 3]
    assert frontier(db, stream) == 0
    leaver.close()
    wait_until(
        lambda: frontier(db, stream) == 3 and in_flight(db, stream) == [],
        timeout=CATCH_UP_SECONDS,
        interval=0.01,
        message="the disconnected session's IDs to be released",
    )


def test_savepoint_rollback_keeps_ids_in_flight_until_top_level_end(connect, db, stream):
    """IDs allocated in a rolled-back savepoint stay in flight (conservative)
    until the top-level transaction ends; its commit then releases them. The
    writer's name was created in the savepoint too: the rollback took the
    instance away, so the second call creates it again (a new id), and the
    IDs of the first, still the name's, are counted under the new id with
    the second's (test_new_writers.py)."""
    create_stream(db, stream)
    w = f"{stream}_w"
    a = connect()
    a.execute("BEGIN")
    a.execute("SAVEPOINT s1")
    assert next_id(a, stream, w) == 1
    a.execute("ROLLBACK TO SAVEPOINT s1")
    assert next_id(a, stream, w) == 2
    assert frontier(db, stream) == 0
    assert sorted((r[3], r[4], r[5]) for r in in_flight(db, stream)) == [(1, 2, 2)]
    durable_commit(a)
    assert frontier(db, stream) == 2
    assert in_flight(db, stream) == []


# =============================================================== 3. two writers


def test_two_writers_tokens_positions_and_in_flight(connect, db, stream):
    """Idle writers sit at the maximum allocated ID; with writer A holding IDs
    and writer B ahead, the token is exactly m{frontier}~{idB}.{posB},
    writer_positions lists both, in_flight() names A's transaction; after A
    commits the token is s{max}."""
    create_stream(db, stream)
    wa, wb = f"{stream}_a", f"{stream}_b"
    ida, idb = instance_id(db, wa), instance_id(db, wb)
    assert ida < idb

    a, b = connect(), connect()
    assert commit_ids(a, stream, wa, 3) == [1, 2, 3]
    assert commit_ids(b, stream, wb, 2) == [4, 5]
    # Idle writers: both at max allocated, nobody holds anything back.
    assert writer_positions(db, stream) == [(wa, ida, 5), (wb, idb, 5)]
    assert (frontier(db, stream), room_token(db, stream), multi_token(db, stream)) == (5, "s5", "5")

    pid_a = backend_pid(a)
    assert hold_ids(a, stream, wa, 3) == [6, 7, 8]
    xid_a, start_a = a.execute("SELECT pg_current_xact_id()::xid::text, now()").fetchone()
    assert commit_ids(b, stream, wb, 2) == [9, 10]

    assert frontier(db, stream) == 5
    assert writer_position(db, stream, wa) == 5
    assert writer_position(db, stream, wb) == 10
    assert room_token(db, stream) == f"m5~{idb}.10"
    assert multi_token(db, stream) == f"m5~{idb}.10"
    assert writer_positions(db, stream) == [(wa, ida, 5), (wb, idb, 10)]
    assert in_flight(db, stream) == [(wa, pid_a, xid_a, 6, 8, 3, start_a)]

    durable_commit(a)
    assert room_token(db, stream) == "s10"
    assert multi_token(db, stream) == "10"
    assert writer_positions(db, stream) == [(wa, ida, 10), (wb, idb, 10)]
    assert in_flight(db, stream) == []


def test_holders_are_found_whatever_order_their_transactions_end_in(connect, db, stream):
    """Readers visit only the backend slots that hold entries (an active
    list, from which an ending transaction's slot is swapped out). Eight
    sessions hold IDs, some of them two streams' worth; they end in a
    scrambled order (commit, rollback, a terminated backend), and after each
    end in_flight() lists exactly the others and the frontier is one below
    the lowest ID still held."""
    create_stream(db, stream)
    other = f"{stream}_o"
    create_stream(db, other)
    sessions = [connect() for _ in range(8)]
    held = {}
    for k, conn in enumerate(sessions):
        held[k] = hold_ids(conn, stream, f"w{k}", 1 + k % 3)
        if k % 2:
            next_id(conn, other, f"w{k}")
    rng = random.Random(20251130)
    order = list(held)
    rng.shuffle(order)
    for step, k in enumerate(order):
        conn = sessions[k]
        if step % 3 == 0:
            durable_commit(conn)
        elif step % 3 == 1:
            conn.execute("ROLLBACK")
        else:
            db.execute("SELECT pg_terminate_backend(%s)", (backend_pid(conn),))
        del held[k]
        expected = sorted(min(ids) for ids in held.values())
        wait_until(
            lambda: sorted(r[3] for r in in_flight(db, stream)) == expected,
            timeout=10,
            message=f"in_flight() after step {step}",
        )
        assert len(in_flight(db, other)) == sum(1 for j in held if j % 2)
        # Aborted or terminated IDs below the lowest held ID stay unseen
        # only while their sequence record is not durable: poll.
        want = expected[0] - 1 if expected else max_allocated(db, stream)
        wait_until(lambda: frontier(db, stream) == want, timeout=10, message=f"frontier after step {step}")


# =============================================================== 4. snapshots


def test_repeatable_read_reader_does_not_count_commit_it_cannot_see(connect, db, stream):
    """A REPEATABLE READ reader whose snapshot was taken while W held k keeps
    frontier < k after W commits, and counts only rows it can see; a fresh
    READ COMMITTED statement afterwards sees frontier >= k and the row."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY)")
    w = f"{stream}_w"
    for i in commit_ids(db, stream, w, 4):
        db.execute(f"INSERT INTO {table} VALUES (%s)", (i,))

    writer, reader = connect(), connect()
    (k,) = hold_ids(writer, stream, w)
    assert k == 5
    reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    assert one(reader, f"SELECT count(*) FROM {table}") == 4  # snapshot taken now
    writer.execute(f"INSERT INTO {table} VALUES (%s)", (k,))
    writer.execute("COMMIT")

    assert frontier(reader, stream) == k - 1
    assert one(reader, f"SELECT count(*) FROM {table} WHERE id <= streampos.frontier(%s)", (stream,)) == 4
    assert room_token(reader, stream) == "s4"
    reader.execute("COMMIT")

    assert frontier(reader, stream) == k
    assert one(reader, f"SELECT count(*) FROM {table} WHERE id <= streampos.frontier(%s)", (stream,)) == 5


def test_repeatable_read_snapshot_older_than_the_allocation(connect, db, stream):
    """A REPEATABLE READ snapshot taken before W even allocated: W allocates,
    inserts and commits; the reader's frontier stays below W's ID."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY)")
    w = f"{stream}_w"
    for i in commit_ids(db, stream, w, 2):
        db.execute(f"INSERT INTO {table} VALUES (%s)", (i,))

    reader, writer = connect(), connect()
    reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    assert one(reader, "SELECT 1") == 1
    writer.execute("BEGIN")
    (k,) = next_ids(writer, stream, w, 1)
    writer.execute(f"INSERT INTO {table} VALUES (%s)", (k,))
    writer.execute("COMMIT")
    assert frontier(db, stream) == k == 3

    assert frontier(reader, stream) == 2
    assert writer_position(reader, stream, w) == 2
    assert one(reader, f"SELECT count(*) FROM {table} WHERE id <= streampos.frontier(%s)", (stream,)) == 2
    reader.execute("COMMIT")
    assert frontier(reader, stream) == 3


@pytest.mark.parametrize("allocate_before_statement", [True, False])
def test_read_committed_statement_does_not_count_commit_during_it(
    connect, db, stream, pool, allocate_before_statement
):
    """One READ COMMITTED statement takes its snapshot, sleeps, then calls
    frontier(); a writer commits ID k during the sleep. The frontier must stay
    below k (the statement cannot see that row), and the rows it counts up to
    its frontier are all of them."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY)")
    w = f"{stream}_w"
    for i in commit_ids(db, stream, w, 3):
        db.execute(f"INSERT INTO {table} VALUES (%s)", (i,))

    reader, writer = connect(), connect()
    if allocate_before_statement:
        (k,) = hold_ids(writer, stream, w)
    query = f"""
        WITH pause AS MATERIALIZED (SELECT pg_sleep(0.4)),
             x AS MATERIALIZED (SELECT streampos.frontier(%s) AS f FROM pause)
        SELECT f, (SELECT count(*) FROM {table} WHERE id <= x.f) FROM x"""
    pid = backend_pid(reader)
    result = pool.submit(lambda: reader.execute(query, (stream,)).fetchone())
    wait_sleeping(db, pid)
    if not allocate_before_statement:
        (k,) = hold_ids(writer, stream, w)
    assert k == 4
    writer.execute(f"INSERT INTO {table} VALUES (%s)", (k,))
    writer.execute("COMMIT")
    assert frontier(db, stream) == 4
    assert not result.done(), "the reader's statement ended before the writer committed"
    assert result.result(timeout=10) == (3, 3)
    assert one(reader, "SELECT streampos.frontier(%s)", (stream,)) == 4


def test_no_missed_rows_with_random_concurrent_writers_and_readers(connect, db, stream, pool):
    """Invariant 1 under load: writers insert rows with next_id/next_ids and
    commit or abort at random while READ COMMITTED and REPEATABLE READ readers
    sample (frontier F, ids <= F they see). Afterwards, for every sample, the
    committed ids <= F are exactly the ids that sample saw; each READ
    COMMITTED reader's frontier never goes backwards."""
    seed = random.randrange(1 << 30)
    print(f"random seed {seed}")
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, writer text NOT NULL)")
    writers = [f"{stream}_w{i}" for i in range(2)]
    for w in writers:
        instance_id(db, w)

    n_writers, duration = 4, 3.0
    writer_conns = [connect() for _ in range(n_writers)]
    rc_conns = [connect() for _ in range(2)]
    slow_conn, rr_conn = connect(), connect()
    stop = threading.Event()
    committed, aborted = set(), set()
    samples = []  # (kind, f, frozenset(ids <= f seen))
    lock = threading.Lock()

    def writer_loop(i):
        conn, rnd = writer_conns[i], random.Random(seed + i)
        name = writers[i % len(writers)]
        for _ in range(5000):
            if stop.is_set():
                break
            conn.execute("BEGIN")
            n = rnd.randint(1, 3)
            if rnd.random() < 0.5:
                ids = next_ids(conn, stream, name, n)
            else:
                ids = [next_id(conn, stream, name) for _ in range(n)]
            for id_ in ids:
                conn.execute(f"INSERT INTO {table} VALUES (%s, %s)", (id_, name))
                time.sleep(rnd.uniform(0, 0.003))
            time.sleep(rnd.uniform(0, 0.01))
            if rnd.random() < 0.25:
                conn.execute("ROLLBACK")
                with lock:
                    aborted.update(ids)
            else:
                conn.execute("COMMIT")
                with lock:
                    committed.update(ids)

    def rc_loop(conn, query):
        last = None
        for _ in range(20000):
            if stop.is_set():
                break
            f, ids = conn.execute(query, (stream,)).fetchone()
            assert last is None or f >= last, f"READ COMMITTED frontier went back from {last} to {f}"
            last = f
            with lock:
                samples.append(("rc", f, frozenset(ids or ())))

    def rr_loop(conn):
        rnd = random.Random(seed - 1)
        for _ in range(5000):
            if stop.is_set():
                break
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            for _ in range(3):
                f = frontier(conn, stream)  # the first call takes the snapshot
                ids = one(conn, f"SELECT array_agg(id) FROM {table} WHERE id <= %s", (f,))
                with lock:
                    samples.append(("rr", f, frozenset(ids or ())))
                time.sleep(rnd.uniform(0, 0.01))
            conn.execute("COMMIT")

    plain = f"""SELECT f, (SELECT array_agg(id) FROM {table} WHERE id <= x.f)
                FROM (SELECT streampos.frontier(%s) AS f OFFSET 0) x"""
    # Widen the window between the statement's snapshot and frontier().
    slow = f"""WITH pause AS MATERIALIZED (SELECT pg_sleep(0.005)),
                    x AS MATERIALIZED (SELECT streampos.frontier(%s) AS f FROM pause)
               SELECT f, (SELECT array_agg(id) FROM {table} WHERE id <= x.f) FROM x"""
    futures = [pool.submit(writer_loop, i) for i in range(n_writers)]
    futures += [pool.submit(rc_loop, c, plain) for c in rc_conns]
    futures += [pool.submit(rc_loop, slow_conn, slow), pool.submit(rr_loop, rr_conn)]
    try:
        time.sleep(duration)
    finally:
        stop.set()
    for fut in futures:
        fut.result(timeout=30)

    final = {r[0] for r in rows(db, f"SELECT id FROM {table}")}
    assert final == committed
    assert final.isdisjoint(aborted)
    top = max(committed | aborted)
    assert max_allocated(db, stream) == top
    wait_until(lambda: frontier(db, stream) == top, timeout=CATCH_UP_SECONDS, message=f"frontier {top}")
    assert len(committed) > 30 and len(aborted) > 0
    kinds = {k for k, _, _ in samples}
    assert kinds == {"rc", "rr"} and len(samples) > 100

    missed = samples_missing_rows(samples, final)
    assert not missed, f"{len(missed)} samples missed committed rows, e.g. {missed[:5]}"
    # The samples were not all trivial: readers saw the frontier move.
    assert len({f for _, f, _ in samples}) > 5


# =============================================================== 5. allocation race


def test_lower_bound_is_published_before_nextval(connect, db, stream, pool):
    """Writer A publishes a lower bound, then sleeps 500 ms before nextval;
    meanwhile B allocates and commits the next ID. A reader during A's sleep
    gets the maximum from before A started (below B's ID and A's eventual ID):
    it would get B's ID if A's lower bound were not published first. B's own
    position waits for A's call too: until A records its WAL position,
    nothing says the IDs it takes are durable, and its lower bound holds
    every writer."""
    create_stream(db, stream)
    wa, wb = f"{stream}_a", f"{stream}_b"
    instance_id(db, wa)
    instance_id(db, wb)
    assert commit_ids(db, stream, wb, 3) == [1, 2, 3]
    m = 3

    a, b = connect(), connect()
    fut, started = paused_next_id(pool, db, a, stream, wa, 500)
    b.execute("BEGIN")
    assert next_id(b, stream, wb) == m + 1
    durable_commit(b)
    during = (
        frontier(db, stream),
        writer_position(db, stream, wa),
        writer_position(db, stream, wb),
        room_token(db, stream),
    )
    assert not fut.done() and time.monotonic() - started < 0.5, (
        "A's nextval finished before the reader looked: the machine is too slow for this test"
    )
    assert during == (m, m, m, f"s{m}")

    assert fut.result(timeout=10) == m + 2
    assert frontier(db, stream) == m + 1
    durable_commit(a)
    assert frontier(db, stream) == m + 2


def test_concurrent_allocations_never_fail(connect, db, stream, pool):
    """Sessions allocating from one stream at the same moment all succeed,
    even when the sequence interleaves their IDs and they finish out of
    order; every ID is handed out once and nothing stays in flight."""
    create_stream(db, stream)
    instance_id(db, "w")
    conns = [connect() for _ in range(4)]
    n = 20000

    def run(conn, barrier):
        barrier.wait(timeout=10)
        try:
            return ("ok", next_ids(conn, stream, "w", n))
        except psycopg.Error as e:
            return ("error", e.diag.sqlstate, e.diag.message_primary, e.diag.message_detail)

    interleaved_rounds, total = 0, 0
    for round_ in range(6):
        barrier = threading.Barrier(len(conns))
        results = [f.result(timeout=60) for f in [pool.submit(run, c, barrier) for c in conns]]
        errors = [r for r in results if r[0] == "error"]
        assert not errors, f"round {round_}: {errors}"
        lists = [r[1] for r in results]
        everything = [i for ids in lists for i in ids]
        total += len(everything)
        assert sorted(everything) == list(range(total - len(everything) + 1, total + 1))
        if any(ids != list(range(ids[0], ids[0] + n)) for ids in lists):
            interleaved_rounds += 1
            if interleaved_rounds == 2:
                break
    assert interleaved_rounds > 0, "the sequence never interleaved two sessions' IDs"
    assert in_flight(db, stream) == []
    assert max_allocated(db, stream) == total
    wait_until(lambda: frontier(db, stream) == total, timeout=CATCH_UP_SECONDS, message=f"frontier {total}")


def test_writer_position_of_a_brand_new_writer_counts_its_in_flight_ids(connect, db, stream):
    """A writer's first transaction (which creates its instance row) holds ID
    k: writer_position() of that writer read from another session is k - 1,
    not k (a reader filtering that writer's rows by it would miss row k)."""
    create_stream(db, stream)
    assert commit_ids(db, stream, f"{stream}_old", 3) == [1, 2, 3]
    new = f"{stream}_new"  # no instance row yet
    a = connect()
    assert hold_ids(a, stream, new) == [4]
    flush_wal(db)  # ID 4 is durable: it holds back its own writer only
    assert frontier(db, stream) == 3
    assert writer_position(db, stream, f"{stream}_old") == 4
    assert writer_position(db, stream, new) == 3


def test_positions_only_name_instances_that_exist(connect, db, stream):
    """A brand-new writer whose first transaction rolls back leaves no trace:
    writer_positions() never lists an empty instance name, and every row of
    stream_positions names an existing instance."""
    create_stream(db, stream)
    old = f"{stream}_old"
    assert commit_ids(db, stream, old, 3) == [1, 2, 3]
    a = connect()
    assert hold_ids(a, stream, f"{stream}_new") == [4]
    flush_wal(db)
    names_while_in_flight = [r[0] for r in writer_positions(db, stream)]
    a.execute("ROLLBACK")
    assert commit_ids(db, stream, old, 1) == [5]
    wait_until(
        lambda: stored_positions(db, stream).get(old) == 5,
        timeout=CATCH_UP_SECONDS,
        message="the worker to store the position",
    )
    orphans = rows(
        db,
        "SELECT instance_name, stream_id FROM streampos.stream_positions p WHERE stream_name = %s "
        "AND NOT EXISTS (SELECT 1 FROM streampos.instances i WHERE i.instance_name = p.instance_name)",
        (stream,),
    )
    assert ("" not in names_while_in_flight, orphans) == (True, [])


# =============================================================== 6. backward streams


def test_backward_stream_counts_down_and_in_flight_holds_it_back(connect, db, stream):
    """A backward stream hands out -1, -2, ... (next_ids descending); its
    frontier is 0 when empty, then -k, and an in-flight ID -j holds it at
    -(j - 1)."""
    create_stream(db, stream, backwards=True)
    w = f"{stream}_w"
    assert (frontier(db, stream), max_allocated(db, stream), room_token(db, stream)) == (0, 0, "s0")

    a, b = connect(), connect()
    assert hold_ids(a, stream, w) == [-1]
    assert frontier(db, stream) == 0
    durable_commit(a)
    assert frontier(db, stream) == -1
    assert commit_ids(b, stream, w, 3) == [-2, -3, -4]
    assert frontier(db, stream) == -4

    pid_a = backend_pid(a)
    assert hold_ids(a, stream, w, 2) == [-5, -6]
    assert commit_ids(b, stream, f"{stream}_other", 1) == [-7]
    assert frontier(db, stream) == -4
    assert max_allocated(db, stream) == -7
    assert writer_position(db, stream, w) == -4
    assert writer_position(db, stream, f"{stream}_other") == -7
    assert room_token(db, stream) == "s-4"
    assert [(r[0], r[1], r[3], r[4], r[5]) for r in in_flight(db, stream)] == [(w, pid_a, -6, -5, 2)]
    durable_commit(a)
    assert frontier(db, stream) == -7
    assert room_token(db, stream) == "s-7"


# =============================================================== 7. writers


def test_configured_writers(connect, db, stream):
    """Only listed writers may allocate (55000 otherwise); set_writers() lets
    a new writer in, drops the removed writer's stored position for good (the
    worker does not write it back), and NULL opens the stream to anyone."""
    wa, wb, wc = f"{stream}_a", f"{stream}_b", f"{stream}_c"
    create_stream(db, stream, writers=[wa, wb])
    cached = connect()  # a session with the stream's catalog row cached
    assert commit_ids(cached, stream, wa, 1) == [1]
    assert commit_ids(db, stream, wb, 1) == [2]
    expect_error(db, "SELECT streampos.next_id(%s, %s)", (stream, wc), "55000")
    expect_error(db, "SELECT streampos.writer_position(%s, %s)", (stream, wc), "55000")
    assert in_flight(db, stream) == []
    wait_until(
        lambda: stored_positions(db, stream) == {wa: 2, wb: 2},
        timeout=CATCH_UP_SECONDS,
        message="the worker to store both writers' positions",
    )

    db.execute("SELECT streampos.set_writers(%s, %s::text[])", (stream, [wa, wc]))
    assert stored_positions(db, stream) == {wa: 2, wc: 2}
    assert [r[0] for r in writer_positions(db, stream)] == [wa, wc]
    assert commit_ids(cached, stream, wc, 1) == [3]
    expect_error(cached, "SELECT streampos.next_id(%s, %s)", (stream, wb), "55000")
    wait_until(
        lambda: stored_positions(db, stream) == {wa: 3, wc: 3},
        timeout=CATCH_UP_SECONDS,
        message="the worker to store the new writers' positions",
    )
    time.sleep(0.5)  # two more worker passes: b's row must stay gone
    assert stored_positions(db, stream) == {wa: 3, wc: 3}

    db.execute("SELECT streampos.set_writers(%s, NULL)", (stream,))
    assert commit_ids(cached, stream, f"{stream}_anyone", 2) == [4, 5]
    assert commit_ids(db, stream, wb, 1) == [6]
    assert frontier(db, stream) == 6


def test_set_writers_is_seen_by_session_that_read_the_stream_in_an_older_snapshot(connect, db, stream):
    """A session that read the stream inside a REPEATABLE READ transaction
    begun before set_writers() committed must, in its next transaction, let
    the newly added writer allocate."""
    wa, wb, wc = f"{stream}_a", f"{stream}_b", f"{stream}_c"
    create_stream(db, stream, writers=[wa, wb])
    instance_id(db, wc)
    reader = connect()
    reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    assert one(reader, "SELECT 1") == 1
    db.execute("SELECT streampos.set_writers(%s, %s::text[])", (stream, [wa, wc]))
    assert frontier(reader, stream) == 0
    reader.execute("COMMIT")
    # A new transaction, after set_writers() committed.
    assert next_id(reader, stream, wc) == 1


def test_recreated_stream_is_seen_by_session_that_read_it_in_an_older_snapshot(connect, db, stream):
    """A stream dropped and created again under the same name is, in the
    next transaction of a session that had read the old one, the new stream:
    frontier 0, first ID 1."""
    create_stream(db, stream)
    assert commit_ids(db, stream, "w", 5) == [1, 2, 3, 4, 5]
    reader = connect()
    reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    assert one(reader, "SELECT 1") == 1
    db.execute("SELECT streampos.drop_stream(%s)", (stream,))
    create_stream(db, stream)
    try:
        frontier(reader, stream)  # the session reads the stream in its old snapshot
    except psycopg.Error:
        pass
    reader.execute("COMMIT")
    assert frontier(db, stream) == 0
    assert (frontier(reader, stream), next_id(reader, stream, "w")) == (0, 1)


# =============================================================== 8. errors


def test_unknown_stream_and_instance_are_42704(db, stream):
    """Unknown streams (writing and reading) and unknown instance ids raise
    42704 and name the object."""
    missing = f"{stream}_missing"
    for sql, params in [
        ("SELECT streampos.next_id(%s, 'w')", (missing,)),
        ("SELECT streampos.next_ids(%s, 'w', 2)", (missing,)),
        ("SELECT streampos.frontier(%s)", (missing,)),
        ("SELECT streampos.max_allocated(%s)", (missing,)),
        ("SELECT streampos.writer_position(%s, 'w')", (missing,)),
        ("SELECT * FROM streampos.writer_positions(%s)", (missing,)),
        ("SELECT streampos.current_token(%s)", (missing,)),
        ("SELECT streampos.current_room_token(%s)", (missing,)),
        ("SELECT * FROM streampos.in_flight(%s)", (missing,)),
        ("SELECT * FROM streampos.check_stream(%s)", (missing,)),
    ]:
        err = expect_error(db, sql, params, "42704")
        assert missing in err.diag.message_primary
    unused = one(db, "SELECT coalesce(max(instance_id), 0) + 1000 FROM streampos.instances")
    err = expect_error(db, "SELECT streampos.instance_name(%s)", (unused,), "42704")
    assert str(unused) in err.diag.message_primary


def test_not_a_writer_is_55000_and_leaves_nothing(db, stream):
    """A writer not in the stream's list gets 55000, and nothing is left in
    flight."""
    create_stream(db, stream, writers=[f"{stream}_a"])
    db.execute("BEGIN")
    err = expect_error(db, "SELECT streampos.next_id(%s, %s)", (stream, f"{stream}_x"), "55000")
    assert f"{stream}_x" in err.diag.message_primary
    db.execute("ROLLBACK")
    assert in_flight(db, stream) == []
    assert (frontier(db, stream), max_allocated(db, stream)) == (0, 0)


@pytest.mark.parametrize("n", [0, -1])
def test_next_ids_bad_count_is_22023(db, stream, n):
    """next_ids with n < 1 raises 22023 and allocates nothing."""
    create_stream(db, stream)
    expect_error(db, "SELECT streampos.next_ids(%s, 'w', %s::int)", (stream, n), "22023")
    assert max_allocated(db, stream) == 0
    assert in_flight(db, stream) == []


def test_prepare_transaction_after_allocation_is_0A000_and_rolls_back(connect, db, stream):
    """PREPARE TRANSACTION of a transaction holding IDs fails with 0A000; the
    transaction is rolled back (its row is gone) and its IDs are released."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY)")
    w = f"{stream}_w"
    a = connect()
    a.execute("BEGIN")
    (k,) = next_ids(a, stream, w, 1)
    a.execute(f"INSERT INTO {table} VALUES (%s)", (k,))
    gid = f"{stream}_gid"
    err = expect_error(a, "PREPARE TRANSACTION %s" % psycopg.sql.quote(gid), None, "0A000")
    assert "PREPARE" in err.diag.message_primary
    assert a.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert one(db, "SELECT count(*) FROM pg_prepared_xacts WHERE gid = %s", (gid,)) == 0
    assert in_flight(db, stream) == []
    assert k == 1
    wait_until(lambda: frontier(db, stream) == 1, timeout=CATCH_UP_SECONDS, message="frontier 1")
    assert one(db, f"SELECT count(*) FROM {table}") == 0
    # The session goes on normally.
    assert commit_ids(a, stream, w, 1) == [2]


def test_read_only_transaction_is_25006(connect, db, stream):
    """Allocating in a read-only transaction (BEGIN READ ONLY or
    default_transaction_read_only) raises 25006 and leaves nothing."""
    create_stream(db, stream)
    a = connect()
    a.execute("BEGIN READ ONLY")
    expect_error(a, "SELECT streampos.next_id(%s, 'w')", (stream,), "25006")
    a.execute("ROLLBACK")
    a.execute("SET default_transaction_read_only = on")
    expect_error(a, "SELECT streampos.next_id(%s, 'w')", (stream,), "25006")
    a.execute("BEGIN")
    expect_error(a, "SELECT streampos.next_ids(%s, 'w', 3)", (stream,), "25006")
    a.execute("ROLLBACK")
    assert in_flight(db, stream) == []
    assert max_allocated(db, stream) == 0
    a.execute("SET default_transaction_read_only = off")
    assert next_id(a, stream, "w") == 1


def _registry_full_case(connect, db, streams, writers):
    """Allocate in one transaction for each (stream, writer) pair; the last
    pair must overflow the per-transaction registry."""
    a = connect()
    a.execute("BEGIN")
    for s, w in zip(streams[:-1], writers[:-1]):
        next_id(a, s, w)
    err = expect_error(a, "SELECT streampos.next_id(%s, %s)", (streams[-1], writers[-1]), "53400")
    assert "streampos.max_streams_per_transaction" in (err.diag.message_hint or ""), err.diag.message_hint
    a.execute("ROLLBACK")
    for s in set(streams):
        assert in_flight(db, s) == [], f"{s} still has IDs in flight"
        wait_until(
            lambda: frontier(db, s) == max_allocated(db, s),
            timeout=CATCH_UP_SECONDS,
            message=f"{s}: frontier = max_allocated",
        )
    return a


def test_registry_full_is_53400_with_hint_and_leaks_nothing(connect, db, stream):
    """Allocating in more distinct streams than
    streampos.max_streams_per_transaction in one transaction raises 53400
    with a HINT naming that setting; after the rollback nothing is in flight
    and a transaction of the maximum size works again."""
    limit = int(one(db, "SHOW streampos.max_streams_per_transaction"))
    streams = [f"{stream}_{i}" for i in range(limit + 1)]
    for s in streams:
        create_stream(db, s)
    a = _registry_full_case(connect, db, streams, ["w"] * len(streams))
    assert [frontier(db, s) for s in streams] == [1] * limit + [0]
    a.execute("BEGIN")
    assert [next_id(a, s, "w") for s in streams[:limit]] == [2] * limit
    durable_commit(a)
    assert [frontier(db, s) for s in streams[:limit]] == [2] * limit


def test_registry_full_counts_stream_writer_pairs(connect, db, stream):
    """The per-transaction limit counts (stream, writer) pairs: one stream
    with one writer too many also raises 53400 and leaks nothing."""
    limit = int(one(db, "SHOW streampos.max_streams_per_transaction"))
    create_stream(db, stream)
    writers = [f"{stream}_w{i}" for i in range(limit + 1)]
    _registry_full_case(connect, db, [stream] * len(writers), writers)
    assert frontier(db, stream) == limit


# =============================================================== 9. durable table


def test_stream_positions_catch_up_and_never_run_ahead(connect, db, stream, pool):
    """While two writers commit (one sometimes holding IDs for a while),
    stream_positions is never ahead of writer_position for the same or a
    later snapshot and never goes backwards; after the last commit it catches
    up within a second; check_stream() is all ok."""
    create_stream(db, stream)
    writers = [f"{stream}_a", f"{stream}_b"]
    for w in writers:
        instance_id(db, w)
    conns = [connect(), connect()]
    stop = threading.Event()

    def writer_loop(i):
        rnd = random.Random(i)
        for _ in range(2000):
            if stop.is_set():
                break
            hold_ids(conns[i], stream, writers[i], rnd.randint(1, 3))
            time.sleep(rnd.uniform(0, 0.05 if i == 0 else 0.005))
            conns[i].execute("COMMIT")

    futures = [pool.submit(writer_loop, i) for i in range(2)]
    violations, last_stored, n_samples = [], {}, 0
    deadline = time.monotonic() + 2.0
    try:
        while time.monotonic() < deadline:
            # Same statement (snapshot) as the stored rows.
            for name, stored, live in rows(
                db,
                "SELECT instance_name, stream_id, streampos.writer_position(%s, instance_name) "
                "FROM streampos.stream_positions WHERE stream_name = %s",
                (stream, stream),
            ):
                n_samples += 1
                if stored > live:
                    violations.append(("same snapshot", name, stored, live))
                if stored < last_stored.get(name, 0):
                    violations.append(("went back", name, last_stored[name], stored))
                last_stored[name] = stored
            # A later snapshot.
            for name, stored in stored_positions(db, stream).items():
                live = writer_position(db, stream, name)
                if stored > live:
                    violations.append(("later snapshot", name, stored, live))
            time.sleep(0.01)
    finally:
        stop.set()
    for fut in futures:
        fut.result(timeout=10)
    last_commit = time.monotonic()
    assert not violations, violations[:5]
    assert n_samples > 20

    top = max_allocated(db, stream)
    wait_until(lambda: frontier(db, stream) == top, timeout=CATCH_UP_SECONDS, message=f"frontier {top}")
    wait_until(
        lambda: stored_positions(db, stream) == {writers[0]: top, writers[1]: top},
        timeout=max(0.1, CATCH_UP_SECONDS - (time.monotonic() - last_commit)),
        interval=0.01,
        message=f"stream_positions to reach {top} within a second of the last commit",
    )
    checks = check_rows(db, stream)
    assert [c for c in checks if not c[1]] == [], checks
    assert {c[0] for c in checks} == {"sequence", "positions", "allocated"}


def test_stream_positions_catch_up_within_a_second_of_each_commit(connect, db, stream):
    """Each single commit is reflected in stream_positions within a second."""
    create_stream(db, stream)
    w = f"{stream}_w"
    for n in (1, 3, 2):
        ids = commit_ids(db, stream, w, n)
        wait_until(
            lambda: stored_positions(db, stream) == {w: ids[-1]},
            timeout=CATCH_UP_SECONDS,
            interval=0.01,
            message=f"stream_positions to reach {ids[-1]}",
        )


# =============================================================== 11. check_stream


def test_check_stream_repairs_table_drift_by_moving_the_sequence(connect, db, stream):
    """A row whose ID is above the sequence makes check_stream() report not
    ok; repair moves the sequence forward (the next ID is above the row),
    deletes no rows or positions, and leaves every check ok."""
    seq = create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, note text)")
    db.execute("SELECT streampos.add_table(%s, %s::regclass, 'id')", (stream, table))
    w = f"{stream}_w"
    for i in commit_ids(db, stream, w, 3):
        db.execute(f"INSERT INTO {table} VALUES (%s, 'allocated')", (i,))
    wait_until(lambda: stored_positions(db, stream) == {w: 3}, timeout=CATCH_UP_SECONDS)
    db.execute(f"INSERT INTO {table} VALUES (100, 'drift')")

    checks = {name: (ok, detail) for name, ok, detail in check_rows(db, stream)}
    assert checks[f"table public.{table}"][0] is False, checks
    assert "100" in checks[f"table public.{table}"][1]
    assert checks["sequence"][0] is True and checks["positions"][0] is True
    assert checks["repair"][0] is False
    assert sequence_value(db, seq) == 3  # checking alone changes nothing

    checks = {name: (ok, detail) for name, ok, detail in check_rows(db, stream, repair=True)}
    assert checks["repair"][0] is True, checks
    assert sequence_value(db, seq) == 100
    assert one(db, f"SELECT count(*) FROM {table}") == 4
    assert stored_positions(db, stream) == {w: 3}
    # The skipped values are never handed out: nothing holds the frontier back.
    assert (frontier(db, stream), max_allocated(db, stream)) == (100, 100)
    assert next_id(db, stream, w) == 101
    assert all(ok for _, ok, _ in check_rows(db, stream)), check_rows(db, stream)


def test_check_stream_repairs_positions_ahead_of_the_sequence(connect, db, stream):
    """A stored position 32 ahead of the sequence (the failover case) makes
    check_stream() report not ok; repair moves the sequence forward to it,
    keeps every stored position, and allocation continues above it."""
    seq = create_stream(db, stream)
    w = f"{stream}_w"
    assert commit_ids(db, stream, w, 2) == [1, 2]
    wait_until(lambda: stored_positions(db, stream) == {w: 2}, timeout=CATCH_UP_SECONDS)
    ghost = f"{stream}_ghost"
    db.execute(
        "INSERT INTO streampos.stream_positions (stream_name, instance_name, stream_id) VALUES (%s, %s, %s)",
        (stream, ghost, 2 + 32),
    )
    checks = {name: (ok, detail) for name, ok, detail in check_rows(db, stream)}
    assert checks["positions"][0] is False, checks
    assert "34" in checks["positions"][1]
    assert checks["repair"][0] is False
    assert sequence_value(db, seq) == 2

    checks = {name: (ok, detail) for name, ok, detail in check_rows(db, stream, repair=True)}
    assert checks["repair"][0] is True, checks
    assert sequence_value(db, seq) == 34
    assert stored_positions(db, stream) == {w: 2, ghost: 34} or stored_positions(db, stream) == {w: 34, ghost: 34}
    assert frontier(db, stream) == 34
    assert next_id(db, stream, w) == 35
    wait_until(
        lambda: stored_positions(db, stream).get(w) == 35,
        timeout=CATCH_UP_SECONDS,
        message="the worker to store the position above the repaired sequence",
    )
    assert stored_positions(db, stream)[ghost] == 34
    assert all(ok for _, ok, _ in check_rows(db, stream)), check_rows(db, stream)


def test_check_stream_repairs_backward_stream(connect, db, stream):
    """Repair works in a backward stream's numbering: a row at -50 moves the
    sequence to 50 and the next ID is -51."""
    seq = create_stream(db, stream, backwards=True)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY)")
    db.execute("SELECT streampos.add_table(%s, %s::regclass, 'id')", (stream, table))
    w = f"{stream}_w"
    for i in commit_ids(db, stream, w, 2):
        db.execute(f"INSERT INTO {table} VALUES (%s)", (i,))
    db.execute(f"INSERT INTO {table} VALUES (-50)")
    checks = {name: (ok, detail) for name, ok, detail in check_rows(db, stream)}
    assert checks[f"table public.{table}"][0] is False, checks
    checks = {name: (ok, detail) for name, ok, detail in check_rows(db, stream, repair=True)}
    assert checks["repair"][0] is True, checks
    assert sequence_value(db, seq) == 50
    assert frontier(db, stream) == -50
    assert next_id(db, stream, w) == -51
    assert one(db, f"SELECT count(*) FROM {table}") == 3
