"""The trap fixture: what an attacker with CREATE on ``public`` (every role,
in databases made before PostgreSQL 15) could plant for every name the
extension or a client resolves, planted in the test database before the
tests run, and checked after each test (hooks in conftest.py).

The rule it checks (docs/contract.md, docs/design.md "Untrusted objects"):
internal SQL pins ``search_path = pg_catalog, pg_temp``, qualifies every
function and operator, refers to relations by OID, and runs a table's code
only as the table's owner, in a security-restricted operation whose
settings are discarded. A trap that fires is a defect of the extension or
the client: fix the defect, never remove the trap.

What is planted, by the LOGIN role ``streampos_trapper`` (CREATE on public):

- functions and aggregates with the name and argument types of every
  pg_catalog function the extension's internal SQL and the Python client
  call (``FUNCTIONS``);
- operators ``= <> < <= > >=`` for every pair of ``TYPES`` for which
  pg_catalog has no exact match (an exact match in public beats pg_catalog's
  when pg_catalog's needs a coercion, even with pg_catalog first in the path);
- casts where the role may create them (it owns none of the types, so none;
  ``summary()`` says why each was refused);
- views in public named like the extension's and Synapse's catalog tables
  and like pg_catalog's (``VIEWS``), over the real ones, with a trap;
- on every ordinary table created in the test database (an event trigger,
  the superuser's), an index whose expression and predicate are IMMUTABLE
  calls of ``public.trap_index``, which the planner folds whenever a
  backend first plans a query on the table.

Every trap is faithful (it returns what pg_catalog's object would, so
tests that resolve it by their own choice behave as before) and calls
``public.trap_fire``. A trap of the first four kinds records itself only
when it was not called by a test's own top-level statement: called from
any other code (the extension's SPI statements, SQL functions, the
position worker), or from a statement that schema-qualifies names (the
extension's and the client's are written so; a test's rarely). The index
trap records itself only inside the extension's internal SQL (whose
statements all contain ``OPERATOR(pg_catalog.``), as a role that is not the
table's owner. When recording, a trap also tries to change the caller's
session (``search_path``, and for the index trap ``work_mem`` and a
session-level advisory lock): the extension must discard that. A record is
a row of ``public.trap_log`` (unlogged, INSERT for PUBLIC) and a step of the
sequence ``public.trap_fired`` (unlogged from PostgreSQL 15), which a
rollback does not undo.

STREAMPOS_TRAPS=0 turns all of this off.
"""

import os
import re

import psycopg

from support import DBNAME, connect_raw, ensure_login_role, rows

ENABLED = os.environ.get("STREAMPOS_TRAPS", "1") != "0"
TRAPPER = "streampos_trapper"

# What a firing trap sets in the caller's session; the check after each test
# looks for these values in every session the test still has open.
FUNCTION_TRAP_PATH = "public, pg_catalog"
INDEX_TRAP_PATH = "public, pg_catalog, trap_index_path"
INDEX_TRAP_WORK_MEM = "2345kB"
INDEX_TRAP_LOCK = 74110

# The line a recording trap writes into the server log (RAISE LOG), which
# the suites that drop their databases (Synapse's) or check per suite
# (pg_regress, the Rust client) look for: scripts/lib.sh, traps_log_check.
LOG_TAG = "STREAMPOS TRAP FIRED:"

# Tables the index trap leaves alone, {regular expression on relname: why}:
# tests that check exact behaviour the extra index changes.
EXEMPT_TABLES = {
    "^unt_turned$": "test/sql/untrusted_view.sql turns it into a view (a _RETURN rule), "
                    "which a table with an index refuses with another error",
}

# pg_catalog functions the extension (src/) and the Python client
# (clients/python/src/streampos) call, with the argument types they are
# called with: (name, argument types, result type, faithful body).
FUNCTIONS = [
    ("abs", "bigint", "bigint", "RETURN pg_catalog.abs($1);"),
    ("abs", "integer", "integer", "RETURN pg_catalog.abs($1);"),
    ("now", "", "timestamptz", "RETURN pg_catalog.now();"),
    ("clock_timestamp", "", "timestamptz", "RETURN pg_catalog.clock_timestamp();"),
    ("current_database", "", "name", "RETURN pg_catalog.current_database();"),
    ("setval", "regclass, bigint", "bigint", "RETURN pg_catalog.setval($1, $2);"),
    ("setval", "regclass, bigint, boolean", "bigint", "RETURN pg_catalog.setval($1, $2, $3);"),
    ("hashtext", "text", "integer", "RETURN pg_catalog.hashtext($1);"),
    ("octet_length", "text", "integer", "RETURN pg_catalog.octet_length($1);"),
    ("pg_notify", "text, text", "void", "PERFORM pg_catalog.pg_notify($1, $2);"),
    ("pg_try_advisory_lock", "integer, integer", "boolean", "RETURN pg_catalog.pg_try_advisory_lock($1, $2);"),
    ("pg_advisory_unlock", "integer, integer", "boolean", "RETURN pg_catalog.pg_advisory_unlock($1, $2);"),
    ("pg_advisory_xact_lock", "bigint", "void", "PERFORM pg_catalog.pg_advisory_xact_lock($1);"),
    ("date_trunc", "text, timestamptz", "timestamptz", "RETURN pg_catalog.date_trunc($1, $2);"),
    ("format", "text, text", "text", "RETURN pg_catalog.format($1, $2);"),
    ("format", "text, bigint", "text", "RETURN pg_catalog.format($1, $2);"),
    # num_nulls and jsonb_build_array take VARIADIC "any", which PL/pgSQL
    # cannot: overloads of the argument types they are called with.
    ("num_nulls", "text", "integer", "RETURN pg_catalog.num_nulls($1);"),
    ("num_nulls", "bigint", "integer", "RETURN pg_catalog.num_nulls($1);"),
    ("jsonb_build_array", "text, integer, bigint", "jsonb", "RETURN pg_catalog.jsonb_build_array($1, $2, $3);"),
    ("jsonb_build_array", "bigint, text", "jsonb", "RETURN pg_catalog.jsonb_build_array($1, $2);"),
    ("unnest", "text[]", "SETOF text", "RETURN QUERY SELECT pg_catalog.unnest($1);"),
    ("unnest", "integer[]", "SETOF integer", "RETURN QUERY SELECT pg_catalog.unnest($1);"),
    ("unnest", "bigint[]", "SETOF bigint", "RETURN QUERY SELECT pg_catalog.unnest($1);"),
]

# Aggregates: (name, argument type, state type, transition body, strict,
# initial state).
AGGREGATES = [
    ("max", "bigint", "bigint", "RETURN pg_catalog.int8larger($1, $2);", True, None),
    ("max", "integer", "integer", "RETURN pg_catalog.int4larger($1, $2);", True, None),
    ("min", "bigint", "bigint", "RETURN pg_catalog.int8smaller($1, $2);", True, None),
    ("min", "integer", "integer", "RETURN pg_catalog.int4smaller($1, $2);", True, None),
    ("count", "*", "bigint", "RETURN $1 OPERATOR(pg_catalog.+) 1;", True, "0"),
    ("array_agg", "text", "text[]", "RETURN pg_catalog.array_append($1, $2);", False, None),
    ("array_agg", "integer", "integer[]", "RETURN pg_catalog.array_append($1, $2);", False, None),
    ("array_agg", "bigint", "bigint[]", "RETURN pg_catalog.array_append($1, $2);", False, None),
    ("jsonb_agg", "jsonb", "jsonb",
     "RETURN pg_catalog.jsonb_insert(COALESCE($1, '[]'::pg_catalog.jsonb), '{-1}', COALESCE($2, 'null'::pg_catalog.jsonb), true);",
     False, None),
]

# The types the extension's and the client's SQL compare.
TYPES = [
    "regclass", "regrole", "regnamespace", "oid", "name", "text", "bigint", "integer",
    "streampos.multi_writer_token", "streampos.room_stream_token",
]
OPERATORS = ["=", "<>", "<", "<=", ">", ">="]

# Casts the attacker would want (the extension and the client cast between
# these); CREATE CAST needs the ownership of one of the two types.
CASTS = [
    ("text", "regclass"), ("text", "oid"), ("bigint", "oid"),
    ("text", "streampos.multi_writer_token"), ("text", "streampos.room_stream_token"),
    ("streampos.multi_writer_token", "text"), ("streampos.room_stream_token", "text"),
    ("jsonb", "text"), ("bigint", "text"),
]

# Views in public over the real relations, named like them: FROM items.
VIEWS = {
    # the extension's catalog
    **{name: f"streampos.{name} x" for name in [
        "streams", "instances", "stream_positions", "stream_tables", "stream_frontiers",
        "consumers", "consumer_positions", "consumer_floors", "frontier_marks", "history_marks",
        "stat_registry", "stat_streams",
    ]},
    # Synapse's (adopt_synapse and the client's Synapse layer read them)
    "instance_map": "streampos.instances x",
    "schema_version": "(SELECT 1 AS version, true AS upgraded) x",
    # pg_catalog's, which the extension and the client read
    **{name: f"pg_catalog.{name} x" for name in [
        "pg_class", "pg_namespace", "pg_attribute", "pg_attrdef", "pg_depend", "pg_database",
        "pg_extension", "pg_sequence", "pg_proc", "pg_prepared_xacts", "pg_stat_activity",
        "pg_locks", "pg_index", "pg_type", "pg_roles", "pg_settings", "pg_constraint",
        "pg_inherits", "pg_policy", "pg_trigger", "pg_rewrite", "pg_cast", "pg_operator",
    ]},
}

# The machinery every trap calls. trap_fire's own path is pinned, so that it
# never runs a trap itself; the PL/pgSQL call stack tells who called the
# trap: the lines after trap_fire's frame, its calling statement and the one
# trap that called it.
MACHINERY = f"""
CREATE UNLOGGED TABLE public.trap_log (
    at timestamptz DEFAULT pg_catalog.clock_timestamp(),
    who name, session_role name, label text, stack text, query text, pid integer);
GRANT INSERT ON public.trap_log TO PUBLIC;
CREATE {{sequence_persistence}} SEQUENCE public.trap_fired;
GRANT USAGE ON SEQUENCE public.trap_fired TO PUBLIC;

CREATE FUNCTION public.trap_fire(label text, rel oid DEFAULT NULL) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    stack text;
    lines text[];
    caller text;
    q text := current_query();
    i integer := 1;
    -- pg_regress names its sessions so.
    regress boolean := current_setting('application_name') LIKE 'pg\\_regress%';
BEGIN
    GET DIAGNOSTICS stack = PG_CONTEXT;
    lines := string_to_array(stack, E'\\n');
    WHILE i <= cardinality(lines) AND (lines[i] LIKE 'PL/pgSQL function %trap_fire(%'
                                       OR lines[i] LIKE 'SQL statement "SELECT public.trap_fire(%') LOOP
        i := i + 1;
    END LOOP;
    caller := array_to_string(lines[i + 1:], E'\\n');
    IF rel IS NULL THEN
        -- A test's own top-level statement chose its path: not recorded.
        -- Under pg_regress every top-level statement is the test file's or
        -- psql's (whose \\d queries compare with unqualified operators).
        -- In a strict database (the clients' suites: public.trap_strict),
        -- every statement is recorded: a client's statement is top-level.
        IF caller = '' AND q IS NOT NULL AND (strpos(q, 'pg_catalog.') = 0 OR regress)
                AND to_regclass('public.trap_strict') IS NULL THEN
            RETURN;
        END IF;
        -- Nor, under pg_regress, the code a test file wrote (its DO blocks
        -- and functions): only a chain with a statement written as the
        -- extension's internal SQL is (qualified names).
        IF regress AND strpos(caller, 'pg_catalog.') = 0 THEN
            RETURN;
        END IF;
        PERFORM public.trap_record(label, stack, q);
        BEGIN PERFORM set_config('search_path', '{FUNCTION_TRAP_PATH}', false); EXCEPTION WHEN OTHERS THEN NULL; END;
    ELSE
        -- The index trap: only inside the extension's internal SQL.
        IF strpos(caller, 'OPERATOR(pg_catalog.') = 0 THEN
            RETURN;
        END IF;
        IF NOT EXISTS (SELECT FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
                       WHERE c.oid = rel AND r.rolname = current_user) THEN
            PERFORM public.trap_record(label, stack, q);
        END IF;
        -- Tried, each: the extension may refuse some (42501) and must
        -- undo the others.
        BEGIN PERFORM set_config('search_path', '{INDEX_TRAP_PATH}', false); EXCEPTION WHEN OTHERS THEN NULL; END;
        BEGIN PERFORM set_config('work_mem', '{INDEX_TRAP_WORK_MEM}', false); EXCEPTION WHEN OTHERS THEN NULL; END;
        BEGIN PERFORM pg_try_advisory_lock({INDEX_TRAP_LOCK}); EXCEPTION WHEN OTHERS THEN NULL; END;
    END IF;
END $$;

-- The count survives a rollback of the caller; the row does not. Neither
-- may fail the caller (a read-only transaction, a standby): a WARNING then.
CREATE FUNCTION public.trap_record(label text, stack text, q text) RETURNS void
LANGUAGE plpgsql VOLATILE PARALLEL SAFE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- In the server log too (not sent to a client at the default
    -- client_min_messages): evidence that outlives a dropped database.
    RAISE LOG '{LOG_TAG} % as % (session %) in database %: query %; stack: %',
        label, current_user, session_user, current_database(), q, stack;
    BEGIN
        PERFORM nextval('public.trap_fired'::regclass);
        INSERT INTO public.trap_log (who, session_role, label, stack, query, pid)
            VALUES (current_user, session_user, label, stack, q, pg_backend_pid());
    EXCEPTION WHEN OTHERS THEN
        RAISE WARNING 'streampos trap % fired as % and could not record it: %', label, current_user, SQLERRM;
    END;
END $$;

CREATE FUNCTION public.trap_index(rel oid, what text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    PERFORM public.trap_fire(what, rel);
    RETURN true;
END $$;
"""

# The superuser's event trigger: the index trap on every new ordinary table
# of a test.
EVENT_TRIGGER = """
CREATE FUNCTION public.trap_add_index() RETURNS event_trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r record;
BEGIN
    FOR r IN
        -- DISTINCT: a statement can report its table twice (Synapse's
        -- CREATE TABLE with a foreign key), IF NOT EXISTS below too.
        SELECT DISTINCT c.oid, n.nspname, c.relname
        FROM pg_event_trigger_ddl_commands() d
        JOIN pg_class c ON c.oid = d.objid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE d.classid = 'pg_class'::regclass AND d.objsubid = 0 AND c.relkind = 'r'
          AND n.nspname NOT IN ('pg_catalog', 'streampos', 'information_schema')
          AND n.nspname NOT LIKE 'pg\\_temp%' AND n.nspname NOT LIKE 'pg\\_toast%'
          AND c.relname !~ {exempt}
    LOOP
        EXECUTE format(
            'CREATE INDEX IF NOT EXISTS %I ON %I.%I ((public.trap_index(%s, %L))) WHERE public.trap_index(%s, %L)',
            'trap_idx_' || r.oid, r.nspname, r.relname,
            r.oid, format('index expression on %I.%I', r.nspname, r.relname),
            r.oid, format('index predicate on %I.%I', r.nspname, r.relname));
    END LOOP;
END $$;
CREATE EVENT TRIGGER trap_add_index ON ddl_command_end WHEN TAG IN ('CREATE TABLE')
    EXECUTE FUNCTION public.trap_add_index();
"""

MARKER = "public.trap_planted()"
TOKEN_MARKER = "public.trap_planted_tokens()"
MACHINERY_NAMES = ("trap_fire", "trap_record", "trap_index", "trap_add_index")

_summary = {"functions": [], "aggregates": [], "operators": [], "operators_refused": [],
            "casts_refused": [], "views": [], "views_refused": []}


def _plpgsql(name, args, returns, body, label):
    return (
        f"CREATE FUNCTION public.{name}({args}) RETURNS {returns} LANGUAGE plpgsql "
        f"PARALLEL SAFE AS $$ BEGIN PERFORM public.trap_fire({_literal(label)}); {body} END $$"
    )


def _literal(text):
    return "'" + text.replace("'", "''") + "'"


def _try(conn, sql):
    """Run a statement; the error's message if it failed."""
    try:
        conn.execute(sql)
        return None
    except psycopg.Error as err:
        return (err.diag.message_primary or str(err)).strip()


def _faithful_operator(conn, op, left, right):
    """The body of an operator trap: what the real operator (pg_catalog's,
    or the token type's own in streampos) answers; an error like a missing
    operator's where there is none."""
    for schema in ("pg_catalog", "streampos"):
        if _try(conn, f"SELECT NULL::{left} OPERATOR({schema}.{op}) NULL::{right}") is None:
            return f"RETURN $1 OPERATOR({schema}.{op}) $2;"
    return (
        f"RAISE EXCEPTION USING ERRCODE = 'undefined_function', "
        f"MESSAGE = {_literal(f'operator does not exist: {left} {op} {right} (a planted trap)')};"
    )


def _exempt_regex():
    return "|".join(f"(?:{p})" for p in EXEMPT_TABLES) or "^$"


# Views plant() leaves out with synapse=True: Synapse's own tables of
# these names are created after (its base database is planted first).
SYNAPSE_TABLES = ("instance_map", "schema_version", "stream_positions")


def plant(dbname=DBNAME, synapse=False, regress=False, strict=False):
    """Plant everything in the database (the test database unless named;
    the superuser's part too), unless it is there already. The operators
    for streampos's token types need the extension: planted by a later
    call once it is created (a database copied from a planted template gets
    the rest)."""
    ensure_login_role(TRAPPER, dbname)
    with connect_raw(dbname) as admin:
        admin.execute(f"GRANT CREATE ON SCHEMA public TO {TRAPPER}")
        if rows(admin, "SELECT to_regprocedure('public.trap_fire(text, oid)')")[0][0] is None:
            # Unlogged sequences came with PostgreSQL 15; a logged one is only
            # not reset by a crash restart (fired_since copes with both).
            unlogged = int(rows(admin, "SHOW server_version_num")[0][0]) >= 150000
            with connect_raw(dbname, user=TRAPPER) as t:
                t.execute(MACHINERY.replace("{sequence_persistence}", "UNLOGGED" if unlogged else ""))
        if not rows(admin, "SELECT 1 FROM pg_event_trigger WHERE evtname = 'trap_add_index'"):
            admin.execute(EVENT_TRIGGER.replace("{exempt}", _literal(_exempt_regex())))
        planted, tokens, tokens_planted = _planted(admin)
    if planted and (tokens_planted or not tokens) and not strict:
        return
    with connect_raw(dbname, user=TRAPPER) as t:
        t.execute("SET search_path = pg_catalog, pg_temp")
        if strict:
            t.execute("CREATE TABLE IF NOT EXISTS public.trap_strict ()")
        if not planted:
            _plant_objects(t, skip_views=SYNAPSE_TABLES if synapse else ())
            t.execute(f"CREATE FUNCTION {MARKER} RETURNS boolean LANGUAGE sql AS 'SELECT true'")
        if tokens and not tokens_planted:
            _plant_operators(t, token_types=True, regress=regress)
            t.execute(f"CREATE FUNCTION {TOKEN_MARKER} RETURNS boolean LANGUAGE sql AS 'SELECT true'")


def _planted(conn):
    """Whether the traps are planted, whether the extension's token types
    exist, and whether their operators' traps are planted."""
    return tuple(v is not None for v in rows(
        conn,
        f"SELECT to_regprocedure('{MARKER}'), to_regtype('streampos.room_stream_token'), "
        f"to_regprocedure('{TOKEN_MARKER}')",
    )[0])


def _plant_objects(t, skip_views=()):
    for key in _summary:
        _summary[key].clear()
    for name, args, returns, body in FUNCTIONS:
        err = _try(t, _plpgsql(name, args, returns, body, f"{name}({args})"))
        assert err is None, f"planting {name}({args}): {err}"
        _summary["functions"].append(f"{name}({args})")
    for i, (name, arg, stype, body, strict, init) in enumerate(AGGREGATES):
        sfunc = f"trap_agg_{i}"
        params = stype if arg == "*" else f"{stype}, {arg}"
        t.execute(_plpgsql(sfunc, params, stype, body, f"{name}({arg})"))
        if strict:
            t.execute(f"ALTER FUNCTION public.{sfunc}({params}) STRICT")
        initcond = f", INITCOND = {_literal(init)}" if init is not None else ""
        t.execute(f"CREATE AGGREGATE public.{name}({arg}) (SFUNC = public.{sfunc}, STYPE = {stype}{initcond})")
        _summary["aggregates"].append(f"{name}({arg})")
    _plant_operators(t, token_types=False)
    extension = rows(t, "SELECT to_regnamespace('streampos')")[0][0] is not None
    for source, target in CASTS:
        if not extension and "streampos." in source + target:
            continue
        fn = f"trap_cast_{len(_summary['casts_refused'])}"
        t.execute(_plpgsql(fn, source, target, f"RETURN $1::text::{target};", f"cast {source} AS {target}"))
        err = _try(t, f"CREATE CAST ({source} AS {target}) WITH FUNCTION public.{fn}({source}) AS IMPLICIT")
        assert err is not None, f"the trapper could create the cast ({source} AS {target}): plant it"
        t.execute(f"DROP FUNCTION public.{fn}({source})")
        _summary["casts_refused"].append(f"({source} AS {target}): {err}")
    # The views' trap: an uncorrelated subquery, a one-time filter that runs
    # at every read, rows or none.
    t.execute(
        "CREATE FUNCTION public.trap_rel(label text) RETURNS boolean LANGUAGE plpgsql PARALLEL SAFE AS "
        "$$ BEGIN PERFORM public.trap_fire(label); RETURN true; END $$"
    )
    for name, source in VIEWS.items():
        if name in skip_views:
            continue
        # pg_attribute's attmissingval (anyarray) cannot be a view's column.
        columns = "x.*" if name != "pg_attribute" else ", ".join(
            f"x.{r[0]}" for r in rows(
                t, "SELECT attname FROM pg_attribute WHERE attrelid = 'pg_catalog.pg_attribute'::regclass "
                "AND attnum > 0 AND atttypid <> 'anyarray'::regtype ORDER BY attnum"))
        err = _try(
            t,
            f"CREATE VIEW public.{name} AS SELECT {columns} FROM {source} "
            f"WHERE (SELECT public.trap_rel({_literal('view public.' + name)}))",
        )
        if err is None:
            t.execute(f"GRANT SELECT ON public.{name} TO PUBLIC")
        (_summary["views_refused"] if err else _summary["views"]).append(name + (f": {err}" if err else ""))


def _plant_operators(t, token_types, regress=False):
    exact = {
        (r[0], r[1], r[2])
        for r in rows(
            t,
            "SELECT oprname::text, oprleft::regtype::text, oprright::regtype::text FROM pg_operator "
            "WHERE oprnamespace = 'pg_catalog'::regnamespace",
        )
    }
    # Pairs with a token type once the extension is there, the others
    # before (a template without the extension).
    types = [ty for ty in TYPES if token_types or not ty.startswith("streampos.")]
    canonical = {ty: rows(t, f"SELECT '{ty}'::regtype::text")[0][0] for ty in types}
    prefix = "trap_opt_" if token_types else "trap_op_"
    n = 0
    for op in OPERATORS:
        for left in types:
            for right in types:
                if (op, canonical[left], canonical[right]) in exact:
                    continue
                if token_types and not (left.startswith("streampos.") or right.startswith("streampos.")):
                    continue
                # pg_regress's token files set search_path = public,
                # streampos for their own statements (not recorded): an
                # exact shadow in public of streampos's operators, or one
                # for the two token types (no operator, no implicit cast:
                # code comparing them fails anyway), changes only their
                # plans and error texts. The other suites plant them.
                if regress and left.startswith("streampos.") and right.startswith("streampos."):
                    continue
                n += 1
                fn = f"{prefix}{n}"
                body = _faithful_operator(t, op, left, right)
                label = f"{op}({left}, {right})"
                t.execute(_plpgsql(fn, f"{left}, {right}", "boolean", body, label))
                t.execute(f"ALTER FUNCTION public.{fn}({left}, {right}) STRICT")
                err = _try(t, f"CREATE OPERATOR public.{op} (LEFTARG = {left}, RIGHTARG = {right}, FUNCTION = public.{fn})")
                (_summary["operators_refused"] if err else _summary["operators"]).append(
                    label + (f": {err}" if err else "")
                )


def unplant(dbname=DBNAME):
    """Drop what plant() planted, but the machinery that the index traps of
    existing tables call (for a test that plants the same names itself)."""
    with connect_raw(dbname) as admin:
        admin.execute(
            f"""
            DO $$
            DECLARE f text;
            BEGIN
                FOREACH f IN ARRAY (
                    SELECT pg_catalog.array_agg(p.oid::pg_catalog.regprocedure::pg_catalog.text)
                    FROM pg_catalog.pg_proc p
                    WHERE p.pronamespace OPERATOR(pg_catalog.=) 'public'::pg_catalog.regnamespace::pg_catalog.oid
                      AND p.proowner OPERATOR(pg_catalog.=) '{TRAPPER}'::pg_catalog.regrole::pg_catalog.oid
                      AND p.prokind OPERATOR(pg_catalog.=) 'f'
                      AND p.proname::pg_catalog.text OPERATOR(pg_catalog.<>) ALL ('{{{",".join(MACHINERY_NAMES)}}}'))
                LOOP
                    EXECUTE pg_catalog.format('DROP FUNCTION IF EXISTS %s CASCADE', f);
                END LOOP;
            END $$
            """
        )


def summary():
    """What plant() planted and what it could not, for the report."""
    return _summary


def take_log(dbname=DBNAME):
    """What the traps recorded since the last call (removed), grouped as
    (count, label, who, session role, query, stack), and the count of
    recordings until now (a rollback does not undo it; a crash restart
    resets it, with the log: unlogged)."""
    with connect_raw(dbname) as c:
        logged = rows(
            c,
            "WITH taken AS (DELETE FROM public.trap_log RETURNING *) "
            "SELECT count(*), label, who::text, session_role::text, query, stack FROM taken "
            "GROUP BY label, who, session_role, query, stack ORDER BY min(at)",
        )
        fired = rows(c, "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.trap_fired")[0][0]
    return logged, fired


def fired_since(before, now):
    """Recordings between two counts of take_log() (the count starts again
    from 0 after a crash restart)."""
    return now - before if now >= before else now


def format_log(logged, limit=10):
    out = []
    for count, label, who, session_role, query, stack in logged[:limit]:
        out.append(
            f"- {count} x {label} as {who} (session {session_role})\n"
            f"  query: {query!r}\n  stack:\n" + "\n".join("    " + line for line in (stack or "").splitlines())
        )
    if len(logged) > limit:
        out.append(f"- and {len(logged) - limit} other (trap, role, query, stack) groups")
    return "\n".join(out)


def session_findings(connections):
    """The sessions (still open, idle and not in use by a thread) that carry
    a setting a trap made."""
    found = []
    for conn in connections:
        if conn.closed or conn.lock.locked():
            continue
        if conn.info.transaction_status not in (
            psycopg.pq.TransactionStatus.IDLE,
            psycopg.pq.TransactionStatus.INTRANS,
        ):
            continue
        try:
            path, work_mem = conn.execute(
                "SELECT pg_catalog.current_setting('search_path'), pg_catalog.current_setting('work_mem')"
            ).fetchone()
        except psycopg.Error:
            continue
        if path in (FUNCTION_TRAP_PATH, INDEX_TRAP_PATH) or work_mem == INDEX_TRAP_WORK_MEM:
            found.append(f"pid {conn.info.backend_pid}: search_path={path!r} work_mem={work_mem!r}")
    return found


def main(argv):
    """scripts/ and the clients' suites use this: ``traps.py plant DBNAME``,
    ``traps.py plant-strict DBNAME`` (the clients' suites: a test's own
    top-level statements are recorded too, for a client's statement is
    one), ``traps.py plant-regress DBNAME`` (pg_regress: without the operators
    between two token types), ``traps.py plant-synapse DBNAME`` (before Synapse's schema: without the
    views named like its tables; again after CREATE EXTENSION for the
    token types' operators), ``traps.py check DBNAME`` (exit 1, and the
    log, if a trap recorded)."""
    if not ENABLED:
        return 0
    what, dbname = argv
    if what in ("plant", "plant-synapse", "plant-regress", "plant-strict"):
        plant(dbname, synapse=what == "plant-synapse", regress=what == "plant-regress",
              strict=what == "plant-strict")
        return 0
    # A fixture that was never planted would pass every check.
    with connect_raw(dbname) as c:
        planted, tokens, tokens_planted = _planted(c)
    if not planted or (tokens and not tokens_planted):
        print(f"traps: {dbname} was not (fully) planted")
        return 1
    logged, fired = take_log(dbname)
    if logged or fired:
        print(f"traps fired {fired} time(s) in {dbname}:\n{format_log(logged)}")
        return 1
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
