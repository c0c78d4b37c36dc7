"""Trust, round 4 (issue 31): what a fourth adversary broke in 0.3.0, each
reproduction kept as a test. The escalation through the caller's settings
(finding 2) is in test_untrusted.py with the other untrusted-object
attacks; the trap fixture (traps.py) checks its whole class in every test.
"""

import os
import time

import psycopg
import pytest

import support
from support import (
    commit_ids,
    create_stream,
    expect_error,
    frontier,
    one,
    rows,
    wait_until,
)


def hold(conn, stream, writer, n=1):
    return one(conn, "SELECT streampos.hold_ids(%s, %s, %s)", (stream, writer, n))


def needs_prepared_transactions(conn):
    if int(one(conn, "SHOW max_prepared_transactions")) == 0:
        pytest.skip("max_prepared_transactions = 0")


# ------------------------------------------ finding 1: what outlives a start


def prepared_row_of_a_hold(connect, db, stream, rows_before=0, rows_after=0, before_hold=None,
                           read_only_at_prepare=False):
    """A stream whose held ID's row is written by a PREPAREd transaction,
    with `rows_before` and `rows_after` committed rows around the hold
    (`before_hold()` runs just before it is taken; the transaction turns
    read-only after its INSERT if asked): (table, held ID, the prepared
    transaction's gid)."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint)")
    commit_rows(db, stream, table, rows_before)
    if before_hold is not None:
        before_hold()
    holder = connect()
    [held] = hold(holder, stream, "p")
    writer = connect()
    gid = f"{stream}_gid"
    writer.execute("BEGIN")
    writer.execute(f"INSERT INTO {table} VALUES (%s)", (held,))
    if read_only_at_prepare:
        writer.execute("SET TRANSACTION READ ONLY")
    writer.execute(f"PREPARE TRANSACTION '{gid}'")
    commit_rows(db, stream, table, rows_after)
    return table, held, gid


def commit_rows(db, stream, table, n):
    for _ in range(n):
        db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w')", (stream,))


def roll_back_if_prepared(gid):
    """A test's clean-up: the prepared transaction `gid`, unless the test
    committed it (or it never was prepared), is rolled back."""
    if gid is None:
        return
    with support.connect_raw() as c:
        if one(c, "SELECT count(*) FROM pg_prepared_xacts WHERE gid = %s", (gid,)):
            c.execute(f"ROLLBACK PREPARED '{gid}'")


@pytest.mark.restarts_server
@pytest.mark.parametrize("stop", ["immediate", "fast"])
def test_a_prepared_row_of_a_held_id_is_not_passed_after_a_start(connect, db, stream, stop):
    """Finding 1. A session holds ID 1; another transaction writes its row
    and PREPAREs; another writer commits ID 2; the server stops (a crash, or
    a clean stop) and starts. The hold is gone with its session, but the
    prepared transaction is not: 0.3.0 answered frontier = the sequence's
    value (33 after a crash) with row 1 invisible, and COMMIT PREPARED then
    put row 1 below a frontier a reader had been given. Now every ID above
    the stored frontier stays in flight until the transactions that were
    running at the stream's first use (the prepared one among them) end."""
    needs_prepared_transactions(db)
    table, held, gid = prepared_row_of_a_hold(connect, db, stream)
    try:
        assert commit_ids(db, stream, "w") == [held + 1]
        # The position worker stores what it saw (the frontier held at 0).
        support.flush_wal(db)
        time.sleep(1.2)
        support.restart_server(stop)
        with support.connect_raw() as c:
            for _ in range(3):
                f = frontier(c, stream)
                seen = one(c, f"SELECT count(*) FROM {table} WHERE id <= %s", (f,))
                assert f < held, f"frontier {f} passed ID {held}, whose row a prepared transaction holds"
                time.sleep(0.5)
            c.execute(f"COMMIT PREPARED '{gid}'")
            wait_until(lambda: frontier(c, stream) >= held + 1, timeout=10, message="the release after the commit")
            f = frontier(c, stream)
            assert one(c, f"SELECT count(*) FROM {table} WHERE id <= %s", (f,)) == 1
            assert seen == 0
    finally:
        roll_back_if_prepared(gid)


@pytest.mark.restarts_server
def test_a_snapshot_from_before_commit_prepared_is_not_passed_the_row(connect, db, stream):
    """The adversary's variant of finding 1: the first fix asked whether a
    prepared transaction existed when the stream was first used. A reader
    whose REPEATABLE READ snapshot was taken before COMMIT PREPARED, using
    the stream only after it, was told the frontier covered the held ID
    whose row its snapshot cannot see. Now the decision is the snapshots'
    horizon against the first xid of the start: it cannot change back."""
    needs_prepared_transactions(db)
    table, held, gid = prepared_row_of_a_hold(connect, db, stream, rows_before=3, rows_after=3)
    support.flush_wal(db)
    time.sleep(1.2)
    support.restart_server("fast")
    with support.connect_raw() as reader, support.connect_raw() as c:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        one(reader, "SELECT 1")
        c.execute(f"COMMIT PREPARED '{gid}'")
        f = frontier(reader, stream)
        ids = [r[0] for r in rows(reader, f"SELECT id FROM {table} WHERE id <= %s ORDER BY id", (f,))]
        assert held not in ids and f < held, f"frontier {f} passed ID {held}, whose row the snapshot cannot see"
        reader.execute("COMMIT")
        wait_until(lambda: frontier(c, stream) >= held + 3, timeout=10, message="the release")


@pytest.mark.restarts_server
def test_a_start_without_prepared_transactions_holds_nothing(connect, db, stream):
    """The other side of finding 1's fix: with no prepared transaction, a
    crash leaves nothing in flight (the frontier is the sequence's value at
    once), and a prepared transaction of another database does not hold
    this one."""
    create_stream(db, stream)
    commit_ids(db, stream, "w", 2)
    support.restart_server("immediate")
    with support.connect_raw() as c:
        seq_value = one(c, "SELECT streampos.max_allocated(%s)", (stream,))
        assert frontier(c, stream) == seq_value


def positions(conn, stream, writers):
    """(frontier, current token, each writer's position)."""
    return (
        frontier(conn, stream),
        one(conn, "SELECT streampos.current_token(%s)::text", (stream,)),
        [one(conn, "SELECT streampos.writer_position(%s, %s)", (stream, w)) for w in writers],
    )


@pytest.mark.restarts_server
@pytest.mark.parametrize("stop", ["immediate", "fast"])
def test_positions_do_not_go_back_after_a_start_a_prepared_transaction_outlived(connect, db, stream, stop):
    """Nemesis finding 1. A session holds ID 1 for writer p, a prepared
    transaction holds its row, writer w commits 2 and 3; the server stops
    and starts. 0.3.0's fix of finding 1 held every writer back from the
    stored frontier: the token went from m0~1.3 (w at 3) to 0, and after a
    crash with the worker's store behind, the frontier fell too. Now the
    prepared transaction recorded which holds were given out when it was
    prepared (streampos.prepared_holds): only p is held, from its ID; w
    keeps its position, nothing goes back, and row 1 is still not passed."""
    needs_prepared_transactions(db)
    gid = None
    try:
        # The worker's store behind, so that what a crash finds stored lags.
        with support.server_settings({"streampos.position_interval_ms": "60000"}):
            table, held, gid = prepared_row_of_a_hold(connect, db, stream, rows_after=2)
            before = positions(db, stream, ["w", "p"])
            assert before[0] == held - 1 and before[2][0] == held + 2, before
            support.flush_wal(db)
            support.restart_server(stop)
            with support.connect_raw() as c:
                after = positions(c, stream, ["w", "p"])
                # A crash may move positions forward (the sequence logs 32
                # values ahead), never back.
                went_back = (
                    after[0] < before[0]
                    or not one(c, "SELECT streampos.is_before_or_eq(%s::streampos.multi_writer_token, "
                                  "%s::streampos.multi_writer_token)", (before[1], after[1]))
                    or any(a < b for a, b in zip(after[2], before[2]))
                )
                assert not went_back, f"positions went back across the start: {before} -> {after}"
                if stop == "fast":
                    assert (after[0], after[2]) == (before[0], before[2])
                assert after[0] < held
        with support.connect_raw() as c:
            c.execute(f"COMMIT PREPARED '{gid}'")
            wait_until(lambda: frontier(c, stream) >= held + 2, timeout=10, message="the release after the commit")
            assert one(c, f"SELECT count(*) FROM {table} WHERE id <= %s", (held + 2,)) == 3
    finally:
        roll_back_if_prepared(gid)


@pytest.mark.restarts_server
@pytest.mark.parametrize("stop", ["immediate", "fast"])
def test_a_prepared_transaction_without_holds_holds_nothing_back_after_a_start(connect, db, stream, stop):
    """Nemesis finding 1, its first case: any prepared transaction (this one
    touches no stream, and no hold was given out when it was prepared) made
    every writer fall back to the stored frontier at the next start. It
    recorded no hold, so nothing is held back."""
    needs_prepared_transactions(db)
    create_stream(db, stream)
    other = connect()
    gid = f"{stream}_unrelated"
    try:
        with support.server_settings({"streampos.position_interval_ms": "60000"}):
            other.execute("BEGIN")
            other.execute(f"CREATE TABLE {stream}_other (x int)")
            other.execute(f"PREPARE TRANSACTION '{gid}'")
            commit_ids(db, stream, "w", 3)
            # The table rewritten after the PREPARE (its catalog row too): the
            # transaction is still not "prepared before the records existed".
            # (Holds other tests left orphaned would have been recorded, and
            # their lock would keep VACUUM FULL waiting: bounded.)
            db.execute("SET lock_timeout = '5s'")
            try:
                db.execute("VACUUM FULL streampos.prepared_holds")
            except psycopg.errors.LockNotAvailable:
                pass
            db.execute("RESET lock_timeout")
            before = positions(db, stream, ["w"])
            support.flush_wal(db)
            support.restart_server(stop)
            with support.connect_raw() as c:
                after = positions(c, stream, ["w"])
                assert after[0] >= before[0] and after[2][0] >= before[2][0], (before, after)
                if stop == "fast":
                    assert after == before
                assert one(
                    c,
                    "SELECT count(*) FROM streampos.prepared_holds h JOIN streampos.streams s USING (stream_key) "
                    "WHERE s.stream_name = %s",
                    (stream,),
                ) == 0
    finally:
        roll_back_if_prepared(gid)


@pytest.mark.restarts_server
@pytest.mark.parametrize("commit_first", [False, True])
def test_a_transaction_prepared_before_the_records_existed_holds_every_writer(connect, db, stream, commit_first):
    """A transaction prepared by a library before 0.4.0, or before ALTER
    EXTENSION UPDATE made streampos.prepared_holds, recorded nothing of the
    holds it may hold rows of: after a start, every writer is held from
    the stored frontier, as 0.3.0 did (rather than passing its row). Also
    when it is committed before the stream's first use, for a snapshot
    taken before that COMMIT PREPARED (the reviewer's case: "still
    prepared now" is no answer for it)."""
    needs_prepared_transactions(db)
    upgrade = open(os.path.join(os.path.dirname(__file__), "..", "..", "sql", "streampos--0.3.0--0.4.0.sql")).read()
    made = upgrade[upgrade.index("CREATE TABLE streampos.prepared_holds"):]

    def drop_the_records_table():
        db.execute("ALTER EXTENSION streampos DROP TABLE streampos.prepared_holds")
        db.execute("DROP TABLE streampos.prepared_holds")

    table, held, gid = prepared_row_of_a_hold(connect, db, stream, before_hold=drop_the_records_table)
    try:
        db.execute(made)
        db.execute("ALTER EXTENSION streampos ADD TABLE streampos.prepared_holds")
        commit_rows(db, stream, table, 2)
        support.flush_wal(db)
        support.restart_server("fast")
        with support.connect_raw() as reader, support.connect_raw() as c:
            if commit_first:
                reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                one(reader, "SELECT 1")
                c.execute(f"COMMIT PREPARED '{gid}'")
            f = frontier(reader, stream)
            seen = [r[0] for r in rows(reader, f"SELECT id FROM {table} WHERE id <= %s", (f,))]
            assert f < held and held not in seen, "the row of a transaction prepared before the records was passed"
            if commit_first:
                reader.execute("COMMIT")
            else:
                c.execute(f"COMMIT PREPARED '{gid}'")
            wait_until(lambda: frontier(c, stream) >= held + 2, timeout=10, message="the release after the commit")
    finally:
        roll_back_if_prepared(gid)


@pytest.mark.restarts_server
def test_a_transaction_that_turned_read_only_after_its_row_still_records_the_holds(connect, db, stream):
    """The fifth adversary's first find: SET TRANSACTION READ ONLY after
    the INSERT, then PREPARE. The records were skipped for read-only
    transactions, and after a start the frontier passed the prepared row.
    A transaction that wrote WAL records, read-only or not."""
    needs_prepared_transactions(db)
    table, held, gid = prepared_row_of_a_hold(connect, db, stream, rows_after=1, read_only_at_prepare=True)
    try:
        support.flush_wal(db)
        support.restart_server("immediate")
        with support.connect_raw() as c:
            assert frontier(c, stream) < held, "the frontier passed a prepared row of a held ID"
            c.execute(f"COMMIT PREPARED '{gid}'")
            wait_until(lambda: frontier(c, stream) >= held + 1, timeout=10, message="the release after the commit")
    finally:
        roll_back_if_prepared(gid)


@pytest.mark.restarts_server
def test_a_change_of_the_records_tables_catalog_row_sends_nothing_back(connect, db, stream):
    """The fifth adversary's second find: whether a prepared transaction
    predated the records was told by the table's pg_class xmin, which a
    GRANT or VACUUM FULL rewrites: every prepared transaction then counted
    as unrecorded, and every writer fell back to the stored frontier. Now
    the table's first row, written with it, tells."""
    needs_prepared_transactions(db)
    table, held, gid = prepared_row_of_a_hold(connect, db, stream, rows_after=3)
    try:
        before = positions(db, stream, ["w"])
        # A prepared transaction with records keeps the table locked
        # (ROW EXCLUSIVE): a GRANT still rewrites its catalog row.
        db.execute("GRANT SELECT ON streampos.prepared_holds TO PUBLIC")
        support.flush_wal(db)
        support.restart_server("fast")
        with support.connect_raw() as c:
            after = positions(c, stream, ["w"])
            assert (after[0], after[2]) == (before[0], before[2]), (before, after)
            assert after[0] < held
            c.execute(f"COMMIT PREPARED '{gid}'")
    finally:
        roll_back_if_prepared(gid)


@pytest.mark.restarts_server
def test_more_than_eight_recorded_writers_send_no_other_writer_back(connect, db, stream):
    """The fifth adversary's third find: the records of a start were folded
    into the stream's orphaned holds, eight writers of them; the rest held
    every writer, and an idle writer fell from 11 to 8. The orphaned holds
    now keep 64 writers."""
    needs_prepared_transactions(db)
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint)")
    holder = connect()
    held = [hold(holder, stream, f"p{k}")[0] for k in range(10)]
    writer = connect()
    gid = f"{stream}_nine"
    writer.execute("BEGIN")
    writer.execute(f"INSERT INTO {table} VALUES (%s)", (held[-1],))
    writer.execute(f"PREPARE TRANSACTION '{gid}'")
    try:
        commit_rows(db, stream, table, 2)
        before = positions(db, stream, ["w"])
        support.flush_wal(db)
        support.restart_server("fast")
        with support.connect_raw() as c:
            after = positions(c, stream, ["w"])
            assert (after[0], after[2]) == (before[0], before[2]), (before, after)
            c.execute(f"COMMIT PREPARED '{gid}'")
    finally:
        roll_back_if_prepared(gid)


def test_a_prepare_waits_a_bounded_time_behind_a_lock_on_the_records(connect, db, stream):
    """The fifth adversary's fifth find: PREPARE runs without
    statement_timeout, and its INSERT of the records waited (604 s) behind
    an ACCESS EXCLUSIVE lock on the table (LOCK, VACUUM FULL, a queued DROP
    EXTENSION). It now waits at most the catalog's lock bound: 55P03, and
    the transaction is rolled back."""
    needs_prepared_transactions(db)
    create_stream(db, stream)
    holder = connect()
    hold(holder, stream, "p")
    locker = connect()
    locker.execute("BEGIN")
    locker.execute("LOCK streampos.prepared_holds IN ACCESS EXCLUSIVE MODE")
    w = connect()
    w.execute("SET statement_timeout = '3s'")
    w.execute("BEGIN")
    w.execute(f"CREATE TABLE {stream}_unrelated (a int)")
    started = time.monotonic()
    err = expect_error(w, f"PREPARE TRANSACTION '{stream}_blocked'", sqlstate="55P03")
    assert time.monotonic() - started < 30, err
    locker.execute("ROLLBACK")
    assert one(db, "SELECT count(*) FROM pg_prepared_xacts WHERE gid = %s", (f"{stream}_blocked",)) == 0


def test_prepared_holds_are_recorded_with_the_transaction_and_forgotten_after_it(connect, db, stream):
    """What a PREPARE records: the lowest held ID per writer of every hold
    given out then (its own uncommitted rows: invisible until COMMIT
    PREPARED, gone with ROLLBACK PREPARED); the position worker forgets
    committed records once every snapshot sees them."""
    needs_prepared_transactions(db)
    create_stream(db, stream)
    holder = connect()
    ids_p = hold(holder, stream, "p", 3)
    [id_q] = hold(holder, stream, "q")
    key = one(db, "SELECT stream_key FROM streampos.streams WHERE stream_name = %s", (stream,))
    w = connect()
    # A snapshot from before the COMMIT PREPARED keeps the records.
    old_snapshot = connect()
    old_snapshot.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    one(old_snapshot, "SELECT 1")
    for gid, end in ((f"{stream}_a", "ROLLBACK"), (f"{stream}_b", "COMMIT")):
        w.execute("BEGIN")
        one(w, "SELECT pg_current_xact_id()")
        w.execute(f"PREPARE TRANSACTION '{gid}'")
        assert one(db, "SELECT count(*) FROM streampos.prepared_holds WHERE stream_key = %s", (key,)) == 0
        db.execute(f"{end} PREPARED '{gid}'")
    recorded = rows(
        db,
        "SELECT i.instance_name, h.min_id FROM streampos.prepared_holds h "
        "JOIN streampos.instances i USING (instance_id) WHERE h.stream_key = %s ORDER BY 1",
        (key,),
    )
    assert recorded == [("p", min(ids_p)), ("q", id_q)]
    time.sleep(11)
    assert one(db, "SELECT count(*) FROM streampos.prepared_holds WHERE stream_key = %s", (key,)) == 2
    old_snapshot.execute("COMMIT")
    wait_until(
        lambda: one(db, "SELECT count(*) FROM streampos.prepared_holds WHERE stream_key = %s", (key,)) == 0,
        timeout=30,
        message="the worker to forget the committed records",
    )
    # A read-only transaction wrote no row: it records nothing (and its
    # PREPARE works).
    w.execute("BEGIN READ ONLY")
    w.execute(f"PREPARE TRANSACTION '{stream}_ro'")
    db.execute(f"COMMIT PREPARED '{stream}_ro'")
    assert one(db, "SELECT count(*) FROM streampos.prepared_holds WHERE stream_key = %s", (key,)) == 0
    # Without holds given out, nothing is recorded.
    for ids in (ids_p, [id_q]):
        holder.execute("SELECT streampos.release_ids(%s, %s)", (stream, ids))
    w.execute("BEGIN")
    w.execute(f"PREPARE TRANSACTION '{stream}_c'")
    db.execute(f"COMMIT PREPARED '{stream}_c'")
    assert one(db, "SELECT count(*) FROM streampos.prepared_holds WHERE stream_key = %s", (key,)) == 0


# ------------------------------------------- finding 3: an ID column's type


def test_an_id_column_that_does_not_compare_with_bigint_is_refused(db, stream):
    """Finding 3. add_table accepted a text or boolean ID column, and every
    updates() of the stream then failed with 42883. Now it is refused
    (42804) with what the column must be."""
    create_stream(db, stream)
    for kind in ("text", "boolean", "numeric", "timestamptz"):
        table = f"{stream}_{kind}"
        db.execute(f"CREATE TABLE {table} (id {kind}, instance_name text)")
        err = expect_error(
            db, "SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table), sqlstate="42804"
        )
        assert err.diag.message_primary == (
            f'column "id" of table public.{table} is of type '
            f"{one(db, 'SELECT %s::regtype::text', (kind,))}, not an integer type"
        )
        assert err.diag.message_detail.startswith("A stream's IDs are bigint")
    for kind in ("smallint", "integer", "bigint"):
        table = f"{stream}_{kind}"
        db.execute(f"CREATE TABLE {table} (id {kind}, instance_name text)")
        db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))


@pytest.mark.restarts_server
def test_a_registered_id_column_altered_to_text_stops_only_its_table(connect, db, stream):
    """Finding 3. A registered table's ID column altered to text made every
    updates() of the stream fail (its good tables and every consumer too),
    check_stream say all was well, and next_id fail after a restart
    that starts a new history. Now updates() skips that table and serves the
    others, check_stream reports it, and allocation is not affected."""
    create_stream(db, stream)
    good, bad = f"{stream}_good", f"{stream}_bad"
    for t in (good, bad):
        db.execute(f"CREATE TABLE {t} (id bigint, instance_name text)")
        db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, t))
    for _ in range(2):
        db.execute(f"INSERT INTO {good} SELECT streampos.next_id(%s, 'w'), 'w'", (stream,))
        db.execute(f"INSERT INTO {bad} SELECT streampos.next_id(%s, 'w'), 'w'", (stream,))
    db.execute(f"ALTER TABLE {bad} ALTER COLUMN id TYPE text")
    answer = one(db, "SELECT streampos.updates(%s, '0')", (stream,))
    assert [h[0] for h in answer["data"] if isinstance(h[0], str)] == [f"public.{good}"]
    checks = rows(db, "SELECT check_name, ok, detail FROM streampos.check_stream(%s)", (stream,))
    failed = [(n, d) for n, ok, d in checks if not ok]
    assert failed and any("not an integer type" in d for _, d in failed), checks
    support.restart_server("immediate")
    with support.connect_raw() as c:
        assert one(c, "SELECT streampos.next_id(%s, 'w')", (stream,)) > 4
        one(c, "SELECT streampos.updates(%s, '0')", (stream,))


# --------------------------------------- finding 8: a sequence that is gone


def test_a_stream_whose_sequence_was_dropped_is_reported_and_can_be_dropped(db, stream):
    """Finding 8. A stream adopted on a bigserial's sequence whose table was
    dropped: check_stream failed with XX000 ("could not open relation with
    OID"). Now check_stream reports it, allocation is refused with 55000
    and a hint, and drop_stream forgets the stream."""
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigserial, instance_name text)")
    db.execute("SELECT streampos.adopt_stream(%s, %s)", (stream, f"{table}_id_seq"))
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    db.execute(f"DROP TABLE {table}")
    for repair in (False, True):
        checks = rows(db, "SELECT check_name, ok, detail FROM streampos.check_stream(%s, %s)", (stream, repair))
        assert len(checks) == 1 and checks[0][:2] == ("sequence", False), checks
        assert "was dropped" in checks[0][2]
    err = expect_error(db, "SELECT streampos.next_id(%s, 'w')", (stream,), sqlstate="55000")
    assert err.diag.message_primary == f'the sequence of stream "{stream}" no longer exists'
    assert "drop_stream() forgets it" in err.diag.message_hint
    db.execute("SELECT streampos.drop_stream(%s)", (stream,))
    expect_error(db, "SELECT streampos.frontier(%s)", (stream,), sqlstate="42704")


# ------------------------------------- finding 4: a full registry empties


def test_a_full_registry_of_a_dropped_databases_streams_empties_once_the_horizon_moves(connect, stream):
    """Finding 4. Every stream slot taken by streams that committed IDs
    while another session held an xid (so their finished entries stayed in
    the ring), then dropped with their database: the entries were pruned
    only by that database's position worker (gone) or a crowded ring, so
    every new stream got 53400 for good. Now a full registry prunes before
    it reclaims."""
    db = connect()
    size = int(one(db, "SHOW streampos.max_streams"))
    horizon = connect()
    horizon.execute("BEGIN")
    one(horizon, "SELECT pg_current_xact_id()")
    scratch = f"full_{stream}"[:60]
    with support.connect_raw("postgres") as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{scratch}"')
        admin.execute(f'CREATE DATABASE "{scratch}"')
    try:
        with support.connect_raw(scratch) as other:
            other.execute("CREATE EXTENSION streampos")
            full = None
            for i in range(size + 1):
                create_stream(other, f"s{i}")
                try:
                    other.execute("SELECT streampos.next_id(%s, 'w')", (f"s{i}",))
                except psycopg.Error as e:
                    full = e.diag.sqlstate
                    break
            assert full == "53400", "the registry never filled up"
    finally:
        with support.connect_raw("postgres") as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{scratch}" WITH (FORCE)')
    horizon.execute("COMMIT")
    create_stream(db, stream)
    assert one(db, "SELECT streampos.next_id(%s, 'w')", (stream,)) == 1
    assert frontier(db, stream) == 1


# ------------------------------ the adversary of 0.4.0: the caller's transaction


OWNER = "streampos_trust4_owner"

TRANSACTION_TRAP = """
CREATE FUNCTION public.t4_trapv() RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  EXECUTE 'SET CONSTRAINTS ALL DEFERRED';
  BEGIN EXECUTE 'DECLARE t4_cur CURSOR FOR SELECT 1'; EXCEPTION WHEN duplicate_cursor THEN NULL; END;
  PERFORM pg_catalog.pg_notify('t4_channel', 'from the owner');
  RETURN true;
END $$;
CREATE FUNCTION public.t4_trap() RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS
  $$ BEGIN RETURN public.t4_trapv(); END $$;
"""


def owned_stream_table(db, stream, owner):
    """A stream with one committed row in a table `owner` owns (SELECT for
    PUBLIC); the table's name."""
    support.ensure_login_role(owner)
    create_stream(db, stream)
    table = f"public.{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint, inst text)")
    db.execute(f"ALTER TABLE {table} OWNER TO {owner}")
    db.execute(f"GRANT SELECT ON {table} TO PUBLIC")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'inst')", (stream, table))
    db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w'), 'w'", (stream,))
    return table


def test_the_owners_code_leaves_the_callers_transaction_as_it_was(connect, db, stream):
    """An index predicate of the table's owner ran inside the caller's
    transaction (VACUUM runs such code in a transaction of its own): SET
    CONSTRAINTS ALL DEFERRED stayed in force (the caller's deferrable
    constraint was no longer checked per statement), a cursor it declared
    stayed open under its name, a notification went out at the caller's
    commit. The read now runs in a subtransaction that is rolled back."""
    table = owned_stream_table(db, stream, OWNER)
    db.execute("CREATE TABLE IF NOT EXISTS public.t4_unique (x int UNIQUE DEFERRABLE INITIALLY IMMEDIATE)")
    db.execute("TRUNCATE public.t4_unique")
    db.execute("INSERT INTO public.t4_unique VALUES (1)")
    db.execute(f"GRANT CREATE ON SCHEMA public TO {OWNER}")
    owner = connect(user=OWNER)
    owner.execute("DROP FUNCTION IF EXISTS public.t4_trap(), public.t4_trapv()")
    owner.execute(TRANSACTION_TRAP)
    owner.execute(f"CREATE INDEX ON {table} (id) WHERE public.t4_trap()")
    listener = connect()
    listener.execute("LISTEN t4_channel")
    caller = connect()
    with caller.transaction():
        answer = one(caller, "SELECT streampos.updates(%s, '0')", (stream,))
        assert [r[0] for r in answer["data"][1:]] == [1]
        assert rows(caller, "SELECT name FROM pg_cursors") == []
        with pytest.raises(psycopg.errors.UniqueViolation):
            with caller.transaction():
                caller.execute("INSERT INTO public.t4_unique VALUES (1)")
    time.sleep(0.2)
    listener.execute("SELECT 1")
    assert list(listener.notifies(timeout=0.5, stop_after=1)) == []


def test_a_policy_forced_on_the_owner_refuses_the_read_rather_than_hide_rows(db, stream):
    """With FORCE ROW LEVEL SECURITY the table's owner is subject to its own
    policies: the read as the owner left out the rows a policy hid, and the
    token passed them (a superuser follower never got row 2). The read now
    runs with row_security = off, as pg_dump's: refused (42501)."""
    table = owned_stream_table(db, stream, OWNER)
    db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w'), 'w' FROM generate_series(1, 2)", (stream,))
    db.execute(f"SET ROLE {OWNER}")
    db.execute(f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY")
    db.execute(f"ALTER TABLE {table} FORCE ROW LEVEL SECURITY")
    db.execute(f"CREATE POLICY hide_two ON {table} USING (id <> 2)")
    db.execute("RESET ROLE")
    err = expect_error(db, "SELECT streampos.updates(%s, '0')", (stream,), sqlstate="42501")
    assert err.diag.message_primary.startswith("query would be affected by row-level security policy")
    db.execute(f"ALTER TABLE {table} NO FORCE ROW LEVEL SECURITY")
    assert [r[0] for r in one(db, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1:]] == [1, 2, 3]


def test_bigint_domains_and_arrays_are_strings_too(db, stream):
    """streampos.json_bigint_as_string missed a domain over bigint (an ID
    column may be one) and bigint[]: JavaScript got them rounded."""
    create_stream(db, stream)
    db.execute("DO $$ BEGIN CREATE DOMAIN public.t4_bigd AS bigint; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id public.t4_bigd, inst text, many bigint[], big public.t4_bigd, "
               "bigds public.t4_bigd[])")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'inst')", (stream, table))
    db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w'), 'w', "
               "ARRAY[[9007199254740993, 1], [2, 3]], 9007199254740995, ARRAY[9007199254740997, NULL]", (stream,))
    db.execute("SET streampos.json_bigint_as_string = on")
    row = one(db, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1]
    assert row == ["1", "w", [["9007199254740993", "1"], ["2", "3"]], "9007199254740995", ["9007199254740997", None]]
    # The adversary of 0.4.0 (F4): an array of a domain over a built-in
    # type is built in too (it was its output text, "{…}", with the setting
    # off): the same JSON shape either way.
    db.execute("SET streampos.json_bigint_as_string = off")
    row = one(db, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1]
    assert row[4] == [9007199254740997, None]


def test_a_select_that_writes_its_row_is_not_warned_about(db, stream):
    """The WARNING for IDs finished at once is for a bare SELECT: a SELECT
    … INTO and a SELECT with a data-modifying WITH write their row in the
    same statement."""
    create_stream(db, stream)
    db.execute(f"CREATE TABLE {stream}_t (id bigint)")
    seen = []
    db.add_notice_handler(lambda d: seen.append(d.sqlstate))
    db.execute(f"SELECT streampos.next_id(%s, 'w') AS id INTO TEMP {stream}_into", (stream,))
    db.execute(f"WITH w AS (INSERT INTO {stream}_t SELECT streampos.next_id(%s, 'w') RETURNING id) "
               "SELECT id FROM w", (stream,))
    assert seen == []
    db.execute("SELECT streampos.next_id(%s, 'w')", (stream,))
    assert seen == ["25P01"]
