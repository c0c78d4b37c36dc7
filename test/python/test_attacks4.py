"""Adversary round 4, against the engine rewritten for issue 19 (durability
per allocation, answers kept while their snapshots live, holds, lost
history keyed on a history id, the stored frontier, 1 024 writers per
stream).

Every test is an attack. A test that FAILS is a break of docs/contract.md
(its docstring says which promise, how, and what would fix it); a test that
passes is an attack the engine withstood, kept as a guard. Tests that need
clusters of their own (a standby, a promotion, a chain of them) use
cluster.py on the failover ports; the others use the suite's server.
"""

import os
import re
import shutil
import threading
import time

import psycopg
import pytest

from cluster import Clusters, Pair, USER, _bin, _run
from support import (
    backend_pid,
    commit_ids,
    create_stream,
    expect_error,
    flush_wal,
    frontier,
    in_flight,
    one,
    rows,
    wait_until,
)

RESYNC = "72000"


def hold(conn, stream, writer, n=1):
    return one(conn, "SELECT streampos.hold_ids(%s, %s, %s)", (stream, writer, n))


def release(conn, stream, ids):
    conn.execute("SELECT streampos.release_ids(%s, %s)", (stream, ids))


def token_text(conn, stream):
    return one(conn, "SELECT streampos.current_token(%s)::text", (stream,))


def token_entries(text):
    """{instance id: position} of a token's text (empty for a plain one)."""
    if not text.startswith("m"):
        return {}
    return {int(i): int(p) for i, p in (e.split(".") for e in text.split("~")[1:] if e)}


def token_position(text, instance_id):
    """A writer's position in a token: its entry, else the minimum."""
    minimum = int(text[1:].split("~")[0]) if text.startswith("m") else int(text)
    return token_entries(text).get(instance_id, minimum)


def top_transaction_bytes(conn):
    return one(
        conn,
        "SELECT sum(total_bytes) FROM pg_catalog.pg_backend_memory_contexts "
        "WHERE name = 'TopTransactionContext'",
    )


# =====================================================================
# The answer cache: one answer per snapshot, memory bounded by what
# PostgreSQL keeps alive.
# =====================================================================


@pytest.mark.parametrize("isolation", ["READ COMMITTED", "REPEATABLE READ"])
def test_answer_cache_memory_is_bounded_when_snapshots_repeat(connect, db, stream, isolation):
    """BREAKS "memory/xmin never grows without bound" (design.md, "One
    answer per snapshot": "an entry goes when none of its snapshots is held
    by anyone else ... So the cache holds what PostgreSQL holds alive").

    How: every statement's active snapshot is a fresh copy; when its
    contents equal an entry's (every statement of a REPEATABLE READ
    transaction, or READ COMMITTED while nothing else commits), `get`
    registers the copy on the transaction's resource owner and appends it to
    the entry's `holds`. Sweeps run only when a NEW entry is added, so an
    entry whose contents never change is never swept: every statement's
    snapshot stays registered to the end of the transaction. A plpgsql loop
    of 20 000 `frontier()` calls grows TopTransactionContext from 8 kB to
    4 MB (60 000 calls: 16 MB, 15 s: `holds.contains` is linear too), with
    nothing alive but the transaction.

    Fix: register one snapshot per entry (the first), and for later copies
    with the same contents keep only the pointer list bounded — e.g. sweep
    an entry's own `holds` when it grows past twice its live count (drop
    copies that are no longer held elsewhere), independently of new
    entries; or keep one registered copy of the contents (CopySnapshot made
    by the cache itself) and never register the caller's copies."""
    create_stream(db, stream)
    commit_ids(db, stream, "w")
    reader = connect()
    reader.execute(f"BEGIN ISOLATION LEVEL {isolation}")
    reader.execute("DO $$ BEGIN FOR k IN 1..20000 LOOP PERFORM pg_catalog.pg_current_snapshot(); "
                   "END LOOP; END $$")
    baseline = top_transaction_bytes(reader)
    reader.execute(f"DO $$ BEGIN FOR k IN 1..20000 LOOP PERFORM streampos.frontier('{stream}'); "
                   "END LOOP; END $$")
    grown = top_transaction_bytes(reader)
    reader.execute("COMMIT")
    assert grown - baseline < 1024 * 1024, (
        f"20 000 reads with one snapshot's contents grew TopTransactionContext from {baseline} "
        f"to {grown} bytes: every statement's snapshot copy stays registered by the answer cache"
    )


def test_a_with_hold_cursor_keeps_its_answer_after_commit(connect, db, stream):
    """Withstood: a WITH HOLD cursor is materialised before the cache lets
    its snapshots go (portals are persisted before XACT_EVENT_PRE_COMMIT),
    so rows fetched after COMMIT carry the first answer."""
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
    reader.execute("BEGIN")
    reader.execute(
        f"DECLARE c CURSOR WITH HOLD FOR SELECT id, streampos.frontier(%s) FROM {table} "
        f"WHERE id <= streampos.frontier(%s)", (stream, stream))
    got = reader.execute("FETCH 1 FROM c").fetchall()
    holder.execute("ROLLBACK")
    reader.execute("COMMIT")
    got += reader.execute("FETCH ALL FROM c").fetchall()
    reader.execute("CLOSE c")
    assert got == [(1, 1)], got


def test_a_procedure_committing_inside_a_cursor_loop_keeps_the_loops_answer(connect, db, stream):
    """Withstood: a plpgsql FOR loop over rows <= frontier() in a procedure
    that COMMITs inside the loop (the loop's portal is held across the
    commit) returns rows all carrying the first answer, none above it."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint)")
    db.execute(f"CREATE TABLE {table}_out (id bigint, f bigint)")
    assert commit_ids(db, stream, "w") == [1]
    holder = connect()
    holder.execute("BEGIN")
    assert one(holder, "SELECT streampos.next_id(%s, 'w')", (stream,)) == 2
    assert commit_ids(db, stream, "w", 2) == [3, 4]
    for i in (1, 3, 4):
        db.execute(f"INSERT INTO {table} VALUES (%s)", (i,))
    db.execute(f"""
        CREATE PROCEDURE {stream}_p() LANGUAGE plpgsql AS $$
        DECLARE r record;
        BEGIN
          FOR r IN SELECT id, streampos.frontier('{stream}') AS f FROM {table}
                   WHERE id <= streampos.frontier('{stream}') ORDER BY id LOOP
            INSERT INTO {table}_out VALUES (r.id, r.f);
            COMMIT;
            PERFORM pg_catalog.pg_sleep(0.2);
          END LOOP;
        END $$""")
    reader = connect()
    done = threading.Event()

    def run():
        try:
            reader.execute(f"CALL {stream}_p()")
        finally:
            done.set()

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.1)
    holder.execute("ROLLBACK")
    t.join(timeout=30)
    assert done.is_set()
    assert rows(db, f"SELECT id, f FROM {table}_out ORDER BY id") == [(1, 1)]


def test_a_cursor_survives_a_subtransaction_that_aborts_around_it(connect, db, stream):
    """Withstood: a cursor opened before a savepoint, read inside it (new
    answers for new snapshots), the savepoint rolled back (its resource
    owner released), then FETCH ALL: one answer for the cursor's snapshot.
    And a cursor opened inside a savepoint that is released keeps its
    answer too."""
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
    q = f"SELECT id, streampos.frontier(%s) FROM {table} WHERE id <= streampos.frontier(%s)"
    reader.execute(f"DECLARE outer_c CURSOR FOR {q}", (stream, stream))
    got = reader.execute("FETCH 1 FROM outer_c").fetchall()
    reader.execute("SAVEPOINT a")
    reader.execute(f"DECLARE inner_c CURSOR FOR {q}", (stream, stream))
    inner = reader.execute("FETCH 1 FROM inner_c").fetchall()
    reader.execute("RELEASE SAVEPOINT a")
    holder.execute("ROLLBACK")
    for k in range(50):
        reader.execute("SAVEPOINT b")
        db.execute("SELECT pg_catalog.pg_current_xact_id()")
        assert one(reader, "SELECT streampos.frontier(%s)", (stream,)) == 4
        try:
            reader.execute("SELECT 1/0")
        except psycopg.errors.DivisionByZero:
            pass
        reader.execute("ROLLBACK TO SAVEPOINT b")
    got += reader.execute("FETCH ALL FROM outer_c").fetchall()
    inner += reader.execute("FETCH ALL FROM inner_c").fetchall()
    reader.execute("COMMIT")
    assert got == [(1, 1)], got
    assert inner == [(1, 1)], inner


def test_an_exported_snapshot_of_a_transaction_holding_ids(connect, db, stream):
    """Withstood: a READ COMMITTED transaction that holds ID 2 exports its
    statement's snapshot after later commits (its own xid is below the
    snapshot's xmax and, as every snapshot, not in its xip). The importer
    must treat ID 2 as in flight (PostgreSQL adds the exporter's xid to the
    exported snapshot)."""
    create_stream(db, stream)
    assert commit_ids(db, stream, "w") == [1]
    exporter = connect()
    exporter.execute("BEGIN")
    assert one(exporter, "SELECT streampos.next_id(%s, 'x')", (stream,)) == 2
    assert commit_ids(db, stream, "w", 3) == [3, 4, 5]
    snapshot = one(exporter, "SELECT pg_catalog.pg_export_snapshot()")
    importer = connect()
    importer.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    importer.execute(f"SET TRANSACTION SNAPSHOT '{snapshot}'")
    assert one(importer, "SELECT streampos.frontier(%s)", (stream,)) == 1
    assert one(importer, "SELECT streampos.writer_position(%s, 'x')", (stream,)) == 1
    exporter.execute("COMMIT")
    assert one(importer, "SELECT streampos.frontier(%s)", (stream,)) == 1
    importer.execute("COMMIT")


# =====================================================================
# Instance ids taken back by a rolled-back savepoint
# =====================================================================


def test_an_id_allocated_under_a_name_a_savepoint_took_back_holds_that_name(connect, db, stream):
    """BREAKS invariant 1 (writer positions and tokens: "the largest p such
    that every ID <= p allocated to W is finished").

    How: T allocates ID 1 for the new writer name `late` in a savepoint
    (creating its instance, id X) and rolls the savepoint back: the
    instance row is gone, the entry (ID 1) stays in flight under X until T
    ends. Another session then allocates for `late`, which creates the name
    again with id Y, and commits ID 2. `rename_own_entries` only renames
    entries of the transaction that creates the name, so T's ID 1 holds X,
    a number nobody can name: writer_position('late') and the token's entry
    for Y are 2 while ID 1, allocated to `late`, is in flight. T then writes
    its row (1, 'late') and commits: a reader that followed `late` up to 2
    never sees row 1.

    Fix: an entry whose instance a rolled-back savepoint took back must not
    be left under a dead id: at SUBXACT_EVENT_ABORT_SUB, mark such entries
    (and holds) as holding every writer (ALL_WRITERS), or resolve the name
    again in the entry when the name is next created by anyone (entries
    carry the name)."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint, writer text)")
    name = f"{stream}_late"
    t = connect()
    t.execute("BEGIN")
    t.execute("SAVEPOINT a")
    assert one(t, "SELECT streampos.next_id(%s, %s)", (stream, name)) == 1
    t.execute("ROLLBACK TO SAVEPOINT a")
    other = connect()
    assert commit_ids(other, stream, name) == [2]
    reader = connect()
    reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    position = one(reader, "SELECT streampos.writer_position(%s, %s)", (stream, name))
    text = token_text(reader, stream)
    late = one(reader, "SELECT streampos.instance_id(%s)", (name,))
    db.execute(f"INSERT INTO {table} VALUES (2, %s)", (name,))
    t.execute(f"INSERT INTO {table} VALUES (1, %s)", (name,))
    t.execute("COMMIT")
    seen = [r[0] for r in rows(reader, f"SELECT id FROM {table} WHERE writer = %s AND id <= %s ORDER BY id",
                               (name, position))]
    reader.execute("COMMIT")
    assert position < 1 and token_position(text, late) < 1, (
        f"writer_position({name!r}) = {position}, token {text} (instance {late}) while ID 1, allocated "
        f"to {name!r} in a rolled-back savepoint, was in flight; rows of the writer the reader saw: {seen}"
    )


def test_a_hold_taken_under_a_name_a_savepoint_took_back_holds_that_name(connect, db, stream):
    """BREAKS invariant 1, for holds (which outlive the transaction, so no
    later `rename_own_entries` of that transaction can fix them).

    How: `hold_ids(s, 'late')` in a savepoint that creates the name, the
    savepoint rolled back, the transaction committed: the hold (ID 1) is
    confirmed under an instance id that no longer exists. Another session
    creates `late` again (new id) and commits ID 2: writer_position('late')
    is 2 while the hold, whose row will be written as `late`'s, is in
    flight; the hold's row is then written and the hold released, and a
    reader that followed `late` to 2 never sees row 1.

    Fix: as for transaction entries (previous test); for holds also at the
    top-level commit: a confirmed hold whose instance id does not exist
    must hold every writer (or be renamed when the name is created)."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint, writer text)")
    name = f"{stream}_late"
    holder = connect()
    holder.execute("BEGIN")
    holder.execute("SAVEPOINT a")
    ids = hold(holder, stream, name)
    assert ids == [1]
    holder.execute("ROLLBACK TO SAVEPOINT a")
    holder.execute("COMMIT")
    assert frontier(db, stream) == 0, "the hold outlives the rolled-back savepoint"
    assert commit_ids(db, stream, name) == [2]
    reader = connect()
    reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    position = one(reader, "SELECT streampos.writer_position(%s, %s)", (stream, name))
    text = token_text(reader, stream)
    late = one(reader, "SELECT streampos.instance_id(%s)", (name,))
    db.execute(f"INSERT INTO {table} VALUES (2, %s)", (name,))
    db.execute(f"INSERT INTO {table} VALUES (1, %s)", (name,))
    release(holder, stream, ids)
    reader.execute("COMMIT")
    assert position < 1 and token_position(text, late) < 1, (
        f"writer_position({name!r}) = {position}, token {text} (instance {late}) while the hold of "
        f"ID 1 for {name!r} was in flight"
    )


# =====================================================================
# Holds
# =====================================================================


def test_release_in_nested_savepoints_follows_the_outer_rollback(connect, db, stream):
    """Withstood: release in an inner savepoint, the inner one released
    (its release now belongs to the outer one), the outer one rolled back:
    the hold stays; a later release commits it."""
    create_stream(db, stream)
    holder = connect()
    ids = hold(holder, stream, "p", 2)
    holder.execute("BEGIN")
    holder.execute("SAVEPOINT a")
    holder.execute("SAVEPOINT b")
    release(holder, stream, ids)
    holder.execute("RELEASE SAVEPOINT b")
    holder.execute("ROLLBACK TO SAVEPOINT a")
    holder.execute("COMMIT")
    assert frontier(db, stream) == 0
    assert [r[3] for r in in_flight(db, stream)] == [1]
    holder.execute("BEGIN")
    holder.execute("SAVEPOINT a")
    holder.execute("SAVEPOINT b")
    release(holder, stream, ids)
    holder.execute("RELEASE SAVEPOINT b")
    holder.execute("RELEASE SAVEPOINT a")
    holder.execute("COMMIT")
    assert frontier(db, stream) == 2
    assert in_flight(db, stream) == []


def test_rolled_back_releases_leave_nothing_behind(connect, db, stream):
    """BREAKS invariant 4 ("a bad call ... leaves nothing behind") and the
    limits table (a transaction's entries are "(stream, writer) pairs").

    How: `release_ids` puts a *shadow* entry in the transaction's entries;
    a rolled-back savepoint keeps the hold but leaves the shadow there
    ("they finish nothing the hold does not"). A transaction that retries a
    release in a savepoint (the usual retry pattern) runs out of entries
    after streampos.max_streams_per_transaction (8) attempts: the 9th
    release of the SAME hold fails with 53400, although the transaction
    holds nothing. Likewise a transaction cannot release more than 8 holds
    (64 are allowed per session).

    Fix: drop a release's shadow when its savepoint aborts (the shadow
    records the subtransaction, as the hold does), and let one shadow per
    (stream, writer) stand for every hold released in the transaction (the
    lowest ID, the highest WAL position), or document the limit."""
    create_stream(db, stream)
    holder = connect()
    ids = hold(holder, stream, "p")
    per_transaction = int(one(holder, "SHOW streampos.max_streams_per_transaction"))
    holder.execute("BEGIN")
    for attempt in range(per_transaction):
        holder.execute("SAVEPOINT retry")
        release(holder, stream, ids)
        holder.execute("ROLLBACK TO SAVEPOINT retry")
    try:
        release(holder, stream, ids)
        failed = None
    except psycopg.Error as e:
        failed = f"{e.sqlstate}: {e}"
    holder.execute("ROLLBACK")
    assert failed is None, (
        f"release #{per_transaction + 1} of one hold after {per_transaction} rolled-back attempts: {failed}"
    )


def test_one_transaction_releases_more_holds_than_it_has_entries(connect, db, stream):
    """BREAKS the documented limits: a session may hold 64 holds
    (streampos.max_held_per_session), but each release takes one of the
    transaction's 8 entries (a shadow): releasing 9 holds of one stream and
    writer in one transaction fails with 53400 naming
    streampos.max_streams_per_transaction, a limit documented for
    (stream, writer) pairs only.

    Fix: one shadow per (stream, writer) for every hold the transaction
    releases (lowest ID, highest WAL position), or document it."""
    create_stream(db, stream)
    holder = connect()
    held = [hold(holder, stream, "p") for _ in range(9)]
    holder.execute("BEGIN")
    try:
        for ids in held:
            release(holder, stream, ids)
        holder.execute("COMMIT")
        failed = None
    except psycopg.Error as e:
        failed = f"{e.sqlstate}: {e.diag.message_primary} ({e.diag.message_hint})"
        holder.execute("ROLLBACK")
    assert failed is None, f"releasing 9 holds in one transaction: {failed}"
    assert frontier(db, stream) == 9


def test_an_orphaned_hold_waits_for_a_prepared_writer(connect, db, stream):
    """Withstood: the row of a hold is written by a transaction that is
    PREPAREd (two-phase commit); the holding session dies. The orphaned
    hold must not be released while the prepared transaction is pending
    (its row is not visible yet), and is released after COMMIT PREPARED."""
    if int(one(db, "SHOW max_prepared_transactions")) == 0:
        pytest.skip("max_prepared_transactions = 0")
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint)")
    holder = connect()
    [held] = hold(holder, stream, "p")
    writer = connect()
    gid = f"{stream}_gid"
    writer.execute("BEGIN")
    writer.execute(f"INSERT INTO {table} VALUES (%s)", (held,))
    writer.execute(f"PREPARE TRANSACTION '{gid}'")
    try:
        assert commit_ids(db, stream, "w") == [held + 1]
        db.execute("SELECT pg_terminate_backend(%s)", (backend_pid(holder),))
        wait_until(lambda: [r[1] for r in in_flight(db, stream)] == [None], message="the orphan")
        time.sleep(1.5)
        f = frontier(db, stream)
        seen = one(db, f"SELECT count(*) FROM {table} WHERE id <= %s", (f,))
        assert f == held - 1, f"frontier {f} passed the orphaned hold {held} while its writer is prepared"
    finally:
        db.execute(f"COMMIT PREPARED '{gid}'")
    wait_until(lambda: frontier(db, stream) == held + 1, message="the orphan's release")
    assert one(db, f"SELECT count(*) FROM {table} WHERE id <= %s", (held + 1,)) == 1


def test_a_session_terminated_while_releasing_keeps_its_hold_until_writers_end(connect, db, stream):
    """Withstood: the holder called release_ids in a transaction and is
    terminated before COMMIT: the release is undone with the transaction
    and the hold becomes an orphan, released only once every transaction
    running when it was orphaned has ended."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint)")
    holder = connect()
    [held] = hold(holder, stream, "p")
    writing = connect()
    writing.execute("BEGIN")
    writing.execute(f"INSERT INTO {table} VALUES (%s)", (held,))
    holder.execute("BEGIN")
    release(holder, stream, [held])
    db.execute("SELECT pg_terminate_backend(%s)", (backend_pid(holder),))
    wait_until(lambda: [r[1] for r in in_flight(db, stream)] == [None], message="the orphan")
    time.sleep(1.0)
    assert frontier(db, stream) == held - 1
    writing.execute("COMMIT")
    wait_until(lambda: frontier(db, stream) == held, message="the orphan's release")


def test_a_hold_on_a_dropped_stream_never_holds_its_successor(connect, db, stream):
    """Withstood: a hold on a stream that is dropped and created again
    under the same name holds the old stream's state only (keys are never
    reused), and the holder's session ending leaves the new stream alone."""
    create_stream(db, stream)
    holder = connect()
    ids = hold(holder, stream, "p", 3)
    db.execute("SELECT streampos.drop_stream(%s)", (stream,))
    create_stream(db, stream)
    assert commit_ids(db, stream, "w") == [1]
    assert frontier(db, stream) == 1
    expect_error(holder, "SELECT streampos.release_ids(%s, %s)", (stream, ids), sqlstate="22023")
    holder.close()
    time.sleep(0.5)
    assert commit_ids(db, stream, "w") == [2]
    assert frontier(db, stream) == 2


def test_holds_on_a_backward_stream(connect, db, stream):
    """Withstood: a backward stream's holds are returned negated, released
    with that array, and hold the frontier at the ID above them."""
    create_stream(db, stream, backwards=True)
    holder = connect()
    ids = hold(holder, stream, "p", 2)
    assert ids == [-1, -2]
    assert commit_ids(db, stream, "w") == [-3]
    assert frontier(db, stream) == 0
    expect_error(holder, "SELECT streampos.release_ids(%s, %s)", (stream, [1, 2]), sqlstate="22023")
    release(holder, stream, ids)
    assert frontier(db, stream) == -3


# =====================================================================
# Writers a stream remembers (1 024)
# =====================================================================

WRITERS_PER_STREAM = 1024


def commit_one_id_each(conn, stream, first, last, prefix="w"):
    conn.execute(
        f"DO $$ BEGIN FOR k IN {int(first)}..{int(last)} LOOP "
        f"PERFORM streampos.next_id('{stream}', '{prefix}' || k); COMMIT; END LOOP; END $$"
    )


def test_the_1024th_writer_is_not_refused_for_running_twice(connect, db, stream):
    """BREAKS the limits table ("writers of a stream: 1 024 (a stream open
    to any writer refuses a writer beyond, 54000)").

    How: a place among the remembered writers is reserved per *entry*, not
    per writer: two concurrent transactions of the same new writer (or
    one session's holds, each an entry) reserve two places. With 1 023
    writers remembered, the 1 024th writer's first transaction reserves
    the last place, and its second concurrent transaction is refused with
    54000 "too many writers", although the writer is the 1 024th.

    Fix: count reservations per (stream, instance) (e.g. a small table of
    reserved instance ids in the stream's state, or check the active
    entries for the same instance before reserving)."""
    create_stream(db, stream)
    commit_one_id_each(db, stream, 1, WRITERS_PER_STREAM - 1)
    # The name exists (committed), so that the two transactions do not wait
    # for each other on its creation; the stream has not seen it yet.
    one(db, "SELECT streampos.instance_id('the_1024th')")
    first, second = connect(), connect()
    first.execute("BEGIN")
    one(first, "SELECT streampos.next_id(%s, 'the_1024th')", (stream,))
    second.execute("BEGIN")
    try:
        one(second, "SELECT streampos.next_id(%s, 'the_1024th')", (stream,))
        failed = None
    except psycopg.Error as e:
        failed = f"{e.sqlstate}: {e.diag.message_primary}"
    second.execute("ROLLBACK")
    first.execute("ROLLBACK")
    assert failed is None, f"the 1024th writer's second transaction: {failed}"


def test_holds_of_one_new_writer_take_one_place(connect, db, stream):
    """BREAKS the limits table, with holds: each hold of a new writer
    reserves a place of its own. With 1 000 writers remembered, a new
    writer's 25th hold is refused (54000) although it is the 1 001st
    writer. (Same fix as above.)"""
    create_stream(db, stream)
    commit_one_id_each(db, stream, 1, 1000)
    holder = connect()
    failed = None
    for k in range(30):
        try:
            hold(holder, stream, "persister")
        except psycopg.Error as e:
            failed = f"hold #{k + 1}: {e.sqlstate}: {e.diag.message_primary}"
            break
    assert failed is None, failed


def test_set_writers_null_keeps_every_listed_writer_in_tokens(connect, db, stream):
    """BREAKS invariant 3 ("every writer position never goes backwards ...
    for snapshots taken later"), in tokens and writer_positions.

    How: a stream with configured writers lists them all in tokens; a
    writer that never committed (idle) is at the highest allocated ID,
    ahead of a frontier held by another writer, so the token carries it.
    `set_writers(s, NULL)` opens the stream; an open stream's tokens list
    only the writers *seen committing since start-up*, so the idle writer
    drops out of the next token (and of writer_positions): its token
    position goes back from the highest ID to the frontier.

    Fix: when a stream's writers change, remember the writers its tokens
    listed (add the configured writers to `seen` at the commit of
    set_writers), or list every instance with a stored position."""
    create_stream(db, stream, writers=["a", "b"])
    assert commit_ids(db, stream, "a") == [1]
    holder = connect()
    holder.execute("BEGIN")
    assert one(holder, "SELECT streampos.next_id(%s, 'a')", (stream,)) == 2
    b = one(db, "SELECT streampos.instance_id('b')")
    before = token_text(db, stream)
    assert token_position(before, b) == 2, before
    db.execute("SELECT streampos.set_writers(%s, NULL)", (stream,))
    after = token_text(db, stream)
    listed = {r[0] for r in rows(db, "SELECT * FROM streampos.writer_positions(%s)", (stream,))}
    holder.execute("ROLLBACK")
    assert token_position(after, b) >= 2, (
        f"writer b went back from 2 to {token_position(after, b)} in tokens: {before} then {after} "
        f"(writer_positions now lists {sorted(listed)})"
    )


# =====================================================================
# Durability: a later allocation of a transaction that needs a newer
# sequence record (finish_allocation, wait_until_durable)
# =====================================================================


def test_positions_never_go_back_while_a_second_allocation_publishes(connect, db, stream):
    """BREAKS invariant 3 ("never go backwards ... for snapshots taken
    later"), rarely: about twice in 400 000 reads under this load.

    How: `finish_allocation`, for a later allocation of an entry that needs
    a newer sequence record, publishes the new WAL position, then the new
    `durable_from`, without moving the seqlock counter; a lock-free reader
    reads `durable_from` first, then the WAL position. A reader between the
    two stores copies the OLD `durable_from` (the entry's first ID, durable
    for a while) with the NEW, not yet durable, WAL position, and holds
    every writer back from the old first ID: an idle writer's position
    drops by the IDs of the first allocation (here by one) for a snapshot
    taken after a snapshot that was answered more. ("A torn copy holds
    more, never less": safe for rows, but the answer goes back; the torture
    harness found it as `went_back` for two equal snapshots, mode
    checkpoint.)

    Here a writer loops over transactions that allocate 1 ID, then 40 (the
    second call crosses the sequence's 32 logged-ahead values: a new WAL
    record), and a reader asks an idle writer's position in a new
    transaction each time, raising if it is ever below an earlier answer.

    Fix: move the seqlock counter in that rare path (a later allocation
    whose WAL position moves), or let readers re-read the WAL position
    after `durable_from` and retry on a change (a per-entry version)."""
    create_stream(db, stream)
    assert commit_ids(db, stream, "idle") == [1]
    stop = threading.Event()
    errors = []

    def write():
        try:
            with psycopg.connect(**db.info.get_parameters(), autocommit=True) as w:
                while not stop.is_set():
                    w.execute(
                        f"DO $$ BEGIN FOR k IN 1..200 LOOP PERFORM streampos.next_id('{stream}', 'w1'); "
                        f"PERFORM streampos.next_ids('{stream}', 'w1', 40); COMMIT; END LOOP; END $$")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    went_back = None
    reader = connect()
    deadline = time.monotonic() + 150
    try:
        while went_back is None and time.monotonic() < deadline and not errors:
            try:
                reader.execute(f"""
                    DO $$ DECLARE prev bigint := 0; cur bigint; BEGIN
                      FOR k IN 1..20000 LOOP
                        cur := streampos.writer_position('{stream}', 'idle');
                        IF cur < prev THEN
                          RAISE EXCEPTION 'idle writer went back from % to %', prev, cur;
                        END IF;
                        prev := cur;
                        COMMIT;
                      END LOOP;
                    END $$""")
            except psycopg.errors.RaiseException as e:
                went_back = str(e).splitlines()[0]
    finally:
        stop.set()
        writer.join(timeout=60)
    assert not errors, errors
    assert went_back is None, f"a later snapshot answered less: {went_back}"


# =====================================================================
# Clusters of their own: synchronous standbys, promotions, histories
# =====================================================================


@pytest.fixture
def clusters():
    with Clusters() as made:
        yield made


def standby_of(clusters, upstream, before_start=None, **settings):
    """A streaming hot standby of `upstream` (any node: a primary or a
    promoted standby); `before_start(node)` may change its data directory
    before it first starts."""
    node = clusters._new_node("standby")
    _run([_bin("pg_basebackup"), "-h", "127.0.0.1", "-p", str(upstream.port), "-U", USER,
          "-D", node.datadir, "-R", "-X", "stream", "-c", "fast",
          "-C", "-S", f"adv_standby{node.port}_{int(time.time() * 1000) % 100000}", "--no-sync"], timeout=180)
    node.set(port=node.port, cluster_name=f"standby{node.port}", synchronous_standby_names="", **settings)
    try:
        os.remove(node.log)
    except FileNotFoundError:
        pass
    if before_start:
        before_start(node)
    node.start()
    pair = Pair(upstream, node, False)
    pair.wait_streaming()
    return pair


def setup_ev(node, backwards=False):
    with node.connect() as c:
        c.execute("SELECT streampos.create_stream('ev', backwards => %s)", (backwards,))
        c.execute("CREATE TABLE ev (id bigint PRIMARY KEY, writer text NOT NULL)")
        if not backwards:
            c.execute("SELECT streampos.add_table('ev', 'ev'::regclass, 'id', 'writer')")


def commit_rows(node, n, writer="w1"):
    with node.connect() as c:
        return [c.execute("INSERT INTO ev SELECT streampos.next_id('ev', %s), %s RETURNING id",
                          (writer, writer)).fetchone()[0] for _ in range(n)]


def sqlstate_of(conn, sql, params=None):
    """The SQLSTATE of a call that fails, or its value."""
    try:
        return conn.execute(sql, params).fetchone()[0]
    except psycopg.Error as e:
        return e.sqlstate


def lose_commits(pair, n_kept=1, n_lost=100):
    """Commit n_kept rows (replicated), cut replication, commit n_lost more
    (lost), kill the primary. Returns (kept, lost)."""
    primary, _ = pair
    kept = commit_rows(primary, n_kept)
    pair.caught_up()
    pair.disconnect()
    lost = commit_rows(primary, n_lost)
    primary.kill()
    return kept, lost


def test_a_second_allocation_does_not_wait_for_a_synchronous_standby_under_local_commit(clusters):
    """BREAKS progress (invariant 2, "never an idle or slow writer" holds
    anything back; here a writer itself is blocked by nothing it asked
    for): with a synchronous standby away, a session with
    `synchronous_commit = local` (its commits do not wait for the standby,
    as PostgreSQL documents) blocks in `next_id` indefinitely once its
    transaction allocates again after a CHECKPOINT: `finish_allocation`
    waits until the earlier allocation's WAL is confirmed by the standby
    (`wait_until_durable`), "as a commit waits for it" — but this
    session's commit would not wait. Cancelled (statement_timeout), the
    transaction ends; that part is clean (checked below).

    Fix: keep the earlier allocation's WAL position in the entry instead of
    waiting (two positions per entry: the IDs below `durable_from` need the
    old one, those above the new one), or wait only as this session's
    commit would (synchronous_commit), leaving the old IDs held by the old
    position meanwhile."""
    pair = clusters.pair(synchronous=True)
    primary, standby = pair
    setup_ev(primary)
    commit_rows(primary, 3)
    pair.caught_up()
    standby.stop()
    with primary.connect() as w, primary.connect() as o:
        w.execute("SET synchronous_commit = local")
        w.execute("SET statement_timeout = '3s'")
        # After a checkpoint the first allocation writes a sequence record
        # of its own, which the absent standby never confirms.
        o.execute("CHECKPOINT")
        w.execute("BEGIN")
        first = w.execute("SELECT streampos.next_id('ev', 'w1')").fetchone()[0]
        o.execute("CHECKPOINT")
        started = time.monotonic()
        try:
            second = w.execute("SELECT streampos.next_id('ev', 'w1')").fetchone()[0]
            outcome = f"returned {second}"
        except psycopg.Error as e:
            outcome = f"{e.sqlstate} after {time.monotonic() - started:.1f}s: {e.diag.message_primary}"
            second = None
        w.execute("ROLLBACK")
        # Whatever happened, nothing is left in flight by the session.
        assert o.execute("SELECT count(*) FROM streampos.in_flight('ev') WHERE pid IS NOT NULL").fetchone()[0] == 0
    standby.start()
    pair.wait_streaming()
    with primary.connect() as o:
        top = o.execute("SELECT streampos.max_allocated('ev')").fetchone()[0]
        wait_until(lambda: o.execute("SELECT streampos.frontier('ev')").fetchone()[0] == top,
                   timeout=15, message="the frontier once the standby is back")
    assert second == first + 1, (
        f"a second allocation under synchronous_commit = local with the synchronous standby away: {outcome}")


def test_the_lost_range_of_an_earlier_history_outlives_a_second_promotion(clusters):
    """BREAKS the contract's lost range ("on a server whose history may lack
    another's ... any position ... in the stream's lost range" is 72000;
    "the range outlives restarts").

    How: A -> B asynchronous, A commits IDs B never gets, A dies; B is
    promoted: B's mark (1, ceiling] refuses A's followers (72000). B
    allocates (its mark is stored, replicated). C, a standby of B, is then
    promoted when B dies. C's history begins with a mark of its own (have =
    B's newest row, above B's ceiling), and the marks of B's history, which
    C has (they replicated), are never consulted: a follower of A holding
    a position in (1, ceiling] that B refused is accepted by C, which
    lacks exactly what B lacked.

    Fix: refuse a position in the lost range of every history the server
    has a mark for (`history_marks` rows of earlier histories replicate
    with the data), not only the current history's."""
    pair = clusters.pair()
    a, b = pair
    setup_ev(a)
    kept, lost = lose_commits(pair)
    b.promote()
    with b.connect() as c:
        ceiling = c.execute("SELECT last_value FROM streampos.ev_seq").fetchone()[0]
        assert kept[-1] < ceiling < lost[-1]
        position = kept[-1] + 5
        assert sqlstate_of(c, "SELECT streampos.updates('ev', %s, timeout_ms => 0)", (str(position),)) == RESYNC
    [new] = commit_rows(b, 1)
    assert new == ceiling + 1
    bc = standby_of(clusters, b)
    bc.caught_up()
    bc.failover()
    _, c_node = bc
    with c_node.connect() as c:
        marks = c.execute("SELECT have, ceiling FROM streampos.history_marks ORDER BY have").fetchall()
        got_updates = sqlstate_of(c, "SELECT streampos.updates('ev', %s, timeout_ms => 0)", (str(position),))
        got_wait = sqlstate_of(c, "SELECT streampos.wait_for('ev', %s, 0)", (position,))
    assert (got_updates, got_wait) == (RESYNC, RESYNC), (
        f"C accepts position {position}, in B's lost range ({kept[-1]}, {ceiling}] (marks {marks}): "
        f"updates -> {got_updates}, wait_for -> {got_wait}")


def test_a_history_that_cannot_be_recorded_is_not_forgotten_at_restart(clusters):
    """BREAKS "the range outlives restarts": the history id lives only in
    the file `streampos.history`, and a start that cannot write it carries
    on silently (`let _ = write(...)`). A standby whose data directory
    refuses the file (here `streampos.history.tmp` is a directory; in
    practice a full disk or wrong permissions) is promoted, refuses the
    lost range (history in shared memory), stores its marks under that
    history ... and after a clean restart the file is missing: history 0,
    "never in doubt", and every lost position is accepted again.

    Fix: a start that begins a history it cannot record must not carry on
    silently: fail the start (FATAL, as PostgreSQL does for its own
    files), or at least keep the history in the catalog (e.g. the marks
    are kept with the history id, so a restart that finds marks but no
    history file must treat the newest history as current)."""
    pair = clusters.pair()
    a, b = pair
    # Replace the standby with one whose data directory refuses the file.
    b.destroy()
    clusters.nodes.remove(b)

    def refuse_history_file(node):
        tmp = os.path.join(node.datadir, "streampos.history.tmp")
        os.mkdir(tmp)
        if os.geteuid() == 0:
            shutil.chown(tmp, "postgres", "postgres")

    pair = standby_of(clusters, a, before_start=refuse_history_file)
    a, b = pair
    setup_ev(a)
    kept, lost = lose_commits(pair)
    b.promote()
    position = kept[-1] + 5
    with b.connect() as c:
        assert sqlstate_of(c, "SELECT streampos.updates('ev', %s, timeout_ms => 0)", (str(position),)) == RESYNC
    commit_rows(b, 1)
    b.stop()
    b.start()
    with b.connect() as c:
        got = sqlstate_of(c, "SELECT streampos.updates('ev', %s, timeout_ms => 0)", (str(position),))
        marks = c.execute("SELECT history, have, ceiling FROM streampos.history_marks").fetchall()
    assert got == RESYNC, (
        f"after a restart, position {position} in the lost range is accepted ({got!r}); "
        f"marks {marks}, history file present: {os.path.exists(os.path.join(b.datadir, 'streampos.history'))}")


def test_a_stream_adopted_after_a_promotion_keeps_its_lost_range(clusters):
    """BREAKS the contract's lost range (positions "above every ID the
    server had when that history began and at or below its sequence's value
    then" are refused, and "the server itself never reports a position in
    that range").

    How: a table and sequence written without streampos (e.g. Synapse
    before streampos is installed) on A; asynchronous failover to B loses
    rows; B's sequence stands up to 32 past its newest row. `adopt_stream`
    on B stores an empty mark (have = ceiling = the sequence's value): B's
    frontier is then the sequence's value, in the range B lacks, and a
    follower of A at a lost position is accepted.

    Fix: in a history that may lack another's, `adopt_stream` (and
    `adopt_synapse`) compute the mark as a first load does (have = the
    newest row or stored position at or below the sequence), not an empty
    one."""
    pair = clusters.pair()
    a, b = pair
    with a.connect() as c:
        c.execute("CREATE SEQUENCE ev_seq")
        c.execute("CREATE TABLE ev (id bigint PRIMARY KEY, writer text NOT NULL)")

    def insert(node, n):
        with node.connect() as c:
            return [c.execute("INSERT INTO ev VALUES (nextval('ev_seq'), 'w1') RETURNING id").fetchone()[0]
                    for _ in range(n)]

    kept = insert(a, 1)
    pair.caught_up()
    pair.disconnect()
    lost = insert(a, 100)
    a.kill()
    b.promote()
    with b.connect() as c:
        c.execute("SELECT streampos.adopt_stream('ev', 'ev_seq'::regclass)")
        c.execute("SELECT streampos.add_table('ev', 'ev'::regclass, 'id', 'writer')")
        seq = c.execute("SELECT last_value FROM ev_seq").fetchone()[0]
        f = c.execute("SELECT streampos.frontier('ev')").fetchone()[0]
        position = kept[-1] + 5
        got = sqlstate_of(c, "SELECT streampos.updates('ev', %s, timeout_ms => 0)", (str(position),))
        marks = c.execute("SELECT have, ceiling FROM streampos.history_marks").fetchall()
    assert kept[-1] < position <= seq < lost[-1]
    assert got == RESYNC and f == kept[-1], (
        f"adopted after a promotion: frontier {f}, updates since {position} -> {got!r}; "
        f"rows up to {kept[-1]}, sequence {seq}, marks {marks}")


def test_a_promotion_then_a_crash_before_any_use_keeps_the_lost_range(clusters):
    """Withstood: promoted, then crashed before anything used the registry
    (the history file still says "recovering"): the restart continues the
    history as a primary and refuses the lost range."""
    pair = clusters.pair()
    a, b = pair
    setup_ev(a)
    kept, lost = lose_commits(pair)
    b.promote()
    b.kill()
    b.start()
    with b.connect() as c:
        ceiling = c.execute("SELECT last_value FROM streampos.ev_seq").fetchone()[0]
        for position in (kept[-1] + 1, ceiling):
            assert sqlstate_of(c, "SELECT streampos.updates('ev', %s, timeout_ms => 0)",
                               (str(position),)) == RESYNC
            assert sqlstate_of(c, "SELECT streampos.wait_for('ev', %s, 0)", (position,)) == RESYNC
        assert c.execute("SELECT streampos.frontier('ev')").fetchone()[0] == kept[-1]


def test_a_backward_streams_lost_range(clusters):
    """Withstood: a backward stream after an asynchronous failover (internal
    numbering counts up): wait_for refuses a lost target, the frontier
    never falls in the range, and the first new ID is past it."""
    pair = clusters.pair()
    a, b = pair
    setup_ev(a, backwards=True)
    with a.connect() as c:
        kept = [c.execute("INSERT INTO ev SELECT streampos.next_id('ev', 'w1'), 'w1' RETURNING id").fetchone()[0]]
    pair.caught_up()
    pair.disconnect()
    with a.connect() as c:
        for _ in range(50):
            c.execute("INSERT INTO ev SELECT streampos.next_id('ev', 'w1'), 'w1'")
    a.kill()
    b.promote()
    with b.connect() as c:
        assert kept == [-1]
        assert c.execute("SELECT streampos.frontier('ev')").fetchone()[0] in (0, -1)
        assert sqlstate_of(c, "SELECT streampos.wait_for('ev', -5, 0)") == RESYNC
        assert c.execute("SELECT streampos.next_id('ev', 'w1')").fetchone()[0] < -32


@pytest.mark.parametrize("backwards", [False, True])
def test_a_lossless_failover_keeps_a_streams_positions(clusters, backwards):
    """BREAKS, for backward streams, "the server itself never reports a
    position in that range" / a needless resynchronisation after a failover
    that lost nothing (forward streams withstand it: the control case).

    How: the lost range's `have` is "the highest ID this server had: a row
    in the stream's tables, a stored position or a stored frontier". For a
    backward stream the rows are negative, and `lost_range_at_load` reads
    them with `table_max_id_at_most` ("one table of a *forward* stream":
    max(id) where id <= ceiling, not negated), clamped to 0: the rows count
    for nothing, and only a stored position saves the range. After a
    failover that lost nothing, rows -1..-5 replicated, whose positions the
    worker has not stored yet (the last position_interval_ms of commits;
    here 60 s), the promoted server's backward frontier is 0 where the old
    primary reported -5, and `wait_for('ev', -3)` — a row it has — is
    refused with 72000.

    Fix: negate IDs for backward streams there (max(-id) where -id <=
    ceiling), as `updates` and `check_stream` do for their reads."""
    pair = clusters.pair(primary_settings={"streampos.position_interval_ms": 60000})
    a, b = pair
    setup_ev(a, backwards=backwards)
    if backwards:
        with a.connect() as c:
            c.execute("SELECT streampos.add_table('ev', 'ev'::regclass, 'id', 'writer')")
    with a.connect() as c:
        # The worker's first pass (at its start) comes before the rows.
        c.execute("SELECT streampos.create_stream('warm')")
        c.execute("SELECT streampos.next_id('warm', 'w1')")
    time.sleep(1.0)
    ids = commit_rows(a, 5)
    with a.connect() as c:
        reported = c.execute("SELECT streampos.frontier('ev')").fetchone()[0]
    assert reported == ids[-1]
    pair.caught_up()
    a.kill()
    b.promote()
    with b.connect() as c:
        f = c.execute("SELECT streampos.frontier('ev')").fetchone()[0]
        got = sqlstate_of(c, "SELECT streampos.wait_for('ev', %s, 0)", (ids[2],))
        marks = c.execute("SELECT have, ceiling FROM streampos.history_marks").fetchall()
    assert f == reported and got == ids[-1], (
        f"after a failover that lost nothing, rows {ids} all there: frontier {f} (the old primary "
        f"reported {reported}), wait_for {ids[2]} -> {got!r}; marks {marks}")


# =====================================================================
# The stored frontier on a hot standby
# =====================================================================


def test_a_hold_holds_the_standbys_frontier(clusters):
    """Withstood: a hold on the primary (a session's, in flight for every
    snapshot) keeps the stored frontier, and so the standby's, below it
    while other writers commit past it; released, the standby catches up.
    Also for a backward stream."""
    pair = clusters.pair()
    primary, standby = pair
    with primary.connect() as c:
        c.execute("SELECT streampos.create_stream('fw')")
        c.execute("SELECT streampos.create_stream('bw', backwards => true)")
    with primary.connect() as holder, primary.connect() as w, standby.connect() as r:
        held = {s: holder.execute("SELECT streampos.hold_ids(%s, 'p')", (s,)).fetchone()[0] for s in ("fw", "bw")}
        for s in ("fw", "bw"):
            for _ in range(5):
                w.execute("SELECT streampos.next_id(%s, 'w')", (s,))
        w.execute("SELECT pg_catalog.pg_logical_emit_message(true, 'x', '')")
        pair.caught_up()
        time.sleep(0.6)
        w.execute("SELECT pg_catalog.pg_logical_emit_message(true, 'x', '')")
        pair.caught_up()
        assert r.execute("SELECT streampos.frontier('fw'), streampos.frontier('bw')").fetchone() == (0, 0)
        assert r.execute("SELECT streampos.writer_position('fw', 'w')").fetchone()[0] in (0, 6)
        for s in ("fw", "bw"):
            holder.execute("SELECT streampos.release_ids(%s, %s)", (s, held[s]))
        wait_until(lambda: r.execute("SELECT streampos.frontier('fw'), streampos.frontier('bw')").fetchone()
                   == (6, -6), timeout=10, message="the standby to catch up")


def test_a_stream_dropped_and_created_again_starts_over_on_the_standby(clusters):
    """Withstood: stored frontiers are keyed by stream name; a stream
    dropped and created again under the same name must not inherit the old
    stream's (higher) stored frontier on the standby."""
    pair = clusters.pair()
    primary, standby = pair
    with primary.connect() as c:
        c.execute("SELECT streampos.create_stream('again')")
        for _ in range(20):
            c.execute("SELECT streampos.next_id('again', 'w')")
        time.sleep(0.6)
        c.execute("SELECT streampos.drop_stream('again')")
        c.execute("SELECT streampos.create_stream('again')")
        c.execute("BEGIN")
        c.execute("SELECT streampos.next_id('again', 'w')")
        with primary.connect() as w:
            for _ in range(3):
                w.execute("SELECT streampos.next_id('again', 'w2')")
        time.sleep(0.6)
        pair.caught_up()
        with standby.connect() as r:
            assert r.execute("SELECT streampos.frontier('again')").fetchone()[0] == 0
        c.execute("COMMIT")


# =====================================================================
# Logical replication: the trigger that keeps catalog rows local
# =====================================================================


def test_a_subscriber_can_allocate_in_an_apply_trigger(clusters):
    """BREAKS the logical replication section ("a subscriber's streams are
    its own ... To write on a subscriber, register its replicated tables
    as its own streams") and invariant 4 (an error with the wrong SQLSTATE,
    a subscription failing in a loop).

    How: the subscriber numbers incoming rows with a stream of its own, in
    a BEFORE INSERT trigger enabled ALWAYS (so it fires in the apply
    worker). The first row makes `next_id` create the writer's instance;
    that INSERT into streampos.instances runs in the apply worker, where
    the catalog trigger `catalog_rows_stay_local` skips EVERY row a logical
    replication worker writes — not only the rows the subscription brings
    — so the instance is never created, `instance_id` fails with 40001
    ("created concurrently"), and the apply worker retries forever. (The
    same silently drops a history mark stored by an allocation in the
    apply worker of a promoted standby, while the registry believes it
    stored: the lost range is recomputed, later, after a restart.)

    Fix: skip only rows the apply worker is applying from the publisher:
    e.g. a backend-local flag set while the extension writes its own
    catalog (`as_owner`), checked by the trigger before skipping."""
    publisher = clusters.node(wal_level="logical")
    subscriber = clusters.node()
    with publisher.connect() as p:
        p.execute("CREATE TABLE src (id int PRIMARY KEY, body text)")
        p.execute("CREATE PUBLICATION pub FOR TABLE src")
    with subscriber.connect() as s:
        s.execute("SELECT streampos.create_stream('sub_ev')")
        s.execute("CREATE TABLE src (id int PRIMARY KEY, body text, ord bigint)")
        s.execute("""
            CREATE FUNCTION number_row() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN NEW.ord := streampos.next_id('sub_ev', 'applier'); RETURN NEW; END $$""")
        s.execute("CREATE TRIGGER number_row BEFORE INSERT ON src FOR EACH ROW EXECUTE FUNCTION number_row()")
        s.execute("ALTER TABLE src ENABLE ALWAYS TRIGGER number_row")
        s.execute(f"CREATE SUBSCRIPTION sub CONNECTION '{publisher.conninfo()}' PUBLICATION pub "
                  "WITH (copy_data = false)")
        wait_until(lambda: s.execute("SELECT count(*) FROM pg_stat_subscription WHERE pid IS NOT NULL")
                   .fetchone()[0] > 0, timeout=30, message="the apply worker")
    with publisher.connect() as p:
        for i in range(3):
            p.execute("INSERT INTO src VALUES (%s, 'x')", (i,))
    with subscriber.connect() as s:
        try:
            wait_until(lambda: s.execute("SELECT count(*) FROM src").fetchone()[0] == 3, timeout=20,
                       message="the rows to be applied")
            applied = None
        except AssertionError as e:
            applied = str(e)
        errors = s.execute("SELECT apply_error_count FROM pg_stat_subscription_stats").fetchone()[0]
        ords = s.execute("SELECT ord FROM src ORDER BY id").fetchall()
        s.execute("ALTER SUBSCRIPTION sub DISABLE")
        s.execute("ALTER SUBSCRIPTION sub SET (slot_name = NONE)")
        s.execute("DROP SUBSCRIPTION sub")
    log = [line for line in subscriber.log_tail(200).splitlines() if "ERROR" in line][:3]
    assert applied is None and errors == 0, (
        f"the subscriber's apply trigger cannot allocate: {errors} apply errors, rows {ords}; log: {log}")
    assert [o for (o,) in ords] == [1, 2, 3]


# =====================================================================
# The position worker
# =====================================================================


def test_an_orphaned_hold_is_released_without_new_allocations(connect, db, stream):
    """BREAKS progress (invariant 2) and the holds section ("then the
    position worker releases them").

    How: orphaned holds are released only by the database's position
    worker, which is started only by an allocation and never restarted by
    the postmaster. When it is gone (here terminated, as an operator's
    "terminate every backend of this database" does; or it could not get a
    slot: max_worker_processes, 64 databases) and the stream sees no new
    allocation, an orphaned hold holds the frontier for ever: wait_for
    never returns, although every transaction that could write the hold's
    rows has ended.

    Fix: let readers (or any streampos call) start the worker when they
    see orphans (`ensure_running` from the reading path when
    `orphans.valid`), or have the postmaster restart it (a restart time)."""
    create_stream(db, stream)
    holder = connect()
    [held] = hold(holder, stream, "p")
    assert commit_ids(db, stream, "w") == [held + 1]
    # The worker of this database (started by the allocations above; one
    # that had just left for want of work is started again by them and
    # shows in pg_stat_activity a moment later).
    workers = []

    def worker_runs():
        workers[:] = rows(db, "SELECT pid FROM pg_stat_activity WHERE backend_type = "
                              "'streampos position worker' AND datname = current_database()")
        return bool(workers)

    wait_until(worker_runs, timeout=10, message="a position worker in the test database")
    for (pid,) in workers:
        db.execute("SELECT pg_terminate_backend(%s)", (pid,))
    wait_until(lambda: not rows(db, "SELECT pid FROM pg_stat_activity WHERE backend_type = "
                                    "'streampos position worker' AND datname = current_database()"),
               message="the worker to exit")
    db.execute("SELECT pg_terminate_backend(%s)", (backend_pid(holder),))
    wait_until(lambda: [r[1] for r in in_flight(db, stream)] == [None], message="the orphan")
    try:
        # Short polls: the worker releases orphans once every transaction
        # running when it noticed them has ended (a follower's long-poll in
        # progress included: its next call sees the release).
        deadline = time.monotonic() + 5
        released = 0
        while released < held + 1 and time.monotonic() < deadline:
            released = one(db, "SELECT streampos.wait_for(%s, %s, 200)", (stream, held + 1))
    finally:
        # Restart the worker for the rest of the suite (an allocation does).
        commit_ids(db, "warmup", "warmup")
    assert released == held + 1, (
        f"5 s after its session ended, with nothing running, the orphaned hold {held} still holds the "
        f"frontier at {released}: the position worker is gone and nothing starts it")


# =====================================================================
# Errors
# =====================================================================


def test_release_ids_with_a_null_element_is_the_callers_error(connect, db, stream):
    """BREAKS the errors table ("bad argument ... an array that is not a
    hold of this session" is 22023; XX000 is "an internal query failed (not
    the caller's fault)"): `release_ids(s, ARRAY[1, NULL])` fails with
    XX000 "array contains NULL", raised by pgrx's conversion of the
    argument to `Vec<i64>` before the function runs.

    Fix: take the argument as `Array<i64>` and refuse NULL elements with
    22004 (null_value_not_allowed) or 22023, as every other bad array."""
    create_stream(db, stream)
    holder = connect()
    ids = hold(holder, stream, "p")
    err = expect_error(holder, "SELECT streampos.release_ids(%s, ARRAY[%s, NULL]::bigint[])", (stream, ids[0]))
    assert err.diag.sqlstate in ("22004", "22023"), f"{err.diag.sqlstate}: {err}"
    release(holder, stream, ids)


def test_names_taken_back_by_savepoints_never_fill_the_writers_table(connect, db, stream):
    """BREAKS the limits table ("writers of a stream: 1 024") and keeps
    garbage in tokens.

    How: a new writer's first allocation in a subtransaction that rolls
    back (a plpgsql EXCEPTION block, a savepoint) creates its instance in
    the subtransaction; the instance row goes with the rollback, the entry
    stays under the dead id and, at the transaction's COMMIT,
    `settle_seen` remembers that dead id among the stream's writers. 1 024
    such transactions fill the table with ids nobody can name: the first
    real writer of the stream is then refused (54000), and every token
    taken while anything is in flight carries up to 1 024 dead entries.

    Fix: at the commit, remember only instances that exist (an entry whose
    instance a rolled-back savepoint took back is not a writer; see also
    the fixes for the entries under dead ids above)."""
    create_stream(db, stream)
    db.execute(f"""
        DO $$ BEGIN
          FOR k IN 1..{WRITERS_PER_STREAM} LOOP
            BEGIN
              PERFORM streampos.next_id('{stream}', 'ghost' || k);
              RAISE EXCEPTION 'taken back';
            EXCEPTION WHEN raise_exception THEN NULL;
            END;
            COMMIT;
          END LOOP;
        END $$""")
    assert one(db, "SELECT count(*) FROM streampos.instances WHERE instance_name ~ '^ghost[0-9]+$'") == 0
    holder = connect()
    holder.execute("BEGIN")
    try:
        one(holder, "SELECT streampos.next_id(%s, 'real')", (stream,))
        refused = None
    except psycopg.Error as e:
        refused = f"{e.sqlstate}: {e.diag.message_primary}"
    text = token_text(db, stream)
    holder.execute("ROLLBACK")
    assert refused is None, f"the stream's first real writer: {refused}"
    assert len(token_entries(text)) <= 1, f"a token with {len(token_entries(text))} entries of dead ids"


@pytest.mark.parametrize("ending", ["rollback", "savepoint"])
def test_a_first_allocation_that_rolls_back_keeps_the_frontier_after_a_restart(clusters, ending):
    """BREAKS invariant 3 ("the frontier ... never goes backwards ...
    across crashes and restarts too") and "the server itself never reports
    a position in that range".

    How: a promoted standby B has the lost range (1, 33]. Its first
    allocation (ID 34) stores the stream's mark *in the allocating
    transaction*; that transaction rolls back (or the allocation was in a
    savepoint that rolls back): the mark row is gone, but ID 34 is
    finished (aborted, durable), so B reports frontier 34. B crashes
    before its position worker stored that frontier (stored positions
    stand in for the mark: `have` counts them): at the restart the mark is
    computed again from the sequence, now at 34 + 32 logged ahead:
    (have, ceiling] = (1, 66], so B's frontier is 1 — back from 34 — and
    B refuses (72000) the very position it reported.

    Fix: the mark must be stored whatever becomes of the transaction that
    first allocates: committed in a transaction of its own (e.g. by the
    position worker, waited for by the first allocation) and durable
    before the first ID of the history is; a subtransaction of the
    allocating transaction is not enough."""
    pair = clusters.pair()
    a, b = pair
    setup_ev(a)
    kept, lost = lose_commits(pair)
    # The position worker stores positions at start and at shutdown only,
    # so that a crash comes before it stores the frontier (it would stand
    # in for the mark: `have` counts stored frontiers).
    b.set(streampos__position_interval_ms=60000)
    b.reload()
    b.promote()
    with b.connect() as c:
        # Another stream's allocation starts the worker, whose first pass
        # runs at once; the next one is a minute away.
        c.execute("SELECT streampos.create_stream('warm')")
        c.execute("SELECT streampos.next_id('warm', 'w1')")
        time.sleep(1.0)
        ceiling = c.execute("SELECT last_value FROM streampos.ev_seq").fetchone()[0]
        c.execute("BEGIN")
        if ending == "savepoint":
            c.execute("SAVEPOINT s")
        first = c.execute("SELECT streampos.next_id('ev', 'w1')").fetchone()[0]
        c.execute("ROLLBACK" if ending == "rollback" else "ROLLBACK TO SAVEPOINT s")
        if ending == "savepoint":
            c.execute("COMMIT")
        assert first == ceiling + 1
        # Until the history's mark is stored (by a first allocation that
        # commits), nothing above `have` is finished: B reports the kept
        # row's position, not the aborted ID (0.3.0's fix).
        reported = c.execute("SELECT streampos.frontier('ev')").fetchone()[0]
    assert reported == kept[-1]
    b.kill()
    b.start()
    with b.connect() as c:
        after = c.execute("SELECT streampos.frontier('ev')").fetchone()[0]
        got = sqlstate_of(c, "SELECT streampos.updates('ev', %s, timeout_ms => 0)", (str(reported),))
        marks = c.execute("SELECT have, ceiling FROM streampos.history_marks").fetchall()
    assert after >= reported and got != RESYNC, (
        f"B reported frontier {reported}; after a crash restart its frontier is {after} and updates since "
        f"{reported} -> {got!r} (marks {marks}, original range ({kept[-1]}, {ceiling}])")


def test_an_orphaned_hold_never_sends_other_writers_back(connect, db, stream):
    """BREAKS invariant 3 ("every writer position never goes backwards ...
    for snapshots taken later").

    How: a hold of writer `p` (ID 1) holds `p` only: writer `w`, which
    commits 2 and 3, is at 3 (token m0~w.3). The holding session ends: its
    hold is folded into the stream's orphan record, which "holds every
    writer back from its lowest ID" — so `w` drops to 0 in writer_position,
    writer_positions and tokens for every later snapshot, until the worker
    releases the orphan.

    Fix: keep the orphan's writer (an orphan record per (stream, writer),
    or orphaned holds kept as holds of no session), so that an orphan holds
    what the hold held, never more."""
    create_stream(db, stream)
    holder = connect()
    [held] = hold(holder, stream, "p")
    assert commit_ids(db, stream, "w", 2) == [held + 1, held + 2]
    # A transaction that runs keeps the orphan from being released while
    # the later snapshot is taken.
    running = connect()
    running.execute("BEGIN")
    running.execute("SELECT pg_catalog.pg_current_xact_id()")
    w = one(db, "SELECT streampos.instance_id('w')")
    before = (one(db, "SELECT streampos.writer_position(%s, 'w')", (stream,)), token_text(db, stream))
    db.execute("SELECT pg_terminate_backend(%s)", (backend_pid(holder),))
    wait_until(lambda: [r[1] for r in in_flight(db, stream)] == [None], message="the orphan")
    after = (one(db, "SELECT streampos.writer_position(%s, 'w')", (stream,)), token_text(db, stream))
    running.execute("COMMIT")
    assert before[0] == held + 2 and token_position(before[1], w) == held + 2, before
    assert after[0] >= before[0] and token_position(after[1], w) >= held + 2, (
        f"writer w went back when another writer's hold was orphaned: {before} then {after}")
