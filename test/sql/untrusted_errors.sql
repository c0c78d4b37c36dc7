--
-- untrusted_errors: the refusals of the untrusted-objects model
-- (docs/contract.md, "Privileges"), with their exact messages, details and
-- hints. The attacks themselves run from Python (test/python/test_untrusted.py).
--
CREATE EXTENSION IF NOT EXISTS streampos;
\set VERBOSITY default
SET search_path = public;

CREATE ROLE regress_untrusted_owner;
CREATE ROLE regress_untrusted_caller;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA streampos TO regress_untrusted_caller;
SELECT streampos.create_stream('unt_s')::text;

-- Only tables, and only a role that may act as the table's owner.
CREATE VIEW unt_view AS SELECT 1::bigint AS id;
SELECT streampos.add_table('unt_s', 'unt_view', 'id');
CREATE TABLE unt_theirs (id bigint, who text);
ALTER TABLE unt_theirs OWNER TO regress_untrusted_owner;
GRANT SELECT ON unt_theirs TO regress_untrusted_caller;
SET ROLE regress_untrusted_caller;
SELECT streampos.add_table('unt_s', 'unt_theirs', 'id', 'who');
RESET ROLE;

-- ID and instance columns of built-in types only (domains over them too).
CREATE TYPE unt_mood AS ENUM ('a', 'b');
CREATE DOMAIN unt_id AS bigint;
CREATE TABLE unt_typed (id unt_id, who unt_mood);
SELECT streampos.add_table('unt_s', 'unt_typed', 'id');
SELECT streampos.add_table('unt_s', 'unt_typed', 'id', 'who');

-- A table with row-level security is read (as its owner) only by its
-- owner or a BYPASSRLS role.
SELECT streampos.add_table('unt_s', 'unt_theirs', 'id', 'who');
ALTER TABLE unt_theirs ENABLE ROW LEVEL SECURITY;
SET ROLE regress_untrusted_caller;
SELECT * FROM streampos.check_stream('unt_s');
SELECT streampos.updates('unt_s', '0');
RESET ROLE;
SELECT check_name, ok FROM streampos.check_stream('unt_s') ORDER BY 1;

-- A registered table turned into a view: untrusted_view.

-- Ownership and schema privileges (checked through calls PostgreSQL 16
-- renamed: this runs on every version): a sequence another role owns is
-- not adopted, a schema without USAGE is not searched for Synapse's tables.
CREATE SEQUENCE unt_their_seq;
ALTER SEQUENCE unt_their_seq OWNER TO regress_untrusted_owner;
CREATE SCHEMA unt_private;
SET ROLE regress_untrusted_caller;
SELECT streampos.adopt_stream('unt_adopted', 'unt_their_seq');
SELECT * FROM streampos.adopt_synapse('unt_private');
RESET ROLE;
DROP SCHEMA unt_private;
DROP SEQUENCE unt_their_seq;

-- The notification sender check.
SELECT streampos.is_position_worker(pg_backend_pid()), streampos.is_position_worker(0);

SELECT streampos.drop_stream('unt_s');
DROP TABLE unt_theirs;
DROP TABLE unt_typed;
DROP VIEW unt_view;
DROP DOMAIN unt_id;
DROP TYPE unt_mood;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA streampos FROM regress_untrusted_caller;
DROP ROLE regress_untrusted_caller;
DROP ROLE regress_untrusted_owner;
