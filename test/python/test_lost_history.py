"""Lost history: a server that may lack commits another server acknowledged
(a promoted standby, a failover by removing standby.signal, a base backup
started as a primary) never reports a position in the range its history
may have lost, refuses a follower's position in it (72000), and keeps
doing so across restarts (docs/design.md, "Lost history").

0.2.0 keyed "may lack history" on the signal files of the current start
and on the sequence's value at the first load: a token exactly at the
replayed value was accepted, wait_for was never checked, a restart of the
promoted node (clean or crash) or a failover by removing standby.signal
checked nothing, the check stopped once the worker stored a position above
the replayed value, and a base backup started as a primary checked nothing.

Every test runs on clusters of its own (cluster.py).
"""

import os

import psycopg
import pytest

from cluster import Clusters, _bin, _run, USER

RESYNC = "72000"


@pytest.fixture
def clusters():
    with Clusters() as made:
        yield made


def setup(node):
    with node.connect() as c:
        c.execute("SELECT streampos.create_stream('ev')")
        c.execute("CREATE TABLE ev (id bigint PRIMARY KEY, writer text NOT NULL)")
        c.execute("SELECT streampos.add_table('ev', 'ev'::regclass, 'id', 'writer')")


def commit_rows(node, n, writer="w1"):
    with node.connect() as c:
        return [c.execute("INSERT INTO ev SELECT streampos.next_id('ev', %s), %s RETURNING id",
                          (writer, writer)).fetchone()[0] for _ in range(n)]


def refused(conn, sql, params=None):
    """The SQLSTATE of a call that must fail with it (or the value)."""
    try:
        return conn.execute(sql, params).fetchone()[0]
    except psycopg.Error as e:
        return e.sqlstate


def check_lost_range(node, have, ceiling, writer_id):
    """Every follower position in (have, ceiling] is refused, below and
    above is not; the server's own positions never fall in the range."""
    with node.connect() as c:
        frontier = c.execute("SELECT streampos.frontier('ev')").fetchone()[0]
        assert not have < frontier <= ceiling, f"the server reports {frontier}, in ({have}, {ceiling}]"
        for position in (have + 1, ceiling):
            for token in (f"{position}", f"m{have}~{writer_id}.{position}"):
                got = refused(c, "SELECT streampos.updates('ev', %s, timeout_ms => 0)", (token,))
                assert got == RESYNC, f"updates since {token}: {got}"
            got = refused(c, "SELECT streampos.wait_for('ev', %s, 0)", (position,))
            assert got == RESYNC, f"wait_for {position}: {got}"
        got = refused(c, "SELECT streampos.updates('ev', %s, timeout_ms => 0)", (str(have),))
        assert got != RESYNC, f"updates since {have} (the server has it): {got}"


def lose_commits(clusters):
    """An asynchronous pair; one row replicated, then the standby cut off,
    a hundred more committed on the primary, which is then lost. Returns
    (the standby, the IDs the standby has, the lost IDs)."""
    pair = clusters.pair()
    primary, standby = pair
    setup(primary)
    kept = commit_rows(primary, 1)
    pair.caught_up()
    pair.disconnect()
    lost = commit_rows(primary, 100)
    primary.kill()
    return standby, kept, lost


def test_a_promoted_standby_refuses_the_lost_range_across_restarts(clusters):
    standby, kept, lost = lose_commits(clusters)
    standby.promote()
    with standby.connect() as c:
        ceiling = c.execute("SELECT last_value FROM streampos.ev_seq").fetchone()[0]
        w1 = c.execute("SELECT streampos.instance_id('w1')").fetchone()[0]
        assert c.execute("SELECT streampos.frontier('ev')").fetchone()[0] == kept[-1]
    # The sequence's replayed record covers 32 values past the kept row.
    assert kept[-1] < ceiling < lost[-1]
    check_lost_range(standby, kept[-1], ceiling, w1)
    # Before any allocation: a restart finds the range again.
    standby.stop()
    standby.start()
    check_lost_range(standby, kept[-1], ceiling, w1)
    # The first new ID is past the range, and the frontier jumps to it.
    [new] = commit_rows(standby, 1)
    assert new == ceiling + 1
    with standby.connect() as c:
        assert c.execute("SELECT streampos.frontier('ev')").fetchone()[0] == new
        answer = c.execute("SELECT streampos.updates('ev', %s, timeout_ms => 0)", (str(new),)).fetchone()[0]
        assert answer["token"] == str(new)
        # The worker has stored a position past the range: still refused.
        c.execute("SELECT pg_sleep(0.5)")
        assert c.execute("SELECT max(stream_id) FROM streampos.stream_positions").fetchone()[0] == new
    check_lost_range(standby, kept[-1], ceiling, w1)
    for mode in ("fast", "immediate"):
        standby.stop(mode)
        standby.start()
        check_lost_range(standby, kept[-1], ceiling, w1)


def test_a_standby_started_without_its_signal_file_refuses_the_lost_range(clusters):
    """A failover by removing standby.signal and restarting: the timeline
    stays the same and no signal file is left, yet the history may lack
    the lost primary's commits."""
    standby, kept, lost = lose_commits(clusters)
    standby.stop()
    os.remove(os.path.join(standby.datadir, "standby.signal"))
    standby.start()
    with standby.connect() as c:
        assert c.execute("SELECT pg_is_in_recovery()").fetchone()[0] is False
        ceiling = c.execute("SELECT last_value FROM streampos.ev_seq").fetchone()[0]
        w1 = c.execute("SELECT streampos.instance_id('w1')").fetchone()[0]
    check_lost_range(standby, kept[-1], ceiling, w1)
    standby.stop("immediate")
    standby.start()
    check_lost_range(standby, kept[-1], ceiling, w1)


def test_a_base_backup_started_as_a_primary_refuses_what_it_never_had(clusters):
    """A base backup started as a primary begins a history of its own:
    nothing the primary committed after the backup exists there. (Its
    sequence is what the backup's checkpoint found, so its lost range is
    empty; what the primary handed out after it is beyond anything the
    backup allocated.)"""
    primary = clusters.node()
    setup(primary)
    kept = commit_rows(primary, 1)
    backup = clusters._new_node("backup")
    _run([_bin("pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port), "-U", USER,
          "-D", backup.datadir, "-X", "stream", "-c", "fast", "--no-sync"], timeout=180)
    backup.set(port=backup.port, cluster_name=f"backup{backup.port}")
    try:
        os.remove(backup.log)
    except FileNotFoundError:
        pass
    lost = commit_rows(primary, 50)
    backup.start()
    for restart in (None, "fast", "immediate"):
        if restart:
            backup.stop(restart)
            backup.start()
        with backup.connect() as c:
            assert c.execute("SELECT streampos.frontier('ev')").fetchone()[0] == kept[-1]
            for token in (str(lost[-1]), str(kept[-1] + 1)):
                got = refused(c, "SELECT streampos.updates('ev', %s, timeout_ms => 0)", (token,))
                assert got == RESYNC, f"updates since {token} after {restart}: {got}"
            got = refused(c, "SELECT streampos.updates('ev', %s, timeout_ms => 0)", (str(kept[-1]),))
            assert got != RESYNC
    # Its first allocation stores the stream's mark in its history.
    assert commit_rows(backup, 1) == [kept[-1] + 1]
    with backup.connect() as c:
        assert c.execute("SELECT have, ceiling FROM streampos.history_marks").fetchall() == [
            (kept[-1], kept[-1])]


def test_a_crash_restart_of_a_primary_refuses_nothing(clusters):
    """A primary's own crash restart loses no commit its frontiers passed:
    its history is not in doubt, and every position it reported stays
    valid."""
    node = clusters.node()
    setup(node)
    ids = commit_rows(node, 5)
    node.kill()
    node.start()
    with node.connect() as c:
        answer = c.execute("SELECT streampos.updates('ev', %s, timeout_ms => 0)", (str(ids[-1]),)).fetchone()[0]
        # The sequence restarted past what its last WAL record logged ahead:
        # a gap, which the frontier passes.
        assert int(answer["token"]) >= ids[-1] and answer["data"][0][2] == 0, answer
        assert c.execute("SELECT count(*) FROM streampos.history_marks").fetchone()[0] == 0
