"""Consumers: register_consumer, ack, unregister_consumer, safe_to_delete,
the view consumers and updates(…, consumer => …), against real concurrent
sessions: acknowledged with the caller's transaction, never backwards,
never past the caller's snapshot, and only by the consumer's owner."""

import random
import threading
import time

import psycopg
import pytest

from support import connect_raw, create_stream, ensure_login_role, expect_error, one, rows, wait_until

WRITERS = ["w1", "w2"]


def parse_rows(answer):
    """(token, {table: [row, ...]}) of an updates() answer."""
    data = answer["data"]
    tables = {}
    i = 0
    while i < len(data):
        name, _position, row_count, _columns = data[i][:4]
        tables[name] = data[i + 1 : i + 1 + row_count]
        i += 1 + row_count
    return answer["token"], tables


def setup_stream(conn, stream):
    create_stream(conn, stream, writers=WRITERS)
    conn.execute(f"CREATE TABLE {stream}_ev (id bigint PRIMARY KEY, instance_name text, body text)")
    conn.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, f"{stream}_ev"))


def write(conn, stream, writer, n=1, commit=True):
    """n rows of `writer` in one transaction; their IDs."""
    conn.execute("BEGIN")
    ids = one(conn, "SELECT streampos.next_ids(%s, %s, %s)", (stream, writer, n))
    for i in ids:
        conn.execute(f"INSERT INTO {stream}_ev VALUES (%s, %s, 'x')", (i, writer))
    conn.execute("COMMIT" if commit else "ROLLBACK")
    return ids


def instance_id(conn, name):
    return one(conn, "SELECT instance_id FROM streampos.instances WHERE instance_name = %s", (name,))


def position(conn, stream, consumer):
    return one(
        conn,
        "SELECT position::text FROM streampos.consumers WHERE stream_name = %s AND consumer_name = %s",
        (stream, consumer),
    )


def register(conn, stream, consumer, since=None):
    return one(conn, "SELECT streampos.register_consumer(%s, %s, %s)::text", (stream, consumer, since))


def ack(conn, stream, consumer, token):
    return one(conn, "SELECT streampos.ack(%s, %s, %s)::text", (stream, consumer, token))


def consume(conn, stream, consumer, max_rows=100, timeout_ms=0):
    answer = one(
        conn,
        "SELECT streampos.updates(%s, consumer => %s, max_rows => %s, timeout_ms => %s)",
        (stream, consumer, max_rows, timeout_ms),
    )
    token, tables = parse_rows(answer)
    return token, [r[0] for t in tables.values() for r in t]


def test_register_consume_ack_resume(connect, stream):
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 2)  # 1, 2: before the consumer
    assert register(db, stream, "sender") == "2"
    assert register(db, stream, "sender") == "2", "registering again answers the position it has"
    write(db, stream, "w2", 2)  # 3, 4
    write(db, stream, "w1")  # 5
    token, ids = consume(db, stream, "sender")
    assert ids == [3, 4, 5] and token == "5"
    # Not acknowledged: the next call answers the same rows.
    assert consume(db, stream, "sender") == (token, ids)
    # An acknowledgement rolled back is none.
    db.execute("BEGIN")
    assert ack(db, stream, "sender", token) == "5"
    db.execute("ROLLBACK")
    assert position(db, stream, "sender") == "2"
    assert ack(db, stream, "sender", token) == "5"
    assert position(db, stream, "sender") == "5"
    assert consume(db, stream, "sender") == ("5", [])
    # Never backwards: an older token changes nothing.
    assert ack(db, stream, "sender", "3") == "5"
    assert position(db, stream, "sender") == "5"
    write(db, stream, "w2")  # 6
    assert consume(db, stream, "sender") == ("6", [6])
    [row] = rows(
        db,
        "SELECT lag_ids, acked_at IS NOT NULL, since_ack >= '0'::interval FROM streampos.consumers "
        "WHERE stream_name = %s",
        (stream,),
    )
    assert row == (1, True, True)
    assert one(db, "SELECT streampos.unregister_consumer(%s, 'sender')", (stream,)) is True
    assert one(db, "SELECT streampos.unregister_consumer(%s, 'sender')", (stream,)) is False
    expect_error(
        db, "SELECT streampos.updates(%s, consumer => 'sender')", (stream,), sqlstate="42704"
    )
    expect_error(db, "SELECT streampos.ack(%s, 'sender', '6')", (stream,), sqlstate="42704")


def test_register_since_and_the_argument_rules(connect, stream):
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 3)
    assert register(db, stream, "from_start", "0") == "0"
    assert consume(db, stream, "from_start")[1] == [1, 2, 3]
    err = expect_error(
        db, "SELECT streampos.register_consumer(%s, 'ahead', '9')", (stream,), sqlstate="22023"
    )
    assert err.diag.message_primary.startswith('token 9 is past the frontier of stream "')
    expect_error(db, "SELECT streampos.register_consumer(%s, '')", (stream,), sqlstate="22023")
    expect_error(db, "SELECT streampos.register_consumer(%s, %s)", (stream, "c" * 64), sqlstate="22023")
    expect_error(db, "SELECT streampos.register_consumer('no_such_stream', 'c')", sqlstate="42704")
    err = expect_error(
        db,
        "SELECT streampos.updates(%s, '0', consumer => 'from_start')",
        (stream,),
        sqlstate="22023",
    )
    assert err.diag.message_primary == "updates() takes since or consumer, not both"
    # Neither since nor consumer: an error saying what to pass (issue 32;
    # it answered NULL). Other NULLs in, NULL out, as before; since alone
    # still works positionally.
    err = expect_error(db, "SELECT streampos.updates(%s)", (stream,), sqlstate="22023")
    assert err.diag.message_primary == "updates() needs since or consumer"
    assert err.diag.message_detail.startswith("Pass since => '0' to follow the stream from its beginning")
    assert one(db, "SELECT streampos.register_consumer(NULL, 'c')") is None
    assert parse_rows(one(db, "SELECT streampos.updates(%s, '1')", (stream,)))[0] == "3"
    create_stream(db, f"{stream}_b", backwards=True)
    expect_error(
        db, "SELECT streampos.register_consumer(%s, 'c')", (f"{stream}_b",), sqlstate="55000"
    )


def test_ack_never_passes_what_the_callers_snapshot_saw(connect, stream):
    """A token from a later snapshot is refused under REPEATABLE READ: the
    transaction cannot have processed rows it does not see."""
    db, consumer = connect(), connect()
    setup_stream(db, stream)
    write(db, stream, "w1")
    register(db, stream, "c")
    consumer.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    assert consume(consumer, stream, "c") == ("1", [])
    write(db, stream, "w2", 2)
    later = one(db, "SELECT streampos.current_token(%s)::text", (stream,))
    assert later == "3"
    err = expect_error(consumer, "SELECT streampos.ack(%s, 'c', %s)", (stream, later), sqlstate="22023")
    assert "seen the stream up to 1" in err.diag.message_detail
    consumer.execute("ROLLBACK")
    assert ack(consumer, stream, "c", later) == "3"
    # A writer's position past the frontier, with the minimum below it.
    w2 = instance_id(db, "w2")
    expect_error(
        db, "SELECT streampos.ack(%s, 'c', %s)", (stream, f"m3~{w2}.4"), sqlstate="22023"
    )


def test_concurrent_acks_join(connect, pool, stream):
    """Two transactions acknowledge incomparable tokens of one consumer: the
    second waits for the first's row lock and joins its token to the
    committed one (writer by writer), never overwrites it."""
    db, a, b = connect(), connect(), connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 3)
    write(db, stream, "w2", 3)
    register(db, stream, "c", "0")
    w1, w2 = instance_id(db, "w1"), instance_id(db, "w2")
    a.execute("BEGIN")
    assert ack(a, stream, "c", f"m1~{w1}.3") == f"m1~{w1}.3"
    pending = pool.submit(ack, b, stream, "c", f"m2~{w2}.6")
    time.sleep(0.3)
    assert not pending.done(), "the second acknowledgement waits for the first"
    a.execute("COMMIT")
    assert pending.result(timeout=10) == f"m2~{w1}.3~{w2}.6"
    assert position(db, stream, "c") == f"m2~{w1}.3~{w2}.6"


def test_ack_writes_its_row_as_an_update_would(connect, pool, stream):
    """ack() writes the consumer's row without SQL (src/sql/consumer_row.rs)
    and must behave as the UPDATE it replaced: refused in a read-only
    transaction with PostgreSQL's own error; a second ack of the same
    transaction sees the first; a savepoint rolled back takes its ack with
    it; under REPEATABLE READ an ack of a row another transaction changed
    since the snapshot is a serialization failure (40001), under READ
    COMMITTED it joins the newest version; acked_at is the transaction's
    start."""
    db, a, b = connect(), connect(), connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 3)
    write(db, stream, "w2", 3)
    register(db, stream, "c", "0")
    w1, w2 = instance_id(db, "w1"), instance_id(db, "w2")
    with a.transaction():
        a.execute("SET TRANSACTION READ ONLY")
        err = expect_error(a, "SELECT streampos.ack(%s, 'c', '1')", (stream,), "25006")
        assert err.diag.message_primary == "cannot execute UPDATE in a read-only transaction"
    assert position(db, stream, "c") == "0"
    with a.transaction():
        assert ack(a, stream, "c", f"m1~{w1}.3") == f"m1~{w1}.3"
        assert ack(a, stream, "c", f"m2~{w2}.6") == f"m2~{w1}.3~{w2}.6"
        a.execute("SAVEPOINT s")
        assert ack(a, stream, "c", "6") == "6"
        a.execute("ROLLBACK TO SAVEPOINT s")
        started = one(a, "SELECT now()")
    assert position(db, stream, "c") == f"m2~{w1}.3~{w2}.6"
    assert one(db, "SELECT acked_at FROM streampos.consumer_positions WHERE stream_name = %s", (stream,)) == started
    # REPEATABLE READ: b's snapshot is taken, then a commits an ack.
    b.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    one(b, "SELECT streampos.frontier(%s)", (stream,))
    ack(a, stream, "c", f"m3~{w2}.6")
    expect_error(b, "SELECT streampos.ack(%s, 'c', '6')", (stream,), "40001")
    b.execute("ROLLBACK")
    assert position(db, stream, "c") == f"m3~{w2}.6"
    # READ COMMITTED, a's ack uncommitted: b waits, then joins a's.
    a.execute("BEGIN")
    ack(a, stream, "c", f"m3~{w1}.4~{w2}.6")
    pending = pool.submit(ack, b, stream, "c", "5")
    time.sleep(0.3)
    assert not pending.done()
    a.execute("COMMIT")
    assert pending.result(timeout=10) == f"m5~{w2}.6"


def test_many_acks_keep_the_consumers_index_whole(connect, stream):
    """Many acks of many consumers: row versions fill pages, so some
    updates cannot stay on their page (not HOT) and put new index entries;
    every consumer is then found through the primary key and a sequential
    scan alike, at its last position, and amcheck (when installed) finds
    the index whole."""
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 40)
    consumers = [f"c{i:02d}" for i in range(30)]
    for c in consumers:
        register(db, stream, c, "0")
    # An old snapshot keeps every dead version: pages fill up.
    holder = connect()
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    one(holder, "SELECT 1")
    rng = random.Random(7)
    last = {}
    for _ in range(1500):
        c = rng.choice(consumers)
        last[c] = max(last.get(c, 0), rng.randint(1, 40))
        ack(db, stream, c, str(last[c]))
    query = ("SELECT consumer_name, position::text FROM streampos.consumer_positions "
             "WHERE stream_name = %s AND consumer_name = %s")
    for scan in ("enable_seqscan = off", "enable_indexscan = off, enable_bitmapscan = off"):
        with db.transaction():
            for setting in scan.split(", "):
                db.execute(f"SET LOCAL {setting}")
            for c in consumers:
                assert rows(db, query, (stream, c)) == [(c, str(last.get(c, 0)))], (scan, c)
    if one(db, "SELECT count(*) FROM pg_available_extensions WHERE name = 'amcheck'"):
        db.execute("CREATE EXTENSION IF NOT EXISTS amcheck")
        db.execute("SELECT bt_index_check('streampos.consumer_positions_pkey'::regclass, true)")


@pytest.mark.parametrize("change, undo", [
    ("CREATE INDEX ack_trap_expr ON streampos.consumer_positions ((lower(consumer_name)), (acked_at IS NULL))",
     "DROP INDEX streampos.ack_trap_expr"),
    ("CREATE INDEX ack_trap_partial ON streampos.consumer_positions (stream_name) WHERE acked_at IS NULL",
     "DROP INDEX streampos.ack_trap_partial"),
    ("ALTER TABLE streampos.consumer_positions ADD CONSTRAINT ack_trap_check "
     "CHECK (acked_at < '2000-01-01') NOT VALID",
     "ALTER TABLE streampos.consumer_positions DROP CONSTRAINT ack_trap_check"),
    ("CREATE TABLE public.ack_trap_log (n int); "
     "CREATE FUNCTION public.ack_trap_audit() RETURNS trigger LANGUAGE plpgsql AS "
     "$$ BEGIN INSERT INTO public.ack_trap_log VALUES (1); RETURN NULL; END $$; "
     "CREATE TRIGGER ack_trap_audit AFTER UPDATE ON streampos.consumer_positions "
     "FOR EACH ROW EXECUTE FUNCTION public.ack_trap_audit()",
     "DROP TRIGGER ack_trap_audit ON streampos.consumer_positions; DROP FUNCTION public.ack_trap_audit(); "
     "DROP TABLE public.ack_trap_log"),
], ids=["expression index", "partial index", "check constraint", "trigger"])
def test_ack_on_a_consumers_table_a_superuser_changed_runs_the_update(connect, stream, change, undo):
    """ack() writes its row itself only while streampos.consumer_positions
    is as the extension made it. A superuser's expression index (which the
    write without SQL could not keep: a crash), partial index, CHECK
    constraint or trigger sends ack() to the UPDATE, which keeps, checks
    and fires them (an adversary's review of the write found each)."""
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 5)
    register(db, stream, "c", "0")
    db.execute(change)
    try:
        # Enough acks under an old snapshot that some cannot stay on their
        # page (new index entries).
        holder = connect()
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        one(holder, "SELECT 1")
        if "CHECK" in change:
            expect_error(db, "SELECT streampos.ack(%s, 'c', '1')", (stream,), "23514")
            return
        for i in range(1, 6):
            for _ in range(40):
                assert ack(db, stream, "c", str(i)) == str(i)
        holder.execute("ROLLBACK")
        if "partial" in change:
            with db.transaction():
                db.execute("SET LOCAL enable_seqscan = off")
                assert rows(db, "SELECT consumer_name FROM streampos.consumer_positions "
                                "WHERE stream_name = %s AND acked_at IS NULL", (stream,)) == []
        if "audit" in change:
            assert one(db, "SELECT count(*) FROM public.ack_trap_log") == 200
        if one(db, "SELECT count(*) FROM pg_available_extensions WHERE name = 'amcheck'"):
            db.execute("CREATE EXTENSION IF NOT EXISTS amcheck")
            for (index,) in rows(db, "SELECT indexrelid::regclass::text FROM pg_index "
                                     "WHERE indrelid = 'streampos.consumer_positions'::regclass"):
                db.execute("SELECT bt_index_check(%s::regclass, true)", (index,))
        assert position(db, stream, "c") == "5"
    finally:
        db.execute(undo)


def test_safe_to_delete_is_what_every_consumer_acknowledged(connect, stream):
    db = connect()
    setup_stream(db, stream)
    assert one(db, "SELECT streampos.safe_to_delete(%s)::text", (stream,)) is None
    write(db, stream, "w1", 3)
    write(db, stream, "w2", 3)
    w1, w2 = instance_id(db, "w1"), instance_id(db, "w2")
    register(db, stream, "a", "0")
    register(db, stream, "b", "0")
    ack(db, stream, "a", f"m1~{w1}.3")
    ack(db, stream, "b", f"m2~{w2}.5")
    assert one(db, "SELECT streampos.safe_to_delete(%s)::text", (stream,)) == f"m1~{w1}.2"
    ack(db, stream, "a", "6")
    assert one(db, "SELECT streampos.safe_to_delete(%s)::text", (stream,)) == f"m2~{w2}.5"
    db.execute("SELECT streampos.unregister_consumer(%s, 'b')", (stream,))
    assert one(db, "SELECT streampos.safe_to_delete(%s)::text", (stream,)) == "6"
    # Consumers go with their stream.
    db.execute("SELECT streampos.drop_stream(%s)", (stream,))
    assert one(db, "SELECT count(*) FROM streampos.consumer_positions WHERE stream_name = %s", (stream,)) == 0


def test_safe_to_delete_answers_once_per_statement_and_follows_every_change(connect, stream):
    """safe_to_delete() keeps its last answer for a statement's snapshot
    and command (a retention job's DELETE asks once per row): within a
    transaction an ack of its own moves the command and the answer; a
    REPEATABLE READ transaction keeps its answer while another session
    acknowledges; the next transaction sees the change; another stream is
    asked for itself."""
    db, other = connect(), connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 4)
    register(db, stream, "a", "0")
    safe = "SELECT streampos.safe_to_delete(%s)::text"
    db.execute("BEGIN")
    assert one(db, safe, (stream,)) == "0"
    # One statement, many rows: every row the same answer.
    assert rows(db, "SELECT DISTINCT streampos.safe_to_delete(%s)::text FROM generate_series(1, 1000)",
                (stream,)) == [("0",)]
    ack(db, stream, "a", "2")
    assert one(db, safe, (stream,)) == "2"
    # An ack rolled back to a savepoint: the snapshot and the command are
    # as they were, the answer is not.
    db.execute("SAVEPOINT s")
    ack(db, stream, "a", "3")
    assert one(db, safe, (stream,)) == "3"
    db.execute("ROLLBACK TO SAVEPOINT s")
    assert one(db, safe, (stream,)) == "2"
    db.execute("COMMIT")
    db.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    assert one(db, safe, (stream,)) == "2"
    ack(other, stream, "a", "3")
    assert one(db, safe, (stream,)) == "2"
    db.execute("COMMIT")
    assert one(db, safe, (stream,)) == "3"
    db.execute("SELECT streampos.unregister_consumer(%s, 'a')", (stream,))
    assert one(db, safe, (stream,)) is None
    expect_error(db, safe, (stream + "_none",), sqlstate="42704")


def test_the_readmes_retention_job_deletes_what_every_consumer_acknowledged(connect, stream):
    """README, "Consumers": the retention job (safe_to_delete and each
    writer's position in it computed once, the ID bounded by
    max_stream_pos so that an index finds the rows) deletes exactly the
    rows at or below every consumer's position, writer by writer, as the
    per-row form does; nothing without consumers."""
    db = connect()
    setup_stream(db, stream)
    job = f"""WITH s AS MATERIALIZED (SELECT streampos.safe_to_delete(%s) AS safe),
                    w AS MATERIALIZED (SELECT i.instance_name,
                                              streampos.instance_pos(s.safe, i.instance_id) AS upto
                                       FROM streampos.instances i, s)
               DELETE FROM {stream}_ev d USING w
               WHERE d.instance_name = w.instance_name AND d.id <= w.upto
                 AND d.id <= (SELECT streampos.max_stream_pos(s.safe) FROM s)
               RETURNING d.id"""
    per_row = f"""DELETE FROM {stream}_ev d USING streampos.instances i
                  WHERE i.instance_name = d.instance_name
                    AND NOT streampos.persisted_after(streampos.safe_to_delete(%s), i.instance_id, d.id)
                  RETURNING d.id"""
    ids1 = write(db, stream, "w1", 3)
    ids2 = write(db, stream, "w2", 3)
    assert [r[0] for r in rows(db, job, (stream,))] == []
    w1, w2 = instance_id(db, "w1"), instance_id(db, "w2")
    register(db, stream, "a", "0")
    register(db, stream, "b", "0")
    ack(db, stream, "a", f"m{ids1[0]}~{w1}.{ids1[2]}")
    ack(db, stream, "b", f"m{ids1[2]}~{w2}.{ids2[1]}")
    safe = one(db, "SELECT streampos.safe_to_delete(%s)::text", (stream,))
    expected = sorted(one(db, f"SELECT array_agg(d.id ORDER BY d.id) FROM {stream}_ev d JOIN streampos.instances i "
                              "ON i.instance_name = d.instance_name "
                              "WHERE NOT streampos.persisted_after(%s::streampos.multi_writer_token, i.instance_id, d.id)",
                          (safe,)) or [])
    assert expected and len(expected) < 6, (safe, expected)
    db.execute("BEGIN")
    assert sorted(r[0] for r in rows(db, per_row, (stream,))) == expected
    db.execute("ROLLBACK")
    # The bound is an index condition (the table is too small for the
    # planner to choose the index by itself).
    db.execute("SET enable_seqscan = off")
    plan = "\n".join(r[0] for r in rows(db, "EXPLAIN " + job.replace("RETURNING d.id", ""), (stream,)))
    db.execute("RESET enable_seqscan")
    assert f"Index Cond: (id <=" in plan, plan
    assert sorted(r[0] for r in rows(db, job, (stream,))) == expected
    assert one(db, f"SELECT count(*) FROM {stream}_ev") == 6 - len(expected)


@pytest.fixture
def roles(database):
    names = [ensure_login_role(r) for r in ("streampos_con_a", "streampos_con_b", "streampos_con_m")]
    with connect_raw() as admin:
        for r in names:
            admin.execute(f"GRANT EXECUTE ON FUNCTION streampos.register_consumer(text, text, streampos.multi_writer_token), "
                          f"streampos.ack(text, text, streampos.multi_writer_token), "
                          f"streampos.unregister_consumer(text, text) TO {r}")
        admin.execute(f"GRANT {names[0]} TO {names[2]}")
    return names


def test_only_the_owner_moves_or_forgets_a_consumer(connect, stream, roles):
    role_a, role_b, member_of_a = roles
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 2)
    nobody = connect(user=ensure_login_role("streampos_con_none"))
    for sql in (
        "SELECT streampos.register_consumer(%s, 'x')",
        "SELECT streampos.ack(%s, 'x', '1')",
        "SELECT streampos.unregister_consumer(%s, 'x')",
    ):
        expect_error(nobody, sql, (stream,), sqlstate="42501")
    a, b, m = connect(user=role_a), connect(user=role_b), connect(user=member_of_a)
    # A consumer reads the stream's rows: registering needs what updates()
    # needs (and a role that cannot read a stream cannot hold its
    # retention back).
    err = expect_error(a, "SELECT streampos.register_consumer(%s, 'mine', '0')", (stream,), sqlstate="42501")
    assert err.diag.message_primary == f"permission denied for table public.{stream}_ev"
    db.execute(f"GRANT SELECT ON {stream}_ev TO PUBLIC")
    assert register(a, stream, "mine", "0") == "0"
    assert one(db, "SELECT owner::text FROM streampos.consumers WHERE stream_name = %s", (stream,)) == role_a
    err = expect_error(b, "SELECT streampos.ack(%s, 'mine', '2')", (stream,), sqlstate="42501")
    assert err.diag.message_primary == f'must be owner of consumer "mine" of stream "{stream}"'
    # Another role's ack writes nothing, not even a version rolled back
    # (the row's xmin stays).
    version = one(db, "SELECT xmin::text FROM streampos.consumer_positions WHERE stream_name = %s", (stream,))
    with b.transaction():
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            with b.transaction():
                b.execute("SELECT streampos.ack(%s, 'mine', '2')", (stream,))
    assert one(db, "SELECT xmin::text FROM streampos.consumer_positions WHERE stream_name = %s", (stream,)) == version
    err = expect_error(b, "SELECT streampos.ack(%s, 'nobody', '2')", (stream,), sqlstate="42704")
    expect_error(b, "SELECT streampos.unregister_consumer(%s, 'mine')", (stream,), sqlstate="42501")
    err = expect_error(b, "SELECT streampos.register_consumer(%s, 'mine')", (stream,), sqlstate="42710")
    assert role_a in err.diag.message_detail
    assert position(db, stream, "mine") == "0"
    # Everyone reads positions, follows with them and sees what is safe.
    assert one(b, "SELECT streampos.safe_to_delete(%s)::text", (stream,)) == "0"
    assert consume(b, stream, "mine")[1] == [1, 2]
    assert one(nobody, "SELECT count(*) FROM streampos.consumers WHERE stream_name = %s", (stream,)) == 1
    expect_error(nobody, "UPDATE streampos.consumer_positions SET position = '2'", sqlstate="42501")
    # A member of the owner may act for it.
    assert ack(m, stream, "mine", "2") == "2"
    assert one(m, "SELECT streampos.unregister_consumer(%s, 'mine')", (stream,)) is True


def test_a_callers_search_path_and_shadowing_objects_change_nothing(connect, stream, roles):
    role_a = roles[0]
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 2)
    db.execute(f"GRANT SELECT ON {stream}_ev TO PUBLIC")
    a = connect(user=role_a)
    a.execute(
        "CREATE TEMP TABLE consumer_positions (stream_name text, consumer_name text, owner regrole, "
        "position text, registered_at timestamptz, acked_at timestamptz)"
    )
    a.execute("CREATE FUNCTION pg_temp.advance(text, text) RETURNS text LANGUAGE sql AS $$ SELECT '999' $$")
    a.execute("SET search_path = pg_temp, public, streampos")
    assert register(a, stream, "c", "0") == "0"
    assert ack(a, stream, "c", "1") == "1"
    assert one(a, "SELECT streampos.safe_to_delete(%s)::text", (stream,)) == "1"
    assert one(a, "SELECT count(*) FROM pg_temp.consumer_positions") == 0


def test_a_consumer_registered_again_by_another_role_is_not_the_callers(connect, pool, stream, roles):
    """The owner is checked on the row the write changes: between the
    caller's check (its statement's snapshot) and its write, the consumer
    may have been unregistered and registered again by another role."""
    role_a, role_b, _ = roles
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 2)
    db.execute(f"GRANT SELECT ON {stream}_ev TO PUBLIC")
    a, a2, b = connect(user=role_a), connect(user=role_a), connect(user=role_b)
    for call, args in (("ack", ", '2'"), ("unregister_consumer", "")):
        register(a, stream, "race", "0")
        # The statement's snapshot is taken before the sleep.
        pending = pool.submit(
            a.execute,
            f"WITH s AS MATERIALIZED (SELECT pg_sleep(1)) SELECT streampos.{call}(%s, 'race'{args}) FROM s",
            (stream,),
        )
        time.sleep(0.3)
        assert one(a2, "SELECT streampos.unregister_consumer(%s, 'race')", (stream,)) is True
        register(b, stream, "race", "0")
        with pytest.raises(psycopg.Error) as info:
            pending.result(timeout=10)
        assert info.value.diag.sqlstate == "42501", info.value
        assert rows(db, "SELECT owner::text, position::text FROM streampos.consumers "
                        "WHERE stream_name = %s", (stream,)) == [(role_b, "0")]
        db.execute("SELECT streampos.unregister_consumer(%s, 'race')", (stream,))


def test_positions_below_zero_or_below_what_others_acknowledged(connect, stream):
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 4)
    for token in ("-1", "-9223372036854775808", "m-5~1.2"):
        expect_error(db, "SELECT streampos.register_consumer(%s, 'c', %s)", (stream, token), sqlstate="22023")
    register(db, stream, "first", "0")
    expect_error(db, "SELECT streampos.ack(%s, 'first', '-1')", (stream,), sqlstate="22023")
    ack(db, stream, "first", "3")
    # Rows up to 3 may be deleted by now: a new consumer starts there or later.
    err = expect_error(db, "SELECT streampos.register_consumer(%s, 'late', '1')", (stream,), sqlstate="22023")
    assert "safe_to_delete() = 3" in err.diag.message_detail
    assert register(db, stream, "late", "3") == "3"
    assert register(db, stream, "later") == "4"
    assert [r[0] for r in rows(db, "SELECT lag_ids FROM streampos.consumers WHERE stream_name = %s "
                                   "ORDER BY consumer_name", (stream,))] == [1, 1, 0]


def test_a_registration_in_progress_holds_every_position_of_the_stream(connect, pool, stream):
    """While a registration's transaction runs, no other consumer of the
    stream acknowledges, goes or registers: a retention job that cannot see
    the new consumer yet would otherwise delete rows below the others' new
    positions that the new consumer needs."""
    db, old, new, other = connect(), connect(), connect(), connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 3)
    register(db, stream, "old", "3")
    new.execute("BEGIN")
    assert register(new, stream, "new") == "3"
    write(db, stream, "w1")  # 4
    old.execute("BEGIN")
    assert consume(old, stream, "old") == ("4", [4])
    acked = pool.submit(ack, old, stream, "old", "4")
    gone = pool.submit(other.execute, "SELECT streampos.register_consumer(%s, 'third')", (stream,))
    time.sleep(0.5)
    assert not acked.done() and not gone.done()
    # What a retention job sees meanwhile: nothing above 3 may go.
    assert one(db, "SELECT streampos.safe_to_delete(%s)::text", (stream,)) == "3"
    new.execute("COMMIT")
    assert acked.result(timeout=10) == "4"
    old.execute("COMMIT")
    assert gone.result(timeout=10)
    assert one(db, "SELECT streampos.safe_to_delete(%s)::text", (stream,)) == "3"
    assert consume(db, stream, "new") == ("4", [4])
    # A registration left open makes acknowledgements wait at most the bound.
    new.execute("BEGIN")
    register(new, stream, "fourth")
    old.execute("SET lock_timeout = '500ms'")
    expect_error(old, "SELECT streampos.ack(%s, 'old', '4')", (stream,), sqlstate="55P03")
    new.execute("ROLLBACK")
    assert ack(old, stream, "old", "4") == "4"


def test_a_repeatable_read_registration_starts_no_lower_than_the_others_as_last_committed(connect, stream):
    """A REPEATABLE READ transaction's snapshot may predate another
    consumer's registration and acknowledgement, and a retention job's
    deletion below them: the registration reads the others as last
    committed, not as its snapshot shows them."""
    db, late, other = connect(), connect(), connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 2)
    late.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    assert one(late, "SELECT streampos.current_token(%s)::text", (stream,)) == "2"
    register(other, stream, "first")
    write(db, stream, "w1", 3)  # 3..5
    ack(other, stream, "first", "5")
    db.execute(f"DELETE FROM {stream}_ev WHERE id <= 5")  # what retention may do now
    expect_error(late, "SELECT streampos.register_consumer(%s, 'late', '3')", (stream,), sqlstate="22023")
    late.execute("ROLLBACK")
    late.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    late.execute("SELECT 1")
    write(db, stream, "w1")  # 6
    ack(other, stream, "first", "6")
    assert register(late, stream, "late") == "6", "the default starts at what the others acknowledged"
    late.execute("COMMIT")
    # A transaction that has written (an xid) still reads the others as
    # last committed (an ordinary SPI query would read with the
    # transaction's snapshot).
    db.execute(f"CREATE TABLE {stream}_scratch (k int)")
    late.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    late.execute(f"INSERT INTO {stream}_scratch VALUES (1)")
    write(db, stream, "w1")  # 7
    ack(other, stream, "first", "7")
    ack(db, stream, "late", "7")
    assert register(late, stream, "later") == "7"
    late.execute("COMMIT")
    # A consumer unregistered after the snapshot is not reported as there.
    late.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    late.execute("SELECT 1")
    other.execute("SELECT streampos.unregister_consumer(%s, 'first')", (stream,))
    assert register(late, stream, "first") == "7"
    late.execute("COMMIT")
    assert one(db, "SELECT count(*) FROM streampos.consumers WHERE stream_name = %s AND consumer_name = 'first'",
               (stream,)) == 1


def test_registrations_never_start_below_what_consumers_that_went_had(connect, stream):
    """A retention job whose snapshot still shows a consumer that has since
    gone may delete up to its position: a consumer registered after it
    starts no lower, even with no consumer left."""
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 8)
    register(db, stream, "a", "0")
    register(db, stream, "b", "0")
    ack(db, stream, "a", "8")
    ack(db, stream, "b", "6")
    db.execute("SELECT streampos.unregister_consumer(%s, 'b')", (stream,))
    # A retention job may have seen a alone (8), or a and b (6).
    assert one(db, "SELECT position::text FROM streampos.consumer_floors WHERE stream_name = %s", (stream,)) == "8"
    db.execute("SELECT streampos.unregister_consumer(%s, 'a')", (stream,))
    assert one(db, "SELECT streampos.safe_to_delete(%s)", (stream,)) is None
    err = expect_error(db, "SELECT streampos.register_consumer(%s, 'c', '7')", (stream,), sqlstate="22023")
    assert "safe_to_delete() = 8" in err.diag.message_detail
    assert register(db, stream, "c", "8") == "8"


def test_drop_stream_waits_a_bounded_time_for_a_consumers_transaction(connect, stream):
    """An acknowledgement left open holds its row: drop_stream waits for it
    no longer than lock_timeout (5 s at most), and before it holds the
    stream's sequence, so writers go on meanwhile."""
    db, consumer, dropper, writer = connect(), connect(), connect(), connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 2)
    register(db, stream, "c", "0")
    consumer.execute("BEGIN")
    ack(consumer, stream, "c", "1")
    dropper.execute("SET lock_timeout = '1s'")
    started = time.monotonic()
    expect_error(dropper, "SELECT streampos.drop_stream(%s)", (stream,), sqlstate="55P03")
    assert time.monotonic() - started < 4
    assert write(writer, stream, "w2") == [3]
    consumer.execute("COMMIT")
    db.execute("SELECT streampos.drop_stream(%s)", (stream,))


def test_a_dropped_owners_consumer_is_left_to_a_superuser(connect, stream):
    db = connect()
    setup_stream(db, stream)
    db.execute(f"GRANT SELECT ON {stream}_ev TO PUBLIC")
    role = ensure_login_role("streampos_con_gone")
    db.execute(f"GRANT EXECUTE ON FUNCTION streampos.register_consumer(text, text, streampos.multi_writer_token) TO {role}")
    gone = connect(user=role)
    register(gone, stream, "orphan", "0")
    gone.close()
    db.execute(f"REVOKE EXECUTE ON FUNCTION streampos.register_consumer(text, text, streampos.multi_writer_token) FROM {role}")
    db.execute(f"REVOKE SELECT ON {stream}_ev FROM PUBLIC")
    db.execute(f"DROP ROLE {role}")
    # PostgreSQL records no dependency on a row: the consumer stays, and
    # holds retention back until a superuser forgets it.
    assert one(db, "SELECT streampos.safe_to_delete(%s)::text", (stream,)) == "0"
    other = connect(user=ensure_login_role("streampos_con_a"))
    err = expect_error(other, "SELECT streampos.ack(%s, 'orphan', '0')", (stream,), sqlstate="42501")
    assert err.diag.message_detail.startswith("It belongs to a dropped role (OID ")
    assert one(db, "SELECT streampos.unregister_consumer(%s, 'orphan')", (stream,)) is True


def lags(conn, stream):
    """{consumer: (lag_ids, lag_time in seconds)} of the view consumers."""
    return {
        name: (ids, seconds)
        for name, ids, seconds in rows(
            conn,
            "SELECT consumer_name, lag_ids, extract(epoch FROM lag_time)::float8 "
            "FROM streampos.consumers WHERE stream_name = %s",
            (stream,),
        )
    }


def marks(conn, stream):
    return rows(
        conn,
        "SELECT position::text FROM streampos.frontier_marks WHERE stream_name = %s ORDER BY marked_at",
        (stream,),
    )


def wait_for_mark(conn, stream, token, timeout=10):
    wait_until(lambda: (token,) in marks(conn, stream), timeout=timeout, message=f"a mark of {token}")


def test_lag_in_time_counts_from_when_unacknowledged_rows_became_readable(connect, stream):
    """lag_time is how long rows the consumer has not acknowledged have
    been readable: never more than since they were committed, less by at
    most the marks' resolution (a second, plus a pass of the worker); 0
    once the consumer acknowledged everything its reader can see."""
    db = connect()
    setup_stream(db, stream)
    register(db, stream, "slow", "0")
    register(db, stream, "quick", "0")
    assert lags(db, stream) == {"slow": (0, 0.0), "quick": (0, 0.0)}
    before = one(db, "SELECT extract(epoch FROM clock_timestamp())::float8")
    write(db, stream, "w1", 2)
    wait_for_mark(db, stream, "2")
    time.sleep(1.5)
    db.execute("BEGIN")
    now = one(db, "SELECT extract(epoch FROM now())::float8")
    lag = lags(db, stream)
    db.execute("COMMIT")
    assert lag["slow"][0] == 2
    assert now - before - 1.5 <= lag["slow"][1] <= now - before
    assert ack(db, stream, "quick", "2") == "2"
    assert lags(db, stream)["quick"] == (0, 0.0)
    # A writer holds ID 3 open while the other commits 4 and 5: a consumer
    # that acknowledged the whole current token (m2~w2.5) is not behind,
    # though its lowest position is 2 and the newest ID 5.
    holder = connect()
    holder.execute("BEGIN")
    held = one(holder, "SELECT streampos.next_id(%s, 'w1')", (stream,))
    assert held == 3
    write(db, stream, "w2", 2)
    w2 = instance_id(db, "w2")
    current = one(db, "SELECT streampos.current_token(%s)::text", (stream,))
    assert current == f"m2~{w2}.5"
    assert ack(db, stream, "quick", current) == current
    lag = lags(db, stream)
    assert lag["quick"] == (0, 0.0)
    assert lag["slow"][0] == 5 and lag["slow"][1] > 1.0
    holder.execute("ROLLBACK")
    # Marks every consumer has acknowledged are let go at the next mark;
    # with no consumer left, every mark.
    write(db, stream, "w1")
    ack(db, stream, "slow", one(db, "SELECT streampos.current_token(%s)::text", (stream,)))
    ack(db, stream, "quick", "6")
    write(db, stream, "w1")
    seen = []

    def only_marks_not_acknowledged():
        # Every mark both consumers acknowledged ("6") let go, the newest
        # ("7") kept. A pass may also have seen a token between the two
        # (w1 at 7 while the minimum was still 6: "m6~<w1>.7"), which no
        # consumer acknowledged: it stays, as it should.
        seen[:] = marks(db, stream)
        acknowledged = [m for (m,) in seen
                        if one(db, "SELECT streampos.is_before_or_eq(%s::streampos.multi_writer_token, '6')", (m,))]
        return bool(seen) and seen[-1] == ("7",) and not acknowledged

    try:
        wait_until(only_marks_not_acknowledged, timeout=10, message="only the marks not acknowledged left")
    except AssertionError as e:
        raise AssertionError(f"{e}; marks: {seen}") from None
    db.execute("SELECT streampos.unregister_consumer(%s, 'slow')", (stream,))
    db.execute("SELECT streampos.unregister_consumer(%s, 'quick')", (stream,))
    write(db, stream, "w1")
    wait_until(lambda: marks(db, stream) == [], timeout=10, message="no marks without consumers")
    time.sleep(1.5)
    assert marks(db, stream) == []


def test_a_consumer_registered_behind_an_idle_stream_shows_its_lag(connect, stream):
    """The worker marks a token when it moves; a consumer registered below
    the current token of a stream that no longer moves is behind from its
    registration on (the registration marks the token)."""
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 3)
    time.sleep(1.2)  # the worker's pass saw the token, with no consumer
    assert marks(db, stream) == []
    register(db, stream, "late", "0")
    assert marks(db, stream) == [("3",)]
    time.sleep(1.5)
    ids, seconds = lags(db, stream)["late"]
    assert ids == 3 and 1.4 <= seconds < 5
    # A registration at the current token marks nothing.
    register(db, stream, "current")
    assert lags(db, stream)["current"] == (0, 0.0)
    assert marks(db, stream) == [("3",)]


def test_registering_in_a_loop_adds_no_marks(connect, stream):
    """Issue 31, finding 6. Each registration below an idle stream's token
    marked that token again: a role granted the consumer functions that
    registered and unregistered in a loop made 17 432 marks in 40 s, and
    the worker's marking statement (and every ack behind it) slowed with
    them. A registration now marks only a token no mark covers yet."""
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 3)
    time.sleep(1.2)
    started = time.monotonic()
    n = 0
    while time.monotonic() - started < 3:
        register(db, stream, f"c{n % 3}", "0")
        db.execute("SELECT streampos.unregister_consumer(%s, %s)", (stream, f"c{n % 3}"))
        n += 1
    assert n > 50
    assert len(marks(db, stream)) <= 4, f"{len(marks(db, stream))} marks after {n} registrations"


def test_a_registration_behind_what_its_snapshot_saw_shows_its_lag(connect, stream):
    """A REPEATABLE READ registration starts at its snapshot's token, below
    what writers committed since (the worker, seeing no consumer yet, marks
    nothing): the registration marks the token as last committed."""
    db, registrar = connect(), connect()
    setup_stream(db, stream)
    write(db, stream, "w1")
    registrar.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    assert one(registrar, "SELECT streampos.current_token(%s)::text", (stream,)) == "1"
    write(db, stream, "w1", 2)
    time.sleep(1.2)  # the worker's pass saw token 3, with no consumer
    assert register(registrar, stream, "c") == "1"
    registrar.execute("COMMIT")
    assert marks(db, stream) == [("3",)]
    time.sleep(1.2)
    ids, seconds = lags(db, stream)["c"]
    assert ids == 2 and seconds >= 1.1


def test_a_token_passed_while_a_registration_was_uncommitted_is_marked(connect, stream):
    """A READ COMMITTED registration at the current token, and a commit of
    the stream before the registration commits: the worker's pass sees the
    stream move with no consumer, and marks that token again within ten
    seconds once the consumer is there (the stream idle since)."""
    db, registrar = connect(), connect()
    setup_stream(db, stream)
    # Another stream keeps the database busy: the worker stays.
    busy = f"{stream}_busy"
    create_stream(db, busy)
    stop = threading.Event()

    def keep_busy():
        with connect_raw() as w:
            while not stop.is_set():
                w.execute("SELECT streampos.next_id(%s, 'w')", (busy,))
                time.sleep(0.2)

    keeper = threading.Thread(target=keep_busy)
    keeper.start()
    try:
        write(db, stream, "w1")
        registrar.execute("BEGIN")
        assert register(registrar, stream, "c") == "1"
        write(db, stream, "w1")
        time.sleep(1.5)  # the worker's pass saw token 2, with no consumer
        registrar.execute("COMMIT")
        assert marks(db, stream) == []
        wait_for_mark(db, stream, "2", timeout=20)
        assert lags(db, stream)["c"][0] == 1
    finally:
        stop.set()
        keeper.join()


def test_lag_is_counted_at_the_statement_and_never_below_zero(connect, stream):
    """In a READ COMMITTED transaction a later statement sees marks and
    acknowledgements newer than the transaction's start."""
    db, reader = connect(), connect()
    setup_stream(db, stream)
    register(db, stream, "c", "0")
    reader.execute("BEGIN")
    one(reader, "SELECT 1")
    time.sleep(1.2)
    write(db, stream, "w1")
    wait_for_mark(db, stream, "1")
    ack(db, stream, "c", "0")
    lag_time, since_ack = rows(
        reader,
        "SELECT extract(epoch FROM lag_time)::float8, extract(epoch FROM since_ack)::float8 "
        "FROM streampos.consumers WHERE stream_name = %s",
        (stream,),
    )[0]
    reader.execute("COMMIT")
    assert 0 <= lag_time < 2
    assert 0 <= since_ack < 2


def test_old_marks_are_thinned_and_the_lag_stays_a_lower_bound(connect, stream):
    """Past an hour's age a minute keeps its latest mark, past a day's an
    hour: three days of marks every 20 s (12 960) become some 1 600, a week
    some 1 700, and the lag told from them is still never above the
    truth."""
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 3)
    register(db, stream, "idle", "0")
    # Marks the worker would have made over three days, one every 20 s
    # (12 960), while IDs 1, 2 and 3 were committed.
    db.execute(
        "INSERT INTO streampos.frontier_marks "
        "SELECT %s, now() - g * interval '20 seconds', "
        "       (CASE WHEN g > 6480 THEN '1' WHEN g > 2160 THEN '2' ELSE '3' END)::streampos.multi_writer_token "
        "FROM generate_series(1, 12960) g",
        (stream,),
    )
    oldest = one(db, "SELECT extract(epoch FROM now() - min(marked_at))::float8 FROM streampos.frontier_marks WHERE stream_name = %s", (stream,))
    write(db, stream, "w1")
    wait_for_mark(db, stream, "4")
    # Away from the classes' edges (the worker's clock is not the test's):
    # a minute keeps one mark between an hour's and a day's age, an hour
    # one past a day's.
    crowded = rows(
        db,
        "SELECT b, count(*) FROM ("
        "  SELECT CASE WHEN marked_at < now() - interval '1 day 1 hour 2 minutes' "
        "                THEN date_trunc('hour', marked_at) "
        "              WHEN marked_at BETWEEN now() - interval '23 hours 58 minutes' "
        "                             AND now() - interval '1 hour 2 minutes' "
        "                THEN date_trunc('minute', marked_at) END AS b "
        "  FROM streampos.frontier_marks WHERE stream_name = %s) x "
        "WHERE b IS NOT NULL GROUP BY b HAVING count(*) > 1",
        (stream,),
    )
    assert crowded == []
    total = one(db, "SELECT count(*) FROM streampos.frontier_marks WHERE stream_name = %s", (stream,))
    # 180 of the last hour, 1 380 minutes, 48 hours, the new mark.
    assert total <= 180 + 1380 + 48 + 5
    # The lag: from the latest mark of the oldest hour kept, an hour of the
    # three days at most below the truth.
    lag = lags(db, stream)["idle"]
    assert lag[0] == 4
    assert oldest - 3600 <= lag[1] <= oldest + 5


def test_a_consumers_wait_for(connect, pool, stream):
    """wait_for_consumer sleeps until the stream moves past the consumer's
    acknowledged position (as the call read it), or the timeout; it
    answers the current token. Every role may wait (positions and tokens
    are for everyone to read); a position this server never reached is
    72000, as a follower's token."""
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 2)
    register(db, stream, "c", "0")
    assert one(db, "SELECT streampos.wait_for_consumer(%s, 'c', 0)::text", (stream,)) == "2"
    ack(db, stream, "c", "2")
    started = time.monotonic()
    assert one(db, "SELECT streampos.wait_for_consumer(%s, 'c', 300)::text", (stream,)) == "2"
    assert time.monotonic() - started >= 0.29
    nobody = connect(user=ensure_login_role("streampos_con_none"))
    waiting = pool.submit(one, nobody, "SELECT streampos.wait_for_consumer(%s, 'c', 20000)::text", (stream,))
    time.sleep(0.3)
    assert not waiting.done()
    started = time.monotonic()
    write(connect(), stream, "w2")
    # The token past the position: ID 3 committed (or, first, writer w1's
    # position moved to ID 3 when w2 took it, as every idle writer's does).
    woken = waiting.result(timeout=10)
    assert time.monotonic() - started < 5
    assert woken in ("3", f"m2~{instance_id(db, 'w1')}.3")
    expect_error(db, "SELECT streampos.wait_for_consumer(%s, 'nobody', 0)", (stream,), sqlstate="42704")
    # A position from another history (a failover that lost IDs).
    db.execute(
        "UPDATE streampos.consumer_positions SET position = '1000' WHERE stream_name = %s AND consumer_name = 'c'",
        (stream,),
    )
    err = expect_error(db, "SELECT streampos.wait_for_consumer(%s, 'c', 0)", (stream,), sqlstate="72000")
    assert "1000" in err.diag.message_primary


def test_every_row_processed_exactly_once_by_every_consumer_under_kills(connect, stream):
    """Writers commit (one transaction in five rolled back) while three
    consumers process rows and acknowledge them in the same transaction,
    their sessions killed at random; a retention job deletes below
    safe_to_delete meanwhile. Every consumer ends with every committed row,
    each once (a processed row twice would violate the primary key), and no
    row a consumer had not acknowledged was deleted before it read it."""
    db = connect()
    setup_stream(db, stream)
    db.execute(f"CREATE TABLE {stream}_done (consumer text, id bigint, PRIMARY KEY (consumer, id))")
    consumers = ["federation", "pusher", "appservice"]
    for c in consumers:
        register(db, stream, c)
    committed = set()
    lock = threading.Lock()
    stop_writing = threading.Event()
    stop = threading.Event()
    errors = []
    pids = {}
    kills = [0]
    batches = [0]

    def writer(name, seed):
        rng = random.Random(seed)
        conn = connect()
        try:
            while not stop_writing.is_set():
                commit = rng.random() >= 0.2
                ids = write(conn, stream, name, rng.randint(1, 3), commit=commit)
                if commit:
                    with lock:
                        committed.update(ids)
                time.sleep(rng.random() * 0.003)
        except Exception as e:
            errors.append(e)
            stop.set()

    def consumer(name, seed):
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                conn = connect()
                pids[name] = conn.info.backend_pid
                while not stop.is_set():
                    with conn.transaction():
                        token, ids = consume(conn, stream, name, max_rows=rng.randint(1, 20), timeout_ms=100)
                        for i in ids:
                            conn.execute(f"INSERT INTO {stream}_done VALUES (%s, %s)", (name, i))
                        time.sleep(rng.random() * 0.002)
                        ack(conn, stream, name, token)
                    batches[0] += 1
            except psycopg.OperationalError:
                continue  # killed: a new session resumes from the acknowledged position
            except Exception as e:
                errors.append(e)
                stop.set()

    def killer():
        rng = random.Random(7)
        conn = connect()
        while not stop.is_set():
            time.sleep(rng.uniform(0.02, 0.12))
            name = rng.choice(consumers)
            pid = pids.get(name)
            if pid and one(conn, "SELECT pg_terminate_backend(%s)", (pid,)):
                kills[0] += 1

    def retention():
        conn = connect()
        try:
            while not stop.is_set():
                with conn.transaction():
                    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    safe = one(conn, "SELECT streampos.safe_to_delete(%s)::text", (stream,))
                    # Never past any consumer's position.
                    assert one(
                        conn,
                        "SELECT bool_and(streampos.is_before_or_eq(%s::streampos.multi_writer_token, position)) "
                        "FROM streampos.consumer_positions WHERE stream_name = %s",
                        (safe, stream),
                    )
                    conn.execute(
                        f"DELETE FROM {stream}_ev e USING streampos.instances i "
                        "WHERE i.instance_name = e.instance_name "
                        "AND NOT streampos.persisted_after(%s::streampos.multi_writer_token, i.instance_id, e.id)",
                        (safe,),
                    )
                time.sleep(0.02)
        except Exception as e:
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=writer, args=(w, k)) for k, w in enumerate(WRITERS)]
    threads += [threading.Thread(target=consumer, args=(c, 10 + k)) for k, c in enumerate(consumers)]
    threads += [threading.Thread(target=killer), threading.Thread(target=retention)]
    for t in threads:
        t.start()
    time.sleep(6)
    stop_writing.set()
    # The writers' last transactions end first: a row committed after the
    # final token was read would be left to consumers already stopped (the
    # test, not the consumers, lost such rows once).
    for t in threads[:len(WRITERS)]:
        t.join(timeout=30)
    final = one(db, "SELECT streampos.current_token(%s)::text", (stream,))
    deadline = time.time() + 60
    while time.time() < deadline and not errors:
        behind = one(
            db,
            "SELECT count(*) FROM streampos.consumer_positions WHERE stream_name = %s "
            "AND NOT streampos.is_before_or_eq(%s::streampos.multi_writer_token, position)",
            (stream, final),
        )
        if behind == 0:
            break
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert kills[0] >= 5 and batches[0] >= 50, (kills, batches)
    print(f"\n  {len(committed)} committed rows, {batches[0]} batches, {kills[0]} consumer sessions killed")
    for c in consumers:
        done = {r[0] for r in rows(db, f"SELECT id FROM {stream}_done WHERE consumer = %s", (c,))}
        assert done == committed, (c, sorted(committed - done)[:10], sorted(done - committed)[:10])
    # Every consumer acknowledged everything: all of it may be deleted.
    safe = one(db, "SELECT streampos.safe_to_delete(%s)::text", (stream,))
    assert one(
        db,
        "SELECT streampos.is_before_or_eq(%s::streampos.multi_writer_token, %s::streampos.multi_writer_token)",
        (final, safe),
    ), (final, safe)


def test_another_roles_ack_never_waits_for_the_owners_transaction(connect, pool, stream, roles):
    """The adversary of 0.4.0: an ack that wrote first and checked the
    owner afterwards held the stream's consumers lock while it waited for
    the owner's row lock; the owner's register_consumer in the same
    transaction then waited for it: 40P01. Another role's ack now matches
    no row (nor waits for one) and is refused at once."""
    role_a, role_b, _ = roles
    db = connect()
    setup_stream(db, stream)
    write(db, stream, "w1", 2)
    db.execute(f"GRANT SELECT ON {stream}_ev TO PUBLIC")
    a, b = connect(user=role_a), connect(user=role_b)
    register(a, stream, "mine", "0")
    with a.transaction():
        assert ack(a, stream, "mine", "1") == "1"
        started = time.monotonic()
        refused = pool.submit(expect_error, b, "SELECT streampos.ack(%s, 'mine', '2')", (stream,), sqlstate="42501")
        refused.result(timeout=20)
        assert time.monotonic() - started < 4, "another role's ack waited for the owner's transaction"
        assert register(a, stream, "another", "1") == "1"
    assert position(db, stream, "mine") == "1"
