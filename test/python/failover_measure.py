"""Failover under load (scenario 7 of test_failover.py), and how far a hot
standby's positions lag (scenario 5). The tests call these functions and
assert on the figures; run by hand, this prints them:

    .venv/bin/python test/python/failover_measure.py            # synchronous
    .venv/bin/python test/python/failover_measure.py --async    # asynchronous
    .venv/bin/python test/python/failover_measure.py --lag      # standby lag

with PG_BIN naming the PostgreSQL whose library directory has streampos
installed, and STREAMPOS_FAILOVER_PORT / STREAMPOS_FAILOVER_DIR as in
cluster.py.

The failover run: four writers (next_id and an INSERT of a row for it, each
in a transaction of its own, one in five rolled back), a follower on
updates() with a small max_rows recording every row and token, a reader
recording the primary's frontiers and one reading the standby (frontier(),
and wait_for(), which a standby refuses). Then an immediate stop of the
primary and pg_ctl promote on the standby; the follower and then the writers
reconnect to the new primary and continue. Asynchronous: before the stop,
replication is cut and the primary runs on until the follower is well past
what the standby has, so the new primary lacks rows the follower saw.
"""

import argparse
import bisect
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import psycopg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cluster import Clusters  # noqa: E402

STREAM = "ev"
WRITERS = ["w1", "w2", "w3", "w4"]
ROLLBACK_RATIO = 0.2


def setup_stream(node, writers=WRITERS):
    """Stream ev with table ev (id, writer, body), registered for updates()."""
    with node.connect() as c:
        c.execute("SELECT streampos.create_stream(%s, writers => %s::text[])", (STREAM, writers))
        c.execute(f"CREATE TABLE {STREAM} (id bigint PRIMARY KEY, writer text NOT NULL, body text)")
        c.execute("SELECT streampos.add_table(%s, %s::regclass, 'id', 'writer')", (STREAM, STREAM))


def token_positions(token):
    """(stream position, highest position) of a multi-writer token's text:
    '56' or 'm56~2.58~3.59'."""
    text = token.lstrip("sm")
    parts = text.split("~")
    stream = int(parts[0])
    highest = max([stream] + [int(p.split(".")[1]) for p in parts[1:] if p])
    return stream, highest


def update_rows(answer):
    """The rows of an updates() answer, as (id, writer, body) in order."""
    out = []
    data = answer["data"]
    i = 0
    while i < len(data):
        header = data[i]
        count = header[2]
        columns = header[4:]
        id_at, writer_at, body_at = (columns.index(c) for c in ("id", "writer", "body"))
        for row in data[i + 1:i + 1 + count]:
            out.append((row[id_at], row[writer_at], row[body_at]))
        i += 1 + count
    return out


def row_body(writer, epoch, sid):
    """Tells apart two rows with the same ID written before and after the
    failover."""
    return f"{writer}:{epoch}:{sid}"


def percentile(values, p):
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


# ---------------------------------------------------------------- scenario 7


@dataclass
class Figures:
    synchronous: bool
    committed_before: int = 0
    committed_after: int = 0
    rolled_back: int = 0
    commit_unknown: int = 0
    highest_old_frontier: int = 0
    highest_old_acked: int = 0
    standby_sequence_at_cut: int | None = None
    cut_ms: int | None = None
    new_primary_frontier_at_promotion: int | None = None
    new_primary_highest_row: int | None = None
    promotion_to_frontier_ms: float | None = None
    reissued_acked: list = field(default_factory=list)
    reissued_below_frontier: list = field(default_factory=list)
    rows_skipped: list = field(default_factory=list)
    rows_repeated: list = field(default_factory=list)
    rows_lost_after_seen: list = field(default_factory=list)
    acked_lost: list = field(default_factory=list)
    follower_resync_error: str | None = None
    follower_resync_token: str | None = None
    follower_first_answer_after_failover: str | None = None
    follower_errors: list = field(default_factory=list)
    writer_errors: list = field(default_factory=list)
    wait_for_after_failover: str | None = None
    wait_for_target: int | None = None
    standby_reads: str | None = None
    wait_for_reached: int | None = None
    wait_for_sqlstate: str | None = None

    def summary(self):
        def n(xs):
            shown = [x[0] if isinstance(x, tuple) else x for x in xs[:8]]
            return f"{len(xs)}" + (f" (e.g. IDs {shown})" if xs else "")

        mode = "synchronous" if self.synchronous else "asynchronous"
        ms = ("never (gave up)" if self.promotion_to_frontier_ms is None
              else f"{self.promotion_to_frontier_ms:.0f} ms")
        lines = [
            f"failover under load, {mode} replication",
            f"  commits acknowledged: {self.committed_before} before, {self.committed_after} after the failover; "
            f"{self.rolled_back} rolled back; {self.commit_unknown} commits cut off by the stop",
            f"  highest frontier the old primary reported: {self.highest_old_frontier}; "
            f"highest acknowledged ID: {self.highest_old_acked}",
            *([f"  replication cut with the standby's sequence at {self.standby_sequence_at_cut}; "
               f"the follower was 40 past it {self.cut_ms} ms later"] if not self.synchronous else []),
            f"  standby reader before the failover: {self.standby_reads}",
            f"  new primary at promotion: frontier {self.new_primary_frontier_at_promotion}, "
            f"highest row {self.new_primary_highest_row}",
            f"  time from promotion until the frontier covers the new primary's rows (no next_id): {ms}",
            f"  acknowledged IDs handed out again: {n(self.reissued_acked)}",
            f"  IDs at or below an old frontier handed out again: {n(self.reissued_below_frontier)}",
            f"  rows the follower skipped: {n(self.rows_skipped)}",
            f"  rows the follower received twice: {n(self.rows_repeated)}",
            f"  rows the follower received that the new primary lacks: {n(self.rows_lost_after_seen)}",
            f"  acknowledged commits lost: {n(self.acked_lost)}",
            f"  follower after the failover: {self.follower_first_answer_after_failover}",
            f"  wait_for(follower's position) on the new primary: {self.wait_for_after_failover}",
        ]
        if self.follower_errors:
            lines.append(f"  follower errors: {self.follower_errors[:5]}")
        if self.writer_errors:
            lines.append(f"  writer errors (other than the stop): {self.writer_errors[:5]}")
        return "\n".join(lines)


class FailoverRun:
    """State shared by the threads of one run."""

    def __init__(self, pair, resync_sqlstate, max_rows=10, seconds_before=2.0, seconds_after=2.0,
                 writer_pause=0.005, standby_wait_for=True):
        self.pair = pair
        self.resync_sqlstate = resync_sqlstate
        self.max_rows = max_rows
        self.seconds_before = seconds_before
        self.seconds_after = seconds_after
        # Between a writer's transactions, so that the follower keeps up.
        self.writer_pause = writer_pause
        # The standby reader also calls wait_for() (refused on a standby).
        self.standby_wait_for = standby_wait_for
        self.target = pair.primary
        self.epoch = 0
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.writers_stop = threading.Event()
        self.writers_go = threading.Event()
        self.writers_go.set()
        self.follower_go = threading.Event()
        self.follower_go.set()
        self.follower_moved_on = threading.Event()
        self.standby_reader_stop = threading.Event()
        # (epoch, id, writer, outcome): committed, rolled_back, unknown, failed
        self.allocations = []
        self.frontiers = []  # (epoch, monotonic time, frontier)
        self.standby_frontiers = []
        self.received = []  # (epoch, id, body)
        self.tokens = []  # (epoch, token)
        self.follower_result = None  # "resync" or "stopped"
        self.resync_token = None
        # Set once the writers have stopped: the follower stops when its
        # token covers this ID (every row is then received).
        self.drain_target = None
        self.follower_errors = []
        self.follower_first = None
        self.writer_errors = []
        self.standby_wait_for_answers = []

    # ------------------------------------------------------------ threads

    def _connect(self, epoch_seen, gate=None, stop=None):
        """A connection to the current primary (waiting while ``gate`` is
        clear), and the epoch it belongs to; None once ``stop`` is set."""
        stop = stop or self.done
        while not stop.is_set():
            if gate is not None and not gate.wait(0.05):
                continue
            with self.lock:
                node, epoch = self.target, self.epoch
            try:
                return node.connect(connect_timeout=2), epoch
            except psycopg.OperationalError:
                time.sleep(0.05)
        return None, epoch_seen

    def writer(self, name, seed):
        rng = random.Random(seed)
        conn, epoch = None, 0
        while not self.writers_stop.is_set():
            if not self.writers_go.wait(0.05):
                if conn is not None:
                    conn.close()
                    conn = None
                continue
            if conn is None:
                conn, epoch = self._connect(epoch, self.writers_go, self.writers_stop)
                if conn is None:
                    break
            sid, stage = None, "begin"
            try:
                conn.execute("BEGIN")
                stage = "next_id"
                sid = conn.execute("SELECT streampos.next_id(%s, %s)", (STREAM, name)).fetchone()[0]
                stage = "insert"
                conn.execute(f"INSERT INTO {STREAM} VALUES (%s, %s, %s)", (sid, name, row_body(name, epoch, sid)))
                if rng.random() < ROLLBACK_RATIO:
                    stage = "rollback"
                    conn.execute("ROLLBACK")
                    outcome = "rolled_back"
                else:
                    stage = "commit"
                    conn.execute("COMMIT")
                    outcome = "committed"
            except psycopg.Error as e:
                outcome = "unknown" if stage == "commit" else "failed"
                if not isinstance(e, psycopg.OperationalError):
                    self.writer_errors.append(f"{name} at {stage}: {e.sqlstate} {e}")
                try:
                    conn.close()
                except Exception:
                    pass
                conn = None
                time.sleep(0.02)
            if sid is not None:
                self.allocations.append((epoch, sid, name, outcome))
            time.sleep(rng.uniform(0, 2 * self.writer_pause))
        if conn is not None:
            conn.close()

    def follower(self):
        token, conn, epoch = "0", None, 0
        while True:
            if not self.follower_go.wait(0.05):
                if conn is not None:
                    conn.close()
                    conn = None
                continue
            if conn is None:
                conn, epoch = self._connect(epoch, self.follower_go)
                if conn is None:
                    self.follower_result = "gave up"
                    return
            try:
                answer = conn.execute(
                    "SELECT streampos.updates(%s, %s, max_rows => %s, timeout_ms => 300)",
                    (STREAM, token, self.max_rows),
                ).fetchone()[0]
            except psycopg.Error as e:
                if epoch == 1 and self.follower_first is None:
                    self.follower_first = f"ERROR {e.sqlstate}: {e.diag.message_primary}"
                    self.follower_moved_on.set()
                if e.sqlstate == self.resync_sqlstate:
                    self.follower_result = "resync"
                    self.resync_token = token
                    return
                if not isinstance(e, psycopg.OperationalError):
                    self.follower_errors.append(f"{e.sqlstate}: {e}")
                try:
                    conn.close()
                except Exception:
                    pass
                conn = None
                time.sleep(0.02)
                continue
            rows = update_rows(answer)
            for sid, _, body in rows:
                self.received.append((epoch, sid, body))
            if epoch == 1 and self.follower_first is None:
                self.follower_first = (f"answered token {answer['token']} with {len(rows)} rows "
                                       f"(since {token})")
                self.follower_moved_on.set()
            token = answer["token"]
            self.tokens.append((epoch, token))
            target = self.drain_target
            if target is not None and token_positions(token)[0] >= target:
                self.follower_result = "stopped"
                conn.close()
                return
            if self.done.is_set():
                self.follower_result = "gave up"
                conn.close()
                return

    def reader(self):
        conn, epoch = None, 0
        while not self.done.is_set():
            if conn is None:
                conn, epoch = self._connect(epoch)
                if conn is None:
                    return
            try:
                f = conn.execute("SELECT streampos.frontier(%s)", (STREAM,)).fetchone()[0]
                self.frontiers.append((epoch, time.monotonic(), f))
                time.sleep(0.005)
            except psycopg.Error:
                try:
                    conn.close()
                except Exception:
                    pass
                conn = None
                time.sleep(0.02)

    def standby_reader(self):
        """Reads the standby until the failover: frontier(), and every tenth
        time wait_for(), which a standby refuses."""
        standby = self.pair.standby
        i = 0
        with standby.connect() as conn:
            while not self.standby_reader_stop.is_set():
                i += 1
                try:
                    f = conn.execute("SELECT streampos.frontier(%s)", (STREAM,)).fetchone()[0]
                    self.standby_frontiers.append((time.monotonic(), f))
                    if self.standby_wait_for and i % 10 == 1:
                        w = conn.execute("SELECT streampos.wait_for(%s, 1, 0)", (STREAM,)).fetchone()[0]
                        self.standby_wait_for_answers.append(f"returned {w}")
                except psycopg.Error as e:
                    self.standby_wait_for_answers.append(e.sqlstate)
                time.sleep(0.01)

    # ------------------------------------------------------------ the run

    def run(self):
        pair = self.pair
        primary, standby = pair
        setup_stream(primary)
        pair.caught_up()
        fig = Figures(synchronous=pair.synchronous)
        threads = [threading.Thread(target=self.writer, args=(w, i), daemon=True)
                   for i, w in enumerate(WRITERS)]
        follower = threading.Thread(target=self.follower, daemon=True)
        threads.append(follower)
        threads.append(threading.Thread(target=self.reader, daemon=True))
        standby_reader = threading.Thread(target=self.standby_reader, daemon=True)
        threads.append(standby_reader)
        for t in threads:
            t.start()
        try:
            time.sleep(self.seconds_before)
            if not pair.synchronous:
                cut = time.monotonic()
                fig.standby_sequence_at_cut = self._cut_replication()
                fig.cut_ms = round((time.monotonic() - cut) * 1000)
            self.standby_reader_stop.set()
            standby_reader.join(10)
            primary.kill()
            self.writers_go.clear()
            self.follower_go.clear()
            promoted = standby.promote()
            with self.lock:
                self.target, self.epoch = standby, 1
            fig.new_primary_frontier_at_promotion, fig.new_primary_highest_row, fig.promotion_to_frontier_ms = (
                self._frontier_after_promotion(standby, promoted))
            # The follower first, so that its first call meets a new primary
            # that no writer has allocated from yet.
            self.follower_go.set()
            self.follower_moved_on.wait(10)
            self._wait_for_follower_position(standby, fig)
            self.writers_go.set()
            time.sleep(self.seconds_after)
        finally:
            self.writers_stop.set()
            self.writers_go.set()
            self.follower_go.set()
            self.standby_reader_stop.set()
            for t in threads[:len(WRITERS)]:
                t.join(15)
            self.drain_target = self._highest_row(self.target)
            follower.join(15)
            self.done.set()
            for t in threads:
                t.join(15)
        self._figures(fig, standby)
        return fig

    def _cut_replication(self):
        """Asynchronous: cut replication, then let the primary run on until
        the follower is 40 IDs past anything the standby's sequence has.
        Returns the standby's sequence value."""
        pair = self.pair
        pair.disconnect()
        standby = pair.standby
        wait = time.monotonic() + 10
        while standby.replay_lsn() != standby.receive_lsn() and time.monotonic() < wait:
            time.sleep(0.02)
        last, called = standby.all(f"SELECT last_value, is_called FROM streampos.{STREAM}_seq")[0]
        seq = last if called else last - 1
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.tokens and token_positions(self.tokens[-1][1])[0] > seq + 40:
                break
            time.sleep(0.02)
        return seq

    @staticmethod
    def _highest_row(node):
        try:
            return node.one(f"SELECT coalesce(max(id), 0) FROM {STREAM}")
        except psycopg.Error:
            return 0

    def _frontier_after_promotion(self, node, promoted, give_up=5.0):
        """The new primary's frontier, before any writer is back: it must
        cover every row the new primary has, with no next_id. Returns
        (first frontier, highest row, ms from promotion until covered or None)."""
        with node.connect() as c:
            highest = c.execute(f"SELECT coalesce(max(id), 0) FROM {STREAM}").fetchone()[0]
            first = None
            while True:
                f = c.execute("SELECT streampos.frontier(%s)", (STREAM,)).fetchone()[0]
                now = time.monotonic()
                first = f if first is None else first
                if f >= highest:
                    return first, highest, (now - promoted) * 1000
                if now - promoted > give_up:
                    return first, highest, None
                time.sleep(0.01)

    def _wait_for_follower_position(self, node, fig):
        """wait_for(the follower's last position) on the new primary."""
        if not self.tokens:
            return
        _, highest = token_positions(self.tokens[-1][1])
        fig.wait_for_target = highest
        with node.connect() as c:
            start = time.monotonic()
            try:
                f = c.execute("SELECT streampos.wait_for(%s, %s, 1000)", (STREAM, highest)).fetchone()[0]
                took = (time.monotonic() - start) * 1000
                fig.wait_for_reached = f
                fig.wait_for_after_failover = f"wait_for({highest}) returned {f} after {took:.0f} ms"
            except psycopg.Error as e:
                fig.wait_for_sqlstate = e.sqlstate
                fig.wait_for_after_failover = f"wait_for({highest}): ERROR {e.sqlstate}: {e.diag.message_primary}"

    def _figures(self, fig, node):
        old = [a for a in self.allocations if a[0] == 0]
        new = [a for a in self.allocations if a[0] == 1]
        acked_old = {a[1] for a in old if a[3] == "committed"}
        acked_old_rows = {(a[1], row_body(a[2], 0, a[1])) for a in old if a[3] == "committed"}
        fig.committed_before = len(acked_old)
        fig.committed_after = sum(1 for a in new if a[3] == "committed")
        fig.rolled_back = sum(1 for a in self.allocations if a[3] == "rolled_back")
        fig.commit_unknown = sum(1 for a in self.allocations if a[3] == "unknown")
        old_frontiers = [f for e, _, f in self.frontiers if e == 0]
        old_frontiers += [token_positions(t)[0] for e, t in self.tokens if e == 0]
        fig.highest_old_frontier = max(old_frontiers, default=0)
        fig.highest_old_acked = max(acked_old, default=0)
        new_ids = sorted({a[1] for a in new})
        fig.reissued_acked = [i for i in new_ids if i in acked_old]
        fig.reissued_below_frontier = [i for i in new_ids if i <= fig.highest_old_frontier]
        # Rows are (id, body): after an asynchronous failover one ID can
        # name a lost row and a new one.
        with node.connect() as c:
            final = set(c.execute(f"SELECT id, body FROM {STREAM}").fetchall())
        received = [(r[1], r[2]) for r in self.received]
        seen = set()
        fig.rows_repeated = sorted({r for r in received if r in seen or seen.add(r)})
        fig.rows_lost_after_seen = sorted(set(received) - final)
        fig.acked_lost = sorted(acked_old_rows - final)
        if self.follower_result == "resync":
            fig.follower_resync_error = self.resync_sqlstate
            fig.follower_resync_token = self.resync_token
            fig.rows_skipped = []
        else:
            fig.rows_skipped = sorted(final - set(received))
        answers = {}
        for a in self.standby_wait_for_answers:
            answers[a] = answers.get(a, 0) + 1
        last = self.standby_frontiers[-1][1] if self.standby_frontiers else None
        fig.standby_reads = (f"{len(self.standby_frontiers)} frontier() reads (last {last}); "
                             f"wait_for(): {answers or 'not called'}")
        fig.follower_first_answer_after_failover = self.follower_first
        fig.follower_errors = list(self.follower_errors)
        fig.writer_errors = list(self.writer_errors)


def failover_under_load(clusters, synchronous, resync_sqlstate, **kwargs):
    """Scenario 7 on a new pair from ``clusters``; returns its Figures."""
    pair = clusters.pair(synchronous=synchronous)
    return FailoverRun(pair, resync_sqlstate, **kwargs).run()


# ---------------------------------------------------------------- scenario 5


@dataclass
class LagFigures:
    interval_ms: int
    primary_samples: int
    standby_samples: int
    time_lag_ms_p50: float | None
    time_lag_ms_p99: float | None
    id_lag_p50: int | None
    id_lag_p99: int | None
    ahead_of_rows: list  # (standby frontier, rows visible <= it, rows committed <= it)
    backwards: list  # (previous, next)

    def summary(self):
        return (f"position_interval_ms={self.interval_ms}: standby frontier behind the primary's by "
                f"p50 {self.time_lag_ms_p50} ms / p99 {self.time_lag_ms_p99} ms, "
                f"p50 {self.id_lag_p50} / p99 {self.id_lag_p99} IDs "
                f"({self.primary_samples} primary, {self.standby_samples} standby samples)")


def standby_lag(pair, interval_ms, seconds=3.0, writers=2):
    """Load the primary of ``pair`` (stream ev must exist) and sample the
    frontier on both sides. The standby's samples also count the rows it
    sees at or below its frontier (one statement, one snapshot)."""
    primary, standby = pair
    stop = threading.Event()
    primary_samples, standby_samples = [], []

    def write(name):
        with primary.connect() as c:
            rng = random.Random(name)
            while not stop.is_set():
                c.execute("BEGIN")
                sid = c.execute("SELECT streampos.next_id(%s, %s)", (STREAM, name)).fetchone()[0]
                c.execute(f"INSERT INTO {STREAM} VALUES (%s, %s, 'lag')", (sid, name))
                c.execute("ROLLBACK" if rng.random() < ROLLBACK_RATIO else "COMMIT")

    def sample_primary():
        with primary.connect() as c:
            while not stop.is_set():
                f = c.execute("SELECT streampos.frontier(%s)", (STREAM,)).fetchone()[0]
                primary_samples.append((time.monotonic(), f))
                time.sleep(0.005)

    standby_stop = threading.Event()

    def sample_standby():
        with standby.connect() as c:
            while not standby_stop.is_set():
                # frontier() once (OFFSET 0 keeps it out of the scan's
                # filter), and the rows at or below it in the same snapshot.
                f, visible = c.execute(
                    f"SELECT f, (SELECT count(*) FROM {STREAM} WHERE id <= f) "
                    f"FROM (SELECT streampos.frontier(%s) AS f OFFSET 0) s",
                    (STREAM,),
                ).fetchone()
                standby_samples.append((time.monotonic(), f, visible))
                time.sleep(0.005)

    threads = [threading.Thread(target=write, args=(w,), daemon=True) for w in WRITERS[:writers]]
    threads.append(threading.Thread(target=sample_primary, daemon=True))
    standby_thread = threading.Thread(target=sample_standby, daemon=True)
    for t in threads + [standby_thread]:
        t.start()
    try:
        time.sleep(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    # Let the standby catch up with the primary's last frontier.
    final = primary.one("SELECT streampos.frontier(%s)", (STREAM,))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (standby_samples and standby_samples[-1][1] >= final):
        time.sleep(0.02)
    standby_stop.set()
    standby_thread.join(10)

    committed = sorted(r[0] for r in primary.all(f"SELECT id FROM {STREAM}"))

    def committed_upto(f):
        return bisect.bisect_right(committed, f)

    ahead = [(f, visible, committed_upto(f)) for _, f, visible in standby_samples
             if visible != committed_upto(f)]
    backwards = [(a[1], b[1]) for a, b in zip(standby_samples, standby_samples[1:]) if b[1] < a[1]]

    # For each frontier the primary reported, how long until the standby
    # reported as much. Both series grow with time (checked above for the
    # standby), so one forward scan finds each first standby sample at or
    # after the primary's with a frontier at least as high.
    time_lags = []
    k = 0
    for t, p in primary_samples:
        while k < len(standby_samples) and (standby_samples[k][0] < t or standby_samples[k][1] < p):
            k += 1
        if k == len(standby_samples):
            break
        time_lags.append((standby_samples[k][0] - t) * 1000)
    id_lags = []
    i = 0
    for t, s, _ in standby_samples:
        while i + 1 < len(primary_samples) and primary_samples[i + 1][0] <= t:
            i += 1
        if primary_samples and primary_samples[i][0] <= t:
            id_lags.append(max(0, primary_samples[i][1] - s))

    def rounded(x):
        return None if x is None else round(x, 1)

    return LagFigures(
        interval_ms=interval_ms,
        primary_samples=len(primary_samples),
        standby_samples=len(standby_samples),
        time_lag_ms_p50=rounded(percentile(time_lags, 50)),
        time_lag_ms_p99=rounded(percentile(time_lags, 99)),
        id_lag_p50=percentile(id_lags, 50),
        id_lag_p99=percentile(id_lags, 99),
        ahead_of_rows=ahead,
        backwards=backwards,
    )


def set_position_interval(pair, interval_ms):
    """Set streampos.position_interval_ms on the primary and restart it (the
    standby reconnects)."""
    pair.primary.set(streampos__position_interval_ms=interval_ms)
    pair.primary.stop("fast")
    pair.primary.start()
    pair.wait_streaming()


def measure_lag(pair, intervals=(200, 20), seconds=3.0):
    setup_stream(pair.primary)
    results = []
    for interval in intervals:
        set_position_interval(pair, interval)
        results.append(standby_lag(pair, interval, seconds=seconds))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help="asynchronous replication, with forced lag")
    parser.add_argument("--lag", action="store_true", help="measure the standby's position lag")
    parser.add_argument("--seconds", type=float, default=2.0, help="load before and after the failover")
    parser.add_argument("--no-standby-wait-for", action="store_true",
                        help="the standby reader does not call wait_for() (refused on a standby)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    from test_failover import RESYNC_SQLSTATE

    with Clusters() as clusters:
        if args.lag:
            pair = clusters.pair()
            for r in measure_lag(pair, seconds=args.seconds + 1):
                print(r.summary())
                if r.ahead_of_rows or r.backwards:
                    print(f"  WRONG: ahead of its rows {r.ahead_of_rows[:5]}, backwards {r.backwards[:5]}")
            return
        fig = failover_under_load(clusters, synchronous=not args.asynchronous,
                                  resync_sqlstate=RESYNC_SQLSTATE,
                                  seconds_before=args.seconds, seconds_after=args.seconds,
                                  standby_wait_for=not args.no_standby_wait_for)
        print(fig.summary())
        if args.json:
            print(json.dumps(fig.__dict__, indent=1))


if __name__ == "__main__":
    main()
