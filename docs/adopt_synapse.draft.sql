-- DRAFT — NOT LOADED BY THE EXTENSION.
--
-- A reference sketch of streampos.adopt_synapse() in plpgsql, written against
-- the public API (adopt_stream, add_table, check_stream) plus direct writes
-- where the API has no call for what adoption needs:
--
--   * importing an instance WITH A GIVEN ID: INSERT INTO streampos.instances
--     (instance_id, instance_name) (the identity is BY DEFAULT, so this works,
--     but there is no function for it), and moving the identity's sequence
--     past every imported id with setval (PUBLIC has USAGE on it, not the
--     UPDATE that setval needs);
--   * importing stored positions: INSERT INTO streampos.stream_positions
--     (PUBLIC may only SELECT it);
--   * the stream map itself (synapse_streams() below, generated from
--     sql/synapse_streams.tsv).
--
-- So as written it needs a superuser (or the extension's owner); the real
-- function lives in the extension with its privilege model.
--
-- Try the tests against it:
--   STREAMPOS_TEST_EXTRA_SQL=docs/adopt_synapse.draft.sql \
--       .venv/bin/python -m pytest test/python/test_adopt_synapse.py
--
-- Decisions taken here (the tests accept them; see docs/synapse-streams.md):
--   * writers: NULL (any instance) for every stream. Writer lists live in
--     homeserver.yaml, not in the database; a list guessed from
--     stream_positions would lock out a configured writer that never wrote.
--   * result actions: adopted, imported (an instance), repaired, unchanged,
--     skipped; detail says what and why.
--   * not Synapse: 55000 with a detail naming the missing tables; a missing
--     schema: 3F000; an instance that streampos already knows under another
--     id (or an id it gives another name): 55000, nothing changed.

CREATE OR REPLACE FUNCTION streampos.synapse_streams()
RETURNS TABLE(stream_name text, sequence_name text, backwards boolean, table_position integer,
              table_name text, instance_column text, id_column text)
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $map$
    VALUES
        ('account_data', 'account_data_sequence', false, 1, 'room_account_data', 'instance_name', 'stream_id'),
        ('account_data', 'account_data_sequence', false, 2, 'room_tags_revisions', 'instance_name', 'stream_id'),
        ('account_data', 'account_data_sequence', false, 3, 'account_data', 'instance_name', 'stream_id'),
        ('backfill', 'events_backfill_stream_seq', true, 1, 'events', 'instance_name', 'stream_ordering'),
        ('backfill', 'events_backfill_stream_seq', true, 2, 'ex_outlier_stream', 'instance_name', 'event_stream_ordering'),
        ('caches', 'cache_invalidation_stream_seq', false, 1, 'cache_invalidation_stream_by_instance', 'instance_name', 'stream_id'),
        ('device_lists_stream', 'device_lists_sequence', false, 1, 'device_lists_stream', 'instance_name', 'stream_id'),
        ('device_lists_stream', 'device_lists_sequence', false, 2, 'user_signature_stream', 'instance_name', 'stream_id'),
        ('device_lists_stream', 'device_lists_sequence', false, 3, 'device_lists_outbound_pokes', 'instance_name', 'stream_id'),
        ('device_lists_stream', 'device_lists_sequence', false, 4, 'device_lists_changes_in_room', 'instance_name', 'stream_id'),
        ('device_lists_stream', 'device_lists_sequence', false, 5, 'device_lists_remote_pending', 'instance_name', 'stream_id'),
        ('device_lists_stream', 'device_lists_sequence', false, 6, 'device_lists_changes_converted_stream_position', 'instance_name', 'stream_id'),
        ('e2e_cross_signing_keys', 'e2e_cross_signing_keys_sequence', false, 1, 'e2e_cross_signing_keys', 'instance_name', 'stream_id'),
        ('events', 'events_stream_seq', false, 1, 'events', 'instance_name', 'stream_ordering'),
        ('events', 'events_stream_seq', false, 2, 'current_state_delta_stream', 'instance_name', 'stream_id'),
        ('events', 'events_stream_seq', false, 3, 'ex_outlier_stream', 'instance_name', 'event_stream_ordering'),
        ('presence_stream', 'presence_stream_sequence', false, 1, 'presence_stream', 'instance_name', 'stream_id'),
        ('profile_updates', 'profile_updates_sequence', false, 1, 'profile_updates', 'instance_name', 'stream_id'),
        ('push_rules_stream', 'push_rules_stream_sequence', false, 1, 'push_rules_stream', 'instance_name', 'stream_id'),
        ('pushers', 'pushers_sequence', false, 1, 'pushers', 'instance_name', 'id'),
        ('pushers', 'pushers_sequence', false, 2, 'deleted_pushers', 'instance_name', 'stream_id'),
        ('quarantined_media', 'quarantined_media_id_seq', false, 1, 'quarantined_media_changes', 'instance_name', 'stream_id'),
        ('receipts', 'receipts_sequence', false, 1, 'receipts_linearized', 'instance_name', 'stream_id'),
        ('sticky_events', 'sticky_events_sequence', false, 1, 'sticky_events', 'instance_name', 'stream_id'),
        ('thread_subscriptions', 'thread_subscriptions_sequence', false, 1, 'thread_subscriptions', 'instance_name', 'stream_id'),
        ('to_device', 'device_inbox_sequence', false, 1, 'device_inbox', 'instance_name', 'stream_id'),
        ('to_device', 'device_inbox_sequence', false, 2, 'device_federation_outbox', 'instance_name', 'stream_id'),
        ('un_partial_stated_event_stream', 'un_partial_stated_event_stream_sequence', false, 1, 'un_partial_stated_event_stream', 'instance_name', 'stream_id'),
        ('un_partial_stated_room_stream', 'un_partial_stated_room_stream_sequence', false, 1, 'un_partial_stated_room_stream', 'instance_name', 'stream_id')

$map$;

CREATE OR REPLACE FUNCTION streampos.adopt_synapse(schema name DEFAULT 'public')
RETURNS TABLE(stream text, action text, detail text)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    missing text[];
    r record;
    m record;
    t record;
    c record;
    known_id integer;
    known_name text;
    highest_id bigint;
    synapse_seq text;
    target_seq regclass;
    target_table regclass;
    increment bigint;
    cache bigint;
    existing record;
    is_new boolean;
    added text[];
    skipped_tables text[];
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace n WHERE n.nspname OPERATOR(pg_catalog.=) schema) THEN
        RAISE EXCEPTION 'schema "%" does not exist', schema USING ERRCODE = '3F000';
    END IF;
    SELECT pg_catalog.array_agg(n ORDER BY n) INTO missing
    FROM pg_catalog.unnest(ARRAY['schema_version', 'instance_map', 'stream_positions']) n
    WHERE pg_catalog.to_regclass(pg_catalog.format('%I.%I', schema, n)) IS NULL;
    IF missing IS NOT NULL THEN
        RAISE EXCEPTION 'schema "%" does not hold a Synapse database', schema
            USING ERRCODE = '55000',
                  DETAIL = pg_catalog.format('It has no table %s.', pg_catalog.array_to_string(missing, ', ')),
                  HINT = 'Pass the schema Synapse uses: streampos.adopt_synapse(''<schema>'').';
    END IF;

    -- One adoption at a time (the mode conflicts with itself).
    LOCK TABLE streampos.streams IN SHARE ROW EXCLUSIVE MODE;

    -- The map is schema 94's (Synapse 1.163.2): a newer Synapse may have
    -- streams it does not know.
    EXECUTE pg_catalog.format('SELECT pg_catalog.max(version)::bigint FROM %I.schema_version', schema) INTO highest_id;
    IF highest_id OPERATOR(pg_catalog.>) 94 THEN
        stream := NULL; action := 'skipped';
        detail := pg_catalog.format('Synapse schema %s is newer than the stream map (94): streams added since are not adopted.', highest_id);
        RETURN NEXT;
    END IF;

    -- Instances: Synapse's ids, unchanged, or nothing.
    FOR r IN EXECUTE pg_catalog.format(
        'SELECT instance_id, instance_name FROM %I.instance_map ORDER BY instance_id', schema)
    LOOP
        SELECT i.instance_id INTO known_id FROM streampos.instances i
        WHERE i.instance_name OPERATOR(pg_catalog.=) r.instance_name;
        IF FOUND AND known_id OPERATOR(pg_catalog.=) r.instance_id THEN
            CONTINUE;
        END IF;
        IF FOUND THEN
            RAISE EXCEPTION 'instance "%" has id % in streampos but % in Synapse''s instance_map',
                r.instance_name, known_id, r.instance_id
                USING ERRCODE = '55000',
                      DETAIL = 'Tokens clients hold name writers by Synapse''s ids; importing would change what they mean.';
        END IF;
        SELECT i.instance_name INTO known_name FROM streampos.instances i
        WHERE i.instance_id OPERATOR(pg_catalog.=) r.instance_id;
        IF FOUND THEN
            RAISE EXCEPTION 'instance id % is "%" in streampos but "%" in Synapse''s instance_map',
                r.instance_id, known_name, r.instance_name
                USING ERRCODE = '55000',
                      DETAIL = 'Tokens clients hold name writers by Synapse''s ids; importing would change what they mean.';
        END IF;
        INSERT INTO streampos.instances (instance_id, instance_name) VALUES (r.instance_id, r.instance_name);
        stream := NULL; action := 'imported';
        detail := pg_catalog.format('Instance %s has id %s.', r.instance_name, r.instance_id);
        RETURN NEXT;
    END LOOP;
    -- New names get ids Synapse never gave: past every imported id and past
    -- instance_map's own sequence (its upserts burn values).
    EXECUTE pg_catalog.format('SELECT pg_catalog.max(instance_id)::bigint FROM %I.instance_map', schema) INTO highest_id;
    synapse_seq := pg_catalog.pg_get_serial_sequence(pg_catalog.format('%I.instance_map', schema), 'instance_id');
    IF synapse_seq IS NOT NULL THEN
        EXECUTE pg_catalog.format('SELECT GREATEST($1, last_value) FROM %s', synapse_seq)
            INTO highest_id USING COALESCE(highest_id, 0);
    END IF;
    SELECT GREATEST(highest_id, pg_catalog.max(i.instance_id)) INTO highest_id FROM streampos.instances i;
    IF highest_id OPERATOR(pg_catalog.>) 0 THEN
        PERFORM pg_catalog.setval(pg_catalog.pg_get_serial_sequence('streampos.instances', 'instance_id'), highest_id, true);
    END IF;

    FOR m IN
        SELECT DISTINCT s.stream_name, s.sequence_name, s.backwards FROM streampos.synapse_streams() s ORDER BY 1
    LOOP
        stream := m.stream_name;
        target_seq := pg_catalog.to_regclass(pg_catalog.format('%I.%I', schema, m.sequence_name));
        IF target_seq IS NULL THEN
            action := 'skipped';
            detail := pg_catalog.format('Sequence %I.%I does not exist (a Synapse older than the map).', schema, m.sequence_name);
            RETURN NEXT;
            CONTINUE;
        END IF;
        SELECT ps.seqincrement, ps.seqcache INTO increment, cache FROM pg_catalog.pg_sequence ps
        WHERE ps.seqrelid OPERATOR(pg_catalog.=) target_seq;
        IF increment IS DISTINCT FROM 1 OR cache IS DISTINCT FROM 1 THEN
            action := 'skipped';
            detail := pg_catalog.format('Sequence %s has INCREMENT %s and CACHE %s; streampos needs 1 and 1 (ALTER SEQUENCE %s CACHE 1).',
                                        target_seq, increment, cache, target_seq);
            RETURN NEXT;
            CONTINUE;
        END IF;

        SELECT st.seq, st.backwards INTO existing FROM streampos.streams st
        WHERE st.stream_name OPERATOR(pg_catalog.=) m.stream_name;
        IF FOUND AND (existing.seq OPERATOR(pg_catalog.<>) target_seq OR existing.backwards OPERATOR(pg_catalog.<>) m.backwards) THEN
            action := 'skipped';
            detail := pg_catalog.format('Stream %s is registered already, with sequence %s%s.', m.stream_name, existing.seq,
                                        CASE WHEN existing.backwards THEN ' backwards' ELSE '' END);
            RETURN NEXT;
            CONTINUE;
        END IF;
        is_new := NOT FOUND;
        IF is_new THEN
            -- Writers NULL: any instance (their lists are in homeserver.yaml).
            PERFORM streampos.adopt_stream(m.stream_name, target_seq, m.backwards, NULL);
        END IF;

        added := ARRAY[]::text[];
        skipped_tables := ARRAY[]::text[];
        FOR t IN
            SELECT s.table_name, s.instance_column, s.id_column FROM streampos.synapse_streams() s
            WHERE s.stream_name OPERATOR(pg_catalog.=) m.stream_name ORDER BY s.table_position
        LOOP
            target_table := pg_catalog.to_regclass(pg_catalog.format('%I.%I', schema, t.table_name));
            IF target_table IS NULL THEN
                skipped_tables := skipped_tables OPERATOR(pg_catalog.||) t.table_name;
                CONTINUE;
            END IF;
            IF NOT EXISTS (
                SELECT 1 FROM streampos.stream_tables x
                WHERE x.stream_name OPERATOR(pg_catalog.=) m.stream_name AND x.tbl OPERATOR(pg_catalog.=) target_table
                  AND x.id_column OPERATOR(pg_catalog.=) t.id_column
                  AND x.instance_column OPERATOR(pg_catalog.=) t.instance_column)
            THEN
                PERFORM streampos.add_table(m.stream_name, target_table, t.id_column, t.instance_column);
                added := added OPERATOR(pg_catalog.||) target_table::text;
            END IF;
        END LOOP;

        IF is_new OR pg_catalog.cardinality(added) OPERATOR(pg_catalog.>) 0 THEN
            action := 'adopted';
            detail := pg_catalog.format('Sequence %s%s, tables %s.', target_seq,
                                        CASE WHEN m.backwards THEN ' (backwards)' ELSE '' END,
                                        pg_catalog.array_to_string(added, ', '));
        ELSE
            action := 'unchanged';
            detail := 'Registered already, as the map says.';
        END IF;
        RETURN NEXT;
        IF pg_catalog.cardinality(skipped_tables) OPERATOR(pg_catalog.>) 0 THEN
            action := 'skipped';
            detail := pg_catalog.format('No table %s in schema %s.', pg_catalog.array_to_string(skipped_tables, ', '), schema);
            RETURN NEXT;
        END IF;

        -- Synapse's positions: never ahead of the truth, so kept unless
        -- streampos already stored a later one.
        EXECUTE pg_catalog.format(
            'INSERT INTO streampos.stream_positions AS p (stream_name, instance_name, stream_id) '
            'SELECT s.stream_name, s.instance_name, s.stream_id FROM %I.stream_positions s '
            'WHERE s.stream_name OPERATOR(pg_catalog.=) $1 '
            'ON CONFLICT (stream_name, instance_name) DO UPDATE SET stream_id = EXCLUDED.stream_id '
            'WHERE pg_catalog.abs(EXCLUDED.stream_id) OPERATOR(pg_catalog.>) pg_catalog.abs(p.stream_id)', schema)
            USING m.stream_name;

        FOR c IN SELECT * FROM streampos.check_stream(m.stream_name, repair => true) LOOP
            IF c.check_name OPERATOR(pg_catalog.=) 'repair' THEN
                action := 'repaired';
                detail := c.detail;
                RETURN NEXT;
            END IF;
        END LOOP;
    END LOOP;
END
$fn$;
