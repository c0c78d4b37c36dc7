-- streampos 0.1.0 -> 0.2.0 (ALTER EXTENSION streampos UPDATE TO '0.2.0').
--
-- Every schema change of 0.2.0 is here, in the order it was made; after it
-- runs, the database has exactly the objects sql/streampos--0.2.0.sql creates
-- (the upgrade test compares the two).
\echo Use "ALTER EXTENSION streampos UPDATE TO '0.2.0'" to load this file. \quit
