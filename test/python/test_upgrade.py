"""ALTER EXTENSION streampos UPDATE from 0.1.0: a database created at 0.1.0
(with the frozen install script sql/streampos--0.1.0.sql and today's
library), with streams, rows and transactions in flight, updated in place and
then used; and its catalog, object by object, equal to a fresh install of the
current version. (test_token_upgrade.py covers what the room token order
change rebuilds or refuses.)
"""

import uuid

import psycopg
import pytest

from support import EXTENSION_VERSION as CURRENT, connect_raw, ensure_login_role, one, rows


def catalog(conn):
    """Every object of the extension, described with everything that makes
    it what it is: functions (signature, language, C symbol or body,
    volatility, parallel safety, strictness, settings, privileges, comment),
    operators, operator classes and families, types, casts, tables (columns,
    defaults, constraints, triggers, indexes, privileges, comments) and
    sequences (settings, privileges). Names are schema-qualified by hand, so
    the caller's search_path does not matter."""
    ext = "(SELECT e.oid FROM pg_extension e WHERE e.extname = 'streampos')"
    members = f"""
        SELECT d.classid, d.objid FROM pg_depend d
        WHERE d.refclassid = 'pg_extension'::regclass AND d.refobjid = {ext} AND d.deptype = 'e'
    """
    out = {}
    out["objects"] = sorted(
        r[0] for r in rows(conn, f"SELECT pg_describe_object(m.classid, m.objid, 0) FROM ({members}) m")
    )
    out["functions"] = rows(conn, f"""
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_function_result(p.oid),
               l.lanname, p.prosrc, p.probin IS NOT NULL, p.provolatile, p.proparallel, p.proisstrict,
               p.prosecdef, p.prokind, p.proconfig, p.proacl::text, obj_description(p.oid, 'pg_proc'),
               pg_get_expr(p.proargdefaults, 0)
        FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
        WHERE p.oid IN (SELECT objid FROM ({members}) m WHERE m.classid = 'pg_proc'::regclass)
        ORDER BY 1, 2
    """)
    out["operators"] = rows(conn, f"""
        SELECT o.oprname, o.oprleft::regtype::text, o.oprright::regtype::text, o.oprcode::text,
               o.oprcom::regoperator::text, o.oprnegate::regoperator::text, o.oprrest::text,
               o.oprjoin::text, o.oprcanhash, o.oprcanmerge
        FROM pg_operator o
        WHERE o.oid IN (SELECT objid FROM ({members}) m WHERE m.classid = 'pg_operator'::regclass)
        ORDER BY 1, 2, 3
    """)
    out["opclasses"] = rows(conn, """
        SELECT c.opcname, a.amname, c.opcintype::regtype::text, c.opcdefault,
               ARRAY(SELECT ao.amopstrategy || ' ' || ao.amopopr::regoperator::text
                     FROM pg_amop ao WHERE ao.amopfamily = c.opcfamily ORDER BY 1),
               ARRAY(SELECT ap.amprocnum || ' ' || ap.amproc::regprocedure::text
                     FROM pg_amproc ap WHERE ap.amprocfamily = c.opcfamily ORDER BY 1)
        FROM pg_opclass c JOIN pg_am a ON a.oid = c.opcmethod
        WHERE c.opcnamespace = 'streampos'::regnamespace ORDER BY 1, 2
    """)
    out["types"] = rows(conn, """
        SELECT t.typname, t.typlen, t.typalign, t.typstorage, t.typinput::text, t.typoutput::text,
               t.typreceive::text, t.typsend::text, obj_description(t.oid, 'pg_type'),
               t.typcategory, t.typispreferred
        FROM pg_type t WHERE t.typnamespace = 'streampos'::regnamespace AND t.typtype = 'b'
        ORDER BY 1
    """)
    out["casts"] = rows(conn, """
        SELECT c.castsource::regtype::text, c.casttarget::regtype::text, c.castfunc::regprocedure::text,
               c.castcontext, c.castmethod
        FROM pg_cast c
        WHERE c.castsource::regtype::text LIKE 'streampos.%' OR c.casttarget::regtype::text LIKE 'streampos.%'
        ORDER BY 1, 2
    """)
    out["tables"] = rows(conn, """
        SELECT c.relname, c.relkind,
               -- NULL means the owner's defaults: compare what they grant
               coalesce(c.relacl, acldefault(CASE c.relkind WHEN 'S' THEN 's' ELSE 'r' END::"char", c.relowner))::text, obj_description(c.oid, 'pg_class'),
               ARRAY(SELECT a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                            || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
                            || coalesce(' default ' || pg_get_expr(ad.adbin, ad.adrelid), '')
                            || CASE WHEN a.attidentity <> '' THEN ' identity ' || a.attidentity::text ELSE '' END
                     FROM pg_attribute a
                     LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
                     WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum),
               ARRAY(SELECT co.conname || ' ' || pg_get_constraintdef(co.oid)
                     FROM pg_constraint co WHERE co.conrelid = c.oid ORDER BY 1),
               ARRAY(SELECT pg_get_triggerdef(tg.oid) FROM pg_trigger tg
                     WHERE tg.tgrelid = c.oid AND NOT tg.tgisinternal ORDER BY 1),
               ARRAY(SELECT pg_get_indexdef(i.indexrelid) FROM pg_index i
                     WHERE i.indrelid = c.oid ORDER BY 1)
        FROM pg_class c
        WHERE c.relnamespace = 'streampos'::regnamespace AND c.relkind IN ('r', 'S')
          AND c.oid IN (SELECT d.objid FROM pg_depend d WHERE d.refobjid =
                        (SELECT e.oid FROM pg_extension e WHERE e.extname = 'streampos')
                        AND d.deptype = 'e')
        ORDER BY 1
    """)
    out["sequences"] = rows(conn, """
        SELECT c.relname, s.seqtypid::regtype::text, s.seqincrement, s.seqmin, s.seqmax, s.seqcache, s.seqcycle
        FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
        WHERE c.relnamespace = 'streampos'::regnamespace
          AND c.oid IN (SELECT d.objid FROM pg_depend d WHERE d.deptype IN ('e', 'i', 'a')
                        AND d.refobjid IN (SELECT oid FROM pg_class WHERE relnamespace = 'streampos'::regnamespace
                                           AND relname IN ('instances', 'streams')))
        ORDER BY 1
    """)
    out["config_dump"] = sorted(
        r[0] for r in rows(conn, "SELECT unnest(extconfig)::regclass::text FROM pg_extension WHERE extname = 'streampos'")
    )
    return out


def test_updated_catalog_is_exactly_a_fresh_install(fresh_db):
    upgraded = connect_raw(fresh_db())
    upgraded.execute("CREATE EXTENSION streampos VERSION '0.1.0'")
    upgraded.execute(f"ALTER EXTENSION streampos UPDATE TO '{CURRENT}'")
    fresh = connect_raw(fresh_db())
    fresh.execute("CREATE EXTENSION streampos")
    got, want = catalog(upgraded), catalog(fresh)
    assert got["functions"] and got["tables"] and got["operators"]
    for part in want:
        assert got[part] == want[part], f"{part} differs after the update"
    upgraded.close()
    fresh.close()


def test_a_database_in_use_is_updated_in_place(fresh_db, connect):
    """Created at 0.1.0 with today's library, streams with rows, a writer
    holding IDs in an open transaction and a reader inside a REPEATABLE READ
    transaction while ALTER EXTENSION UPDATE runs; everything goes on after
    it, and the writer's IDs are still in flight until it commits.

    The update takes ACCESS EXCLUSIVE on the catalog tables (new constraints)
    and SHARE on tables whose indexes it rebuilds, so it waits for any
    transaction that has read the catalog or written such a table: the two
    sessions here looked their stream up before their transaction (the
    per-backend catalog cache answers inside it, so they hold no catalog
    lock), and the rebuilt token index is on a table nobody is writing.
    test_the_update_waits_for_catalog_readers shows the wait itself."""
    name = fresh_db()
    admin = connect_raw(name)
    admin.execute("CREATE EXTENSION streampos VERSION '0.1.0'")
    admin.execute("SELECT streampos.create_stream('events', writers => ARRAY['p1', 'p2'])")
    admin.execute("CREATE TABLE events (stream_ordering bigint PRIMARY KEY, instance_name text, body text)")
    admin.execute("SELECT streampos.add_table('events', 'events', 'stream_ordering', 'instance_name')")
    admin.execute("SELECT streampos.create_stream('backfill', backwards => true)")
    admin.execute("CREATE TABLE archive (stream_ordering bigint)")
    admin.execute("INSERT INTO archive SELECT g FROM generate_series(1, 50) g")
    admin.execute("CREATE INDEX archive_token ON archive ((streampos.make_room_token(stream_ordering)))")
    writer = connect_raw(name)  # its catalog cache learns 'events' and 'p2' here
    for session, instance in ((admin, "p1"), (writer, "p2"), (admin, "p1")):
        session.execute(
            "INSERT INTO events SELECT streampos.next_id('events', %s), %s, 'before'", (instance, instance)
        )
    assert one(admin, "SELECT streampos.frontier('events')") == 3
    assert one(admin, "SELECT streampos.next_id('backfill', 'p1')") == -1

    writer.execute("BEGIN")
    held = one(writer, "SELECT streampos.next_id('events', 'p2')")
    reader = connect_raw(name)
    reader.execute("SELECT streampos.frontier('events')")
    reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    assert one(reader, "SELECT streampos.frontier('events')") == 3

    admin.execute(f"ALTER EXTENSION streampos UPDATE TO '{CURRENT}'")
    assert one(admin, "SELECT extversion FROM pg_extension WHERE extname = 'streampos'") == CURRENT

    # In flight across the update, for every session.
    assert one(admin, "SELECT streampos.frontier('events')") == 3
    assert one(reader, "SELECT streampos.frontier('events')") == 3
    assert rows(admin, "SELECT instance_name, min_id FROM streampos.in_flight('events')") == [("p2", held)]
    admin.execute("INSERT INTO events SELECT streampos.next_id('events', 'p1'), 'p1', 'after'")
    assert one(admin, "SELECT streampos.frontier('events')") == 3
    writer.execute("INSERT INTO events VALUES (%s, 'p2', 'in flight')", (held,))
    writer.execute("COMMIT")
    assert one(admin, "SELECT streampos.frontier('events')") == held + 1
    assert one(admin, "SELECT streampos.current_room_token('events')::text") == f"s{held + 1}"
    reader.execute("COMMIT")
    # The followers' feed, the checks, the backward stream, the new function.
    answer = one(admin, "SELECT streampos.updates('events', '3', 10)")
    assert answer["token"] == str(held + 1) and not answer["limited"]
    assert [r[0] for r in answer["data"][1:]] == [held, held + 1]
    assert all(r[1] for r in rows(admin, "SELECT * FROM streampos.check_stream('events')"))
    assert one(admin, "SELECT streampos.next_id('backfill', 'p1')") == -2
    assert one(admin, "SELECT streampos.frontier('backfill')") == -2
    # 0.2.0's privileges hold after the update.
    role = f"up_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE ROLE {role} LOGIN")
    try:
        intruder = connect_raw(name, user=role)
        for sql in [
            "SELECT streampos.create_stream('x')",
            "INSERT INTO streampos.instances (instance_name) VALUES ('x')",
            "SELECT streampos.next_id('events', 'p1')",
        ]:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                intruder.execute(sql)
        intruder.close()
    finally:
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")
    for c in (admin, writer, reader):
        c.close()


def test_the_update_waits_for_catalog_readers(fresh_db):
    """A transaction that has read the catalog (cold cache) holds ACCESS SHARE
    on it: the update waits for it, under lock_timeout it fails with 55P03
    and changes nothing, and after that transaction ends it goes through."""
    name = fresh_db()
    admin = connect_raw(name)
    admin.execute("CREATE EXTENSION streampos VERSION '0.1.0'")
    admin.execute("SELECT streampos.create_stream('events')")
    reader = connect_raw(name)
    reader.execute("BEGIN")
    assert one(reader, "SELECT streampos.frontier('events')") == 0
    admin.execute("SET lock_timeout = '300ms'")
    with pytest.raises(psycopg.errors.LockNotAvailable):
        admin.execute(f"ALTER EXTENSION streampos UPDATE TO '{CURRENT}'")
    assert one(admin, "SELECT extversion FROM pg_extension WHERE extname = 'streampos'") == "0.1.0"
    reader.execute("COMMIT")
    admin.execute(f"ALTER EXTENSION streampos UPDATE TO '{CURRENT}'")
    assert one(admin, "SELECT extversion FROM pg_extension WHERE extname = 'streampos'") == CURRENT
    assert one(reader, "SELECT streampos.frontier('events')") == 0


def test_instance_ids_restored_ahead_of_a_fresh_sequence_are_not_given_again(fresh_db):
    """A restore (or an import) can bring instance rows back while the id
    sequence is still fresh (last_value 1, not called): the next new
    instance gets an id above them, not 1 again."""
    c = connect_raw(fresh_db())
    c.execute("CREATE EXTENSION streampos")
    assert one(c, "SELECT is_called FROM streampos.instances_instance_id_seq") is False
    c.execute("INSERT INTO streampos.instances (instance_id, instance_name) VALUES (1, 'restored')")
    assert one(c, "SELECT streampos.instance_id('new')") == 2
    assert one(c, "SELECT streampos.instance_id('restored')") == 1
    c.close()


def test_a_database_not_yet_updated_follows_with_the_new_library(fresh_db):
    """0.2.0 declares updates() with four arguments and STRICT; 0.3.0's has
    five. Between installing the library and ALTER EXTENSION UPDATE, the old
    declaration still reaches a function of the library that takes four."""
    name = fresh_db()
    admin = connect_raw(name)
    admin.execute("CREATE EXTENSION streampos VERSION '0.2.0'")
    admin.execute("SELECT streampos.create_stream('old_s')")
    admin.execute("CREATE TABLE old_ev (id bigint, w text)")
    admin.execute("SELECT streampos.add_table('old_s', 'old_ev', 'id', 'w')")
    admin.execute("INSERT INTO old_ev SELECT streampos.next_id('old_s', 'w1'), 'w1' FROM generate_series(1, 3)")
    for sql in ("SELECT streampos.updates('old_s', '1')", "SELECT streampos.updates('old_s', '1', 10, 0)"):
        answer = one(admin, sql)
        assert answer["token"] == "3" and [r[0] for r in answer["data"][1:]] == [2, 3]
    assert one(admin, "SELECT streampos.updates('old_s', NULL)") is None
    admin.close()


def test_the_update_carries_updates_privileges_over(fresh_db):
    """updates() is dropped and created again with a fifth argument: what a
    database granted or revoked on it stays as it was."""
    name = fresh_db()
    admin = connect_raw(name)
    role = f"up_{uuid.uuid4().hex[:8]}"
    admin.execute(f"CREATE ROLE {role}")
    try:
        admin.execute("CREATE EXTENSION streampos VERSION '0.2.0'")
        admin.execute("REVOKE EXECUTE ON FUNCTION streampos.updates(text, streampos.multi_writer_token, integer, integer) FROM PUBLIC")
        admin.execute(f"GRANT EXECUTE ON FUNCTION streampos.updates(text, streampos.multi_writer_token, integer, integer) TO {role}")
        admin.execute(f"ALTER EXTENSION streampos UPDATE TO '{CURRENT}'")
        new = "streampos.updates(text, streampos.multi_writer_token, integer, integer, text)"
        assert one(admin, f"SELECT has_function_privilege('public', '{new}', 'EXECUTE')") is False
        assert one(admin, f"SELECT has_function_privilege('{role}', '{new}', 'EXECUTE')") is True
        # A database that changed nothing keeps the default.
        other = connect_raw(fresh_db())
        other.execute("CREATE EXTENSION streampos VERSION '0.2.0'")
        other.execute(f"ALTER EXTENSION streampos UPDATE TO '{CURRENT}'")
        assert one(other, f"SELECT proacl IS NULL FROM pg_proc WHERE oid = '{new}'::regprocedure") is True
        other.close()
    finally:
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")
        admin.close()


@pytest.mark.parametrize("start", ["0.2.0", "0.3.0"])
def test_each_released_version_updates_to_exactly_a_fresh_install(fresh_db, start):
    upgraded = connect_raw(fresh_db())
    upgraded.execute(f"CREATE EXTENSION streampos VERSION '{start}'")
    upgraded.execute(f"ALTER EXTENSION streampos UPDATE TO '{CURRENT}'")
    fresh = connect_raw(fresh_db())
    fresh.execute("CREATE EXTENSION streampos")
    got, want = catalog(upgraded), catalog(fresh)
    for part in want:
        assert got[part] == want[part], f"{part} differs after the update from {start}"
    upgraded.close()
    fresh.close()


def test_a_view_anyone_made_on_0_2_0s_updates_does_not_stop_the_update(fresh_db):
    """Issue 31, finding 5: a role with no privileges made a temporary view
    calling 0.2.0's updates() and kept its session; 0.2.0 -> 0.3.0 drops
    that function and failed with 2BP01 (with CREATE on a schema, a
    permanent view stopped it for good). 0.2.0 -> 0.4.0 is one step that
    keeps the old function as updates_0_2 while something depends on it:
    the update goes through, the view still answers, updates() is the new
    one."""
    name = fresh_db()
    admin = connect_raw(name)
    admin.execute("CREATE EXTENSION streampos VERSION '0.2.0'")
    admin.execute("SELECT streampos.create_stream('pin_s')")
    admin.execute("CREATE TABLE pin_ev (id bigint, w text)")
    admin.execute("SELECT streampos.add_table('pin_s', 'pin_ev', 'id', 'w')")
    admin.execute("GRANT SELECT ON pin_ev TO PUBLIC")
    admin.execute("INSERT INTO pin_ev SELECT streampos.next_id('pin_s', 'w1'), 'w1'")
    nobody = connect_raw(name, user=ensure_login_role("streampos_pinner"))
    nobody.execute("CREATE TEMP VIEW pin AS SELECT streampos.updates('pin_s', '0'::streampos.multi_writer_token, 1, 0)")
    with pytest.raises(psycopg.errors.DependentObjectsStillExist):
        admin.execute("ALTER EXTENSION streampos UPDATE TO '0.3.0'")
    admin.execute(f"ALTER EXTENSION streampos UPDATE TO '{CURRENT}'")
    assert one(admin, "SELECT extversion FROM pg_extension WHERE extname = 'streampos'") == CURRENT
    assert one(nobody, "SELECT * FROM pin")["token"] == "1"
    assert one(admin, "SELECT streampos.updates('pin_s', consumer => NULL, since => '0')")["token"] == "1"
    assert one(admin, "SELECT count(*) FROM pg_proc WHERE proname = 'updates_0_2'") == 1
    nobody.close()
    # Without dependents the old function is dropped: exactly a fresh install.
    other = connect_raw(fresh_db())
    other.execute("CREATE EXTENSION streampos VERSION '0.2.0'")
    other.execute(f"ALTER EXTENSION streampos UPDATE TO '{CURRENT}'")
    assert one(other, "SELECT count(*) FROM pg_proc WHERE proname = 'updates_0_2'") == 0
    other.close()
    admin.close()
