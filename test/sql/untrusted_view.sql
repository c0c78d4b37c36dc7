--
-- untrusted_view: a registered table turned into a view in place (CREATE
-- RULE "_RETURN", same OID) is not read. PostgreSQL 16 and later refuse to
-- turn a table into a view (expected/untrusted_view_1.out); 14 and 15 allow
-- it (expected/untrusted_view.out).
--
CREATE EXTENSION IF NOT EXISTS streampos;
\set VERBOSITY default
SET search_path = public;

SELECT streampos.create_stream('unt_v')::text;
CREATE TABLE unt_turned (id bigint, who text);
SELECT streampos.add_table('unt_v', 'unt_turned', 'id', 'who');
CREATE RULE "_RETURN" AS ON SELECT TO unt_turned DO INSTEAD SELECT 99::bigint AS id, 'w'::text AS who;
SELECT relkind FROM pg_class WHERE oid = 'unt_turned'::regclass;
SELECT ok, detail FROM streampos.check_stream('unt_v') WHERE NOT ok;
SELECT streampos.updates('unt_v', '0');

SELECT streampos.drop_stream('unt_v');
DO $$ BEGIN
    EXECUTE CASE (SELECT relkind FROM pg_class WHERE oid = 'unt_turned'::regclass)
        WHEN 'v' THEN 'DROP VIEW unt_turned' ELSE 'DROP TABLE unt_turned' END;
END $$;
