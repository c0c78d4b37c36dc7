--
-- api_errors: the single-session errors of streams, writers, allocation and
-- reading, with their exact messages, details and hints (their SQLSTATEs are in
-- docs/contract.md, "Errors"). Concurrency, privileges of other roles and
-- servers are tested from Python (test/python).
--
CREATE EXTENSION IF NOT EXISTS streampos;
\set VERBOSITY default
SET search_path = public;

-- Streams.
SELECT streampos.create_stream('api_s', writers => ARRAY['w1', 'w2'])::text;
SELECT streampos.create_stream('api_s');
SELECT streampos.create_stream('');
SELECT streampos.create_stream(repeat('x', 60));
SELECT streampos.create_stream('api_n', writers => ARRAY['w1', NULL]);
SELECT streampos.frontier('api_missing');
SELECT streampos.frontier(repeat('y', 1000));
CREATE TABLE api_t (id bigint, who text);
SELECT streampos.adopt_stream('api_t_stream', 'api_t');
CREATE SEQUENCE api_cached CACHE 10;
SELECT streampos.adopt_stream('api_c', 'api_cached');
SELECT streampos.adopt_stream('api_dup', 'streampos.api_s_seq');
CREATE SEQUENCE api_negative MINVALUE -10;
SELECT streampos.adopt_stream('api_m', 'api_negative');
CREATE SEQUENCE api_cycle CYCLE;
SELECT streampos.adopt_stream('api_y', 'api_cycle');
BEGIN;
SELECT streampos.create_stream('api_prepared')::text;
PREPARE TRANSACTION 'api_catalog';
SELECT streampos.add_table('api_s', 'api_t', 'nope');
SELECT streampos.add_table('api_s', 'api_t', 'id', 'nope');
SELECT streampos.add_table('api_s', 'api_t', 'id', 'who');

-- Instances.
SELECT streampos.instance_id('');
SELECT streampos.instance_name(-1);
SELECT streampos.instance_pos('s5'::streampos.room_stream_token, 'api_nobody');
UPDATE streampos.instances SET instance_name = 'renamed' WHERE instance_name = 'w1';
DELETE FROM streampos.instances WHERE instance_name = 'w1';
INSERT INTO streampos.instances (instance_id, instance_name) VALUES (0, 'api_zero');

-- Writing.
SELECT streampos.next_id('api_s', 'w3');
SELECT streampos.next_ids('api_s', 'w1', 0);
SELECT streampos.next_ids('api_s', 'w1', 1000001);
SELECT streampos.next_id('api_s', '');
BEGIN TRANSACTION READ ONLY;
SELECT streampos.next_id('api_s', 'w1');
ROLLBACK;
BEGIN;
SELECT streampos.next_id('api_s', 'w1');
SELECT streampos.frontier('api_s'), streampos.writer_position('api_s', 'w1'),
       streampos.writer_position('api_s', 'w2'), streampos.max_allocated('api_s');
PREPARE TRANSACTION 'api_p';
SELECT streampos.frontier('api_s'), streampos.max_allocated('api_s');
SELECT streampos.writer_position('api_s', 'w3');

-- A sequence moved back below what was handed out.
SELECT streampos.next_ids('api_s', 'w1', 3);
SELECT setval('streampos.api_s_seq', 1);
SELECT streampos.next_id('api_s', 'w1');
SELECT setval('streampos.api_s_seq', 4);

-- Followers.
SELECT streampos.updates('api_s', '0', 0);
SELECT streampos.updates('api_s', '0', 10001);
SELECT streampos.updates('api_s', '1000', 1);
SELECT streampos.wait_for('api_s', 1000, 10);
SELECT streampos.create_stream('api_back', backwards => true)::text;
SELECT streampos.updates('api_back', '0');

-- Checks.
SELECT * FROM streampos.check_stream('api_s');
SELECT streampos.drop_stream('api_s');
SELECT streampos.drop_stream('api_back');
SELECT streampos.drop_stream('api_s');
DROP TABLE api_t;
DROP SEQUENCE api_cached;
DROP SEQUENCE api_negative;
DROP SEQUENCE api_cycle;

-- An ID column that does not compare with bigint; a sequence that is gone;
-- a follower waiting for anything new (one past the highest allocated ID)
-- and beyond it.
SELECT streampos.create_stream('api_n')::text;
CREATE TABLE api_text_ids (id text, who text);
SELECT streampos.add_table('api_n', 'api_text_ids', 'id', 'who');
SELECT streampos.next_id('api_n', 'w');
SELECT streampos.wait_for('api_n', 2, 10);
SELECT streampos.wait_for('api_n', 3, 10);
CREATE TABLE api_serial (id bigserial, who text);
SELECT streampos.adopt_stream('api_gone', 'api_serial_id_seq');
DROP TABLE api_serial;
SELECT * FROM streampos.check_stream('api_gone');
SELECT streampos.next_id('api_gone', 'w');
SELECT streampos.drop_stream('api_gone');
SELECT streampos.drop_stream('api_n');
DROP TABLE api_text_ids;
