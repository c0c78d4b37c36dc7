-- streampos 0.3.0 -> 0.4.0
\echo Use "ALTER EXTENSION streampos UPDATE TO '0.4.0'" to load this file. \quit

-- A consumer's name is checked by register_consumer (1 to 63 bytes); the
-- CHECK constraint, which PostgreSQL parsed again for every ack(), goes.
ALTER TABLE streampos.consumer_positions DROP CONSTRAINT consumer_positions_consumer_name_check;

-- An argument of unknown type (a driver's untyped parameter, a quoted
-- literal) given to a function with an overload for each token type
-- (is_before_or_eq, instance_pos, ...) is a multi-writer token, not an
-- ambiguity (42725): the type is its category's preferred type, as
-- CREATE TYPE ... PREFERRED = true makes it in a fresh install (ALTER TYPE
-- cannot change it).
UPDATE pg_catalog.pg_type SET typispreferred = true
WHERE oid OPERATOR(pg_catalog.=) 'streampos.multi_writer_token'::pg_catalog.regtype;

-- updates() as json: the same answer's text, written once by the call
-- (jsonb is printed character by character each time it is sent).
CREATE FUNCTION streampos.updates_json(
	"stream" TEXT,
	"since" streampos.multi_writer_token DEFAULT NULL,
	"max_rows" INT DEFAULT 100,
	"timeout_ms" INT DEFAULT 0,
	"consumer" TEXT DEFAULT NULL,
	"ordered" BOOLEAN DEFAULT false
) RETURNS json
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'updates_json_wrapper';
COMMENT ON FUNCTION streampos.updates_json(text, streampos.multi_writer_token, integer, integer, text, boolean) IS
    'updates() as json: the same answer''s text, written once instead of printed from jsonb; ordered: only up to the frontier, every row in ID order across calls';

-- The view consumers never waits for a lock: its rows come from a
-- function that locks what it reads only if granted at once (55P03 names
-- what is locked); the view's columns stay as they were.
CREATE FUNCTION streampos.stat_get_consumers() RETURNS TABLE (
	"stream_name" TEXT,
	"consumer_name" TEXT,
	"owner" oid,
	"position" TEXT,
	"lag_ids" bigint,
	"lag_time" interval,
	"registered_at" timestamp with time zone,
	"acked_at" timestamp with time zone,
	"since_ack" interval
)
STRICT VOLATILE PARALLEL RESTRICTED
LANGUAGE c
AS 'MODULE_PATHNAME', 'stat_get_consumers_wrapper';
COMMENT ON FUNCTION streampos.stat_get_consumers() IS 'Each consumer''s position and lag (see the view consumers)';
CREATE OR REPLACE VIEW streampos.consumers AS
SELECT c.stream_name, c.consumer_name, c.owner::pg_catalog.regrole AS owner, c.position::streampos.multi_writer_token AS position,
       c.lag_ids, c.lag_time, c.registered_at, c.acked_at, c.since_ack
FROM streampos.stat_get_consumers() c;

-- Followers on a hot standby are woken by replay (streampos.standby_wakeup_rmgr_id):
-- how many such records this server replayed.
CREATE FUNCTION streampos.standby_wakeups_replayed() RETURNS bigint
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'standby_wakeups_replayed_wrapper';
COMMENT ON FUNCTION streampos.standby_wakeups_replayed() IS
    'Records of the primary''s position worker replayed here since start-up, each waking followers on this standby';

-- Instance rows stay immutable also with session_replication_role =
-- replica: a backend keeps the ids it has read (src/sql/index_read.rs).
ALTER TABLE streampos.instances ENABLE ALWAYS TRIGGER instances_immutable;

-- What a prepared transaction may hold rows of (src/prepared.rs): the
-- lowest ID of every hold given out in the database when it was prepared,
-- per stream and writer (instance 0: every writer). Its own rows, gone with
-- its rollback; read after a start with a dirty snapshot; the position
-- worker forgets them once every snapshot sees them committed. Describes
-- this server's transactions, so not dumped.
-- A start that such a transaction outlived holds back only those writers,
-- from those IDs (0.3.0 held every writer back from the stored frontier).
-- A heap whatever default_table_access_method says: it is read with a
-- heap scan of its own (src/prepared.rs).
CREATE TABLE streampos.prepared_holds (
    stream_key integer NOT NULL,
    instance_id integer NOT NULL,
    min_id bigint NOT NULL
) USING heap;
-- Its first row (stream key 0: no stream) says, by its xmin, when the table
-- was created: a transaction prepared before recorded nothing.
INSERT INTO streampos.prepared_holds VALUES (0, 0, 0);
GRANT SELECT ON streampos.prepared_holds TO PUBLIC;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON streampos.prepared_holds
    FOR EACH ROW EXECUTE FUNCTION streampos.catalog_rows_stay_local();
ALTER TABLE streampos.prepared_holds ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
