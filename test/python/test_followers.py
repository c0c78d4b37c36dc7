"""Followers: streampos.wait_for() and the streampos.updates() replication feed,
against real concurrent sessions."""

import os
import random
import subprocess
import sys
import threading
import time

import psycopg
import pytest

import support
from support import create_stream, expect_error, one

WRITERS = ["w1", "w2", "w3", "w4"]


def parse_updates(answer):
    """{"token", "limited", "data"} -> (token, limited, {table: [row, ...]}).
    Table names are schema-qualified (as regclass prints them)."""
    data = answer["data"]
    tables = {}
    i = 0
    while i < len(data):
        header = data[i]
        name, _position, row_count, column_count = header[:4]
        assert len(header) == 4 + column_count, header
        tables[name] = data[i + 1 : i + 1 + row_count]
        i += 1 + row_count
    return answer["token"], answer["limited"], tables


def setup_feed(conn, stream):
    """A stream spanning two tables, like a homeserver's events stream."""
    create_stream(conn, stream, writers=WRITERS)
    conn.execute(f"CREATE TABLE {stream}_ev (id bigint PRIMARY KEY, instance_name text, body text)")
    conn.execute(f"CREATE TABLE {stream}_delta (stream_id bigint, instance_name text, note text)")
    conn.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, f"{stream}_ev"))
    conn.execute(
        "SELECT streampos.add_table(%s, %s, 'stream_id', 'instance_name')", (stream, f"{stream}_delta")
    )


def test_follower_gets_every_committed_row_once_in_writer_order(connect, stream):
    """Four writers commit and abort at random while a follower loops on
    updates() with a small max_rows: it ends with exactly the committed rows,
    each once, and each writer's rows in ID order."""
    admin = connect()
    setup_feed(admin, stream)
    committed = []  # (table, id, writer)
    lock = threading.Lock()
    stop = threading.Event()
    errors = []

    def writer(name, seed):
        rng = random.Random(seed)
        conn = connect()
        try:
            while not stop.is_set():
                n = rng.randint(1, 3)
                conn.execute("BEGIN")
                ids = one(conn, "SELECT streampos.next_ids(%s, %s, %s)", (stream, name, n))
                rows = []
                for i in ids:
                    conn.execute(f"INSERT INTO {stream}_ev VALUES (%s, %s, 'x')", (i, name))
                    rows.append((f"public.{stream}_ev", i, name))
                    if rng.random() < 0.5:
                        # Several delta rows can share one stream ID.
                        for _ in range(rng.randint(1, 3)):
                            conn.execute(f"INSERT INTO {stream}_delta VALUES (%s, %s, 'd')", (i, name))
                            rows.append((f"public.{stream}_delta", i, name))
                time.sleep(rng.random() * 0.004)
                if rng.random() < 0.15:
                    conn.execute("ROLLBACK")
                else:
                    conn.execute("COMMIT")
                    with lock:
                        committed.extend(rows)
        except Exception as e:  # surfaced below
            errors.append(e)
            stop.set()

    received = []  # (table, id, writer) in arrival order
    follower_done = threading.Event()
    writers_finished = threading.Event()

    def follower():
        conn = connect()
        token = "0"
        try:
            while True:
                writers_done = writers_finished.is_set()
                answer = one(
                    conn, "SELECT streampos.updates(%s, %s, 7, 200)", (stream, token)
                )
                token, limited, tables = parse_updates(answer)
                for table, rows in tables.items():
                    for row in rows:
                        received.append((table, row[0], row[1]))
                if writers_done and not limited and not any(tables.values()):
                    break
        except Exception as e:
            errors.append(e)
        finally:
            follower_done.set()

    threads = [threading.Thread(target=writer, args=(w, i)) for i, w in enumerate(WRITERS)]
    follow = threading.Thread(target=follower)
    for t in threads:
        t.start()
    follow.start()
    time.sleep(4)
    stop.set()
    for t in threads:
        t.join(30)
    writers_finished.set()
    follow.join(60)
    assert follower_done.is_set(), "follower did not finish"
    assert not errors, errors

    assert len(committed) > 50, "the load produced too little to prove anything"
    # As multisets: several delta rows may share (table, id, writer).
    assert sorted(received) == sorted(committed)
    for w in WRITERS:
        ids = [i for table, i, writer in received if writer == w and table.endswith("_ev")]
        assert ids == sorted(ids), f"{w}'s rows arrived out of order"


def test_limited_answer_continues_exactly(connect, stream):
    """max_rows cuts at an ID boundary; the returned token continues with no
    row skipped or repeated; one ID with more rows than max_rows comes whole."""
    conn = connect()
    setup_feed(conn, stream)
    conn.execute("BEGIN")
    for w in ["w1", "w2"]:
        for _ in range(3):
            i = one(conn, "SELECT streampos.next_id(%s, %s)", (stream, w))
            conn.execute(f"INSERT INTO {stream}_ev VALUES (%s, %s, 'x')", (i, w))
    big = one(conn, "SELECT streampos.next_id(%s, 'w3')", (stream,))
    for _ in range(5):
        conn.execute(f"INSERT INTO {stream}_delta VALUES (%s, 'w3', 'many')", (big,))
    conn.execute("COMMIT")

    token, seen, answers = "0", [], []
    for _ in range(20):
        token, limited, tables = parse_updates(one(conn, "SELECT streampos.updates(%s, %s, 2)", (stream, token)))
        answers.append(sum(len(r) for r in tables.values()))
        seen += [(t, row[0]) for t, rows in tables.items() for row in rows]
        if not limited:
            break
    expected = [(f"public.{stream}_ev", i) for i in range(1, 7)] + [(f"public.{stream}_delta", 7)] * 5
    assert sorted(seen) == sorted(expected)
    assert answers[:3] == [2, 2, 2] and answers[3] == 5, answers
    assert token == "7"


def test_position_only_advance_returns_new_token(connect, stream):
    """A commit that adds no rows still moves the token, so a follower never
    asks twice for the same position."""
    conn = connect()
    setup_feed(conn, stream)
    conn.execute("SELECT streampos.next_id(%s, 'w1')", (stream,))
    token, limited, tables = parse_updates(one(conn, "SELECT streampos.updates(%s, '0')", (stream,)))
    assert (token, limited) == ("1", False)
    assert all(rows == [] for rows in tables.values()) and len(tables) == 2


def test_updates_waits_for_a_commit(connect, stream, pool):
    """With a timeout, updates() blocks until a writer moves past since."""
    conn, writer = connect(), connect()
    setup_feed(conn, stream)
    future = pool.submit(lambda: one(conn, "SELECT streampos.updates(%s, '0', 10, 20000)", (stream,)))
    time.sleep(0.3)
    assert not future.done()
    writer.execute("BEGIN")
    i = one(writer, "SELECT streampos.next_id(%s, 'w2')", (stream,))
    writer.execute(f"INSERT INTO {stream}_ev VALUES (%s, 'w2', 'late')", (i,))
    writer.execute("COMMIT")
    token, _, tables = parse_updates(future.result(timeout=10))
    assert token == "1"
    assert tables[f"public.{stream}_ev"] == [[1, "w2", "late"]]


def test_wait_for_returns_after_the_satisfying_commit(connect, stream, pool):
    """wait_for() sleeps while the frontier is below the target and returns
    as soon as the commit that reaches it happens, long before its timeout."""
    conn, writer, waiter = connect(), connect(), connect()
    create_stream(conn, stream)
    writer.execute("BEGIN")
    assert one(writer, "SELECT streampos.next_id(%s, 'w1')", (stream,)) == 1
    start = time.monotonic()
    future = pool.submit(lambda: one(waiter, "SELECT streampos.wait_for(%s, 1, 20000)", (stream,)))
    time.sleep(0.3)
    assert not future.done(), "wait_for returned while the ID was in flight"
    writer.execute("COMMIT")
    assert future.result(timeout=10) == 1
    # Returned because of the commit, not the 20 s timeout.
    assert time.monotonic() - start < 10


def test_wait_for_times_out_with_the_current_frontier(connect, stream):
    conn, writer = connect(), connect()
    create_stream(conn, stream)
    conn.execute("SELECT streampos.next_id(%s, 'w1')", (stream,))
    # IDs 2..5 allocated and still in flight: 5 is a position this server
    # handed out, so waiting for it is a wait, not a resynchronise error.
    writer.execute("BEGIN")
    writer.execute("SELECT streampos.next_ids(%s, 'w1', 4)", (stream,))
    start = time.monotonic()
    assert one(conn, "SELECT streampos.wait_for(%s, 5, 300)", (stream,)) == 1
    assert time.monotonic() - start >= 0.3
    # Already reached: no wait at all.
    assert one(conn, "SELECT streampos.wait_for(%s, 1, 60000)", (stream,)) == 1


def test_wait_for_is_cancellable(connect, stream, pool):
    """Query cancel and statement_timeout interrupt the sleep."""
    conn, waiter, writer = connect(), connect(), connect()
    create_stream(conn, stream)
    writer.execute("BEGIN")
    writer.execute("SELECT streampos.next_ids(%s, 'w1', 100)", (stream,))
    pid = one(waiter, "SELECT pg_backend_pid()")
    future = pool.submit(lambda: waiter.execute("SELECT streampos.wait_for(%s, 100, 60000)", (stream,)))
    time.sleep(0.3)
    assert one(conn, "SELECT pg_cancel_backend(%s)", (pid,))
    with pytest.raises(psycopg.errors.QueryCanceled):
        future.result(timeout=10)
    waiter.execute("SET statement_timeout = '200ms'")
    expect_error(waiter, "SELECT streampos.wait_for(%s, 100, 60000)", (stream,), sqlstate="57014")


@pytest.mark.parametrize("backwards", [False, True])
def test_wait_for_the_next_id_waits_for_anything_new(connect, stream, pool, backwards):
    """Issue 32. A follower with its own query waits for anything new past
    the position p it holds with wait_for(stream, p + 1) (p - 1 backwards):
    on a caught-up stream that was 72000 ("resynchronise") at once. Now a
    timeout answers p (nothing yet), a commit wakes it, and only a target
    further out is 72000."""
    conn, writer = connect(), connect()
    create_stream(conn, stream, backwards=backwards)
    step = -1 if backwards else 1
    p = one(conn, "SELECT streampos.next_id(%s, 'w1')", (stream,))
    assert one(conn, "SELECT streampos.wait_for(%s, %s, 50)", (stream, p + step)) == p
    expect_error(conn, "SELECT streampos.wait_for(%s, %s, 0)", (stream, p + 2 * step), sqlstate="72000")
    future = pool.submit(lambda: one(connect(), "SELECT streampos.wait_for(%s, %s, 20000)", (stream, p + step)))
    time.sleep(0.3)
    assert not future.done()
    writer.execute("SELECT streampos.next_id(%s, 'w1')", (stream,))
    assert future.result(timeout=10) == p + step


def scheduled_slices(pid):
    """How often the kernel has put process `pid` on a CPU (schedstat)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[2])


@pytest.mark.parametrize(
    "call",
    [
        "SELECT streampos.wait_for(%(s)s, %(next)s, 2000)",
        "SELECT streampos.updates(%(s)s, %(token)s, 100, 2000)",
    ],
)
def test_an_idle_wait_sleeps(connect, stream, call):
    """Issue 32. An idle long-poll re-checked every 100 ms and ended each
    window with a timed sleep of 0 ms, which returns at once: the loop spun
    for the last fraction of a millisecond (1 261 wake-ups in 3 s). Now,
    while every WAL record is durable (nothing can move a position but an
    allocation's end, which wakes it), it wakes twice a second, to see
    whether its client is still there."""
    if not os.path.exists("/proc/self/schedstat"):
        pytest.skip("no /proc/<pid>/schedstat")
    conn, waiter = connect(), connect()
    create_stream(conn, stream)
    p = one(conn, "SELECT streampos.next_id(%s, 'w1')", (stream,))
    pid = one(waiter, "SELECT pg_backend_pid()")
    try:
        before = scheduled_slices(pid)
    except (FileNotFoundError, PermissionError):
        pytest.skip("the server's processes are not readable here")
    waiter.execute(call, {"s": stream, "next": p + 1, "token": str(p)})
    woken = scheduled_slices(pid) - before
    assert woken < 40, f"{woken} wake-ups in a 2 s idle wait"


def test_a_killed_clients_wait_ends(connect, stream):
    """Issue 32. A long-polling client killed with SIGKILL left its backend
    waiting until the timeout (30 s in the README's example), holding its
    transaction and a consumer's lock. The wait now notices the closed
    connection within its next re-check and the backend exits."""
    conn = connect()
    create_stream(conn, stream)
    p = one(conn, "SELECT streampos.next_id(%s, 'w1')", (stream,))
    script = (
        "import psycopg, sys\n"
        f"c = psycopg.connect({support.conninfo_string()!r}, autocommit=True, application_name='killed_{stream}')\n"
        f"c.execute('SELECT streampos.wait_for(%s, %s, 30000)', ({stream!r}, {p + 1}))\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        support.wait_until(
            lambda: one(conn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                        "AND query LIKE '%%wait_for%%'", (f"killed_{stream}",)) == 1,
            timeout=10, message="the client's wait",
        )
    finally:
        child.kill()
        child.wait()
    killed = time.monotonic()
    support.wait_until(
        lambda: one(conn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                    (f"killed_{stream}",)) == 0,
        timeout=5, message="the killed client's backend to end",
    )
    assert time.monotonic() - killed < 2


def test_wait_for_backward_stream(connect, stream, pool):
    """Backward streams wait until the frontier reaches the (negative) ID."""
    conn, writer = connect(), connect()
    create_stream(conn, stream, backwards=True)
    writer.execute("BEGIN")
    assert one(writer, "SELECT streampos.next_id(%s, 'w1')", (stream,)) == -1
    future = pool.submit(lambda: one(conn, "SELECT streampos.wait_for(%s, -1, 20000)", (stream,)))
    time.sleep(0.2)
    assert not future.done()
    writer.execute("COMMIT")
    assert future.result(timeout=10) == -1


def test_updates_follows_its_tables_between_calls(connect, stream):
    """updates() keeps its statements prepared between calls: a column
    renamed or retyped, a table renamed, dropped and created again, given to
    another owner, or a caller's hostile search_path changes what the next
    call reads exactly as if nothing had been kept."""
    conn = connect()
    setup_feed(conn, stream)

    def write(body):
        conn.execute("BEGIN")
        i = one(conn, "SELECT streampos.next_id(%s, 'w1')", (stream,))
        conn.execute(f"INSERT INTO {stream}_ev VALUES (%s, 'w1', %s)", (i, body))
        conn.execute("COMMIT")
        return i

    def feed(since="0"):
        answer = one(conn, "SELECT streampos.updates(%s, %s)", (stream, since))
        headers = [h for h in answer["data"] if isinstance(h[0], str) and h[0].startswith("public.")]
        return parse_updates(answer)[2], {h[0]: h[4:] for h in headers}

    first = write("a")
    rows, columns = feed()
    assert rows[f"public.{stream}_ev"] == [[first, "w1", "a"]]
    assert columns[f"public.{stream}_ev"] == ["id", "instance_name", "body"]

    conn.execute(f"ALTER TABLE {stream}_ev RENAME COLUMN body TO content")
    rows, columns = feed()
    assert columns[f"public.{stream}_ev"] == ["id", "instance_name", "content"]
    assert rows[f"public.{stream}_ev"] == [[first, "w1", "a"]]

    conn.execute(f"ALTER TABLE {stream}_ev ALTER COLUMN content TYPE integer USING length(content)")
    rows, _ = feed()
    assert rows[f"public.{stream}_ev"] == [[first, "w1", 1]]

    conn.execute(f"ALTER TABLE {stream}_ev RENAME TO {stream}_ev2")
    rows, _ = feed()
    assert rows[f"public.{stream}_ev2"] == [[first, "w1", 1]] and f"public.{stream}_ev" not in rows

    # The same name again, a new table: the kept statement of the old name
    # must not read the old one (dropped) or miss the new one.
    conn.execute(f"ALTER TABLE {stream}_ev2 RENAME TO {stream}_ev")
    feed()
    conn.execute(f"DROP TABLE {stream}_ev")
    conn.execute(f"CREATE TABLE {stream}_ev (id bigint PRIMARY KEY, instance_name text, body text)")
    conn.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, f"{stream}_ev"))
    second = write("b")
    rows, _ = feed()
    assert rows[f"public.{stream}_ev"] == [[second, "w1", "b"]]

    # Another owner whose row security would hide a row: the statement runs
    # as the new owner, to whom forced row security applies, with
    # row_security = off: refused, never an answer without the row.
    role = f"{stream}_owner"
    conn.execute(f"CREATE ROLE {role}")
    conn.execute(f"ALTER TABLE {stream}_ev OWNER TO {role}")
    conn.execute(f"ALTER TABLE {stream}_ev ENABLE ROW LEVEL SECURITY")
    conn.execute(f"ALTER TABLE {stream}_ev FORCE ROW LEVEL SECURITY")
    conn.execute(f"CREATE POLICY hide ON {stream}_ev USING (body <> 'b')")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        feed()
    conn.execute(f"ALTER TABLE {stream}_ev DISABLE ROW LEVEL SECURITY")
    rows, _ = feed()
    assert rows[f"public.{stream}_ev"] == [[second, "w1", "b"]]

    # A caller's search_path with functions and operators shadowing the
    # ones the statement uses changes nothing.
    conn.execute(f"CREATE SCHEMA {stream}_evil")
    conn.execute(
        f"CREATE FUNCTION {stream}_evil.jsonb_build_array(bigint, text, text) RETURNS jsonb "
        "LANGUAGE sql AS $$ SELECT '[\"evil\"]'::jsonb $$"
    )
    conn.execute(
        f"CREATE FUNCTION {stream}_evil.evil_le(bigint, bigint) RETURNS boolean "
        "LANGUAGE sql AS $$ SELECT false $$"
    )
    conn.execute(f"CREATE OPERATOR {stream}_evil.<= (FUNCTION = {stream}_evil.evil_le, LEFTARG = bigint, RIGHTARG = bigint)")
    conn.execute(f"SET search_path = {stream}_evil, public")
    rows, _ = feed()
    assert rows[f"public.{stream}_ev"] == [[second, "w1", "b"]]
    conn.execute("RESET search_path")
    conn.execute(f"ALTER TABLE {stream}_ev OWNER TO CURRENT_USER")
    conn.execute(f"DROP ROLE {role}")


def test_updates_tells_tables_apart_after_a_schema_rename(connect, stream):
    """A schema renamed and a new schema of the old name with a table of the
    same name, both tables in the stream: each table's rows come under its
    own name (a statement kept for the old text must not read the new
    table, or the other way round)."""
    conn = connect()
    create_stream(conn, stream, writers=WRITERS)
    conn.execute(f"CREATE SCHEMA {stream}_a")
    conn.execute(f"CREATE TABLE {stream}_a.ev (id bigint PRIMARY KEY, instance_name text, body text)")
    conn.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, f"{stream}_a.ev"))

    def write(table, body):
        conn.execute("BEGIN")
        i = one(conn, "SELECT streampos.next_id(%s, 'w1')", (stream,))
        conn.execute(f"INSERT INTO {table} VALUES (%s, 'w1', %s)", (i, body))
        conn.execute("COMMIT")
        return i

    first = write(f"{stream}_a.ev", "old")
    _, _, tables = parse_updates(one(conn, "SELECT streampos.updates(%s, '0')", (stream,)))
    assert tables == {f"{stream}_a.ev": [[first, "w1", "old"]]}

    conn.execute(f"ALTER SCHEMA {stream}_a RENAME TO {stream}_b")
    conn.execute(f"CREATE SCHEMA {stream}_a")
    conn.execute(f"CREATE TABLE {stream}_a.ev (id bigint PRIMARY KEY, instance_name text, body text)")
    conn.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, f"{stream}_a.ev"))
    second = write(f"{stream}_a.ev", "new")
    _, _, tables = parse_updates(one(conn, "SELECT streampos.updates(%s, '0')", (stream,)))
    assert tables == {
        f"{stream}_b.ev": [[first, "w1", "old"]],
        f"{stream}_a.ev": [[second, "w1", "new"]],
    }


def test_a_busy_follower_takes_a_burst_in_one_call(connect, stream):
    """streampos.follower_batch_ms: a long-polling updates() returns no
    sooner than the window after the session's previous updates(), with
    every commit of the window in its answer; an idle follower, a call
    without a timeout, and a window of 0 answer at once."""
    conn, writer = connect(), connect()
    setup_feed(conn, stream)

    def commit_one():
        writer.execute("BEGIN")
        i = one(writer, "SELECT streampos.next_id(%s, 'w1')", (stream,))
        writer.execute(f"INSERT INTO {stream}_ev VALUES (%s, 'w1', 'x')", (i,))
        writer.execute("COMMIT")
        return i

    def poll(token, timeout=5000):
        started = time.monotonic()
        answer = one(conn, "SELECT streampos.updates(%s, %s, 100, %s)", (stream, token, timeout))
        token, _, tables = parse_updates(answer)
        return token, [r[0] for r in tables[f"public.{stream}_ev"]], time.monotonic() - started

    conn.execute("SET streampos.follower_batch_ms = 400")
    first = commit_one()
    token, ids, elapsed = poll("0")
    assert ids == [first]
    # Idle for longer than the window: the next commit is answered at once.
    time.sleep(0.5)
    burst = [commit_one()]
    token, ids, elapsed = poll(token)
    assert ids == burst and elapsed < 0.3, elapsed
    # Right after an answer, rows already there: the call waits out the
    # window and takes what committed meanwhile too.
    more = [commit_one()]

    def late_commits():
        time.sleep(0.15)
        more.append(commit_one())

    t = threading.Thread(target=late_commits)
    t.start()
    token, ids, elapsed = poll(token)
    t.join()
    assert ids == more and 0.3 < elapsed < 2.0, (ids, more, elapsed)
    # Without a timeout a call never waits.
    again = commit_one()
    token, ids, elapsed = poll(token, timeout=0)
    assert ids == [again] and elapsed < 0.3, elapsed
    # A window of 0: at once, always.
    conn.execute("SET streampos.follower_batch_ms = 0")
    poll(token, timeout=0)
    last = commit_one()
    token, ids, elapsed = poll(token)
    assert ids == [last] and elapsed < 0.3, elapsed


def test_a_table_added_while_a_follower_waits_is_read(connect, stream, pool):
    """A follower waiting in updates() while a table is added to the stream
    and a row is committed to it gets that row: the tables are listed with
    the snapshot the rows are read with, not as they were when it started
    to wait (its token would pass the row for good)."""
    conn, admin, writer = connect(), connect(), connect()
    setup_feed(admin, stream)
    conn.execute("SET streampos.follower_batch_ms = 0")
    token = one(conn, "SELECT streampos.updates(%s, '0')", (stream,))["token"]
    future = pool.submit(lambda: parse_updates(one(conn, "SELECT streampos.updates(%s, %s, 100, 10000)", (stream, token))))
    time.sleep(0.3)
    admin.execute(f"CREATE TABLE {stream}_late (id bigint PRIMARY KEY, instance_name text)")
    admin.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, f"{stream}_late"))
    writer.execute("BEGIN")
    i = one(writer, "SELECT streampos.next_id(%s, 'w1')", (stream,))
    writer.execute(f"INSERT INTO {stream}_late VALUES (%s, 'w1')", (i,))
    writer.execute("COMMIT")
    _, _, tables = future.result(timeout=20)
    assert tables.get(f"public.{stream}_late") == [[i, "w1"]], tables


def test_a_definition_seen_by_an_old_snapshot_is_not_kept(connect, stream):
    """A REPEATABLE READ follower whose snapshot predates a column renamed
    back (the table unusable in its snapshot's catalog) must not leave that
    view cached: the next follower call reads the table's new rows."""
    conn, admin, writer = connect(), connect(), connect()
    setup_feed(admin, stream)
    admin.execute(f"CREATE TABLE {stream}_other (x int)")
    token = one(conn, "SELECT streampos.updates(%s, '0')", (stream,))["token"]
    admin.execute(f"ALTER TABLE {stream}_ev RENAME COLUMN instance_name TO i2")
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    one(conn, "SELECT streampos.frontier(%s)", (stream,))
    admin.execute(f"ALTER TABLE {stream}_ev RENAME COLUMN i2 TO instance_name")
    # A lock not held yet takes in the invalidations, then a call.
    one(conn, f"SELECT count(*) FROM {stream}_other")
    one(conn, "SELECT streampos.updates(%s, %s)", (stream, token))
    conn.execute("COMMIT")
    writer.execute("BEGIN")
    i = one(writer, "SELECT streampos.next_id(%s, 'w1')", (stream,))
    writer.execute(f"INSERT INTO {stream}_ev VALUES (%s, 'w1', 'x')", (i,))
    writer.execute("COMMIT")
    _, _, tables = parse_updates(one(conn, "SELECT streampos.updates(%s, %s)", (stream, token)))
    assert tables.get(f"public.{stream}_ev") == [[i, "w1", "x"]], tables


def test_the_batch_window_is_per_stream(connect, stream):
    """An answer on one stream does not hold back the session's next
    long-poll on another stream whose rows are ready."""
    conn, admin = connect(), connect()
    setup_feed(admin, stream)
    other = f"{stream}_2"
    create_stream(admin, other)
    conn.execute("SET streampos.follower_batch_ms = 1000")
    admin.execute("SELECT streampos.next_id(%s, 'w1')", (other,))
    one(conn, "SELECT streampos.updates(%s, '0', 100, 0)", (stream,))
    started = time.monotonic()
    one(conn, "SELECT streampos.updates(%s, '0', 100, 5000)", (other,))
    assert time.monotonic() - started < 0.5


@pytest.mark.restarts_server
def stream_with_rows(db, stream, n):
    """A stream with one table, `<stream>_ev`, holding n committed rows of
    writer 'w' (IDs 1 to n); the table's name."""
    create_stream(db, stream)
    table = f"{stream}_ev"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, instance_name text, body text)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    for _ in range(n):
        db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w'), 'w', 'x'", (stream,))
    return table


def test_the_followers_statement_is_planned_once_per_session(connect, stream):
    """Issue 32. PostgreSQL's plan cache kept choosing a custom plan for
    the row statement updates() keeps: 51 plans in 50 calls, most of each
    call's cost. Counted by pg_stat_statements (internal statements
    tracked), 100 calls of updates(), caught up and one row behind: a plain
    table with its ID index is read without any statement (the index read);
    a table the index read leaves to the statement (a column of a type that
    is not built in) plans the row statement once."""
    db = connect()
    if not one(db, "SELECT count(*) FROM pg_available_extensions WHERE name = 'pg_stat_statements'"):
        pytest.skip("pg_stat_statements is not installed")
    table = stream_with_rows(db, stream, 3)
    db.close()
    support.restart_server(
        "fast",
        options="-c shared_preload_libraries=streampos,pg_stat_statements "
        "-c pg_stat_statements.track=all -c pg_stat_statements.track_planning=on",
    )
    statement = f"%jsonb_build_array%{table}%"
    try:
        with support.connect_raw() as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")

            def hundred_calls():
                c.execute("SELECT pg_stat_statements_reset()")
                # One row behind and two: a caught-up follower ("3") reads no table.
                for since in ("2", "1"):
                    for _ in range(50):
                        answer = c.execute("SELECT streampos.updates(%s, %s, 100, 0)", (stream, since)).fetchone()[0]
                        assert answer["data"][1][:3] == [int(since) + 1, "w", "x"]
                return c.execute("SELECT count(*), sum(plans) FROM pg_stat_statements WHERE query LIKE %s",
                                 (statement,)).fetchone()

            assert hundred_calls() == (0, None), "the index read ran the row statement"
            c.execute(f"CREATE TYPE {stream}_mood AS ENUM ('calm')")
            c.execute(f"ALTER TABLE {table} ADD COLUMN mood {stream}_mood")
            count, plans = hundred_calls()
            assert count == 1 and plans == 1, f"the row statement was planned {plans} times in 100 calls"
            c.execute("DROP EXTENSION pg_stat_statements")
    finally:
        support.restart_server("fast")


def test_a_caught_up_follower_reads_no_table(connect, stream):
    """Issue 32: nothing past `since` (the most frequent call) is answered
    without reading the stream's tables, and the answer is the one a read
    gives: the token, and each table's header with no rows."""
    db = connect()
    table = stream_with_rows(db, stream, 3)
    scans = (f"SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM pg_stat_xact_user_tables "
             f"WHERE relname = '{table}'")
    # The stream's first use in the server reads its tables once (its
    # history's start): not what is counted here.
    one(db, "SELECT streampos.updates(%s, '2')", (stream,))
    # The view counts what this backend has not reported yet, which a
    # transaction block does not (between its statements nothing is).
    with db.transaction():
        before = one(db, scans)
        for _ in range(5):
            answer = one(db, "SELECT streampos.updates(%s, '3')", (stream,))
        assert one(db, scans) == before
        assert answer == {"token": "3", "limited": False, "data": [[f"public.{table}", 3, 0, 3, "id", "instance_name", "body"]]}
        behind = one(db, "SELECT streampos.updates(%s, '2')", (stream,))
        assert one(db, scans) > before
    assert behind["token"] == "3" and behind["data"][1] == [3, "w", "x"]


def test_next_id_in_a_bare_select_outside_a_transaction_block_warns(connect, stream):
    """Issue 32: a bare SELECT of next_id() in autocommit finishes the ID
    when it returns; a row a later statement writes with it can be passed.
    A WARNING (25P01, as PostgreSQL's own for a transaction command outside
    a block) tells the caller; the INSERT that allocates, a transaction
    block, hold_ids() and the setting turned off are not warned about."""
    db = connect()
    create_stream(db, stream)
    db.execute(f"CREATE TABLE {stream}_ev (id bigint)")
    seen = []
    db.add_notice_handler(lambda d: seen.append((d.severity_nonlocalized, d.sqlstate, d.message_primary)))
    db.execute("SELECT streampos.next_id(%s, 'w')", (stream,))
    db.execute("SELECT streampos.next_ids(%s, 'w', 2)", (stream,))
    assert seen == [
        ("WARNING", "25P01", f'{f}() outside a transaction block finishes its IDs of stream "{stream}" when this statement ends')
        for f in ("next_id", "next_ids")
    ]
    seen.clear()
    db.execute(f"INSERT INTO {stream}_ev SELECT streampos.next_id(%s, 'w')", (stream,))
    with db.transaction():
        db.execute("SELECT streampos.next_id(%s, 'w')", (stream,))
    db.execute("SELECT streampos.release_ids(%s, streampos.hold_ids(%s, 'w'))", (stream, stream))
    db.execute("SET streampos.warn_finished_at_once = off")
    db.execute("SELECT streampos.next_id(%s, 'w')", (stream,))
    assert seen == []


def test_bigint_values_as_json_strings_for_javascript(connect, stream):
    """Issue 32: JavaScript's numbers round integers above 2^53 (a
    follower got 9007199254740992 for ID 9007199254740993). With
    streampos.json_bigint_as_string the answer's positions and bigint
    columns are strings, exact in every language; the default stays
    numbers (older clients)."""
    db = connect()
    seq = create_stream(db, stream)
    table = f"{stream}_ev"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, instance_name text, n integer, ts bigint)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    db.execute(f"SELECT setval('{seq}', 9007199254740992)")
    db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w'), 'w', 7, 9007199254740995", (stream,))
    big = 9007199254740993
    answer = one(db, "SELECT streampos.updates(%s, '0')::text", (stream,))
    assert f"[{big}, \"w\", 7, 9007199254740995]" in answer
    db.execute("SET streampos.json_bigint_as_string = on")
    answer = one(db, "SELECT streampos.updates(%s, '0')", (stream,))
    assert answer["token"] == str(big)
    assert answer["data"] == [[f"public.{table}", str(big), 1, 4, "id", "instance_name", "n", "ts"],
                              [str(big), "w", 7, "9007199254740995"]]
