-- streampos 0.2.0 -> 0.4.0: sql/streampos--0.2.0--0.3.0.sql, then sql/streampos--0.3.0--0.4.0.sql
-- (written by scripts/schema), with 0.2.0's updates() kept while something depends on it.
\echo Use "ALTER EXTENSION streampos UPDATE TO '0.4.0'" to load this file. \quit

-- A hot standby's frontier: stored with the writer positions of the same
-- snapshot by the position worker (stored positions alone name only the
-- writers the worker can name).
CREATE TABLE streampos.stream_frontiers (
    stream_name text PRIMARY KEY REFERENCES streampos.streams ON DELETE CASCADE ON UPDATE CASCADE,
    stream_id bigint NOT NULL
);
SELECT pg_catalog.pg_extension_config_dump('streampos.stream_frontiers', '');
GRANT SELECT ON streampos.stream_frontiers TO PUBLIC;
COMMENT ON TABLE streampos.stream_frontiers IS
    'Durable frontiers, written by the background worker with the positions: a hot standby''s frontier';

-- Holds: IDs held by the session rather than its transaction.
CREATE FUNCTION streampos."hold_ids"(
	"stream" TEXT,
	"writer" TEXT,
	"n" INT DEFAULT 1
) RETURNS bigint[]
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'hold_ids_wrapper';
CREATE FUNCTION streampos."release_ids"(
	"stream" TEXT,
	"ids" bigint[]
) RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'release_ids_wrapper';
COMMENT ON FUNCTION streampos.hold_ids(text, text, integer) IS
    'Allocate n IDs held by the session (not its transaction) until release_ids or the session ends';
COMMENT ON FUNCTION streampos.release_ids(text, bigint[]) IS
    'Release a hold of this session at the commit of the calling transaction';

-- Lost history: per stream and history, the IDs a lost history may have
-- handed out.
CREATE TABLE streampos.history_marks (
    history bigint NOT NULL,
    stream_name text NOT NULL REFERENCES streampos.streams ON DELETE CASCADE ON UPDATE CASCADE,
    have bigint NOT NULL,
    ceiling bigint NOT NULL CHECK (ceiling >= have),
    PRIMARY KEY (history, stream_name)
);
GRANT SELECT ON streampos.history_marks TO PUBLIC;
COMMENT ON TABLE streampos.history_marks IS
    'Per stream and history: IDs in (have, ceiling] may have been handed out by a history this server lost';

-- A logical replication subscriber's streams are its own: catalog rows a
-- subscription brings are not applied.
CREATE FUNCTION streampos."catalog_rows_stay_local"() RETURNS trigger
	LANGUAGE c
	AS 'MODULE_PATHNAME', 'catalog_rows_stay_local_wrapper';
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON streampos.instances
    FOR EACH ROW EXECUTE FUNCTION streampos.catalog_rows_stay_local();
ALTER TABLE streampos.instances ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON streampos.streams
    FOR EACH ROW EXECUTE FUNCTION streampos.catalog_rows_stay_local();
ALTER TABLE streampos.streams ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON streampos.stream_tables
    FOR EACH ROW EXECUTE FUNCTION streampos.catalog_rows_stay_local();
ALTER TABLE streampos.stream_tables ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON streampos.stream_positions
    FOR EACH ROW EXECUTE FUNCTION streampos.catalog_rows_stay_local();
ALTER TABLE streampos.stream_positions ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON streampos.stream_frontiers
    FOR EACH ROW EXECUTE FUNCTION streampos.catalog_rows_stay_local();
ALTER TABLE streampos.stream_frontiers ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON streampos.history_marks
    FOR EACH ROW EXECUTE FUNCTION streampos.catalog_rows_stay_local();
ALTER TABLE streampos.history_marks ENABLE ALWAYS TRIGGER catalog_rows_stay_local;

-- Listeners tell the position worker's notifications from anybody else's
-- (any role may NOTIFY streampos): the sender's pid, checked here.
CREATE FUNCTION @extschema@."is_position_worker"(
	"pid" INT
) RETURNS bool
STRICT VOLATILE PARALLEL RESTRICTED
LANGUAGE c
AS 'MODULE_PATHNAME', 'is_position_worker_wrapper';
COMMENT ON FUNCTION @extschema@.is_position_worker(integer) IS
    'Whether pid (a notification''s sender) is this database''s position worker';

-- Statistics, in shared memory since start-up (the README, "Monitoring").
CREATE FUNCTION streampos."stat_get_registry"() RETURNS TABLE (
	"streams_loaded" INT,
	"streams_used" INT,
	"streams_dropped" INT,
	"streams_max" INT,
	"ring_used" bigint,
	"ring_used_max" bigint,
	"ring_size" bigint,
	"ring_folds" bigint,
	"reader_retries" bigint,
	"reader_lock_fallbacks" bigint,
	"position_workers" INT,
	"stats_reset" timestamp with time zone
)
STRICT VOLATILE PARALLEL RESTRICTED
LANGUAGE c
AS 'MODULE_PATHNAME', 'stat_get_registry_wrapper';
CREATE FUNCTION streampos."stat_get_streams"() RETURNS TABLE (
	"stream_name" TEXT,
	"ids_allocated" bigint,
	"xact_commit" bigint,
	"xact_rollback" bigint,
	"max_allocated" bigint,
	"frontier" bigint,
	"frontier_lag_ids" bigint,
	"frontier_lag_seconds" double precision,
	"ids_in_flight" bigint,
	"oldest_in_flight_seconds" double precision,
	"oldest_in_flight_pid" INT,
	"oldest_in_flight_instance" TEXT,
	"followers_waiting" INT,
	"last_store" timestamp with time zone,
	"stored_frontier" bigint,
	"store_lag_ids" bigint,
	"store_lag_seconds" double precision,
	"stats_reset" timestamp with time zone
)
STRICT VOLATILE PARALLEL RESTRICTED
LANGUAGE c
AS 'MODULE_PATHNAME', 'stat_get_streams_wrapper';
CREATE FUNCTION streampos."stat_reset"() RETURNS void
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'stat_reset_wrapper';
CREATE VIEW streampos.stat_streams AS SELECT * FROM streampos.stat_get_streams();
CREATE VIEW streampos.stat_registry AS SELECT * FROM streampos.stat_get_registry();
GRANT SELECT ON streampos.stat_streams, streampos.stat_registry TO PUBLIC;
REVOKE EXECUTE ON FUNCTION streampos.stat_reset() FROM PUBLIC;
COMMENT ON FUNCTION streampos.stat_get_streams() IS 'Statistics of each stream of this database (see the view stat_streams)';
COMMENT ON FUNCTION streampos.stat_get_registry() IS 'Statistics of the in-flight registry (see the view stat_registry)';
COMMENT ON FUNCTION streampos.stat_reset() IS
    'Start the counters of this database''s streams, and the registry''s, again from zero';
COMMENT ON VIEW streampos.stat_streams IS
    'Per stream: IDs allocated, commits and rollbacks, lag of the frontier and of the stored positions, what is in flight, followers waiting; since start-up';
COMMENT ON VIEW streampos.stat_registry IS
    'The in-flight registry: streams loaded, finished ring use and folds, lock-free readers'' retries; since start-up';

-- Consumers: a named reader's acknowledged position on a stream, written
-- by ack() in the consumer's own transaction (README, "Consumers").
CREATE TABLE streampos.consumer_positions (
    stream_name text NOT NULL REFERENCES streampos.streams ON DELETE CASCADE ON UPDATE CASCADE,
    consumer_name text NOT NULL CHECK (octet_length(consumer_name) BETWEEN 1 AND 63),
    owner regrole NOT NULL,
    position streampos.multi_writer_token NOT NULL,
    registered_at timestamptz NOT NULL,
    acked_at timestamptz,
    PRIMARY KEY (stream_name, consumer_name)
);
SELECT pg_catalog.pg_extension_config_dump('streampos.consumer_positions', '');
GRANT SELECT ON streampos.consumer_positions TO PUBLIC;
-- What consumers that have gone had acknowledged, per stream: a retention
-- job may have deleted up to it, so no consumer registers below it.
CREATE TABLE streampos.consumer_floors (
    stream_name text PRIMARY KEY REFERENCES streampos.streams ON DELETE CASCADE ON UPDATE CASCADE,
    position streampos.multi_writer_token NOT NULL
);
SELECT pg_catalog.pg_extension_config_dump('streampos.consumer_floors', '');
GRANT SELECT ON streampos.consumer_floors TO PUBLIC;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON streampos.consumer_floors
    FOR EACH ROW EXECUTE FUNCTION streampos.catalog_rows_stay_local();
ALTER TABLE streampos.consumer_floors ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON streampos.consumer_positions
    FOR EACH ROW EXECUTE FUNCTION streampos.catalog_rows_stay_local();
ALTER TABLE streampos.consumer_positions ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
-- When the stream's current token passed what, marked by the position
-- worker while the stream has consumers: their lag in time.
CREATE TABLE streampos.frontier_marks (
    stream_name text NOT NULL REFERENCES streampos.streams ON DELETE CASCADE ON UPDATE CASCADE,
    marked_at timestamptz NOT NULL,
    position streampos.multi_writer_token NOT NULL,
    PRIMARY KEY (stream_name, marked_at)
);
SELECT pg_catalog.pg_extension_config_dump('streampos.frontier_marks', '');
GRANT SELECT ON streampos.frontier_marks TO PUBLIC;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON streampos.frontier_marks
    FOR EACH ROW EXECUTE FUNCTION streampos.catalog_rows_stay_local();
ALTER TABLE streampos.frontier_marks ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE VIEW streampos.consumers AS
SELECT c.stream_name, c.consumer_name, c.owner, c.position,
       CASE WHEN streampos.is_before_or_eq(t.current, c.position) THEN 0
            ELSE GREATEST(0,
                streampos.max_stream_pos(t.current) OPERATOR(pg_catalog.-) streampos.stream_pos(c.position))
       END AS lag_ids,
       CASE WHEN streampos.is_before_or_eq(t.current, c.position) THEN interval '0'
            ELSE GREATEST(interval '0',
                pg_catalog.statement_timestamp() OPERATOR(pg_catalog.-)
                    (SELECT m.marked_at FROM streampos.frontier_marks m
                     WHERE m.stream_name OPERATOR(pg_catalog.=) c.stream_name
                       AND NOT streampos.is_before_or_eq(m.position, c.position)
                     ORDER BY m.marked_at LIMIT 1))
       END AS lag_time,
       c.registered_at, c.acked_at,
       GREATEST(interval '0',
           pg_catalog.statement_timestamp() OPERATOR(pg_catalog.-) COALESCE(c.acked_at, c.registered_at))
           AS since_ack
FROM streampos.consumer_positions c,
     LATERAL (SELECT streampos.current_token(c.stream_name) AS current) t;
GRANT SELECT ON streampos.consumers TO PUBLIC;

CREATE FUNCTION streampos."register_consumer"(
	"stream" TEXT,
	"consumer" TEXT,
	"since" streampos.multi_writer_token DEFAULT NULL
) RETURNS streampos.multi_writer_token
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'register_consumer_wrapper';
CREATE FUNCTION streampos."unregister_consumer"(
	"stream" TEXT,
	"consumer" TEXT
) RETURNS bool
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'unregister_consumer_wrapper';
CREATE FUNCTION streampos."ack"(
	"stream" TEXT,
	"consumer" TEXT,
	"token" streampos.multi_writer_token
) RETURNS streampos.multi_writer_token
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'ack_wrapper';
CREATE FUNCTION streampos."safe_to_delete"(
	"stream" TEXT
) RETURNS streampos.multi_writer_token
STRICT STABLE PARALLEL RESTRICTED
LANGUAGE c
AS 'MODULE_PATHNAME', 'safe_to_delete_wrapper';
CREATE FUNCTION streampos."wait_for_consumer"(
	"stream" TEXT,
	"consumer" TEXT,
	"timeout_ms" INT
) RETURNS streampos.multi_writer_token
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'wait_for_consumer_wrapper';
REVOKE EXECUTE ON FUNCTION streampos.register_consumer(text, text, streampos.multi_writer_token) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION streampos.unregister_consumer(text, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION streampos.ack(text, text, streampos.multi_writer_token) FROM PUBLIC;

-- updates() resumes from a consumer's position too: a fifth argument, and
-- since may be NULL (so the function is no longer STRICT). The function is
-- dropped and created again: a view or a function with a SQL-standard body
-- that calls it stops the update (README, "Upgrading"); EXECUTE granted or
-- revoked on it is carried over.
CREATE TEMPORARY TABLE streampos_updates_acl AS
    SELECT p.proacl FROM pg_catalog.pg_proc p
    WHERE p.oid OPERATOR(pg_catalog.=)
          'streampos.updates(text, streampos.multi_writer_token, integer, integer)'::pg_catalog.regprocedure;
-- (0.2.0 -> 0.4.0 in one step) A view, or a function with a SQL-standard
-- body, that calls 0.2.0's updates() stopped the DROP (2BP01), and PUBLIC
-- can make one (a temporary view): while something depends on it, the old
-- function is kept as streampos.updates_0_2 (the library still answers
-- it), and what depends on it goes on working; else it is dropped.
DO $$
BEGIN
    IF EXISTS (
        SELECT FROM pg_catalog.pg_depend d
        WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
          AND d.refobjid OPERATOR(pg_catalog.=)
              'streampos.updates(text, streampos.multi_writer_token, integer, integer)'::pg_catalog.regprocedure
          AND d.deptype OPERATOR(pg_catalog.=) 'n'
    ) THEN
        ALTER FUNCTION streampos.updates(text, streampos.multi_writer_token, integer, integer)
            RENAME TO updates_0_2;
    ELSE
        DROP FUNCTION streampos.updates(text, streampos.multi_writer_token, integer, integer);
    END IF;
END
$$;
CREATE FUNCTION streampos."updates"(
	"stream" TEXT,
	"since" streampos.multi_writer_token DEFAULT NULL,
	"max_rows" INT DEFAULT 100,
	"timeout_ms" INT DEFAULT 0,
	"consumer" TEXT DEFAULT NULL
) RETURNS jsonb
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'updates_v3_wrapper';
DO $$
DECLARE
    item record;
BEGIN
    IF (SELECT a.proacl FROM pg_temp.streampos_updates_acl a) IS NULL THEN
        RETURN;  -- the default: EXECUTE for PUBLIC, as the new function has
    END IF;
    REVOKE EXECUTE ON FUNCTION streampos.updates(text, streampos.multi_writer_token, integer, integer, text)
        FROM PUBLIC;
    FOR item IN
        SELECT x.grantee, x.is_grantable
        FROM pg_temp.streampos_updates_acl a, pg_catalog.aclexplode(a.proacl) x
        WHERE x.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE'
    LOOP
        EXECUTE pg_catalog.format(
            'GRANT EXECUTE ON FUNCTION streampos.updates(text, streampos.multi_writer_token, integer, integer, text) TO %s%s',
            CASE WHEN item.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                 ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(item.grantee)) END,
            CASE WHEN item.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END
$$;
DROP TABLE pg_temp.streampos_updates_acl;

COMMENT ON FUNCTION streampos.updates(text, streampos.multi_writer_token, integer, integer, text) IS
    'Replication feed: rows of the stream''s tables newer than since (or the consumer''s position), with the token to continue from';
COMMENT ON TABLE streampos.consumer_positions IS
    'Consumers: each one''s acknowledged position on a stream, moved by ack() in the consumer''s transaction';
COMMENT ON TABLE streampos.consumer_floors IS
    'Per stream: what consumers that have gone had acknowledged; no consumer registers below it';
COMMENT ON TABLE streampos.frontier_marks IS
    'When each stream''s current token passed what, marked by the position worker while the stream has consumers: their lag in time';
COMMENT ON VIEW streampos.consumers IS
    'Per consumer: its position, how far behind the stream it is, and since when it has not acknowledged';
COMMENT ON FUNCTION streampos.register_consumer(text, text, streampos.multi_writer_token) IS
    'Register a consumer of the stream at since (default: the current token); idempotent for its owner';
COMMENT ON FUNCTION streampos.unregister_consumer(text, text) IS 'Forget a consumer; whether it was registered';
COMMENT ON FUNCTION streampos.ack(text, text, streampos.multi_writer_token) IS
    'Acknowledge every row up to token, with this transaction; never backwards, never past the frontier';
COMMENT ON FUNCTION streampos.safe_to_delete(text) IS
    'The position up to which every consumer of the stream has acknowledged every row (NULL: no consumers)';
COMMENT ON FUNCTION streampos.wait_for_consumer(text, text, integer) IS
    'Sleep until the stream moves past the consumer''s acknowledged position or the timeout passes; returns the current token';

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
