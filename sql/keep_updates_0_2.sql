-- (0.2.0 -> 0.4.0 in one step) A view, or a function with a SQL-standard
-- body, that calls 0.2.0's updates() stopped the DROP (2BP01), and PUBLIC
-- can make one (a temporary view): while something depends on it, the old
-- function is kept as streampos.updates_0_2 (the library still answers
-- it), and what depends on it goes on working; else it is dropped.
DO $$
BEGIN
    IF EXISTS (
        SELECT FROM pg_catalog.pg_depend d
        WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_proc'::pg_catalog.regclass
          AND d.refobjid OPERATOR(pg_catalog.=)
              'streampos.updates(text, streampos.multi_writer_token, integer, integer)'::pg_catalog.regprocedure
          AND d.deptype OPERATOR(pg_catalog.=) 'n'
    ) THEN
        ALTER FUNCTION streampos.updates(text, streampos.multi_writer_token, integer, integer)
            RENAME TO updates_0_2;
    ELSE
        DROP FUNCTION streampos.updates(text, streampos.multi_writer_token, integer, integer);
    END IF;
END
$$;
