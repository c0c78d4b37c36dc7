--
-- tokens_ops: functions, operators, aggregates, operator classes and index
-- support of streampos.room_stream_token and streampos.multi_writer_token.
--
-- The contract is docs/tokens.md and docs/contract.md ("Tokens") and the docs of core/src/token/:
-- the causal order is_before_or_eq is Synapse's (writer by writer, a
-- historical token counting as s{stream}: its topological part is ignored),
-- advance = a least upper bound in that order, bound never raises a
-- component, and a total order (<, <=, ...) that extends is_before_or_eq:
--   key = (stream; sum of (pos - stream) over listed entries; listed entries
--          lexicographically; topological, live tokens as +infinity)
-- with btree and hash operator classes so tokens sort, index, group and join.
--
-- (quietly: the other test files may have created it already)
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS streampos;
RESET client_min_messages;
SET search_path = public, streampos;
\set VERBOSITY default

---------------------------------------------------------------------------
-- 1. Accessors: stream_pos (the minimum), max_stream_pos, topological
--    (NULL for live tokens), instance_pos by id (listed position, else the
--    minimum).
---------------------------------------------------------------------------
SELECT t, stream_pos(t), max_stream_pos(t), topological(t),
       instance_pos(t, 1) AS pos1, instance_pos(t, 2) AS pos2,
       instance_pos(t, 3) AS pos3
FROM (VALUES ('s5'::room_stream_token), ('s-5'), ('t426-2633508'), ('t5--12'),
             ('m56~2.58~3.59'), ('m56~3.59~2.58'), ('m-5~1.-3'),
             ('m5~2.100~3.7')) AS v(t);

SELECT t, stream_pos(t), max_stream_pos(t),
       instance_pos(t, 1) AS pos1, instance_pos(t, 2) AS pos2
FROM (VALUES ('5'::multi_writer_token), ('-5'), ('m5~1.6'), ('m5~2.9~1.6')) AS v(t);

-- The functions are strict.
SELECT stream_pos(NULL::room_stream_token) IS NULL AS a,
       max_stream_pos(NULL::multi_writer_token) IS NULL AS b,
       topological(NULL) IS NULL AS c,
       instance_pos('s5'::room_stream_token, NULL::integer) IS NULL AS d;

---------------------------------------------------------------------------
-- 2. instance_pos by instance name: resolves the name through
--    streampos.instances; an unknown name is 42704.
---------------------------------------------------------------------------
SELECT instance_id('w1') = instance_id('w1') AS w1_stable,
       instance_id('w2') <> instance_id('w1') AS w2_distinct;

CREATE TABLE named (t room_stream_token, m multi_writer_token);
INSERT INTO named
SELECT make_room_token(10, ARRAY[instance_id('w1')], ARRAY[15]),
       make_multi_writer_token(10, ARRAY[instance_id('w1')], ARRAY[15]);

SELECT instance_pos(t, 'w1') AS room_w1, instance_pos(t, 'w2') AS room_w2,
       instance_pos(m, 'w1') AS mw_w1, instance_pos(m, 'w2') AS mw_w2,
       instance_pos(t, 'w1') = instance_pos(t, instance_id('w1')) AS same_as_by_id
FROM named;
SELECT instance_pos('s5'::room_stream_token, 'no_such_writer');
SELECT instance_pos('5'::multi_writer_token, 'no_such_writer');

---------------------------------------------------------------------------
-- 3. is_before_or_eq: the causal order, with the expected value spelled out
--    per row. Synapse's: every writer's position in a is <= its position in
--    b, a historical token counting as s{stream} (its topological part is
--    ignored), so distinct tokens can be before-or-equal each other.
---------------------------------------------------------------------------
SELECT a, b, is_before_or_eq(a, b) AS got, expected,
       is_before_or_eq(a, b) = expected AS ok
FROM (VALUES
    ('t1-5'::room_stream_token, 't2-6'::room_stream_token, true),
    ('t1-5', 't1-5', true),
    ('t2-5', 't1-6', true),             -- topological part ignored
    ('t6-3', 't5-6', true),
    ('t1-6', 't2-5', false),            -- stream greater
    ('t1-5', 't2-5', true),             -- before-or-equal each other
    ('t2-5', 't1-5', true),
    ('t3-5', 's5', true),               -- historical vs live: as s{stream}
    ('s5', 't3-5', true),
    ('t3-6', 's5', false),
    ('t9-5', 'm4~1.9', false),          -- b's minimum 4 < 5, despite writer 1
    ('s5', 't100-100', true),
    ('s2', 't0-2', true),
    ('m5~1.9', 't0-9', true),           -- every writer of a at most 9
    ('m5~1.9', 't0-8', false),
    ('s5', 's5', true),
    ('s5', 's6', true),
    ('s6', 's5', false),
    ('s5', 'm5~1.6', true),
    ('m5~1.6', 's5', false),
    ('m5~1.6', 's6', true),
    ('m5~1.7', 's6', false),
    ('m5~1.7', 'm6~1.7', true),
    ('m5~1.7~2.8', 'm5~1.8~2.8', true),
    ('m5~1.7~2.8', 'm5~1.8', false),    -- writer 2: 8 > 5
    ('m5~2.8', 'm5~1.8', false),
    ('m5~1.8', 'm5~2.8', false),        -- incomparable pair
    ('m4~1.9', 'm5~1.9~2.6', true)
) AS v(a, b, expected);

SELECT a, b, is_before_or_eq(a, b) AS got
FROM (VALUES
    ('5'::multi_writer_token, 'm5~1.6'::multi_writer_token),
    ('m5~1.6', '5'),
    ('m5~1.6~2.9', 'm6~2.9'),
    ('m5~1.7~2.9', 'm6~2.9'),
    ('-5', '5')
) AS v(a, b);

---------------------------------------------------------------------------
-- 4. persisted_after(t, instance, stream_id): stream_id > that writer's
--    position in t.
---------------------------------------------------------------------------
SELECT t, i, sid, persisted_after(t, i, sid)
FROM (VALUES ('m5~2.7'::room_stream_token, 2, 7), ('m5~2.7', 2, 8),
             ('m5~2.7', 1, 5), ('m5~2.7', 1, 6),
             ('t3-10', 1, 10), ('t3-10', 1, 11),
             ('s-5', 1, -5), ('s-5', 1, -4)) AS v(t, i, sid);
SELECT persisted_after('m5~2.7'::multi_writer_token, 2, 7) AS a,
       persisted_after('m5~2.7'::multi_writer_token, 2, 8) AS b,
       persisted_after('m5~2.7'::multi_writer_token, 3, 6) AS c;

---------------------------------------------------------------------------
-- 5. in_range(low, high, instance, stream_id): low < position <= high for
--    that writer; a NULL bound is unbounded; a NULL stream_id gives NULL. A
--    NULL instance is the instance named master for room tokens (Synapse's
--    _filter_results_by_stream), here none exists yet: each token's
--    minimum; for multi-writer tokens always each token's minimum (Synapse's
--    is_stream_position_in_range). Section 6b creates master.
---------------------------------------------------------------------------
SELECT lo, hi, i, sid, in_range(lo, hi, i, sid) AS got, expected,
       in_range(lo, hi, i, sid) IS NOT DISTINCT FROM expected AS ok
FROM (VALUES
    -- writer 2 is at 7 in low and 12 in high
    ('m5~2.7'::room_stream_token, 'm10~2.12'::room_stream_token, 2, 7::bigint, false),
    ('m5~2.7', 'm10~2.12', 2, 8, true),
    ('m5~2.7', 'm10~2.12', 2, 12, true),
    ('m5~2.7', 'm10~2.12', 2, 13, false),
    -- writer 1 is at the minimum of both (5, 10)
    ('m5~2.7', 'm10~2.12', 1, 5, false),
    ('m5~2.7', 'm10~2.12', 1, 6, true),
    ('m5~2.7', 'm10~2.12', 1, 10, true),
    ('m5~2.7', 'm10~2.12', 1, 11, false),
    -- NULL instance, no master: the minimum (5, 10), not writer 2's position
    ('m5~2.7', 'm10~2.12', NULL, 6, true),
    ('m5~2.7', 'm10~2.12', NULL, 11, false),
    ('m5~1.8', 's10', 1, 6, false),
    ('m5~1.8', 's10', NULL, 6, true),
    -- NULL bounds are unbounded
    (NULL, 's10', 1, -1000, true),
    (NULL, 's10', 1, 11, false),
    ('s5', NULL, 1, 1000, true),
    ('s5', NULL, 1, 5, false),
    (NULL, NULL, 1, 0, true),
    (NULL, NULL, NULL, 0, true),
    -- NULL stream_id
    ('s5', 's10', 1, NULL, NULL),
    -- historical bounds use their stream part here (Synapse's
    -- _filter_results_by_stream refuses them)
    ('t1-5', 't9-10', 1, 6, true),
    ('t1-5', 't9-10', 1, 5, false)
) AS v(lo, hi, i, sid, expected);

SELECT in_range('m5~2.7'::multi_writer_token, 'm10~2.12', 2, 8) AS a,
       in_range('m5~2.7'::multi_writer_token, 'm10~2.12', 2, 7) AS b,
       in_range('m5~2.7'::multi_writer_token, 'm10~2.12', NULL, 6) AS c,
       in_range(NULL::multi_writer_token, NULL, NULL, 6) AS d,
       in_range('5'::multi_writer_token, '10', 1, NULL) AS e;

---------------------------------------------------------------------------
-- 6. in_range(low, high, instance, topological, stream_id) for room
--    pagination (Synapse's _filter_results): a historical bound compares
--    (topological, stream_id) tuples, excluding (topo, sid) <= low and
--    high < (topo, sid); a live bound compares the writer's position.
---------------------------------------------------------------------------
SELECT lo, hi, i, topo, sid, in_range(lo, hi, i, topo, sid) AS got, expected,
       in_range(lo, hi, i, topo, sid) IS NOT DISTINCT FROM expected AS ok
FROM (VALUES
    ('t3-20'::room_stream_token, 't5-40'::room_stream_token, 1, 3::bigint, 20::bigint, false),
    ('t3-20', 't5-40', 1, 3, 21, true),
    ('t3-20', 't5-40', 1, 4, 5, true),     -- a lower stream is fine in between
    ('t3-20', 't5-40', 1, 5, 40, true),
    ('t3-20', 't5-40', 1, 5, 41, false),
    ('t3-20', 't5-40', 1, 6, 1, false),
    ('t3-20', 't5-40', 1, 2, 100, false),
    ('t3-20', 't5-40', NULL, 4, 30, true), -- instance does not matter here
    -- live bounds: writer positions (writer 1 is at 35 in high)
    ('s20', 'm30~1.35', 1, 0, 20, false),
    ('s20', 'm30~1.35', 1, 0, 21, true),
    ('s20', 'm30~1.35', 1, 99, 35, true),
    ('s20', 'm30~1.35', 1, 0, 36, false),
    ('s20', 'm30~1.35', 2, 0, 31, false),
    ('s20', 'm30~1.35', NULL, 0, 30, true),
    ('s20', 'm30~1.35', NULL, 0, 31, false),
    -- mixed bounds
    ('t3-20', 's50', 1, 3, 21, true),
    ('t3-20', 's50', 1, 2, 30, false),
    ('t3-20', 's50', 1, 9, 51, false),
    ('s20', 't5-40', 1, 9, 30, false),
    ('s20', 't5-40', 1, 4, 30, true),
    -- NULL bounds and NULL arguments
    (NULL, 't5-40', 1, 5, 40, true),
    (NULL, 't5-40', 1, 5, 41, false),
    ('t3-20', NULL, 1, 1000, 0, true),
    (NULL, NULL, NULL, 0, 0, true),
    ('t3-20', 't5-40', 1, NULL, 30, NULL),
    ('t3-20', 't5-40', 1, 4, NULL, NULL)
) AS v(lo, hi, i, topo, sid, expected);

---------------------------------------------------------------------------
-- 6b. A NULL instance in the room in_range functions is master (Synapse's
--    _filter_results and _filter_results_by_stream read a row without an
--    instance name as written by "master"): master's listed position, else
--    the minimum. Multi-writer tokens keep the minimum. The room functions
--    read streampos.instances, so they are STABLE (and parallel restricted); the
--    multi-writer one stays IMMUTABLE.
---------------------------------------------------------------------------
SELECT p.oid::regprocedure AS function, p.provolatile, p.proparallel
FROM pg_proc p
WHERE p.proname = 'in_range' AND p.pronamespace = 'streampos'::regnamespace
ORDER BY p.oid::regprocedure::text COLLATE "C";

CREATE TABLE master_bounds AS
SELECT make_room_token(5, ARRAY[instance_id('master')], ARRAY[8]) AS lo,
       make_room_token(10, ARRAY[instance_id('master')], ARRAY[12]) AS hi,
       make_multi_writer_token(5, ARRAY[instance_id('master')], ARRAY[8]) AS mlo,
       make_multi_writer_token(10, ARRAY[instance_id('master')], ARRAY[12]) AS mhi;
-- master is at 8 in lo and 12 in hi; other writers at 5 and 10.
SELECT sid,
       in_range(lo, hi, NULL, sid) AS room_null,
       in_range(lo, hi, instance_id('master'), sid) AS room_master,
       in_range(lo, hi, NULL, 0, sid) AS room5_null,
       in_range(lo, hi, instance_id('w1'), sid) AS room_w1,
       in_range(mlo, mhi, NULL, sid) AS mw_null
FROM master_bounds, (VALUES (6::bigint), (8), (9), (10), (11), (12), (13)) AS v(sid)
ORDER BY sid;
-- Historical bounds do not depend on the writer.
SELECT in_range('t3-20'::room_stream_token, 't5-40', NULL, 4, 30) AS hist_null,
       in_range(lo, NULL, NULL, 0, 8) AS live_lo_8,
       in_range(lo, NULL, NULL, 0, 9) AS live_lo_9
FROM master_bounds;

---------------------------------------------------------------------------
-- 7. advance(a, b): a least upper bound in the causal order.
---------------------------------------------------------------------------
SELECT a, b, advance(a, b) AS got, expected, advance(a, b) = expected AS ok
FROM (VALUES
    ('s5'::room_stream_token, 's7'::room_stream_token, 's7'::room_stream_token),
    ('m5~1.9', 'm6~2.8', 'm6~1.9~2.8'),
    ('m5~1.9', 's9', 's9'),                -- writer 1 falls to the minimum
    ('m5~1.9', 'm7~1.8', 'm7~1.9'),
    ('m5~1.9~2.6', 'm5~2.9', 'm5~1.9~2.9'),
    ('t1-5', 't3-2', 't3-5'),              -- maximum of each part
    ('t2-5', 't1-5', 't2-5'),
    ('t1-5', 'm3~1.4', 's5'),              -- live, every writer at least 5
    ('t1-5', 'm3~1.9', 'm5~1.9'),
    ('s3', 't1-5', 's5'),
    ('s-5', 's-9', 's-5')
) AS v(a, b, expected);

SELECT advance('5'::multi_writer_token, 'm3~1.9') AS a,
       advance('m5~1.6'::multi_writer_token, 'm5~2.6') AS b,
       advance('m5~1.6'::multi_writer_token, '6') AS c;

-- Least upper bound, checked over every pair of a sample: commutative, an
-- upper bound of both, and below (causally) every other upper bound in the
-- sample. All counts must be 0.
CREATE TABLE sample (t room_stream_token);
INSERT INTO sample VALUES
    ('s0'), ('s3'), ('s5'), ('s6'), ('s9'), ('t1-2'), ('t1-5'), ('t2-3'),
    ('t3-9'), ('t0-0'), ('m3~1.5'), ('m3~1.9'), ('m3~2.5'), ('m3~1.4~2.6'),
    ('m5~1.6'), ('m5~2.6'), ('m5~1.9~2.7'), ('m5~3.6'), ('m6~1.9'),
    ('m6~2.9~3.7'), ('m4~1.6~2.6~3.6'), ('s-3'), ('m-3~1.2'), ('t-1-4');
SELECT count(*) FILTER (WHERE advance(a.t, b.t) <> advance(b.t, a.t)) AS not_commutative,
       count(*) FILTER (WHERE NOT is_before_or_eq(a.t, advance(a.t, b.t))
                           OR NOT is_before_or_eq(b.t, advance(a.t, b.t))) AS not_upper_bound,
       count(*) FILTER (WHERE advance(a.t, a.t) <> a.t) AS not_idempotent,
       count(*) AS pairs
FROM sample a, sample b;
SELECT count(*) AS not_least
FROM sample a, sample b, sample c
WHERE is_before_or_eq(a.t, c.t) AND is_before_or_eq(b.t, c.t)
  AND NOT is_before_or_eq(advance(a.t, b.t), c.t);
-- is_before_or_eq(a, b) exactly when advance(a, b) is before-or-equal b
-- (then the two are before-or-equal each other); advance(a, b) is b itself
-- when b is live.
SELECT count(*) FILTER (WHERE is_before_or_eq(a.t, b.t)
                              <> is_before_or_eq(advance(a.t, b.t), b.t)) AS mismatches,
       count(*) FILTER (WHERE is_before_or_eq(a.t, b.t) AND topological(b.t) IS NULL
                              AND advance(a.t, b.t) <> b.t) AS live_not_b
FROM sample a, sample b;

---------------------------------------------------------------------------
-- 8. The advance aggregate: least upper bound of a column, NULLs ignored,
--    NULL for no rows, with GROUP BY.
---------------------------------------------------------------------------
CREATE TABLE positions (room text, t room_stream_token, m multi_writer_token);
INSERT INTO positions VALUES
    ('a', 's5', '5'), ('a', 'm4~1.9', 'm4~1.9'), ('a', 'm3~2.8', 'm3~2.8'),
    ('a', NULL, NULL),
    ('b', 't3-7', NULL), ('b', 't5-2', NULL),
    ('c', 't3-7', '1'), ('c', 'm4~1.9', 'm4~1.9'),
    ('d', NULL, NULL);
SELECT room, advance(t) AS room_token, advance(m) AS mw_token, count(t)
FROM positions GROUP BY room ORDER BY room;
SELECT advance(t) AS all_rooms, advance(m) AS all_mw FROM positions;
SELECT advance(t) IS NULL AS empty_is_null FROM positions WHERE false;
-- The aggregate agrees with folding the function in any order.
SELECT advance(t) = advance('m4~1.9'::room_stream_token, advance('s5'::room_stream_token, 'm3~2.8')) AS same
FROM positions WHERE room = 'a';
-- Like every way to build a token, the function and the aggregate refuse a
-- result of more than 10000 instance positions (54000); at the cap is fine.
CREATE TABLE wide (part int, m multi_writer_token);
INSERT INTO wide
SELECT part, make_multi_writer_token(0, array_agg(i), array_agg(5::bigint))
FROM (SELECT i, (i - 1) / 5000 AS part FROM generate_series(1, 15000) i) s
GROUP BY part;
SELECT cardinality(string_to_array(advance(m)::text, '~')) - 1 AS at_the_cap
FROM wide WHERE part < 2;
SELECT advance(m) IS NULL FROM wide;
SELECT advance(advance(a.m, b.m)::room_stream_token, c.m::room_stream_token) IS NULL
FROM wide a, wide b, wide c WHERE (a.part, b.part, c.part) = (0, 1, 2);
DROP TABLE wide;

---------------------------------------------------------------------------
-- 9. bound(t, max): every component capped at max, entries that fall to the
--    minimum dropped, topological part kept; never raises a component.
---------------------------------------------------------------------------
SELECT t, m, bound(t, m) AS got, expected, bound(t, m) = expected AS ok
FROM (VALUES
    ('m5~1.9~2.7'::room_stream_token, 8::bigint, 'm5~1.8~2.7'::room_stream_token),
    ('m5~1.9~2.7', 7, 'm5~1.7~2.7'),
    ('m5~1.9~2.7', 6, 'm5~1.6~2.6'),
    ('m5~1.9~2.7', 5, 's5'),
    ('m5~1.9~2.7', 3, 's3'),
    ('m5~1.9~2.7', 100, 'm5~1.9~2.7'),
    ('s5', 100, 's5'),
    ('s5', -1, 's-1'),
    ('t10-20', 15, 't10-15'),
    ('t10-20', 30, 't10-20')
) AS v(t, m, expected);
SELECT bound('m5~1.9'::multi_writer_token, 7) AS a, bound('5'::multi_writer_token, 9) AS b;
-- Never raises: bound(t, m) is causally before t, for the whole sample.
SELECT count(*) AS raised
FROM sample, generate_series(-5, 12) AS m
WHERE NOT is_before_or_eq(bound(t, m), t);

---------------------------------------------------------------------------
-- 10. Comparison operators. = and <> compare canonical values; <, <=, >,
--     >= follow the total order.
---------------------------------------------------------------------------
SELECT a, b, a < b AS lt, a <= b AS le, a = b AS eq, a <> b AS ne,
       a >= b AS ge, a > b AS gt, room_stream_token_cmp(a, b) AS cmp
FROM (VALUES
    ('s5'::room_stream_token, 's5'::room_stream_token),
    ('m56~3.59~2.58', 'm56~2.58~3.59'),
    ('m5~', 's5'),
    ('s5', 's6'),
    ('s6', 's5'),
    ('t100-100', 's0'),                    -- the stream part first
    ('t1-9', 't2-0'),
    ('t2-1', 't2-0'),
    ('t1-5', 't2-5'),                      -- same live view s5: topological
    ('t9-5', 's5'),                        -- part, live last
    ('t9-5', 'm5~1.6'),
    ('s5', 'm5~1.6'),                      -- more excess is later
    ('m5~1.7', 'm5~2.7'),                  -- same excess: entries decide
    ('m5~1.6~2.6', 'm5~1.7'),
    ('m5~3.8', 's6'),                      -- the minimum decides first
    ('m5~1.100', 's6')
) AS v(a, b);

SELECT a, b, a < b AS lt, a = b AS eq, a > b AS gt, multi_writer_token_cmp(a, b) AS cmp
FROM (VALUES
    ('5'::multi_writer_token, '5'::multi_writer_token),
    ('m5~3.9~1.6', 'm5~1.6~3.9'),
    ('5', 'm5~1.6'),
    ('m5~1.100', '6'),
    ('-5', '5')
) AS v(a, b);

-- Operators are strict.
SELECT ('s5'::room_stream_token < NULL) IS NULL AS lt_null,
       ('5'::multi_writer_token = NULL) IS NULL AS eq_null;

---------------------------------------------------------------------------
-- 11. ORDER BY follows the documented total order.
---------------------------------------------------------------------------
SELECT t FROM (VALUES ('s6'::room_stream_token), ('m5~3.8'), ('m5~2.7'),
    ('m5~1.7'), ('m5~1.6~2.6'), ('s5'), ('m4~1.100'), ('t2-0'), ('t1-100'),
    ('t-1-5'), ('s-1'), ('t1-99')) AS v(t)
ORDER BY t;
SELECT t FROM (VALUES ('s6'::room_stream_token), ('t2-0'), ('m5~1.7'), ('s5'))
    AS v(t)
ORDER BY t DESC;
SELECT t FROM (VALUES ('6'::multi_writer_token), ('m5~1.7'), ('m5~2.6'),
    ('5'), ('-7'), ('m5~1.6~2.6')) AS v(t)
ORDER BY t;

-- The total order extends the causal order, over every pair of the sample:
-- is_before_or_eq(a, b) and not is_before_or_eq(b, a) implies a < b; tokens
-- before-or-equal each other have the same stream part and no entries (the
-- live view s{n}, or a historical t{x}-{n}); and the order is antisymmetric
-- and consistent with equality of the canonical text.
SELECT count(*) FILTER (WHERE is_before_or_eq(a.t, b.t) AND NOT is_before_or_eq(b.t, a.t)
                              AND NOT a.t < b.t) AS not_extending,
       count(*) FILTER (WHERE is_before_or_eq(a.t, b.t) AND is_before_or_eq(b.t, a.t)
                              AND a.t <> b.t
                              AND NOT (stream_pos(a.t) = stream_pos(b.t)
                                       AND max_stream_pos(a.t) = stream_pos(a.t)
                                       AND max_stream_pos(b.t) = stream_pos(b.t))) AS odd_equivalents,
       count(*) FILTER (WHERE room_stream_token_cmp(a.t, b.t) <> -room_stream_token_cmp(b.t, a.t)) AS not_antisymmetric,
       count(*) FILTER (WHERE (a.t = b.t) <> (a.t::text = b.t::text)) AS eq_not_text_eq,
       count(*) FILTER (WHERE (a.t < b.t) = (a.t >= b.t)) AS lt_ge_not_negations
FROM sample a, sample b;

---------------------------------------------------------------------------
-- 12. A table of 2000 generated tokens (live s, historical t, vector m with
--     one or two writers, many duplicates) for the index, join and grouping
--     tests. `model` is an independent SQL model of the documented total
--     order key, computed from the canonical text.
---------------------------------------------------------------------------
CREATE TABLE big (id int PRIMARY KEY, t room_stream_token NOT NULL);
INSERT INTO big
SELECT i, (CASE i % 3
    WHEN 0 THEN 's' || (i % 97)
    WHEN 1 THEN 't' || (i % 13) || '-' || (i % 89)
    ELSE 'm' || (i % 50) || '~1.' || (i % 50 + 1 + i % 7)
             || CASE WHEN i % 4 = 0 THEN '~3.' || (i % 50 + 2 + i % 5) ELSE '' END
    END)::room_stream_token
FROM generate_series(1, 2000) AS i;
VACUUM ANALYZE big;

SELECT count(*) AS rows, count(DISTINCT t) AS distinct_tokens,
       count(*) FILTER (WHERE topological(t) IS NOT NULL) AS historical,
       count(*) FILTER (WHERE t::text LIKE 'm%') AS vectors
FROM big;

CREATE VIEW model AS
SELECT id, t, live, topo, stream, entries,
       coalesce((SELECT sum(x - stream) FROM unnest(entries) WITH ORDINALITY AS u(x, k)
                 WHERE k % 2 = 0), 0) AS excess
FROM (SELECT id, t,
             topological(t) IS NULL AS live,
             coalesce(topological(t), 0) AS topo,
             stream_pos(t) AS stream,
             -- 'm8~1.10~3.13' -> {1,10,3,13}: (id, pos) pairs, ascending ids
             CASE WHEN t::text LIKE 'm%'
                  THEN string_to_array(translate(substring(t::text FROM '~(.*)$'), '~.', ',,'), ',')::bigint[]
                  ELSE '{}'::bigint[] END AS entries
      FROM big) AS s;

-- ORDER BY t gives the same sequence of values as sorting by the model key.
SELECT count(*) AS order_mismatches
FROM (SELECT t, row_number() OVER (ORDER BY t) AS n FROM big) AS x
JOIN (SELECT t, row_number() OVER (ORDER BY stream, excess, entries, live, topo) AS n
      FROM model) AS y USING (n)
WHERE x.t <> y.t;

---------------------------------------------------------------------------
-- 13. btree index: index scans return exactly what a sequential scan
--     returns, for a range and for equality (also with a non-canonical
--     spelling of the key); amcheck verifies the btree's order.
---------------------------------------------------------------------------
CREATE INDEX big_t_btree ON big (t);
SET enable_bitmapscan = off;

-- The reference answers, from a sequential scan.
SET enable_indexscan = off;
SET enable_indexonlyscan = off;
EXPLAIN (COSTS OFF) SELECT id FROM big WHERE t > 't5-20' AND t <= 'm30~1.33';
CREATE TEMP TABLE seq_range AS
    SELECT id FROM big WHERE t > 't5-20' AND t <= 'm30~1.33';
CREATE TEMP TABLE seq_eq AS
    SELECT id FROM big WHERE t = 'm8~1.10~3.13';
CREATE TEMP TABLE seq_eq2 AS
    SELECT id FROM big WHERE t = 's5';
RESET enable_indexscan;
RESET enable_indexonlyscan;

SET enable_seqscan = off;
EXPLAIN (COSTS OFF) SELECT id FROM big WHERE t > 't5-20' AND t <= 'm30~1.33';
CREATE TEMP TABLE idx_range AS
    SELECT id FROM big WHERE t > 't5-20' AND t <= 'm30~1.33';
EXPLAIN (COSTS OFF) SELECT id FROM big WHERE t = 'm8~3.13~1.10';
CREATE TEMP TABLE idx_eq AS
    SELECT id FROM big WHERE t = 'm8~3.13~1.10';   -- unsorted spelling
CREATE TEMP TABLE idx_eq2 AS
    SELECT id FROM big WHERE t = 'm5~';            -- spelling of s5
-- Index order is the sort order.
CREATE TEMP TABLE idx_order AS
    SELECT row_number() OVER () AS n, t FROM (SELECT t FROM big ORDER BY t) AS s;
EXPLAIN (COSTS OFF) SELECT t FROM big ORDER BY t;
RESET enable_seqscan;

SELECT (SELECT count(*) FROM seq_range) AS seq_range,
       (SELECT count(*) FROM idx_range) AS idx_range,
       (SELECT count(*) FROM seq_eq) AS seq_eq,
       (SELECT count(*) FROM idx_eq) AS idx_eq,
       (SELECT count(*) FROM seq_eq2) AS seq_eq_s5,
       (SELECT count(*) FROM idx_eq2) AS idx_eq_s5;
-- Same rows, both ways (all 0).
SELECT (SELECT count(*) FROM (SELECT * FROM seq_range EXCEPT SELECT * FROM idx_range) d) AS range_seq_only,
       (SELECT count(*) FROM (SELECT * FROM idx_range EXCEPT SELECT * FROM seq_range) d) AS range_idx_only,
       (SELECT count(*) FROM (SELECT * FROM seq_eq EXCEPT SELECT * FROM idx_eq) d) AS eq_seq_only,
       (SELECT count(*) FROM (SELECT * FROM idx_eq EXCEPT SELECT * FROM seq_eq) d) AS eq_idx_only,
       (SELECT count(*) FROM (SELECT * FROM seq_eq2 EXCEPT SELECT * FROM idx_eq2) d) AS s5_seq_only,
       (SELECT count(*) FROM (SELECT * FROM idx_eq2 EXCEPT SELECT * FROM seq_eq2) d) AS s5_idx_only;
-- The range answer agrees with the model too.
SELECT count(*) AS model_range
FROM model
WHERE (live, topo, stream, excess, entries) > (false, 5, 40, 0, '{}'::bigint[])
  AND (live, topo, stream, excess, entries) <= (true, 0, 30, 3, '{1,33}'::bigint[]);
-- The index-ordered scan equals a sort of the model key.
SELECT count(*) AS index_order_mismatches
FROM idx_order
JOIN (SELECT t, row_number() OVER (ORDER BY stream, excess, entries, live, topo) AS n
      FROM model) AS y USING (n)
WHERE idx_order.t <> y.t;

CREATE EXTENSION IF NOT EXISTS amcheck;
SELECT bt_index_check('big_t_btree', true);

---------------------------------------------------------------------------
-- 14. Joins: a hash join and a merge join on = give the same number of
--     pairs as a nested loop, and the same as joining on the canonical text.
---------------------------------------------------------------------------
CREATE TABLE probe AS SELECT DISTINCT ON (t) id, t FROM big ORDER BY t, id;
INSERT INTO probe VALUES (-1, 'm8~3.13~1.10'), (-2, 'm5~'), (-3, 's100000');
ANALYZE probe;

SET enable_mergejoin = off;
SET enable_nestloop = off;
EXPLAIN (COSTS OFF) SELECT count(*) FROM big b JOIN probe p ON b.t = p.t;
SELECT count(*) AS hash_join FROM big b JOIN probe p ON b.t = p.t;
RESET enable_mergejoin;
RESET enable_nestloop;

SET enable_hashjoin = off;
SET enable_nestloop = off;
EXPLAIN (COSTS OFF) SELECT count(*) FROM big b JOIN probe p ON b.t = p.t;
SELECT count(*) AS merge_join FROM big b JOIN probe p ON b.t = p.t;
RESET enable_hashjoin;
RESET enable_nestloop;

SET enable_hashjoin = off;
SET enable_mergejoin = off;
SET enable_indexscan = off;
SET enable_indexonlyscan = off;
EXPLAIN (COSTS OFF) SELECT count(*) FROM big b JOIN probe p ON b.t = p.t;
SELECT count(*) AS nested_loop FROM big b JOIN probe p ON b.t = p.t;
SELECT count(*) AS text_join FROM big b JOIN probe p ON b.t::text = p.t::text;
RESET enable_hashjoin;
RESET enable_mergejoin;
RESET enable_indexscan;
RESET enable_indexonlyscan;

---------------------------------------------------------------------------
-- 15. GROUP BY through HashAggregate and through GroupAggregate: the same
--     groups, and the same as grouping by the canonical text.
---------------------------------------------------------------------------
SET enable_sort = off;
EXPLAIN (COSTS OFF) SELECT t, count(*) FROM big GROUP BY t;
CREATE TEMP TABLE groups_hash AS SELECT t, count(*) AS n FROM big GROUP BY t;
RESET enable_sort;

SET enable_hashagg = off;
EXPLAIN (COSTS OFF) SELECT t, count(*) FROM big GROUP BY t;
CREATE TEMP TABLE groups_sort AS SELECT t, count(*) AS n FROM big GROUP BY t;
RESET enable_hashagg;

CREATE TEMP TABLE groups_text AS SELECT t::text AS t, count(*) AS n FROM big GROUP BY t::text;

SELECT (SELECT count(*) FROM groups_hash) AS hash_groups,
       (SELECT count(*) FROM groups_sort) AS sort_groups,
       (SELECT count(*) FROM groups_text) AS text_groups,
       (SELECT count(*) FROM (SELECT * FROM groups_hash EXCEPT SELECT * FROM groups_sort) d) AS hash_only,
       (SELECT count(*) FROM (SELECT * FROM groups_sort EXCEPT SELECT * FROM groups_hash) d) AS sort_only,
       (SELECT count(*) FROM (SELECT t::text, n FROM groups_hash EXCEPT SELECT * FROM groups_text) d) AS not_text;
-- A few groups, pinned.
SELECT t, n FROM groups_sort ORDER BY n DESC, t LIMIT 5;

---------------------------------------------------------------------------
-- 16. Hash operator class: equal tokens hash equally whatever their
--     spelling; hash_extended with seed 0 agrees with hash in the low 32 bits
--     (PostgreSQL's requirement for hash support function 2); a hash index
--     answers equality like a sequential scan.
---------------------------------------------------------------------------
SELECT room_stream_token_hash('m56~3.59~2.58') = room_stream_token_hash('m56~2.58~3.59') AS unsorted,
       room_stream_token_hash('m5~') = room_stream_token_hash('s5') AS empty_entry,
       room_stream_token_hash('s007') = room_stream_token_hash('s7') AS zeros,
       multi_writer_token_hash('m5~3.9~1.6') = multi_writer_token_hash('m5~1.6~3.9') AS mw_unsorted,
       room_stream_token_hash_extended('s5', 0) <> room_stream_token_hash_extended('s5', 1) AS seed_matters;
SELECT count(*) FILTER (WHERE (room_stream_token_hash_extended(t, 0) & 4294967295)
                              <> (room_stream_token_hash(t)::bigint & 4294967295)) AS low_bits_differ,
       count(*) FILTER (WHERE room_stream_token_hash(t) <> room_stream_token_hash(t::text::room_stream_token)) AS unstable,
       count(DISTINCT room_stream_token_hash(t)) AS distinct_hashes,
       count(DISTINCT t) AS distinct_tokens
FROM big;

DROP INDEX big_t_btree;
CREATE INDEX big_t_hash ON big USING hash (t);
SET enable_seqscan = off;
EXPLAIN (COSTS OFF) SELECT id FROM big WHERE t = 'm8~3.13~1.10';
CREATE TEMP TABLE hash_eq AS SELECT id FROM big WHERE t = 'm8~3.13~1.10';
CREATE TEMP TABLE hash_eq2 AS SELECT id FROM big WHERE t = 'm5~';
SELECT count(*) AS hash_rows FROM big WHERE t = 's100000';
RESET enable_seqscan;
SELECT (SELECT count(*) FROM hash_eq) AS hash_eq,
       (SELECT count(*) FROM (SELECT * FROM hash_eq EXCEPT SELECT * FROM seq_eq) d) +
       (SELECT count(*) FROM (SELECT * FROM seq_eq EXCEPT SELECT * FROM hash_eq) d) AS eq_diff,
       (SELECT count(*) FROM hash_eq2) AS hash_eq_s5,
       (SELECT count(*) FROM (SELECT * FROM hash_eq2 EXCEPT SELECT * FROM seq_eq2) d) +
       (SELECT count(*) FROM (SELECT * FROM seq_eq2 EXCEPT SELECT * FROM hash_eq2) d) AS s5_diff;
-- Every probe value looked up through the hash index (nested loop with an
-- inner index scan) finds as many rows as the hash join above.
SET enable_seqscan = off;
SET enable_hashjoin = off;
SET enable_mergejoin = off;
EXPLAIN (COSTS OFF) SELECT count(*) FROM probe p JOIN big b ON b.t = p.t;
SELECT count(*) AS hash_index_join FROM probe p JOIN big b ON b.t = p.t;
RESET enable_seqscan;
RESET enable_hashjoin;
RESET enable_mergejoin;

---------------------------------------------------------------------------
-- 17. The advance aggregate in parallel (its combine function is advance
--     itself): the same result as serially.
---------------------------------------------------------------------------
-- Over the live tokens with a minimum below 45 (so that some writers stay
-- ahead of the result's minimum), and over everything.
SELECT advance(t) FILTER (WHERE stream_pos(t) < 45 AND topological(t) IS NULL) AS serial_live,
       advance(t) AS serial_all
FROM big;
SET max_parallel_workers_per_gather = 2;
SET parallel_setup_cost = 0;
SET parallel_tuple_cost = 0;
SET min_parallel_table_scan_size = 0;
EXPLAIN (COSTS OFF)
SELECT advance(t) FILTER (WHERE stream_pos(t) < 45 AND topological(t) IS NULL),
       advance(t)
FROM big;
SELECT advance(t) FILTER (WHERE stream_pos(t) < 45 AND topological(t) IS NULL) AS parallel_live,
       advance(t) AS parallel_all
FROM big;
RESET max_parallel_workers_per_gather;
RESET parallel_setup_cost;
RESET parallel_tuple_cost;
RESET min_parallel_table_scan_size;

-- By group, checked against the definition for live tokens: the join's
-- position of every writer is the maximum of that writer's positions.
SELECT g, j,
       stream_pos(j) = max_min
         AND instance_pos(j, 1) = max1 AND instance_pos(j, 2) = max2
         AND instance_pos(j, 3) = max3 AS ok
FROM (SELECT id % 4 AS g, advance(t) AS j,
             max(stream_pos(t)) AS max_min,
             max(instance_pos(t, 1)) AS max1, max(instance_pos(t, 2)) AS max2,
             max(instance_pos(t, 3)) AS max3
      FROM big
      WHERE topological(t) IS NULL AND stream_pos(t) BETWEEN 10 AND 40
      GROUP BY id % 4) AS s
ORDER BY g;

---------------------------------------------------------------------------
-- 18. multi_writer_token: btree index, GROUP BY, ORDER BY, hash join.
---------------------------------------------------------------------------
CREATE TABLE big_mw (id int PRIMARY KEY, m multi_writer_token NOT NULL);
INSERT INTO big_mw
SELECT id, t::multi_writer_token FROM big WHERE topological(t) IS NULL;
CREATE INDEX big_mw_btree ON big_mw (m);
VACUUM ANALYZE big_mw;

SET enable_seqscan = off;
SET enable_bitmapscan = off;
EXPLAIN (COSTS OFF) SELECT id FROM big_mw WHERE m >= '40' AND m < 'm45~1.47';
CREATE TEMP TABLE mw_idx AS SELECT id FROM big_mw WHERE m >= '40' AND m < 'm45~1.47';
RESET enable_seqscan;
SET enable_indexscan = off;
SET enable_indexonlyscan = off;
CREATE TEMP TABLE mw_seq AS SELECT id FROM big_mw WHERE m >= '40' AND m < 'm45~1.47';
RESET enable_indexscan;
RESET enable_indexonlyscan;
RESET enable_bitmapscan;
SELECT (SELECT count(*) FROM mw_idx) AS idx_rows, (SELECT count(*) FROM mw_seq) AS seq_rows,
       (SELECT count(*) FROM (SELECT * FROM mw_idx EXCEPT SELECT * FROM mw_seq) d) +
       (SELECT count(*) FROM (SELECT * FROM mw_seq EXCEPT SELECT * FROM mw_idx) d) AS diff;
-- The multi-writer order is the room order of the same live tokens.
SELECT count(*) AS order_mismatches
FROM (SELECT m, row_number() OVER (ORDER BY m) AS n FROM big_mw) AS x
JOIN (SELECT t, row_number() OVER (ORDER BY t) AS n FROM big WHERE topological(t) IS NULL) AS y
  USING (n)
WHERE x.m::room_stream_token <> y.t;
SELECT bt_index_check('big_mw_btree', true);

SET enable_sort = off;
CREATE TEMP TABLE mw_groups_hash AS SELECT m, count(*) AS n FROM big_mw GROUP BY m;
RESET enable_sort;
SET enable_hashagg = off;
CREATE TEMP TABLE mw_groups_sort AS SELECT m, count(*) AS n FROM big_mw GROUP BY m;
RESET enable_hashagg;
SELECT (SELECT count(*) FROM mw_groups_hash) AS hash_groups,
       (SELECT count(*) FROM mw_groups_sort) AS sort_groups,
       (SELECT count(DISTINCT m::text) FROM big_mw) AS text_groups,
       (SELECT count(*) FROM (SELECT * FROM mw_groups_hash EXCEPT SELECT * FROM mw_groups_sort) d) +
       (SELECT count(*) FROM (SELECT * FROM mw_groups_sort EXCEPT SELECT * FROM mw_groups_hash) d) AS diff;
SELECT m, n FROM mw_groups_sort ORDER BY m LIMIT 5;

SET enable_mergejoin = off;
SET enable_nestloop = off;
EXPLAIN (COSTS OFF) SELECT count(*) FROM big_mw a JOIN big_mw b ON a.m = b.m;
SELECT count(*) AS hash_join FROM big_mw a JOIN big_mw b ON a.m = b.m;
RESET enable_mergejoin;
RESET enable_nestloop;
SELECT count(*) AS text_join FROM big_mw a JOIN big_mw b ON a.m::text = b.m::text;
