"""docs/event-stores.md, statement by statement: the column default that
reads the writer from a setting (and what happens without it), what a
rolled-back or running writer does to the frontier, the limits the guide
names, and the reader's loop it shows."""

import io

import psycopg

import support
from support import create_stream, expect_error, one, rows

GUIDE_ROLE = "streampos_guide_writer"


def events_table(db, stream, writers=None):
    create_stream(db, stream, writers=writers)
    db.execute(f"CREATE TABLE {stream}_events (position bigint PRIMARY KEY, writer text NOT NULL, "
               "stream_id text, type text, body jsonb)")
    db.execute(f"ALTER TABLE {stream}_events "
               f"ALTER COLUMN position SET DEFAULT streampos.next_id('{stream}', current_setting('app.writer')), "
               f"ALTER COLUMN writer SET DEFAULT current_setting('app.writer')")
    db.execute("SELECT streampos.add_table(%s, %s, 'position', 'writer')", (stream, f"{stream}_events"))
    return f"{stream}_events"


def test_a_column_default_allocates_for_unchanged_inserts(connect, stream):
    """With app.writer set, INSERTs that name neither column, a multi-row
    INSERT and COPY each get an ID of the stream per row and the writer's
    name; a follower receives them all."""
    db = connect()
    table = events_table(db, stream)
    w = connect()
    w.execute("SET app.writer = 'node-1'")
    w.execute(f"INSERT INTO {table} (stream_id, type, body) VALUES ('order-1', 'placed', '{{}}')")
    w.execute(f"INSERT INTO {table} (stream_id, type, body) VALUES ('order-1', 'paid', '{{}}'), "
              "('order-2', 'placed', '{}')")
    with w.cursor().copy(f"COPY {table} (stream_id, type, body) FROM STDIN") as copy:
        copy.write(io.StringIO("order-3\tplaced\t{}\norder-3\tpaid\t{}\n").read())
    rows = db.execute(f"SELECT position, writer FROM {table} ORDER BY position").fetchall()
    assert rows == [(i, "node-1") for i in range(1, 6)]
    answer = one(db, "SELECT streampos.updates_json(%s, '0', ordered => true)", (stream,))
    assert [r[0] for r in answer["data"][1:]] == [1, 2, 3, 4, 5] and answer["token"] == "5"


def test_without_the_setting_the_insert_fails_and_writes_nothing(connect, stream):
    """current_setting('app.writer') without the setting: 42704, nothing
    written, no ID taken; the missing_ok form fails later, on NOT NULL."""
    db = connect()
    table = events_table(db, stream)
    w = connect()
    err = expect_error(w, f"INSERT INTO {table} (stream_id, type) VALUES ('o', 't')", None, "42704")
    assert "app.writer" in str(err)
    assert one(db, f"SELECT count(*) FROM {table}") == 0
    assert one(db, "SELECT streampos.max_allocated(%s)", (stream,)) == 0
    db.execute(f"ALTER TABLE {table} ALTER COLUMN position SET DEFAULT "
               f"streampos.next_id('{stream}', current_setting('app.writer', true))")
    expect_error(w, f"INSERT INTO {table} (writer, stream_id, type) VALUES ('x', 'o', 't')", None, "23502")


def test_the_inserting_role_needs_what_nextval_needs(connect, stream):
    """A role that may insert into the table but has no USAGE on the
    stream's sequence: 42501 from next_id; with USAGE it writes."""
    db = connect()
    table = events_table(db, stream)
    role = support.ensure_login_role(GUIDE_ROLE)
    db.execute(f"GRANT INSERT, SELECT ON {table} TO {role}")
    w = connect(user=role)
    w.execute("SET app.writer = 'node-1'")
    expect_error(w, f"INSERT INTO {table} (stream_id, type) VALUES ('o', 't')", None, "42501")
    db.execute(f'GRANT USAGE ON SEQUENCE streampos."{stream}_seq" TO {role}')
    w.execute(f"INSERT INTO {table} (stream_id, type) VALUES ('o', 't')")
    assert one(db, f"SELECT count(*) FROM {table}") == 1


def test_a_rolled_back_writer_leaves_a_gap_the_frontier_passes_at_once(connect, stream):
    """No stale threshold: a rolled-back transaction's ID is finished with
    it, and the frontier moves past the gap at once; a running one is named
    by in_flight() with its pid and holds the frontier below its ID."""
    db = connect()
    table = events_table(db, stream)
    a, b = connect(), connect()
    for c in (a, b):
        c.execute("SET app.writer = 'node-1'")
    a.execute("BEGIN")
    a.execute(f"INSERT INTO {table} (stream_id, type) VALUES ('o', 'slow')")
    b.execute(f"INSERT INTO {table} (stream_id, type) VALUES ('o', 'fast')")
    assert one(db, "SELECT streampos.frontier(%s)", (stream,)) == 0
    pids = [r[0] for r in db.execute("SELECT pid FROM streampos.in_flight(%s)", (stream,)).fetchall()]
    assert pids == [a.info.backend_pid]
    a.execute("ROLLBACK")
    assert one(db, "SELECT streampos.frontier(%s)", (stream,)) == 2
    assert [r[0] for r in one(db, "SELECT streampos.updates_json(%s, '0', ordered => true)",
                              (stream,))["data"][1:]] == [2]


def test_a_stream_with_named_writers_refuses_another(connect, stream):
    """writers => ARRAY[…]: another name is refused, and nothing is taken."""
    db = connect()
    table = events_table(db, stream, writers=["node-1", "node-2"])
    w = connect()
    w.execute("SET app.writer = 'node-3'")
    expect_error(w, f"INSERT INTO {table} (stream_id, type) VALUES ('o', 't')", None, "55000")
    w.execute("SET app.writer = 'node-2'")
    w.execute(f"INSERT INTO {table} (stream_id, type) VALUES ('o', 't')")


def test_the_readers_loop_of_the_guide(connect, stream):
    """The guide's consumer: register once, read ordered, apply, ack in one
    transaction; a batch rolled back comes again; retention may delete what
    was acknowledged."""
    db = connect()
    table = events_table(db, stream)
    db.execute(f"CREATE TABLE {stream}_orders (stream_id text PRIMARY KEY, events int)")
    w = connect()
    w.execute("SET app.writer = 'node-1'")
    for i in range(3):
        w.execute(f"INSERT INTO {table} (stream_id, type) VALUES ('order-{i % 2}', 'e')")
    db.execute("SELECT streampos.register_consumer(%s, 'projection-orders', '0')", (stream,))
    r = connect()

    def batch(commit):
        with r.transaction():
            got = one(r, "SELECT streampos.updates_json(%s, consumer => 'projection-orders', ordered => true)",
                      (stream,))
            for row in got["data"][1:]:
                r.execute(f"INSERT INTO {stream}_orders VALUES (%s, 1) ON CONFLICT (stream_id) "
                          f"DO UPDATE SET events = {stream}_orders.events + 1", (row[2],))
            r.execute("SELECT streampos.ack(%s, 'projection-orders', %s)", (stream, got["token"]))
            if not commit:
                raise psycopg.Rollback()
        return got["token"]

    assert batch(commit=False) == "3"
    assert one(db, f"SELECT count(*) FROM {stream}_orders") == 0
    assert batch(commit=True) == "3"
    assert db.execute(f"SELECT stream_id, events FROM {stream}_orders ORDER BY 1").fetchall() == [
        ("order-0", 2), ("order-1", 1)]
    assert one(db, "SELECT streampos.safe_to_delete(%s)::text", (stream,)) == "3"


def test_the_limits_the_guide_states(connect, db, stream):
    """The guide's "Limits": one transaction allocates from at most
    streampos.max_streams_per_transaction (stream, writer) pairs (53400
    beyond, naming the setting, and the earlier pairs' IDs are still its
    own); next_ids takes at most 1 000 000 IDs a call (22023 beyond); a
    transaction may hold any number of IDs across calls. A stream open to any writer remembers 1024
    writers (test_fixed_tables.py); a server, streampos.max_streams streams
    (test_torture.py::test_registry_exhaustion_in_one_transaction)."""
    create_stream(db, stream)
    pairs = int(one(db, "SHOW streampos.max_streams_per_transaction"))
    writer = connect()
    writer.execute("BEGIN")
    for w in range(pairs):
        one(writer, "SELECT streampos.next_id(%s, %s)", (stream, f"tenant_{w}"))
    err = expect_error(writer, "SELECT streampos.next_id(%s, 'one_more_tenant')", (stream,), sqlstate="53400")
    assert "streampos.max_streams_per_transaction" in (err.diag.message_hint or ""), err.diag.message_hint
    writer.execute("ROLLBACK")

    err = expect_error(db, "SELECT streampos.next_ids(%s, 'importer', 1000001)", (stream,), sqlstate="22023")
    assert err.diag.message_detail == "n must be between 1 and 1000000."
    before = one(db, "SELECT streampos.frontier(%s)", (stream,))
    with db.transaction():
        for _ in range(3):
            ids = one(db, "SELECT streampos.next_ids(%s, 'importer', 1000000)", (stream,))
            assert len(ids) == 1000000
        # Only this transaction's writer is in flight (how many rows
        # in_flight shows for it depends on what is durable yet).
        assert rows(db, "SELECT DISTINCT instance_name FROM streampos.in_flight(%s)", (stream,)) == [("importer",)]
    assert one(db, "SELECT streampos.frontier(%s)", (stream,)) == before + 3000000
