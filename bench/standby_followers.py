#!/usr/bin/env python3
"""Long-polling followers on the primary and on a hot standby (issue 33's
bench): delivery latency and the followers' backends' CPU.

The script makes its own primary and two streaming hot standbys (initdb,
pg_basebackup -R, all run as user postgres, each preloading streampos,
reached only through Unix sockets in the working directory; ports 54470
to 54472 by default), one stream with a table per cell, and measures
four placements of N long-polling followers:

  (a) primary      followers on the primary (streampos.standby_wakeup_rmgr_id
                   set on both servers, as in (b))
  (b) standby      followers on the standby, woken by replay of the record
                   the primary's position worker logs after each store
                   (streampos.standby_wakeup_rmgr_id = 171 on both)
  (c) standby, polling
                   followers on the standby with the id 0 on both: they
                   look again every 100 ms
  (d) two standbys followers alternating between two standbys of the
                   primary, woken by replay (as (b))

Each round switches the servers between the two configurations (restarts:
the id is a postmaster setting; the standby gets it first, the primary
drops it first, as README's "Followers on hot standbys" says), runs (c)
for every N, then (a) and (b) for every N, in an order rotated per round.

A cell: N followers, each a thread with its own connection (statements
prepared), looping

    SELECT streampos.updates_json(stream, token, 100, 10000)

from token '0' on a stream of its own (empty), each call from the token
the previous one answered. One writer on the primary (autocommit) commits

    INSERT INTO t SELECT streampos.next_id(stream, 'w1'), 'w1', repeat('x', 200) RETURNING id

at a steady pace (--rate commits/s, scheduled, not slept between): a few
warm-up commits, waited for until every follower has them, then --commits
measured ones. Then an idle phase of --idle seconds with no commit, then
one last commit that ends the followers' loops.

Measured per cell:
  - delivery latency: from the writer's COMMIT returning (time.monotonic()
    in the writer's thread) to the follower's call returning with that row
    (time.monotonic() in the follower's thread as soon as execute()
    returns, before the answer is parsed), for every follower and every
    measured row; pooled over the rounds: p50, p99, max. The followers
    are threads of one Python process, so a wake-up of 32 of them at once
    queues on the interpreter's lock: that is in the figure too.
  - the followers' backends' CPU: utime + stime from /proc/<pid>/stat
    (clock ticks, 10 ms each: coarse for a few followers) of every
    follower's backend (pg_backend_pid()), summed: over the measured
    commits (from before the first until every follower had the last and
    0.2 s more) per commit, and over the idle phase per second. The same
    from /proc/<pid>/schedstat (nanoseconds on the CPU) beside it, since
    ticks round a few followers' share to 0. The servers must run on this
    machine. Median over the rounds; ratios against (a) with the same N.
  - on the standbys ((b), (d)): from the standby's replay of the commit
    (its replay LSN, polled every 2 ms, at or past the writer's insert
    LSN read right after its COMMIT) to the follower's answer;
  - the primary's CPU per measured commit: every process of the primary
    alive at the cell's start, from /proc/<pid>/schedstat;
  - exactly once: every follower must receive every committed row (warm-up,
    measured, last) exactly once; misses, repeats and rows never written
    are counted and reported, never dropped. Also reported: calls per
    delivered row (a standby's follower sees rows a store at a time),
    answers with no row (a 10 s timeout: nothing woke it) and, on the
    standby with wake-ups, replayed wake-up records per measured commit
    (streampos.standby_wakeups_replayed()).

streampos.position_interval_ms stays at its default (200 ms) unless
--position-interval-ms says otherwise: a standby's followers answer from
the positions the primary's worker stores, so their latency is about half
a store interval more than the primary's.

Usage (PostgreSQL 16, a release build installed first):

    source scripts/lib.sh && use_postgresql 16 \\
      && install_extension --release --no-default-features --features "pg16 stats"
    .venv/bin/python bench/standby_followers.py --pg-bin /opt/streampos/postgresql-16.15.0/bin

    bench/standby_followers.py --pg-bin DIR [--port 54470] [--followers 1,8,32] [--with-128]
                               [--rate 20] [--commits 60] [--idle 5] [--rounds 3]
                               [--position-interval-ms MS] [--dir DIR] [--out FILE]

(about 5 minutes with the defaults on 2 cores; not run by scripts/bench).
"""
import argparse
import collections
import datetime
import os
import pwd
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psycopg

RMGR_ID = 171
WARM_UP = 3
TIMEOUT_MS = 10000
SETTLE_S = 0.2
DELIVERY_WAIT_S = 15.0
USER = "postgres"
CLK_TCK = os.sysconf("SC_CLK_TCK")

PLACEMENTS = {
    "a": "(a) primary",
    "b": "(b) standby, woken by replay",
    "c": "(c) standby, polling (id 0)",
    "d": "(d) two standbys, woken by replay",
}
# How often the replay watcher asks each standby how far it replayed.
REPLAY_POLL_S = 0.002
FOLLOW = "SELECT streampos.updates_json(%s, %s, 100, %s)"
INSERT = "INSERT INTO {s}_ev SELECT streampos.next_id('{s}', 'w1'), 'w1', repeat('x', 200) RETURNING id"


def as_postgres(args):
    return (["runuser", "-u", USER, "--"] + args) if os.geteuid() == 0 else args


def chown(path):
    if os.geteuid() == 0:
        pw = pwd.getpwnam(USER)
        os.chown(path, pw.pw_uid, pw.pw_gid)


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)


def cpu_ns(pid):
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def cpu_of(pids):
    """(ticks, ns) summed over pids."""
    return sum(cpu_ticks(p) for p in pids), sum(cpu_ns(p) for p in pids)


def cpu_ns_by_pid(pids):
    """{pid: ns on the CPU} of the pids still alive."""
    out = {}
    for pid in pids:
        try:
            out[pid] = cpu_ns(pid)
        except (OSError, ValueError):
            pass
    return out


def cpu_delta_ns(before, after):
    """CPU time between two cpu_ns_by_pid readings, over the processes
    alive at both."""
    return sum(after[p] - before[p] for p in before if p in after)


def row_ids(answer):
    """The row IDs of one updates_json answer: data is, per table, a header
    whose third element is its row count, then those rows (ID first)."""
    data, ids, i = answer["data"], [], 0
    while i < len(data):
        count = data[i][2]
        ids.extend(int(r[0]) for r in data[i + 1: i + 1 + count])
        i += 1 + count
    return ids


class Server:
    def __init__(self, a, name, port):
        self.a, self.name, self.port = a, name, port
        self.data = os.path.join(a.root, name)
        self.log = os.path.join(a.root, f"{name}.log")
        self.dsn = f"host={a.root} port={port} user={USER} dbname=postgres"

    def run(self, *args, timeout=180):
        proc = subprocess.run(as_postgres(list(args)), capture_output=True, text=True,
                              timeout=timeout, env=self.a.env)
        if proc.returncode != 0:
            sys.exit(f"{' '.join(args)} failed: {proc.stdout}{proc.stderr}\n{self.log_tail()}")
        return proc

    def log_tail(self):
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-20:])
        except OSError:
            return ""

    def bin(self, name):
        return os.path.join(self.a.pg_bin, name)

    def start(self):
        self.run(self.bin("pg_ctl"), "-D", self.data, "-l", self.log, "-w", "-t", "120", "start")

    def stop(self):
        self.run(self.bin("pg_ctl"), "-D", self.data, "-m", "fast", "-w", "-t", "120", "stop")

    def running(self):
        return postmaster_pid(self.data) is not None

    def set_rmgr(self, rmgr):
        with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
            f.write(f"streampos.standby_wakeup_rmgr_id = {rmgr}\n")

    def children(self):
        """The pids of the server's processes (the postmaster and its
        children: backends, walsenders, the position worker, …)."""
        pid = postmaster_pid(self.data)
        if pid is None:
            return []
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
        return [pid] + [int(x) for x in out.split()]

    def connect(self):
        c = psycopg.connect(self.dsn, autocommit=True)
        c.prepare_threshold = 0
        return c

    def one(self, sql, params=None):
        with psycopg.connect(self.dsn, autocommit=True) as c:
            cur = c.execute(sql, params)
            return cur.fetchone()[0] if cur.description else None


def postmaster_pid(data):
    """The postmaster of `data` if it is alive and was started on it."""
    try:
        with open(os.path.join(data, "postmaster.pid")) as f:
            pid = int(f.readline().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if any(os.path.realpath(x.decode(errors="replace")) == os.path.realpath(data)
                      for x in args if x) else None


def force_stop(server):
    """Stop a server this script started, whatever its state."""
    if not os.path.exists(os.path.join(server.data, "postmaster.pid")):
        return
    subprocess.run(as_postgres([server.bin("pg_ctl"), "-D", server.data, "-m", "fast", "-w", "-t", "60",
                                "stop"]), capture_output=True, env=server.a.env, timeout=90)
    pid = postmaster_pid(server.data)
    if pid is None:
        return
    subprocess.run(as_postgres([server.bin("pg_ctl"), "-D", server.data, "-m", "immediate", "-w", "-t",
                                "30", "stop"]), capture_output=True, env=server.a.env, timeout=60)
    pid = postmaster_pid(server.data)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)  # its children exit with it
        except ProcessLookupError:
            pass


def caught_up(primary, standby, timeout=60):
    lsn = primary.one("SELECT pg_current_wal_flush_lsn()::text")
    deadline = time.monotonic() + timeout
    while not standby.one("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)):
        if time.monotonic() > deadline:
            sys.exit(f"the standby did not replay up to {lsn}\n{standby.log_tail()}")
        time.sleep(0.05)


def streaming(primary, standbys=1, timeout=60):
    deadline = time.monotonic() + timeout
    while primary.one("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'") < standbys:
        if time.monotonic() > deadline:
            sys.exit(f"the standby does not stream\n{primary.log_tail()}")
        time.sleep(0.05)


def configure(primary, standbys, rmgr, current):
    """Every server to `rmgr`: the standbys first when turning it on, the
    primary first (and each standby only once it replayed every record)
    when turning it off."""
    if rmgr == current:
        return rmgr
    order = standbys + [primary] if rmgr else [primary] + standbys
    for s in order:
        if s is not primary and not rmgr:
            caught_up(primary, s)
        s.stop()
        s.set_rmgr(rmgr)
        s.start()
    streaming(primary, len(standbys))
    for standby in standbys:
        caught_up(primary, standby)
    for s in [primary] + standbys:
        got = int(s.one("SHOW streampos.standby_wakeup_rmgr_id"))
        if got != rmgr:
            sys.exit(f"{s.name}: streampos.standby_wakeup_rmgr_id is {got}, not {rmgr}")
    return rmgr


class Cell:
    def __init__(self, a, primary, standbys, placement, n, stream):
        self.a, self.primary, self.standbys = a, primary, standbys
        # (d): the followers alternate between the two standbys.
        self.servers = {"a": [primary], "b": standbys[:1], "c": standbys[:1], "d": standbys}[placement]
        self.placement, self.n, self.stream = placement, n, stream
        self.lock = threading.Condition()
        self.pids = [None] * n
        self.got = [[] for _ in range(n)]  # [(id, monotonic)] per follower
        self.calls = [0] * n
        self.empty = [0] * n
        self.errors = []
        self.connected = 0
        self.stop = threading.Event()
        self.last_measured = None  # set before stop
        self.stop_deadline = None

    def follower(self, i):
        try:
            with self.servers[i % len(self.servers)].connect() as c:
                self.pids[i] = c.execute("SELECT pg_backend_pid()").fetchone()[0]
                with self.lock:
                    self.connected += 1
                    self.lock.notify_all()
                token = "0"
                while True:
                    cur = c.execute(FOLLOW, (self.stream, token, TIMEOUT_MS))
                    t = time.monotonic()
                    answer = cur.fetchone()[0]
                    ids = row_ids(answer)
                    token = answer["token"]
                    with self.lock:
                        self.calls[i] += 1
                        if not ids:
                            self.empty[i] += 1
                        self.got[i].extend((x, t) for x in ids)
                        self.lock.notify_all()
                    if self.stop.is_set():
                        if any(x > self.last_measured for x in ids) or time.monotonic() > self.stop_deadline:
                            return
        except Exception as e:  # reported by the cell
            with self.lock:
                self.errors.append(repr(e))
                self.lock.notify_all()

    def delivered(self, ids, timeout):
        """Wait until every follower has every row of `ids` (or timeout)."""
        want = set(ids)
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                if self.errors:
                    sys.exit(f"a follower failed: {self.errors[0]}")
                if all(want <= {x for x, _ in g} for g in self.got):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(timeout=min(left, 0.05))

    def run(self):
        a, s = self.a, self.stream
        insert = INSERT.format(s=s)
        writer = self.primary.connect()
        threads = [threading.Thread(target=self.follower, args=(i,), daemon=True) for i in range(self.n)]
        for t in threads:
            t.start()
        with self.lock:
            while self.connected < self.n:
                if self.errors:
                    sys.exit(f"a follower failed: {self.errors[0]}")
                self.lock.wait(timeout=1)
        time.sleep(0.3)  # every follower in its first call
        # Wake-up records replayed, per standby of the cell (the first
        # standby's for (a) and (c)).
        watched = self.servers if self.placement in ("b", "d") else self.standbys[:1]
        wakeups = lambda: sum(s.one("SELECT streampos.standby_wakeups_replayed()")  # noqa: E731
                              for s in watched) / len(watched)
        # When each standby of the cell replayed each commit (by its LSN).
        replayed_at = [[] for _ in watched]  # [(lsn, monotonic)] per standby
        watching = threading.Event()

        def watch(k, server):
            with server.connect() as c:
                while not watching.is_set():
                    lsn = c.execute("SELECT pg_last_wal_replay_lsn() - '0/0'::pg_lsn").fetchone()[0]
                    replayed_at[k].append((int(lsn), time.monotonic()))
                    time.sleep(REPLAY_POLL_S)

        watchers = [threading.Thread(target=watch, args=(k, sv), daemon=True) for k, sv in enumerate(watched)]
        if self.placement in ("b", "d"):
            for t in watchers:
                t.start()
        primary_pids = self.primary.children()

        written = []  # (id, monotonic of COMMIT returning)
        late = []

        def commits(k):
            out = []
            interval = 1.0 / a.rate
            t0 = time.monotonic()
            for j in range(k):
                due = t0 + j * interval
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                else:
                    late.append(-wait)
                x = writer.execute(insert).fetchone()[0]
                t = time.monotonic()
                # The commit's record ends at or before this LSN.
                lsn = writer.execute("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()[0]
                out.append((x, t))
                commit_lsn[x] = int(lsn)
            return out

        commit_lsn = {}

        warm = commits(WARM_UP)
        written += warm
        if not self.delivered([x for x, _ in warm], DELIVERY_WAIT_S):
            sys.exit(f"{PLACEMENTS[self.placement]}, N = {self.n}: the warm-up rows never reached every follower")
        time.sleep(SETTLE_S)
        late.clear()
        w0 = wakeups()
        c0 = cpu_of(self.pids)
        p0 = cpu_ns_by_pid(primary_pids)
        measured = commits(a.commits)
        written += measured
        on_time = self.delivered([x for x, _ in measured], DELIVERY_WAIT_S)
        time.sleep(SETTLE_S)
        c1 = cpu_of(self.pids)
        p1 = cpu_ns_by_pid(primary_pids)
        w1 = wakeups()
        watching.set()
        time.sleep(a.idle)
        c2 = cpu_of(self.pids)
        w2 = wakeups()
        self.last_measured = max(x for x, _ in written)
        self.stop_deadline = time.monotonic() + DELIVERY_WAIT_S
        self.stop.set()
        final = commits(1)
        written += final
        final_on_time = self.delivered([x for x, _ in final], DELIVERY_WAIT_S)
        writer.close()
        for t in threads:
            t.join(timeout=TIMEOUT_MS / 1000 + DELIVERY_WAIT_S + 5)
        if any(t.is_alive() for t in threads):
            sys.exit("a follower did not end")
        if self.errors:
            sys.exit(f"a follower failed: {self.errors[0]}")

        for t in watchers:
            if t.is_alive():
                t.join(timeout=5)
        commit_at = dict(written)
        measured_ids = {x for x, _ in measured}

        def replay_time(k, x):
            """When standby k had replayed row x's commit (the first poll
            that saw its LSN), or None."""
            for lsn, t in replayed_at[k]:
                if lsn >= commit_lsn[x]:
                    return t
            return None

        after_replay = []
        for i, g in enumerate(self.got):
            if self.placement not in ("b", "d"):
                break
            k = i % len(self.servers)
            for x, t in g:
                if x in measured_ids:
                    r = replay_time(k, x)
                    if r is not None:
                        after_replay.append((t - r) * 1000)
        latencies = []
        missing = repeated = unknown = 0
        for g in self.got:
            count = collections.Counter(x for x, _ in g)
            missing += sum(1 for x in commit_at if x not in count)
            repeated += sum(c - 1 for c in count.values() if c > 1)
            unknown += sum(1 for x in count if x not in commit_at)
            seen = set()
            for x, t in g:
                if x in measured_ids and x not in seen:
                    seen.add(x)
                    latencies.append((t - commit_at[x]) * 1000)
        rows = sum(len(g) for g in self.got)
        return {
            "latencies": latencies,
            "after_replay": after_replay,
            "primary_cpu_commit_ns_ms": cpu_delta_ns(p0, p1) / 1e6 / a.commits,
            "cpu_commit_ticks_ms": (c1[0] - c0[0]) * 1000 / CLK_TCK / a.commits,
            "cpu_commit_ns_ms": (c1[1] - c0[1]) / 1e6 / a.commits,
            "cpu_idle_ticks_ms": (c2[0] - c1[0]) * 1000 / CLK_TCK / a.idle,
            "cpu_idle_ns_ms": (c2[1] - c1[1]) / 1e6 / a.idle,
            "missing": missing, "repeated": repeated, "unknown": unknown,
            "on_time": on_time and final_on_time,
            "calls_per_row": sum(self.calls) / rows if rows else float("nan"),
            "empty": sum(self.empty),
            "wakeups_per_commit": (w1 - w0) / a.commits,
            "wakeups_idle": w2 - w1,
            "late_ms": max(late) * 1000 if late else 0.0,
            "rows": len(written),
        }


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pg-bin", required=True)
    ap.add_argument("--port", type=int, default=54470, help="the primary's; the standby's is the next")
    ap.add_argument("--followers", default="1,8,32")
    ap.add_argument("--with-128", action="store_true", help="also N = 128")
    ap.add_argument("--rate", type=float, default=20.0, help="the writer's commits per second")
    ap.add_argument("--commits", type=int, default=60, help="measured commits per cell")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of the idle phase")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--position-interval-ms", type=int, help="streampos.position_interval_ms (default: the server's)")
    ap.add_argument("--dir", help="working directory (kept); default a new temporary one, removed")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "standby_followers.md"))
    a = ap.parse_args()
    fs = [int(x) for x in a.followers.split(",")] + ([128] if a.with_128 else [])
    if not 54470 <= a.port <= 54477:
        sys.exit("--port: 54470 to 54477 (the standbys take the next two)")
    started = time.monotonic()
    a.root = a.dir or tempfile.mkdtemp(prefix="streampos-standby-followers-")
    os.makedirs(a.root, exist_ok=True)
    os.chmod(a.root, 0o755)
    chown(a.root)
    libdir = subprocess.run([os.path.join(a.pg_bin, "pg_config"), "--libdir"], check=True,
                            capture_output=True, text=True).stdout.strip()
    # The relocatable builds' walreceiver must load their own libpq
    # (scripts/lib.sh, use_postgresql).
    a.env = dict(os.environ, LD_LIBRARY_PATH=libdir, RUST_BACKTRACE="0", RUST_LIB_BACKTRACE="0")
    primary = Server(a, "primary", a.port)
    standby = Server(a, "standby", a.port + 1)
    standby2 = Server(a, "standby2", a.port + 2)
    standbys = [standby, standby2]
    version = None
    results = {}  # (placement, n) -> [cell results per round]
    try:
        primary.run(os.path.join(a.pg_bin, "initdb"), "-D", primary.data, "-A", "trust", "-U", USER)
        with open(os.path.join(primary.data, "postgresql.conf"), "a") as f:
            f.write("\n".join([
                "shared_preload_libraries = 'streampos'",
                f"port = {a.port}",
                "listen_addresses = ''",  # Unix sockets in the working directory only
                f"unix_socket_directories = '{a.root}'",
                f"max_connections = {max(fs) + 20}",
                "wal_level = replica",
                "max_wal_senders = 4",
                "hot_standby = on",
                "hot_standby_feedback = on",
                "wal_receiver_status_interval = '1s'",
                "autovacuum = off",
                "log_line_prefix = '%m [%p] %b '",
                "streampos.standby_wakeup_rmgr_id = 0",
            ] + ([f"streampos.position_interval_ms = {a.position_interval_ms}"]
                 if a.position_interval_ms else [])) + "\n")
        primary.start()
        version = primary.one("SHOW server_version")
        primary.one("CREATE EXTENSION streampos")
        streams = {}
        for rnd in range(a.rounds):
            for p in PLACEMENTS:
                for n in fs:
                    s = streams[(rnd, p, n)] = f"s{rnd}{p}{n}"
                    with primary.connect() as c:
                        c.execute(f"SELECT streampos.create_stream('{s}')")
                        c.execute(f"CREATE TABLE {s}_ev (id bigint PRIMARY KEY, instance_name text, payload text)")
                        c.execute(f"SELECT streampos.add_table('{s}', '{s}_ev', 'id', 'instance_name')")
        for sb in standbys:
            primary.run(os.path.join(a.pg_bin, "pg_basebackup"), "-h", a.root, "-p", str(a.port), "-U", USER,
                        "-D", sb.data, "-R", "-X", "stream", "-c", "fast")
            with open(os.path.join(sb.data, "postgresql.conf"), "a") as f:
                f.write(f"port = {sb.port}\n")
            sb.start()
        streaming(primary, len(standbys))
        for sb in standbys:
            caught_up(primary, sb)
        rmgr = 0
        position_interval = primary.one("SHOW streampos.position_interval_ms")
        print(f"PostgreSQL {version}, servers up: {time.monotonic() - started:.0f} s", flush=True)
        for rnd in range(a.rounds):
            plan = [(0, "c")] + [(RMGR_ID, "a"), (RMGR_ID, "b"), (RMGR_ID, "d")]
            cells = [(r, p, n) for r, p in plan for n in fs]
            # Rotated within each configuration per round.
            k = rnd % len(fs)
            for r in (0, RMGR_ID):
                mine = [x for x in cells if x[0] == r]
                mine = mine[k:] + mine[:k]
                if rnd % 2:
                    mine.reverse()
                rmgr = configure(primary, standbys, r, rmgr)
                for _, p, n in mine:
                    t0 = time.monotonic()
                    res = Cell(a, primary, standbys, p, n, streams[(rnd, p, n)]).run()
                    results.setdefault((p, n), []).append(res)
                    lat = res["latencies"]
                    print(f"round {rnd + 1}: {PLACEMENTS[p]}, N = {n}: p50 {pct(lat, 50):.1f} ms, "
                          f"p99 {pct(lat, 99):.1f} ms, CPU/commit {res['cpu_commit_ns_ms']:.3f} ms, "
                          f"idle {res['cpu_idle_ns_ms']:.3f} ms/s, missing {res['missing']}, "
                          f"repeated {res['repeated']} ({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        for s in standbys + [primary]:
            try:
                force_stop(s)
            except Exception as e:  # the other must still stop
                print(f"stopping {s.name}: {e!r}", file=sys.stderr)
        for s in standbys + [primary]:
            if s.running():
                print(f"{s.name} still runs: {s.data} kept", file=sys.stderr)
                a.dir = a.dir or a.root
        if not a.dir:
            shutil.rmtree(a.root, ignore_errors=True)

    def med(p, n, key):
        return statistics.median(r[key] for r in results[(p, n)])

    def rng(p, n, key, fmt):
        xs = [r[key] for r in results[(p, n)]]
        return f" ({fmt.format(min(xs))}–{fmt.format(max(xs))})" if len(xs) > 1 else ""

    def ratio(p, n, key):
        base = med("a", n, key)
        return f"{med(p, n, key) / base:.2f}" if base > 0 else "–"

    command = " ".join(["bench/standby_followers.py"] + sys.argv[1:])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    lines = [
        "## Followers on the primary and on a hot standby",
        "",
        f"{now}, nproc {os.cpu_count()} (shared with other work: noisy), PostgreSQL {version}, streampos: "
        "the release build installed in it (`install_extension --release --no-default-features "
        "--features \"pg16 stats\"`). Command:",
        "",
        f"    .venv/bin/python {command}",
        "",
        f"A primary and two streaming hot standbys (pg_basebackup -R, asynchronous, fsync on, "
        f"`streampos.position_interval_ms` = {position_interval}, `follower_batch_ms` default). One writer "
        f"on the primary commits `INSERT … SELECT streampos.next_id(…) … RETURNING id` at {a.rate:g}/s "
        f"(autocommit): {WARM_UP} warm-up commits, {a.commits} measured, {a.idle:g} s with none, one last. "
        f"N followers, each a thread on its own connection looping `updates_json(stream, token, 100, "
        f"{TIMEOUT_MS})` (prepared); in (d) they alternate between the two standbys. (a), (b) and (d) with "
        f"`streampos.standby_wakeup_rmgr_id` = {RMGR_ID} on every server, "
        "(c) with 0 on every server (the standby's followers look every 100 ms); servers restarted "
        f"between the two each round. {a.rounds} round(s).",
        "",
        "Delivery latency: the writer's COMMIT returning → the follower's call returning with the row, "
        "every follower × every measured row, pooled over the rounds (the followers are threads of one "
        "Python process: a wake-up of many at once queues on its interpreter lock, which is in the "
        "figure). Exactly once: every follower against every row committed in the cell (warm-up, "
        "measured, last).",
        "",
        "| placement | N | p50 ms | p99 ms | max ms | calls per row | empty answers | missed | repeated | "
        "not written | wake-up records per commit | wake-up records while idle |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in PLACEMENTS:
        for n in fs:
            rs = results[(p, n)]
            lat = [x for r in rs for x in r["latencies"]]
            wk = (f"{med(p, n, 'wakeups_per_commit'):.2f} | {sum(r['wakeups_idle'] for r in rs)}"
                  if p != "a" else "– | –")
            lines.append(
                f"| {PLACEMENTS[p]} | {n} | {pct(lat, 50):.1f} | {pct(lat, 99):.1f} | {max(lat):.1f} | "
                f"{med(p, n, 'calls_per_row'):.2f} | {sum(r['empty'] for r in rs)} | "
                f"{sum(r['missing'] for r in rs)} | {sum(r['repeated'] for r in rs)} | "
                f"{sum(r['unknown'] for r in rs)} | {wk} |")
    lines += [
        "",
        "From the standby's replay of the commit to the follower's answer ((b) and (d)): each "
        "standby's `pg_last_wal_replay_lsn()` is polled every "
        f"{REPLAY_POLL_S * 1000:g} ms from a connection of its own; a commit counts as replayed at the "
        "first poll that saw `pg_current_wal_insert_lsn()` as the writer read it right after its "
        "COMMIT (at or past the commit's record: later by up to one poll, and by the records the "
        "insert position includes beyond it). Issue 33's goal: p50 within 5 ms. The primary's CPU: "
        "every process of the primary alive at the cell's start (its postmaster's children: the "
        "writer's backend, walsenders, the position worker, the primary's followers in (a)), "
        "schedstat, per measured commit, median of the rounds (range).",
        "",
        "| placement | N | replay → answer p50 ms | p99 ms | primary's CPU per commit, ms |",
        "|---|---|---|---|---|",
    ]
    for p in PLACEMENTS:
        for n in fs:
            rs = results[(p, n)]
            after = [x for r in rs for x in r["after_replay"]]
            cells = f"{pct(after, 50):.1f} | {pct(after, 99):.1f}" if after else "– | –"
            lines.append(f"| {PLACEMENTS[p]} | {n} | {cells} | {med(p, n, 'primary_cpu_commit_ns_ms'):.3f}"
                         f"{rng(p, n, 'primary_cpu_commit_ns_ms', '{:.3f}')} |")
    lines += [
        "",
        "The followers' backends' CPU, summed over the N backends: per measured commit (from before the "
        f"first until every follower had the last, + {SETTLE_S} s) and per second of the idle phase. "
        "`stat`: utime + stime of /proc/<pid>/stat (ticks of "
        f"{1000 // CLK_TCK} ms: a few followers' share rounds to 0 or one tick); `schedstat`: "
        "/proc/<pid>/schedstat's time on the CPU (ns). Median of the rounds (range); / (a): against the "
        "primary's followers with the same N (schedstat's medians).",
        "",
        "| placement | N | per commit, stat ms | per commit, schedstat ms | / (a) | idle, stat ms/s | "
        "idle, schedstat ms/s | / (a) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in PLACEMENTS:
        for n in fs:
            lines.append(
                f"| {PLACEMENTS[p]} | {n} | {med(p, n, 'cpu_commit_ticks_ms'):.3f}"
                f"{rng(p, n, 'cpu_commit_ticks_ms', '{:.3f}')} | {med(p, n, 'cpu_commit_ns_ms'):.3f}"
                f"{rng(p, n, 'cpu_commit_ns_ms', '{:.3f}')} | {ratio(p, n, 'cpu_commit_ns_ms')} | "
                f"{med(p, n, 'cpu_idle_ticks_ms'):.2f}{rng(p, n, 'cpu_idle_ticks_ms', '{:.2f}')} | "
                f"{med(p, n, 'cpu_idle_ns_ms'):.3f}{rng(p, n, 'cpu_idle_ns_ms', '{:.3f}')} | "
                f"{ratio(p, n, 'cpu_idle_ns_ms')} |")
    idle_a = [r["cpu_idle_ns_ms"] for n in fs for r in results[("a", n)]]
    per = "; ".join(
        f"N = {n}: (b) {med('b', n, 'cpu_idle_ns_ms') / n:.2f}, (c) {med('c', n, 'cpu_idle_ns_ms') / n:.2f}"
        + (f", (c) / (b) {med('c', n, 'cpu_idle_ns_ms') / med('b', n, 'cpu_idle_ns_ms'):.1f}"
           if med('b', n, 'cpu_idle_ns_ms') > 0 else "")
        for n in fs)
    lines += [
        "",
        "While idle: (a)'s followers used " + (
            "no CPU at all (0 ns in every round), so no ratio against (a)" if not any(idle_a) else
            f"at most {max(idle_a):.3f} ms/s") + "; per follower, ms of CPU per idle second (schedstat): "
        + per + " (a standby's follower looks again every 1 s with wake-ups, every 100 ms without).",
    ]
    worst_late = max(r["late_ms"] for rs in results.values() for r in rs)
    lines += [
        "",
        f"The writer's latest commit behind its schedule: {worst_late:.1f} ms. "
        f"Run time: {time.monotonic() - started:.0f} s.",
        "",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        new = not os.path.exists(a.out)
        with open(a.out, "a") as f:
            if new:
                f.write("# Followers on a hot standby\n\n")
            f.write(text)


if __name__ == "__main__":
    main()
