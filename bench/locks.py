#!/usr/bin/env python3
"""Registry lock hold times under load, from a build with the cargo feature
`lock-stats` (run by scripts/bench-locks, which builds it).

For each cell, streampos.lock_stats() is read before and after a pgbench
run; the difference gives, per lock section, acquisitions per second, the
mean time waiting for the lock and the mean time holding it (ns), and the
share of the run's wall time the lock was held in that section. These are
the inputs of the model in docs/performance.md.

Cells (pgbench -M prepared):
  writers 32x1 off   32 clients of next_id + INSERT on one writer, synchronous_commit off (CPU-bound)
  writers 8x4 on     8 clients on 4 writers, synchronous_commit on
  readers + writers  8 clients of frontier() while 8 writer clients run
  token readers      8 clients of current_room_token() while 8 writer clients run
"""
import argparse
import os
import sys
import time

import psycopg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model  # noqa: E402
from run import READER_SHAPES, WRITER_SHAPES, Bench  # noqa: E402

# A reader's hold of the lock when readers took it shared (before reads
# became lock-free copies): measured with that build, 8 frontier() readers
# and 8 writers, max_connections 100 (docs/performance.md). Only the model
# of the shared-lock read path uses it.
SHARED_VIEW_NS = 650


def stats(conninfo):
    with psycopg.connect(**conninfo, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT section, mode, acquisitions, wait_ns, hold_ns, fallbacks, slots_visited "
            "FROM streampos.lock_stats()"
        ).fetchall()
    return {r[0]: r for r in rows}


def measure(bench, label, run):
    before = stats(bench.conninfo)
    started = time.monotonic()
    tps = run()
    wall = time.monotonic() - started
    after = stats(bench.conninfo)
    rows = []
    for section, a in after.items():
        b = before[section]
        n = a[2] - b[2]
        if n == 0:
            continue
        wait, hold = a[3] - b[3], a[4] - b[4]
        fallbacks, slots = a[5] - b[5], a[6] - b[6]
        rows.append((label, section, a[1], n / wall, wait / n, hold / n, hold / (wall * 1e9),
                     fallbacks / wall, slots / n))
    print(f"  {label}: {tps}", flush=True)
    return rows, tps, wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dbname", default="streampos_bench")
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--label", default="")
    ap.add_argument("--pgbench", default="/usr/lib/postgresql/15/bin/pgbench")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", action="store_true", help="append the projection of bench/model.py")
    args = ap.parse_args()
    args.rounds = 1
    bench = Bench(args)
    bench.setup()
    writer = bench.script("streampos", WRITER_SHAPES["streampos"])
    s = args.seconds
    cells = [
        ("writers 32x1, sync off", lambda: bench.pgbench(writer, 32, s, 1, sync=False)[0]),
        ("writers 8x4, sync on", lambda: bench.pgbench(writer, 8, s, 4, sync=True)[0]),
    ]
    for name in ("frontier()", "current_room_token()"):
        script = bench.script(name, READER_SHAPES[name])
        cells.append((
            f"8 {name} readers + 8 writers",
            lambda script=script: "readers {:.0f}, writers {:.0f}".format(
                *(x[0] for x in bench.with_load(writer, 8, 4, script, 8, s))
            ),
        ))
    rows = []
    results = []
    mixed = None
    for label, run in cells:
        bench.reset()
        r, tps, wall = measure(bench, label, run)
        rows += r
        results.append((label, tps))
        if mixed is None and "frontier()" in label:
            mixed = {row[1]: row for row in r}
    with open(args.out, "a") as out:
        out.write(f"### Registry lock sections ({args.label})\n\n")
        for label, tps in results:
            out.write(f"- {label}: {tps if isinstance(tps, str) else f'{tps:.0f}'} TPS\n")
        out.write("\nLock-free copies: \"mean hold\" is the copy's time (tries included), \"mean wait\" the time "
                  "spent by copies that gave up before taking the lock shared (counted under view).\n")
        out.write("\n| cell | section | mode | per second | mean wait ns | mean hold ns | lock held (share of wall time) "
                  "| fallbacks per second | active slots per copy |\n")
        out.write("|---|---|---|---|---|---|---|---|---|\n")
        for label, section, mode, rate, wait, hold, share, fallbacks, slots in rows:
            extra = f"{fallbacks:.1f} | {slots:.2f}" if mode == "none" else " | "
            out.write(f"| {label} | {section} | {mode} | {rate:.0f} | {wait:.0f} | {hold:.0f} | {share:.3f} | {extra} |\n")
        out.write("\n")
        if mixed and "view (lock-free copy)" in mixed and args.model:
            t = dict(
                begin=mixed["begin_allocation"][5],
                finish=mixed["finish_allocation"][5],
                end=mixed["end_transaction"][5],
                copy=mixed["view (lock-free copy)"][5],
                slots=mixed["view (lock-free copy)"][8],
                view=SHARED_VIEW_NS,
            )
            writers = mixed["begin_allocation"][3]
            readers = mixed["view (lock-free copy)"][3]
            t["alloc_measured"] = writers
            out.write("#### Projection (bench/model.py, docs/performance.md), from the cell \"8 frontier() readers + 8 writers\"\n\n")
            out.write(f"Inputs: begin {t['begin']:.0f} ns, finish {t['finish']:.0f} ns, commit {t['end']:.0f} ns, "
                      f"lock-free copy {t['copy']:.0f} ns visiting {t['slots']:.2f} active slots, "
                      f"shared-lock view {t['view']:.0f} ns; per core {writers / 2:.0f} allocations/s and "
                      f"{readers / 2:.0f} reads/s (2 cores, pgbench on the same cores).\n\n")
            out.write(model.table(t, writers / 2, readers / 2))
            out.write("\n")


if __name__ == "__main__":
    main()
