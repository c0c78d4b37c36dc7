"""A trusted extension: what a plain LOGIN role (the attacker) can do in a
database where a superuser created the extension and the streams. Each test
is one way 0.1.0 let such a role corrupt positions, run code as another role,
freeze streams or bring the server down (README, "Security").
"""

import time
import uuid

import psycopg
import pytest

from cluster import Clusters
from support import (
    commit_ids,
    connect_raw,
    create_stream,
    ensure_login_role,
    expect_error,
    one,
    rows,
    stored_positions,
    wait_until,
)

ATTACKER = "streampos_attacker"


@pytest.fixture(scope="module")
def attacker_role(database):
    """A LOGIN role with no privilege beyond PUBLIC's."""
    return ensure_login_role(ATTACKER)


@pytest.fixture
def attacker(attacker_role, connect):
    return connect(user=attacker_role)




# ------------------------------------------------ 1. shadowing relations


def test_a_shadowing_view_cannot_poison_positions(db, attacker, stream):
    """The registry reads a stream's sequence by OID, from its page: a TEMP
    view named like the sequence, first in the attacker's search_path, is
    never read (0.1.0 read `SELECT last_value FROM <name>` through the
    caller's search_path the first time a stream was used after start-up, and
    every session's frontier became 10^12)."""
    create_stream(db, stream)  # not used yet: the first reader loads it
    attacker.execute("SET search_path = pg_temp, streampos, public")
    attacker.execute(
        f'CREATE TEMP VIEW "{stream}_seq" AS '
        "SELECT 1000000000000::bigint AS last_value, true AS is_called, 0::bigint AS log_cnt"
    )
    assert one(attacker, "SELECT streampos.frontier(%s)", (stream,)) == 0
    assert rows(attacker, "SELECT * FROM streampos.in_flight(%s)", (stream,)) == []
    assert one(attacker, "SELECT streampos.max_allocated(%s)", (stream,)) == 0
    assert one(db, "SELECT streampos.frontier(%s)", (stream,)) == 0
    assert commit_ids(db, stream, "w") == [1]
    assert one(db, "SELECT streampos.frontier(%s)", (stream,)) == 1
    wait_until(lambda: stored_positions(db, stream) == {"w": 1}, timeout=5)
    assert all(r[1] for r in rows(db, "SELECT * FROM streampos.check_stream(%s)", (stream,)))


def test_drop_stream_drops_its_own_sequence_after_a_rename(db, stream):
    """drop_stream drops the sequence by OID: renaming the stream's own
    sequence and creating an unrelated one under the old name does not make
    it drop the unrelated one (0.1.0 dropped by the remembered name)."""
    seq = create_stream(db, stream)
    db.execute(f'ALTER SEQUENCE {seq} RENAME TO "{stream}_renamed"')
    db.execute(f'CREATE SEQUENCE streampos."{stream}_seq"')
    db.execute("SELECT streampos.drop_stream(%s)", (stream,))
    left = {r[0] for r in rows(
        db,
        "SELECT relname FROM pg_class WHERE relnamespace = 'streampos'::regnamespace "
        "AND relname IN (%s, %s)",
        (f"{stream}_seq", f"{stream}_renamed"),
    )}
    assert left == {f"{stream}_seq"}
    db.execute(f'DROP SEQUENCE streampos."{stream}_seq"')


# --------------------------------------------- 2. search_path hijacking

# Every function, operator, aggregate and type name the extension's internal
# SQL uses, overloaded with the exact argument types it is called with (an
# exact match beats pg_catalog's when a coercion would be needed, and with
# pg_catalog placed after public in the path it wins outright). Each logs
# that it ran, as the role that ran it.
OVERLOADS = """
CREATE TABLE public.attack_log (what text, who text DEFAULT current_user, at timestamptz DEFAULT now());
GRANT INSERT, SELECT ON public.attack_log TO PUBLIC;
CREATE FUNCTION public.attack(what text) RETURNS void LANGUAGE sql AS
    $$ INSERT INTO public.attack_log (what) VALUES (what) $$;
CREATE FUNCTION public.abs(bigint) RETURNS bigint LANGUAGE sql AS
    $$ SELECT public.attack('abs(bigint)'); SELECT 0::bigint $$;
CREATE FUNCTION public.setval(regclass, bigint, boolean) RETURNS bigint LANGUAGE sql AS
    $$ SELECT public.attack('setval'); SELECT 0::bigint $$;
CREATE FUNCTION public.unnest(text[]) RETURNS SETOF text LANGUAGE sql AS
    $$ SELECT public.attack('unnest(text[])'); SELECT 'x' $$;
CREATE FUNCTION public.quote_ident(name) RETURNS text LANGUAGE sql AS
    $$ SELECT public.attack('quote_ident(name)'); SELECT 'x' $$;
CREATE FUNCTION public.quote_ident(text) RETURNS text LANGUAGE sql AS
    $$ SELECT public.attack('quote_ident(text)'); SELECT 'x' $$;
CREATE FUNCTION public.format(text, text) RETURNS text LANGUAGE sql AS
    $$ SELECT public.attack('format'); SELECT 'x' $$;
CREATE FUNCTION public.pg_notify(text, text) RETURNS void LANGUAGE sql AS
    $$ SELECT public.attack('pg_notify') $$;
CREATE FUNCTION public.to_jsonb(text[]) RETURNS jsonb LANGUAGE sql AS
    $$ SELECT public.attack('to_jsonb'); SELECT '[]'::jsonb $$;
CREATE FUNCTION public.cardinality(text[]) RETURNS integer LANGUAGE sql AS
    $$ SELECT public.attack('cardinality'); SELECT 0 $$;
CREATE FUNCTION public.jsonb_build_array(bigint, text, text) RETURNS jsonb LANGUAGE sql AS
    $$ SELECT public.attack('jsonb_build_array'); SELECT '[]'::jsonb $$;
CREATE FUNCTION public.jsonb_build_object(text, text, text, boolean, text, jsonb) RETURNS jsonb LANGUAGE sql AS
    $$ SELECT public.attack('jsonb_build_object'); SELECT '{}'::jsonb $$;
CREATE FUNCTION public.attack_max_sfunc(bigint, bigint) RETURNS bigint LANGUAGE sql AS
    $$ SELECT public.attack('max(bigint)'); SELECT 0::bigint $$;
CREATE AGGREGATE public.max(bigint) (SFUNC = public.attack_max_sfunc, STYPE = bigint);
CREATE AGGREGATE public.min(bigint) (SFUNC = public.attack_max_sfunc, STYPE = bigint);
CREATE FUNCTION public.attack_max4_sfunc(integer, integer) RETURNS integer LANGUAGE sql AS
    $$ SELECT public.attack('max(integer)'); SELECT 0 $$;
CREATE AGGREGATE public.max(integer) (SFUNC = public.attack_max4_sfunc, STYPE = integer);
CREATE FUNCTION public.attack_count_sfunc(bigint) RETURNS bigint LANGUAGE sql AS
    $$ SELECT public.attack('count(*)'); SELECT 0::bigint $$;
CREATE AGGREGATE public.count(*) (SFUNC = public.attack_count_sfunc, STYPE = bigint, INITCOND = '0');
CREATE FUNCTION public.attack_agg_sfunc(jsonb, jsonb) RETURNS jsonb LANGUAGE sql AS
    $$ SELECT public.attack('jsonb_agg'); SELECT '[]'::jsonb $$;
CREATE AGGREGATE public.jsonb_agg(jsonb) (SFUNC = public.attack_agg_sfunc, STYPE = jsonb);
CREATE FUNCTION public.attack_eq_text(text, text) RETURNS boolean LANGUAGE sql AS
    $$ SELECT public.attack('=(text,text)'); SELECT true $$;
CREATE OPERATOR public.= (LEFTARG = text, RIGHTARG = text, FUNCTION = public.attack_eq_text);
CREATE FUNCTION public.attack_ne_text(text, text) RETURNS boolean LANGUAGE sql AS
    $$ SELECT public.attack('<>(text,text)'); SELECT true $$;
CREATE OPERATOR public.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = public.attack_ne_text);
CREATE FUNCTION public.attack_eq_oid(oid, regclass) RETURNS boolean LANGUAGE sql AS
    $$ SELECT public.attack('=(oid,regclass)'); SELECT true $$;
CREATE OPERATOR public.= (LEFTARG = oid, RIGHTARG = regclass, FUNCTION = public.attack_eq_oid);
CREATE FUNCTION public.attack_eq_oidoid(oid, oid) RETURNS boolean LANGUAGE sql AS
    $$ SELECT public.attack('=(oid,oid)'); SELECT true $$;
CREATE OPERATOR public.= (LEFTARG = oid, RIGHTARG = oid, FUNCTION = public.attack_eq_oidoid);
CREATE FUNCTION public.attack_eq_int(integer, integer) RETURNS boolean LANGUAGE sql AS
    $$ SELECT public.attack('=(int,int)'); SELECT true $$;
CREATE OPERATOR public.= (LEFTARG = integer, RIGHTARG = integer, FUNCTION = public.attack_eq_int);
CREATE FUNCTION public.attack_gt_big(bigint, bigint) RETURNS boolean LANGUAGE sql AS
    $$ SELECT public.attack('>(bigint,bigint)'); SELECT true $$;
CREATE OPERATOR public.> (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = public.attack_gt_big);
CREATE FUNCTION public.attack_le_big(bigint, bigint) RETURNS boolean LANGUAGE sql AS
    $$ SELECT public.attack('<=(bigint,bigint)'); SELECT true $$;
CREATE OPERATOR public.<= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = public.attack_le_big);
CREATE FUNCTION public.attack_concat(text, text) RETURNS text LANGUAGE sql AS
    $$ SELECT public.attack('||(text,text)'); SELECT 'x' $$;
CREATE OPERATOR public.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = public.attack_concat);
CREATE FUNCTION public.attack_neg(bigint) RETURNS bigint LANGUAGE sql AS
    $$ SELECT public.attack('-(bigint)'); SELECT 0::bigint $$;
CREATE OPERATOR public.- (RIGHTARG = bigint, FUNCTION = public.attack_neg);
CREATE FUNCTION public.attack_check() RETURNS boolean LANGUAGE sql AS
    $$ SELECT public.attack('domain int8'); SELECT true $$;
CREATE DOMAIN public.int8 AS pg_catalog.int8 CHECK (public.attack_check());
CREATE DOMAIN public.text AS pg_catalog.text CHECK (public.attack_check());
CREATE VIEW public.instances AS SELECT 1 AS instance_id, 'x'::pg_catalog.text AS instance_name
    WHERE public.attack_check();
CREATE VIEW public.streams AS SELECT 'x'::pg_catalog.text AS stream_name WHERE public.attack_check();
"""


@pytest.fixture
def hijacked_public(attacker_role, connect, database):
    """public writable by the attacker (a pre-15 public, or a database owned
    by the homeserver role), and the attacker's overloads in it."""
    admin = connect()
    admin.execute(f"GRANT CREATE ON SCHEMA public TO {attacker_role}")
    attacker = connect(user=attacker_role)
    for statement in OVERLOADS.strip().split(";\n"):
        if statement.strip():
            attacker.execute(statement)
    yield admin
    with connect_raw() as cleanup:
        cleanup.execute(f"DROP OWNED BY {attacker_role} CASCADE")
        cleanup.execute(f"REVOKE CREATE ON SCHEMA public FROM {attacker_role}")


@pytest.mark.parametrize("path", ["public, streampos", "public, pg_catalog, streampos"])
def test_overloads_in_the_callers_search_path_never_run(hijacked_public, connect, stream, path):
    """A superuser whose search_path starts with the attacker's schema calls
    every function of the extension (and the position worker stores
    positions): none of the attacker's functions, operators, aggregates,
    domains or views runs (0.1.0 ran public.quote_ident(name) as the superuser
    in check_stream, and public.jsonb_build_array in updates)."""
    victim = connect()
    victim.execute(f"SET search_path = {path}")
    table = f"{stream}_t"
    victim.execute(f'CREATE TABLE public."{table}" (id bigint PRIMARY KEY, instance_name pg_catalog.text, body pg_catalog.text)')
    calls = [
        ("SELECT streampos.create_stream(%s, writers => ARRAY['w1','w2']::pg_catalog.text[])", (stream,)),
        ("SELECT streampos.add_table(%s, %s::pg_catalog.regclass, 'id', 'instance_name')", (stream, f'public."{table}"')),
        ("SELECT streampos.instance_id('w3')", None),
        ("SELECT streampos.set_writers(%s, ARRAY['w1','w2','w3']::pg_catalog.text[])", (stream,)),
        (f'INSERT INTO public."{table}" SELECT streampos.next_id(%s, \'w1\'), \'w1\', \'a\'', (stream,)),
        (f'INSERT INTO public."{table}" SELECT pg_catalog.unnest(streampos.next_ids(%s, \'w2\', 3)), \'w2\', \'b\'', (stream,)),
        ("SELECT streampos.frontier(%s)", (stream,)),
        ("SELECT streampos.max_allocated(%s)", (stream,)),
        ("SELECT streampos.writer_position(%s, 'w1')", (stream,)),
        ("SELECT * FROM streampos.writer_positions(%s)", (stream,)),
        ("SELECT streampos.current_token(%s)", (stream,)),
        ("SELECT streampos.current_room_token(%s)", (stream,)),
        ("SELECT * FROM streampos.in_flight(%s)", (stream,)),
        ("SELECT streampos.wait_for(%s, 1, 10)", (stream,)),
        ("SELECT streampos.updates(%s, '0', 2)", (stream,)),
        ("SELECT streampos.updates(%s, '2', 10)", (stream,)),
        ("SELECT * FROM streampos.check_stream(%s, true)", (stream,)),
        ("SELECT streampos.instance_name(streampos.instance_id('w1'))", None),
        ("SELECT streampos.instance_pos(streampos.current_room_token(%s), 'w1')", (stream,)),
        ("SELECT streampos.in_range(NULL::streampos.room_stream_token, 's9'::streampos.room_stream_token, NULL, 5::pg_catalog.int8)", None),
    ]
    for sql, params in calls:
        victim.execute(sql, params)
    # The worker stores positions with its own search_path.
    time.sleep(0.5)
    victim.execute("SELECT streampos.drop_stream(%s)", (stream,))
    victim.execute(f'DROP TABLE public."{table}"')
    log = rows(victim, "SELECT what, who FROM public.attack_log")
    assert log == [], f"the attacker's code ran inside the extension: {log}"


# ------------------------------------- 3. allocation and catalog changes


def test_public_may_neither_allocate_nor_change_the_catalog(db, attacker, stream):
    """Allocation needs what nextval needs (0.1.0 skipped the sequence's
    check, so any role could allocate, pose as any writer, and hold every
    follower back with an open transaction); catalog-changing functions and
    the catalog tables are not for PUBLIC."""
    seq = create_stream(db, stream)
    err = expect_error(attacker, "SELECT streampos.next_id(%s, 'event_persister1')", (stream,), "42501")
    assert "USAGE" in err.diag.message_hint
    expect_error(attacker, "SELECT nextval(%s::regclass)", (seq,), "42501")
    for sql, params in [
        ("SELECT streampos.create_stream(%s)", (stream + "x",)),
        ("SELECT streampos.adopt_stream(%s, %s::regclass)", (stream + "y", seq)),
        ("SELECT streampos.add_table(%s, 'pg_class', 'oid')", (stream,)),
        ("SELECT streampos.set_writers(%s, NULL)", (stream,)),
        ("SELECT streampos.drop_stream(%s)", (stream,)),
        ("SELECT streampos.instance_id('squatter')", None),
        ("INSERT INTO streampos.instances (instance_id, instance_name) VALUES (999999, 'squatter')", None),
        ("INSERT INTO streampos.instances (instance_name) VALUES ('squatter')", None),
        ("UPDATE streampos.streams SET writers = NULL", None),
        ("DELETE FROM streampos.stream_positions", None),
        ("INSERT INTO streampos.stream_positions VALUES (%s, 'w', 1000000)", (stream,)),
        ("SELECT setval(%s::regclass, 1000000)", (seq,)),
    ]:
        expect_error(attacker, sql, params, "42501")
    # Reading is for everyone.
    assert one(attacker, "SELECT streampos.frontier(%s)", (stream,)) == 0
    # One grant lets the role write.
    db.execute(f"GRANT USAGE ON SEQUENCE {seq} TO {ATTACKER}")
    attacker.execute("BEGIN")
    assert one(attacker, "SELECT streampos.next_id(%s, 'event_persister1')", (stream,)) == 1
    attacker.execute("ROLLBACK")


def test_the_homeserver_role_recipe(connect, database, stream):
    """The README's deployment: a superuser creates the extension; one grant
    (EXECUTE on the schema's functions) lets the homeserver's own role create
    its streams, own their sequences, and write and read without any other
    grant; another role it grants USAGE to may write too."""
    role, other = f"hs_{uuid.uuid4().hex[:8]}", f"w_{uuid.uuid4().hex[:8]}"
    admin = connect()
    admin.execute(f"CREATE ROLE {role} LOGIN")
    admin.execute(f"CREATE ROLE {other} LOGIN")
    try:
        admin.execute(f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA streampos TO {role}")
        admin.execute(f"GRANT CREATE ON SCHEMA public TO {role}")
        hs = connect(user=role)
        seq = one(hs, "SELECT streampos.create_stream(%s, writers => ARRAY['p1'])::text", (stream,))
        assert one(hs, "SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = %s::regclass", (seq,)) == role
        hs.execute(f'CREATE TABLE "{stream}_ev" (id bigint PRIMARY KEY, instance_name text)')
        hs.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, f"{stream}_ev"))
        hs.execute(f"INSERT INTO \"{stream}_ev\" SELECT streampos.next_id(%s, 'p1'), 'p1'", (stream,))
        assert one(hs, "SELECT streampos.frontier(%s)", (stream,)) == 1
        assert all(r[1] for r in rows(hs, "SELECT * FROM streampos.check_stream(%s, true)", (stream,)))
        w = connect(user=other)
        expect_error(w, "SELECT streampos.next_id(%s, 'p1')", (stream,), "42501")
        hs.execute(f"GRANT USAGE ON SEQUENCE {seq} TO {other}")
        w.execute("BEGIN")
        assert one(w, "SELECT streampos.next_id(%s, 'p1')", (stream,)) == 2
        w.execute("ROLLBACK")
        hs.execute("SELECT streampos.drop_stream(%s)", (stream,))
        hs.execute(f'DROP TABLE "{stream}_ev"')
        for c in (hs, w):
            c.close()
    finally:
        with connect_raw() as cleanup:
            for r in (role, other):
                cleanup.execute(f"DROP OWNED BY {r} CASCADE")
                cleanup.execute(f"REVOKE ALL ON ALL FUNCTIONS IN SCHEMA streampos FROM {r}")
                cleanup.execute(f"DROP ROLE {r}")


# ---------------------------------------------------------- 4. memory


def test_inputs_too_large_are_errors_under_a_low_address_space_limit():
    """Under a low address-space limit (what vm.overcommit_memory=2 amounts
    to), hostile input sizes are clear errors and no backend aborts (0.1.0
    asked the Rust allocator for 9.6 GB for a token of 600 million "~", and
    the failed allocation restarted the whole cluster)."""
    with Clusters() as clusters:
        node = clusters.node(start=False)
        limit_kb = 2 * 1024 * 1024
        env_pg_ctl = f"ulimit -v {limit_kb} && exec {clusters_bin('pg_ctl')} -D {node.datadir} -l {node.log} -w -t 60 start"
        run_as_postgres(["bash", "-c", env_pg_ctl])
        try:
            with node.connect() as c:
                c.execute("SELECT streampos.create_stream('big')")
                started = one(c, "SELECT pg_postmaster_start_time()")
                attacks = [
                    ("SELECT ('m1' || repeat('~', 100000000))::streampos.room_stream_token", "54000"),
                    ("SELECT ('m1' || repeat('~', 100000000))::streampos.multi_writer_token", "54000"),
                    ("SELECT streampos.make_room_token(1, array_fill(2, ARRAY[20000000]), "
                     "array_fill(5::bigint, ARRAY[20000000]))", "54000"),
                    ("SELECT streampos.make_multi_writer_token(1, array_fill(2, ARRAY[20000000]), "
                     "array_fill(5::bigint, ARRAY[20000000]))", "54000"),
                    ("SELECT streampos.updates('big', '0', 2147483647)", "54000"),
                    ("SELECT streampos.set_writers('big', array_fill('w'::text, ARRAY[10000000]))", "54000"),
                    ("SELECT streampos.next_ids('big', 'w', 2147483647)", "22023"),
                    ("SELECT streampos.frontier(repeat('x', 50000000))", "42704"),
                ]
                for sql, state in attacks:
                    err = expect_error(c, sql, None, state)
                    assert len(str(err)) < 2000, f"{sql}: an unbounded message ({len(str(err))} bytes)"
                assert one(c, "SELECT pg_postmaster_start_time()") == started
                assert one(c, "SELECT streampos.next_id('big', 'w')") == 1
        finally:
            node.stop("immediate")


def clusters_bin(name):
    import cluster

    return cluster._bin(name)


def run_as_postgres(args):
    import cluster

    cluster._run(args, timeout=120)


# -------------------------------------------------- 5. the instances table


def test_instances_cannot_be_squatted(db, attacker, stream):
    """PUBLIC could insert into streampos.instances (0.1.0): squat ids,
    insert negative ones, hold a writer's name in an open transaction. Now
    only the extension writes it, ids are positive, and ids given explicitly
    (imported, restored) are never handed out again."""
    expect_error(attacker, "INSERT INTO streampos.instances (instance_name) VALUES ('x')", None, "42501")
    expect_error(db, "INSERT INTO streampos.instances (instance_id, instance_name) VALUES (-5, %s)",
                 (stream + "_neg",), "23514")
    top = one(db, "SELECT coalesce(max(instance_id), 0) FROM streampos.instances")
    db.execute("INSERT INTO streampos.instances (instance_id, instance_name) VALUES (%s, %s)",
               (top + 3, stream + "_imported"))
    ids = [one(db, "SELECT streampos.instance_id(%s)", (f"{stream}_new{k}",)) for k in range(5)]
    assert len(set(ids)) == 5 and all(i > top + 3 for i in ids), (top, ids)


# ------------------------------------------ 6. DROP and CREATE EXTENSION


def test_drop_and_create_extension_again_starts_streams_afresh(connect, database):
    """Stream keys restart when the extension is created again: a new stream
    with an old key must start empty in every session, also one that used
    the old stream (0.1.0 showed the old frontier and failed next_id until a
    restart; the session's stale cache failed with "could not open relation
    with OID")."""
    name = f"streampos_recreate_{uuid.uuid4().hex[:8]}"
    with connect_raw("postgres") as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        a = connect_raw(name)
        a.execute("CREATE EXTENSION streampos")
        a.execute("SELECT streampos.create_stream('s')")
        assert commit_ids(a, "s", "w", 5) == [1, 2, 3, 4, 5]
        assert one(a, "SELECT streampos.frontier('s')") == 5
        b = connect_raw(name)
        # DDL can deadlock with the position worker's pass; PostgreSQL
        # cancels one of them, and the DROP is retried.
        for attempt in range(5):
            try:
                with b.transaction():
                    b.execute("DROP EXTENSION streampos")
                    b.execute("DROP SCHEMA streampos CASCADE")
                break
            except psycopg.errors.DeadlockDetected:
                time.sleep(0.2)
        b.execute("CREATE EXTENSION streampos")
        b.execute("SELECT streampos.create_stream('s')")
        for conn in (a, b, connect_raw(name)):
            assert one(conn, "SELECT streampos.frontier('s')") == 0
            assert one(conn, "SELECT streampos.max_allocated('s')") == 0
        assert commit_ids(a, "s", "w") == [1]
        assert one(b, "SELECT streampos.frontier('s')") == 1
        a.close()
        b.close()
    finally:
        with connect_raw("postgres") as admin:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


# -------------------------------------------------------- 7. the rest


def test_check_stream_notices_a_sequence_moved_back_and_repairs_it(db, stream):
    seq = create_stream(db, stream)
    assert commit_ids(db, stream, "w", 10)[-1] == 10
    db.execute(f"SELECT setval('{seq}', 3)")
    err = expect_error(db, "SELECT streampos.next_id(%s, 'w')", (stream,), "55000")
    assert "below one already allocated" in err.diag.message_primary
    checks = {n: (ok, d) for n, ok, d in rows(db, "SELECT * FROM streampos.check_stream(%s)", (stream,))}
    assert checks["allocated"][0] is False, checks
    checks = {n: (ok, d) for n, ok, d in rows(db, "SELECT * FROM streampos.check_stream(%s, true)", (stream,))}
    assert checks["repair"][0] is True, checks
    assert one(db, "SELECT streampos.next_id(%s, 'w')", (stream,)) == 11


def test_in_flight_shows_other_roles_backends_only_as_pg_stat_activity_would(db, attacker, connect, stream):
    seq = create_stream(db, stream)
    writer = connect()
    writer.execute("BEGIN")
    one(writer, "SELECT streampos.next_id(%s, 'brand-new-writer')", (stream,))
    # The writer's name was created by its open transaction: still shown.
    mine = rows(db, "SELECT instance_name, pid, xid, since FROM streampos.in_flight(%s)", (stream,))
    assert len(mine) == 1 and mine[0][0] == "brand-new-writer" and all(v is not None for v in mine[0])
    theirs = rows(attacker, "SELECT instance_name, pid, xid, since FROM streampos.in_flight(%s)", (stream,))
    assert theirs == [("brand-new-writer", None, None, None)]
    db.execute(f"GRANT pg_read_all_stats TO {ATTACKER}")
    try:
        attacker2 = connect(user=ATTACKER)
        seen = rows(attacker2, "SELECT pid, xid, since FROM streampos.in_flight(%s)", (stream,))
        assert len(seen) == 1 and all(v is not None for v in seen[0])
    finally:
        db.execute(f"REVOKE pg_read_all_stats FROM {ATTACKER}")
    writer.execute("ROLLBACK")
    del seq


def test_updates_names_columns_exactly_and_converts_every_row(db, stream):
    """A column called i"d came out of 0.1.0's updates() headers as i""d, and a
    value its own conversion could not handle became null. Now PostgreSQL
    builds the answer: headers are the column names as they are, values are
    to_jsonb's (a money or an array keeps its value)."""
    create_stream(db, stream)
    table = f"{stream}_q"
    db.execute(f'CREATE TABLE "{table}" ("i""d" bigint, "w""ho" text, "odd col" money, "arr" int[])')
    db.execute("SELECT streampos.add_table(%s, %s, %s, %s)", (stream, table, 'i"d', 'w"ho'))
    db.execute(
        f'INSERT INTO "{table}" SELECT streampos.next_id(%s, %s), %s, 12.5, ARRAY[1, 2]',
        (stream, "w", "w"),
    )
    answer = one(db, "SELECT streampos.updates(%s, '0')", (stream,))
    db.execute(f'DROP TABLE "{table}"')
    header, row = answer["data"][0], answer["data"][1]
    assert header[4:] == ['i"d', 'w"ho', "odd col", "arr"], header
    assert row == [1, "w", "$12.50", [1, 2]], row


def test_in_flight_names_a_writer_its_own_open_transaction_created(db, connect, stream):
    """0.1.0 showed an empty instance name for a writer whose name was created
    by the still-open transaction (other sessions cannot see that row yet).
    The name is kept with the registry entry."""
    create_stream(db, stream)
    writer = f"{stream}_brand_new"
    w = connect()
    w.execute("BEGIN")
    one(w, "SELECT streampos.next_id(%s, %s)", (stream, writer))
    shown = rows(db, "SELECT instance_name, min_id FROM streampos.in_flight(%s)", (stream,))
    w.execute("ROLLBACK")
    assert shown == [(writer, 1)]


def test_a_writer_seen_only_in_aborted_transactions_is_not_in_tokens(db, connect, stream):
    create_stream(db, stream)
    commit_ids(db, stream, "real")
    ghost_id = one(db, "SELECT streampos.instance_id('ghost')")
    ghost = connect()
    for _ in range(3):
        ghost.execute("BEGIN")
        one(ghost, "SELECT streampos.next_id(%s, %s)", (stream, "ghost"))
        ghost.execute("ROLLBACK")
    commit_ids(db, stream, "real")
    token = one(db, "SELECT streampos.current_token(%s)::text", (stream,))
    assert f"~{ghost_id}." not in token, token
    assert "ghost" not in {r[0] for r in rows(db, "SELECT * FROM streampos.writer_positions(%s)", (stream,))}


def test_messages_do_not_echo_unbounded_input(db):
    for sql in [
        "SELECT streampos.frontier(repeat('x', 100000))",
        "SELECT streampos.next_id('warmup', repeat('y', 100000))",
        "SELECT streampos.instance_id(repeat('z', 100000))",
        "SELECT repeat('s', 100000)::streampos.room_stream_token",
    ]:
        err = expect_error(db, sql)
        text = str(err) + (err.diag.message_detail or "") + (err.diag.message_hint or "")
        assert len(text) < 1000, f"{sql}: {len(text)} bytes"


def test_position_worker_slots_are_reused_across_many_databases(database):
    """A position worker's slot is freed when it exits, so a server that has
    seen more databases than there are slots still stores positions in a new
    one (0.1.0 never freed them: after 64 databases, silently nothing)."""
    names = [f"streampos_slots_{uuid.uuid4().hex[:6]}_{k}" for k in range(70)]
    try:
        for name in names:
            with connect_raw("postgres") as admin:
                admin.execute(f"CREATE DATABASE {name}")
            with connect_raw(name) as c:
                c.execute("CREATE EXTENSION streampos")
                c.execute("SELECT streampos.create_stream('s')")
                commit_ids(c, "s", "w")
            with connect_raw("postgres") as admin:
                admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
        last = names[-1] + "x"
        names.append(last)
        with connect_raw("postgres") as admin:
            admin.execute(f"CREATE DATABASE {last}")
        with connect_raw(last) as c:
            c.execute("CREATE EXTENSION streampos")
            c.execute("SELECT streampos.create_stream('s')")
            commit_ids(c, "s", "w", 3)
            wait_until(lambda: stored_positions(c, "s") == {"w": 3}, timeout=10,
                       message="the position worker of the 71st database")
        with connect_raw() as c:
            workers = one(c, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'streampos position worker'")
            assert workers <= 3, f"{workers} position workers still running"
    finally:
        with connect_raw("postgres") as admin:
            for name in names:
                admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
