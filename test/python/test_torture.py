"""Torture and fault scenarios for streampos.

The load comes from torture.py (also a stand-alone command; see
docs/torture.md). Tests that crash or restart the server are marked
restarts_server (they run after all others) and leave the server running.
"""

import os
import signal
import subprocess
import threading
import time

import psycopg
import pytest

from support import (
    DBNAME,
    PGDATA,
    PGHOST,
    PGPORT,
    PGUSER,
    backend_pid,
    create_stream,
    expect_error,
    force_parallel_setting,
    in_flight,
    one,
    rows,
    sequence_value,
    start_server,
    start_standby,
    stop_server,
    stop_standby,
    stored_positions,
    wait_for_server,
    wait_until,
)

import torture

# Readers sampling modes for runs whose subject is something else (a crash):
# stmt_filter exercises frontier()'s stability within one statement, which
# has its own tests below.


def conninfo():
    return dict(host=PGHOST, port=PGPORT, user=PGUSER, dbname=DBNAME)


def contract_failures(r):
    """The samples that missed rows or went back, and what the reference
    model found (torture.check_contract), as text."""
    out = []
    if r["violations"]:
        out.append(
            f"{r['violations']} samples missed committed rows (by mode: {r['violations_by_mode']}):\n"
            + "\n".join(r["violation_details"])
        )
    if r["regressions"]:
        out.append(
            f"{r['regressions']} positions went backwards for later snapshots:\n"
            + "\n".join(r["regression_details"])
        )
    if r["contract_violations"]:
        out.append(
            f"{r['contract_violations']} answers broke the contract ({r['contract']}):\n"
            + "\n".join(r["contract_details"])
        )
    return out


def assert_contract(r):
    """The verdict on every sample and answer: torture.ContractViolation (an
    AssertionError) if a sample missed a row or went back, or the reference
    model found anything."""
    failures = contract_failures(r)
    if failures:
        raise torture.ContractViolation(torture.summary_line(r) + "\n" + "\n".join(failures))


def assert_clean_run(r, min_commits=100):
    """Everything torture.verify checks, with readable failures. Missed
    rows, regressions and the reference model's findings come last, as one
    torture.ContractViolation (assert_contract)."""
    assert not r["errors"], r["errors"][:5]
    assert r["verified"], "the run was not verified"
    assert r["commits"] >= min_commits, f"only {r['commits']} commits: the load proves too little"
    assert not r["lost"], f"acknowledged commits missing from the table: {r['lost'][:20]}"
    assert not r["extra"], f"rows that were never acknowledged: {r['extra'][:20]}"
    assert not r["wrong_owner"], r["wrong_owner"][:20]
    assert r["in_flight"] == 0
    assert r["frontier"] == r["max_allocated"] == r["sequence"], (
        r["frontier"],
        r["max_allocated"],
        r["sequence"],
    )
    assert_contract(r)


def session_in_flight(conn):
    return one(conn, "SELECT count(*) FROM streampos.in_flight() WHERE pid = pg_backend_pid()")


def assert_nothing_left(conn):
    """The session holds nothing in the registry and the server still answers."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        conn.execute("ROLLBACK")
    assert session_in_flight(conn) == 0
    assert one(conn, "SELECT 1") == 1


# =============================================================== the torture


def test_short_torture(database, stream):
    """6 writers over 3 instances, 4 readers, ~25 s: no sample misses a
    committed row, no position goes backwards, the frontier reaches
    max_allocated, and the table holds exactly the committed rows. All five
    reader modes, the one-statement FILTER form included."""
    r = torture.run(conninfo(), stream, seconds=25, writers=6, instances=3, readers=4)
    print(torture.summary_line(r))
    assert_clean_run(r, min_commits=1000)
    # Readers go through every mode each round; the count depends on load.
    assert all(r["samples_by_mode"][m] >= 5 for m in torture.MODES), r["samples_by_mode"]


def test_short_torture_backward_stream(database, stream):
    """The same on a backward stream (IDs -1, -2, ...; "at or below F" means
    id >= F): nothing missed, nothing going backwards, exact rows."""
    r = torture.run(
        conninfo(), stream, seconds=8, writers=4, instances=2, readers=3, backwards=True
    )
    print(torture.summary_line(r))
    assert r["backwards"] and r["frontier"] < 0
    assert_clean_run(r, min_commits=300)


# =============================================================== the reference model


def _snap(xmin, xmax, *xip):
    return (xmin, xmax, frozenset(xip))


def _history():
    """A fabricated run that keeps the contract. w1's transaction (xid 100,
    IDs 1-2) commits at t=3, w2's (xid 101, ID 3) at t=1. Snapshot S1
    (t=1.5) sees 101 ended and 100 running; S2 (t=4) sees both ended."""
    Txn, Answer = torture.Txn, torture.Answer
    txns = [
        Txn("w1#1", xid=100, ids={"w1": [1, 2]}, fate="committed", t_end0=3.0, t_end1=3.1),
        Txn("w2#1", xid=101, ids={"w2": [3]}, fate="committed", t_end0=1.0, t_end1=1.1),
        Txn("w2#2", xid=102, ids={"w2": [4]}, fate="aborted", t_end0=3.5, t_end1=3.6),
    ]
    s1, s2 = _snap(100, 102, 100), _snap(103, 103)
    answers = [
        # rc: one statement
        Answer("rc", 0, (0, 1), s1, 1.5, 1.5, 1.6, 0, 3, {"w1": 0, "w2": 3}, (0, {"w2": 3})),
        # a cursor: two FETCHes, one snapshot, one answer
        Answer("cursor", 1, (1, 1), s1, 1.5, 1.6, 1.7, 0, None, None, (0, {"w2": 3})),
        Answer("cursor", 1, (1, 1), s1, 1.5, 2.6, 2.7, 0, None, None, (0, {"w2": 3})),
        # later, everything ended
        Answer("rc", 0, (0, 2), s2, 4.0, 4.0, 4.1, 4, 4, {"w1": 4, "w2": 4}, (4, {})),
        # a standby, behind but never ahead of a commit not yet sent
        Answer("standby", 2, (2, 1), None, 2.0, 2.0, 2.1, 0, None, {"w2": 3}, (0, {"w2": 3}), node="standby"),
        Answer("standby", 2, (2, 2), None, 5.0, 5.0, 5.1, 4, None, {"w1": 4, "w2": 4}, (4, {}), node="standby"),
    ]
    return txns, answers


def test_contract_checker_accepts_a_history_that_keeps_the_contract():
    txns, answers = _history()
    report = torture.check_contract(txns, answers)
    assert report.total() == 0, report.details


def _later(answers, **fields):
    """Add an answer of snapshot S1 from another transaction, taken at t=2
    (after the rc answer returned at t=1.6), with ``fields`` changed."""
    a = torture.Answer("rc", 3, (3, 1), _snap(100, 102, 100), 2.0, 2.0, 2.1, 0, 3, {"w1": 0, "w2": 3}, (0, {"w2": 3}))
    for k, v in fields.items():
        setattr(a, k, v)
    answers.append(a)


FAULTS = {
    # The frontier of S1 covers ID 1, committed by xid 100, which S1 sees running.
    "frontier-covers": ("covers_invisible_commit", lambda a: setattr(a[0], "frontier", 1)),
    # So does w1's position, or w1's token entry.
    "position-covers": ("covers_invisible_commit", lambda a: a[0].positions.update(w1=2)),
    "token-entry-covers": ("covers_invisible_commit", lambda a: a[0].token[1].update(w1=1)),
    # The cursor's second FETCH answers differently for the same snapshot.
    "cursor-frontier-changed": ("answer_changed", lambda a: setattr(a[2], "frontier", 1)),
    "cursor-token-changed": ("answer_changed", lambda a: setattr(a[2], "token", (0, {"w2": 2}))),
    # A later snapshot answers less: the frontier, a writer's position, a token entry.
    "frontier-went-back": ("went_back", lambda a: a.append(
        torture.Answer("rr", 3, (3, 1), _snap(103, 103), 4.5, 4.6, 4.7, 3, 4, None, None))),
    "position-went-back": ("went_back", lambda a: _later(a, positions={"w1": 0, "w2": 2})),
    "token-entry-went-back": ("went_back", lambda a: _later(a, token=(0, {}))),
    # A snapshot whose xmin is past S2's xmax, taken before S2's answer
    # returned but first asked after it, answers less.
    "xmin-past-xmax-answers-less": ("went_back", lambda a: a.append(
        torture.Answer("rr", 3, (3, 1), _snap(103, 104), 3.9, 4.2, 4.3, 3, 4, None, None))),
    # The same snapshot imported by another transaction answers less.
    "importer-answers-less": ("went_back", lambda a: _later(a, t_snap=1.5, t_ans0=1.8, token=(0, {"w2": 1}))),
    # An answer above the max_allocated of its own statement.
    "above-max_allocated": ("above_max_allocated", lambda a: setattr(a[3], "max_allocated", 3)),
    # The token's minimum and the frontier disagree in one statement.
    "token-not-frontier": ("inconsistent", lambda a: setattr(a[0], "token", (1, {"w2": 3}))),
    # writer_positions forgets w2, which committed before the snapshot's xmin.
    "writer-forgotten": ("missing_writer", lambda a: a[3].positions.pop("w2")),
    # The standby covers ID 1 at t=2.1, before w1's COMMIT was sent (t=3).
    "standby-ahead": ("standby_covers_in_flight", lambda a: setattr(a[4], "frontier", 2)),
    # The standby goes back.
    "standby-went-back": ("standby_went_back", lambda a: a[5].positions.update(w2=2)),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_contract_checker_reports_each_kind_of_violation(fault):
    """The checker itself: a fabricated history with one fault is reported
    under that fault's name (and the clean history above is not)."""
    kind, change = FAULTS[fault]
    txns, answers = _history()
    change(answers)
    report = torture.check_contract(txns, answers)
    assert report.counts[kind] >= 1, (kind, report.found(), report.details)


FOLLOWER_FAULTS = {
    # (ordered, delivered, kind): the rows wanted are 1 (w1), 2 (w2), 3 (w1).
    "missed": (False, [(1, "w1"), (3, "w1")], "follower_missed"),
    "repeated": (False, [(1, "w1"), (2, "w2"), (1, "w1"), (3, "w1")], "follower_repeated"),
    "extra": (False, [(1, "w1"), (2, "w2"), (3, "w1"), (4, "w2")], "follower_extra"),
    "writer-out-of-order": (False, [(3, "w1"), (2, "w2"), (1, "w1")], "follower_out_of_order"),
    "global-out-of-order": (True, [(2, "w2"), (1, "w1"), (3, "w1")], "follower_out_of_order"),
}


@pytest.mark.parametrize("fault", sorted(FOLLOWER_FAULTS))
def test_follower_checker_reports_each_kind(fault):
    wanted = {1: "w1", 2: "w2", 3: "w1"}
    ordered, delivered, kind = FOLLOWER_FAULTS[fault]
    found = torture.follower_findings(ordered, delivered, wanted)
    assert found[kind], (fault, found)
    assert not any(torture.follower_findings(ordered, [(2, "w2"), (1, "w1"), (3, "w1")] if not ordered
                                             else [(1, "w1"), (2, "w2"), (3, "w1")], wanted).values())


def test_snapshot_visibility_matches_postgresql(db):
    """torture.sees_ended is pg_visible_in_snapshot for top-level xids."""
    text = "1000:1010:1001,1004,1007"
    snap = torture.parse_snapshot(text)
    for xid in range(995, 1015):
        pg = one(db, "SELECT pg_visible_in_snapshot(%s::text::xid8, %s::pg_snapshot)", (xid, text))
        assert torture.sees_ended(snap, xid) == pg, xid


def test_torture_with_checkpoints(database, stream):
    """CHECKPOINT every ~250 ms while a quarter of the writers' transactions
    allocate, wait for the next checkpoint and allocate again: every
    answer, writer position and token entry against the model."""
    r = torture.run(conninfo(), stream, seconds=5, readers=4, checkpoint_ms=250)
    print(torture.summary_line(r))
    assert r["checkpoints"] >= 5 and r["spanning"] >= 10, (r["checkpoints"], r["spanning"])
    assert_clean_run(r, min_commits=100)


def test_torture_with_followers(database, stream):
    """A follower and an ordered follower (updates_json, ordered => true)
    beside the writers and readers, each call with a random max_rows and
    long poll: every committed row reaches each exactly once, nothing
    rolled back, each writer's rows in ID order, and the ordered follower's
    in global ID order across all its calls (the model's follower_* kinds).
    Forward streams only: updates() follows no backward stream."""
    r = torture.run(conninfo(), stream, seconds=8, writers=4, instances=3, readers=2,
                    modes=torture.scenario_options(["followers"])["modes"])
    print(torture.summary_line(r), r["follower_summary"])
    assert_clean_run(r, min_commits=100)
    assert {f["mode"] for f in r["follower_summary"]} == {"follower", "ordered_follower"}
    committed = sum(len(ids) for ids in r["committed"].values())
    for f in r["follower_summary"]:
        assert f["calls"] >= 20 and f["rows"] >= committed, f


def test_torture_with_more_than_64_writers(database, stream):
    """90 instance names over 8 writer threads on a stream open to any
    writer: tokens carry many entries, every writer's position is checked,
    and at the end writer_positions lists all 90 at max_allocated."""
    r = torture.run(conninfo(), stream, seconds=5, writers=8, instances=90, readers=3, open_stream=True)
    print(torture.summary_line(r))
    committed = {w for t in r["txns"] if t.fate == "committed" for w, ids in t.ids.items() if ids}
    assert len(committed) > 64, len(committed)
    assert_clean_run(r, min_commits=200)
    assert r["max_token_entries"] > 64 and r["max_writer_positions"] >= 90, (
        r["max_token_entries"],
        r["max_writer_positions"],
    )


def test_long_cursor_keeps_its_answer_past_8192_snapshots(database, stream):
    """A READ COMMITTED transaction opens a cursor over the rows <=
    frontier() (an ID held by a helper that then rolls back), FETCHes 1,
    asks frontier() for more than 8192 distinct snapshots, then FETCHes the
    rest: one answer for the cursor, and no row below it missing."""
    r = torture.run(conninfo(), stream, seconds=2, writers=4, readers=0, modes=("long_cursor",),
                    long_cursor_seconds=60)
    print(torture.summary_line(r))
    assert r["long_cursors"], "no long cursor found a row at or below its frontier"
    assert max(c["snapshots"] for c in r["long_cursors"]) > torture.CACHED_SNAPSHOTS, r["long_cursors"]
    assert_clean_run(r, min_commits=20)


STANDBY_PORT = int(os.environ.get("STREAMPOS_STANDBY_PORT", PGPORT + 9))


@pytest.fixture
def torture_standby(database):
    """A hot standby of the test server, for one test."""
    path = (PGDATA or "").rstrip("/") + "-torture-standby"
    info = start_standby(path, STANDBY_PORT)
    yield info
    stop_standby(path)


def test_torture_with_a_hot_standby(database, stream, torture_standby):
    """The load on an open stream (3 % of the transactions as a brand-new
    writer held 0.25-0.5 s) with a reader on a hot standby alongside the
    primary's: the standby never covers an ID whose COMMIT the primary had
    not been sent, never misses a row below its frontier, never goes back,
    and catches up."""
    r = torture.run(conninfo(), stream, seconds=6, readers=3, modes=torture.MODES + ("standby",),
                    standby=torture_standby, open_stream=True, fresh_writers=0.03)
    print(torture.summary_line(r))
    assert r["samples_by_mode"]["standby"] >= 20, r["samples_by_mode"]
    assert_clean_run(r, min_commits=200)


# =============================================================== within one statement


def test_frontier_is_stable_within_one_statement(connect, stream, pool):
    """frontier() is declared STABLE: every call in one statement must answer
    the same. A transaction that holds the lowest ID and aborts while the
    statement runs must not make the target list report a frontier above the
    one the WHERE clause filtered with: the caller would take F as its new
    position and never see the committed row below it."""
    c, holder, other, reader = connect(), connect(), connect(), connect()
    create_stream(c, stream)
    c.execute(f"CREATE TABLE {stream}_t (id bigint PRIMARY KEY)")
    holder.execute("BEGIN")
    assert one(holder, "SELECT streampos.next_id(%s, 'w1')", (stream,)) == 1
    other.execute("BEGIN")
    two = one(other, "SELECT streampos.next_id(%s, 'w2')", (stream,))
    other.execute(f"INSERT INTO {stream}_t VALUES (%s)", (two,))
    other.execute("COMMIT")
    assert one(reader, "SELECT streampos.frontier(%s)", (stream,)) == 0

    # The scan runs while ID 1 is in flight; ID 1 aborts during the sleep
    # that precedes the target list's frontier().
    def abort_later():
        time.sleep(0.5)
        holder.execute("ROLLBACK")

    f = pool.submit(abort_later)
    row = reader.execute(
        f"SELECT array_agg(id) FILTER (WHERE id <= streampos.frontier(%s)) AS seen, "
        f"pg_sleep(1.5)::text AS pause, streampos.frontier(%s) AS upto FROM {stream}_t",
        (stream, stream),
    ).fetchone()
    f.result(timeout=10)
    seen, upto = row[0] or [], row[2]
    missed = [i for i in [two] if i <= upto and i not in seen]
    assert not missed, (
        f"one statement reported frontier {upto} but its WHERE/FILTER used a lower one: "
        f"committed row(s) {missed} (visible to the statement) were left out"
    )


def test_frontier_is_stable_within_a_statement_under_load(database, stream):
    """The same property as above, sampled by the torture readers only in the
    one-statement FILTER form (frontier() in the target list and per row)."""
    r = torture.run(conninfo(), stream, seconds=8, writers=6, instances=3, readers=3, modes=("stmt_filter",))
    print(torture.summary_line(r))
    assert r["samples"] > 50
    assert r["violations"] == 0, (
        f"{r['violations']} of {r['samples']} one-statement samples missed rows:\n"
        + "\n".join(r["violation_details"][:10])
    )
    # Every answer (the frontier and its snapshot) against the model.
    assert_contract(r)


# =============================================================== finished ring overflow


def _fill_ring(conn, stream, n):
    """n committed single-ID transactions on a side stream named after
    ``stream`` (so the stream fixture drops it), fast: a procedure that
    commits in a loop, without waiting for the WAL flush."""
    side = f"{stream}_ring"
    create_stream(conn, side)
    conn.execute(
        "CREATE OR REPLACE PROCEDURE pg_temp.commits(s text, n int) LANGUAGE plpgsql AS $$ "
        "BEGIN FOR i IN 1..n LOOP PERFORM streampos.next_id(s, 'filler'); COMMIT; END LOOP; END $$"
    )
    conn.execute("SET synchronous_commit = off")
    conn.execute("CALL pg_temp.commits(%s, %s)", (side, n))
    conn.execute("RESET synchronous_commit")
    return side


def test_ring_overflow_never_moves_a_fresh_frontier_backwards(connect, stream):
    """While an old snapshot holds the xmin horizon, the finished ring fills
    and later commits are folded into a summary. A *fresh* snapshot must still
    never see the frontier go below what an earlier snapshot saw (invariant 3)
    nor be held back by commits it sees (invariant 2)."""
    c, holder, w = connect(), connect(), connect()
    create_stream(c, stream)
    ring = int(one(c, "SHOW streampos.finished_ring_size"))
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT 1")  # its snapshot holds the horizon: nothing is pruned
    try:
        _fill_ring(c, stream, ring + 10)
        # Our own stream, after the ring is full: these commits go to the summary.
        for _ in range(20):
            c.execute("SELECT streampos.next_id(%s, 'w1')", (stream,))
        before = one(c, "SELECT streampos.frontier(%s)", (stream,))
        assert before == one(c, "SELECT streampos.max_allocated(%s)", (stream,)) == 20
        w.execute("BEGIN")
        held = one(w, "SELECT streampos.next_id(%s, 'w2')", (stream,))
        for _ in range(5):
            c.execute("SELECT streampos.next_id(%s, 'w1')", (stream,))
        after = one(c, "SELECT streampos.frontier(%s)", (stream,))
        assert after >= before, (
            f"a fresh snapshot's frontier went backwards from {before} to {after} after the finished ring "
            f"overflowed (only ID {held} is in flight)"
        )
        assert after == held - 1, f"frontier {after}: held back below the only in-flight ID {held}"
    finally:
        holder.execute("COMMIT")
        w.execute("ROLLBACK")


def test_torture_while_an_old_snapshot_holds_the_horizon(connect, stream):
    """The torture load while a REPEATABLE READ transaction keeps the xmin
    horizon back and the finished ring is full: readers must still miss no
    row, and positions must not go backwards."""
    c, holder = connect(), connect()
    ring = int(one(c, "SHOW streampos.finished_ring_size"))
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT 1")
    try:
        _fill_ring(c, stream, ring + 10)
        r = torture.run(
            conninfo(), stream, seconds=8, readers=3, verify_at_end=False
        )
    finally:
        holder.execute("COMMIT")
    torture.verify(conninfo(), r)
    print(torture.summary_line(r))
    assert_clean_run(r, min_commits=200)


# =============================================================== terminated and failing writers


def test_pg_terminate_backend_of_writers_releases_their_ids(connect, db, stream):
    """Several writers are terminated mid-transaction while holding IDs: the
    IDs are released within a second and the frontier reaches max_allocated."""
    create_stream(db, stream)
    db.execute(f"CREATE TABLE {stream}_t (id bigint PRIMARY KEY)")
    writers = [connect() for _ in range(4)]
    pids = []
    for i, w in enumerate(writers):
        w.execute("BEGIN")
        ids = one(w, "SELECT streampos.next_ids(%s, %s, 3)", (stream, f"w{i}"))
        w.execute(f"INSERT INTO {stream}_t SELECT unnest(%s::bigint[])", (ids,))
        pids.append(backend_pid(w))
    # A later committed ID, so the frontier has somewhere to go.
    last = one(db, "SELECT streampos.next_id(%s, 'late')", (stream,))
    assert one(db, "SELECT streampos.frontier(%s)", (stream,)) == 0
    held = {r[1] for r in in_flight(db, stream)}
    assert set(pids) <= held

    victims = pids[:3]
    start = time.monotonic()
    assert all(r[0] for r in rows(db, "SELECT pg_terminate_backend(p) FROM unnest(%s::int[]) p", (victims,)))
    wait_until(
        lambda: not {r[1] for r in in_flight(db, stream)} & set(victims),
        timeout=1.0,
        message="the terminated writers' IDs to leave in_flight()",
    )
    released = time.monotonic() - start
    # The fourth writer still holds its IDs (the lowest in flight now).
    remaining = in_flight(db, stream)
    assert [r[1] for r in remaining] == [pids[3]]
    assert one(db, "SELECT streampos.frontier(%s)", (stream,)) == remaining[0][3] - 1
    writers[3].execute("ROLLBACK")
    wait_until(
        lambda: one(db, "SELECT streampos.frontier(%s) = streampos.max_allocated(%s)", (stream, stream)),
        timeout=1.0,
        message="frontier == max_allocated",
    )
    assert one(db, "SELECT streampos.frontier(%s)", (stream,)) == last
    assert one(db, f"SELECT count(*) FROM {stream}_t") == 0
    print(f"released {released:.3f}s after pg_terminate_backend")


def test_registry_exhaustion_in_one_transaction(connect, db, stream):
    """A transaction that allocates from more streams than
    streampos.max_streams_per_transaction gets 53400 with a HINT naming that
    setting; nothing of that transaction stays in flight, and every stream's
    frontier equals its max_allocated."""
    limit = int(one(db, "SHOW streampos.max_streams_per_transaction"))
    streams = [f"{stream}_{i}" for i in range(limit + 1)]
    for s in streams:
        create_stream(db, s)
        # Something committed before, so frontiers are not trivially 0.
        db.execute("SELECT streampos.next_id(%s, 'before')", (s,))
    w = connect()
    pid = backend_pid(w)
    w.execute("BEGIN")
    for s in streams[:limit]:
        w.execute("SELECT streampos.next_ids(%s, 'w1', 2)", (s,))
    assert one(db, "SELECT count(*) FROM streampos.in_flight() WHERE pid = %s", (pid,)) == limit
    err = expect_error(w, "SELECT streampos.next_id(%s, 'w1')", (streams[limit],), sqlstate="53400")
    assert "streampos.max_streams_per_transaction" in (err.diag.message_hint or ""), err.diag.message_hint
    # The transaction is aborted (not yet rolled back): its IDs are released already.
    assert w.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
    assert one(db, "SELECT count(*) FROM streampos.in_flight() WHERE pid = %s", (pid,)) == 0
    w.execute("ROLLBACK")
    assert one(db, "SELECT count(*) FROM streampos.in_flight() WHERE pid = %s", (pid,)) == 0
    for s in streams:
        f, m = db.execute(
            "SELECT streampos.frontier(%s), streampos.max_allocated(%s)", (s, s)
        ).fetchone()
        assert f == m, (s, f, m)
    # The session allocates normally afterwards.
    w.execute("BEGIN")
    for s in streams[:limit]:
        w.execute("SELECT streampos.next_id(%s, 'w1')", (s,))
    w.execute("COMMIT")
    assert session_in_flight(w) == 0


def test_registry_exhaustion_caught_by_savepoint_keeps_the_rest(connect, db, stream):
    """53400 caught by a savepoint: the transaction's other IDs stay in flight
    until it commits, then the frontier covers them."""
    limit = int(one(db, "SHOW streampos.max_streams_per_transaction"))
    streams = [f"{stream}_{i}" for i in range(limit + 1)]
    for s in streams:
        create_stream(db, s)
    w = connect()
    w.execute("BEGIN")
    got = {s: one(w, "SELECT streampos.next_id(%s, 'w1')", (s,)) for s in streams[:limit]}
    w.execute("SAVEPOINT sp")
    expect_error(w, "SELECT streampos.next_id(%s, 'w1')", (streams[limit],), sqlstate="53400")
    w.execute("ROLLBACK TO SAVEPOINT sp")
    assert session_in_flight(w) == limit
    for s in streams[:limit]:
        assert one(db, "SELECT streampos.frontier(%s)", (s,)) == got[s] - 1
    w.execute("COMMIT")
    for s in streams:
        f, m = db.execute("SELECT streampos.frontier(%s), streampos.max_allocated(%s)", (s, s)).fetchone()
        assert f == m == got.get(s, 0), (s, f, m)


def test_statement_timeout_inside_a_writer_transaction_releases_ids(connect, db, stream):
    """statement_timeout fires after the allocation: 57014, the transaction is
    aborted and its IDs are released at once (before ROLLBACK)."""
    create_stream(db, stream)
    w = connect()
    w.execute("SET statement_timeout = '100ms'")
    w.execute("BEGIN")
    ids = one(w, "SELECT streampos.next_ids(%s, 'w1', 3)", (stream,))
    assert in_flight(db, stream)[0][3:5] == (ids[0], ids[-1])
    expect_error(w, "SELECT pg_sleep(1)", sqlstate="57014")
    assert in_flight(db, stream) == []
    assert one(db, "SELECT streampos.frontier(%s) = streampos.max_allocated(%s)", (stream, stream))
    w.execute("ROLLBACK")
    assert one(w, "SELECT streampos.next_id(%s, 'w1')", (stream,)) == ids[-1] + 1
    assert_nothing_left(w)


def test_terminate_during_the_allocation_itself(connect, db, stream, pool):
    """A writer terminated while its allocation sits between publishing the
    lower bound and nextval (test-only delay): the pending entry holds the
    frontier while it lasts and is gone within a second of the termination."""
    create_stream(db, stream)
    db.execute("SELECT streampos.next_id(%s, 'w0')", (stream,))
    w = connect()
    pid = backend_pid(w)
    w.execute("SET streampos.test_allocation_delay_ms = 1500")
    w.execute("BEGIN")
    future = pool.submit(lambda: one(w, "SELECT streampos.next_ids(%s, 'w1', 5)", (stream,)))
    wait_until(lambda: in_flight(db, stream), timeout=5, message="the pending allocation")
    assert one(db, "SELECT streampos.frontier(%s)", (stream,)) == 1
    assert one(db, "SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(psycopg.Error):
        future.result(timeout=10)
    wait_until(lambda: not in_flight(db, stream), timeout=1.0, message="the pending entry to go")
    # Whatever nextval handed out before the backend died is a gap now.
    wait_until(
        lambda: one(db, "SELECT streampos.frontier(%s) = streampos.max_allocated(%s)", (stream, stream)),
        timeout=1.0,
        message="frontier == max_allocated",
    )
    assert one(db, "SELECT streampos.next_id(%s, 'w0')", (stream,)) > 1


# =============================================================== bad input at the SQL surface


@pytest.fixture
def open_stream(db, stream):
    """A stream any instance may write to."""
    create_stream(db, stream)
    return stream


NULL_CALLS = [
    ("SELECT streampos.next_id(NULL, 'w1')", False),
    ("SELECT streampos.next_id(%(s)s, NULL)", True),
    ("SELECT streampos.next_ids(NULL, 'w1', 3)", False),
    ("SELECT streampos.next_ids(%(s)s, NULL, 3)", True),
    ("SELECT streampos.next_ids(%(s)s, 'w1', NULL)", True),
    ("SELECT streampos.frontier(NULL)", False),
    ("SELECT streampos.max_allocated(NULL)", False),
    ("SELECT streampos.writer_position(NULL, 'w1')", False),
    ("SELECT streampos.writer_position(%(s)s, NULL)", True),
    ("SELECT streampos.current_token(NULL)::text", False),
]


@pytest.mark.parametrize("query,uses_stream", NULL_CALLS, ids=[q for q, _ in NULL_CALLS])
def test_null_arguments_return_null(db, open_stream, query, uses_stream):
    db.execute("BEGIN")
    assert one(db, query, {"s": open_stream} if uses_stream else None) is None
    assert session_in_flight(db) == 0
    db.execute("COMMIT")
    assert one(db, "SELECT streampos.max_allocated(%s)", (open_stream,)) == 0
    assert_nothing_left(db)


BAD_CALLS = [
    # (id, query, params ({s} is the stream), SQLSTATE)
    ("empty-stream-next_id", "SELECT streampos.next_id('', 'w1')", None, "42704"),
    ("unknown-stream-next_ids", "SELECT streampos.next_ids('no_such_stream_x', 'w1', 2)", None, "42704"),
    ("empty-stream-frontier", "SELECT streampos.frontier('')", None, "42704"),
    ("long-stream-frontier", "SELECT streampos.frontier(repeat('s', 100))", None, "42704"),
    ("empty-instance", "SELECT streampos.next_id(%(s)s, '')", {}, "22023"),
    ("instance-64-bytes", "SELECT streampos.next_id(%(s)s, repeat('i', 64))", {}, "22023"),
    ("instance-64-bytes-multibyte", "SELECT streampos.next_id(%(s)s, repeat('é', 32))", {}, "22023"),
    ("instance-1000-bytes", "SELECT streampos.next_ids(%(s)s, repeat('i', 1000), 2)", {}, "22023"),
    ("instance_id-empty", "SELECT streampos.instance_id('')", None, "22023"),
    ("instance_id-64-bytes", "SELECT streampos.instance_id(repeat('i', 64))", None, "22023"),
    ("create_stream-64-bytes", "SELECT streampos.create_stream(repeat('s', 64))", None, "22023"),
    ("create_stream-60-bytes", "SELECT streampos.create_stream(repeat('s', 60))", None, "22023"),
    ("create_stream-empty", "SELECT streampos.create_stream('')", None, "22023"),
    ("invalid-utf8", "SELECT streampos.next_id(%(s)s, E'\\xff')", {}, "22021"),
    ("n-zero", "SELECT streampos.next_ids(%(s)s, 'w1', 0)", {}, "22023"),
    ("n-negative", "SELECT streampos.next_ids(%(s)s, 'w1', -1)", {}, "22023"),
    ("n-min-int", "SELECT streampos.next_ids(%(s)s, 'w1', -2147483648)", {}, "22023"),
    ("n-huge", "SELECT streampos.next_ids(%(s)s, 'w1', 2000000000)", {}, "22023"),
    ("n-over-limit", "SELECT streampos.next_ids(%(s)s, 'w1', 1000001)", {}, "22023"),
    ("n-int-overflow", "SELECT streampos.next_ids(%(s)s, 'w1', 3000000000)", {}, "42883"),
]


@pytest.mark.parametrize("query,params,sqlstate", [b[1:] for b in BAD_CALLS], ids=[b[0] for b in BAD_CALLS])
def test_bad_input_is_a_clear_error_and_leaves_nothing(db, open_stream, query, params, sqlstate):
    if params is not None:
        params = {"s": open_stream}
    err = expect_error(db, query, params, sqlstate=sqlstate)
    assert err.diag.message_primary
    assert_nothing_left(db)
    # Nothing was allocated either.
    assert one(db, "SELECT streampos.max_allocated(%s)", (open_stream,)) == 0


IN_TRANSACTION_CALLS = [b for b in BAD_CALLS if "%(s)s" in b[1] and "E'" not in b[1]]


@pytest.mark.parametrize("query", [b[1] for b in IN_TRANSACTION_CALLS], ids=[b[0] for b in IN_TRANSACTION_CALLS])
def test_bad_call_inside_a_transaction_releases_its_earlier_ids(connect, db, open_stream, query):
    """A bad call aborts the transaction: the IDs it had allocated before are
    released at once, and the frontier is not held back."""
    w = connect()
    pid = backend_pid(w)
    held = "SELECT count(*) FROM streampos.in_flight() WHERE pid = %s"
    w.execute("BEGIN")
    first = one(w, "SELECT streampos.next_id(%s, 'w1')", (open_stream,))
    assert one(db, held, (pid,)) == 1
    expect_error(w, query, {"s": open_stream})
    # Aborted, not yet rolled back: released already.
    assert one(db, held, (pid,)) == 0
    assert one(db, "SELECT streampos.frontier(%s)", (open_stream,)) == first
    assert_nothing_left(w)


def test_control_characters_in_names_are_handled(db, stream):
    """Names are text: control characters are accepted (or refused) cleanly,
    never a crash; the stream then works like any other."""
    odd = stream[:40] + "\x01\x02\t"
    create_stream(db, odd)
    instance = "w\x01" + chr(0x7F) + "\n"
    db.execute("BEGIN")
    i = one(db, "SELECT streampos.next_id(%s, %s)", (odd, instance))
    assert i == 1
    assert [r[0] for r in in_flight(db, odd)] == [instance]
    db.execute("COMMIT")
    assert one(db, "SELECT streampos.frontier(%s)", (odd,)) == 1
    assert one(db, "SELECT streampos.writer_position(%s, %s)", (odd, instance)) == 1
    assert one(db, "SELECT streampos.instance_name(streampos.instance_id(%s))", (instance,)) == instance
    tok = one(db, "SELECT streampos.current_token(%s)::text", (odd,))
    assert tok == "1"
    db.execute("SELECT streampos.drop_stream(%s)", (odd,))
    expect_error(db, "SELECT streampos.frontier(%s)", (odd,), sqlstate="42704")
    assert_nothing_left(db)


def test_read_only_transaction_is_25006(connect, db, open_stream):
    w = connect()
    w.execute("BEGIN READ ONLY")
    expect_error(w, "SELECT streampos.next_id(%s, 'w1')", (open_stream,), sqlstate="25006")
    w.execute("ROLLBACK")
    w.execute("BEGIN")
    w.execute("SET TRANSACTION READ ONLY")
    expect_error(w, "SELECT streampos.next_ids(%s, 'w1', 3)", (open_stream,), sqlstate="25006")
    w.execute("ROLLBACK")
    w.execute("SET default_transaction_read_only = on")
    expect_error(w, "SELECT streampos.next_id(%s, 'w1')", (open_stream,), sqlstate="25006")
    # Reading works in a read-only transaction.
    assert one(w, "SELECT streampos.frontier(%s)", (open_stream,)) == 0
    w.execute("RESET default_transaction_read_only")
    assert_nothing_left(w)
    assert one(db, "SELECT streampos.max_allocated(%s)", (open_stream,)) == 0


def test_force_parallel_mode(connect, db, open_stream):
    """Reading functions are PARALLEL RESTRICTED: under force_parallel_mode
    they still answer (in the leader, for its snapshot), including inside a
    parallel scan's filter; next_id still allocates."""
    t = f"{open_stream}_t"
    db.execute(f"CREATE TABLE {t} (id bigint PRIMARY KEY, pad text)")
    db.execute("BEGIN")
    db.execute(
        f"INSERT INTO {t} SELECT i, repeat('x', 100) FROM unnest(streampos.next_ids(%s, 'w1', 5000)) i",
        (open_stream,),
    )
    db.execute("COMMIT")
    holder = connect()
    holder.execute("BEGIN")
    held = one(holder, "SELECT streampos.next_id(%s, 'w2')", (open_stream,))
    db.execute(f"INSERT INTO {t} VALUES (%s + 1, 'later')", (held,))  # a row above the in-flight ID
    db.execute(f"ANALYZE {t}")

    p = connect()
    for setting in (
        f"{force_parallel_setting(p)} = on",
        "parallel_setup_cost = 0",
        "parallel_tuple_cost = 0",
        "min_parallel_table_scan_size = 0",
        "max_parallel_workers_per_gather = 2",
    ):
        p.execute(f"SET {setting}")
    assert one(p, "SELECT streampos.frontier(%s)", (open_stream,)) == held - 1
    assert one(p, "SELECT streampos.max_allocated(%s)", (open_stream,)) == held
    # w1 holds nothing: an idle writer is at max_allocated.
    assert one(p, "SELECT streampos.writer_position(%s, 'w1')", (open_stream,)) == held
    assert one(p, "SELECT streampos.writer_position(%s, 'w2')", (open_stream,)) == held - 1
    assert one(p, "SELECT streampos.current_token(%s)::text", (open_stream,))
    plan = "\n".join(
        r[0]
        for r in rows(
            p, f"EXPLAIN SELECT count(*) FROM {t} WHERE pad <> '' AND id <= streampos.frontier(%s)", (open_stream,)
        )
    )
    assert one(p, f"SELECT count(*) FROM {t} WHERE pad <> '' AND id <= streampos.frontier(%s)", (open_stream,)) == 5000, plan
    assert one(p, f"SELECT count(*) FROM {t} WHERE pad <> ''") == 5001
    # Allocation under force_parallel_mode (next_id is PARALLEL UNSAFE: no parallel plan).
    p.execute("BEGIN")
    got = one(p, "SELECT streampos.next_id(%s, 'w3')", (open_stream,))
    assert got > held
    assert session_in_flight(p) == 1
    p.execute("ROLLBACK")
    holder.execute("ROLLBACK")
    assert one(p, "SELECT streampos.frontier(%s) = streampos.max_allocated(%s)", (open_stream, open_stream))
    assert_nothing_left(p)


# =============================================================== crashes and restarts (keep these last)


def _wait_for_crash(conn, timeout=30.0):
    """Wait until the postmaster has killed ``conn``'s backend (crash restart)."""

    def gone():
        try:
            conn.execute("SELECT 1")
            return False
        except psycopg.Error:
            return True

    wait_until(gone, timeout=timeout, interval=0.05, message="the crash restart to end old sessions")


def _after_restart_checks(conn, stream):
    """After any restart: nothing in flight, frontier == max_allocated ==
    the sequence's value, stored positions not ahead of it."""
    seq = one(conn, "SELECT seq::text FROM streampos.streams WHERE stream_name = %s", (stream,))
    front, maxa = conn.execute(
        "SELECT streampos.frontier(%s), streampos.max_allocated(%s)", (stream, stream)
    ).fetchone()
    value = sequence_value(conn, seq)
    assert in_flight(conn, stream) == []
    assert front == maxa == value, (front, maxa, value)
    stored = stored_positions(conn, stream)
    assert all(p <= value for p in stored.values()), f"stored positions {stored} ahead of the sequence ({value})"
    return front


@pytest.mark.restarts_server
def test_immediate_shutdown_during_torture(connect, stream):
    """pg_ctl stop -m immediate in the middle of the load, then start: nothing
    in flight, frontier == max_allocated == sequence, every acknowledged row
    present, no sample (before or after) missed a row, and a second phase on
    the same stream is clean."""
    holder = {}

    def load():
        holder["r"] = torture.run(
            conninfo(), stream, seconds=60, readers=3, tolerate_disconnect=True, verify_at_end=False,
        )

    t = threading.Thread(target=load, daemon=True)
    t.start()
    time.sleep(4)
    try:
        stop_server("immediate")
        t.join(60)
        assert not t.is_alive(), "the harness did not stop after the server went away"
    finally:
        start_server()
    r = holder["r"]
    assert not r["errors"], r["errors"][:5]
    assert r["commits"] > 50 and r["disconnects"] > 0, (r["commits"], r["disconnects"])

    c = connect()
    front = _after_restart_checks(c, stream)
    table = r["table"]
    present = {x[0] for x in rows(c, f"SELECT id FROM {table}")}
    acknowledged = {i for ids in r["committed"].values() for i in ids}
    assert acknowledged <= present, f"acknowledged commits lost: {sorted(acknowledged - present)[:20]}"
    # Samples from before the crash, against what survived it (and
    # assert_contract at the end: missed rows, regressions, the model).
    torture.verify(conninfo(), r)
    assert not r["lost"] and not r["extra"], (r["lost"][:10], r["extra"][:10])

    # Phase two on the same stream; then phase one's samples again, against
    # rows committed after the restart (IDs handed out twice would show here).
    r2 = torture.run(conninfo(), stream, seconds=8, readers=3)
    print(torture.summary_line(r), "|", torture.summary_line(r2))
    assert_clean_run(r2, min_commits=100)
    assert r2["frontier"] > front
    v, details = torture.recheck_samples(c, table, r["sample_list"], backwards=r["backwards"])
    assert v == 0, details
    # The position worker came back with the server and catches up.
    wait_until(
        lambda: stored_positions(c, stream)
        == {n: p for n, _, p in rows(c, "SELECT * FROM streampos.writer_positions(%s)", (stream,))},
        timeout=3,
        message="stream_positions to catch up after the restart",
    )
    # Every answer before the crash against the model, and against the
    # first answers after the restart (never backwards across a crash).
    assert_contract(r)


def _server_children(*names):
    """PIDs of the postmaster's children whose title contains one of ``names``."""
    with open(os.path.join(os.environ["STREAMPOS_PGDATA"], "postmaster.pid")) as f:
        postmaster = int(f.readline())
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(postmaster)], capture_output=True, text=True)
    return [int(line.split()[0]) for line in out.stdout.splitlines() if any(n in line for n in names)]


@pytest.mark.restarts_server
def test_rolled_back_allocation_is_not_reused_after_immediate_shutdown(connect, stream):
    """A rolled-back allocation is a gap the frontier covers at once. After a
    crash the frontier must not go back below it, and its ID must not be
    handed out again: a reader that read "nothing up to F" before the crash
    would miss the row that reuses the ID (invariants 1 and 3).

    Whether the sequence's WAL record survives depends on something flushing
    the WAL before the crash: the WAL writer (within wal_writer_delay) or the
    position worker's next commit (within position_interval_ms), ~200 ms
    each. Both are paused (SIGSTOP) across the window, so that the outcome
    does not depend on timing."""
    if os.geteuid() != 0 or not os.environ.get("STREAMPOS_PGDATA"):
        pytest.skip("needs root and STREAMPOS_PGDATA to pause server processes")
    c, w = connect(), connect()
    create_stream(c, stream)
    c.execute(f"CREATE TABLE {stream}_t (id bigint PRIMARY KEY)")
    c.execute("SELECT streampos.next_id(%s, 'w0')", (stream,))  # starts the position worker
    c.execute("CHECKPOINT")  # the next nextval writes a fresh WAL record
    paused = _server_children("walwriter", "streampos position worker")
    assert paused, "no WAL writer found"
    for pid in paused:
        os.kill(pid, signal.SIGSTOP)
    try:
        w.execute("BEGIN")
        rolled_back = one(w, "SELECT streampos.next_id(%s, 'w1')", (stream,))
        w.execute("ROLLBACK")
        before = one(c, "SELECT streampos.frontier(%s)", (stream,))
        assert before == rolled_back
        seen_before = one(c, f"SELECT count(*) FROM {stream}_t WHERE id <= %s", (before,))
        # Immediate shutdown: the postmaster SIGQUITs every child; the paused
        # ones act on it once continued.
        stopper = threading.Thread(target=stop_server, args=("immediate",))
        stopper.start()
        _wait_for_crash(c)
    finally:
        for pid in paused:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    stopper.join(90)
    start_server()
    c = connect()
    after = one(c, "SELECT streampos.frontier(%s)", (stream,))
    c.execute("BEGIN")
    new = one(c, f"INSERT INTO {stream}_t VALUES (streampos.next_id(%s, 'w1')) RETURNING id", (stream,))
    c.execute("COMMIT")
    seen_now = one(c, f"SELECT count(*) FROM {stream}_t WHERE id <= %s", (before,))
    assert after >= before and new > rolled_back and seen_now == seen_before, (
        f"frontier {before} before the crash, {after} after; ID {rolled_back} (rolled back, covered by "
        f"the frontier) was handed out again as {new}: a reader that read every row <= {before} "
        f"before the crash never sees the new row"
    )


@pytest.mark.restarts_server
def test_kill_9_of_a_backend_holding_ids(connect, stream):
    """SIGKILL of a writer's backend while it holds IDs, under load: the
    postmaster restarts every backend; afterwards frontier == max_allocated
    == sequence, acknowledged rows are present, and allocation continues."""
    if os.geteuid() != 0:
        pytest.skip("needs root to kill a postgres backend")
    holder = {}

    def load():
        holder["r"] = torture.run(
            conninfo(), stream, seconds=60, readers=2, tolerate_disconnect=True, verify_at_end=False,
        )

    t = threading.Thread(target=load, daemon=True)
    t.start()
    observer = connect()
    time.sleep(3)
    victim = wait_until(
        lambda: one(observer, "SELECT min(pid) FROM streampos.in_flight(%s)", (stream,)),
        timeout=10,
        message="a backend holding IDs",
    )
    os.kill(victim, signal.SIGKILL)
    _wait_for_crash(observer)
    t.join(60)
    assert not t.is_alive()
    wait_for_server()
    r = holder["r"]
    assert not r["errors"], r["errors"][:5]
    assert r["disconnects"] > 0, "the crash restart did not reach the load's sessions"

    c = connect()
    _after_restart_checks(c, stream)
    torture.verify(conninfo(), r)  # (assert_contract at the end)
    assert not r["lost"] and not r["extra"], (r["lost"][:10], r["extra"][:10])

    # Allocation continues.
    c.execute("BEGIN")
    i = one(c, f"INSERT INTO {r['table']} VALUES (streampos.next_id(%s, 'torture_w1'), 'torture_w1', 'after') RETURNING id", (stream,))
    c.execute("COMMIT")
    assert one(c, "SELECT streampos.frontier(%s)", (stream,)) == i == one(c, "SELECT streampos.max_allocated(%s)", (stream,))
    r2 = torture.run(conninfo(), stream, seconds=4, readers=2)
    assert_clean_run(r2, min_commits=50)
    assert_contract(r)
