"""The trap fixture (traps.py) can fail: each kind of trap records a call
made the way a defect of the extension or a client would make it, as the
role that made it. Without these, a fixture that recorded nothing (never
planted, or a filter too wide) would pass every suite (docs/torture.md,
"The trap fixture")."""

import pytest

import traps
from support import connect_raw, ensure_login_role, one

pytestmark = pytest.mark.fires_traps

NOT_OWNER = "streampos_trap_selftest"


def _labels(logged):
    return {(label, who) for _count, label, who, _role, _query, _stack in logged}


def test_an_unqualified_function_call_in_code_is_recorded(db, planted_traps):
    """A function whose path puts public first calls now(): the planted
    public.now() answers and records itself (a top-level statement's own
    unqualified call is the test's choice and is not recorded)."""
    traps.take_log()
    db.execute("CREATE FUNCTION pg_temp.careless() RETURNS timestamptz LANGUAGE sql "
               "SET search_path = public, pg_catalog AS 'SELECT now()'")
    db.execute("SELECT now()")
    assert traps.take_log()[0] == []
    db.execute("SELECT pg_temp.careless()")
    logged, _fired = traps.take_log()
    assert ("now()", "postgres") in _labels(logged)


def test_an_operator_resolved_by_coercion_is_recorded(db, planted_traps):
    """pg_catalog has no bigint = oid (it coerces): a statement written as
    the extension writes its own (qualified names) that compares the two
    gets public's exact match, which records itself."""
    traps.take_log()
    db.execute("SET search_path = public, pg_catalog")
    try:
        assert one(db, "SELECT pg_catalog.int8(1) = 1::oid") is True
    finally:
        db.execute("RESET search_path")
    logged, _fired = traps.take_log()
    assert ("=(bigint, oid)", "postgres") in _labels(logged)


def test_a_tables_index_predicate_run_as_another_role_is_recorded(db, planted_traps):
    """Every table gets an index whose IMMUTABLE predicate is a trap: a
    statement written as the extension's internal SQL (OPERATOR(pg_catalog.…))
    that plans a query on the table as a role that does not own it runs the
    owner's code as that role, and the trap records it, and leaves its
    settings in the caller's session for the suites' session check."""
    ensure_login_role(NOT_OWNER)
    db.execute("DROP TABLE IF EXISTS public.trap_selftest")
    db.execute("CREATE TABLE public.trap_selftest (id bigint)")
    db.execute(f"GRANT SELECT ON public.trap_selftest TO {NOT_OWNER}")
    traps.take_log()
    try:
        with connect_raw(user=NOT_OWNER) as c:
            c.execute("DO $$ BEGIN PERFORM 1 FROM public.trap_selftest "
                      "WHERE id OPERATOR(pg_catalog.>) 0; END $$")
            assert one(c, "SHOW work_mem") == traps.INDEX_TRAP_WORK_MEM
        logged, _fired = traps.take_log()
        assert any(who == NOT_OWNER and label.startswith("index") for label, who in _labels(logged)), logged
    finally:
        db.execute("DROP TABLE public.trap_selftest")


def test_the_check_fails_when_a_trap_fired(db, planted_traps):
    """The command the other suites run after their tests (scripts/test)
    exits 1 with what fired (and stays 1: the count a rollback cannot
    undo has moved)."""
    traps.take_log()
    db.execute("SELECT public.trap_record('selftest', 'a stack', 'a query')")
    assert traps.main(["check", db.info.dbname]) == 1
    assert traps.take_log()[0] == []
