"""Exact across failover and recovery: a standby promoted after a crash of
its primary, synchronous and asynchronous replication, followers that are
ahead of the new primary, and imported instance ids.

Every test runs on clusters of its own (cluster.py: own ports and data
directories), never on the server the rest of the suite shares. The load
scenario and the lag measurement live in failover_measure.py, which also
runs them by hand and prints the figures.
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from cluster import Clusters
from support import wait_until
from failover_measure import (
    failover_under_load,
    measure_lag,
    set_position_interval,
    setup_stream,
    token_positions,
    update_rows,
)

# The SQLSTATE with which updates() and wait_for() tell a follower that its
# position is ahead of anything this server ever allocated (it followed a
# primary that was lost with commits the new primary never received): the
# follower must resynchronise, not wait or skip rows.
RESYNC_SQLSTATE = "72000"


@pytest.fixture
def clusters():
    with Clusters() as made:
        yield made


@pytest.fixture(scope="module")
def steady():
    """An asynchronous pair that never fails over (scenarios 4 to 6)."""
    with Clusters() as made:
        yield made.pair()


def sequence_value(conn, stream="ev"):
    last, called = conn.execute(f"SELECT last_value, is_called FROM streampos.{stream}_seq").fetchone()
    return last if called else last - 1


def commit_rows(node, n, writers=("w1",), stream="ev"):
    """n transactions, each next_id + INSERT of its row; returns the IDs."""
    ids = []
    with node.connect() as c:
        for i in range(n):
            w = writers[i % len(writers)]
            ids.append(c.execute(
                f"INSERT INTO {stream} SELECT streampos.next_id(%s, %s), %s, 'r' RETURNING id",
                (stream, w, w)).fetchone()[0])
    return ids


def frontier(conn, stream="ev"):
    return conn.execute("SELECT streampos.frontier(%s)", (stream,)).fetchone()[0]


def highest_position(conn, stream="ev"):
    """The highest position the current token reports (frontier or a writer
    ahead of it)."""
    return conn.execute("SELECT streampos.max_stream_pos(streampos.current_token(%s))",
                        (stream,)).fetchone()[0]


def timed(conn, sql, params=None):
    """(first column or the psycopg error, seconds taken)."""
    start = time.monotonic()
    try:
        value = conn.execute(sql, params).fetchone()[0]
    except psycopg.Error as e:
        value = e
    return value, time.monotonic() - start


# ---------------------------------------------------------------- 1


@pytest.mark.parametrize("call", ["updates", "wait_for", "none"])
def test_promoted_standby_frontier_is_current_without_next_id(clusters, call):
    """A follower call refused on the standby must not leave the standby's
    (stale) sequence value in the registry: after promotion the frontier
    covers every committed ID at once. ("none": no call on the standby, the
    control case.)"""
    pair = clusters.pair()
    primary, standby = pair
    setup_stream(primary, writers=["w1"])
    commit_rows(primary, 10)
    pair.caught_up()
    with standby.connect() as s:
        sql = {"updates": "SELECT streampos.updates('ev', '0', timeout_ms => 0)",
               "wait_for": "SELECT streampos.wait_for('ev', 5, 0)",
               "none": "SELECT streampos.frontier('ev')"}[call]
        try:
            s.execute(sql)
        except psycopg.Error as e:
            assert e.sqlstate == "0A000", f"{call} on a standby: {e.sqlstate} {e}"
    committed = commit_rows(primary, 200)
    assert committed[-1] == 210
    pair.caught_up()
    pair.failover()

    with standby.connect() as c:
        seq = sequence_value(c)
        f = frontier(c)
        m = c.execute("SELECT streampos.max_allocated('ev')").fetchone()[0]
        assert 210 <= f <= seq, (
            f"new primary: frontier {f} (max_allocated {m}) with no next_id; every committed ID "
            f"up to 210 must be covered, and nothing past its sequence ({seq})")
        assert m == f, f"nothing is in flight, yet max_allocated {m} <> frontier {f}"

        reached, took = timed(c, "SELECT streampos.wait_for('ev', 210, 3000)")
        assert not isinstance(reached, Exception), f"wait_for(210): {reached}"
        assert reached >= 210 and took < 2.0, f"wait_for(210) returned {reached} after {took:.1f}s"

        answer, took = timed(c, "SELECT streampos.updates('ev', '10', max_rows => 1000, timeout_ms => 3000)")
        assert not isinstance(answer, Exception), f"updates(since 10): {answer}"
        got = [r[0] for r in update_rows(answer)]
        assert got == list(range(11, 211)) and took < 2.0, (
            f"updates(since 10) after {took:.1f}s: token {answer['token']}, rows {got[:3]}…{got[-3:]} "
            f"({len(got)} of 200)")

        if f > 210:
            # The gap up to the sequence is final: a follower at 210 moves on.
            answer, took = timed(c, "SELECT streampos.updates('ev', '210', timeout_ms => 3000)")
            assert not isinstance(answer, Exception), f"updates(since 210): {answer}"
            assert token_positions(answer["token"])[0] == f and not update_rows(answer) and took < 2.0, (
                f"updates(since 210) after {took:.1f}s: {answer}")

        checks = c.execute("SELECT check_name, ok, detail FROM streampos.check_stream('ev')").fetchall()
        assert all(ok for _, ok, _ in checks), checks

        # And allocation continues above everything reported.
        new_id = c.execute("SELECT streampos.next_id('ev', 'w1')").fetchone()[0]
        assert new_id > f


# ---------------------------------------------------------------- 2


def end_allocation(primary, ending, n=40):
    """One transaction that allocates n IDs and writes nothing else, ended
    by ``ending`` while the synchronous standby is away. Returns the IDs."""
    with primary.connect() as c:
        if ending == "rollback":
            c.execute("BEGIN")
            ids = c.execute("SELECT streampos.next_ids('ev', 'w1', %s)", (n,)).fetchone()[0]
            c.execute("ROLLBACK")
            return ids
        if ending == "commit_local":
            # This session does not wait for the standby; the others do.
            c.execute("SET synchronous_commit = local")
            c.execute("BEGIN")
            ids = c.execute("SELECT streampos.next_ids('ev', 'w1', %s)", (n,)).fetchone()[0]
            c.execute("COMMIT")
            return ids
        assert ending == "commit_cancelled_wait"
        # The commit waits for the standby; cancelling the wait leaves it
        # committed locally (PostgreSQL warns, and the IDs are finished here).
        c.execute("BEGIN")
        ids = c.execute("SELECT streampos.next_ids('ev', 'w1', %s)", (n,)).fetchone()[0]
        pid = c.info.backend_pid
        done = {}

        def commit():
            try:
                c.execute("COMMIT")
                done["ok"] = True
            except psycopg.Error as e:
                done["error"] = e

        t = threading.Thread(target=commit, daemon=True)
        t.start()
        with primary.connect() as o:
            deadline = time.monotonic() + 10
            while o.execute("SELECT wait_event FROM pg_stat_activity WHERE pid = %s",
                            (pid,)).fetchone()[0] != "SyncRep":
                assert time.monotonic() < deadline, "the commit never waited for the standby"
                time.sleep(0.01)
            # Waiting for the standby, the IDs are in flight.
            assert frontier(o) < ids[0]
            o.execute("SELECT pg_cancel_backend(%s)", (pid,))
        t.join(10)
        assert done.get("ok"), f"cancelled commit: {done}"
        return ids


@pytest.mark.parametrize("ending", ["rollback", "commit_cancelled_wait", "commit_local"])
def test_sync_standby_away_ids_are_not_final_before_it_has_them(clusters, ending):
    """With a synchronous standby away, IDs that ended on the primary only
    (aborted, or committed locally) must not move the frontier past what the
    standby has: promoted, it would hand them out again. Once the standby
    is back, the frontier moves."""
    pair = clusters.pair(synchronous=True)
    primary, standby = pair
    setup_stream(primary, writers=["w1"])
    commit_rows(primary, 10)
    pair.caught_up()
    with standby.connect() as s:
        standby_has = sequence_value(s)
    reported = []

    standby.stop()
    ids = end_allocation(primary, ending)
    with primary.connect() as o:
        for _ in range(10):
            reported += [frontier(o), highest_position(o)]
            time.sleep(0.02)
    assert max(reported) <= standby_has, (
        f"{ending}: with the synchronous standby away (its sequence at {standby_has}), the primary "
        f"reported positions up to {max(reported)} for IDs {ids[0]}..{ids[-1]} only it has")

    standby.start()
    pair.wait_streaming()
    with primary.connect() as o:
        deadline = time.monotonic() + 10
        while frontier(o) < ids[-1]:
            assert time.monotonic() < deadline, (
                f"standby back, yet the frontier stays at {frontier(o)} below {ids[-1]}")
            time.sleep(0.02)

    # Away again, and this time the primary dies.
    standby.stop()
    ids = end_allocation(primary, ending)
    with primary.connect() as o:
        for _ in range(10):
            reported += [frontier(o), highest_position(o)]
            time.sleep(0.02)
    pair.failover()
    with standby.connect() as c:
        again = c.execute("SELECT streampos.next_ids('ev', 'w1', 5)").fetchone()[0]
    assert min(again) > max(reported), (
        f"{ending}: the old primary reported positions up to {max(reported)}; "
        f"the promoted standby handed out {again} again")


# ---------------------------------------------------------------- 3


def test_follower_ahead_of_new_primary_gets_resync_error(clusters):
    """Asynchronous failover with commits lost: a follower whose position is
    past anything the new primary allocated gets RESYNC_SQLSTATE from
    updates() and wait_for(), never a silent wait (and later rows below its
    position skipped)."""
    pair = clusters.pair()
    primary, standby = pair
    setup_stream(primary, writers=["w1", "w2"])
    commit_rows(primary, 20, writers=("w1", "w2"))
    pair.caught_up()
    pair.disconnect()
    with standby.connect() as s:
        standby_has = sequence_value(s)
    commit_rows(primary, 100, writers=("w1", "w2"))
    token, received = "0", []
    with primary.connect() as p:
        while len(received) < 120:
            answer = p.execute("SELECT streampos.updates('ev', %s, max_rows => 50, timeout_ms => 1000)",
                               (token,)).fetchone()[0]
            received += update_rows(answer)
            token = answer["token"]
    _, ahead = token_positions(token)
    primary.kill()
    standby.promote()

    with standby.connect() as c:
        new_has = sequence_value(c)
        assert standby_has <= new_has < ahead, (standby_has, new_has, ahead)
        # A follower that is not ahead carries on as usual.
        answer, took = timed(c, "SELECT streampos.updates('ev', '10', timeout_ms => 2000)")
        assert not isinstance(answer, Exception), f"updates(since 10): {answer}"
        assert [r[0] for r in update_rows(answer)] == list(range(11, 21)), answer

        answer, took = timed(c, "SELECT streampos.updates('ev', %s, timeout_ms => 2000)", (token,))
        assert isinstance(answer, psycopg.Error) and answer.sqlstate == RESYNC_SQLSTATE, (
            f"updates(since {token}) on a new primary that allocated up to {new_has} at most: "
            f"expected ERROR {RESYNC_SQLSTATE}, got "
            + (f"ERROR {answer.sqlstate}: {answer}" if isinstance(answer, psycopg.Error)
               else f"{answer} after {took:.1f}s"))
        reached, took = timed(c, "SELECT streampos.wait_for('ev', %s, 2000)", (ahead,))
        assert isinstance(reached, psycopg.Error) and reached.sqlstate == RESYNC_SQLSTATE, (
            f"wait_for({ahead}) on a new primary that allocated up to {new_has} at most: "
            f"expected ERROR {RESYNC_SQLSTATE}, got "
            + (f"ERROR {reached.sqlstate}: {reached}" if isinstance(reached, psycopg.Error)
               else f"{reached} after {took:.1f}s"))


def test_a_monitoring_read_after_promotion_does_not_wait_for_a_stream_table(clusters):
    """In a promoted server's new history, the first use of a stream reads
    its tables (what this server has: the history's mark). A monitoring
    read that would load the stream then needs them: a lock on one refuses
    at once with 55P03 naming it, and the read answers once it is gone
    (on a server never promoted the tables are not read, nor locked:
    test_monitoring_locks.py)."""
    pair, _ = replicated_rows(clusters, 5)
    primary, standby = pair
    primary.kill()
    standby.promote()
    with standby.connect() as holder, standby.connect() as reader:
        holder.execute("BEGIN")
        holder.execute("LOCK TABLE ev IN ACCESS EXCLUSIVE MODE")
        reader.execute("SET statement_timeout = '5s'")
        with pytest.raises(psycopg.errors.LockNotAvailable) as refused:
            reader.execute("SELECT * FROM streampos.stat_streams")
        assert "table public.ev is locked" in str(refused.value), str(refused.value)
        holder.execute("ROLLBACK")
        frontier = reader.execute("SELECT frontier FROM streampos.stat_streams WHERE stream_name = 'ev'"
                                  ).fetchone()[0]
        assert frontier >= 5


# ---------------------------------------------------------------- 4


def test_check_stream_on_standby_is_read_only_or_refused(steady):
    primary, standby = steady
    with primary.connect() as p:
        p.execute("SELECT streampos.create_stream('cs')")
        p.execute("CREATE TABLE cs (id bigint PRIMARY KEY, writer text)")
        p.execute("SELECT streampos.add_table('cs', 'cs', 'id', 'writer')")
        for _ in range(5):
            p.execute("INSERT INTO cs SELECT streampos.next_id('cs', 'w'), 'w'")
    steady.caught_up()
    with standby.connect() as s:
        for repair in (False, True):
            try:
                checks = s.execute("SELECT check_name, ok, detail FROM streampos.check_stream('cs', %s)",
                                   (repair,)).fetchall()
            except psycopg.Error as e:
                assert e.sqlstate == "25006", (
                    f"check_stream(repair => {repair}) on a standby: ERROR {e.sqlstate}: "
                    f"{e.diag.message_primary} (detail: {e.diag.message_detail!r})")
                assert "backtrace" not in (e.diag.message_detail or "").lower()
                continue
            assert checks and all(ok for _, ok, _ in checks), checks


# ---------------------------------------------------------------- 5


def test_standby_position_lag(steady):
    """How far the standby's frontier (from the stored positions) lags the
    primary's under load, at the default position interval and at 20 ms:
    printed, not asserted. Asserted: never ahead of the rows the standby
    sees, never backwards."""
    try:
        results = measure_lag(steady, intervals=(200, 20), seconds=2.5)
    finally:
        set_position_interval(steady, 200)
    for r in results:
        print(r.summary())
    for r in results:
        assert r.standby_samples > 20 and r.time_lag_ms_p50 is not None, r
        assert not r.ahead_of_rows, (
            f"interval {r.interval_ms}: standby frontier above rows it cannot see "
            f"(frontier, visible, committed): {r.ahead_of_rows[:5]}")
        assert not r.backwards, f"interval {r.interval_ms}: standby frontier went back: {r.backwards[:5]}"


# ---------------------------------------------------------------- 6


def _fresh_database(node, name):
    node.one(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)", dbname="postgres")
    node.one(f"CREATE DATABASE {name}", dbname="postgres")


@pytest.mark.parametrize("how", ["insert", "copy", "dump_restore"])
def test_instance_id_numbering_skips_imported_ids(steady, how):
    """An instance imported with an explicit id (superuser INSERT, COPY, or
    carried by pg_dump/pg_restore): instance_id() for new names must never
    fail with 23505 when its own numbering reaches that id."""
    node = steady.primary
    db = f"inst_{how}"
    _fresh_database(node, db)
    if how == "dump_restore":
        source = f"{db}_src"
        _fresh_database(node, source)
        with node.connect(source) as c:
            c.execute("CREATE EXTENSION streampos")
            c.execute("SELECT streampos.instance_id('first')")
            c.execute("INSERT INTO streampos.instances (instance_id, instance_name) VALUES (5, 'imported')")
        dump = f"{node.datadir}/{source}.dump"
        node.tool("pg_dump", "-Fc", "-f", dump, source)
        node.tool("pg_restore", "-d", db, dump)
        imported = {1: "first", 5: "imported"}
    else:
        with node.connect(db) as c:
            c.execute("CREATE EXTENSION streampos")
            if how == "insert":
                c.execute("INSERT INTO streampos.instances (instance_id, instance_name) VALUES (5, 'imported')")
                imported = {5: "imported"}
            else:
                with c.cursor().copy("COPY streampos.instances (instance_id, instance_name) FROM STDIN") as cp:
                    cp.write_row((3, "imported3"))
                    cp.write_row((5, "imported5"))
                imported = {3: "imported3", 5: "imported5"}
    with node.connect(db) as c:
        ids = {}
        for i in range(8):
            name = f"new-{i}"
            try:
                ids[name] = c.execute("SELECT streampos.instance_id(%s)", (name,)).fetchone()[0]
            except psycopg.Error as e:
                pytest.fail(f"{how}: instance_id({name!r}) with ids {sorted(imported)} taken, after "
                            f"{ids}: ERROR {e.sqlstate}: {e}")
        assert len(set(ids.values())) == len(ids) and not set(ids.values()) & set(imported), (ids, imported)
        for name, i in list(ids.items()) + [(n, i) for i, n in imported.items()]:
            assert c.execute("SELECT streampos.instance_name(%s)", (i,)).fetchone()[0] == name
            assert c.execute("SELECT streampos.instance_id(%s)", (name,)).fetchone()[0] == i
    for name in (db, f"{db}_src"):
        node.one(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)", dbname="postgres")


# ---------------------------------------------------------------- 7


def test_failover_under_load_synchronous(clusters):
    """Four writers, a follower and readers; immediate stop of the primary,
    promotion of the synchronous standby, everyone reconnects. Nothing the
    old primary reported is handed out again, the follower gets every row
    exactly once, and the new primary's frontier is right without next_id."""
    fig = failover_under_load(clusters, synchronous=True, resync_sqlstate=RESYNC_SQLSTATE)
    print(fig.summary())
    assert fig.committed_before > 20 and fig.committed_after > 20, fig.summary()
    assert not fig.writer_errors and not fig.follower_errors, fig.summary()
    assert not fig.acked_lost, fig.summary()
    assert not fig.reissued_acked and not fig.reissued_below_frontier, fig.summary()
    if fig.follower_resync_error is not None:
        # Documented: a follower whose position ends in a gap of rolled-back
        # (or cut-off, never acknowledged) IDs above every row the new
        # primary has looks like one holding lost rows, and resynchronises
        # needlessly. Anything else is a wrong answer.
        _, position = token_positions(fig.follower_resync_token)
        assert fig.highest_old_acked <= fig.new_primary_highest_row < position, (
            f"the follower was told to resynchronise at {position}\n" + fig.summary())
    assert not fig.rows_skipped and not fig.rows_repeated and not fig.rows_lost_after_seen, fig.summary()
    assert fig.promotion_to_frontier_ms is not None, (
        "the new primary's frontier did not cover its rows without a next_id\n" + fig.summary())
    if fig.follower_resync_error is not None and fig.wait_for_sqlstate == RESYNC_SQLSTATE:
        # The same documented case: wait_for() at that position is refused
        # as the follower was.
        assert fig.wait_for_target > fig.new_primary_highest_row, fig.summary()
    else:
        assert fig.wait_for_reached is not None and fig.wait_for_reached >= fig.wait_for_target, fig.summary()


def test_failover_under_load_asynchronous(clusters):
    """The same with asynchronous replication cut before the stop, so that
    the follower is past anything the new primary has: it must be told to
    resynchronise (RESYNC_SQLSTATE), not skip the rows the new primary
    writes below its position."""
    fig = failover_under_load(clusters, synchronous=False, resync_sqlstate=RESYNC_SQLSTATE)
    print(fig.summary())
    assert fig.committed_before > 20 and fig.committed_after > 20, fig.summary()
    assert fig.standby_sequence_at_cut is not None and fig.highest_old_frontier > fig.standby_sequence_at_cut + 40, (
        "the scenario did not put the follower ahead of the standby\n" + fig.summary())
    assert not fig.rows_repeated, fig.summary()
    assert fig.follower_resync_error == RESYNC_SQLSTATE, (
        f"the follower was not told to resynchronise ({RESYNC_SQLSTATE})\n" + fig.summary())
    assert f"ERROR {RESYNC_SQLSTATE}" in (fig.wait_for_after_failover or ""), fig.summary()


# ---------------------------------------------------------------- followers on standbys


def follow_json(conn, since, max_rows=100, timeout_ms=0):
    """updates_json('ev', since, ...): (token, [row ids])."""
    answer = conn.execute("SELECT streampos.updates_json('ev', %s, %s, %s)",
                          (since, max_rows, timeout_ms)).fetchone()[0]
    return answer["token"], [r[0] for r in update_rows(answer)]


def replicated_rows(clusters, n, synchronous=False):
    """A pair with stream ev, n rows committed on the primary and the
    standby's frontier at n: (pair, the committed IDs)."""
    pair = clusters.pair(synchronous=synchronous)
    primary, standby = pair
    setup_stream(primary, writers=["w1"])
    committed = commit_rows(primary, n)
    pair.caught_up()
    with standby.connect() as s:
        wait_until(lambda: frontier(s) == n, timeout=10, message="the standby's frontier")
    return pair, committed


def test_a_follower_waiting_on_a_standby_goes_on_across_its_promotion(clusters):
    """A follower long-polls on the standby; the primary stops for good and
    the standby is promoted while it waits: the call ends soon after with
    its last answer (nothing new, its token), and the follower's next calls
    run on the promoted server's registry: every row once, no token back."""
    pair, committed = replicated_rows(clusters, 5, synchronous=True)
    primary, standby = pair
    with standby.connect() as s:
        token, ids = follow_json(s, "0")
    assert ids == committed
    with ThreadPoolExecutor(1) as pool, standby.connect() as s:
        waiting = pool.submit(follow_json, s, token, 100, 30000)
        time.sleep(0.5)
        assert not waiting.done()
        promoted = pair.failover()
        assert waiting.result(timeout=5) == (token, [])
        assert time.monotonic() - promoted < 3
    more = commit_rows(standby, 2)
    with standby.connect() as s:
        token2, ids2 = follow_json(s, token, 100, 5000)
    assert ids2 == more
    assert token_positions(token2)[0] >= token_positions(token)[0]


def test_a_follower_on_a_cascading_standby_is_woken_by_replay(clusters):
    """A standby of the standby replays the same records: a long-polling
    follower there is answered with a primary commit's row well within its
    1 s re-check, five times."""
    pair = clusters.pair()
    primary, standby = pair
    setup_stream(primary, writers=["w1"])
    commit_rows(primary, 1)
    pair.caught_up()
    cascade = clusters.cascade(standby)
    with cascade.connect() as c:
        wait_until(lambda: frontier(c) == 1, timeout=20, message="the cascading standby's frontier")
        token, ids = follow_json(c, "0")
        assert ids == [1]
    # Records replayed here: from now on a follower looks again only every
    # second unless one wakes it.
    commit_rows(primary, 1)
    with cascade.connect() as c:
        wait_until(lambda: frontier(c) == 2, timeout=20, message="the cascading standby's frontier")
        # (PostgreSQL 14: none; its followers look again every 100 ms.)
        wakeups = int(c.execute("SHOW server_version_num").fetchone()[0]) >= 150000
        assert (c.execute("SELECT streampos.standby_wakeups_replayed()").fetchone()[0] > 0) == wakeups
        token, ids = follow_json(c, token)
        assert ids == [2]
    latencies = []
    with ThreadPoolExecutor(1) as pool, cascade.connect() as c:
        for k in range(1, 6):
            waiting = pool.submit(follow_json, c, token, 100, 10000)
            time.sleep(0.3)
            started = time.monotonic()
            commit_rows(primary, 1)
            token, ids = waiting.result(timeout=15)
            latencies.append(time.monotonic() - started)
            assert ids == [k + 2]
    print("cascading standby follower latencies:", [round(x, 3) for x in latencies])
    # Woken by replay: a follower left to its 1 s re-check would answer
    # half a second late on average.
    assert max(latencies) < 0.5, latencies


def test_a_standby_follower_waiting_at_promotion_sends_no_position_back(clusters):
    """A follower caught up on the standby long-polls while the primary
    commits rows the worker has not stored yet (a long store interval
    widens the window a busy primary always has), then the primary dies and
    the standby is promoted. The waiting call ends with its standby answer
    and loads nothing: the new primary's frontier covers every committed
    row, and a follower that read them on the old primary goes on (an
    adversary's review: the wait loaded the registry mid-statement through
    the statement's older snapshot, and the frontier went back to 5)."""
    pair, _ = replicated_rows(clusters, 5, synchronous=True)
    primary, standby = pair
    with standby.connect() as s:
        token_a, _ = follow_json(s, "0")
    primary.set(**{"streampos.position_interval_ms": "60000"})
    primary.reload()
    time.sleep(1)
    with ThreadPoolExecutor(1) as pool, standby.connect() as a:
        waiting = pool.submit(follow_json, a, token_a, 100, 10000)
        time.sleep(0.5)
        committed = commit_rows(primary, 10)
        with primary.connect() as p:
            token_b, ids_b = follow_json(p, "5")
        assert ids_b == committed
        pair.failover()
        token, ids = waiting.result(timeout=20)
        assert token_positions(token)[0] >= 5 and set(ids) <= set(committed)
    with standby.connect() as s:
        assert frontier(s) == 15
        assert follow_json(s, token_b) == (token_b, [])
    more = commit_rows(standby, 2)
    with standby.connect() as s:
        assert follow_json(s, token_b)[1] == more


def test_a_lost_range_made_by_the_promotion_ends_a_standby_followers_wait(clusters):
    """Asynchronous: the old primary commits rows 21-25 the standby never
    receives, a follower holding token 25 long-polls on the standby, the
    standby is promoted and commits its own 21-23. The waiting call must
    not hand the follower the new history's rows as if they followed its
    25: it ends (with nothing) at the promotion, or is told to
    resynchronise (72000); a fresh call is told so."""
    pair, _ = replicated_rows(clusters, 20)
    primary, standby = pair
    pair.disconnect()
    commit_rows(primary, 5)
    with primary.connect() as p:
        wait_until(lambda: frontier(p) == 25, timeout=10, message="the old primary's frontier")
        token, ids = follow_json(p, "20")
    assert ids == [21, 22, 23, 24, 25]
    with ThreadPoolExecutor(1) as pool, standby.connect() as s:
        waiting = pool.submit(follow_json, s, token, 100, 20000)
        time.sleep(0.5)
        assert not waiting.done()
        primary.kill()
        standby.promote()
        commit_rows(standby, 3)
        try:
            answered = waiting.result(timeout=25)
        except psycopg.Error as e:
            assert e.sqlstate == RESYNC_SQLSTATE, e
        else:
            assert answered == (token, []), answered
    with standby.connect() as s:
        with pytest.raises(psycopg.Error) as err:
            follow_json(s, token)
        assert err.value.sqlstate == RESYNC_SQLSTATE
