-- streampos 0.1.0 -> 0.2.0 (ALTER EXTENSION streampos UPDATE TO '0.2.0').
--
-- Every schema change of 0.2.0 is here, in the order it was made; after it
-- runs, the database has exactly the objects sql/streampos--0.2.0.sql creates
-- (the upgrade test compares the two).
\echo Use "ALTER EXTENSION streampos UPDATE TO '0.2.0'" to load this file. \quit

-- Privileges (a trusted extension). The catalog tables are written only by
-- the extension's functions, as the extension's owner; catalog-changing
-- functions are not for PUBLIC; next_id() now checks the privilege nextval()
-- needs (grant USAGE on each stream's sequence to the roles that write).
REVOKE INSERT ON instances FROM PUBLIC;
REVOKE USAGE ON SEQUENCE instances_instance_id_seq FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION create_stream(text, boolean, text[]) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION adopt_stream(text, regclass, boolean, text[]) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION add_table(text, regclass, text, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION set_writers(text, text[]) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION drop_stream(text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION instance_id(text) FROM PUBLIC;

-- Instance ids are positive (Synapse's instance_map ids are), and a stream
-- has a sequence of its own. An existing row that breaks either stops the
-- upgrade with the constraint's name.
ALTER TABLE instances ADD CONSTRAINT instances_instance_id_check CHECK (instance_id > 0);
ALTER TABLE streams ADD CONSTRAINT streams_seq_key UNIQUE (seq);

-- The trigger that keeps instances immutable raises its error from the
-- library now, like every other error of the extension.
CREATE OR REPLACE FUNCTION instances_immutable() RETURNS trigger
    LANGUAGE c AS 'MODULE_PATHNAME', 'instances_immutable_wrapper';

-- Room tokens answer as Synapse does (docs/tokens.md, "Upgrading from 0.1.0").
--
-- 1. is_before_or_eq(room_stream_token, room_stream_token) ignores the
--    topological part, as Synapse's does; the btree order of
--    room_stream_token (room_stream_token_cmp and <, <=, >=, >) extends it:
--    historical tokens no longer sort before every live token but beside
--    s{stream}. The functions are the same; the library's code changed.
-- 2. in_range(room_stream_token, ...) with a NULL instance uses the position
--    of the instance named master (Synapse's _filter_results): the two room
--    forms read streampos.instances, so they are STABLE now.
-- 3. Whatever stored the old order or old answers is rebuilt here: every
--    index that sorts room tokens with room_stream_token_ops, or whose
--    expressions or predicate use a changed function or operator. Table
--    CHECK constraints using one are re-checked, and what cannot be rebuilt
--    in place (range partitioning or range types on room_stream_token_ops,
--    stored generated columns and domain constraints using a changed
--    function) stops the upgrade with an error naming it; but only for
--    objects whose owner has the privileges of the role running the update
--    (its own, a superuser's). The update never evaluates an expression of
--    another role's object, nor lets one stop it: their CHECK constraints
--    are not re-checked, their partitioned tables, range types, generated
--    columns and domains are left as they are, and their indexes with
--    expressions or a predicate are not rebuilt, each with a WARNING naming
--    it (its owner fixes it); their plain indexes are rebuilt (by
--    PostgreSQL, as their owner, with no code but the extension's
--    comparison), waiting at most 5 seconds for a lock, else a WARNING.
--    Hash indexes and multi_writer_token are unaffected: = and the stored
--    bytes are unchanged, and live tokens keep their order.
--
-- The library keeps the 0.1.0 answers under the 0.1.0 C symbols, so that a
-- database not yet updated keeps the order its indexes were built in; here
-- the functions move to the symbols with the new answers (same functions,
-- same OIDs: operators and operator classes follow), and then what depends
-- on the order is rebuilt.
CREATE OR REPLACE FUNCTION @extschema@.room_stream_token_cmp(a @extschema@.room_stream_token, b @extschema@.room_stream_token)
    RETURNS integer IMMUTABLE STRICT PARALLEL SAFE
    LANGUAGE c AS 'MODULE_PATHNAME', 'room_functions_cmp_v2_wrapper';
CREATE OR REPLACE FUNCTION @extschema@.room_stream_token_lt(a @extschema@.room_stream_token, b @extschema@.room_stream_token)
    RETURNS boolean IMMUTABLE STRICT PARALLEL SAFE
    LANGUAGE c AS 'MODULE_PATHNAME', 'room_functions_lt_v2_wrapper';
CREATE OR REPLACE FUNCTION @extschema@.room_stream_token_le(a @extschema@.room_stream_token, b @extschema@.room_stream_token)
    RETURNS boolean IMMUTABLE STRICT PARALLEL SAFE
    LANGUAGE c AS 'MODULE_PATHNAME', 'room_functions_le_v2_wrapper';
CREATE OR REPLACE FUNCTION @extschema@.room_stream_token_ge(a @extschema@.room_stream_token, b @extschema@.room_stream_token)
    RETURNS boolean IMMUTABLE STRICT PARALLEL SAFE
    LANGUAGE c AS 'MODULE_PATHNAME', 'room_functions_ge_v2_wrapper';
CREATE OR REPLACE FUNCTION @extschema@.room_stream_token_gt(a @extschema@.room_stream_token, b @extschema@.room_stream_token)
    RETURNS boolean IMMUTABLE STRICT PARALLEL SAFE
    LANGUAGE c AS 'MODULE_PATHNAME', 'room_functions_gt_v2_wrapper';
CREATE OR REPLACE FUNCTION @extschema@.is_before_or_eq(a @extschema@.room_stream_token, b @extschema@.room_stream_token)
    RETURNS boolean IMMUTABLE STRICT PARALLEL SAFE
    LANGUAGE c AS 'MODULE_PATHNAME', 'room_functions_is_before_or_eq_v2_wrapper';
-- These two read streampos.instances now: STABLE, and PARALLEL RESTRICTED
-- (internal SQL pins search_path, which a parallel worker may not set).
CREATE OR REPLACE FUNCTION @extschema@.in_range(low @extschema@.room_stream_token, high @extschema@.room_stream_token,
                                               instance_id integer, stream_id bigint)
    RETURNS boolean STABLE PARALLEL RESTRICTED
    LANGUAGE c AS 'MODULE_PATHNAME', 'room_functions_in_range_v2_wrapper';
CREATE OR REPLACE FUNCTION @extschema@.in_range(low @extschema@.room_stream_token, high @extschema@.room_stream_token,
                                               instance_id integer, topological bigint, stream_id bigint)
    RETURNS boolean STABLE PARALLEL RESTRICTED
    LANGUAGE c AS 'MODULE_PATHNAME', 'in_range_room_v2_wrapper';
COMMENT ON FUNCTION @extschema@.is_before_or_eq(@extschema@.room_stream_token, @extschema@.room_stream_token) IS
    'Synapse''s causal order: every writer''s position in a is <= its position in b; a historical token counts as s{stream}';
COMMENT ON FUNCTION @extschema@.in_range(@extschema@.room_stream_token, @extschema@.room_stream_token, integer, bigint) IS
    'low < position <= high for that writer; NULL bounds are unbounded, NULL instance is master (Synapse _filter_results_by_stream)';
COMMENT ON FUNCTION @extschema@.in_range(@extschema@.room_stream_token, @extschema@.room_stream_token, integer, bigint, bigint) IS
    'Room pagination (Synapse _filter_results): historical bounds compare (topological, stream), live ones the writer position; NULL instance is master';

DO $upgrade$
DECLARE
    room_ops oid;
    -- Functions and operators whose answers changed.
    changed oid[];
    changed_operators oid[];
    -- The role running the update: an object whose owner has its
    -- privileges is its own to check (and to be refused over); any other
    -- role's object is never evaluated and never stops the update.
    updater oid := (SELECT r.oid FROM pg_catalog.pg_roles r
                    WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER);
    found record;
    violates boolean;
    saved_lock_timeout text;
BEGIN
    SELECT c.oid INTO STRICT room_ops
    FROM pg_catalog.pg_opclass c
    JOIN pg_catalog.pg_am a ON a.oid OPERATOR(pg_catalog.=) c.opcmethod
    WHERE c.opcname OPERATOR(pg_catalog.=) 'room_stream_token_ops'
      AND a.amname OPERATOR(pg_catalog.=) 'btree'
      AND c.opcnamespace OPERATOR(pg_catalog.=) '@extschema@'::pg_catalog.regnamespace;
    changed := ARRAY[
        '@extschema@.room_stream_token_cmp(@extschema@.room_stream_token, @extschema@.room_stream_token)'::pg_catalog.regprocedure,
        '@extschema@.room_stream_token_lt(@extschema@.room_stream_token, @extschema@.room_stream_token)'::pg_catalog.regprocedure,
        '@extschema@.room_stream_token_le(@extschema@.room_stream_token, @extschema@.room_stream_token)'::pg_catalog.regprocedure,
        '@extschema@.room_stream_token_ge(@extschema@.room_stream_token, @extschema@.room_stream_token)'::pg_catalog.regprocedure,
        '@extschema@.room_stream_token_gt(@extschema@.room_stream_token, @extschema@.room_stream_token)'::pg_catalog.regprocedure,
        '@extschema@.is_before_or_eq(@extschema@.room_stream_token, @extschema@.room_stream_token)'::pg_catalog.regprocedure,
        '@extschema@.in_range(@extschema@.room_stream_token, @extschema@.room_stream_token, integer, bigint)'::pg_catalog.regprocedure,
        '@extschema@.in_range(@extschema@.room_stream_token, @extschema@.room_stream_token, integer, bigint, bigint)'::pg_catalog.regprocedure
    ]::oid[];
    changed_operators := ARRAY(
        SELECT o.oid FROM pg_catalog.pg_operator o
        WHERE o.oprcode::pg_catalog.oid OPERATOR(pg_catalog.=) ANY (changed));

    -- What cannot be rebuilt in place.
    FOR found IN
        SELECT pt.partrelid::pg_catalog.regclass AS what, c.relowner AS owner
        FROM pg_catalog.pg_partitioned_table pt
        JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) pt.partrelid
        WHERE pt.partstrat OPERATOR(pg_catalog.=) 'r'
          AND room_ops OPERATOR(pg_catalog.=) ANY (pt.partclass::oid[])
    LOOP
        IF pg_catalog.pg_has_role(found.owner, updater, 'USAGE') THEN
            RAISE EXCEPTION 'cannot update streampos: table % is range-partitioned on room_stream_token', found.what
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      DETAIL = 'Version 0.2.0 changes the order of room_stream_token, so rows could be in the wrong partition.',
                      HINT = 'Detach its partitions or repartition the table without room_stream_token, then update.';
        END IF;
        RAISE WARNING 'streampos: table % (owned by %) is range-partitioned on room_stream_token; left as it is',
                found.what, found.owner::pg_catalog.regrole
            USING DETAIL = 'Version 0.2.0 changes the order of room_stream_token, so rows could be in the wrong partition. The update does not check another role''s table.',
                  HINT = 'Its owner should detach its partitions or repartition it without room_stream_token.';
    END LOOP;
    FOR found IN
        SELECT r.rngtypid::pg_catalog.regtype AS what, t.typowner AS owner
        FROM pg_catalog.pg_range r
        JOIN pg_catalog.pg_type t ON t.oid OPERATOR(pg_catalog.=) r.rngtypid
        WHERE r.rngsubopc OPERATOR(pg_catalog.=) room_ops
    LOOP
        IF pg_catalog.pg_has_role(found.owner, updater, 'USAGE') THEN
            RAISE EXCEPTION 'cannot update streampos: range type % is ordered by room_stream_token_ops', found.what
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      DETAIL = 'Version 0.2.0 changes the order of room_stream_token, so stored ranges could be empty or inverted.',
                      HINT = 'Drop the range type and what uses it, update, then create them again.';
        END IF;
        RAISE WARNING 'streampos: range type % (owned by %) is ordered by room_stream_token_ops; left as it is',
                found.what, found.owner::pg_catalog.regrole
            USING DETAIL = 'Version 0.2.0 changes the order of room_stream_token, so stored ranges could be empty or inverted. The update does not check another role''s type.',
                  HINT = 'Its owner should drop it and what uses it, and create them again.';
    END LOOP;
    FOR found IN
        SELECT DISTINCT pg_catalog.pg_describe_object(d.classid, d.objid, d.objsubid) AS what,
               COALESCE(tc.relowner, ty.typowner) AS owner
        FROM pg_catalog.pg_depend d
        LEFT JOIN pg_catalog.pg_attrdef ad
          ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_attrdef'::pg_catalog.regclass
         AND ad.oid OPERATOR(pg_catalog.=) d.objid
        LEFT JOIN pg_catalog.pg_constraint co
          ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_constraint'::pg_catalog.regclass
         AND co.oid OPERATOR(pg_catalog.=) d.objid
        -- PostgreSQL 14 records a generated column's expression as the
        -- column's dependency, not its default's (15 and later).
        LEFT JOIN pg_catalog.pg_attribute ga
          ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
         AND d.objsubid OPERATOR(pg_catalog.>) 0
         AND ga.attrelid OPERATOR(pg_catalog.=) d.objid
         AND ga.attnum OPERATOR(pg_catalog.=) d.objsubid
        LEFT JOIN pg_catalog.pg_class tc
          ON tc.oid OPERATOR(pg_catalog.=) COALESCE(ad.adrelid, co.conrelid, ga.attrelid)
        LEFT JOIN pg_catalog.pg_type ty ON ty.oid OPERATOR(pg_catalog.=) co.contypid
        WHERE ((d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
                AND d.refobjid OPERATOR(pg_catalog.=) ANY (changed))
            OR (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_operator'::pg_catalog.regclass
                AND d.refobjid OPERATOR(pg_catalog.=) ANY (changed_operators)))
          AND (
              -- a stored generated column (a plain default is computed anew)
              (ad.oid IS NOT NULL
               AND EXISTS (
                   SELECT 1 FROM pg_catalog.pg_attribute a
                   WHERE a.attrelid OPERATOR(pg_catalog.=) ad.adrelid
                     AND a.attnum OPERATOR(pg_catalog.=) ad.adnum
                     AND a.attgenerated OPERATOR(pg_catalog.=) 's'))
           OR ga.attgenerated OPERATOR(pg_catalog.=) 's'
              -- a constraint other than a table CHECK (handled below)
           OR (co.oid IS NOT NULL
               AND NOT (co.contype OPERATOR(pg_catalog.=) 'c'
                        AND co.conrelid OPERATOR(pg_catalog.<>) 0)))
    LOOP
        IF found.owner IS NULL OR pg_catalog.pg_has_role(found.owner, updater, 'USAGE') THEN
            RAISE EXCEPTION 'cannot update streampos: % compares room tokens', found.what
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      DETAIL = 'Version 0.2.0 changes the order of room_stream_token and the answers of is_before_or_eq and in_range on room tokens; stored results would be stale.',
                      HINT = 'Drop that expression or constraint, update, then create it again.';
        END IF;
        RAISE WARNING 'streampos: % (owned by %) compares room tokens; left as it is',
                found.what, found.owner::pg_catalog.regrole
            USING DETAIL = 'Version 0.2.0 changes the order of room_stream_token and the answers of is_before_or_eq and in_range on room tokens; stored results may be stale. The update does not evaluate another role''s expressions.',
                  HINT = 'Its owner should drop that expression or constraint and create it again.';
    END LOOP;

    -- Table CHECK constraints: still true of every row? Evaluated only on
    -- the updating role's own tables (as it would be on any of its
    -- inserts), each table on its own (ONLY: an inheritance child or
    -- partition has its own copy of an inherited constraint, and its
    -- owner's constraints are not planned here).
    FOR found IN
        SELECT DISTINCT c.conrelid::pg_catalog.regclass AS tbl, c.conname, t.relowner AS owner,
               t.relkind OPERATOR(pg_catalog.=) ANY ('{r,p}'::pg_catalog."char"[])
                   AND (t.relpersistence OPERATOR(pg_catalog.<>) 't'
                        OR t.relnamespace OPERATOR(pg_catalog.=) pg_catalog.pg_my_temp_schema()) AS readable,
               pg_catalog.pg_get_expr(c.conbin, c.conrelid) AS expr
        FROM pg_catalog.pg_constraint c
        JOIN pg_catalog.pg_class t ON t.oid OPERATOR(pg_catalog.=) c.conrelid
        JOIN pg_catalog.pg_depend d
          ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_constraint'::pg_catalog.regclass
         AND d.objid OPERATOR(pg_catalog.=) c.oid
        WHERE c.contype OPERATOR(pg_catalog.=) 'c' AND c.conrelid OPERATOR(pg_catalog.<>) 0
          AND c.convalidated
          AND ((d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
                AND d.refobjid OPERATOR(pg_catalog.=) ANY (changed))
            OR (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_operator'::pg_catalog.regclass
                AND d.refobjid OPERATOR(pg_catalog.=) ANY (changed_operators)))
    LOOP
        IF NOT (found.readable AND pg_catalog.pg_has_role(found.owner, updater, 'USAGE')) THEN
            RAISE WARNING 'streampos: check constraint "%" of table % (owned by %) was not re-checked',
                    found.conname, found.tbl, found.owner::pg_catalog.regrole
                USING DETAIL = 'Version 0.2.0 changes the order of room_stream_token and the answers of is_before_or_eq and in_range on room tokens, so rows may break it now. The update does not evaluate another role''s expressions.',
                      HINT = pg_catalog.format('Its owner can find such rows with: SELECT * FROM ONLY %s WHERE NOT (%s);',
                                               found.tbl, found.expr);
            CONTINUE;
        END IF;
        EXECUTE pg_catalog.format('SELECT EXISTS (SELECT 1 FROM ONLY %s WHERE NOT (%s))', found.tbl, found.expr)
            INTO violates;
        IF violates THEN
            RAISE EXCEPTION 'cannot update streampos: rows of table % violate check constraint "%" under the new room token order',
                    found.tbl, found.conname
                USING ERRCODE = 'check_violation',
                      DETAIL = 'Version 0.2.0 changes the order of room_stream_token and the answers of is_before_or_eq and in_range on room tokens.',
                      HINT = 'Fix those rows or drop the constraint, then update.';
        END IF;
    END LOOP;

    -- Indexes: rebuilt in the new order. REINDEX runs an index's
    -- expressions as its table's owner in a security-restricted operation
    -- (PostgreSQL's rule); another role's index is rebuilt only when it has
    -- none (only the extension's comparison runs), and never waits more
    -- than 5 seconds for a lock. A partitioned index has no storage: its
    -- partitions' indexes are rebuilt one by one.
    saved_lock_timeout := pg_catalog.current_setting('lock_timeout');
    FOR found IN
        SELECT i.indexrelid::pg_catalog.regclass AS idx, t.relowner AS owner,
               (i.indexprs IS NULL AND i.indpred IS NULL) AS plain,
               t.relpersistence OPERATOR(pg_catalog.=) 't'
                   AND t.relnamespace OPERATOR(pg_catalog.<>) pg_catalog.pg_my_temp_schema() AS others_temp
        FROM pg_catalog.pg_index i
        JOIN pg_catalog.pg_class x ON x.oid OPERATOR(pg_catalog.=) i.indexrelid
        JOIN pg_catalog.pg_class t ON t.oid OPERATOR(pg_catalog.=) i.indrelid
        WHERE x.relkind OPERATOR(pg_catalog.=) 'i'
          AND (room_ops OPERATOR(pg_catalog.=) ANY (i.indclass::oid[])
           OR EXISTS (
               SELECT 1 FROM pg_catalog.pg_depend d
               WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
                 AND d.objid OPERATOR(pg_catalog.=) i.indexrelid
                 AND ((d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
                       AND d.refobjid OPERATOR(pg_catalog.=) ANY (changed))
                   OR (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_operator'::pg_catalog.regclass
                       AND d.refobjid OPERATOR(pg_catalog.=) ANY (changed_operators)))))
        ORDER BY 1
    LOOP
        IF found.others_temp THEN
            RAISE WARNING 'streampos: index % of another session''s temporary table was not rebuilt', found.idx
                USING DETAIL = 'Version 0.2.0 changes the order of room_stream_token; the table goes away with its session.';
        ELSIF pg_catalog.pg_has_role(found.owner, updater, 'USAGE') THEN
            EXECUTE pg_catalog.format('REINDEX INDEX %s', found.idx);
        ELSIF NOT found.plain THEN
            RAISE WARNING 'streampos: index % (owned by %) has expressions or a predicate and was not rebuilt',
                    found.idx, found.owner::pg_catalog.regrole
                USING DETAIL = 'Version 0.2.0 changes the order of room_stream_token and the answers of is_before_or_eq and in_range on room tokens, so the index is out of order. The update does not run another role''s expressions.',
                      HINT = pg_catalog.format('Its owner should run REINDEX INDEX %s;', found.idx);
        ELSE
            BEGIN
                PERFORM pg_catalog.set_config('lock_timeout', '5s', true);
                EXECUTE pg_catalog.format('REINDEX INDEX %s', found.idx);
                PERFORM pg_catalog.set_config('lock_timeout', saved_lock_timeout, true);
            EXCEPTION WHEN OTHERS THEN
                RAISE WARNING 'streampos: index % (owned by %) was not rebuilt: %',
                        found.idx, found.owner::pg_catalog.regrole, SQLERRM
                    USING DETAIL = 'Version 0.2.0 changes the order of room_stream_token, so the index is out of order.',
                          HINT = pg_catalog.format('Its owner should run REINDEX INDEX %s;', found.idx);
            END;
        END IF;
    END LOOP;
END
$upgrade$;

-- adopt_synapse(): every stream of a Synapse database in one call
-- (docs/synapse-streams.md). It changes the catalog, so it is not for PUBLIC.
CREATE FUNCTION @extschema@."adopt_synapse"(
	"schema" name DEFAULT 'public'
) RETURNS TABLE (
	"stream" TEXT,
	"action" TEXT,
	"detail" TEXT
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'adopt_synapse_wrapper';
REVOKE EXECUTE ON FUNCTION @extschema@.adopt_synapse(name) FROM PUBLIC;
COMMENT ON FUNCTION @extschema@.adopt_synapse(name) IS
    'Register every stream of the Synapse database in schema, with its sequence, tables, instance ids and positions';

-- Followers take the latest snapshot under READ COMMITTED, which PostgreSQL
-- refuses while a parallel plan runs elsewhere in the query.
ALTER FUNCTION @extschema@.wait_for(text, bigint, integer) PARALLEL UNSAFE;
ALTER FUNCTION @extschema@.updates(text, @extschema@.multi_writer_token, integer, integer) PARALLEL UNSAFE;
