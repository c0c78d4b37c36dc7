"""updates()' index read (src/sql/index_read.rs, issue 32): a plain table's
rows read through its ID index without any statement. Its answers must be
the row statement's, value for value, and it must never read where the
statement would refuse, see less, or run another role's code."""

import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

import support
from support import create_stream, expect_error, one

# Columns of built-in types, each with values whose JSON is easy to get
# wrong: every one goes through the index read's direct conversions or its
# to_jsonb call, and must come out as jsonb_build_array makes it.
COLUMNS = [
    ("b", "boolean", ["true", "false"]),
    ("i2", "smallint", ["-32768", "32767"]),
    ("i4", "integer", ["-2147483648", "2147483647"]),
    ("i8", "bigint", ["-9223372036854775808", "9223372036854775807", "9007199254740993"]),
    ("num", "numeric", ["'NaN'", "'-0.000100'", "1e40", "'Infinity'"]),
    ("f4", "real", ["'NaN'", "'-0'", "1.5e-30", "'-Infinity'"]),
    ("f8", "double precision", ["'NaN'", "'Infinity'", "0.1", "-1e308"]),
    ("t", "text", ["''", "E'\"quoted\" \\\\ back\\nline\\t\\u0001 é 𝄞'", "repeat('long ', 40000)"]),
    ("vc", "varchar(12)", ["'a'", "'   '"]),
    ("ch", "character(4)", ["'ab'"]),
    ("by", "bytea", ["'\\x00ff'::bytea"]),
    ("d", "date", ["'2026-12-07'", "'infinity'"]),
    ("ts", "timestamp", ["'2026-12-07 10:11:12.5'", "'-infinity'"]),
    ("tz", "timestamptz", ["'2026-12-07 10:11:12+05'"]),
    ("iv", "interval", ["'1 year 2 mons -3 days 04:05:06'"]),
    ("u", "uuid", ["'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'"]),
    ("j", "jsonb", ["'{\"a\": [1, 2.50, null], \"b\": \"x\"}'", "'null'"]),
    ("js", "json", ["'{\"a\":  1, \"a\": 2}'"]),
    ("ta", "text[]", ["'{a,NULL,\"b c\"}'", "'{}'"]),
    ("ia", "integer[]", ["'{{1,2},{3,4}}'"]),
    ("ba", "bigint[]", ["'{9007199254740993,NULL}'"]),
    ("ip", "inet", ["'10.0.0.1/8'"]),
    ("oi", "oid", ["4294967295"]),
    ("ch1", '"char"', ["'x'"]),
    ("tv", "tsvector", ["'a:1 b:2'"]),
    ("pt", "point", ["'(1,2)'"]),
]


def rows_of_every_type(db, table, stream):
    """Rows of `table` (created here): one per value of each column and one
    of NULLs, with IDs from the stream."""
    defs = ", ".join(f"{name} {type_}" for name, type_, _ in COLUMNS)
    db.execute(f"CREATE TABLE {table} (id bigint, instance_name text, {defs})")
    db.execute(f"CREATE UNIQUE INDEX ON {table} (id)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    db.execute(f"INSERT INTO {table} (id, instance_name) SELECT streampos.next_id(%s, 'w'), 'w'", (stream,))
    for name, _, values in COLUMNS:
        for value in values:
            db.execute(f"INSERT INTO {table} (id, instance_name, {name}) "
                       f"SELECT streampos.next_id(%s, 'w'), 'w', {value}", (stream,))


def as_text(db, stream, since, n):
    """updates()' answer as text (numbers exactly as printed), after
    checking that updates_json() wrote the same text."""
    text, json_text = db.execute("SELECT streampos.updates(%s, %s, %s, 0)::text, "
                                 "streampos.updates_json(%s, %s, %s, 0)::text",
                                 (stream, since, n, stream, since, n)).fetchone()
    assert json_text == text, "updates_json() is not updates() printed"
    return text


def answers(db, stream, since="0"):
    """updates()' answers as text, with json_bigint_as_string off and on."""
    out = []
    for bigint_as_text in ("off", "on"):
        db.execute(f"SET streampos.json_bigint_as_string = {bigint_as_text}")
        out.append(as_text(db, stream, since, 1000))
    db.execute("RESET streampos.json_bigint_as_string")
    return out


def reference_rows(db, table):
    """The rows as jsonb_build_array makes them, by hand, as the text of a
    jsonb array (numbers exactly as they are)."""
    cols = ", ".join(["instance_name"] + [name for name, _, _ in COLUMNS])
    return one(db, f"SELECT jsonb_agg(jsonb_build_array(id, {cols}) ORDER BY id)::text FROM {table}")


def test_the_index_read_answers_what_the_statement_answers(connect, stream):
    """Every column of a table with an ID index is read by the index read
    (that no statement runs for it is test_followers.py's
    test_the_followers_statement_is_planned_once_per_session); its rows
    are jsonb_build_array's, and the answers are the statement's, read
    once the index is gone, byte for byte, with bigints as numbers and as
    strings (a bigint[] column leaves the latter to the statement)."""
    db = connect()
    create_stream(db, stream)
    table = f"{stream}_ev"
    rows_of_every_type(db, table, stream)
    db.execute("SET TimeZone = 'Asia/Kathmandu'")
    db.execute("SET extra_float_digits = 0")
    through_index = answers(db, stream)
    through_index_later = answers(db, stream, since="5")
    # The rows as the SQL reference makes them, in the answer.
    got = one(db, "SELECT jsonb_path_query_array(streampos.updates(%s, '0', 1000, 0), '$.data[1 to last]')::text",
              (stream,))
    assert got == reference_rows(db, table)
    # Without an ID index the statement reads the table: the same answers.
    db.execute(f"DROP INDEX {table}_id_idx")
    assert answers(db, stream) == through_index
    assert answers(db, stream, since="5") == through_index_later


@pytest.mark.parametrize("index", [
    "CREATE UNIQUE INDEX ON {t} (id) WHERE id > 0",            # partial
    "CREATE UNIQUE INDEX ON {t} (id DESC)",                   # descending
    "CREATE INDEX ON {t} USING hash (id)",                     # not a B-tree
    "CREATE INDEX ON {t} ((id + 0))",                          # an expression
    "CREATE INDEX ON {t} (instance_name, id)",                 # ID not first
    "CREATE UNIQUE INDEX ON {t} (id, instance_name)",          # ID first: read
])
def test_any_id_index_gives_the_same_rows(connect, stream, index):
    """The index read takes only a plain ascending B-tree index led by the
    ID; with any other the statement reads. Either way: the same rows."""
    db = connect()
    create_stream(db, stream)
    table = f"{stream}_ev"
    db.execute(f"CREATE TABLE {table} (id bigint, instance_name text, body text)")
    db.execute(index.format(t=table))
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    for i in range(5):
        db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w'), 'w', %s", (stream, f"r{i}"))
    answer = one(db, "SELECT streampos.updates(%s, '1', 3, 0)", (stream,))
    assert answer["data"][1:] == [[2, "w", "r1"], [3, "w", "r2"], [4, "w", "r3"]]
    assert answer["limited"] is True


def test_a_column_changed_between_calls_is_read_as_it_is_now(connect, stream):
    """What the index read keeps of a table (its plan) follows the table:
    a column's type changed, a column dropped or added, the index dropped
    and made again, between calls of one session."""
    db = connect()
    create_stream(db, stream)
    table = f"{stream}_ev"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, instance_name text, n integer, gone text)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w'), 'w', 7, 'g'", (stream,))
    assert one(db, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1] == [1, "w", 7, "g"]
    db.execute("SET streampos.json_bigint_as_string = on")
    assert one(db, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1] == ["1", "w", 7, "g"]
    db.execute(f"ALTER TABLE {table} ALTER COLUMN n TYPE bigint")
    assert one(db, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1] == ["1", "w", "7", "g"]
    db.execute(f"ALTER TABLE {table} DROP COLUMN gone, ADD COLUMN late text DEFAULT 'l'")
    answer = one(db, "SELECT streampos.updates(%s, '0')", (stream,))
    assert answer["data"] == [[f"public.{table}", "1", 1, 4, "id", "instance_name", "n", "late"], ["1", "w", "7", "l"]]
    db.execute(f"ALTER TABLE {table} DROP CONSTRAINT {table}_pkey")
    db.execute(f"ALTER TABLE {table} ALTER COLUMN n TYPE numeric")
    assert one(db, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1] == ["1", "w", 7, "l"]
    db.execute(f"CREATE INDEX ON {table} (id)")
    assert one(db, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1] == ["1", "w", 7, "l"]


READER = "streampos_index_reader"


def test_a_caller_without_select_is_refused_by_the_index_read(connect, stream):
    """The index read checks the caller as read_as_owner does: SELECT on
    the table or on every column read (42501)."""
    db = connect()
    create_stream(db, stream)
    table = f"{stream}_ev"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, instance_name text, secret text)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w'), 'w', 's'", (stream,))
    reader = support.ensure_login_role(READER)
    db.execute(f"GRANT SELECT (id, instance_name) ON {table} TO {reader}")
    r = connect(user=reader)
    err = expect_error(r, "SELECT streampos.updates(%s, '0')", (stream,), "42501")
    assert table in str(err)
    db.execute(f"GRANT SELECT (secret) ON {table} TO {reader}")
    assert one(r, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1] == [1, "w", "s"]
    db.execute(f"REVOKE SELECT ON {table} FROM {reader}")
    expect_error(r, "SELECT streampos.updates(%s, '0')", (stream,), "42501")


def test_another_sessions_temporary_table_is_not_read_from_its_buffers(connect, stream):
    """A temporary table's rows live in its session's own buffers: another
    session's index read would see none of them. It is refused as a
    statement would be."""
    db = connect()
    create_stream(db, stream)
    db.execute(f"CREATE TEMPORARY TABLE {stream}_tmp (id bigint PRIMARY KEY, instance_name text)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, f"{stream}_tmp"))
    db.execute(f"INSERT INTO {stream}_tmp SELECT streampos.next_id(%s, 'w'), 'w'", (stream,))
    assert one(db, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1] == [1, "w"]
    other = connect()
    expect_error(other, "SELECT streampos.updates(%s, '0')", (stream,), "0A000")


def since_tokens(ids, top):
    """Every canonical multi-writer token over `ids` (instance ids) with
    positions 0 to top in steps: `m{least}~{id}.{pos}…` for the writers
    above the least."""
    steps = sorted({0, 1, top // 3, top // 2, top - 2, top - 1, top} & set(range(top + 1)))
    tokens = set()
    for a in steps:
        for b in steps:
            for c in steps:
                positions = dict(zip(ids, (a, b, c)))
                least = min(positions.values())
                tail = "".join(f"~{i}.{p}" for i, p in sorted(positions.items()) if p > least)
                tokens.add(f"m{least}{tail}" if tail else f"{least}")
    return sorted(tokens)


def test_writers_apart_are_read_as_the_statement_reads_them(connect, stream):
    """Writers standing apart: a row is in range by its writer's positions
    in the tokens. The index read looks each writer up in
    streampos.instances and compares as the statement does: for every
    token of three writers over the stream, with a writer still in flight
    (the current token has it behind), rows of no writer (NULL) and of a
    name no writer has, a text and a varchar instance column and a table
    without one, with room for every row and two rows a call (the cut),
    the answers are the statement's, read once the indexes are gone."""
    db, slow = connect(), connect()
    writers = ["w1", "w2", "w3"]
    create_stream(db, stream, writers=writers)
    ev, st, bare = f"{stream}_ev", f"{stream}_st", f"{stream}_bare"
    db.execute(f"CREATE TABLE {ev} (id bigint PRIMARY KEY, instance_name text, body text)")
    db.execute(f"CREATE TABLE {st} (stream_id bigint PRIMARY KEY, writer varchar(20), n int)")
    db.execute(f"CREATE TABLE {bare} (id bigint PRIMARY KEY, note text)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, ev))
    db.execute("SELECT streampos.add_table(%s, %s, 'stream_id', 'writer')", (stream, st))
    db.execute("SELECT streampos.add_table(%s, %s, 'id')", (stream, bare))

    def write(writer, table, name=None):
        """A row of `writer` in `table`, its instance column saying `name`
        (the writer's own by default)."""
        if table == bare:
            db.execute(f"INSERT INTO {bare} SELECT streampos.next_id(%s, %s), 'b'", (stream, writer))
        else:
            db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, %s), %s, %s",
                       (stream, writer, name or writer, 1 if table == st else writer))

    for i in range(12):
        write(writers[i % 3], [ev, st, bare][i % 3])
    db.execute(f"INSERT INTO {ev} SELECT streampos.next_id(%s, 'w2'), NULL, 'none'", (stream,))
    write("w3", st, name="stranger")
    # w2 in flight (a session's hold: no lock on the tables, which lose
    # their indexes below): the current token keeps it behind the others.
    held = one(slow, "SELECT streampos.hold_ids(%s, 'w2')", (stream,))
    for i in range(6):
        write(["w1", "w3"][i % 2], [ev, st][i % 2])
    ids = [one(db, "SELECT instance_id FROM streampos.instances WHERE instance_name = %s", (w,)) for w in writers]
    top = one(db, "SELECT streampos.max_allocated(%s)", (stream,))
    current = one(db, "SELECT streampos.current_token(%s)::text", (stream,))
    assert current.startswith("m"), f"writers are not apart: {current}"
    tokens = since_tokens(ids, top - 1)

    def all_answers():
        return [as_text(db, stream, since, n) for since in tokens for n in (1000, 2)]

    through_index = all_answers()
    assert any('"w1"' in a for a in through_index) and any('"stranger"' in a for a in through_index)
    assert any('"limited": true' in a for a in through_index)
    for table, id_column in ((ev, "id"), (st, "stream_id"), (bare, "id")):
        db.execute(f"ALTER TABLE {table} DROP CONSTRAINT {table}_pkey")
        db.execute(f"CREATE INDEX ON {table} ({id_column}) WHERE {id_column} IS NOT NULL")
    through_statement = all_answers()
    slow.execute("SELECT streampos.release_ids(%s, %s)", (stream, held))
    mismatches = [(t, a, b) for t, a, b in zip([t for t in tokens for _ in (0, 1)], through_index, through_statement)
                  if a != b]
    assert not mismatches, f"{len(mismatches)} answers differ, first: {mismatches[0]}"


def test_an_instance_the_backend_knows_is_unknown_to_a_snapshot_before_it(connect, stream):
    """The index read keeps the instance ids it has read (a follower of
    writers apart would look each writer up on every call), but a snapshot
    taken before an instance's row committed must not see it: a row whose
    writer has no instance for that snapshot is compared at the token's
    least position, as the statement compares it. A backend that read the
    new instance answers an older, imported snapshot exactly as a backend
    that never read it."""
    db, other, exporter, fresh = connect(), connect(), connect(), connect()
    create_stream(db, stream)
    ev = f"{stream}_ev"
    db.execute(f"CREATE TABLE {ev} (id bigint PRIMARY KEY, instance_name text, body text)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, ev))
    with db.transaction():
        db.execute(f"INSERT INTO {ev} SELECT streampos.next_id(%s, 'w1'), 'w1', 'a'", (stream,))
    late_name = f"{stream}_late"
    # A row naming an instance that does not exist yet.
    with db.transaction():
        row = one(db, f"INSERT INTO {ev} SELECT streampos.next_id(%s, 'w1'), %s, 'b' RETURNING id",
                  (stream, late_name))
    exporter.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    snapshot = one(exporter, "SELECT pg_export_snapshot()")
    assert one(exporter, "SELECT streampos.frontier(%s)", (stream,)) >= row
    # The instance comes into being after that snapshot.
    with other.transaction():
        other.execute(f"INSERT INTO {ev} SELECT streampos.next_id(%s, %s), %s, 'c'",
                      (stream, late_name, late_name))
    late = one(db, "SELECT instance_id FROM streampos.instances WHERE instance_name = %s", (late_name,))
    since = f"m{row - 1}~{late}.{row}"
    now = as_text(db, stream, since, 100)
    assert f'"{late_name}", "b"' not in now, "the late instance is known now: its row is behind the token"

    def under_old_snapshot(conn):
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute(f"SET TRANSACTION SNAPSHOT '{snapshot}'")
        answer = as_text(conn, stream, since, 100)
        conn.execute("COMMIT")
        return answer

    known, unknown = under_old_snapshot(db), under_old_snapshot(fresh)
    exporter.execute("COMMIT")
    assert f'"{late_name}", "b"' in unknown, unknown
    assert known == unknown


def test_instances_stay_immutable_as_a_replica(connect, stream):
    """The index read keeps instance ids across calls because a row of
    streampos.instances never changes: also not with
    session_replication_role = replica, which silences ordinary triggers
    (an adversary's review renamed an instance that way, and a backend
    that had read it kept the old id)."""
    db = connect()
    create_stream(db, stream)
    with db.transaction():
        one(db, "SELECT streampos.next_id(%s, 'w1')", (stream,))
    db.execute("SET session_replication_role = replica")
    expect_error(db, "UPDATE streampos.instances SET instance_name = instance_name || 'x' "
                     "WHERE instance_name = 'w1'", sqlstate="55000")
    expect_error(db, "DELETE FROM streampos.instances WHERE instance_name = 'w1'", sqlstate="55000")
    db.execute("RESET session_replication_role")


def test_one_table_in_two_streams_is_read_by_each_streams_columns(connect, stream):
    """What the index read keeps of a table is kept per registration: the
    same table registered in two streams by different ID columns, and a
    registration changed (no relation changes), read in one session."""
    db = connect()
    a, b = f"{stream}_a", f"{stream}_b"
    create_stream(db, a)
    create_stream(db, b)
    table = f"{stream}_ev"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, alt_id bigint, w text, v text, body text)")
    db.execute(f"CREATE INDEX ON {table} (alt_id)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'w')", (a, table))
    db.execute("SELECT streampos.add_table(%s, %s, 'alt_id', 'w')", (b, table))
    for i in range(3):
        db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w'), streampos.next_id(%s, 'w'), "
                   f"'w', 'v', %s", (a, b, f"r{i}"))
    db.execute(f"UPDATE {table} SET alt_id = 4 - alt_id")  # b's IDs run against a's
    rows_a = one(db, "SELECT streampos.updates(%s, '0')", (a,))["data"][1:]
    rows_b = one(db, "SELECT streampos.updates(%s, '0')", (b,))["data"][1:]
    assert [r[0] for r in rows_a] == [1, 2, 3] and [r[4] for r in rows_a] == ["r0", "r1", "r2"]
    assert [r[1] for r in rows_b] == [1, 2, 3] and [r[4] for r in rows_b] == ["r2", "r1", "r0"]
    # The instance column changed by a new registration: writers apart are
    # compared by the new one ('v' names no writer: each row at the minimum).
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'v')", (a, table))
    assert one(db, "SELECT streampos.updates(%s, '0')", (a,))["data"][1:] == rows_a


def test_object_names_print_as_the_statement_prints_them(connect, stream):
    """regclass and its kind print a name qualified only when the search
    path does not find it: the statement prints with its own path, and so
    does every answer, whatever the caller's path."""
    db = connect()
    create_stream(db, stream)
    table = f"{stream}_ev"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, instance_name text, target regclass, "
               f"targets regclass[], fn regprocedure)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    # The trap fixture's index on every new table sets a search path inside
    # the statement (to see that nothing of it outlives the statement); the
    # statement's own path is what is compared here.
    for (index,) in db.execute("SELECT indexrelid::regclass::text FROM pg_index "
                               "WHERE indrelid = %s::regclass AND NOT indisprimary", (table,)).fetchall():
        db.execute(f"DROP INDEX {index}")
    db.execute(f"CREATE FUNCTION public.{stream}_f() RETURNS int LANGUAGE sql AS 'SELECT 1'")
    db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w'), 'w', %s::regclass, "
               f"ARRAY[%s::regclass], 'public.{stream}_f()'::regprocedure",
               (stream, f"public.{table}", f"public.{table}"))
    expected = [1, "w", f"public.{table}", [f"public.{table}"], f"public.{stream}_f()"]
    for path in ("public", "pg_catalog", '"$user", public'):
        db.execute(f"SET search_path = {path}")
        assert one(db, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1] == expected, path


def test_a_virtual_generated_column_is_computed(connect, stream):
    """PostgreSQL 18's virtual generated columns are not stored: a row's
    value is the statement's computation, never the NULL a heap holds."""
    db = connect()
    if one(db, "SELECT current_setting('server_version_num')::int") < 180000:
        pytest.skip("virtual generated columns are PostgreSQL 18's")
    create_stream(db, stream)
    table = f"{stream}_ev"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, instance_name text, body text, "
               f"n int GENERATED ALWAYS AS (length(body)) VIRTUAL)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w'), 'w', 'hello'", (stream,))
    assert one(db, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1] == [1, "w", "hello", 5]


def test_a_change_while_a_transaction_holds_the_tables_lock_is_seen(connect, stream):
    """A lock the reader's transaction already holds takes no invalidation
    in: an inheritance child made (it does not wait for the reader) and a
    privilege revoked while the reader's transaction goes on are seen by
    its next call, as the statement would see them: the child's rows are
    read, the revoked reader refused."""
    db, reader = connect(), connect()
    create_stream(db, stream)
    table = f"{stream}_ev"
    db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, instance_name text, body text)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w'), 'w', 'parent'", (stream,))
    with reader.transaction():
        assert one(reader, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1:] == [[1, "w", "parent"]]
        db.execute(f"CREATE TABLE {stream}_child () INHERITS ({table})")
        db.execute(f"INSERT INTO {stream}_child SELECT streampos.next_id(%s, 'w'), 'w', 'child'", (stream,))
        assert one(reader, "SELECT streampos.updates(%s, '0')", (stream,))["data"][1:] == [
            [1, "w", "parent"], [2, "w", "child"]]
    role = support.ensure_login_role(READER)
    db.execute(f"GRANT SELECT ON {table} TO {role}")
    r = connect(user=role)
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        with r.transaction():
            assert one(r, "SELECT streampos.updates(%s, '1')", (stream,))["data"][1:] == [[2, "w", "child"]]
            db.execute(f"REVOKE SELECT ON {table} FROM {role}")
            r.execute("SELECT streampos.updates(%s, '1')", (stream,))


def test_updates_json_is_updates_printed_in_every_form(connect, stream):
    """updates_json() answers what updates() answers, as json: the same
    text whichever way each table is read (an index read and, for a table
    with row-level security, the statement, in one answer), from a consumer,
    caught up, after a long poll woken by a commit, limited; NULL where
    updates() is NULL, its errors where it errs, its privilege checks."""
    db = connect()
    create_stream(db, stream)
    plain, secured = f"{stream}_ev", f"{stream}_rls"
    for table in (plain, secured):
        db.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, instance_name text, body text)")
        db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    db.execute(f"ALTER TABLE {secured} ENABLE ROW LEVEL SECURITY")
    for i in range(6):
        db.execute(f"INSERT INTO {[plain, secured][i % 2]} SELECT streampos.next_id(%s, 'w'), 'w', "
                   "E'row \\u00e9 \"' || %s", (stream, i))
    assert len(one(db, "SELECT streampos.updates(%s, '0')", (stream,))["data"]) == 8
    for n in (100, 2):
        as_text(db, stream, "0", n)
    assert '"limited": true' in as_text(db, stream, "0", 2)
    top = one(db, "SELECT streampos.current_token(%s)::text", (stream,))
    assert '"data": [[' in as_text(db, stream, top, 100)

    db.execute("SELECT streampos.register_consumer(%s, 'c', '2')", (stream,))
    both = db.execute("SELECT streampos.updates(%s, consumer => 'c')::text, "
                      "streampos.updates_json(%s, consumer => 'c')::text, "
                      "pg_typeof(streampos.updates_json(%s, consumer => 'c'))::text",
                      (stream, stream, stream)).fetchone()
    assert both[0] == both[1] and both[2] == "json"

    # A long poll, woken by another session's commit.
    writer = connect()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(one, connect(), "SELECT streampos.updates_json(%s, %s, 100, 20000)::text",
                              (stream, top))
        time.sleep(0.3)
        writer.execute(f"INSERT INTO {plain} SELECT streampos.next_id(%s, 'w'), 'w', 'late'", (stream,))
        woken = waiting.result(timeout=15)
    assert '"late"' in woken and woken == as_text(db, stream, top, 100)

    assert one(db, "SELECT streampos.updates_json(NULL, '0') IS NULL")
    assert one(db, "SELECT streampos.updates_json(%s, '0', NULL) IS NULL", (stream,))
    for sql, state in (("SELECT streampos.updates_json(%s)", "22023"),
                       ("SELECT streampos.updates_json(%s, '0', consumer => 'c')", "22023"),
                       ("SELECT streampos.updates_json(%s, '0', 0)", "22023"),
                       ("SELECT streampos.updates_json(%s, consumer => 'nobody')", "42704")):
        expect_error(db, sql, (stream,), state)
    reader = support.ensure_login_role(READER)
    db.execute(f"GRANT SELECT ON {plain} TO {reader}")
    expect_error(connect(user=reader), "SELECT streampos.updates_json(%s, '0')", (stream,), "42501")
