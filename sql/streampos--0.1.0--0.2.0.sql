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
--    expressions or predicate use a changed function or operator, and every
--    table CHECK constraint using one is re-checked. What cannot be rebuilt
--    in place (range partitioning or range types on room_stream_token_ops,
--    stored generated columns and domain constraints using a changed
--    function) stops the upgrade with an error naming it. Hash indexes and
--    multi_writer_token are unaffected: = and the stored bytes are
--    unchanged, and live tokens keep their order.
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
    found record;
    violates boolean;
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
        SELECT pt.partrelid::pg_catalog.regclass AS what
        FROM pg_catalog.pg_partitioned_table pt
        WHERE pt.partstrat OPERATOR(pg_catalog.=) 'r'
          AND room_ops OPERATOR(pg_catalog.=) ANY (pt.partclass::oid[])
    LOOP
        RAISE EXCEPTION 'cannot update streampos: table % is range-partitioned on room_stream_token', found.what
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = 'Version 0.2.0 changes the order of room_stream_token, so rows could be in the wrong partition.',
                  HINT = 'Detach its partitions or repartition the table without room_stream_token, then update.';
    END LOOP;
    FOR found IN
        SELECT r.rngtypid::pg_catalog.regtype AS what
        FROM pg_catalog.pg_range r
        WHERE r.rngsubopc OPERATOR(pg_catalog.=) room_ops
    LOOP
        RAISE EXCEPTION 'cannot update streampos: range type % is ordered by room_stream_token_ops', found.what
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = 'Version 0.2.0 changes the order of room_stream_token, so stored ranges could be empty or inverted.',
                  HINT = 'Drop the range type and what uses it, update, then create them again.';
    END LOOP;
    FOR found IN
        SELECT DISTINCT pg_catalog.pg_describe_object(d.classid, d.objid, d.objsubid) AS what
        FROM pg_catalog.pg_depend d
        WHERE ((d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
                AND d.refobjid OPERATOR(pg_catalog.=) ANY (changed))
            OR (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_operator'::pg_catalog.regclass
                AND d.refobjid OPERATOR(pg_catalog.=) ANY (changed_operators)))
          AND (
              -- a stored generated column (a plain default is computed anew)
              (d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_attrdef'::pg_catalog.regclass
               AND EXISTS (
                   SELECT 1 FROM pg_catalog.pg_attrdef ad
                   JOIN pg_catalog.pg_attribute a
                     ON a.attrelid OPERATOR(pg_catalog.=) ad.adrelid
                    AND a.attnum OPERATOR(pg_catalog.=) ad.adnum
                   WHERE ad.oid OPERATOR(pg_catalog.=) d.objid
                     AND a.attgenerated OPERATOR(pg_catalog.=) 's'))
              -- a constraint other than a table CHECK (re-checked below)
           OR (d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_constraint'::pg_catalog.regclass
               AND NOT EXISTS (
                   SELECT 1 FROM pg_catalog.pg_constraint c
                   WHERE c.oid OPERATOR(pg_catalog.=) d.objid
                     AND c.contype OPERATOR(pg_catalog.=) 'c'
                     AND c.conrelid OPERATOR(pg_catalog.<>) 0)))
    LOOP
        RAISE EXCEPTION 'cannot update streampos: % compares room tokens', found.what
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  DETAIL = 'Version 0.2.0 changes the order of room_stream_token and the answers of is_before_or_eq and in_range on room tokens; stored results would be stale.',
                  HINT = 'Drop that expression or constraint, update, then create it again.';
    END LOOP;

    -- Table CHECK constraints: still true of every row?
    FOR found IN
        SELECT DISTINCT c.conrelid::pg_catalog.regclass AS tbl, c.conname,
               pg_catalog.pg_get_expr(c.conbin, c.conrelid) AS expr
        FROM pg_catalog.pg_constraint c
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
        EXECUTE pg_catalog.format('SELECT EXISTS (SELECT 1 FROM %s WHERE NOT (%s))', found.tbl, found.expr)
            INTO violates;
        IF violates THEN
            RAISE EXCEPTION 'cannot update streampos: rows of table % violate check constraint "%" under the new room token order',
                    found.tbl, found.conname
                USING ERRCODE = 'check_violation',
                      DETAIL = 'Version 0.2.0 changes the order of room_stream_token and the answers of is_before_or_eq and in_range on room tokens.',
                      HINT = 'Fix those rows or drop the constraint, then update.';
        END IF;
    END LOOP;

    -- Indexes: rebuilt in the new order.
    FOR found IN
        SELECT i.indexrelid::pg_catalog.regclass AS idx
        FROM pg_catalog.pg_index i
        WHERE room_ops OPERATOR(pg_catalog.=) ANY (i.indclass::oid[])
           OR EXISTS (
               SELECT 1 FROM pg_catalog.pg_depend d
               WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
                 AND d.objid OPERATOR(pg_catalog.=) i.indexrelid
                 AND ((d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
                       AND d.refobjid OPERATOR(pg_catalog.=) ANY (changed))
                   OR (d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_operator'::pg_catalog.regclass
                       AND d.refobjid OPERATOR(pg_catalog.=) ANY (changed_operators))))
        ORDER BY 1
    LOOP
        EXECUTE pg_catalog.format('REINDEX INDEX %s', found.idx);
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
