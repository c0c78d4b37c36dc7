--
-- unlogged_sequences: an UNLOGGED sequence is reset at crash recovery and
-- would hand out its IDs again, so a stream never uses one. PostgreSQL 15
-- introduced unlogged sequences: on 14 the CREATE fails and so does the
-- adoption (unlogged_sequences_1.out).
--
CREATE EXTENSION IF NOT EXISTS streampos;
\set VERBOSITY default
SET search_path = public;
CREATE UNLOGGED SEQUENCE api_unlogged;
SELECT streampos.adopt_stream('api_u', 'api_unlogged');
DROP SEQUENCE api_unlogged;
