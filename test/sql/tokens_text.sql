--
-- tokens_text: text and binary input/output, casts and constructors of
-- streampos.room_stream_token and streampos.multi_writer_token.
--
-- The contract is docs/tokens.md and docs/contract.md ("Tokens", "Errors"): Synapse's text format
-- byte for byte, canonical output (instances ascending, empty m-token as s),
-- malformed text 22P02 with the offending text in the message, out-of-range
-- numbers 22003, binary I/O (bad bytes 22P03), casts to/from text and between
-- the two types for live tokens, bad constructor arguments 22023.
--
-- (quietly: the other test files may have created it already)
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS streampos;
RESET client_min_messages;
SET search_path = public, streampos;
\set VERBOSITY default

-- Tries a text -> token conversion and reports either the canonical output
-- or the error (SQLSTATE, message, DETAIL), so that one query can cover many
-- bad inputs.
CREATE FUNCTION try_input(input text, typ regtype,
                          OUT output text, OUT err_state text,
                          OUT err_message text, OUT err_detail text)
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('SELECT %L::%s::text', input, typ) INTO output;
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE,
                            err_message = MESSAGE_TEXT,
                            err_detail = PG_EXCEPTION_DETAIL;
END
$$;

-- Runs a query returning one text value and reports it or the SQLSTATE.
CREATE FUNCTION try_sql(query text, OUT output text, OUT err_state text)
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE query INTO output;
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE;
END
$$;

---------------------------------------------------------------------------
-- 1. Valid room_stream_token text: every form, printed canonically.
--    `canonical_is_fixed_point` proves the output parses back to itself.
---------------------------------------------------------------------------
SELECT input,
       input::room_stream_token AS token,
       input::room_stream_token::text::room_stream_token::text
           = input::room_stream_token::text AS canonical_is_fixed_point
FROM (VALUES
    ('s5'), ('s0'), ('s-5'), ('s-0'), ('s007'), ('s-007'), ('s2633508'),
    ('s9223372036854775807'),                   -- i64 max
    ('s-9223372036854775808'),                  -- i64 min
    ('s00000000000000000000000000009'),         -- > 19 digits, but only zeros
    ('t426-2633508'),
    ('t5-12'),
    ('t5--12'),                                 -- negative stream part
    ('t-3-4'), ('t-3--4'), ('t0-0'), ('t007-008'),
    ('t9223372036854775807-9223372036854775807'),
    ('t-9223372036854775808--9223372036854775808'),
    ('m5'),                                     -- no entries: prints as s5
    ('m5~'),                                    -- empty trailing entry (old Synapse)
    ('m-5~'),
    ('m5~2.7'), ('m5~2.7~'),
    ('m56~2.58~3.59'),
    ('m56~3.59~2.58'),                          -- sorted by instance id on output
    ('m1~9.2~-4.3~0.4~3.5'),                    -- negative and zero instance ids
    ('m-5~1.-3'),                               -- negative positions
    ('m05~02.06'),                              -- leading zeros everywhere
    ('m5~2147483647.6'),                        -- i32 max instance id
    ('m5~-2147483648.6'),                       -- i32 min instance id
    ('m-9223372036854775808~1.9223372036854775807')
) AS v(input);

---------------------------------------------------------------------------
-- 2. Valid multi_writer_token text.
---------------------------------------------------------------------------
SELECT input,
       input::multi_writer_token AS token,
       input::multi_writer_token::text::multi_writer_token::text
           = input::multi_writer_token::text AS canonical_is_fixed_point
FROM (VALUES
    ('5'), ('0'), ('-5'), ('-0'), ('007'),
    ('9223372036854775807'), ('-9223372036854775808'),
    ('m5'), ('m5~'),                            -- both print as 5
    ('m5~1.6'),
    ('m5~3.9~1.6'),
    ('m5~1.6~'),
    ('m-5~1.-4')
) AS v(input);

-- Different spellings of one value are equal (= compares canonical values).
SELECT 'm56~3.59~2.58'::room_stream_token = 'm56~2.58~3.59' AS unsorted_eq_sorted,
       'm5~'::room_stream_token = 's5' AS empty_entry_eq_s,
       'm5'::room_stream_token = 's5' AS m_eq_s,
       's007'::room_stream_token = 's7' AS leading_zeros,
       's-0'::room_stream_token = 's0' AS minus_zero,
       'm5~'::multi_writer_token = '5' AS mw_empty_entry,
       'm5~3.9~1.6'::multi_writer_token = 'm5~1.6~3.9' AS mw_unsorted;

---------------------------------------------------------------------------
-- 3. Invalid room_stream_token text: one row per case with its SQLSTATE,
--    message (which must quote the offending text) and DETAIL.
--    22P02 = malformed, 22003 = number out of range. Grammar errors win over
--    range errors, which win over semantic errors (core/src/token/ docs).
---------------------------------------------------------------------------
SELECT input, r.output, r.err_state, r.err_message, r.err_detail
FROM (VALUES
    (''), ('s'), ('x5'), ('S5'), ('5'), ('-5'), ('+5'),
    ('s5 '), (' s5'), ('s+5'), ('s5_0'), ('s5.0'), ('s-'), ('s--5'), ('s5x'),
    ('sé'),
    ('t'), ('t5'), ('t5-'), ('t-5'), ('t5---1'), ('t5-1x'), ('t5~1'), ('tt5-5'),
    ('m'), ('m~2.3'), ('m-'), ('m5~2'), ('m5~2.'), ('m5~.3'), ('m5.2'),
    ('m5~2.7.8'), ('m5~2.+7'), ('m5~+2.7'), ('m5 ~2.7'), ('m5~2.7x'),
    ('m5~~2.7'),                                -- empty entry not at the end
    ('m5~~'), ('m5~2.7~~'),
    ('m5~2.5'),                                 -- position = minimum
    ('m5~2.4'),                                 -- position < minimum
    ('m5~2.3~2.4'), ('m5~2.6~2.7'),             -- duplicate instance id
    ('m5~3.9~2.6~3.7'),                         -- duplicate, not adjacent in input
    ('s9223372036854775808'),                   -- i64 max + 1
    ('s-9223372036854775809'),                  -- i64 min - 1
    ('s99999999999999999999'),
    ('t99999999999999999999-1'), ('t1-99999999999999999999'),
    ('m5~2147483648.9'), ('m5~-2147483649.9'),  -- instance id is an i32
    ('m5~2.99999999999999999999'), ('m99999999999999999999~2.3'),
    ('s99999999999999999999x'),                 -- grammar wins over range
    ('m5~2147483648.9~~'),                      -- grammar wins over range
    ('m5~2.4~3.99999999999999999999')           -- range wins over semantics
) AS v(input),
LATERAL try_input(v.input, 'room_stream_token') AS r;

-- Long input is clipped in the message (200 bytes) and the DETAIL (40).
SELECT length(r.err_message) AS message_length, r.err_state,
       r.err_message LIKE 'value out of range for type room_stream_token: "s999%..."' AS message_clipped,
       r.err_detail
FROM try_input('s' || repeat('9', 300), 'room_stream_token') AS r;

---------------------------------------------------------------------------
-- 4. Invalid multi_writer_token text.
---------------------------------------------------------------------------
SELECT input, r.output, r.err_state, r.err_message, r.err_detail
FROM (VALUES
    (''), ('s5'), ('t1-2'), ('x'), ('5x'), ('-'), ('--5'), ('+5'),
    (' 5'), ('5 '), ('5_0'), ('5_000'), ('5.0'),
    ('m'), ('m5~1.5'), ('m5~1.4'), ('m5~1.6~1.7'), ('m5~~1.7'),
    ('9223372036854775808'), ('-9223372036854775809'),
    ('m5~2147483648.9')
) AS v(input),
LATERAL try_input(v.input, 'multi_writer_token') AS r;

---------------------------------------------------------------------------
-- 5. The full error report (message, caret, DETAIL) of a few cases, as a
--    client sees it.
---------------------------------------------------------------------------
SELECT 's5 '::room_stream_token;
SELECT ''::room_stream_token;
SELECT ''::multi_writer_token;
SELECT 'm5~~2.7'::room_stream_token;
SELECT 'm5~2.5'::room_stream_token;
SELECT 'm5~2.6~2.7'::room_stream_token;
SELECT 's5'::multi_writer_token;
SELECT '+5'::multi_writer_token;
SELECT '5_0'::multi_writer_token;
SELECT 's9223372036854775808'::room_stream_token;
SELECT 'm5~2147483648.9'::multi_writer_token;
-- Also through an input function call with a text argument (not a literal).
SELECT CAST(x AS room_stream_token) FROM (VALUES ('t1')) AS v(x);

---------------------------------------------------------------------------
-- 6. Casts: text <-> token, room <-> multi_writer for live tokens.
---------------------------------------------------------------------------
SELECT 's5'::text::room_stream_token AS text_to_room,
       'm5~2.7'::text::multi_writer_token AS text_to_mw,
       ('m56~3.59~2.58'::room_stream_token)::text AS room_to_text,
       ('m5~3.9~1.6'::multi_writer_token)::varchar AS mw_to_varchar,
       pg_typeof(('s5'::room_stream_token)::text) AS text_type;

-- Live room tokens cast to multi-writer tokens and back, unchanged.
SELECT r AS room,
       r::multi_writer_token AS as_mw,
       r::multi_writer_token::room_stream_token AS back,
       r::multi_writer_token::room_stream_token = r AS round_trips
FROM (VALUES ('s5'::room_stream_token), ('s-5'), ('s0'), ('m5~'),
             ('m5~2.7'), ('m56~3.59~2.58'),
             ('s9223372036854775807'), ('s-9223372036854775808')) AS v(r);

SELECT m AS mw,
       m::room_stream_token AS as_room,
       m::room_stream_token::multi_writer_token = m AS round_trips
FROM (VALUES ('5'::multi_writer_token), ('-5'), ('m5~1.6~3.9')) AS v(m);

-- A historical token has no multi-writer form: a clear 22023 error.
SELECT 't426-2633508'::room_stream_token::multi_writer_token;
SELECT * FROM try_sql($q$SELECT 't5--12'::room_stream_token::multi_writer_token::text$q$);
-- The casts are explicit only: tokens of the two types do not mix silently.
SELECT 's5'::room_stream_token = '5'::multi_writer_token;

---------------------------------------------------------------------------
-- 7. Constructors.
---------------------------------------------------------------------------
SELECT make_room_token(5) AS no_entries,
       make_room_token(5, NULL, NULL) AS null_arrays,
       make_room_token(5, '{}', '{}') AS empty_arrays,
       make_room_token(5, '{3,2}', '{9,7}') AS unsorted_ids,
       make_room_token(-5, '{1}', '{-3}') AS negative,
       make_historical_token(426, 2633508) AS historical,
       make_historical_token(5, -12) AS historical_negative_stream,
       make_multi_writer_token(5) AS mw_no_entries,
       make_multi_writer_token(5, '{3,1}', '{9,6}') AS mw_unsorted;

-- Constructed tokens equal the parsed ones.
SELECT make_room_token(56, '{3,2}', '{59,58}') = 'm56~2.58~3.59' AS room_eq,
       make_multi_writer_token(56, '{3,2}', '{59,58}') = 'm56~2.58~3.59' AS mw_eq,
       make_historical_token(1, 2) = 't1-2' AS hist_eq;

-- make_historical_token is strict.
SELECT make_historical_token(NULL, 1) IS NULL AS null_topo,
       make_historical_token(1, NULL) IS NULL AS null_stream;

-- Bad arguments: 22023 each, with a DETAIL where one helps.
SELECT make_room_token(5, '{2}', '{}');
SELECT make_room_token(5, '{2}', NULL);
SELECT make_room_token(5, NULL, '{7}');
SELECT make_room_token(5, '{2,NULL}', '{7,8}');
SELECT make_room_token(5, '{2}', '{NULL}');
SELECT make_room_token(5, '{2}', '{5}');
SELECT make_room_token(5, '{2,3}', '{7,4}');
SELECT make_room_token(5, '{2,2}', '{7,8}');
SELECT make_room_token(5, '{2,2}', '{4,8}');     -- position check comes first
SELECT make_multi_writer_token(5, '{1,2}', '{7}');
SELECT make_multi_writer_token(5, '{1}', '{5}');
SELECT make_multi_writer_token(5, '{1,1}', '{6,7}');

-- The SQLSTATEs of those errors.
SELECT q, r.*
FROM (VALUES
    ($q$SELECT make_room_token(5, '{2}', '{}')::text$q$),
    ($q$SELECT make_room_token(5, '{2,NULL}', '{7,8}')::text$q$),
    ($q$SELECT make_room_token(5, '{2}', '{5}')::text$q$),
    ($q$SELECT make_room_token(5, '{2,2}', '{7,8}')::text$q$),
    ($q$SELECT make_multi_writer_token(5, '{1}', '{5}')::text$q$),
    ($q$SELECT make_multi_writer_token(5, '{1,1}', '{6,7}')::text$q$),
    ($q$SELECT 't1-2'::room_stream_token::multi_writer_token::text$q$),
    ($q$SELECT make_room_token(5, '{2,3}', '{9,7}')::text$q$)
) AS v(q),
LATERAL try_sql(v.q) AS r;

---------------------------------------------------------------------------
-- 8. Binary output (send): the documented wire format, big-endian:
--    version 1, kind (0 live / 1 historical), stream i64, topological i64 if
--    historical, u32 count, count x (i32 id, i64 pos) ascending.
---------------------------------------------------------------------------
SELECT t, room_stream_token_send(t)
FROM (VALUES ('s5'::room_stream_token), ('s-1'), ('t426-2633508'), ('t5--12'),
             ('m56~3.59~2.58')) AS v(t);
SELECT t, multi_writer_token_send(t)
FROM (VALUES ('5'::multi_writer_token), ('m56~3.59~2.58')) AS v(t);
-- Equal tokens send identical bytes.
SELECT room_stream_token_send('m56~3.59~2.58') = room_stream_token_send('m56~2.58~3.59') AS same_bytes,
       room_stream_token_send('m5~') = room_stream_token_send('s5') AS same_bytes_s,
       room_stream_token_send('s5') = multi_writer_token_send('5') AS same_as_mw;

---------------------------------------------------------------------------
-- 9. Binary round trip through COPY (FORMAT binary): send then recv gives
--    back exactly the original values, for both types, NULLs included.
---------------------------------------------------------------------------
SELECT '/tmp/streampos_regress_' || current_setting('port') || '_tokens.bin' AS tokens_file,
       '/tmp/streampos_regress_' || current_setting('port') || '_recv.bin' AS recv_file
\gset

CREATE TABLE tok_src (id int PRIMARY KEY, r room_stream_token, m multi_writer_token);
INSERT INTO tok_src
SELECT row_number() OVER (), r::room_stream_token,
       CASE WHEN r LIKE 't%' THEN NULL ELSE r::room_stream_token::multi_writer_token END
FROM (VALUES ('s5'), ('s-5'), ('s0'), ('s9223372036854775807'), ('s-9223372036854775808'),
             ('t426-2633508'), ('t5--12'), ('t-9223372036854775808--9223372036854775808'),
             ('m5~2.7'), ('m56~3.59~2.58'), ('m1~9.2~-4.3~0.4~3.5'),
             ('m-9223372036854775808~1.9223372036854775807'),
             ('m5~2147483647.6~-2147483648.7')) AS v(r);
INSERT INTO tok_src VALUES (100, NULL, NULL);

COPY (SELECT id, r, m FROM tok_src ORDER BY id) TO :'tokens_file' (FORMAT binary);
CREATE TABLE tok_dst (LIKE tok_src);
COPY tok_dst FROM :'tokens_file' (FORMAT binary);

SELECT s.id, s.r, d.r AS r_back, s.m, d.m AS m_back,
       s.r IS NOT DISTINCT FROM d.r AND s.m IS NOT DISTINCT FROM d.m AS same
FROM tok_src s JOIN tok_dst d USING (id)
ORDER BY s.id;
-- No row differs, in either direction.
(SELECT * FROM tok_src EXCEPT SELECT * FROM tok_dst)
UNION ALL
(SELECT * FROM tok_dst EXCEPT SELECT * FROM tok_src);

---------------------------------------------------------------------------
-- 10. Binary input (recv) of hand-made bytes. A binary COPY of a bytea value
--     writes exactly its bytes as the field, so reading that file into a
--     token column feeds the bytes to the token's receive function.
--     Bad bytes: 22P03 with a DETAIL saying what is wrong.
---------------------------------------------------------------------------
CREATE TABLE recv_target (room room_stream_token, mw multi_writer_token);

CREATE FUNCTION try_recv(bytes bytea, col name, file text,
                         OUT output text, OUT err_state text,
                         OUT err_message text, OUT err_detail text)
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('COPY (SELECT %L::bytea) TO %L (FORMAT binary)', bytes, file);
    BEGIN
        EXECUTE format('COPY recv_target (%I) FROM %L (FORMAT binary)', col, file);
        EXECUTE format('SELECT %I::text FROM recv_target', col) INTO output;
        DELETE FROM recv_target;
    EXCEPTION WHEN OTHERS THEN
        GET STACKED DIAGNOSTICS err_state = RETURNED_SQLSTATE,
                                err_message = MESSAGE_TEXT,
                                err_detail = PG_EXCEPTION_DETAIL;
    END;
END
$$;

SELECT v.col, v.case_name, r.output, r.err_state, r.err_message, r.err_detail
FROM (VALUES
    ('room', 'live s5',
     '\x01000000000000000005' || '00000000'),
    ('room', 'entries out of order are sorted',
     '\x01000000000000000005' || '00000002' || '000000030000000000000009' || '000000020000000000000007'),
    ('room', 'historical t426-2633508',
     '\x0101' || '0000000000282f24' || '00000000000001aa' || '00000000'),
    ('mw',   'multi-writer 5',
     '\x01000000000000000005' || '00000000'),
    ('mw',   'multi-writer m5~1.6',
     '\x01000000000000000005' || '00000001' || '000000010000000000000006'),
    ('room', 'empty',
     '\x'),
    ('room', 'version 2',
     '\x02000000000000000005' || '00000000'),
    ('room', 'version byte only',
     '\x01'),
    ('room', 'kind byte 2',
     '\x01020000000000000005' || '00000000'),
    ('mw',   'historical multi-writer',
     '\x0101' || '0000000000000001' || '0000000000000002' || '00000000'),
    ('room', 'header cut short',
     '\x0100000000000000'),
    ('room', 'historical with entries',
     '\x0101' || '0000000000000005' || '0000000000000001' || '00000001' || '000000020000000000000007'),
    ('room', 'count 1, no entry',
     '\x01000000000000000005' || '00000001'),
    ('room', 'huge count, short message',
     '\x01000000000000000005' || 'ffffffff' || '000000020000000000000007'),
    ('room', 'trailing byte',
     '\x01000000000000000005' || '00000000' || '00'),
    ('room', 'position = minimum',
     '\x01000000000000000005' || '00000001' || '000000020000000000000005'),
    ('mw',   'position < minimum',
     '\x01000000000000000005' || '00000001' || '000000020000000000000004'),
    ('room', 'duplicate instance',
     '\x01000000000000000005' || '00000002' || '000000020000000000000007' || '000000020000000000000008')
) AS v(col, case_name, hex),
LATERAL try_recv(decode(substr(v.hex, 3), 'hex'), v.col, :'recv_file') AS r;

-- The full report of one bad binary value, with the COPY context.
COPY (SELECT '\x02000000000000000005000000'::bytea) TO :'recv_file' (FORMAT binary);
COPY recv_target (room) FROM :'recv_file' (FORMAT binary);

---------------------------------------------------------------------------
-- 11. Large tokens (3000 writers, 36 kB) are compressed / moved out of line
--     by TOAST and read back intact.
---------------------------------------------------------------------------
CREATE TABLE tok_large (id int, t room_stream_token, m multi_writer_token);
INSERT INTO tok_large
SELECT 1, make_room_token(0, ids, pos), make_multi_writer_token(0, ids, pos)
FROM (SELECT array_agg(i ORDER BY i) AS ids,
             array_agg(1 + (i * 7919) % 1000003::bigint ORDER BY i) AS pos
      FROM generate_series(1, 3000) AS i) AS s;
SELECT pg_column_size(t) < 36009 AS compressed,
       length(t::text) AS text_length, md5(t::text) AS text_md5,
       stream_pos(t), max_stream_pos(t), instance_pos(t, 2999),
       t = t::text::room_stream_token AS round_trips,
       m::room_stream_token = t AS same_as_mw,
       md5(room_stream_token_send(t)) = md5(multi_writer_token_send(m)) AS same_wire
FROM tok_large;
-- Out of line: the TOAST table holds the value.
SELECT pg_relation_size(reltoastrelid) > 0 AS toasted
FROM pg_class WHERE relname = 'tok_large';

-- A NULL minimum gives a NULL token: the constructors are not STRICT (so that
-- the arrays may be NULL), and must not fail on a NULL stream.
SELECT streampos.make_room_token(NULL) IS NULL AS room_null,
       streampos.make_multi_writer_token(NULL::bigint, '{1}', '{2}') IS NULL AS multi_writer_null;
