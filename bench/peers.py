#!/usr/bin/env python3
"""Beside other designs (scripts/bench, "Beside other designs"; issue 36):
the readers event stores and outboxes on PostgreSQL use, side by side on
one workload, against a running cluster with streampos preloaded.

One table, `p_ev (id, w, xid, body)`: every row's ID comes from
`streampos.next_id('p_s', writer)` (a sequence's `nextval` with the
registry's bookkeeping: IDs are handed out in the order transactions ask,
as `nextval` hands them out to the other designs), and `xid` is
`pg_current_xact_id()`, for the xid8 recipe. Five readers follow it at
once, each on its own connection, each a loop as a real one is:

1. **naive**: `SELECT … WHERE id > $last ORDER BY id LIMIT 1000`, `$last`
   the highest ID read; sleeps `--poll-ms` when it got less than a page.
2. **gap detector**, a model of Marten's async daemon high-water agent
   (JasperFx.Events HighWaterAgent, Marten's HighWaterDetector and
   GapDetector). What it models: a mark (the high-water mark, also the
   projection's position). Each poll runs Marten's gap query from the
   mark: the row before the first gap among the rows `id >= mark` (`lead(id)
   OVER (ORDER BY id) - id > 1`), or else the highest row; and reads the
   stream sequence's `last_value` (Marten's HighestSequence). If that row
   is above the mark, the mark moves there and the rows up to it are
   delivered in ID order (status Changed, or CaughtUp when the mark reaches
   the sequence's value); the stale clock restarts. If the mark did not
   move but the sequence is ahead of it (status Stale), it waits for the
   gap to fill, polling; once the clock is `--stale-seconds` old (Marten's
   StaleSequenceThreshold, default 3 s) it skips: the same gap query from
   mark + 1 (DetectInSafeZone), so the leading gap is stepped over and the
   mark moves to the row before the next gap. IDs skipped are never read
   again; each further gap costs another threshold. Not modelled: the
   polling intervals (Marten waits 250 ms after a change and 1 s
   otherwise; every poller here sleeps the same `--poll-ms`, so that the
   latencies compare designs, not settings); the liveness probe of
   marten#4953 (GapLivenessProbe: no skip while a transaction older than
   the gap is open, which trades these skips for stalls as long as any
   older transaction, idle ones included, stays open); the fallback to
   HighestSequence - 32 when nothing follows the gap (GH-2681, #3865);
   per-tenant partitions; the projection's own batching.
3. **xid8 recipe**: every row stores `pg_current_xact_id()`; the reader
   keeps `(last_xid, last_id)` and reads `WHERE (xid, id) > ($xid, $id) AND
   xid < pg_snapshot_xmin(pg_current_snapshot()) ORDER BY xid, id LIMIT
   1000`, as in "Reliable transactional outbox with PostgreSQL"
   (github.com/eugene-khyst/postgresql-event-sourcing, README) and Oskar
   Dudycz's "How Postgres sequences issues can impact your messaging
   guarantees" (event-driven.io/en/ordering_in_postgres_outbox/).
4. **streampos**: `streampos.updates_json('p_s', $token, 1000, 1000)`, the
   per-writer form, long-polling (1 s).
5. **streampos ordered**: the same with `ordered => true`.

Workload: three steady writers (`w1`–`w3`, each its own connection, one
row a transaction, 0–10 ms between its ID and its COMMIT, 10–40 ms between
transactions) run throughout. Scenarios, one after another, each followed
by a settle (until every reader has delivered, or passed for good, every
row committed before the scenario ended; at most `--max-settle` s):

- steady: the three writers alone;
- 4 MB row: one row whose body (4 MB of random hex, stored uncompressed)
  is generated after its ID was taken;
- bulk import: 20 000 rows (5 000 with `--quick`) in one transaction, in
  20 batches (10) spread over 5 s (4), as an import reading its input;
- rollback gaps: 3 (2) transactions that take 10 IDs each and roll back,
  0.5 s apart;
- idle, no stream ID: a session that wrote another table (so it has an
  xid) and stays idle in transaction for 8 s (4), then commits;
- idle with an ID: a session that wrote a row (writer `idle`) and stays
  idle in transaction for 8 s (4), then commits;
- slow commit: a transaction that writes a row, then `pg_sleep(2)`, then
  commits;
- kill -9: a client process (Python, its own connection) writes 10 rows
  in a transaction (writer `killed`) and is killed with SIGKILL 1 s
  later; its backend sees the connection close and aborts. The client is
  what we kill, not the backend: SIGKILL of a backend makes the postmaster
  end every session and recover (a server crash, which measures recovery,
  and needs root or postgres on the server's host); a client killed with
  its IDs reserved is what an event store meets when a process dies (the
  OOM killer, a pod killed), from any host.

Per (scenario, reader), for the rows whose COMMIT returned during the
scenario (until the next one started): missed (committed, in the table at
the end, never delivered by the end of the run), delivered twice (extra
deliveries), out of global order (delivered after a higher ID was), the
longest stall (the longest time a delivered row waited from its commit,
shown when above `--stall-ms`), and p50/p99 of commit-to-delivery latency.
Times are this process's monotonic clock: a row's commit is when its
COMMIT returned to its writer, its delivery when the reader's query
returned (a reader may see a row before its writer hears back: such a
latency counts as 0). A section is appended to `--out`; `--json` writes the
numbers for test/python/test_peers_bench.py.
"""
import argparse
import datetime
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time

import psycopg

STREAM = "p_s"
PAGE = 1000
SETUP = """
DROP TABLE IF EXISTS p_ev, p_other;
CREATE TABLE p_ev (id bigint PRIMARY KEY, w text NOT NULL,
                   xid xid8 NOT NULL DEFAULT pg_current_xact_id(), body text NOT NULL);
ALTER TABLE p_ev ALTER COLUMN body SET STORAGE EXTERNAL;
CREATE INDEX p_ev_xid ON p_ev (xid, id);
CREATE TABLE p_other (at timestamptz NOT NULL);
"""
INSERT = ("INSERT INTO p_ev (id, w, body) SELECT streampos.next_id('p_s', %s), %s, %s "
          "FROM generate_series(1, %s) RETURNING id, xid::text")

# The client the kill -9 scenario kills: it writes its rows in a transaction,
# says which and its backend's pid, and waits.
KILLED_CLIENT = r"""
import json, sys, time, psycopg
c = psycopg.connect(sys.argv[1], autocommit=True)
c.execute("BEGIN")
ids = [r[0] for r in c.execute(
    "INSERT INTO p_ev (id, w, body) SELECT streampos.next_id('p_s', 'killed'), 'killed', 'never committed' "
    "FROM generate_series(1, %s) RETURNING id", (int(sys.argv[2]),))]
print(json.dumps({"pid": c.info.backend_pid, "ids": ids}), flush=True)
time.sleep(3600)
"""

READERS = (
    ("naive", "naive `id > last`"),
    ("gap", "gap detector (Marten model)"),
    ("xid8", "xid8 recipe"),
    ("streampos", "streampos `updates_json`"),
    ("ordered", "streampos `updates_json(ordered)`"),
)


def now():
    return time.monotonic()


class Reader:
    """Delivery bookkeeping; subclasses poll."""

    key = ""

    def __init__(self, bench):
        self.bench = bench
        self.lock = threading.Lock()
        self.first = {}       # id -> first delivery time
        self.extra = {}       # id -> deliveries after the first
        self.late = set()     # ids delivered after a higher one
        self.highest = 0
        self.errors = []

    def deliver(self, ids, t):
        with self.lock:
            for i in ids:
                if i in self.first:
                    self.extra[i] = self.extra.get(i, 0) + 1
                    continue
                self.first[i] = t
                if i < self.highest:
                    self.late.add(i)
                else:
                    self.highest = i

    def passed(self, row_id, xid):
        """Will this reader never look at this row again (its checkpoint is
        past it)?"""
        return False

    def resolved(self, row_id, xid):
        return row_id in self.first or self.passed(row_id, xid)

    def run(self, stop):
        conn = None
        while not stop.is_set():
            try:
                if conn is None:
                    conn = self.bench.connect()
                if not self.poll(conn):
                    stop.wait(self.bench.args.poll_ms / 1000)
            except psycopg.Error as e:
                self.errors.append(repr(e))
                if conn is not None:
                    conn.close()
                conn = None
                stop.wait(0.5)
        if conn is not None:
            conn.close()


class Naive(Reader):
    key = "naive"

    def __init__(self, bench, start_id, start_xid):
        super().__init__(bench)
        self.last = start_id

    def passed(self, row_id, xid):
        return row_id <= self.last

    def poll(self, c):
        rows = c.execute("SELECT id, w, body FROM p_ev WHERE id > %s ORDER BY id LIMIT %s",
                         (self.last, PAGE)).fetchall()
        self.deliver([r[0] for r in rows], now())
        if rows:
            self.last = rows[-1][0]
        return len(rows) == PAGE


class GapDetector(Reader):
    """Marten's high-water agent, as the module's docstring says."""

    key = "gap"
    DETECT = """
        SELECT (SELECT id FROM (SELECT id, lead(id) OVER (ORDER BY id) AS next
                                FROM p_ev WHERE id >= %(start)s) g
                WHERE next IS NOT NULL AND next - id > 1 ORDER BY id LIMIT 1),
               (SELECT max(id) FROM p_ev WHERE id >= %(start)s),
               (SELECT last_value FROM streampos.p_s_seq)"""

    def __init__(self, bench, start_id, start_xid):
        super().__init__(bench)
        self.mark = start_id
        self.clock = now()
        self.skips = 0

    def passed(self, row_id, xid):
        return row_id <= self.mark

    def detect(self, c, start):
        before_gap, top, highest = c.execute(self.DETECT, {"start": start}).fetchone()
        return (before_gap if before_gap is not None else top), highest

    def advance(self, c, mark):
        rows = c.execute("SELECT id, w, body FROM p_ev WHERE id > %s AND id <= %s ORDER BY id",
                         (self.mark, mark)).fetchall()
        self.deliver([r[0] for r in rows], now())
        self.mark = mark
        self.clock = now()

    def poll(self, c):
        current, highest = self.detect(c, self.mark)
        if current is not None and current > self.mark:
            self.advance(c, current)              # Changed or CaughtUp
            return False
        if highest <= self.mark:
            self.clock = now()                    # CaughtUp
            return False
        if now() - self.clock >= self.bench.args.stale_seconds:
            # Stale past the threshold: DetectInSafeZone, from mark + 1.
            current, _ = self.detect(c, self.mark + 1)
            if current is not None and current > self.mark:
                self.skips += 1
                self.advance(c, current)
        return False


class Xid8(Reader):
    key = "xid8"

    def __init__(self, bench, start_id, start_xid):
        super().__init__(bench)
        self.checkpoint = (start_xid, start_id)

    def passed(self, row_id, xid):
        return (xid, row_id) <= self.checkpoint

    def poll(self, c):
        # The text of the xid under another name: an output column named
        # xid would be what ORDER BY xid sorts by (as text: '9996' after
        # '10000').
        rows = c.execute(
            "SELECT id, xid::text AS xid_text, w, body FROM p_ev "
            "WHERE (xid, id) > (%s::text::xid8, %s) AND xid < pg_snapshot_xmin(pg_current_snapshot()) "
            "ORDER BY xid, id LIMIT %s", (str(self.checkpoint[0]), self.checkpoint[1], PAGE)).fetchall()
        self.deliver([r[0] for r in rows], now())
        if rows:
            self.checkpoint = (int(rows[-1][1]), rows[-1][0])
        return len(rows) == PAGE


class Streampos(Reader):
    key = "streampos"
    ORDERED = False

    def __init__(self, bench, start_id, start_xid):
        super().__init__(bench)
        self.token = str(start_id)

    def poll(self, c):
        answer = c.execute(
            f"SELECT streampos.updates_json('p_s', %s, {PAGE}, 1000, ordered => {str(self.ORDERED).lower()})",
            (self.token,)).fetchone()[0]
        t = now()
        data, ids, i = answer["data"], [], 0
        while i < len(data):
            count = data[i][2]
            ids += [row[0] for row in data[i + 1:i + 1 + count]]
            i += 1 + count
        # One table: its rows come in ID order within an answer.
        self.deliver(ids, t)
        self.token = answer["token"]
        return True   # it long-polls: ask again at once


class Ordered(Streampos):
    key = "ordered"
    ORDERED = True


class Bench:
    def __init__(self, args):
        self.args = args
        self.conninfo = dict(host=args.host, port=args.port, dbname=args.dbname, user=args.user)
        self.commits = []          # (commit time, [(id, xid)], writer)
        self.commits_lock = threading.Lock()
        self.abandoned = []        # IDs of the killed client's rows
        self.notes = []
        self.q = args.quick

    def connect(self):
        return psycopg.connect(**self.conninfo, autocommit=True)

    def record(self, rows, writer):
        t = now()
        with self.commits_lock:
            self.commits.append((t, [(r[0], int(r[1])) for r in rows], writer))

    # ------------------------------------------------------------ set-up

    def setup(self):
        with psycopg.connect(**dict(self.conninfo, dbname="postgres"), autocommit=True) as c:
            if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.args.dbname,)).fetchone():
                c.execute(f'CREATE DATABASE "{self.args.dbname}"')
        with self.connect() as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS streampos")
            if c.execute("SELECT 1 FROM streampos.streams WHERE stream_name = %s", (STREAM,)).fetchone():
                c.execute("SELECT streampos.drop_stream(%s)", (STREAM,))
            c.execute(SETUP)
            c.execute("SELECT streampos.create_stream(%s)", (STREAM,))
            c.execute("SELECT streampos.add_table(%s, 'p_ev', 'id', 'w')", (STREAM,))
            # Every reader starts after this row.
            seed = c.execute(INSERT, ("seed", "seed", "seed", 1)).fetchone()
            self.version = c.execute("SHOW server_version").fetchone()[0]
        return seed[0], int(seed[1])

    # ----------------------------------------------------------- writers

    def steady_writer(self, name, stop):
        rng = random.Random(f"{self.args.seed}-{name}")
        try:
            with self.connect() as c:
                while not stop.is_set():
                    c.execute("BEGIN")
                    rows = c.execute(INSERT, (name, name, "steady", 1)).fetchall()
                    time.sleep(rng.uniform(0, 0.010))
                    c.execute("COMMIT")
                    self.record(rows, name)
                    time.sleep(rng.uniform(0.010, 0.040))
        except psycopg.Error as e:
            self.notes.append(f"writer {name} stopped: {e!r}")

    # --------------------------------------------------------- scenarios

    def scenario_steady(self):
        time.sleep(2 if self.q else 5)

    def scenario_big_row(self):
        with self.connect() as c:
            c.execute("BEGIN")
            # The ID first (the first column), then the body: 131 072 md5s.
            rows = c.execute(
                "INSERT INTO p_ev (id, w, body) SELECT streampos.next_id('p_s', 'big'), 'big', "
                "(SELECT string_agg(md5(i::text || random()::text), '') FROM generate_series(1, 131072) i) "
                "RETURNING id, xid::text, length(body)").fetchall()
            c.execute("COMMIT")
            self.record(rows, "big")
            assert rows[0][2] == 4 * 1024 * 1024, rows[0][2]

    def scenario_bulk_import(self):
        total, batches, seconds = (5000, 10, 4.0) if self.q else (20000, 20, 5.0)
        rows = []
        with self.connect() as c:
            c.execute("BEGIN")
            for _ in range(batches):
                rows += c.execute(INSERT, ("import", "import", "imported", total // batches)).fetchall()
                time.sleep(seconds / batches)
            c.execute("COMMIT")
            self.record(rows, "import")

    def scenario_rollbacks(self):
        with self.connect() as c:
            for k in range(2 if self.q else 3):
                c.execute("BEGIN")
                c.execute(INSERT, ("rollback", "rollback", "rolled back", 10))
                time.sleep(0.05)
                c.execute("ROLLBACK")
                time.sleep(0.5)

    def idle_seconds(self):
        return 4.0 if self.q else 8.0

    def scenario_idle_no_id(self):
        with self.connect() as c:
            c.execute("BEGIN")
            c.execute("INSERT INTO p_other VALUES (now())")
            assert c.execute("SELECT pg_current_xact_id_if_assigned() IS NOT NULL").fetchone()[0]
            time.sleep(self.idle_seconds())
            c.execute("COMMIT")

    def scenario_idle_with_id(self):
        with self.connect() as c:
            c.execute("BEGIN")
            rows = c.execute(INSERT, ("idle", "idle", "idle in transaction", 1)).fetchall()
            time.sleep(self.idle_seconds())
            c.execute("COMMIT")
            self.record(rows, "idle")

    def scenario_slow_commit(self):
        with self.connect() as c:
            c.execute("BEGIN")
            rows = c.execute(INSERT, ("slow", "slow", "slow", 1)).fetchall()
            c.execute("SELECT pg_sleep(2)")
            c.execute("COMMIT")
            self.record(rows, "slow")

    def scenario_kill(self):
        dsn = psycopg.conninfo.make_conninfo(**self.conninfo)
        proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, dsn, "10"],
                                stdout=subprocess.PIPE, text=True)
        try:
            told = json.loads(proc.stdout.readline())
            time.sleep(1.0)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        self.abandoned += told["ids"]
        # Its backend notices the closed connection and aborts.
        with self.connect() as c:
            deadline = now() + 10
            while c.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (told["pid"],)).fetchone():
                if now() > deadline:
                    self.notes.append(f"kill -9: backend {told['pid']} still there after 10 s")
                    break
                time.sleep(0.02)

    def scenarios(self):
        idle = f"{self.idle_seconds():.0f} s"
        total = "5 000" if self.q else "20 000"
        return [
            ("steady", "three steady writers alone", self.scenario_steady),
            ("big", "4 MB single-row insert", self.scenario_big_row),
            ("import", f"bulk import ({total} rows, one transaction)", self.scenario_bulk_import),
            ("rollback", f"rollback gaps ({2 if self.q else 3})", self.scenario_rollbacks),
            ("idle", f"idle in transaction, no stream ID, {idle}", self.scenario_idle_no_id),
            ("idle_id", f"idle in transaction with a stream ID, {idle}", self.scenario_idle_with_id),
            ("slow", "slow commit (2 s)", self.scenario_slow_commit),
            ("kill", "kill -9 of a writer's client holding 10 IDs", self.scenario_kill),
        ]

    # ----------------------------------------------------------- settling

    def settle(self, readers, since, until):
        """Wait until every reader delivered, or passed for good, every row
        committed from `since` to `until`; at most --max-settle s. Returns
        the readers that had not."""
        with self.commits_lock:
            rows = [r for t, rs, _ in self.commits if since <= t <= until for r in rs]
        pending = {r: rows for r in readers}
        deadline = now() + self.args.max_settle
        time.sleep(0.2)
        while True:
            pending = {r: [x for x in left if not r.resolved(*x)] for r, left in pending.items()}
            if not any(pending.values()) or now() > deadline:
                return [r.key for r, left in pending.items() if left]
            time.sleep(0.1)

    # -------------------------------------------------------------- run

    def run(self):
        seed_id, seed_xid = self.setup()
        readers = [cls(self, seed_id, seed_xid) for cls in (Naive, GapDetector, Xid8, Streampos, Ordered)]
        stop_readers, stop_writers = threading.Event(), threading.Event()
        threads = [threading.Thread(target=r.run, args=(stop_readers,), daemon=True) for r in readers]
        writers = [threading.Thread(target=self.steady_writer, args=(f"w{k}", stop_writers), daemon=True)
                   for k in (1, 2, 3)]
        for t in threads + writers:
            t.start()
        time.sleep(0.5)
        windows = []
        started = now()
        for key, label, action in self.scenarios():
            t0 = now()
            action()
            t1 = now()
            late = self.settle(readers, t0, t1)
            windows.append((key, label, t0))
            print(f"  {label}: {t1 - t0:.1f} s, settled in {now() - t1:.1f} s"
                  + (f" (not settled: {', '.join(late)})" if late else ""), flush=True)
            if late:
                self.notes.append(f"{label}: not settled after {self.args.max_settle:.0f} s by {', '.join(late)}")
        stop_writers.set()
        for t in writers:
            t.join(timeout=30)
        end = now()
        late = self.settle(readers, windows[-1][2], end)
        if late:
            self.notes.append(f"the end: not settled after {self.args.max_settle:.0f} s by {', '.join(late)}")
        stop_readers.set()
        for t in threads:
            t.join(timeout=30)
        self.elapsed = now() - started
        for r in readers:
            for e in r.errors[:3]:
                self.notes.append(f"{r.key}: {e}")
        return self.measure(readers, windows, end)

    def measure(self, readers, windows, end):
        with self.connect() as c:
            table = {r[0] for r in c.execute("SELECT id FROM p_ev WHERE w <> 'seed'")}
        committed_at = {}
        for t, rows, _ in self.commits:
            for row_id, _ in rows:
                committed_at[row_id] = t
        # The truth is the table; every row in it must have been recorded
        # and nothing the killed client wrote may be there.
        if set(committed_at) != table:
            self.notes.append(f"the table and the recorded commits differ: {len(table - set(committed_at))} rows "
                              f"not recorded, {len(set(committed_at) - table)} recorded but absent")
        if table & set(self.abandoned):
            self.notes.append(f"rows of the killed client are in the table: {sorted(table & set(self.abandoned))}")
        bounds = [w[2] for w in windows[1:]] + [end + 1]
        results = []
        for (key, label, t0), t1 in zip(windows, bounds):
            ids = sorted(i for i in table if t0 <= committed_at.get(i, -1) < t1)
            cells = {}
            for r in readers:
                lat = sorted(max(0.0, r.first[i] - committed_at[i]) for i in ids if i in r.first)
                cells[r.key] = {
                    "missed": sum(1 for i in ids if i not in r.first),
                    "twice": sum(r.extra.get(i, 0) for i in ids),
                    "out_of_order": sum(1 for i in ids if i in r.late),
                    "longest_s": lat[-1] if lat else None,
                    "p50_ms": lat[len(lat) // 2] * 1000 if lat else None,
                    "p99_ms": lat[int(len(lat) * 0.99)] * 1000 if lat else None,
                }
            results.append({"key": key, "label": label, "rows": len(ids), "readers": cells})
        for r in readers:
            phantom = set(r.first) - table
            if phantom:
                self.notes.append(f"{r.key} delivered {len(phantom)} IDs that are not committed rows")
        return results


def fmt_int(n):
    return f"{n:,}".replace(",", " ")


def fmt_ms(v):
    return "–" if v is None else (f"{v:.0f}" if v >= 10 else f"{v:.1f}")


def report(args, bench, results):
    stall = args.stall_ms / 1000
    names = dict(READERS)
    command = "bench/peers.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        "### Beside other designs",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%MZ}, {os.cpu_count()} cores, "
        f"PostgreSQL {bench.version}. Command: `{command}` ({bench.elapsed:.0f} s).",
        "",
        "One table read at once by five readers while three writers commit all the time, one scenario "
        "after another (bench/peers.py's docstring says exactly what each reader and scenario does). "
        "Rows: those committed during the scenario. *missed*: committed, never delivered by the end of the "
        "run; *twice*: extra deliveries; *out of order*: delivered after a higher ID was; *stall*: the "
        f"longest wait from a row's commit to its delivery, when above {args.stall_ms} ms; p50/p99: "
        f"commit-to-delivery latency (ms). Pollers sleep {args.poll_ms} ms; the gap detector skips a gap "
        f"after {args.stale_seconds:g} s; streampos long-polls.",
        "",
        "| scenario | rows | reader | missed | twice | out of order | stall | p50 | p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in results:
        for k, (key, _) in enumerate(READERS):
            c = s["readers"][key]
            longest = c["longest_s"]
            stalled = f"{longest:.1f} s" if longest is not None and longest > stall else "–"
            lines.append(
                f"| {s['label'] if k == 0 else ''} | {fmt_int(s['rows']) if k == 0 else ''} | {names[key]} | "
                f"{fmt_int(c['missed'])} | {fmt_int(c['twice'])} | {fmt_int(c['out_of_order'])} | {stalled} | "
                f"{fmt_ms(c['p50_ms'])} | {fmt_ms(c['p99_ms'])} |")
    lines.append("")
    if bench.notes:
        lines += ["Notes: " + "; ".join(bench.notes) + ".", ""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--user", default="postgres")
    p.add_argument("--dbname", default="streampos_bench")
    p.add_argument("--quick", action="store_true",
                   help="shorter scenarios (5 000-row import, 4 s idle sessions, 2 rollbacks): about 30 s")
    p.add_argument("--poll-ms", type=int, default=100, help="the pollers' sleep when they got nothing")
    p.add_argument("--stale-seconds", type=float, default=3.0, help="the gap detector's stale threshold")
    p.add_argument("--stall-ms", type=int, default=500, help="a longest wait above this is a stall")
    p.add_argument("--max-settle", type=float, default=30.0, help="longest settle after a scenario (s)")
    p.add_argument("--seed", type=int, default=36)
    p.add_argument("--out", help="append the markdown section here")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    bench = Bench(args)
    results = bench.run()
    text = report(args, bench, results)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"scenarios": results, "notes": bench.notes}, f, indent=1)
    # A row streampos missed or gave twice is a finding: say so.
    for s in results:
        for key in ("streampos", "ordered"):
            c = s["readers"][key]
            if c["missed"] or c["twice"]:
                print(f"FINDING: {key} missed {c['missed']} and repeated {c['twice']} rows in {s['label']}",
                      file=sys.stderr)


if __name__ == "__main__":
    main()
