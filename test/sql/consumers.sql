--
-- consumers: the single-session errors of register_consumer, ack,
-- unregister_consumer, safe_to_delete and updates(consumer => …), with
-- their exact messages and details. Concurrency and other roles are tested
-- from Python (test/python/test_consumers.py).
--
CREATE EXTENSION IF NOT EXISTS streampos;
\set VERBOSITY default
SET search_path = public;

SELECT streampos.create_stream('con_s', writers => ARRAY['con_w1', 'con_w2'])::text;
CREATE TABLE con_ev (id bigint PRIMARY KEY, instance_name text);
SELECT streampos.add_table('con_s', 'con_ev', 'id', 'instance_name');
BEGIN;
INSERT INTO con_ev SELECT i, 'con_w1' FROM unnest(streampos.next_ids('con_s', 'con_w1', 3)) i;
COMMIT;

-- Registering.
SELECT streampos.safe_to_delete('con_s');
SELECT streampos.register_consumer('con_s', 'from_one', '1')::text;
SELECT streampos.register_consumer('con_s', 'sender')::text;
SELECT streampos.register_consumer('con_s', 'sender', '1')::text;
SELECT streampos.register_consumer('con_s', 'late', '0');
SELECT streampos.register_consumer('con_s', 'negative', '-1');
SELECT streampos.register_consumer('con_s', 'ahead', '4');
SELECT streampos.register_consumer('con_s', '');
SELECT streampos.register_consumer('con_s', repeat('c', 64));
SELECT streampos.register_consumer('con_missing', 'sender');
SELECT streampos.register_consumer(NULL, 'sender');
SELECT streampos.create_stream('con_back', backwards => true)::text;
SELECT streampos.register_consumer('con_back', 'sender');
SELECT stream_name, consumer_name, owner, position, lag_ids, lag_time >= interval '0' AS lag_time_known
FROM streampos.consumers WHERE stream_name = 'con_s' ORDER BY consumer_name;

-- Following.
SELECT streampos.updates('con_s', consumer => 'from_one');
SELECT streampos.updates('con_s', consumer => 'nobody');
SELECT streampos.updates('con_s', '1', consumer => 'from_one');
SELECT streampos.updates('con_s');
SELECT streampos.wait_for_consumer('con_s', 'from_one', 0)::text;
SELECT streampos.wait_for_consumer('con_s', 'nobody', 0);
SELECT streampos.wait_for_consumer('con_back', 'sender', 0);
SELECT streampos.wait_for_consumer('con_s', 'from_one', NULL) IS NULL AS strict;

-- Acknowledging.
SELECT streampos.ack('con_s', 'from_one', '3')::text;
SELECT streampos.ack('con_s', 'from_one', '2')::text;
SELECT streampos.ack('con_s', 'from_one', '4');
SELECT streampos.ack('con_s', 'nobody', '1');
SELECT streampos.ack('con_back', 'sender', '1');
SELECT streampos.safe_to_delete('con_s')::text;

-- Forgetting.
SELECT streampos.unregister_consumer('con_s', 'sender');
SELECT streampos.unregister_consumer('con_s', 'sender');
SELECT streampos.safe_to_delete('con_s')::text;
SELECT streampos.unregister_consumer('con_missing', 'sender');

SELECT streampos.drop_stream('con_s');
SELECT streampos.drop_stream('con_back');
SELECT count(*) FROM streampos.consumer_positions WHERE stream_name = 'con_s';
DROP TABLE con_ev;
