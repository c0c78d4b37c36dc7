-- streampos: type definitions, operators, operator classes, casts,
-- aggregates and comments. Runs last, after every generated function.

CREATE TYPE room_stream_token (
    INPUT = room_stream_token_in,
    OUTPUT = room_stream_token_out,
    RECEIVE = room_stream_token_recv,
    SEND = room_stream_token_send,
    INTERNALLENGTH = VARIABLE,
    ALIGNMENT = int4,
    STORAGE = extended
);

CREATE OPERATOR < (
    LEFTARG = room_stream_token,
    RIGHTARG = room_stream_token,
    FUNCTION = room_stream_token_lt,
    COMMUTATOR = >,
    NEGATOR = >=,
    RESTRICT = scalarltsel,
    JOIN = scalarltjoinsel
);
CREATE OPERATOR <= (
    LEFTARG = room_stream_token,
    RIGHTARG = room_stream_token,
    FUNCTION = room_stream_token_le,
    COMMUTATOR = >=,
    NEGATOR = >,
    RESTRICT = scalarlesel,
    JOIN = scalarlejoinsel
);
CREATE OPERATOR = (
    LEFTARG = room_stream_token,
    RIGHTARG = room_stream_token,
    FUNCTION = room_stream_token_eq,
    COMMUTATOR = =,
    NEGATOR = <>,
    RESTRICT = eqsel,
    JOIN = eqjoinsel,
    HASHES,
    MERGES
);
CREATE OPERATOR <> (
    LEFTARG = room_stream_token,
    RIGHTARG = room_stream_token,
    FUNCTION = room_stream_token_ne,
    COMMUTATOR = <>,
    NEGATOR = =,
    RESTRICT = neqsel,
    JOIN = neqjoinsel
);
CREATE OPERATOR >= (
    LEFTARG = room_stream_token,
    RIGHTARG = room_stream_token,
    FUNCTION = room_stream_token_ge,
    COMMUTATOR = <=,
    NEGATOR = <,
    RESTRICT = scalargesel,
    JOIN = scalargejoinsel
);
CREATE OPERATOR > (
    LEFTARG = room_stream_token,
    RIGHTARG = room_stream_token,
    FUNCTION = room_stream_token_gt,
    COMMUTATOR = <,
    NEGATOR = <=,
    RESTRICT = scalargtsel,
    JOIN = scalargtjoinsel
);

CREATE OPERATOR CLASS room_stream_token_ops
    DEFAULT FOR TYPE room_stream_token USING btree AS
        OPERATOR 1 <,
        OPERATOR 2 <=,
        OPERATOR 3 =,
        OPERATOR 4 >=,
        OPERATOR 5 >,
        FUNCTION 1 room_stream_token_cmp(room_stream_token, room_stream_token);

CREATE OPERATOR CLASS room_stream_token_hash_ops
    DEFAULT FOR TYPE room_stream_token USING hash AS
        OPERATOR 1 =,
        FUNCTION 1 room_stream_token_hash(room_stream_token),
        FUNCTION 2 room_stream_token_hash_extended(room_stream_token, bigint);

CREATE AGGREGATE advance(room_stream_token) (
    SFUNC = advance,
    STYPE = room_stream_token,
    COMBINEFUNC = advance,
    PARALLEL = SAFE
);

-- PREFERRED: an argument of unknown type (a driver's untyped parameter, a
-- quoted literal) given to a function or operator with an overload for
-- each token type is a multi-writer token, not an ambiguity (42725).
CREATE TYPE multi_writer_token (
    INPUT = multi_writer_token_in,
    OUTPUT = multi_writer_token_out,
    RECEIVE = multi_writer_token_recv,
    SEND = multi_writer_token_send,
    INTERNALLENGTH = VARIABLE,
    ALIGNMENT = int4,
    STORAGE = extended,
    PREFERRED = true
);

CREATE OPERATOR < (
    LEFTARG = multi_writer_token,
    RIGHTARG = multi_writer_token,
    FUNCTION = multi_writer_token_lt,
    COMMUTATOR = >,
    NEGATOR = >=,
    RESTRICT = scalarltsel,
    JOIN = scalarltjoinsel
);
CREATE OPERATOR <= (
    LEFTARG = multi_writer_token,
    RIGHTARG = multi_writer_token,
    FUNCTION = multi_writer_token_le,
    COMMUTATOR = >=,
    NEGATOR = >,
    RESTRICT = scalarlesel,
    JOIN = scalarlejoinsel
);
CREATE OPERATOR = (
    LEFTARG = multi_writer_token,
    RIGHTARG = multi_writer_token,
    FUNCTION = multi_writer_token_eq,
    COMMUTATOR = =,
    NEGATOR = <>,
    RESTRICT = eqsel,
    JOIN = eqjoinsel,
    HASHES,
    MERGES
);
CREATE OPERATOR <> (
    LEFTARG = multi_writer_token,
    RIGHTARG = multi_writer_token,
    FUNCTION = multi_writer_token_ne,
    COMMUTATOR = <>,
    NEGATOR = =,
    RESTRICT = neqsel,
    JOIN = neqjoinsel
);
CREATE OPERATOR >= (
    LEFTARG = multi_writer_token,
    RIGHTARG = multi_writer_token,
    FUNCTION = multi_writer_token_ge,
    COMMUTATOR = <=,
    NEGATOR = <,
    RESTRICT = scalargesel,
    JOIN = scalargejoinsel
);
CREATE OPERATOR > (
    LEFTARG = multi_writer_token,
    RIGHTARG = multi_writer_token,
    FUNCTION = multi_writer_token_gt,
    COMMUTATOR = <,
    NEGATOR = <=,
    RESTRICT = scalargtsel,
    JOIN = scalargtjoinsel
);

CREATE OPERATOR CLASS multi_writer_token_ops
    DEFAULT FOR TYPE multi_writer_token USING btree AS
        OPERATOR 1 <,
        OPERATOR 2 <=,
        OPERATOR 3 =,
        OPERATOR 4 >=,
        OPERATOR 5 >,
        FUNCTION 1 multi_writer_token_cmp(multi_writer_token, multi_writer_token);

CREATE OPERATOR CLASS multi_writer_token_hash_ops
    DEFAULT FOR TYPE multi_writer_token USING hash AS
        OPERATOR 1 =,
        FUNCTION 1 multi_writer_token_hash(multi_writer_token),
        FUNCTION 2 multi_writer_token_hash_extended(multi_writer_token, bigint);

CREATE AGGREGATE advance(multi_writer_token) (
    SFUNC = advance,
    STYPE = multi_writer_token,
    COMBINEFUNC = advance,
    PARALLEL = SAFE
);

CREATE CAST (room_stream_token AS multi_writer_token)
    WITH FUNCTION room_to_multi_writer_token(room_stream_token);
CREATE CAST (multi_writer_token AS room_stream_token)
    WITH FUNCTION multi_writer_to_room_token(multi_writer_token);

CREATE TRIGGER instances_immutable BEFORE UPDATE OR DELETE ON instances
    FOR EACH ROW EXECUTE FUNCTION instances_immutable();
-- Also with session_replication_role = replica: a backend keeps the ids it
-- has read (src/sql/index_read.rs). A subscription's rows are skipped
-- first, by catalog_rows_stay_local (triggers fire in name order).
ALTER TABLE instances ENABLE ALWAYS TRIGGER instances_immutable;

-- A logical replication subscriber's streams are its own: catalog rows a
-- subscription brings are not applied (the trigger fires in the apply
-- worker, which runs as a replica, and skips them).
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON instances
    FOR EACH ROW EXECUTE FUNCTION catalog_rows_stay_local();
ALTER TABLE instances ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON streams
    FOR EACH ROW EXECUTE FUNCTION catalog_rows_stay_local();
ALTER TABLE streams ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON stream_tables
    FOR EACH ROW EXECUTE FUNCTION catalog_rows_stay_local();
ALTER TABLE stream_tables ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON stream_positions
    FOR EACH ROW EXECUTE FUNCTION catalog_rows_stay_local();
ALTER TABLE stream_positions ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON stream_frontiers
    FOR EACH ROW EXECUTE FUNCTION catalog_rows_stay_local();
ALTER TABLE stream_frontiers ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON history_marks
    FOR EACH ROW EXECUTE FUNCTION catalog_rows_stay_local();
ALTER TABLE history_marks ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON prepared_holds
    FOR EACH ROW EXECUTE FUNCTION catalog_rows_stay_local();
ALTER TABLE prepared_holds ENABLE ALWAYS TRIGGER catalog_rows_stay_local;

-- Functions with a token argument that defaults to NULL: the default needs
-- the type complete (src/api/follow.rs, src/api/consumers.rs).
CREATE FUNCTION updates(
	"stream" TEXT,
	"since" multi_writer_token DEFAULT NULL,
	"max_rows" INT DEFAULT 100,
	"timeout_ms" INT DEFAULT 0,
	"consumer" TEXT DEFAULT NULL
) RETURNS jsonb
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'updates_v3_wrapper';
CREATE FUNCTION updates_json(
	"stream" TEXT,
	"since" multi_writer_token DEFAULT NULL,
	"max_rows" INT DEFAULT 100,
	"timeout_ms" INT DEFAULT 0,
	"consumer" TEXT DEFAULT NULL,
	"ordered" BOOLEAN DEFAULT false
) RETURNS json
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'updates_json_wrapper';
CREATE FUNCTION register_consumer(
	"stream" TEXT,
	"consumer" TEXT,
	"since" multi_writer_token DEFAULT NULL
) RETURNS multi_writer_token
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'register_consumer_wrapper';

-- Consumers: a named reader's acknowledged position on a stream, written
-- by ack() in the consumer's own transaction (README, "Consumers"). Its
-- owner is the role that registered it; a role may move or forget only the
-- consumers of roles it has the privileges of.
CREATE TABLE consumer_positions (
    stream_name text NOT NULL REFERENCES streams ON DELETE CASCADE ON UPDATE CASCADE,
    -- 1 to 63 bytes: register_consumer checks (no CHECK constraint, which
    -- PostgreSQL would parse again for every acknowledgement).
    consumer_name text NOT NULL,
    owner regrole NOT NULL,
    position multi_writer_token NOT NULL,
    registered_at timestamptz NOT NULL,
    acked_at timestamptz,
    PRIMARY KEY (stream_name, consumer_name)
);
SELECT pg_catalog.pg_extension_config_dump('consumer_positions', '');
GRANT SELECT ON consumer_positions TO PUBLIC;
-- What consumers that have gone had acknowledged, per stream: a retention
-- job may have deleted up to it, so no consumer registers below it.
CREATE TABLE consumer_floors (
    stream_name text PRIMARY KEY REFERENCES streams ON DELETE CASCADE ON UPDATE CASCADE,
    position multi_writer_token NOT NULL
);
SELECT pg_catalog.pg_extension_config_dump('consumer_floors', '');
GRANT SELECT ON consumer_floors TO PUBLIC;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON consumer_floors
    FOR EACH ROW EXECUTE FUNCTION catalog_rows_stay_local();
ALTER TABLE consumer_floors ENABLE ALWAYS TRIGGER catalog_rows_stay_local;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON consumer_positions
    FOR EACH ROW EXECUTE FUNCTION catalog_rows_stay_local();
ALTER TABLE consumer_positions ENABLE ALWAYS TRIGGER catalog_rows_stay_local;

-- When the stream's current token passed what: marked by the position
-- worker at most once a second when it moved while the stream has
-- consumers (and by a registration below the current token), and kept
-- while some consumer has not acknowledged what a mark shows (thinned to
-- one a minute past an hour's age, one an hour past a day's), so that a
-- consumer's lag can be told in time.
CREATE TABLE frontier_marks (
    stream_name text NOT NULL REFERENCES streams ON DELETE CASCADE ON UPDATE CASCADE,
    marked_at timestamptz NOT NULL,
    position multi_writer_token NOT NULL,
    PRIMARY KEY (stream_name, marked_at)
);
SELECT pg_catalog.pg_extension_config_dump('frontier_marks', '');
GRANT SELECT ON frontier_marks TO PUBLIC;
CREATE TRIGGER catalog_rows_stay_local BEFORE INSERT OR UPDATE OR DELETE ON frontier_marks
    FOR EACH ROW EXECUTE FUNCTION catalog_rows_stay_local();
ALTER TABLE frontier_marks ENABLE ALWAYS TRIGGER catalog_rows_stay_local;

-- Per consumer: how far behind the stream's current token it is, in IDs
-- (its lowest position against the newest finished ID; 0 when it has
-- acknowledged the whole token) and in time (since the first mark the
-- consumer has not acknowledged: how long the current token has been past
-- its position, to within the marks' resolution, counted at the
-- statement's start), and since when it has not acknowledged. Read by a
-- function that never waits for a lock (55P03 names what is locked), as
-- every monitoring read.
CREATE VIEW consumers AS
SELECT c.stream_name, c.consumer_name, c.owner::regrole AS owner, c.position::multi_writer_token AS position,
       c.lag_ids, c.lag_time, c.registered_at, c.acked_at, c.since_ack
FROM stat_get_consumers() c;
GRANT SELECT ON consumers TO PUBLIC;

-- Privileges. Reading functions and token functions are for every role
-- (updates() and check_stream() read the stream's tables with the caller's
-- own privileges). Allocating needs what nextval() needs on the stream's
-- sequence (next_id checks it). Changing the catalog is for roles the owner
-- grants it to.
REVOKE EXECUTE ON FUNCTION create_stream(text, boolean, text[]) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION adopt_stream(text, regclass, boolean, text[]) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION add_table(text, regclass, text, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION set_writers(text, text[]) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION drop_stream(text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION instance_id(text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION adopt_synapse(name) FROM PUBLIC;
-- Registering and acknowledging are for roles granted them; safe_to_delete
-- and the view consumers are for everyone.
REVOKE EXECUTE ON FUNCTION register_consumer(text, text, multi_writer_token) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION unregister_consumer(text, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION ack(text, text, multi_writer_token) FROM PUBLIC;

-- Statistics, in shared memory since start-up (the README, "Monitoring").
-- Every role may read them (another role's pid only as in_flight() shows
-- it); resetting them is not for PUBLIC, as pg_stat_reset().
CREATE VIEW stat_streams AS SELECT * FROM stat_get_streams();
CREATE VIEW stat_registry AS SELECT * FROM stat_get_registry();
GRANT SELECT ON stat_streams, stat_registry TO PUBLIC;
REVOKE EXECUTE ON FUNCTION stat_reset() FROM PUBLIC;

-- Comments: what each object is for, as \df+ and \dT+ show them.
COMMENT ON TYPE room_stream_token IS
    'Synapse RoomStreamToken: s{stream}, t{topological}-{stream}, or m{stream}~{instance_id}.{pos}~…';
COMMENT ON TYPE multi_writer_token IS
    'Synapse MultiWriterStreamToken: {stream} or m{stream}~{instance_id}.{pos}~…';
COMMENT ON TABLE instances IS 'Writer instances: ids never reused, names never changed';
COMMENT ON TABLE streams IS 'Streams: their sequence, direction and writers (NULL: any instance)';
COMMENT ON TABLE stream_tables IS 'Tables whose rows carry a stream''s IDs';
COMMENT ON TABLE stream_positions IS
    'Durable writer positions, written by the background worker: never ahead of the truth';
COMMENT ON TABLE history_marks IS
    'Per stream and history: IDs in (have, ceiling] may have been handed out by a history this server lost';
COMMENT ON TABLE stream_frontiers IS
    'Durable frontiers, written by the background worker with the positions: a hot standby''s frontier';

COMMENT ON FUNCTION stream_pos(room_stream_token) IS 'The minimum position: every writer is at least here';
COMMENT ON FUNCTION stream_pos(multi_writer_token) IS 'The minimum position: every writer is at least here';
COMMENT ON FUNCTION max_stream_pos(room_stream_token) IS 'The highest position of any writer';
COMMENT ON FUNCTION max_stream_pos(multi_writer_token) IS 'The highest position of any writer';
COMMENT ON FUNCTION topological(room_stream_token) IS 'The topological part of a historical token; NULL for live tokens';
COMMENT ON FUNCTION instance_pos(room_stream_token, integer) IS 'The position of one writer';
COMMENT ON FUNCTION instance_pos(multi_writer_token, integer) IS 'The position of one writer';
COMMENT ON FUNCTION instance_pos(room_stream_token, text) IS 'The position of one writer, by instance name';
COMMENT ON FUNCTION instance_pos(multi_writer_token, text) IS 'The position of one writer, by instance name';
COMMENT ON FUNCTION is_before_or_eq(room_stream_token, room_stream_token) IS
    'Synapse''s causal order: every writer''s position in a is <= its position in b; a historical token counts as s{stream}';
COMMENT ON FUNCTION is_before_or_eq(multi_writer_token, multi_writer_token) IS
    'Causal order: every writer''s position in a is <= its position in b';
COMMENT ON FUNCTION persisted_after(room_stream_token, integer, bigint) IS
    'Is stream_id of that writer newer than the token?';
COMMENT ON FUNCTION persisted_after(multi_writer_token, integer, bigint) IS
    'Is stream_id of that writer newer than the token?';
COMMENT ON FUNCTION in_range(multi_writer_token, multi_writer_token, integer, bigint) IS
    'low < position <= high for that writer; NULL bounds are unbounded, NULL instance uses the minimum';
COMMENT ON FUNCTION in_range(room_stream_token, room_stream_token, integer, bigint) IS
    'low < position <= high for that writer; NULL bounds are unbounded, NULL instance is master (Synapse _filter_results_by_stream)';
COMMENT ON FUNCTION in_range(room_stream_token, room_stream_token, integer, bigint, bigint) IS
    'Room pagination (Synapse _filter_results): historical bounds compare (topological, stream), live ones the writer position; NULL instance is master';
COMMENT ON FUNCTION advance(room_stream_token, room_stream_token) IS 'Least upper bound (Synapse copy_and_advance)';
COMMENT ON FUNCTION advance(multi_writer_token, multi_writer_token) IS 'Least upper bound (Synapse copy_and_advance)';
COMMENT ON AGGREGATE advance(room_stream_token) IS 'Least upper bound of all tokens';
COMMENT ON AGGREGATE advance(multi_writer_token) IS 'Least upper bound of all tokens';
COMMENT ON FUNCTION bound(room_stream_token, bigint) IS 'Cap every position at max_stream (Synapse bound_stream_token)';
COMMENT ON FUNCTION bound(multi_writer_token, bigint) IS 'Cap every position at max_stream (Synapse bound_stream_token)';
COMMENT ON FUNCTION make_room_token(bigint, integer[], bigint[]) IS 'A live room token from its minimum and writer positions';
COMMENT ON FUNCTION make_historical_token(bigint, bigint) IS 'A historical room token t{topological}-{stream}';
COMMENT ON FUNCTION make_multi_writer_token(bigint, integer[], bigint[]) IS 'A multi-writer token from its minimum and writer positions';

COMMENT ON FUNCTION create_stream(text, boolean, text[]) IS 'Create a stream and the sequence it owns';
COMMENT ON FUNCTION adopt_stream(text, regclass, boolean, text[]) IS 'Register an existing sequence as a stream';
COMMENT ON FUNCTION add_table(text, regclass, text, text) IS 'Register a table whose rows carry the stream''s IDs';
COMMENT ON FUNCTION set_writers(text, text[]) IS 'Set the instances allowed to write (NULL: any)';
COMMENT ON FUNCTION drop_stream(text) IS 'Forget a stream and drop the sequence it owns';
COMMENT ON FUNCTION instance_id(text) IS 'The id of an instance name, created on first use';
COMMENT ON FUNCTION instance_name(integer) IS 'The name of an instance id';
COMMENT ON FUNCTION next_id(text, text) IS 'Allocate one ID; it stays in flight until this transaction ends';
COMMENT ON FUNCTION next_ids(text, text, integer) IS 'Allocate n IDs in allocation order';
COMMENT ON FUNCTION hold_ids(text, text, integer) IS
    'Allocate n IDs held by the session (not its transaction) until release_ids or the session ends';
COMMENT ON FUNCTION release_ids(text, bigint[]) IS
    'Release a hold of this session at the commit of the calling transaction';
COMMENT ON FUNCTION frontier(text) IS 'Largest F with every ID <= F finished, for the caller''s snapshot';
COMMENT ON FUNCTION max_allocated(text) IS 'The highest ID allocated so far';
COMMENT ON FUNCTION writer_position(text, text) IS 'Largest p with every ID <= p of that writer finished';
COMMENT ON FUNCTION writer_positions(text) IS 'Every writer''s position';
COMMENT ON FUNCTION current_token(text) IS 'The frontier plus every writer ahead of it';
COMMENT ON FUNCTION current_room_token(text) IS 'current_token as a room token';
COMMENT ON FUNCTION in_flight(text) IS 'Who is holding the frontier back, and since when';
COMMENT ON FUNCTION check_stream(text, boolean) IS 'Check the sequence against tables and stored positions; repair moves it forward';
COMMENT ON FUNCTION is_position_worker(integer) IS
    'Whether pid (a notification''s sender) is this database''s position worker';
COMMENT ON FUNCTION adopt_synapse(name) IS
    'Register every stream of the Synapse database in schema, with its sequence, tables, instance ids and positions';
COMMENT ON FUNCTION wait_for(text, bigint, integer) IS
    'Sleep until the frontier reaches stream_id or the timeout passes; returns the frontier';
COMMENT ON FUNCTION wait_for_consumer(text, text, integer) IS
    'Sleep until the stream moves past the consumer''s acknowledged position or the timeout passes; returns the current token';
COMMENT ON FUNCTION updates(text, multi_writer_token, integer, integer, text) IS
    'Replication feed: rows of the stream''s tables newer than since (or the consumer''s position), with the token to continue from';
COMMENT ON FUNCTION updates_json(text, multi_writer_token, integer, integer, text, boolean) IS
    'updates() as json: the same answer''s text, written once instead of printed from jsonb; ordered: only up to the frontier, every row in ID order across calls';
COMMENT ON TABLE consumer_positions IS
    'Consumers: each one''s acknowledged position on a stream, moved by ack() in the consumer''s transaction';
COMMENT ON TABLE consumer_floors IS
    'Per stream: what consumers that have gone had acknowledged; no consumer registers below it';
COMMENT ON TABLE frontier_marks IS
    'When each stream''s current token passed what, marked by the position worker while the stream has consumers: their lag in time';
COMMENT ON VIEW consumers IS
    'Per consumer: its position, how far behind the stream it is, and since when it has not acknowledged';
COMMENT ON FUNCTION register_consumer(text, text, multi_writer_token) IS
    'Register a consumer of the stream at since (default: the current token); idempotent for its owner';
COMMENT ON FUNCTION unregister_consumer(text, text) IS 'Forget a consumer; whether it was registered';
COMMENT ON FUNCTION ack(text, text, multi_writer_token) IS
    'Acknowledge every row up to token, with this transaction; never backwards, never past the frontier';
COMMENT ON FUNCTION safe_to_delete(text) IS
    'The position up to which every consumer of the stream has acknowledged every row (NULL: no consumers)';
COMMENT ON FUNCTION stat_get_streams() IS 'Statistics of each stream of this database (see the view stat_streams)';
COMMENT ON FUNCTION standby_wakeups_replayed() IS
    'Records of the primary''s position worker replayed here since start-up, each waking followers on this standby';
COMMENT ON FUNCTION stat_get_consumers() IS 'Each consumer''s position and lag (see the view consumers)';
COMMENT ON FUNCTION stat_get_registry() IS 'Statistics of the in-flight registry (see the view stat_registry)';
COMMENT ON FUNCTION stat_reset() IS
    'Start the counters of this database''s streams, and the registry''s, again from zero';
COMMENT ON VIEW stat_streams IS
    'Per stream: IDs allocated, commits and rollbacks, lag of the frontier and of the stored positions, what is in flight, followers waiting; since start-up';
COMMENT ON VIEW stat_registry IS
    'The in-flight registry: streams loaded, finished ring use and folds, lock-free readers'' retries; since start-up';
