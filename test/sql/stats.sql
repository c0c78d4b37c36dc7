--
-- stats: the statistics' views, their columns and who may reset them
-- (README, "Statistics"; docs/contract.md, "Operating"). Their values,
-- under concurrent sessions, are tested from Python
-- (test/python/test_stats.py).
--
CREATE EXTENSION IF NOT EXISTS streampos;
\set VERBOSITY default
SET search_path = public;

SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod)
FROM pg_attribute a
WHERE a.attrelid = 'streampos.stat_streams'::regclass AND a.attnum > 0
ORDER BY a.attnum;
SELECT a.attname, pg_catalog.format_type(a.atttypid, a.atttypmod)
FROM pg_attribute a
WHERE a.attrelid = 'streampos.stat_registry'::regclass AND a.attnum > 0
ORDER BY a.attnum;

-- One row per stream of the database, counting from zero.
SELECT streampos.create_stream('st_events')::text;
SELECT streampos.create_stream('st_backfill', backwards => true)::text;
BEGIN;
SELECT streampos.next_ids('st_events', 'w1', 3);
COMMIT;
BEGIN;
SELECT streampos.next_id('st_events', 'w2');
ROLLBACK;
SELECT streampos.next_id('st_backfill', 'w1');
SELECT stream_name, ids_allocated, xact_commit, xact_rollback, max_allocated, frontier,
       frontier_lag_ids, ids_in_flight, oldest_in_flight_seconds, followers_waiting
FROM streampos.stat_streams WHERE stream_name LIKE 'st\_%' ORDER BY 1;
SELECT streams_max, ring_size >= 65536 AS ring_size_ok FROM streampos.stat_registry;

-- Everyone reads them; resetting is not for PUBLIC, as pg_stat_reset().
CREATE ROLE regress_stats_reader;
SET ROLE regress_stats_reader;
SELECT count(*) > 0 AS readable FROM streampos.stat_streams;
SELECT count(*) AS one_row FROM streampos.stat_registry;
SELECT streampos.stat_reset();
RESET ROLE;
SELECT streampos.stat_reset();
SELECT stream_name, ids_allocated, xact_commit, xact_rollback, stats_reset IS NOT NULL AS reset
FROM streampos.stat_streams WHERE stream_name LIKE 'st\_%' ORDER BY 1;

SELECT streampos.drop_stream('st_events');
SELECT streampos.drop_stream('st_backfill');
DROP ROLE regress_stats_reader;
