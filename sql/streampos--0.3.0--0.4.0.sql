-- streampos 0.3.0 -> 0.4.0
\echo Use "ALTER EXTENSION streampos UPDATE TO '0.4.0'" to load this file. \quit

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
