#!/usr/bin/env python3
"""A writer's commit with waiting followers, in instructions, across
backends (issue 32/33's cell), against the same commit with none and
against LISTEN/NOTIFY.

A follower's delivery and the writer's commit run in different backends,
so single-user mode cannot count them. Here the whole server runs under
callgrind:

    valgrind --tool=callgrind --callgrind-out-file=DIR/cg.%p postgres -D …

Every backend is a fork of the postmaster, so each writes its own files
(%p: its pid). Each backend marks its own measuring window from SQL with
callgrind client requests, by a tiny C module (bench/callgrind_marks,
built here with the server's pgxs and loaded by absolute path, not
installed): cg_zero() resets the calling process's counts
(CALLGRIND_ZERO_STATS), cg_dump(label) writes them to a labelled dump
(CALLGRIND_DUMP_STATS_AT). The script reads each dump's total
(callgrind_annotate), less the cumulative statistics' flush in it
(pgstat_report_stat: at most once a second per backend, so how many fall
in a window depends on the run's pace, not on the cell). Every session
first measures two empty windows (zero, then dump; the first is the two
functions' first use): the second, the two statements' own cost, is
subtracted from its window. zero and dump are not prepared statements,
and every measured statement runs more than five times before its window
(the plan cache's custom plans). Each cell has a stream and table of its
own, all made before the first cell: every cell's rows start an empty
table, so no page extension or index split falls in one cell and not
another.

Followers, F of them (0, 8, 32 by default), each a client on a
connection of its own, every statement prepared (as a driver does):

  wait_for  SELECT streampos.wait_for(stream, p + 1, 600000): p, the
            value the previous call returned (no row read)
  updates   SELECT streampos.updates(stream, token, 100, 600000): the
            long-poll, the new row and the next token
  updates_json  the same with updates_json (the answer as json)
  listen    the hand-written baseline: the table has a trigger
            (AFTER INSERT … FOR EACH ROW: pg_notify), followers LISTEN
            and on each notification run SELECT id, instance_name,
            payload FROM t WHERE id > since AND id <= streampos.frontier(…)
            ORDER BY id LIMIT 100 (follow_calls.py's hand-written query)

The writer (autocommit) runs W warm-up commits (followers answer them as
in the window), then zeroes, then K commits of INSERT … SELECT
streampos.next_id(…), then dumps. Before each commit it waits, outside
its window's work (the polling runs in another backend), until every
follower has answered the previous commit and sleeps again: in
wait_for/updates (pg_stat_activity: wait_event_type Extension), or, for
LISTEN, idle after its query. Each follower zeroes after the warm-up
commits and dumps after the K-th.

Per commit: the writer's window / K, and the followers' work: the sum of
their windows / K (wake-up, answer, sending it, the client's next call).
F = 0 for wait_for, updates and updates_json is one measurement (no follower: the
same commit). Instructions in user space only: the kernel's share of
waking a process (kill(), the scheduler) is not counted.

Usage: bench/commit_wakeup.py --pg-bin DIR [--port 54396] [--followers 8,32]
                              [--commits 10] [--warm-up 2] [--rounds 3]
                              [--mechanisms wait_for,updates,updates_json,listen] [--out FILE]
"""
import argparse
import glob
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psycopg
from psycopg.types.numeric import Int8

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from callgrind import as_postgres  # noqa: E402

TIMEOUT_S = 600


def build_marks(pg_bin, root):
    src = os.path.join(HERE, "callgrind_marks")
    build = os.path.join(root, "marks")
    shutil.copytree(src, build, ignore=shutil.ignore_patterns("*.o", "*.so", "*.bc"))
    subprocess.run(["make", "-s", "-C", build, f"PG_CONFIG={os.path.join(pg_bin, 'pg_config')}"],
                   check=True, capture_output=True)
    so = os.path.join(build, "callgrind_marks.so")
    os.chmod(build, 0o755)
    os.chmod(so, 0o755)
    return so


FLUSH = "pgstat_report_stat"


def dumps(cg_dir):
    """{label: [(instructions, of which FLUSH's) of each dump with that
    label]}: the dump's total and the inclusive cost of the cumulative
    statistics' flush in it (callgrind_annotate)."""
    found = {}
    for path in glob.glob(os.path.join(cg_dir, "cg.*")):
        with open(path, errors="replace") as f:
            head = f.read(4096)
        m = re.search(r"^desc: Trigger: Client Request: (.+)$", head, re.M)
        if not m:
            continue
        out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", path],
                             check=True, capture_output=True, text=True).stdout
        total = flush = None
        for line in out.splitlines():
            c = re.match(r"\s*([\d,]+) \([^)]*\)\s+(.*)$", line)
            if not c:
                continue
            n = int(c.group(1).replace(",", ""))
            if c.group(2).strip() == "PROGRAM TOTALS":
                total = n
            elif re.search(rf":{FLUSH} \[", c.group(2)):
                flush = (flush or 0) + n
        if total is None:
            sys.exit(f"no total in {path}")
        found.setdefault(m.group(1).strip(), []).append((total, flush or 0))
    return found


SETUP = [
    "CREATE EXTENSION streampos",
    "CREATE FUNCTION notify_row() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN PERFORM pg_notify(TG_TABLE_NAME, NEW.id::text); RETURN NULL; END $$",
]
# A stream and its table for each cell of each round, all made before the
# first: every cell's rows start an empty table (no page extension or index
# split falls in one cell's window and not another's), and the server has
# the same streams throughout.
STREAM = [
    "SELECT streampos.create_stream('{s}')",
    "CREATE TABLE {s}_ev (id bigint PRIMARY KEY, instance_name text, payload text)",
    "SELECT streampos.add_table('{s}', '{s}_ev', 'id', 'instance_name')",
]
NOTIFY = "CREATE TRIGGER notify AFTER INSERT ON {s}_ev FOR EACH ROW EXECUTE FUNCTION notify_row()"
INSERT = "INSERT INTO {s}_ev SELECT streampos.next_id('{s}', 'w1'), 'w1', repeat('x', 200)"
WAIT_FOR = "SELECT streampos.wait_for('{s}', %s, 600000)"
UPDATES = "SELECT streampos.updates('{s}', %s, 100, 600000)"
UPDATES_JSON = "SELECT streampos.updates_json('{s}', %s, 100, 600000)"
WARM = 8
HAND = ("SELECT id, instance_name, payload FROM {s}_ev WHERE id > %s "
        "AND id <= streampos.frontier('{s}') ORDER BY id LIMIT 100")
NAMES = {
    "wait_for": "`wait_for(stream, p + 1)`",
    "updates": "`updates()` long-poll",
    "updates_json": "`updates_json()` long-poll",
    "listen": "LISTEN/NOTIFY + query",
}


def zero(c):
    # Not prepared: the same parse and plan at every window's edge (a
    # prepared statement with a parameter changes plans after five runs).
    c.execute("SELECT cg_zero()", prepare=False)


def dump(c, label):
    c.execute(f"SELECT cg_dump('{label}')", prepare=False)


def empty_window(c, tag):
    """Two empty windows: the first uses the functions for the first time
    in the session, the second is the one subtracted."""
    for what in ("cold", "empty"):
        zero(c)
        dump(c, f"{what} {tag}")


class Cell:
    """One writer with F followers of one mechanism: K measured commits."""

    def __init__(self, a, dsn, admin, mechanism, f, tag, stream):
        self.a, self.dsn, self.admin, self.stream = a, dsn, admin, stream
        self.mechanism, self.f, self.tag = mechanism, f, tag
        self.lock = threading.Condition()
        self.ready = 0  # follower steps done ("ready for the next commit")
        self.errors = []
        self.pids = []

    def connect(self):
        c = psycopg.connect(self.dsn, autocommit=True)
        c.prepare_threshold = 0
        return c

    def mark_ready(self):
        with self.lock:
            self.ready += 1
            self.lock.notify_all()

    def follower(self, i):
        a, tag, s = self.a, self.tag, self.stream
        wait_for, updates, hand = (q.format(s=s) for q in (
            WAIT_FOR, UPDATES_JSON if self.mechanism == "updates_json" else UPDATES, HAND))
        try:
            with self.connect() as c:
                with self.lock:
                    self.pids.append(c.info.backend_pid)
                empty_window(c, f"{tag} {i}")
                # Each statement run WARM times before the window: prepared,
                # and past the plan cache's first five (custom) plans.
                if self.mechanism == "wait_for":
                    p = c.execute("SELECT streampos.frontier(%s)", (s,)).fetchone()[0]
                    for _ in range(WARM):
                        c.execute(wait_for, (Int8(p),))  # reached: answers at once

                    def step():
                        nonlocal p
                        p = c.execute(wait_for, (Int8(p + 1),)).fetchone()[0]
                elif self.mechanism in ("updates", "updates_json"):
                    p = c.execute("SELECT streampos.frontier(%s)", (s,)).fetchone()[0]
                    # One row behind: answers at once.
                    for _ in range(WARM):
                        token = c.execute(updates, (str(p - 1),)).fetchone()[0]["token"]

                    def step():
                        nonlocal token
                        answer = c.execute(updates, (token,)).fetchone()[0]
                        if not answer["data"]:
                            raise RuntimeError(f"updates answered no row: {answer}")
                        token = answer["token"]
                else:
                    since = c.execute("SELECT streampos.frontier(%s)", (s,)).fetchone()[0]
                    for _ in range(WARM):
                        c.execute(hand, (Int8(since),)).fetchall()
                    c.execute(f"LISTEN {s}_ev")

                    def step():
                        nonlocal since
                        got = list(c.notifies(timeout=TIMEOUT_S, stop_after=1))
                        if not got:
                            raise RuntimeError("no notification")
                        rows = c.execute(hand, (Int8(since),)).fetchall()
                        if not rows:
                            raise RuntimeError("the notified row is not visible")
                        since = rows[-1][0]
                self.mark_ready()
                for j in range(a.warm_up + a.commits):
                    step()
                    if j + 1 == a.warm_up:
                        zero(c)
                    if j + 1 < a.warm_up + a.commits:
                        self.mark_ready()
                dump(c, f"follower {tag} {i}")
        except Exception as e:  # reported by the writer
            with self.lock:
                self.errors.append(e)
                self.lock.notify_all()

    def wait_ready(self, steps):
        """Every follower has answered `steps` - 1 commits (after setting
        up) and sleeps again: in wait_for/updates, or idle (LISTEN)."""
        deadline = time.monotonic() + TIMEOUT_S
        with self.lock:
            while self.ready < self.f * steps:
                if self.errors:
                    sys.exit(f"a follower failed: {self.errors[0]!r}")
                if not self.lock.wait(timeout=max(0.0, deadline - time.monotonic())):
                    sys.exit(f"followers not ready ({self.ready} of {self.f * steps} steps)")
        if self.f == 0 or self.mechanism == "listen":
            return
        while self.admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s) AND wait_event_type = 'Extension'",
                (self.pids,)).fetchone()[0] < self.f:
            if self.errors:
                sys.exit(f"a follower failed: {self.errors[0]!r}")
            if time.monotonic() > deadline:
                sys.exit("followers not waiting")
            time.sleep(0.02)

    def run(self):
        a, tag = self.a, self.tag
        insert = INSERT.format(s=self.stream)
        writer = self.connect()
        for _ in range(2):  # prepared, caches
            writer.execute(insert)
        empty_window(writer, f"{tag} writer")
        threads = [threading.Thread(target=self.follower, args=(i,)) for i in range(self.f)]
        for t in threads:
            t.start()
        for j in range(a.warm_up + a.commits):
            self.wait_ready(j + 1)
            if j == a.warm_up:
                zero(writer)
            writer.execute(insert)
        dump(writer, f"writer {tag}")
        writer.close()
        for t in threads:
            t.join()
        if self.errors:
            sys.exit(f"a follower failed: {self.errors[0]!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pg-bin", required=True)
    ap.add_argument("--port", type=int, default=54396, help="the server's port: names its socket (no TCP)")
    ap.add_argument("--followers", default="8,32", help="numbers of followers besides 0, comma-separated")
    ap.add_argument("--commits", type=int, default=10)
    ap.add_argument("--warm-up", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mechanisms", default="wait_for,updates,updates_json,listen")
    ap.add_argument("--dir", help="working directory (kept); default a new temporary one, removed")
    ap.add_argument("--out", help="append the results to this file")
    a = ap.parse_args()
    fs = [int(x) for x in a.followers.split(",")]
    mechanisms = a.mechanisms.split(",")
    if set(mechanisms) - set(NAMES):
        sys.exit(f"unknown mechanism in {a.mechanisms}")
    started = time.monotonic()
    root = a.dir or tempfile.mkdtemp(prefix="streampos-commit-wakeup-")
    os.makedirs(root, exist_ok=True)
    os.chmod(root, 0o777)
    marks = build_marks(a.pg_bin, root)
    data = os.path.join(root, "data")
    cg_dir = os.path.join(root, "cg")
    os.makedirs(cg_dir)
    os.chmod(cg_dir, 0o777)
    subprocess.run(as_postgres([os.path.join(a.pg_bin, "initdb"), "-D", data, "-A", "trust", "-U", "postgres"]),
                   check=True, capture_output=True)
    with open(os.path.join(data, "postgresql.conf"), "a") as f:
        # No TCP: clients reach this server only through its socket in
        # `root`, never another server that has the port.
        f.write(f"shared_preload_libraries = 'streampos'\nport = {a.port}\nlisten_addresses = ''\n"
                f"unix_socket_directories = '{root}'\nmax_connections = {max(fs) + 20}\n"
                "fsync = off\nautovacuum = off\n")
    log = open(os.path.join(root, "server.log"), "w")
    os.chmod(log.name, 0o666)
    server = subprocess.Popen(as_postgres([
        "valgrind", "--tool=callgrind", f"--callgrind-out-file={cg_dir}/cg.%p",
        os.path.join(a.pg_bin, "postgres"), "-D", data]), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    dsn = f"host={root} port={a.port} user=postgres dbname=postgres"
    # (mechanism, F): F = 0 of wait_for and updates is the same commit.
    cells = []
    for m in mechanisms:
        for f in [0] + fs:
            key = ("streampos" if m != "listen" and f == 0 else m, f)
            if key not in cells:
                cells.append(key)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                admin = psycopg.connect(dsn, autocommit=True)
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline or server.poll() is not None:
                    sys.exit(f"server did not start: see {log.name}")
                time.sleep(1)
        for sql in SETUP + [
            f"CREATE FUNCTION cg_zero() RETURNS void AS '{marks}', 'cg_zero' LANGUAGE C",
            f"CREATE FUNCTION cg_dump(text) RETURNS void AS '{marks}', 'cg_dump' LANGUAGE C STRICT",
        ]:
            admin.execute(sql)
        streams = {}
        for rnd in range(a.rounds):
            for n, (m, f) in enumerate(cells):
                s = streams[(rnd, m, f)] = f"c{rnd}_{n}"
                for sql in STREAM + ([NOTIFY] if m == "listen" else []):
                    admin.execute(sql.format(s=s))
        for rnd in range(a.rounds):
            # Rotated each round, so that no cell always runs first.
            order = cells[rnd % len(cells):] + cells[:rnd % len(cells)]
            for m, f in order:
                t0 = time.monotonic()
                Cell(a, dsn, admin, "wait_for" if m == "streampos" else m, f, f"r{rnd} {m} {f}",
                     streams[(rnd, m, f)]).run()
                print(f"round {rnd + 1}: {m}, {f} followers: {time.monotonic() - t0:.0f} s", flush=True)
        admin.close()
    finally:
        stopped = subprocess.run(as_postgres([os.path.join(a.pg_bin, "pg_ctl"), "stop", "-D", data, "-m",
                                              "fast", "-w", "-t", "300"]), capture_output=True).returncode == 0
        try:
            server.wait(timeout=300 if stopped else 10)
        except subprocess.TimeoutExpired:
            # Not stopped (it never started, or hangs): its own process
            # group, started above, and nothing else.
            for sig in (signal.SIGINT, signal.SIGKILL):
                try:
                    os.killpg(server.pid, sig)
                    server.wait(timeout=60)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue

    found = dumps(cg_dir)

    def one(label):
        """A window's instructions less the statistics' flush in it."""
        values = found.get(label)
        if not values or len(values) != 1:
            sys.exit(f"no single dump labelled {label!r} in {cg_dir}")
        return values[0][0] - values[0][1], values[0][1]

    def window(label, empty):
        (w, flush), (e, _) = one(label), one(empty)
        return w - e, flush

    # {(mechanism, F): [(writer per commit, followers per commit) per round]}
    res = {}
    flushed = []  # instructions of the statistics' flushes left out, per window
    for rnd in range(a.rounds):
        for m, f in cells:
            tag = f"r{rnd} {m} {f}"
            w, wf = window(f"writer {tag}", f"empty {tag} writer")
            fl = [window(f"follower {tag} {i}", f"empty {tag} {i}") for i in range(f)]
            flushed += [wf] + [x[1] for x in fl]
            res.setdefault((m, f), []).append((w / a.commits, sum(x[0] for x in fl) / a.commits))

    def med(m, f, k):
        return statistics.median(x[k] for x in res[(m, f)])

    def spread(m, f, k, scale=1):
        xs = [x[k] / scale for x in res[(m, f)]]
        return f" ({min(xs):,.0f}–{max(xs):,.0f})" if a.rounds > 1 else ""

    lines = [
        "### The writer's commit with waiting followers (callgrind, across backends)",
        "",
        "The server runs under `valgrind --tool=callgrind --callgrind-out-file=…/cg.%p`: every backend "
        "writes its own counts and marks its own window from SQL (bench/callgrind_marks: "
        "CALLGRIND_ZERO_STATS, CALLGRIND_DUMP_STATS_AT), less an empty window of the same session. "
        f"The writer commits {a.commits} × `{INSERT.format(s='s').replace('s_ev', 't')}` (autocommit, after "
        f"{a.warm_up} warm-up commits), waiting before each until every follower has answered the "
        "previous commit and sleeps again. Followers, each on its own connection, statements prepared: "
        "`wait_for(stream, p + 1, 600000)` (no row read); `updates(stream, token, 100, 600000)` "
        "(the long-poll: the new row and the next token), and the same with `updates_json`; LISTEN/NOTIFY (the table has a trigger "
        "`AFTER INSERT … FOR EACH ROW` calling `pg_notify`; on each notification the follower runs "
        "`SELECT id, instance_name, payload FROM t WHERE id > $1 AND id <= streampos.frontier(s) "
        "ORDER BY id LIMIT 100`). Followers' work: their windows summed (woken, answering, the "
        "client's next call until it sleeps again). Left out: each backend's cumulative-statistics "
        f"flush (`{FLUSH}`, at most once a second per backend, so its count depends on the run's "
        "pace: " + (f"{statistics.mean(flushed):,.0f}" if flushed else "0") + " instructions a window "
        "on average here), and the kernel's share of a wake-up (callgrind counts user space). "
        f"{a.rounds} round(s)" + (", each cell's median (range); / F = 0: the median of the rounds' "
                                  "ratios (range)" if a.rounds > 1 else "") + ".",
        "",
        "| followers | F | writer's commit | / F = 0 | followers' work per commit | per follower "
        "| writer / LISTEN's | per follower / LISTEN's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, f in cells:
        w, fl = med(m, f, 0), med(m, f, 1)
        zero_key = ("listen" if m == "listen" else "streampos", 0)
        listen_key = ("listen", f)
        name = "streampos, no follower" if m == "streampos" else NAMES[m]
        ratio = ""
        if zero_key in res and f:
            rs = [x[0] / z[0] for x, z in zip(res[(m, f)], res[zero_key])]
            ratio = f"{statistics.median(rs):.3f}" + (f" ({min(rs):.3f}–{max(rs):.3f})" if a.rounds > 1 else "")
        elif zero_key in res:
            ratio = "1"
        per = f"{fl / f:,.0f}{spread(m, f, 1, f)}" if f else "–"
        work = f"{fl:,.0f}{spread(m, f, 1)}" if f else "–"
        vs_w = vs_f = ""
        if listen_key in res and m != "listen":
            vs_w = f"{w / med(*listen_key, 0):.3f}"
            if f:
                vs_f = f"{fl / med(*listen_key, 1):.3f}"
        lines.append(f"| {name} | {f} | {w:,.0f}{spread(m, f, 0)} | {ratio} | "
                     f"{work} | {per} | {vs_w} | {vs_f} |")
    lines += [
        "",
        f"Run time: {time.monotonic() - started:.0f} s.",
        "",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text)
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
