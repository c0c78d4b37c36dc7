"""Untrusted objects (docs/contract.md, "Privileges"; docs/design.md,
"Untrusted objects"): a privileged caller (the superuser, the homeserver's
role, a follower) never runs code that another role chose, and no
statement PUBLIC can run makes an adoption, an allocation or a drop wait
without bound.

The attacker is a LOGIN role with only CREATE on schema public (what a
database owner grants, and what PostgreSQL before 15 gave everyone). Every
function it plants records current_user and session_user in a table it
owns (spy_log); each test asserts that nothing but the attacker was ever
recorded, and that the privileged call skipped the object or refused it
with the documented SQLSTATE. Every test here failed on 0.2.0 unless its
docstring says WITHSTANDS (an attack of the review that found nothing,
kept so that a change cannot open it).
"""

import os
import subprocess
import threading
import time
import uuid

import psycopg
import pytest

import support
from support import (
    PG_BIN,
    PGDATA,
    commit_ids,
    connect_raw,
    conninfo_string,
    create_stream,
    ensure_login_role,
    expect_error,
    in_flight,
    one,
    rows,
    scratch_database,
    wait_until,
)

ATTACKER = "streampos_untrusted"
HOMESERVER = "streampos_untrusted_hs"
READER = "streampos_untrusted_reader"

# The attacker's spy: spy() records who runs it; spy_immutable() is the same
# declared IMMUTABLE, so that the planner folds a call with constant
# arguments (index expressions and predicates, CHECK constraints used for
# constraint exclusion) while it plans a query on the table.
SPY = """
CREATE TABLE public.spy_log (what text, who name DEFAULT current_user, session_role name DEFAULT session_user);
GRANT INSERT ON public.spy_log TO PUBLIC;
CREATE FUNCTION public.spy(what text) RETURNS boolean LANGUAGE plpgsql VOLATILE AS
    $$ BEGIN INSERT INTO public.spy_log (what) VALUES (what); RETURN true; END $$;
CREATE FUNCTION public.spy_immutable(what text) RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS
    $$ BEGIN PERFORM public.spy(what); RETURN true; END $$;
"""


@pytest.fixture(scope="module")
def roles(database):
    """The attacker, the homeserver's role and a reader: LOGIN roles with
    nothing beyond PUBLIC's privileges (each test database grants the rest)."""
    return ensure_login_role(ATTACKER), ensure_login_role(HOMESERVER), ensure_login_role(READER)


class Arena:
    """A database of its own with the extension, where the attacker and the
    homeserver's role may create in public, the homeserver's role may call
    every function of the extension, and the attacker's spy is planted."""

    def __init__(self, dbname):
        self.dbname = dbname
        self._conns = []

    def connect(self, user=None, **kwargs):
        if user:
            kwargs["user"] = user
        conn = connect_raw(self.dbname, **kwargs)
        self._conns.append(conn)
        return conn

    def close(self):
        for conn in self._conns:
            try:
                conn.close()
            except Exception:
                pass

    def spied(self):
        with connect_raw(self.dbname) as c:
            return rows(c, "SELECT what, who::text, session_role::text FROM public.spy_log")

    def assert_only_the_attacker_ran(self):
        others = [r for r in self.spied() if r[1] != ATTACKER]
        assert others == [], f"the attacker's code ran as another role: {others}"


def _arena(roles, version=None):
    name = "streampos_untrusted_" + uuid.uuid4().hex[:8]
    with scratch_database(name, extension=version is None) as dbname:
        arena = Arena(dbname)
        admin = arena.connect()
        if version is not None:
            admin.execute(f"CREATE EXTENSION streampos VERSION '{version}'")
        admin.execute(f"GRANT CREATE ON SCHEMA public TO {ATTACKER}, {HOMESERVER}")
        admin.execute(f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA streampos TO {HOMESERVER}")
        arena.connect(ATTACKER).execute(SPY)
        try:
            yield arena
        finally:
            arena.close()


@pytest.fixture
def arena(roles):
    yield from _arena(roles)


@pytest.fixture
def arena_010(roles):
    """An arena whose extension was created at 0.1.0."""
    yield from _arena(roles, version="0.1.0")


def synapse_lookalike(conn):
    """The homeserver's Synapse tables of the events stream, rows up to 5 (a
    Synapse older than ex_outlier_stream); every other stream of the map
    has no sequence here and is skipped."""
    conn.execute(
        """
        CREATE TABLE public.schema_version (version integer NOT NULL, upgraded boolean);
        INSERT INTO public.schema_version VALUES (80, true);
        CREATE TABLE public.instance_map (instance_id integer, instance_name text);
        INSERT INTO public.instance_map VALUES (1, 'master');
        CREATE TABLE public.stream_positions (stream_name text, instance_name text, stream_id bigint);
        INSERT INTO public.stream_positions VALUES ('events', 'master', 5);
        CREATE SEQUENCE public.events_stream_seq CACHE 1;
        SELECT setval('public.events_stream_seq', 5);
        CREATE TABLE public.events (stream_ordering bigint, instance_name text);
        INSERT INTO public.events SELECT g, 'master' FROM generate_series(1, 5) g;
        CREATE TABLE public.current_state_delta_stream (stream_id bigint, instance_name text);
        """
    )


def registered_tables(conn, stream):
    """The stream's registered tables, schema-qualified."""
    return {
        r[0]
        for r in rows(
            conn,
            "SELECT format('%%I.%%I', n.nspname, c.relname) FROM streampos.stream_tables t "
            "JOIN pg_class c ON c.oid = t.tbl JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE t.stream_name = %s",
            (stream,),
        )
    }


def update_rows(answer):
    """The rows of an updates() answer, without the table headers."""
    data, out, i = answer["data"], [], 0
    while i < len(data):
        count = data[i][2]
        out.extend(data[i + 1 : i + 1 + count])
        i += 1 + count
    return out


MAX = 9223372036854775807

# A table of the attacker's whose every read runs its code: a policy (with
# FORCE, its owner is subject to it too), and an index expression and a
# partial index predicate with IMMUTABLE calls the planner folds when it
# plans any query on the table.
PLANT = """
ALTER TABLE {t} ENABLE ROW LEVEL SECURITY;
ALTER TABLE {t} FORCE ROW LEVEL SECURITY;
CREATE POLICY spy ON {t} USING (public.spy('policy on {t}'));
CREATE INDEX ON {t} (({id} * public.spy_immutable('index expression on {t}')::integer));
CREATE INDEX ON {t} ({id}) WHERE public.spy_immutable('index predicate on {t}');
GRANT SELECT ON {t} TO PUBLIC;
"""


# ---------------------------------------------------------- adoption


@pytest.mark.parametrize("caller", ["superuser", "homeserver"])
def test_adopt_synapse_skips_a_planted_table_of_the_layout(arena, caller):
    """Finding 1 and 2. The attacker plants ex_outlier_stream (a table of
    the events stream an older Synapse lacks) with a row at 2^63-1, a
    row-level-security policy and an index whose predicate the planner
    folds. 0.2.0 registered it (the caller could SELECT it): the policy ran
    as the homeserver's role, the predicate as the superuser, the repair
    moved events_stream_seq to its maximum (every next_id then fails
    2200H), and updates() returned the forged row. Now it is skipped, with
    its owner in the answer: its owner is not a role the caller acts as
    (the homeserver), or cannot move the stream's sequence itself (the
    superuser adopting the homeserver's Synapse)."""
    hs = arena.connect(HOMESERVER)
    synapse_lookalike(hs)
    attacker = arena.connect(ATTACKER)
    attacker.execute(
        "CREATE TABLE public.ex_outlier_stream (event_stream_ordering bigint, instance_name text);"
        f"INSERT INTO public.ex_outlier_stream VALUES ({MAX}, 'master');"
        + PLANT.format(t="public.ex_outlier_stream", id="event_stream_ordering")
    )
    victim = hs if caller == "homeserver" else arena.connect()
    result = rows(victim, "SELECT stream, action, detail FROM streampos.adopt_synapse()")
    events = [(a, d) for s, a, d in result if s == "events"]
    assert events[0][0] == "adopted", result
    skipped = [d for a, d in events if a == "skipped" and "ex_outlier_stream" in d]
    assert len(skipped) == 1 and ATTACKER in skipped[0], result
    admin = arena.connect()
    assert registered_tables(admin, "events") == {"public.events", "public.current_state_delta_stream"}
    assert one(admin, "SELECT last_value FROM public.events_stream_seq") == 5
    for conn in (admin, hs):
        assert all(ok for _n, ok, _d in rows(conn, "SELECT * FROM streampos.check_stream('events', true)"))
        answer = one(conn, "SELECT streampos.updates('events', '0', 100)")
        assert [r[0] for r in update_rows(answer)] == [1, 2, 3, 4, 5]
    assert one(hs, "SELECT streampos.next_id('events', 'master')") == 6
    arena.assert_only_the_attacker_ran()


@pytest.mark.parametrize("caller", ["superuser", "homeserver"])
def test_adopt_synapse_skips_a_planted_sequence_of_the_layout(arena, caller):
    """Beyond the issue. The attacker plants the sequence and table of a
    stream an older Synapse lacks (presence_stream). 0.2.0 refused the
    homeserver's whole adoption (42501, not the owner of that sequence: one
    planted object blocked it) and let the superuser adopt the attacker's
    sequence as a stream the homeserver would write through. Now the stream
    is skipped, its owner named; the others are adopted."""
    hs = arena.connect(HOMESERVER)
    synapse_lookalike(hs)
    attacker = arena.connect(ATTACKER)
    attacker.execute(
        """
        CREATE SEQUENCE public.presence_stream_sequence CACHE 1;
        CREATE TABLE public.presence_stream (stream_id bigint, instance_name text);
        GRANT SELECT ON public.presence_stream TO PUBLIC;
        """
    )
    victim = hs if caller == "homeserver" else arena.connect()
    result = rows(victim, "SELECT stream, action, detail FROM streampos.adopt_synapse()")
    presence = [(a, d) for s, a, d in result if s == "presence_stream"]
    assert [a for a, _d in presence] == ["skipped"] and ATTACKER in presence[0][1], result
    assert [a for s, a, _d in result if s == "events"][0] == "adopted", result
    assert one(victim, "SELECT count(*) FROM streampos.streams WHERE stream_name = 'presence_stream'") == 0


def test_adopt_synapse_reads_a_lookalike_as_its_owner_or_not_at_all(arena):
    """Finding 3. A Synapse look-alike in public, all the attacker's, whose
    instance_map has an inheritance child with a CHECK constraint calling
    the attacker's function: planning adoption's read of instance_map (with
    constraint exclusion on the child) evaluated it, as the superuser. Now
    the homeserver's role, which cannot act as the tables' owner, is
    refused before anything is read (42501, naming the table); the
    superuser reads them as their owner, in a security-restricted operation
    (what it adopts from a schema it named is its choice)."""
    attacker = arena.connect(ATTACKER)
    attacker.execute(
        """
        CREATE TABLE public.schema_version (version integer);
        CREATE TABLE public.instance_map (instance_id integer, instance_name text);
        CREATE TABLE public.instance_map_child (CHECK (public.spy_immutable('constraint exclusion')))
            INHERITS (public.instance_map);
        CREATE TABLE public.stream_positions (stream_name text, instance_name text, stream_id bigint);
        ALTER TABLE public.stream_positions ENABLE ROW LEVEL SECURITY;
        ALTER TABLE public.stream_positions FORCE ROW LEVEL SECURITY;
        CREATE POLICY spy ON public.stream_positions USING (public.spy('policy'));
        GRANT SELECT ON ALL TABLES IN SCHEMA public TO PUBLIC;
        """
    )
    hs = arena.connect(HOMESERVER)
    err = expect_error(hs, "SELECT * FROM streampos.adopt_synapse()", sqlstate="42501")
    assert "public.schema_version" in err.diag.message_primary and ATTACKER in err.diag.message_detail, err
    assert arena.spied() == []
    admin = arena.connect()
    rows(admin, "SELECT * FROM streampos.adopt_synapse()")
    arena.assert_only_the_attacker_ran()
    assert rows(admin, "SELECT * FROM streampos.streams") == []


# ------------------------------------------------ reading registered tables


def test_a_registered_tables_code_runs_as_its_owner(arena):
    """Finding 2 (check_stream) and row-level security. A table the
    attacker owns, registered by the superuser (who may act as any role),
    gets a forced policy and a folded index predicate. 0.2.0 read it with
    the caller's privileges: the predicate ran as the superuser in
    check_stream and updates(), the policy as every other caller. Now it is
    read as its owner, restricted: the superuser's check, repair and feed
    run the attacker's code as the attacker; a caller with SELECT but
    neither the owner's privileges nor BYPASSRLS is refused (42501), since
    reading as the owner would show it rows the policy hides. While the
    policy is forced on the owner itself (FORCE ROW LEVEL SECURITY), a read
    as the owner could lack rows the policy hides from it: refused for
    every caller (42501, as pg_dump's row_security = off refuses), never a
    token past rows nobody was shown (issue 31, the adversary of 0.4.0)."""
    admin = arena.connect()
    create_stream(admin, "s")
    attacker = arena.connect(ATTACKER)
    attacker.execute("CREATE TABLE public.att_rows (id bigint, instance_name text); GRANT SELECT ON public.att_rows TO PUBLIC")
    admin.execute("SELECT streampos.add_table('s', 'public.att_rows', 'id', 'instance_name')")
    commit_ids(admin, "s", "w", 3)
    attacker.execute("INSERT INTO public.att_rows VALUES (1, 'w'), (2, 'w'), (3, 'w')")
    attacker.execute(PLANT.format(t="public.att_rows", id="id"))
    for sql in ("SELECT streampos.updates('s', '0')", "SELECT * FROM streampos.check_stream('s')"):
        err = expect_error(admin, sql, sqlstate="42501")
        assert err.diag.message_primary == 'query would be affected by row-level security policy for table "att_rows"'
    attacker.execute("ALTER TABLE public.att_rows NO FORCE ROW LEVEL SECURITY")
    assert all(ok for _n, ok, _d in rows(admin, "SELECT * FROM streampos.check_stream('s')"))
    assert all(ok for _n, ok, _d in rows(admin, "SELECT * FROM streampos.check_stream('s', true)"))
    assert [r[0] for r in update_rows(one(admin, "SELECT streampos.updates('s', '0')"))] == [1, 2, 3]
    for role in (HOMESERVER, READER):
        c = arena.connect(role)
        expect_error(c, "SELECT streampos.updates('s', '0')", sqlstate="42501")
        err = expect_error(c, "SELECT * FROM streampos.check_stream('s')", sqlstate="42501")
        assert "row-level security" in err.diag.message_primary, err
    arena.assert_only_the_attacker_ran()
    assert {r[1] for r in arena.spied()} == {ATTACKER}  # it did run, as its owner


def test_updates_converts_other_roles_types_without_their_casts(arena):
    """Finding 4. The homeserver's table has columns of types the attacker
    owns: an enum with casts to json and to text, an array of it, a domain
    over it, a composite type and a range type. 0.2.0's to_jsonb looked the
    cast to json up and ran it as every follower, the superuser included.
    Now a column whose type is not built in (through domains and array
    elements) comes out as its output function's text, and built-in types
    exactly as to_jsonb makes them."""
    attacker = arena.connect(ATTACKER)
    attacker.execute(
        """
        CREATE TYPE public.mood AS ENUM ('happy', 'sad');
        CREATE FUNCTION public.mood_json(public.mood) RETURNS json LANGUAGE plpgsql AS
            $$ BEGIN PERFORM public.spy('cast to json'); RETURN '"forged"'::json; END $$;
        CREATE CAST (public.mood AS json) WITH FUNCTION public.mood_json(public.mood);
        CREATE FUNCTION public.mood_text(public.mood) RETURNS text LANGUAGE plpgsql AS
            $$ BEGIN PERFORM public.spy('cast to text'); RETURN 'forged'; END $$;
        CREATE CAST (public.mood AS text) WITH FUNCTION public.mood_text(public.mood);
        CREATE DOMAIN public.mood_d AS public.mood;
        CREATE TYPE public.pair AS (m public.mood, n integer);
        CREATE FUNCTION public.pair_json(public.pair) RETURNS json LANGUAGE plpgsql AS
            $$ BEGIN PERFORM public.spy('composite cast to json'); RETURN '"forged"'::json; END $$;
        CREATE CAST (public.pair AS json) WITH FUNCTION public.pair_json(public.pair);
        CREATE FUNCTION public.diff(bigint, bigint) RETURNS float8 LANGUAGE plpgsql IMMUTABLE AS
            $$ BEGIN PERFORM public.spy('subtype_diff'); RETURN $1 - $2; END $$;
        CREATE TYPE public.span AS RANGE (subtype = bigint, subtype_diff = public.diff);
        """
    )
    hs = arena.connect(HOMESERVER)
    create_stream(hs, "s")
    hs.execute(
        "CREATE TABLE public.moods (id bigint, instance_name text, m public.mood, ms public.mood[], "
        "md public.mood_d, p public.pair, r public.span, n integer, j jsonb, t timestamptz, a integer[])"
    )
    hs.execute("GRANT SELECT ON public.moods TO PUBLIC")
    hs.execute("SELECT streampos.add_table('s', 'public.moods', 'id', 'instance_name')")
    hs.execute(
        "INSERT INTO public.moods SELECT streampos.next_id('s', 'w'), 'w', 'happy', '{happy,sad}', 'sad', "
        "'(sad,2)', '[1,5)', 7, '{\"a\": [1, 2.50]}', '2024-01-02 03:04:05+00', '{1,NULL,3}'"
    )
    hs.execute("INSERT INTO public.moods (id, instance_name) SELECT streampos.next_id('s', 'w'), 'w'")
    for role in (None, HOMESERVER, READER):
        c = arena.connect(role)
        c.execute("SET TimeZone = 'UTC'")
        answer = one(c, "SELECT streampos.updates('s', '0')")
        assert answer["data"][0][4:] == ["id", "instance_name", "m", "ms", "md", "p", "r", "n", "j", "t", "a"]
        assert update_rows(answer) == [
            [1, "w", "happy", "{happy,sad}", "sad", "(sad,2)", "[1,5)", 7, {"a": [1, 2.50]},
             "2024-01-02T03:04:05+00:00", [1, None, 3]],
            [2, "w", None, None, None, None, None, None, None, None, None],
        ]
    arena.assert_only_the_attacker_ran()


def test_a_table_turned_into_a_view_in_place_is_refused_not_read(arena):
    """Finding 4. A registered table of the attacker's, emptied and turned
    into a view with CREATE RULE "_RETURN" (same OID): 0.2.0's check_stream
    read the view as the superuser (running the attacker's code) and its
    repair moved the sequence to the view's 2^63-1. Now a registered
    relation must still be a table at every use: check_stream reports it,
    updates() skips it, add_table refuses a view (42809)."""
    admin = arena.connect()
    create_stream(admin, "s")
    commit_ids(admin, "s", "w", 2)
    attacker = arena.connect(ATTACKER)
    attacker.execute("CREATE TABLE public.att_rows (id bigint, instance_name text); GRANT SELECT ON public.att_rows TO PUBLIC")
    admin.execute("SELECT streampos.add_table('s', 'public.att_rows', 'id', 'instance_name')")
    rule = (
        'CREATE RULE "_RETURN" AS ON SELECT TO public.att_rows DO INSTEAD '
        f"SELECT {MAX}::bigint AS id, 'w'::text AS instance_name WHERE public.spy('view')"
    )
    if attacker.info.server_version >= 160000:
        # PostgreSQL 16 and later refuse to turn a table into a view.
        expect_error(attacker, rule, sqlstate="42809")
        return
    attacker.execute(rule)
    assert one(admin, "SELECT relkind FROM pg_class WHERE oid = 'public.att_rows'::regclass") == "v"
    checks = rows(admin, "SELECT * FROM streampos.check_stream('s', true)")
    bad = [(n, d) for n, ok, d in checks if not ok]
    assert len(bad) == 1 and "is a view now, not a table" in bad[0][1], checks
    assert not [d for n, _ok, d in checks if n == "repair" and "moved" in d], checks
    assert one(admin, "SELECT streampos.max_allocated('s')") == 2
    assert update_rows(one(admin, "SELECT streampos.updates('s', '0')")) == []
    expect_error(admin, "SELECT streampos.add_table('s', 'public.att_rows', 'id')", sqlstate="42809")
    arena.assert_only_the_attacker_ran()
    assert arena.spied() == []


def test_add_table_registers_only_tables_the_caller_acts_as_the_owner_of(arena):
    """Registration is for a role that may act as the table's owner
    (42501): the homeserver's role could register any table it could
    SELECT in 0.2.0, and every later read of it ran the owner's code with a
    reader's privileges."""
    hs = arena.connect(HOMESERVER)
    create_stream(hs, "s")
    attacker = arena.connect(ATTACKER)
    attacker.execute("CREATE TABLE public.att_rows (id bigint, instance_name text); GRANT SELECT ON public.att_rows TO PUBLIC")
    err = expect_error(hs, "SELECT streampos.add_table('s', 'public.att_rows', 'id')", sqlstate="42501")
    assert "must be owner of table public.att_rows" in err.diag.message_primary, err
    assert rows(hs, "SELECT * FROM streampos.stream_tables") == []


def test_id_and_instance_columns_of_other_roles_types_are_refused(arena):
    """Beyond the issue. updates() compares the ID column and casts the
    instance column to text: for a type the attacker owns, its cast to text
    (and operators) would run in every follower's read. add_table refuses
    a column whose type is not built in (42804); a column changed to such a
    type later makes the table unusable (check_stream says so, updates()
    skips it) rather than read."""
    attacker = arena.connect(ATTACKER)
    attacker.execute(
        """
        CREATE TYPE public.who AS ENUM ('w', 'x');
        CREATE FUNCTION public.who_text(public.who) RETURNS text LANGUAGE plpgsql AS
            $$ BEGIN PERFORM public.spy('cast to text'); RETURN 'w'; END $$;
        CREATE CAST (public.who AS text) WITH FUNCTION public.who_text(public.who) AS IMPLICIT;
        """
    )
    hs = arena.connect(HOMESERVER)
    create_stream(hs, "s")
    hs.execute("CREATE TABLE public.rows_a (id bigint, instance_name public.who)")
    expect_error(hs, "SELECT streampos.add_table('s', 'public.rows_a', 'id', 'instance_name')", sqlstate="42804")
    hs.execute("CREATE TABLE public.rows_b (id bigint, instance_name text)")
    hs.execute("SELECT streampos.add_table('s', 'public.rows_b', 'id', 'instance_name')")
    hs.execute("INSERT INTO public.rows_b SELECT streampos.next_id('s', 'w'), 'w'")
    hs.execute("ALTER TABLE public.rows_b ALTER COLUMN instance_name TYPE public.who USING instance_name::public.who")
    admin = arena.connect()
    bad = [d for _n, ok, d in rows(admin, "SELECT * FROM streampos.check_stream('s')") if not ok]
    assert len(bad) == 1 and "not a built-in type" in bad[0], bad
    assert update_rows(one(admin, "SELECT streampos.updates('s', '0')")) == []
    arena.assert_only_the_attacker_ran()
    assert arena.spied() == []


def test_a_follower_needs_select_on_every_column_it_is_sent(arena):
    """Reading as the owner must not widen what a follower sees: updates()
    sends every column, so it needs SELECT on each (a grant on some columns
    is 42501), checked before it waits (0.2.0 made a refused follower wait
    out its timeout first); check_stream needs the ID column only."""
    hs = arena.connect(HOMESERVER)
    create_stream(hs, "s")
    hs.execute("CREATE TABLE public.secret (id bigint, instance_name text, body text)")
    hs.execute("SELECT streampos.add_table('s', 'public.secret', 'id', 'instance_name')")
    hs.execute("INSERT INTO public.secret SELECT streampos.next_id('s', 'w'), 'w', 'hidden'")
    hs.execute(f"GRANT SELECT (id, instance_name) ON public.secret TO {READER}")
    reader = arena.connect(READER)
    started = time.monotonic()
    expect_error(reader, "SELECT streampos.updates('s', '1', timeout_ms => 3000)", sqlstate="42501")
    assert time.monotonic() - started < 2, "the refused follower waited first"
    assert all(ok for _n, ok, _d in rows(reader, "SELECT * FROM streampos.check_stream('s')"))
    hs.execute(f"GRANT SELECT (body) ON public.secret TO {READER}")
    assert update_rows(one(reader, "SELECT streampos.updates('s', '0')")) == [[1, "w", "hidden"]]


def test_a_long_polling_follower_holds_no_lock_on_the_streams_tables(arena, pool):
    """WITHSTANDS (written with the checks a follower makes before it
    waits). A follower's privileges are checked before it sleeps, without
    locking the stream's tables: a sleeping follower holding ACCESS SHARE
    would make DDL on them wait, and writers queue behind the DDL."""
    hs = arena.connect(HOMESERVER)
    create_stream(hs, "s")
    hs.execute("CREATE TABLE public.s_rows (id bigint, instance_name text)")
    hs.execute("SELECT streampos.add_table('s', 'public.s_rows', 'id', 'instance_name')")
    hs.execute(f"GRANT SELECT ON public.s_rows TO {READER}")
    reader = arena.connect(READER)
    follower = pool.submit(one, reader, "SELECT streampos.updates('s', '0', 10, 3000)")
    time.sleep(0.5)
    hs.execute("SET lock_timeout = '1s'")
    hs.execute("ALTER TABLE public.s_rows ADD COLUMN body text")
    assert not follower.done()
    assert update_rows(follower.result(timeout=10)) == []


# ------------------------------------------------------------ the upgrade


def test_the_update_from_010_never_evaluates_another_roles_expressions(arena_010):
    """Finding 5. At 0.1.0 the attacker owns a table with CHECK (spy() AND
    tok < 's100') on a room token column, a domain with such a CHECK, a
    table range-partitioned on room tokens, a range type over them, a
    stored generated column comparing them, an index whose predicate the
    planner folds, a plain index on a table it keeps locked, and a
    temporary table with a token index in a session it keeps open. 0.2.0's
    update ran the CHECK's text as the superuser, and refused the update
    (55000) over the partitioned table, the domain, the range type and the
    generated column: one unprivileged object blocked every upgrade. Now the
    update goes through, evaluates none of them, and names each in a
    WARNING."""
    arena = arena_010
    attacker = arena.connect(ATTACKER)
    attacker.execute("SET search_path = public, streampos")
    attacker.execute(
        """
        CREATE TABLE public.att_tokens (tok streampos.room_stream_token
            CHECK (public.spy('check') AND tok < 's100'::streampos.room_stream_token));
        INSERT INTO public.att_tokens VALUES ('s5'), ('t1-200');
        CREATE INDEX att_tokens_folded ON public.att_tokens (tok) WHERE public.spy_immutable('index predicate');
        CREATE DOMAIN public.att_tok AS streampos.room_stream_token
            CHECK (public.spy('domain') AND VALUE < 's100'::streampos.room_stream_token);
        CREATE TABLE public.att_domain (tok public.att_tok);
        CREATE INDEX att_domain_tok ON public.att_domain (tok);
        CREATE TABLE public.att_parted (tok streampos.room_stream_token) PARTITION BY RANGE (tok);
        CREATE TABLE public.att_part1 PARTITION OF public.att_parted FOR VALUES FROM ('s1') TO ('s100');
        CREATE INDEX att_parted_tok ON public.att_parted (tok);
        CREATE TYPE public.att_range AS RANGE (subtype = streampos.room_stream_token);
        CREATE TABLE public.att_gen (tok streampos.room_stream_token,
            early boolean GENERATED ALWAYS AS (tok < 's10'::streampos.room_stream_token) STORED);
        """
    )
    spied_before = arena.spied()
    # A temporary table of a session that stays, and a lock held on a table
    # whose plain token index the update rebuilds.
    keeper = arena.connect(ATTACKER)
    keeper.execute("SET search_path = public, streampos")
    keeper.execute("CREATE TEMP TABLE att_temp (tok streampos.room_stream_token)")
    keeper.execute("CREATE INDEX att_temp_tok ON att_temp (tok)")
    keeper.execute("BEGIN")
    keeper.execute("LOCK TABLE public.att_domain IN ROW EXCLUSIVE MODE")
    admin = arena.connect()
    warnings = []
    admin.add_notice_handler(lambda d: warnings.append(d.message_primary or ""))
    admin.execute("SET lock_timeout = '30s'")
    started = time.monotonic()
    admin.execute("ALTER EXTENSION streampos UPDATE")
    took = time.monotonic() - started
    keeper.execute("ROLLBACK")
    assert one(admin, "SELECT extversion FROM pg_extension WHERE extname = 'streampos'") == support.EXTENSION_VERSION
    assert took < 20, took
    text = "\n".join(warnings)
    for fragment in [
        'check constraint "att_tokens_tok_check"',
        "att_parted",
        "att_range",
        "column early of table",
        "att_tok_check",
        "att_tokens_folded",
        "att_domain_tok",
        "temporary table",
    ]:
        assert fragment in text, (fragment, warnings)
    assert arena.spied() == spied_before
    arena.assert_only_the_attacker_ran()
    # The partitioned index's partition was rebuilt: it has no expression.
    assert "att_part1" not in text, warnings


# ------------------------------------------------------------ clients


def test_the_python_clients_start_up_repair_is_not_a_default(arena):
    """Finding 6. A writer's generator repaired the stream at start-up by
    default: with a table of the attacker's registered (by the superuser),
    the repair ran its policy as the homeserver's role and moved the
    sequence to the planted 10^12. Now a repair is an operator's action
    (repair=True); the default start reads nothing of the tables."""
    from streampos import SyncMultiWriterIdGenerator

    hs = arena.connect(HOMESERVER)
    create_stream(hs, "s", writers=["master"])
    attacker = arena.connect(ATTACKER)
    attacker.execute(
        "CREATE TABLE public.att_rows (id bigint, instance_name text);"
        "INSERT INTO public.att_rows VALUES (1000000000000, 'master');"
        + PLANT.format(t="public.att_rows", id="id")
    )
    arena.connect().execute("SELECT streampos.add_table('s', 'public.att_rows', 'id', 'instance_name')")
    gen = SyncMultiWriterIdGenerator(
        conninfo_string(arena.dbname), stream_name="s", instance_name="master", user=HOMESERVER
    )
    try:
        with gen.get_next() as stream_id:
            assert stream_id == 1
    finally:
        gen.close()
    assert one(hs, "SELECT streampos.max_allocated('s')") == 1
    arena.assert_only_the_attacker_ran()


# ------------------------------------------------------------ locks


def _locks_of(conn, pid):
    return rows(
        conn,
        "SELECT c.relname, l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
        "WHERE l.pid = %s AND c.relnamespace = 'streampos'::regnamespace ORDER BY 1",
        (pid,),
    )


def test_a_prepared_insert_into_the_catalog_stalls_no_adoption_or_allocation(arena, pool):
    """Also found. Parse analysis of a statement PUBLIC may PREPARE takes its
    lock before the privilege check: a transaction kept open after PREPARE
    INSERT INTO streampos.instances held ROW EXCLUSIVE, and adopt_synapse()
    (which locked the catalog SHARE ROW EXCLUSIVE) waited for it, with
    next_id of a new writer name queued behind. The catalog lock is now an
    advisory lock in the extension's own key space: nothing waits."""
    hs = arena.connect(HOMESERVER)
    synapse_lookalike(hs)
    attacker = arena.connect(ATTACKER)
    attacker.execute("BEGIN")
    attacker.execute("PREPARE p1 AS INSERT INTO streampos.instances (instance_name) VALUES ('squatter')")
    attacker.execute("PREPARE p2 AS DELETE FROM streampos.streams")
    attacker.execute("PREPARE p3 AS UPDATE streampos.stream_tables SET id_column = 'x'")
    attacker.execute("PREPARE p4 AS DELETE FROM streampos.stream_positions")
    admin = arena.connect()
    held = _locks_of(admin, one(attacker, "SELECT pg_backend_pid()"))
    assert ("instances", "RowExclusiveLock") in held and ("streams", "RowExclusiveLock") in held, held
    try:
        # Under 0.2.0 both waited for the attacker until this lock_timeout.
        hs.execute("SET lock_timeout = '3s'")
        adopt = pool.submit(rows, hs, "SELECT * FROM streampos.adopt_synapse()")
        # One after the other: a new writer's name created first would take
        # instance id 1, which the adoption must import as Synapse's.
        assert any(a == "adopted" for _s, a, _d in adopt.result(timeout=10))
        writer = arena.connect()
        writer.execute("SET lock_timeout = '3s'")
        create_stream(writer, "other")
        allocated = pool.submit(one, writer, "SELECT streampos.next_id('other', 'a_new_writer')")
        assert allocated.result(timeout=10) == 1
        writer.execute("SELECT streampos.drop_stream('other')")
    finally:
        attacker.execute("ROLLBACK")


def test_objects_other_roles_hang_on_a_streams_sequence_do_not_stop_its_drop(arena):
    """Also found. A temporary view over a stream's sequence, or a column
    DEFAULT nextval() of it, needs no privilege on it: 0.2.0's drop_stream
    then failed (2BP01) for as long as the attacker liked. Now the drop
    takes them with it (NOTICEs name them); the attacker's table stays,
    without its default."""
    hs = arena.connect(HOMESERVER)
    seq = create_stream(hs, "s")
    attacker = arena.connect(ATTACKER)
    attacker.execute(f"CREATE TEMP VIEW att_view AS SELECT last_value FROM {seq}")
    attacker.execute(f"CREATE TABLE public.att_t (x bigint DEFAULT nextval('{seq}'), y int)")
    notices = []
    hs.add_notice_handler(lambda d: notices.append(f"{d.message_primary} {d.message_detail}"))
    hs.execute("SELECT streampos.drop_stream('s')")
    assert rows(hs, "SELECT * FROM streampos.streams") == []
    assert one(hs, "SELECT count(*) FROM pg_class WHERE relname = 'att_view'") == 0
    assert rows(hs, "SELECT 1 FROM pg_attrdef WHERE adrelid = 'public.att_t'::regclass") == []
    assert any("att_view" in n for n in notices), notices


def test_a_lock_on_a_streams_sequence_stalls_writers_only_as_long_as_the_bound(arena, pool):
    """Also found. Any role may hold a lock on a stream's sequence (PREPARE
    of a SELECT, or of an UPDATE, on it locks before the privilege check):
    drop_stream (and a repair) then waited without bound, and every writer
    of the stream queued behind it. Now their lock waits are bounded (5 s,
    or lock_timeout if shorter): past it, 55P03 naming the sequence, and
    the writers go on."""
    hs = arena.connect(HOMESERVER)
    seq = create_stream(hs, "s")
    hs.execute("CREATE TABLE public.s_rows (id bigint)")
    hs.execute("SELECT streampos.add_table('s', 'public.s_rows', 'id')")
    hs.execute("INSERT INTO public.s_rows VALUES (10)")  # a repair would move the sequence
    attacker = arena.connect(ATTACKER)
    attacker.execute("BEGIN")
    attacker.execute(f"PREPARE q AS UPDATE {seq} SET last_value = 1")
    try:
        dropper = arena.connect(HOMESERVER)
        started = time.monotonic()
        drop = pool.submit(dropper.execute, "SELECT streampos.drop_stream('s')")
        time.sleep(0.5)
        writer = arena.connect(HOMESERVER)
        allocated = pool.submit(one, writer, "SELECT streampos.next_id('s', 'w')")
        with pytest.raises(psycopg.errors.LockNotAvailable) as info:
            drop.result(timeout=15)
        assert seq in info.value.diag.message_primary and info.value.diag.message_hint, info.value
        assert 4 < time.monotonic() - started < 8
        assert allocated.result(timeout=5) == 1
        hs.execute("SET lock_timeout = '500ms'")
        started = time.monotonic()
        err = expect_error(hs, "SELECT * FROM streampos.check_stream('s', true)", sqlstate="55P03")
        assert seq in err.diag.message_primary, err
        assert time.monotonic() - started < 2
    finally:
        attacker.execute("ROLLBACK")
    hs.execute("SELECT streampos.drop_stream('s')")


def test_a_locked_dependent_of_a_streams_sequence_bounds_drop_stream(arena):
    """Also found (with the drop above). The attacker's temporary view over
    the sequence, read in a transaction it keeps open: the drop must lock
    the view too, and fails (55P03) after the bound instead of waiting."""
    hs = arena.connect(HOMESERVER)
    seq = create_stream(hs, "s")
    attacker = arena.connect(ATTACKER)
    attacker.execute(f"CREATE TEMP VIEW att_view AS SELECT last_value FROM {seq}")
    attacker.execute("BEGIN")
    attacker.execute("LOCK TABLE att_view IN ACCESS SHARE MODE")
    try:
        hs.execute("SET lock_timeout = '500ms'")
        err = expect_error(hs, "SELECT streampos.drop_stream('s')", sqlstate="55P03")
        assert seq in err.diag.message_primary, err
    finally:
        attacker.execute("ROLLBACK")
    hs.execute("SELECT streampos.drop_stream('s')")


# ------------------------------------------------------------ notifications


def test_a_listener_tells_the_position_workers_notifications_from_forged_ones(arena):
    """Also found. Any role may NOTIFY streampos with a payload that looks
    like the worker's. The documented recipe (README, "LISTEN/NOTIFY?"): a
    notification is a hint to read positions again, never a position; and
    streampos.is_position_worker(sender pid) tells the worker's from the
    others (pg_stat_activity hides other roles' backend types)."""
    admin = arena.connect()
    create_stream(admin, "s")
    listener = arena.connect(READER)
    received = []
    listener.add_notify_handler(received.append)
    listener.execute("LISTEN streampos")
    attacker = arena.connect(ATTACKER)
    attacker.execute("NOTIFY streampos, 's s9223372036854775000'")
    commit_ids(admin, "s", "w")

    def from_the_worker():
        listener.execute("SELECT 1")  # receives what arrived meanwhile
        return [
            n for n in received
            if n.payload == "s 1" and one(listener, "SELECT streampos.is_position_worker(%s)", (n.pid,))
        ]

    wait_until(from_the_worker, timeout=10, interval=0.1, message="the position worker's notification")
    genuine = {n.payload: one(listener, "SELECT streampos.is_position_worker(%s)", (n.pid,)) for n in received}
    assert genuine.get("s s9223372036854775000") is False, genuine
    assert genuine.get("s 1") is True, genuine
    # The recipe: whatever the payload, the position is read again.
    assert one(listener, "SELECT streampos.current_token('s')::text") == "1"
    assert one(listener, "SELECT streampos.is_position_worker(pg_backend_pid())") is False


# ------------------------------------------------------------ backtraces


@pytest.mark.restarts_server
def test_no_rust_backtrace_reaches_a_client_whatever_the_servers_environment(arena):
    """Also found. With RUST_BACKTRACE=1 in the server's environment, a
    PostgreSQL ERROR raised inside the extension's Rust code (here a
    statement timeout while a PUBLIC role waits in wait_for) reached the
    client with a Rust backtrace as its DETAIL. The library turns the
    standard library's capture off when it loads."""
    if not PGDATA:
        pytest.skip("STREAMPOS_PGDATA is not set: cannot restart the server")
    admin = arena.connect()
    create_stream(admin, "s")
    arena.close()
    support.stop_server("fast")
    env = dict(os.environ, RUST_BACKTRACE="1")
    env.pop("RUST_LIB_BACKTRACE", None)
    cmd = support._as_postgres(
        [os.path.join(PG_BIN, "pg_ctl"), "-D", PGDATA, "-l", os.path.join(PGDATA, "server.log"), "-w", "-t", "60", "start"]
    )
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=120)
    try:
        support.wait_for_server()
        with connect_raw(arena.dbname) as holder, connect_raw(arena.dbname, user=READER) as reader:
            holder.execute("BEGIN")
            held = one(holder, "SELECT streampos.next_id('s', 'w')")
            reader.execute("SET statement_timeout = '300ms'")
            err = expect_error(reader, "SELECT streampos.wait_for('s', %s, 5000)", (held,), sqlstate="57014")
            detail = err.diag.message_detail or ""
            assert "panic" not in detail and "backtrace" not in detail and ".rs:" not in detail, detail
            holder.execute("ROLLBACK")
    finally:
        support.restart_server("fast")


# ------------------------------------------- the caller's session (issue 31)

# A table owner's code that tries to change the session of whoever reads
# its table: settings (with set_config and with SET, the path among them),
# session-level advisory locks, a temporary table, a prepared statement and
# LISTEN (the last three are refused inside a security-restricted
# operation; each attempt is caught so the others still run). It runs in an
# IMMUTABLE partial index predicate, which the planner folds whenever it
# plans a query on the table, and in an index expression.
SESSION_TRAP = """
CREATE FUNCTION public.now() RETURNS timestamptz LANGUAGE plpgsql VOLATILE AS
    $$ BEGIN PERFORM public.spy('public.now() ran'); RETURN '2000-01-01'; END $$;
CREATE FUNCTION public.session_trap_volatile(what text) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM public.spy(what);
    PERFORM pg_catalog.set_config('search_path', 'public, pg_catalog', false);
    PERFORM pg_catalog.set_config('work_mem', '1234kB', false);
    PERFORM pg_catalog.set_config('trap.planted', 'planted', false);
    SET statement_timeout = '4321s';
    -- Refused (42501) inside streampos functions; caught here so that the
    -- trap goes on.
    BEGIN PERFORM pg_catalog.pg_try_advisory_lock(4242); EXCEPTION WHEN insufficient_privilege THEN NULL; END;
    BEGIN PERFORM pg_catalog.pg_try_advisory_lock_shared(42, 43); EXCEPTION WHEN insufficient_privilege THEN NULL; END;
    BEGIN PERFORM pg_catalog.pg_advisory_xact_lock(4244); EXCEPTION WHEN insufficient_privilege THEN NULL; END;
    BEGIN PERFORM pg_catalog.pg_advisory_unlock_all(); EXCEPTION WHEN insufficient_privilege THEN NULL; END;
    BEGIN PERFORM pg_catalog.setseed(0.5); EXCEPTION WHEN insufficient_privilege THEN NULL; END;
    BEGIN EXECUTE 'CREATE TEMP TABLE trap_temp (x int)'; EXCEPTION WHEN OTHERS THEN NULL; END;
    BEGIN EXECUTE 'PREPARE trap_stmt AS SELECT 1'; EXCEPTION WHEN OTHERS THEN NULL; END;
    BEGIN EXECUTE 'LISTEN trap_channel'; EXCEPTION WHEN OTHERS THEN NULL; END;
    RETURN true;
END $$;
CREATE FUNCTION public.session_trap(what text) RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS
    $$ BEGIN RETURN public.session_trap_volatile(what); END $$;
"""


def session_state(conn):
    """What of a session another role's code could change: settings, the
    session's advisory locks, temporary tables, prepared statements,
    channels listened to."""
    return {
        "settings": rows(
            conn,
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('search_path', 'work_mem', 'statement_timeout', 'role', 'session_authorization') ORDER BY 1",
        ),
        # A custom name set_config() used stays defined with no value once
        # the nest level is discarded (as after VACUUM): empty or missing.
        "custom": one(conn, "SELECT current_setting('trap.planted', true)") or None,
        "advisory": rows(
            conn,
            "SELECT classid, objid, objsubid, mode FROM pg_locks "
            "WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND objsubid IN (1, 2) ORDER BY 1, 2, 3, 4",
        ),
        "temp": one(conn, "SELECT count(*) FROM pg_class WHERE relpersistence = 't' AND relname = 'trap_temp'"),
        "prepared": rows(conn, "SELECT name FROM pg_prepared_statements ORDER BY 1"),
        "listening": rows(conn, "SELECT pg_listening_channels()"),
        "user": one(conn, "SELECT current_user::text"),
    }


@pytest.mark.parametrize("caller", [None, READER])
def test_a_table_owners_code_leaves_nothing_in_the_callers_session(arena, caller):
    """Issue 31, finding 2 (an escalation). A partial index predicate of
    the homeserver's table set search_path with set_config(…, false); the
    superuser's check_stream() and a follower's updates() kept it, and the
    caller's next plain `SELECT now()` ran the homeserver's public.now() as
    the caller. The switch to the owner now opens a GUC nest level with the
    restricted search path and discards it (as VACUUM does), and refuses
    the functions that change the session directly (advisory locks taken or
    released, setseed). Every function
    a caller can reach that reads the table is tried, each in a session that
    held settings and advisory locks of its own before the call."""
    admin = arena.connect()
    hs = arena.connect(HOMESERVER)
    hs.execute(SESSION_TRAP)
    create_stream(hs, "s")
    hs.execute("CREATE TABLE public.hs_rows (id bigint, instance_name text)")
    hs.execute("GRANT SELECT ON public.hs_rows TO PUBLIC")
    hs.execute("SELECT streampos.add_table('s', 'public.hs_rows', 'id', 'instance_name')")
    hs.execute("INSERT INTO public.hs_rows SELECT streampos.next_id('s', 'w'), 'w' FROM generate_series(1, 3)")
    hs.execute("CREATE INDEX ON public.hs_rows (id) WHERE public.session_trap('index predicate')")
    hs.execute("CREATE INDEX ON public.hs_rows ((id * public.session_trap('index expression')::int))")
    hs.execute("SELECT streampos.register_consumer('s', 'c')")
    hs.execute("SELECT pg_advisory_unlock_all()")  # what its own code took in its own session
    if caller is not None:
        admin.execute(f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA streampos TO {caller}")
    calls = [
        "SELECT streampos.updates('s', '0')",
        "SELECT streampos.updates('s', '0', 1, 0)",
        "SELECT count(*) FROM streampos.check_stream('s')",
        "SELECT streampos.frontier('s')",
    ]
    if caller is None:
        calls.append("SELECT count(*) FROM streampos.check_stream('s', true)")
    for call in calls:
        c = arena.connect(caller)
        c.execute("SET work_mem = '7MB'")
        c.execute("SELECT pg_advisory_lock(7), pg_advisory_lock(7)")
        before = session_state(c)
        c.execute(call)
        after = session_state(c)
        assert after == before, f"{call} left {after} (was {before})"
        assert one(c, "SELECT now() > '2001-01-01'"), f"{call}: the owner's now() ran as the caller"
        # The caller's own lock is still held, twice.
        assert [one(c, "SELECT pg_advisory_unlock(7)") for _ in range(3)] == [True, True, False]
    assert [r for r in arena.spied() if r[1] not in (HOMESERVER, ATTACKER)] == []


@pytest.mark.parametrize("caller", [None, READER])
def test_a_table_owners_code_may_not_take_holds_or_ids_for_the_caller(arena, caller):
    """The adversary of 0.4.0 (F1): an index predicate of the homeserver's
    table that called streampos.hold_ids() 64 times left 64 holds in the
    caller's session (a hold outlives the subtransaction that took it): the
    other stream's frontier stuck behind the caller's session for as long
    as it lived, and the caller's own hold_ids() 53400; next_id() left an
    ID in flight in the caller's transaction. hold_ids, release_ids,
    next_id and next_ids are refused (42501) in another role's code inside
    a streampos function, as the advisory lock functions are."""
    admin = arena.connect()
    hs = arena.connect(HOMESERVER)
    create_stream(hs, "s")
    create_stream(hs, "s2")
    hs.execute("CREATE TABLE public.holdy (id bigint, instance_name text)")
    hs.execute("GRANT SELECT ON public.holdy TO PUBLIC")
    hs.execute("SELECT streampos.add_table('s', 'public.holdy', 'id', 'instance_name')")
    hs.execute("INSERT INTO public.holdy SELECT streampos.next_id('s', 'w'), 'w'")
    hs.execute(
        """
        CREATE FUNCTION public.take_ids() RETURNS boolean LANGUAGE plpgsql VOLATILE AS
            $$ BEGIN RETURN true; END $$;
        CREATE FUNCTION public.take_ids_i() RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS
            $$ BEGIN RETURN public.take_ids(); END $$;
        """
    )
    # CREATE INDEX folds the predicate in the owner's own session: the
    # trap is armed after.
    hs.execute("CREATE INDEX holdy_trap ON public.holdy (id) WHERE public.take_ids_i()")
    attempts = "".join(
        f"BEGIN PERFORM {call}; RAISE NOTICE 'trap: {name} ran'; "
        f"EXCEPTION WHEN insufficient_privilege THEN RAISE NOTICE 'trap: {name} refused'; "
        f"WHEN OTHERS THEN RAISE NOTICE 'trap: {name} ran'; END; "
        for name, call in (
            ("hold_ids", "streampos.hold_ids('s2', 'w')"),
            ("release_ids", "streampos.release_ids('s2', ARRAY[1]::bigint[])"),
            ("next_id", "streampos.next_id('s2', 'w')"),
            ("next_ids", "streampos.next_ids('s2', 'w', 2)"),
        )
    )
    hs.execute(
        "CREATE OR REPLACE FUNCTION public.take_ids() RETURNS boolean LANGUAGE plpgsql VOLATILE AS "
        f"$$ BEGIN {attempts} RETURN true; END $$"
    )
    if caller is not None:
        admin.execute(f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA streampos TO {caller}")
    calls = ["SELECT streampos.updates('s', '0')", "SELECT count(*) FROM streampos.check_stream('s')"]
    for call in calls:
        c = arena.connect(caller)
        # The owner's code runs in a subtransaction streampos rolls back
        # (a spy's row would go with it): it says what happened in notices.
        notices = []
        c.add_notice_handler(lambda d: notices.append(d.message_primary))
        with c.transaction():
            c.execute(call)
            # Nothing in flight for the caller's transaction, nor held for
            # its session.
            assert in_flight(admin, "s2") == [], call
        assert in_flight(admin, "s2") == [], call
        assert set(notices) == {f"trap: {name} refused" for name in ("hold_ids", "release_ids", "next_id", "next_ids")}, (
            call, notices)


def test_a_table_owners_code_may_not_take_or_release_advisory_locks(arena):
    """Issue 31, after the adversary's review: an index predicate calling
    pg_advisory_unlock_all() released the caller's own locks, and one that
    took a lock and then raised left it in the caller's session for good.
    Another role's code running inside a streampos function may not call
    the advisory lock functions (nor setseed): 42501, naming the function
    and the role, and the caller's locks are as they were."""
    hs = arena.connect(HOMESERVER)
    create_stream(hs, "s")
    hs.execute("CREATE TABLE public.locky (id bigint, instance_name text)")
    hs.execute("GRANT SELECT ON public.locky TO PUBLIC")
    hs.execute("SELECT streampos.add_table('s', 'public.locky', 'id', 'instance_name')")
    # A row past '0': updates() reads the table (with nothing new it reads none).
    hs.execute("INSERT INTO public.locky SELECT streampos.next_id('s', 'w'), 'w'")
    hs.execute(
        """
        CREATE FUNCTION public.unlock_all() RETURNS boolean LANGUAGE plpgsql VOLATILE AS
            $$ BEGIN PERFORM pg_catalog.pg_advisory_unlock_all(); RETURN true; END $$;
        CREATE FUNCTION public.unlock_all_i() RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS
            $$ BEGIN RETURN public.unlock_all(); END $$;
        CREATE FUNCTION public.lock_then_fail() RETURNS boolean LANGUAGE plpgsql VOLATILE AS
            $$ BEGIN PERFORM pg_catalog.pg_advisory_lock(11); RAISE EXCEPTION 'failed'; END $$;
        CREATE FUNCTION public.lock_then_fail_i() RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS
            $$ BEGIN RETURN public.lock_then_fail(); END $$;
        """
    )
    for predicate, function in (("public.unlock_all_i()", "pg_advisory_unlock_all"),
                                ("public.lock_then_fail_i()", "pg_advisory_lock")):
        hs.execute("DROP INDEX IF EXISTS public.locky_trap")
        hs.execute("SET check_function_bodies = off")
        try:
            hs.execute(f"CREATE INDEX locky_trap ON public.locky (id) WHERE {predicate}")
        except psycopg.Error:
            # CREATE INDEX folds the predicate in the owner's own session:
            # lock_then_fail raises there. Plant it in a table already
            # indexed by a predicate that only fails later.
            hs.execute("CREATE OR REPLACE FUNCTION public.lock_then_fail() RETURNS boolean LANGUAGE plpgsql "
                       "VOLATILE AS $$ BEGIN RETURN true; END $$")
            hs.execute(f"CREATE INDEX locky_trap ON public.locky (id) WHERE {predicate}")
            hs.execute("CREATE OR REPLACE FUNCTION public.lock_then_fail() RETURNS boolean LANGUAGE plpgsql "
                       "VOLATILE AS $$ BEGIN PERFORM pg_catalog.pg_advisory_lock(11); RAISE EXCEPTION 'failed'; END $$")
        hs.execute("SELECT pg_advisory_unlock_all()")
        c = arena.connect()
        c.execute("SELECT pg_advisory_lock(%s)", (7 + len(function),))
        before = session_state(c)
        err = expect_error(c, "SELECT streampos.updates('s', '0')", sqlstate="42501")
        assert err.diag.message_primary == (
            f"{function}() may not run in another role's code inside a streampos function"
        )
        assert HOMESERVER in err.diag.message_detail
        assert session_state(c) == before
