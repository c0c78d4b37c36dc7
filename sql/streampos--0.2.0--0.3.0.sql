-- streampos 0.2.0 -> 0.3.0
\echo Use "ALTER EXTENSION streampos UPDATE TO '0.3.0'" to load this file. \quit

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
