#!/usr/bin/env python3
"""The streampos benchmark suite, run by scripts/bench against a running
cluster with streampos preloaded.

Every shape runs in the same session of this script, interleaved round by
round (A B C D, A B C D, ...), so that drift on a noisy machine hits all
shapes alike. Results are medians over rounds, reported as ratios against a
baseline measured in the same run.

Writers (pgbench -M prepared, synchronous_commit as given):
  floor           INSERT … SELECT nextval(seq), writer, payload
  streampos       INSERT … SELECT streampos.next_id('bench', writer), …
  synapse-in-txn  the floor's INSERT + an upsert of the writer's positions
                  row in the same transaction
Readers (8 clients, while 8 streampos writers run):
  SELECT 1  /  streampos.frontier('bench')  /  streampos.current_room_token('bench')
Old snapshot (4 writer clients of next_id + INSERT, 4 reader clients of each
reader shape, pgbench -M prepared), without and with one REPEATABLE READ
transaction that took its snapshot first and stays open for at least
--hold seconds across the runs; afterwards that transaction's frontier and
its rows at or below it are checked against what every later snapshot sees.
Many streams: 16 clients, each the only writer of a stream of its own,
against the floor with one sequence per client.

With and without statistics (--part stats, --compare PATH): streampos built
with the cargo feature `stats` (the default) and without it (PATH: that
build's streampos.so), each round restarting the server with one library
and then the other (in an order that rotates): writers (1 × 1, 8 × 1,
32 × 4) and frontier() readers under writers, as above.

Every ratio is computed round by round (each round measures the shape and
its baseline back to back, in an order that rotates from round to round)
and reported as the median of the rounds with their range (min-max), so
that a cost smaller than the noise shows as a range that straddles 1.
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psycopg

PAYLOAD = "repeat('x', 200)"

WRITER_SHAPES = {
    "floor": f"""
\\set w random(1, :writers)
INSERT INTO b_floor SELECT nextval('b_floor_seq'), 'w' || :w, {PAYLOAD};
""",
    "streampos": f"""
\\set w random(1, :writers)
INSERT INTO b_sp SELECT streampos.next_id('bench', 'w' || :w), 'w' || :w, {PAYLOAD};
""",
    "synapse-in-txn": f"""
\\set w random(1, :writers)
BEGIN;
INSERT INTO b_syn SELECT nextval('b_syn_seq'), 'w' || :w, {PAYLOAD} RETURNING id AS new_id \\gset
INSERT INTO b_syn_pos VALUES ('w' || :w, :new_id) ON CONFLICT (writer) DO UPDATE
    SET stream_id = EXCLUDED.stream_id WHERE b_syn_pos.stream_id < EXCLUDED.stream_id;
COMMIT;
""",
}

READER_SHAPES = {
    "SELECT 1": "SELECT 1;\n",
    "frontier()": "SELECT streampos.frontier('bench');\n",
    "current_room_token()": "SELECT streampos.current_room_token('bench');\n",
}

OLD_SNAPSHOT_WRITER = f"""
\\set w random(1, 4)
INSERT INTO b_os SELECT streampos.next_id('bench', 'w' || :w), 'w' || :w, {PAYLOAD};
"""

N_STREAMS = 16
# pgbench numbers its clients from 0: client c writes stream (c % 16) + 1.
MANY_STREAM_SHAPES = {
    "floor": f"""
\\set s :client_id % {N_STREAMS} + 1
INSERT INTO b_ms SELECT nextval(('b_ms_seq_' || :s)::regclass), :s, {PAYLOAD};
""",
    "streampos": f"""
\\set s :client_id % {N_STREAMS} + 1
INSERT INTO b_ms SELECT streampos.next_id('ms' || :s, 'w1'), :s, {PAYLOAD};
""",
}

SETUP = """
DROP TABLE IF EXISTS b_floor, b_sp, b_syn, b_syn_pos, b_after, b_after_pos, b_os, b_ms;
DROP SEQUENCE IF EXISTS b_floor_seq, b_syn_seq, b_after_seq;
CREATE TABLE b_floor (id bigint, writer text, payload text);
CREATE TABLE b_sp (id bigint, writer text, payload text);
CREATE TABLE b_syn (id bigint, writer text, payload text);
CREATE TABLE b_syn_pos (writer text PRIMARY KEY, stream_id bigint NOT NULL);
CREATE TABLE b_os (id bigint, writer text, payload text);
CREATE TABLE b_ms (id bigint, stream int, payload text);
CREATE SEQUENCE b_floor_seq;
CREATE SEQUENCE b_syn_seq;
"""


def rotated(items, k):
    """`items` starting at position k: each round runs its shapes in another
    order, so that a shape is not always the one after (say) a checkpoint."""
    items = list(items)
    k %= len(items)
    return items[k:] + items[:k]


def spread(values):
    """Median and range of per-round values."""
    return statistics.median(values), min(values), max(values)


def fmt_ratio(values):
    med, lo, hi = spread(values)
    return f"{med:.2f} ({lo:.2f}–{hi:.2f})"


class Bench:
    def __init__(self, args):
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="streampos-bench-")
        self.conninfo = dict(host=args.host, port=args.port, dbname=args.dbname, user="postgres")

    def sql(self, statement):
        with psycopg.connect(**self.conninfo, autocommit=True) as conn:
            for part in statement.split(";"):
                if part.strip():
                    conn.execute(part)

    def setup(self):
        with psycopg.connect(**dict(self.conninfo, dbname="postgres"), autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.args.dbname,)).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{self.args.dbname}"')
        self.sql("CREATE EXTENSION IF NOT EXISTS streampos")
        self.sql(SETUP)
        with psycopg.connect(**self.conninfo, autocommit=True) as conn:
            for name in ["bench"] + [f"ms{i}" for i in range(1, N_STREAMS + 1)]:
                if not conn.execute("SELECT 1 FROM streampos.streams WHERE stream_name = %s", (name,)).fetchone():
                    conn.execute("SELECT streampos.create_stream(%s, writers => ARRAY['w1'])" if name.startswith("ms")
                                 else "SELECT streampos.create_stream(%s)", (name,))
            for i in range(1, N_STREAMS + 1):
                conn.execute(f"DROP SEQUENCE IF EXISTS b_ms_seq_{i}")
                conn.execute(f"CREATE SEQUENCE b_ms_seq_{i}")
        self.reset()

    def reset(self):
        self.sql("TRUNCATE b_floor, b_sp, b_syn, b_syn_pos, b_ms")

    def script(self, name, body):
        path = os.path.join(self.dir, re.sub(r"[^a-z0-9]+", "_", name.lower()) + ".sql")
        with open(path, "w") as f:
            f.write(body)
        return path

    def pgbench(self, script, clients, seconds, writers=1, sync=True):
        env = dict(os.environ, PGOPTIONS=f"-c synchronous_commit={'on' if sync else 'off'}")
        cmd = [
            self.args.pgbench, "-h", self.args.host, "-p", str(self.args.port), "-U", "postgres",
            "-n", "-M", "prepared", "-c", str(clients), "-j", str(min(clients, 4)),
            "-T", str(seconds), "-D", f"writers={writers}", "-f", script, self.args.dbname,
        ]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"pgbench failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
        tps = float(re.search(r"tps = ([0-9.]+)", out.stdout).group(1))
        latency = float(re.search(r"latency average = ([0-9.]+) ms", out.stdout).group(1))
        return tps, latency

    def with_load(self, load_script, load_clients, load_writers, script, clients, seconds):
        """Run `script` while `load_script` runs (started 1 s before, ends 1 s
        after); returns (measured, load) results."""
        load_result = []
        load = threading.Thread(
            target=lambda: load_result.append(
                self.pgbench(load_script, load_clients, seconds + 2, load_writers, True)
            )
        )
        load.start()
        time.sleep(1)
        measured = self.pgbench(script, clients, seconds)
        load.join()
        return measured, load_result[0]

    def writer_cells(self):
        cells = [(1, 1, True)] + [(c, w, True) for c in (8, 32) for w in (1, 4)]
        cells.append((32, 1, False))
        cells.append((32, 4, False))
        rows = []
        for clients, writers, sync in cells:
            results = {name: [] for name in WRITER_SHAPES}
            for round_ in range(self.args.rounds):
                for name in rotated(WRITER_SHAPES, round_):
                    body = WRITER_SHAPES[name]
                    self.reset()
                    results[name].append(
                        self.pgbench(self.script(name, body), clients, self.args.seconds, writers, sync)
                    )
            floor = [t for t, _ in results["floor"]]
            for name, runs in results.items():
                tps = statistics.median(t for t, _ in runs)
                lat = statistics.median(latency for _, latency in runs)
                ratios = [t / f for (t, _), f in zip(runs, floor)]
                rows.append((clients, writers, "on" if sync else "off", name, tps, lat, ratios))
            line = ", ".join(f"{n} {statistics.median(t for t, _ in r):.0f}" for n, r in results.items())
            print(f"  {clients} clients, {writers} writers, sync {sync}: {line}", flush=True)
        return rows

    def reader_cells(self, label):
        writer_script = self.script("streampos", WRITER_SHAPES["streampos"])
        results = {name: [] for name in READER_SHAPES}
        for round_ in range(self.args.rounds):
            for name in rotated(READER_SHAPES, round_):
                body = READER_SHAPES[name]
                self.reset()
                measured, _ = self.with_load(writer_script, 8, 4, self.script(name, body), 8, self.args.seconds)
                results[name].append(measured)
        base = [t for t, _ in results["SELECT 1"]]
        rows = []
        for name, runs in results.items():
            tps = statistics.median(t for t, _ in runs)
            lat = statistics.median(latency for _, latency in runs)
            rows.append((label, name, tps, lat, [t / b for (t, _), b in zip(runs, base)]))
        print(f"  readers ({label}): " + ", ".join(f"{r[1]} {r[2]:.0f}" for r in rows), flush=True)
        return rows

    def open_old_snapshot(self):
        """A REPEATABLE READ transaction whose snapshot is taken now (its
        first query), while no writer runs."""
        conn = psycopg.connect(**self.conninfo)
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        max_id = conn.execute("SELECT coalesce(max(id), 0) FROM b_os").fetchone()[0]
        return conn, max_id

    def check_old_snapshot(self, conn, max_id_then):
        """The old snapshot's first frontier, asked after the run, and its
        rows at or below it: every row at or below it that any later
        snapshot sees, it sees too."""
        frontier = conn.execute("SELECT streampos.frontier('bench')").fetchone()[0]
        seen_old = conn.execute("SELECT count(*) FROM b_os WHERE id <= %s", (frontier,)).fetchone()[0]
        rows_then = conn.execute("SELECT count(*) FROM b_os").fetchone()[0]
        conn.rollback()
        conn.close()
        with psycopg.connect(**self.conninfo, autocommit=True) as now:
            seen_now = now.execute("SELECT count(*) FROM b_os WHERE id <= %s", (frontier,)).fetchone()[0]
            total_now = now.execute("SELECT count(*) FROM b_os").fetchone()[0]
        return dict(frontier=frontier, exact=max_id_then, rows_old=seen_old, rows_now=seen_now,
                    correct=seen_old == seen_now and frontier <= max_id_then,
                    commits_during=total_now - rows_then)

    def old_snapshot_cell(self):
        """Writers and readers without and with one old REPEATABLE READ
        snapshot held across the runs, interleaved round by round."""
        self.sql("TRUNCATE b_os")
        writer_script = self.script("old snapshot writer", OLD_SNAPSHOT_WRITER)
        seconds = self.args.seconds
        readers = {(cond, name): [] for cond in ("without", "with") for name in READER_SHAPES}
        writers = {key: [] for key in readers}
        checks = []
        for round_ in range(self.args.rounds):
            for cond in rotated(("without", "with"), round_):
                old = None
                if cond == "with":
                    old = self.open_old_snapshot()
                    held_since = time.monotonic()
                    # Writers alone first: the snapshot is already old (and the
                    # ring well filled) when the measured runs start.
                    self.pgbench(writer_script, 4, self.args.prefill)
                for name in rotated(READER_SHAPES, round_):
                    body = READER_SHAPES[name]
                    (r, _), (w, _) = self.with_load(
                        writer_script, 4, 4, self.script(name, body), 4, seconds
                    )
                    readers[(cond, name)].append(r)
                    writers[(cond, name)].append(w)
                if old:
                    left = self.args.hold - (time.monotonic() - held_since)
                    if left > 0:
                        self.pgbench(writer_script, 4, int(left + 0.999))
                    check = self.check_old_snapshot(*old)
                    check["held_s"] = time.monotonic() - held_since
                    checks.append(check)
        rows = []
        for cond in ("without", "with"):
            base = readers[(cond, "SELECT 1")]
            for name in READER_SHAPES:
                rtps = readers[(cond, name)]
                wtps = writers[(cond, name)]
                rows.append((
                    cond, name, statistics.median(rtps), [r / b for r, b in zip(rtps, base)],
                    statistics.median(wtps),
                    [w / b for w, b in zip(wtps, writers[("without", name)])],
                ))
        print("  old snapshot: " + "; ".join(
            f"{c} {n}: readers {fmt_ratio(r)}, writers {fmt_ratio(w)}" for c, n, _, r, _, w in rows
        ), flush=True)
        print(f"  old snapshot checks: {checks}", flush=True)
        return rows, checks

    def many_streams_cell(self):
        results = {name: [] for name in MANY_STREAM_SHAPES}
        for round_ in range(self.args.rounds):
            for name in rotated(MANY_STREAM_SHAPES, round_):
                body = MANY_STREAM_SHAPES[name]
                self.reset()
                results[name].append(
                    self.pgbench(self.script("ms " + name, body), N_STREAMS, self.args.seconds)
                )
        floor = [t for t, _ in results["floor"]]
        rows = []
        for name, runs in results.items():
            rows.append((
                name, statistics.median(t for t, _ in runs),
                statistics.median(latency for _, latency in runs),
                [t / f for (t, _), f in zip(runs, floor)],
            ))
        print("  many streams: " + ", ".join(f"{n} {t:.0f}" for n, t, _, _ in rows), flush=True)
        return rows


class Libraries:
    """Swap the server's streampos.so between builds and restart it (a
    preloaded library is read at start-up only)."""

    def __init__(self, args, bench):
        self.args, self.bench = args, bench
        self.libdir = subprocess.run([os.path.join(args.pg_bin, "pg_config"), "--pkglibdir"],
                                     capture_output=True, text=True, check=True).stdout.strip()
        self.paths = {"with": os.path.join(bench.dir, "streampos-with-stats.so"), "without": args.compare}
        shutil.copy(os.path.join(self.libdir, "streampos.so"), self.paths["with"])

    def pg_ctl(self, *args):
        cmd = [os.path.join(self.args.pg_bin, "pg_ctl"), "-D", self.args.pgdata, *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--"] + cmd
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def use(self, name):
        self.pg_ctl("-m", "fast", "-w", "-t", "60", "stop")
        target = os.path.join(self.libdir, "streampos.so")
        # Unlinked first: never overwrite a library a process has mapped.
        os.unlink(target)
        shutil.copy(self.paths[name], target)
        self.pg_ctl("-l", os.path.join(self.args.pgdata, "server.log"), "-w", "-t", "60", "start")


STATS_CELLS = [("writers", 1, 1), ("writers", 8, 1), ("writers", 32, 4), ("frontier() readers", 8, 4)]


def stats_cells(bench, args):
    """streampos with and without the statistics' counters, interleaved
    round by round; returns rows (cell, TPS with, TPS without, ratios)."""
    libs = Libraries(args, bench)
    writer = bench.script("streampos", WRITER_SHAPES["streampos"])
    reader = bench.script("frontier()", READER_SHAPES["frontier()"])
    tps = {(cell, lib): [] for cell in STATS_CELLS for lib in ("with", "without")}
    try:
        for round_ in range(args.rounds):
            for lib in rotated(("with", "without"), round_):
                libs.use(lib)
                for cell in STATS_CELLS:
                    kind, clients, writers = cell
                    bench.reset()
                    if kind == "writers":
                        t, _ = bench.pgbench(writer, clients, args.seconds, writers)
                    else:
                        (t, _), _ = bench.with_load(writer, 8, writers, reader, clients, args.seconds)
                    tps[(cell, lib)].append(t)
            print(f"  statistics, round {round_ + 1}: " + ", ".join(
                f"{c[0]} {c[1]}x{c[2]} {tps[(c, 'with')][-1]:.0f}/{tps[(c, 'without')][-1]:.0f}"
                for c in STATS_CELLS), flush=True)
    finally:
        libs.use("with")
    return [
        (cell, statistics.median(tps[(cell, "with")]), statistics.median(tps[(cell, "without")]),
         [w / wo for w, wo in zip(tps[(cell, "with")], tps[(cell, "without")])])
        for cell in STATS_CELLS
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dbname", default="streampos_bench")
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hold", type=int, default=30, help="old snapshot: seconds held open, at least")
    ap.add_argument("--prefill", type=int, default=8, help="old snapshot: seconds of writers alone first")
    ap.add_argument("--pgbench", default="/usr/lib/postgresql/15/bin/pgbench")
    ap.add_argument("--part", choices=["writers", "readers", "old-snapshot", "many-streams", "stats"],
                    required=True)
    ap.add_argument("--compare", help="--part stats: streampos.so built without statistics")
    ap.add_argument("--pg-bin", help="--part stats: the server's bin directory (pg_ctl, pg_config)")
    ap.add_argument("--pgdata", help="--part stats: the server's data directory (restarted)")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    bench = Bench(args)
    bench.setup()
    with open(args.out, "a") as out:
        if args.part == "writers":
            rows = bench.writer_cells()
            out.write("### Writers (TPS, median of interleaved rounds)\n\n")
            out.write("| clients | writers | sync commit | shape | TPS | mean latency ms | ratio to floor (range) |\n")
            out.write("|---|---|---|---|---|---|---|\n")
            for c, w, s, name, tps, lat, ratios in rows:
                out.write(f"| {c} | {w} | {s} | {name} | {tps:.0f} | {lat:.2f} | {fmt_ratio(ratios)} |\n")
            out.write("\n")
        elif args.part == "readers":
            rows = bench.reader_cells(args.label)
            out.write(f"### Readers, 8 clients, under 8 streampos writer clients ({args.label})\n\n")
            out.write("| max_connections | shape | TPS | mean latency ms | ratio to SELECT 1 (range) |\n")
            out.write("|---|---|---|---|---|\n")
            for label, name, tps, lat, ratios in rows:
                out.write(f"| {label} | {name} | {tps:.0f} | {lat:.3f} | {fmt_ratio(ratios)} |\n")
            out.write("\n")
        elif args.part == "old-snapshot":
            rows, checks = bench.old_snapshot_cell()
            out.write("### Old snapshot: 4 writer + 4 reader clients, without and with one open REPEATABLE READ transaction\n\n")
            out.write(f"The old transaction takes its snapshot first, then {args.prefill} s of writers alone, "
                      f"then the reader shapes; held at least {args.hold} s.\n\n")
            out.write("| old snapshot | reader shape | reader TPS | readers / SELECT 1 (range) | writer TPS | writers / without (range) |\n")
            out.write("|---|---|---|---|---|---|\n")
            for cond, name, rtps, rratios, wtps, wratios in rows:
                out.write(f"| {cond} | {name} | {rtps:.0f} | {fmt_ratio(rratios)} | {wtps:.0f} | {fmt_ratio(wratios)} |\n")
            out.write("\n")
            out.write("The old snapshot's first frontier() after the run, and its rows at or below it:\n\n")
            out.write("| held s | commits after its snapshot | its frontier | highest ID it sees | its rows ≤ frontier | rows ≤ frontier now | correct |\n")
            out.write("|---|---|---|---|---|---|---|\n")
            for c in checks:
                out.write(f"| {c['held_s']:.0f} | {c['commits_during']} | {c['frontier']} | {c['exact']} | "
                          f"{c['rows_old']} | {c['rows_now']} | {'yes' if c['correct'] else '**no**'} |\n")
            out.write("\n")
            if not all(c["correct"] for c in checks):
                sys.exit("old snapshot: a frontier past a row the snapshot does not see")
        elif args.part == "stats":
            rows = stats_cells(bench, args)
            out.write("### With and without statistics (TPS, median of interleaved rounds)\n\n")
            out.write("streampos built with the cargo feature `stats` (the default) and without it, "
                      "the server restarted with one then the other in each round.\n\n")
            out.write("| shape | clients | writers | TPS with | TPS without | with / without (range) |\n")
            out.write("|---|---|---|---|---|---|\n")
            for (kind, clients, writers), w, wo, ratios in rows:
                out.write(f"| {kind} | {clients} | {writers} | {w:.0f} | {wo:.0f} | {fmt_ratio(ratios)} |\n")
            out.write("\n")
        else:
            rows = bench.many_streams_cell()
            out.write(f"### Many streams: {N_STREAMS} clients, each the only writer of its own stream\n\n")
            out.write("| shape | TPS | mean latency ms | ratio to floor (range) |\n")
            out.write("|---|---|---|---|\n")
            for name, tps, lat, ratios in rows:
                out.write(f"| {name} | {tps:.0f} | {lat:.2f} | {fmt_ratio(ratios)} |\n")
            out.write("\n")


if __name__ == "__main__":
    main()
