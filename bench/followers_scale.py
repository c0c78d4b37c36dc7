#!/usr/bin/env python3
"""Writers with many long-polling followers, against the same writers
alone and against LISTEN/NOTIFY followers (issue 33's cells), with the
followers in the Rust client (clients/rust/examples/follower_load.rs: every
follower of a cell is a task of one process, light enough not to be what is
measured; the LISTEN/NOTIFY followers are the same program).

A cluster of its own (PostgreSQL of --pg-bin, streampos installed there,
`max_connections = 300`, otherwise as scripts/bench's). Two pgbench writer
clients commit `INSERT … SELECT streampos.next_id(…)` (autocommit) for
--seconds; round by round, interleaved: the writers alone, then with N
followers:

- `updates_json` long-poll: each follower a `Follower` of the Rust client
  (`updates_json(stream, token, 100, 1000)`, prepared once);
- LISTEN/NOTIFY: the writers' transaction also runs `NOTIFY` (BEGIN …
  COMMIT), each follower LISTENs and on a notification runs the
  hand-written query for the rows after its last, up to the frontier.

Ratio: the writers' TPS with the followers / alone in the same round
(median of the rounds, range). Every follower must receive every row the
writers committed while it followed, once. Latency: follower 0's rows,
from the row's `clock_timestamp()` in the writer's INSERT to the follower
having it. Client CPU: the follower process's user + system time per
second of the loaded run.

    .venv/bin/python bench/followers_scale.py --pg-bin <bin> [--followers 32,128] [--out FILE]
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import psycopg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import callgrind as cg  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUST_CLIENT = os.path.join(REPO, "clients", "rust")

SETUP = """
CREATE EXTENSION streampos;
CREATE TABLE t_sp (id bigint PRIMARY KEY, w text NOT NULL, body text NOT NULL,
                   at_us bigint NOT NULL DEFAULT (extract(epoch FROM clock_timestamp()) * 1e6)::bigint);
CREATE TABLE t_ln (LIKE t_sp INCLUDING ALL);
SELECT streampos.create_stream('s_sp');
SELECT streampos.create_stream('s_ln');
SELECT streampos.add_table('s_sp', 't_sp', 'id', 'w');
"""

WRITER = {
    "alone": "\\set w random(1, 2)\n"
             "INSERT INTO t_sp (id, w, body) SELECT streampos.next_id('s_sp', 'w' || :w), 'w' || :w, 'x';\n",
    "updates": "\\set w random(1, 2)\n"
               "INSERT INTO t_sp (id, w, body) SELECT streampos.next_id('s_sp', 'w' || :w), 'w' || :w, 'x';\n",
    "listen": "\\set w random(1, 2)\nBEGIN;\n"
              "INSERT INTO t_ln (id, w, body) SELECT streampos.next_id('s_ln', 'w' || :w), 'w' || :w, 'x';\n"
              "NOTIFY s_ln;\nCOMMIT;\n",
}
TABLE = {"updates": "t_sp", "listen": "t_ln"}
STREAM = {"updates": "s_sp", "listen": "s_ln"}
NAMES = {"updates": "`updates_json()` long-poll (Rust client)", "listen": "LISTEN/NOTIFY + query (Rust client)"}


def fmt(values, digits=2):
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


class Cluster:
    def __init__(self, pg_bin, port):
        self.pg_bin, self.port = pg_bin, port
        self.root = tempfile.mkdtemp(prefix="streampos-followers-scale-")
        os.chmod(self.root, 0o777)
        self.data = os.path.join(self.root, "data")
        os.makedirs(self.data)
        if os.geteuid() == 0:
            shutil.chown(self.data, "postgres", "postgres")
        subprocess.run(cg.as_postgres([os.path.join(pg_bin, "initdb"), "-D", self.data, "-A", "trust",
                                       "-U", "postgres"]), check=True, capture_output=True)
        with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
            f.write("shared_preload_libraries = 'streampos'\nmax_connections = 300\n"
                    "shared_buffers = 256MB\nsynchronous_commit = on\nlisten_addresses = '127.0.0.1'\n"
                    f"port = {port}\nunix_socket_directories = '{self.root}'\n")
        subprocess.run(cg.as_postgres([os.path.join(pg_bin, "pg_ctl"), "-D", self.data, "-w", "-l",
                                       os.path.join(self.data, "log"), "start"]), check=True,
                       capture_output=True)
        self.conninfo = f"host=127.0.0.1 port={port} user=postgres dbname=postgres"

    def stop(self):
        subprocess.run(cg.as_postgres([os.path.join(self.pg_bin, "pg_ctl"), "-D", self.data, "-m", "fast",
                                       "stop"]), capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def pgbench(self, name, clients, seconds):
        script = os.path.join(self.root, name + ".sql")
        with open(script, "w") as f:
            f.write(WRITER[name])
        cmd = [os.path.join(self.pg_bin, "pgbench"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
               "-n", "-M", "prepared", "-c", str(clients), "-j", str(clients), "-T", str(seconds),
               "-f", script, "postgres"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"pgbench failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
        return float(re.search(r"tps = ([0-9.]+)", out.stdout).group(1))

    def count(self, table):
        with psycopg.connect(self.conninfo, autocommit=True) as c:
            return c.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def build_client():
    subprocess.run(["cargo", "build", "--quiet", "--release", "--example", "follower_load"],
                   cwd=RUST_CLIENT, check=True)
    return os.path.join(RUST_CLIENT, "target", "release", "examples", "follower_load")


def loaded_run(cluster, program, kind, n, seconds):
    """The writers with n followers of `kind`: (TPS, rows committed, the
    followers' report, client CPU seconds)."""
    proc = subprocess.Popen([program, "--conninfo", cluster.conninfo, "--kind", kind, "--followers", str(n),
                             "--stream", STREAM[kind], "--table", TABLE[kind]],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        sys.exit(f"follower_load did not start: {line!r}")
    before = cluster.count(TABLE[kind])
    tps = cluster.pgbench(kind, 2, seconds)
    after = cluster.count(TABLE[kind])
    time.sleep(1.5)
    proc.stdin.close()
    report = json.loads(proc.stdout.read())
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        sys.exit(f"follower_load failed ({status})")
    return tps, after - before, report, usage.ru_utime + usage.ru_stime


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pg-bin", required=True)
    p.add_argument("--port", type=int, default=54470)
    p.add_argument("--followers", default="32,128")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    counts = [int(n) for n in args.followers.split(",")]
    program = build_client()
    cluster = Cluster(args.pg_bin, args.port)
    started = time.time()
    rows = []
    try:
        with psycopg.connect(cluster.conninfo, autocommit=True) as c:
            c.execute(SETUP)
            version = c.execute("SHOW server_version").fetchone()[0]
        for kind in ("updates", "listen"):
            for n in counts:
                ratios, alone_tps, loaded_tps, latencies, cpu, checks = [], [], [], [], [], []
                for r in range(args.rounds):
                    alone = cluster.pgbench("alone", 2, args.seconds)
                    tps, committed, report, cpu_s = loaded_run(cluster, program, kind, n, args.seconds)
                    ratios.append(tps / alone)
                    alone_tps.append(alone)
                    loaded_tps.append(tps)
                    cpu.append(cpu_s / args.seconds)
                    latencies += report["latencies_ms"]
                    for k, f in enumerate(report["followers"]):
                        if "error" in f:
                            checks.append(f"follower {k}: {f['error']}")
                        elif f["twice"] or f["rows"] != committed:
                            checks.append(f"follower {k}: {f['rows']} rows of {committed}, {f['twice']} twice")
                latencies.sort()
                p50 = latencies[len(latencies) // 2] if latencies else float("nan")
                p99 = latencies[int(len(latencies) * 0.99)] if latencies else float("nan")
                rows.append((kind, n, ratios, alone_tps, loaded_tps, p50, p99, cpu, checks))
                print(f"  {kind} N={n}: writers {fmt(ratios)} of alone, p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
                      f"client CPU {fmt(cpu)} s/s; {'; '.join(checks[:3]) or 'every row once'}", flush=True)
    finally:
        cluster.stop()
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines = [
        "# Writers with many followers, the followers in the Rust client", "",
        f"{time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, nproc {os.cpu_count()}, PostgreSQL {version}, "
        f"streampos as installed in it (commit {commit}'s tree). Command:", "",
        f"    .venv/bin/python bench/followers_scale.py --pg-bin <bin> --followers {args.followers} "
        f"--rounds {args.rounds} --seconds {args.seconds}", "",
        "2 pgbench writer clients (`INSERT … SELECT streampos.next_id(…)`, autocommit), alone and then "
        "with N followers, interleaved round by round; the followers are tasks of one process "
        "(clients/rust/examples/follower_load.rs). Ratio: writers' TPS with the followers / alone in "
        "the same round, median (range) of the rounds. Latency: follower 0's rows, from the INSERT's "
        "`clock_timestamp()` to the follower having the row, pooled over the rounds. Client CPU: the "
        "follower process's user + system seconds per second of the loaded run. Goals (issue 33): "
        "writers ≥ 0.6 of alone with 32 followers, ≥ 0.4 with 128.", "",
        "| followers | N | writers vs alone | writers alone, TPS | with followers, TPS | latency p50 | p99 "
        "| client CPU s/s | rows |",
        "|---|---|---|---|---|---|---|---|---|"]
    for kind, n, ratios, alone_tps, loaded_tps, p50, p99, cpu, checks in rows:
        lines.append(f"| {NAMES[kind]} | {n} | {fmt(ratios)} | {statistics.median(alone_tps):.0f} "
                     f"| {statistics.median(loaded_tps):.0f} | {p50:.1f} ms | {p99:.1f} ms | {fmt(cpu)} "
                     f"| {'; '.join(checks[:2]) or 'every row once'} |")
    lines += ["", f"Run time: {time.time() - started:.0f} s."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
