"""ALTER EXTENSION streampos UPDATE from 0.1.0 to 0.2.0, for the room token
changes of 0.2.0 (docs/tokens.md, "Upgrading from 0.1.0"): the order of
room_stream_token changed, so the update rebuilds what sorted by it, re-checks
CHECK constraints using it, refuses what it cannot rebuild, and leaves the
catalog exactly as a fresh 0.2.0 install makes it.

Each test works in a database of its own, created from scratch.
"""


import psycopg
import pytest

from support import connect_raw, one, rows


@pytest.fixture
def scratch_db(fresh_db):
    """A factory of connections to empty databases, dropped at teardown."""
    return lambda: connect_raw(fresh_db())


def at_010(conn):
    conn.execute("CREATE EXTENSION streampos VERSION '0.1.0'")
    conn.execute("SET search_path = public, streampos")
    return conn


def update(conn):
    conn.execute("ALTER EXTENSION streampos UPDATE TO '0.2.0'")
    assert one(conn, "SELECT extversion FROM pg_extension WHERE extname = 'streampos'") == "0.2.0"


def filenodes(conn):
    return dict(
        rows(
            conn,
            "SELECT i.indexrelid::regclass::text, c.relfilenode FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid IN ('tok'::regclass, 'mw'::regclass)",
        )
    )


def test_update_rebuilds_indexes_that_sort_room_tokens(scratch_db):
    conn = at_010(scratch_db())
    conn.execute("CREATE EXTENSION amcheck")
    conn.execute(
        """
        CREATE TABLE tok (
            id int PRIMARY KEY,
            t room_stream_token UNIQUE,
            -- True in the order of 0.1.0 and in that of 0.2.0 alike.
            CHECK (t >= 't-1000000--1000000')
        );
        INSERT INTO tok
        SELECT i, (CASE i % 3 WHEN 0 THEN 's' || (i % 97)
                              WHEN 1 THEN 't' || i || '-' || (i % 89)
                              ELSE 'm' || (i % 50) || '~1.' || (i % 50 + 1 + i) END)::room_stream_token
        FROM generate_series(1, 3000) AS i
        ON CONFLICT DO NOTHING;
        CREATE INDEX tok_t ON tok (t DESC, id);
        CREATE INDEX tok_partial ON tok (id) WHERE t < 's10';
        CREATE INDEX tok_expr ON tok ((is_before_or_eq(t, 's20')));
        CREATE INDEX tok_hash ON tok USING hash (t);
        CREATE TABLE mw (m multi_writer_token PRIMARY KEY);
        INSERT INTO mw SELECT ('m' || i || '~1.' || (i + 5))::multi_writer_token
        FROM generate_series(1, 100) AS i;
        """
    )
    # Still at 0.1.0 with the new library: the 0.1.0 C symbols keep 0.1.0's
    # order, so the indexes built in it are still in order.
    for index in ("tok_t_key", "tok_t", "tok_partial", "tok_expr", "tok_pkey", "mw_pkey"):
        conn.execute("SELECT bt_index_check(%s::regclass, true)", (index,))
    before = filenodes(conn)
    update(conn)
    after = filenodes(conn)

    rebuilt = {name for name in before if before[name] != after[name]}
    assert rebuilt == {"tok_t_key", "tok_t", "tok_partial", "tok_expr"}, (before, after)

    for index in ("tok_t_key", "tok_t", "tok_partial", "tok_expr", "tok_pkey", "mw_pkey"):
        conn.execute("SELECT bt_index_check(%s::regclass, true)", (index,))
    # Index scans and sequential scans agree on the new order.
    queries = [
        "SELECT count(*) FROM tok WHERE t < 's10'",
        "SELECT count(*) FROM tok WHERE t > 't5-20' AND t <= 'm30~1.33'",
        "SELECT count(*) FROM tok WHERE is_before_or_eq(t, 's20')",
    ]
    conn.execute("SET enable_bitmapscan = off")
    conn.execute("SET enable_seqscan = off")
    by_index = [one(conn, q) for q in queries]
    conn.execute("RESET enable_seqscan")
    conn.execute("SET enable_indexscan = off")
    conn.execute("SET enable_indexonlyscan = off")
    assert by_index == [one(conn, q) for q in queries]


def catalog(conn):
    """Every function (with its arguments, defaults, result and
    privileges), operator and comment of the extension, as text."""
    functions = rows(
        conn,
        """
        SELECT p.oid::regprocedure::text, p.provolatile, p.proparallel, p.proisstrict,
               p.prosrc, obj_description(p.oid, 'pg_proc'),
               pg_get_function_arguments(p.oid), pg_get_function_result(p.oid), p.proacl::text
        FROM pg_proc p JOIN pg_depend d ON d.objid = p.oid
        WHERE d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'streampos')
          AND d.classid = 'pg_proc'::regclass
        ORDER BY 1
        """,
    )
    operators = rows(
        conn,
        """
        SELECT o.oid::regoperator::text, o.oprcode::text
        FROM pg_operator o JOIN pg_depend d ON d.objid = o.oid
        WHERE d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'streampos')
          AND d.classid = 'pg_operator'::regclass
        ORDER BY 1
        """,
    )
    return functions, operators


def test_updated_catalog_is_a_fresh_install(scratch_db):
    upgraded = at_010(scratch_db())
    update(upgraded)
    fresh = scratch_db()
    fresh.execute("CREATE EXTENSION streampos VERSION '0.2.0'")
    fresh.execute("SET search_path = public, streampos")
    got, want = catalog(upgraded), catalog(fresh)
    assert got[0] and got[1]
    assert got == want


def refused(conn, sqlstate, *fragments):
    with pytest.raises(psycopg.Error) as info:
        update(conn)
    err = info.value
    assert err.diag.sqlstate == sqlstate, str(err)
    for fragment in fragments:
        assert fragment in str(err), str(err)
    # Nothing changed: still 0.1.0.
    assert one(conn, "SELECT extversion FROM pg_extension WHERE extname = 'streampos'") == "0.1.0"


def test_update_refuses_a_range_type_over_room_tokens(scratch_db):
    conn = at_010(scratch_db())
    conn.execute("CREATE TYPE token_range AS RANGE (subtype = streampos.room_stream_token)")
    refused(conn, "55000", "range type public.token_range")


def test_update_refuses_range_partitioning_on_room_tokens(scratch_db):
    conn = at_010(scratch_db())
    conn.execute("CREATE TABLE parted (t room_stream_token) PARTITION BY RANGE (t)")
    refused(conn, "55000", "parted", "range-partitioned")


def test_update_refuses_a_stored_generated_column_comparing_room_tokens(scratch_db):
    conn = at_010(scratch_db())
    conn.execute(
        "CREATE TABLE gen (t room_stream_token, "
        "early boolean GENERATED ALWAYS AS (t < 's10'::room_stream_token) STORED)"
    )
    refused(conn, "55000", "column early of table public.gen")


def test_update_rechecks_check_constraints(scratch_db):
    conn = at_010(scratch_db())
    # Holds in the new order: the update goes through.
    conn.execute("CREATE TABLE ok (t room_stream_token CHECK (t < 's100'))")
    conn.execute("INSERT INTO ok VALUES ('t1-5'), ('s7')")
    # 't1-5' < 's3' held in 0.1.0's order (historical tokens first), not in
    # 0.2.0's (stream 5 > 3). The library loaded is 0.2.0's, so the row is
    # written first and the constraint marked valid as 0.1.0 would have.
    conn.execute("CREATE TABLE bad (t room_stream_token)")
    conn.execute("INSERT INTO bad VALUES ('t1-5')")
    conn.execute("ALTER TABLE bad ADD CONSTRAINT early CHECK (t < 's3') NOT VALID")
    conn.execute("UPDATE pg_constraint SET convalidated = true WHERE conname = 'early'")
    refused(conn, "23514", "bad", "early")
    conn.execute("DELETE FROM bad")
    update(conn)


def test_untyped_token_parameters_are_multi_writer_tokens(db):
    """Issue 32: a driver that sends parameters untyped (psycopg 3 sends a
    str so) called is_before_or_eq($1, $2) or instance_pos($1, 'w2') and
    got 42725 (an overload for each token type). The multi-writer token is
    its category's preferred type: an unknown argument is one. A room token
    is cast."""
    assert db.execute("SELECT streampos.is_before_or_eq(%s, %s)", ("m5~1.7", "m6~1.7")).fetchone()[0] is True
    assert db.execute("SELECT streampos.instance_pos(%s, 1)", ("m5~1.7",)).fetchone()[0] == 7
    assert db.execute("SELECT streampos.advance(%s, %s)::text", ("5", "m3~1.9")).fetchone()[0] == "m5~1.9"
    assert db.execute("SELECT streampos.max_stream_pos(%s)", ("m5~1.7",)).fetchone()[0] == 7
    assert db.execute("SELECT pg_typeof(streampos.bound(%s, 6))::text", ("m5~1.7",)).fetchone()[0] == (
        "streampos.multi_writer_token"
    )
    assert db.execute(
        "SELECT streampos.is_before_or_eq(%s::streampos.room_stream_token, %s)", ("s5", "t3-6")
    ).fetchone()[0] is True
    with pytest.raises(psycopg.errors.InvalidTextRepresentation):
        db.execute("SELECT streampos.is_before_or_eq(%s, %s)", ("s5", "s6"))
