"""Third round of attacks, on the lock-free readers: `frontier()` and the
other readers copy the registry as seqlock readers, while the allocation
sections add entries without moving the seqlock counter and an ending
transaction swaps its slot out of the active list. Last, a repair by
`check_stream` racing writers (found by the Python client's example run).

As in test_attacks.py, each test is one attack. A test whose docstring says
BREAKS fails on the code it was written against; a test that says
WITHSTANDS passes and stays as a regression test.

What these tests cannot show: the ordering of the reader's loads on a
weakly ordered CPU. The test machines are x86-64 (loads are not reordered
with loads there), so the acquire fence between the highest allocated ID
and the active-slot counts (`Raw::for_each_active`) is argued in
docs/design.md, "Reading without the lock", not tested.
"""

import random
import threading
import time

import psycopg

from support import (
    CATCH_UP_SECONDS,
    backend_pid,
    commit_ids,
    create_stream,
    durable_commit,
    frontier,
    in_flight,
    max_allocated,
    next_id,
    next_ids,
    one,
    paused_next_id,
    rows,
    samples_missing_rows,
    wait_until,
    writer_position,
)


def hold_id(conn, stream, writer):
    conn.execute("BEGIN")
    return next_id(conn, stream, writer)


# =====================================================================
# A pending entry whose slot is swapped around the active list
# =====================================================================


def test_a_paused_allocation_holds_while_its_slot_moves_in_the_active_list(db, connect, stream, pool):
    """WITHSTANDS. Writer A publishes its lower bound (a pending entry; its
    slot is appended last to the active list) and pauses before nextval.
    B and C, whose slots came first, end: B's end moves A's slot into B's
    place, C's end shrinks the list; D then allocates and commits above A's
    lower bound (its slot appended after A's, then swapped out). Through all
    of it readers (lock-free) hold the stream below A's lower bound, and A's
    own ID, taken after D's, is the next one."""
    create_stream(db, stream)
    wa, wb, wc, wd = (f"{stream}_{x}" for x in "abcd")
    b, c, d, a = connect(), connect(), connect(), connect()
    db.execute("BEGIN")
    next_ids(db, stream, wb, 3)
    durable_commit(db)
    assert hold_id(b, stream, wb) == 4
    assert hold_id(c, stream, wc) == 5
    fut, started = paused_next_id(pool, db, a, stream, wa, 3000)
    # A's lower bound is 6: nothing can pass 5 while A is paused.
    durable_commit(b)
    assert frontier(db, stream) == 4
    durable_commit(c)
    assert frontier(db, stream) == 5
    assert hold_id(d, stream, wd) == 6
    assert frontier(db, stream) == 5
    durable_commit(d)
    observed = (
        frontier(db, stream),
        writer_position(db, stream, wd),
        max_allocated(db, stream),
        sorted(r[3] for r in in_flight(db, stream)),
    )
    assert not fut.done() and time.monotonic() - started < 3.0, (
        "A's nextval finished before the readers looked: the machine is too slow for this test"
    )
    # D's position too: A's lower bound holds every writer until A records
    # its WAL position.
    assert observed == (5, 5, 6, [6])
    assert fut.result(timeout=10) == 7
    assert frontier(db, stream) == 6
    durable_commit(a)
    assert frontier(db, stream) == 7


# =====================================================================
# Many short transactions: the active list churns under lock-free readers
# =====================================================================


def test_lock_free_readers_miss_no_row_while_many_slots_start_and_end(db, connect, stream, pool):
    """WITHSTANDS. Twelve writers run short transactions (one or two
    streams, so slots hold one or two entries; commit, rollback, or their
    backend terminated mid-transaction), so backend slots enter and leave
    the active list in scrambled order all the time, while READ COMMITTED
    readers (frontier and the rows at or below it in one statement) and a
    REPEATABLE READ reader sample. Afterwards, for every sample, the
    committed IDs at or below its frontier are exactly the rows it saw, and
    no READ COMMITTED reader's frontier went back."""
    seed = random.randrange(1 << 30)
    print(f"random seed {seed}")
    create_stream(db, stream)
    other = f"{stream}_o"
    create_stream(db, other)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY)")

    n_writers, duration = 12, 5.0
    stop = threading.Event()
    pids = {}
    lock = threading.Lock()
    samples = []  # (kind, frontier, frozenset of ids <= frontier seen)
    counts = {"commit": 0, "rollback": 0, "terminated": 0}

    def writer_loop(i):
        rnd = random.Random(seed + i)
        name = f"{stream}_w{i % 4}"
        conn = connect()
        with lock:
            pids[i] = backend_pid(conn)
        while not stop.is_set():
            try:
                conn.execute("BEGIN")
                if rnd.random() < 0.5:
                    next_id(conn, other, name)
                ids = next_ids(conn, stream, name, rnd.randint(1, 2))
                if rnd.random() < 0.3:
                    ids.append(next_id(conn, stream, f"{name}_x"))
                for id_ in ids:
                    conn.execute(f"INSERT INTO {table} VALUES (%s)", (id_,))
                time.sleep(rnd.uniform(0, 0.002))
                if rnd.random() < 0.2:
                    conn.execute("ROLLBACK")
                    outcome = "rollback"
                else:
                    conn.execute("COMMIT")
                    outcome = "commit"
            except psycopg.OperationalError:
                outcome = "terminated"
                conn = connect()
                with lock:
                    pids[i] = backend_pid(conn)
            with lock:
                counts[outcome] += 1

    def killer():
        rnd = random.Random(seed - 2)
        conn = connect()
        while not stop.wait(0.15):
            with lock:
                pid = pids.get(rnd.randrange(n_writers))
            if pid is not None:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE pid = %s AND state = 'idle in transaction'",
                    (pid,),
                )

    plain = f"""SELECT f, (SELECT array_agg(id) FROM {table} WHERE id <= x.f)
                FROM (SELECT streampos.frontier(%s) AS f OFFSET 0) x"""

    def rc_loop():
        conn = connect()
        last = None
        while not stop.is_set():
            f, ids = conn.execute(plain, (stream,)).fetchone()
            assert last is None or f >= last, f"READ COMMITTED frontier went back from {last} to {f}"
            last = f
            with lock:
                samples.append(("rc", f, frozenset(ids or ())))

    def rr_loop():
        conn = connect()
        rnd = random.Random(seed - 1)
        while not stop.is_set():
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            first = None
            for _ in range(3):
                f = frontier(conn, stream)
                ids = one(conn, f"SELECT array_agg(id) FROM {table} WHERE id <= %s", (f,))
                assert first is None or f == first, f"one snapshot, two frontiers: {first} then {f}"
                first = f
                with lock:
                    samples.append(("rr", f, frozenset(ids or ())))
                time.sleep(rnd.uniform(0, 0.005))
            conn.execute("COMMIT")

    futures = [pool.submit(writer_loop, i) for i in range(n_writers)]
    futures += [pool.submit(rc_loop) for _ in range(2)]
    futures += [pool.submit(rr_loop), pool.submit(killer)]
    try:
        time.sleep(duration)
    finally:
        stop.set()
    for fut in futures:
        fut.result(timeout=60)

    final = {r[0] for r in rows(db, f"SELECT id FROM {table}")}
    print(f"transactions {counts}, {len(samples)} samples, {len(final)} rows")
    top = max_allocated(db, stream)
    wait_until(lambda: frontier(db, stream) == top, timeout=CATCH_UP_SECONDS, message=f"frontier {top}")
    assert in_flight(db, stream) == [] and in_flight(db, other) == []
    assert counts["commit"] > 100 and counts["rollback"] > 10 and counts["terminated"] > 0, counts
    kinds = {k for k, _, _ in samples}
    assert kinds == {"rc", "rr"} and len(samples) > 100
    missed = samples_missing_rows(samples, final)
    assert not missed, f"{len(missed)} samples missed committed rows, e.g. {missed[:5]}"
    assert len({f for _, f, _ in samples}) > 20


def test_a_repair_racing_writers_never_moves_the_sequence_back(db, connect, stream, pool):
    """BREAKS (0.2.0 before the fix; found when the Python client's
    generators, which repair at start-up, met other processes' writers):
    `check_stream(…, repair => true)` read the sequence, then the tables and
    the registry. Rows committed in between looked like a sequence lagging
    behind them, and setval moved the sequence back to them: the next
    allocation got an ID already handed out (refused by the per-ID check,
    55000). A repair now reads the sequence last, and when it must move
    it, holds it against allocation and checks again. A writer holding an
    ID throughout shows that a repair with nothing to repair does not ask
    for that lock (it would wait for the holder: 55P03 here)."""
    create_stream(db, stream)
    table = f"{stream}_rows"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, writer text)")
    db.execute("SELECT streampos.add_table(%s, %s::regclass, 'id', 'writer')", (stream, table))
    # The writer's instance exists first: a transaction creating it would
    # make every other first use of the name wait for its end.
    commit_ids(db, stream, "w1")
    holder = connect()
    holder.execute("BEGIN")
    next_id(holder, stream, "w1")
    stop = time.monotonic() + 4
    errors, committed = [], []

    def writer():
        conn = connect()
        while time.monotonic() < stop:
            try:
                with conn.transaction():
                    new = next_id(conn, stream, "w1")
                    conn.execute(f"INSERT INTO {table} VALUES (%s, 'w1')", (new,))
                committed.append(new)
            except psycopg.Error as e:
                errors.append(f"{e.sqlstate}: {e.diag.message_primary}")
        return 0

    def repairer():
        conn = connect()
        conn.execute("SET lock_timeout = '1s'")
        repairs = 0
        while time.monotonic() < stop:
            try:
                rows(conn, "SELECT * FROM streampos.check_stream(%s, repair => true)", (stream,))
                repairs += 1
            except psycopg.Error as e:
                errors.append(f"repair: {e.sqlstate}: {e.diag.message_primary}")
        return repairs

    futures = [pool.submit(writer) for _ in range(4)] + [pool.submit(repairer) for _ in range(2)]
    try:
        repairs = sum(f.result(timeout=60) for f in futures)
    finally:
        holder.execute("ROLLBACK")
    assert repairs > 10 and len(committed) > 100, (repairs, len(committed))
    assert not errors, f"{len(errors)} calls failed, e.g. {errors[:3]}"
    assert len(set(committed)) == len(committed)
    assert one(db, f"SELECT count(*) FROM {table}") == len(committed)
    assert one(db, "SELECT streampos.max_allocated(%s)", (stream,)) >= max(committed)
