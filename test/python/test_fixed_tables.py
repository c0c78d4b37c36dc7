"""What happens when a table of fixed size fills (docs/design.md, "Tables of
fixed size"): it may refuse a new entry with a clear error, or answer
lower for a while, but it never forgets something a live snapshot can
still ask about, and never sends a position back.
"""

import threading

import psycopg
import pytest

from support import commit_ids, create_stream, expect_error, one, rows

WRITERS_PER_STREAM = 1024


def commit_one_id_each(conn, stream, first, last, prefix="w"):
    """Writers prefix<first>..prefix<last> commit one ID each, one
    transaction per writer (a DO block that commits as it goes)."""
    conn.execute(
        f"DO $$ BEGIN FOR k IN {int(first)}..{int(last)} LOOP "
        f"PERFORM streampos.next_id('{stream}', '{prefix}' || k); COMMIT; END LOOP; END $$"
    )


def token_entries(conn, stream):
    """The instance positions a stream's current token lists: {id: pos}."""
    text = one(conn, "SELECT streampos.current_token(%s)::text", (stream,))
    if not text.startswith("m"):
        return {}
    return {int(i): int(p) for i, p in (e.split(".") for e in text.split("~")[1:] if e)}


# ------------------------------------------------------ writers of a stream


def test_more_than_64_writers_stay_in_tokens(connect, db, stream):
    """0.2.0 remembered 64 writers per stream: a 65th writer dropped out of
    tokens and writer_positions, and its position went back (from 129 in
    flight to 64 after its commit)."""
    create_stream(db, stream)
    holder = connect()
    holder.execute("BEGIN")
    assert one(holder, "SELECT streampos.next_id(%s, 'holder')", (stream,)) == 1
    listed = {}
    for k in range(1, 81):
        writer = f"w{k}"
        [got] = commit_ids(db, stream, writer)
        wid = one(db, "SELECT streampos.instance_id(%s)", (writer,))
        listed[wid] = got
        entries = token_entries(db, stream)
        # Every writer that committed is at the highest ID (nothing of its
        # own in flight), ahead of the frontier 0.
        assert entries == {w: got for w in listed}, f"after {writer}"
        positions = {r[1]: r[2] for r in rows(db, "SELECT * FROM streampos.writer_positions(%s)", (stream,))}
        assert all(positions[w] == got for w in listed), f"after {writer}"
    holder.execute("ROLLBACK")


def test_a_writer_beyond_the_limit_is_refused_and_leaves_nothing(connect, db, stream):
    """A stream open to any writer lists every writer that committed in its
    tokens; the 1025th is refused (54000) rather than forgotten, and the
    refusal leaves nothing in flight. A stream with configured writers, and
    the writers already remembered, go on."""
    create_stream(db, stream)
    commit_one_id_each(db, stream, 1, WRITERS_PER_STREAM)
    assert one(db, "SELECT streampos.max_allocated(%s)", (stream,)) == WRITERS_PER_STREAM
    err = expect_error(db, "SELECT streampos.next_id(%s, 'one_too_many')", (stream,), sqlstate="54000")
    assert "too many writers" in str(err)
    assert rows(db, "SELECT * FROM streampos.in_flight(%s)", (stream,)) == []
    assert one(db, "SELECT streampos.frontier(%s)", (stream,)) == WRITERS_PER_STREAM
    assert one(db, "SELECT streampos.next_id(%s, 'w7')", (stream,)) == WRITERS_PER_STREAM + 1
    assert len(token_entries(db, stream)) == 0
    # Limited to a list, the stream takes a writer that is not remembered.
    db.execute("SELECT streampos.set_writers(%s, ARRAY['one_too_many', 'w7'])", (stream,))
    assert one(db, "SELECT streampos.next_id(%s, 'one_too_many')", (stream,)) == WRITERS_PER_STREAM + 2


def test_reserved_places_are_given_back_by_rollbacks(connect, db, stream):
    """A new writer's place is reserved while its transaction runs; a
    rollback gives it back, so aborted transactions never fill the table."""
    create_stream(db, stream)
    commit_one_id_each(db, stream, 1, WRITERS_PER_STREAM - 1)
    for k in range(5):
        db.execute("BEGIN")
        db.execute("SELECT streampos.next_id(%s, %s)", (stream, f"aborted{k}"))
        db.execute("ROLLBACK")
    # One place left: the first new writer takes it, the next is refused.
    other = connect()
    db.execute("BEGIN")
    db.execute("SELECT streampos.next_id(%s, 'last')", (stream,))
    expect_error(other, "SELECT streampos.next_id(%s, 'after_last')", (stream,), sqlstate="54000")
    db.execute("COMMIT")
    assert one(db, "SELECT streampos.instance_id('last')") in token_entries_all(db, stream)


def token_entries_all(conn, stream):
    return {r[1] for r in rows(conn, "SELECT * FROM streampos.writer_positions(%s)", (stream,))}


# ------------------------------------------------- answers of a transaction


def test_a_cursor_keeps_its_answer_past_any_number_of_other_snapshots(connect, db, stream):
    """0.2.0 remembered the answers of 8192 snapshots per transaction: a READ
    COMMITTED transaction that ran more statements than that, each with a
    new snapshot, while a cursor was open got a second answer for the
    cursor's snapshot, and the cursor skipped a row. Rows are stored in the
    order 4, 1, 3 with 2 in flight: FETCH 1 returns row 1 with frontier 1
    (row 4 was filtered out); 2 is rolled back; after 9000 distinct
    snapshots the rest of the cursor must still carry frontier 1 (a
    frontier of 4 would return row 3 and report a position past row 4,
    which the cursor never returned)."""
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
    reader = connect()
    reader.execute("SET enable_indexscan = off")
    reader.execute("BEGIN")
    reader.execute(
        f"DECLARE c CURSOR FOR SELECT id, streampos.frontier(%s) FROM {table} "
        f"WHERE id <= streampos.frontier(%s)",
        (stream, stream),
    )
    got = reader.execute("FETCH 1 FROM c").fetchall()
    assert got == [(1, 1)]
    holder.execute("ROLLBACK")
    # Commits in another session make every statement's snapshot new.
    stop = threading.Event()

    def churn():
        with psycopg.connect(**db.info.get_parameters(), autocommit=True) as c:
            while not stop.is_set():
                c.execute("SELECT pg_catalog.pg_current_xact_id()")

    thread = threading.Thread(target=churn)
    thread.start()
    snapshots = set()
    try:
        while len(snapshots) < 9000:
            snap, f = reader.execute(
                "SELECT pg_catalog.pg_current_snapshot()::text, streampos.frontier(%s)", (stream,)
            ).fetchone()
            snapshots.add(snap)
            assert f == 4, "a new snapshot sees 2 rolled back"
    finally:
        stop.set()
        thread.join()
    got += reader.execute("FETCH ALL FROM c").fetchall()
    reader.execute("COMMIT")
    assert got == [(1, 1)], f"the cursor changed its answer after {len(snapshots)} snapshots: {got}"


def test_answers_of_dead_snapshots_are_let_go(connect, db, stream):
    """Memory is bounded by the snapshots PostgreSQL keeps alive: a READ
    COMMITTED transaction running many statements does not keep an old
    statement's snapshot (its xmin would hold back vacuum) beyond a few
    statements."""
    create_stream(db, stream)
    commit_ids(db, stream, "w")
    reader = connect()
    reader.execute("BEGIN")
    pid = one(reader, "SELECT pg_backend_pid()")
    stop = threading.Event()

    def churn():
        with psycopg.connect(**db.info.get_parameters(), autocommit=True) as c:
            while not stop.is_set():
                c.execute("SELECT pg_catalog.pg_current_xact_id()")

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        first_xmin = None
        # At least 200 statements; more (up to 5 000) while any other
        # transaction with an xid (the position worker's pass, descheduled
        # on a loaded machine) outlives them and holds every snapshot's
        # xmin where it was.
        for k in range(5000):
            reader.execute("SELECT streampos.frontier(%s)", (stream,))
            xmin = one(db, "SELECT backend_xmin::text::bigint FROM pg_stat_activity WHERE pid = %s", (pid,))
            if k == 0:
                first_xmin = xmin
            elif k >= 200 and xmin is not None and first_xmin is not None and xmin > first_xmin:
                break
    finally:
        stop.set()
        thread.join()
    # The backend's xmin moved on with its statements (it is at most a few
    # statements old), rather than staying at the first one's.
    assert xmin is not None and first_xmin is not None and xmin > first_xmin
    reader.execute("COMMIT")


# ------------------------------------------------ REPEATABLE READ followers


def test_a_repeatable_read_follower_is_not_told_to_resynchronise(connect, db, stream):
    """0.2.0 checked a follower's target against the highest ID cached with
    the transaction snapshot's answer: in REPEATABLE READ, after a first
    reading call, wait_for and updates for an ID the server did allocate
    later raised 72000."""
    create_stream(db, stream)
    db.execute(f"CREATE TABLE {stream}_t (id bigint, w text)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'w')", (stream, f"{stream}_t"))
    commit_ids(db, stream, "w", 7)
    follower = connect()
    follower.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    assert one(follower, "SELECT streampos.frontier(%s)", (stream,)) == 7
    assert commit_ids(db, stream, "w") == [8]
    # The transaction's snapshot cannot see 8: the wait times out at 7.
    assert one(follower, "SELECT streampos.wait_for(%s, 8, 0)", (stream,)) == 7
    answer = one(follower, "SELECT streampos.updates(%s, '8')", (stream,))
    assert answer["token"] == "8" and answer["data"][0][2] == 0, answer
    follower.execute("COMMIT")
    # One past what the server allocated is "anything new" (nothing yet:
    # the frontier); beyond it, refused.
    assert one(follower, "SELECT streampos.wait_for(%s, 9, 0)", (stream,)) == 8
    expect_error(follower, "SELECT streampos.wait_for(%s, 10, 0)", (stream,), sqlstate="72000")
