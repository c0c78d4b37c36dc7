"""Holds: IDs held by a session rather than a transaction (`hold_ids`,
`release_ids`), for rows that other transactions write (Synapse's
`get_next()`). In flight until released or the session ends; a release
is seen with the commit of its transaction, so a reader's frontier never
covers a row whose writing transaction its snapshot does not see.
"""

import time

import psycopg
import pytest

from support import (
    backend_pid,
    commit_ids,
    create_stream,
    ensure_login_role,
    expect_error,
    frontier,
    in_flight,
    one,
    rows,
    wait_until,
)


def hold(conn, stream, writer, n=1):
    return one(conn, "SELECT streampos.hold_ids(%s, %s, %s)", (stream, writer, n))


def release(conn, stream, ids):
    conn.execute("SELECT streampos.release_ids(%s, %s)", (stream, ids))


def test_a_hold_outlives_its_transaction_until_released(connect, db, stream):
    create_stream(db, stream)
    assert commit_ids(db, stream, "w") == [1]
    holder = connect()
    ids = hold(holder, stream, "persister", 2)
    assert ids == [2, 3]
    assert commit_ids(db, stream, "w") == [4]
    # The transaction that took the hold has committed; the IDs are still
    # in flight, and listed with no xid (a session holds them).
    assert frontier(db, stream) == 1
    [row] = [r for r in rows(db, "SELECT instance_name, pid, xid, min_id, max_id, ids "
                                 "FROM streampos.in_flight(%s)", (stream,)) if r[0] == "persister"]
    assert row == ("persister", backend_pid(holder), None, 2, 3, 2)
    assert one(db, "SELECT streampos.writer_position(%s, 'w')", (stream,)) == 4
    assert one(db, "SELECT streampos.writer_position(%s, 'persister')", (stream,)) == 1
    holder.execute("BEGIN")
    release(holder, stream, ids)
    assert frontier(db, stream) == 1, "released only at the commit"
    holder.execute("COMMIT")
    assert frontier(db, stream) == 4
    assert in_flight(db, stream) == []
    expect_error(holder, "SELECT streampos.release_ids(%s, %s)", (stream, ids), sqlstate="22023")


def test_a_reader_never_covers_a_row_its_snapshot_cannot_see(connect, db, stream):
    """The one new rule: the rows of a hold are written by another
    transaction T, which commits before the release. A reader whose
    snapshot predates T's commit and first asks after the release must not
    be told the IDs are finished (it cannot see T's row)."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint)")
    holder = connect()
    [held] = hold(holder, stream, "persister")
    reader = connect()
    reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    reader.execute("SELECT 1")  # the snapshot is taken
    db.execute(f"INSERT INTO {table} VALUES (%s)", (held,))  # T commits
    release(holder, stream, [held])  # the release commits after T
    assert frontier(db, stream) == held
    f = one(reader, "SELECT streampos.frontier(%s)", (stream,))
    seen = one(reader, f"SELECT count(*) FROM {table} WHERE id <= streampos.frontier(%s)", (stream,))
    assert (f, seen) == (held - 1, 0), "the reader's frontier covers a row it cannot see"
    reader.execute("COMMIT")


def test_a_release_that_rolls_back_keeps_the_hold(connect, db, stream):
    create_stream(db, stream)
    holder = connect()
    ids = hold(holder, stream, "persister")
    holder.execute("BEGIN")
    release(holder, stream, ids)
    holder.execute("ROLLBACK")
    assert frontier(db, stream) == 0
    holder.execute("BEGIN")
    holder.execute("SAVEPOINT s")
    release(holder, stream, ids)
    holder.execute("ROLLBACK TO SAVEPOINT s")
    holder.execute("COMMIT")
    assert frontier(db, stream) == 0
    assert [r[3] for r in rows(db, "SELECT * FROM streampos.in_flight(%s)", (stream,))] == [None]
    # Released in a savepoint that is kept: gone with the commit.
    holder.execute("BEGIN")
    holder.execute("SAVEPOINT s")
    release(holder, stream, ids)
    holder.execute("RELEASE SAVEPOINT s")
    holder.execute("COMMIT")
    assert frontier(db, stream) == 1


def test_a_hold_taken_by_a_transaction_that_aborts_is_abandoned(connect, db, stream):
    create_stream(db, stream)
    holder = connect()
    holder.execute("BEGIN")
    ids = hold(holder, stream, "persister", 3)
    assert frontier(db, stream) == 0
    holder.execute("ROLLBACK")
    assert in_flight(db, stream) == []
    assert frontier(db, stream) == 3
    expect_error(holder, "SELECT streampos.release_ids(%s, %s)", (stream, ids), sqlstate="22023")


def test_release_needs_the_exact_hold_of_this_session(connect, db, stream):
    create_stream(db, stream)
    holder, other = connect(), connect()
    ids = hold(holder, stream, "persister", 2)
    expect_error(other, "SELECT streampos.release_ids(%s, %s)", (stream, ids), sqlstate="22023")
    expect_error(holder, "SELECT streampos.release_ids(%s, %s)", (stream, ids[:1]), sqlstate="22023")
    expect_error(holder, "SELECT streampos.release_ids(%s, '{}')", (stream,), sqlstate="22023")
    release(holder, stream, ids)
    assert frontier(db, stream) == 2


def test_a_session_that_ends_with_holds_releases_them_after_every_writer_then_running(connect, db, stream):
    """A persister that dies holds its IDs until every transaction that was
    running when it died has ended (one of them may be writing its rows),
    then the position worker releases them: never forever, never early."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint)")
    holder = connect()
    [held] = hold(holder, stream, "persister")
    writing = connect()
    writing.execute("BEGIN")
    writing.execute(f"INSERT INTO {table} VALUES (%s)", (held,))
    assert commit_ids(db, stream, "w") == [held + 1]
    db.execute("SELECT pg_terminate_backend(%s)", (backend_pid(holder),))
    # Orphaned: still the writer's, with no session.
    wait_until(lambda: [(r[1], r[2]) for r in rows(db, "SELECT * FROM streampos.in_flight(%s)", (stream,))]
               == [("persister", None)], message="the hold to be orphaned")
    # Held while the writing transaction runs, however long.
    time.sleep(1.0)
    assert frontier(db, stream) == held - 1
    writing.execute("COMMIT")
    wait_until(lambda: frontier(db, stream) == held + 1, timeout=5,
               message="the worker to release the orphaned hold")
    assert one(db, f"SELECT count(*) FROM {table} WHERE id <= streampos.frontier(%s)", (stream,)) == 1


def test_holds_per_session_are_bounded(connect, db, stream):
    create_stream(db, stream)
    holder = connect()
    limit = int(one(holder, "SHOW streampos.max_held_per_session"))
    taken = [hold(holder, stream, "persister")[0] for _ in range(limit)]
    err = expect_error(holder, "SELECT streampos.hold_ids(%s, 'persister')", (stream,), sqlstate="53400")
    assert "streampos.max_held_per_session" in err.diag.message_hint
    assert len(in_flight(db, stream)) == limit
    for i in taken:
        release(holder, stream, [i])
    assert frontier(db, stream) == limit  # refused before any ID was taken


def test_holds_need_what_allocation_needs(connect, db, stream):
    create_stream(db, stream)
    role = ensure_login_role("streampos_hold_intruder")
    intruder = connect(user=role)
    expect_error(intruder, "SELECT streampos.hold_ids(%s, 'x')", (stream,), sqlstate="42501")
    db.execute("BEGIN READ ONLY")
    expect_error(db, "SELECT streampos.hold_ids(%s, 'x')", (stream,), sqlstate="25006")
    db.execute("ROLLBACK")


def test_a_transaction_that_takes_or_releases_a_hold_cannot_be_prepared(connect, db, stream):
    create_stream(db, stream)
    holder = connect()
    ids = hold(holder, stream, "persister")
    for statement, args in [("SELECT streampos.hold_ids(%s, 'p')", (stream,)),
                            ("SELECT streampos.release_ids(%s, %s)", (stream, ids))]:
        holder.execute("BEGIN")
        holder.execute(statement, args)
        expect_error(holder, "PREPARE TRANSACTION 'streampos_hold'", sqlstate="0A000")
        holder.execute("ROLLBACK")
    assert frontier(db, stream) == 0
    release(holder, stream, ids)
    assert frontier(db, stream) == 2
