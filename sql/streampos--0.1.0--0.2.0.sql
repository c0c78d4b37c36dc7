-- streampos 0.1.0 -> 0.2.0 (ALTER EXTENSION streampos UPDATE TO '0.2.0').
--
-- Every schema change of 0.2.0 is here, in the order it was made; after it
-- runs, the database has exactly the objects sql/streampos--0.2.0.sql creates
-- (the upgrade test compares the two).
\echo Use "ALTER EXTENSION streampos UPDATE TO '0.2.0'" to load this file. \quit

-- Privileges (a trusted extension). The catalog tables are written only by
-- the extension's functions, as the extension's owner; catalog-changing
-- functions are not for PUBLIC; next_id() now checks the privilege nextval()
-- needs (grant USAGE on each stream's sequence to the roles that write).
REVOKE INSERT ON instances FROM PUBLIC;
REVOKE USAGE ON SEQUENCE instances_instance_id_seq FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION create_stream(text, boolean, text[]) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION adopt_stream(text, regclass, boolean, text[]) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION add_table(text, regclass, text, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION set_writers(text, text[]) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION drop_stream(text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION instance_id(text) FROM PUBLIC;

-- Instance ids are positive (Synapse's instance_map ids are), and a stream
-- has a sequence of its own. An existing row that breaks either stops the
-- upgrade with the constraint's name.
ALTER TABLE instances ADD CONSTRAINT instances_instance_id_check CHECK (instance_id > 0);
ALTER TABLE streams ADD CONSTRAINT streams_seq_key UNIQUE (seq);

-- The trigger that keeps instances immutable raises its error from the
-- library now, like every other error of the extension.
CREATE OR REPLACE FUNCTION instances_immutable() RETURNS trigger
    LANGUAGE c AS 'MODULE_PATHNAME', 'instances_immutable_wrapper';
