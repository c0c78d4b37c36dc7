#!/usr/bin/env python3
"""Noise-free cost: instructions per transaction, counted by callgrind.

Each measurement is one run of `postgres --single` (single-user mode: one
process, no other backend, no background worker, so nothing else runs
between the statements) under `valgrind --tool=callgrind`, on a fresh copy of
a template cluster, reading from stdin:

    <preamble of the variant>
    PREPARE p AS <statement>;
    EXECUTE p;            -- warm-up: caches, first-use loading
    EXECUTE p;            -- N times
    ...

Each EXECUTE is a transaction of its own (autocommit), so it includes the
commit. The cost of one transaction is (instructions with N − instructions
with 0) / N: start-up, the preamble, the warm-up and shut-down cancel out.
Several N show that it is linear (the per-transaction figures agree).

Every run, the floor's and SELECT 1's too, starts with one frontier() call:
a backend that uses streampos has read its catalog once (through SPI, which
leaves PostgreSQL's per-backend lock table larger, and every commit scans
that table), so the baselines run in the same kind of backend.

Statements (like pgbench -M prepared, planned once):
  floor       INSERT … SELECT nextval(seq), 'w1', payload
  streampos   INSERT … SELECT streampos.next_id('bench', 'w1'), 'w1', payload
  SELECT 1 / frontier() / current_room_token()

Variants:
  quiet   nothing else in the registry
  pinned  a prepared transaction holds an xid, so nothing committed after it
          can be pruned (like a long-running transaction anywhere); the
          preamble commits 1.5 × the ring's capacity (set to 1024 here) of
          allocations first, so the ring is full and every commit folds its
          oldest entry.
  max_connections = 1000
          reads only: the registry has a backend slot per connection, and a
          reader's work must not grow with them.

With statistics and without (--compare PATH): the extension is built with
the cargo feature `stats` (the counters of the writers' and readers' paths)
and, for this comparison, without it (PATH: that build's streampos.so). The
variants of --compare-variants are measured with each library in turn
(swapped into the server's library directory between runs: single-user
backends load it afresh), side by side, and the installed one is put back.

Usage: bench/callgrind.py --pg-bin DIR [--n 200,400,800] [--out FILE]
                          [--compare PATH [--compare-variants quiet,pinned]]
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PAYLOAD = "repeat('x', 200)"
SHAPES = {
    "floor": f"INSERT INTO b_floor SELECT nextval('b_floor_seq'), 'w1', {PAYLOAD}",
    "streampos": f"INSERT INTO b_sp SELECT streampos.next_id('bench', 'w1'), 'w1', {PAYLOAD}",
    "SELECT 1": "SELECT 1",
    "frontier()": "SELECT streampos.frontier('bench')",
    "current_room_token()": "SELECT streampos.current_room_token('bench')",
}
# (shape, baseline, goal: at most this ratio)
RATIOS = [
    ("streampos", "floor", 1.05),
    ("frontier()", "SELECT 1", 1.25),
    ("current_room_token()", "SELECT 1", 1.25),
]

SETUP = [
    "CREATE EXTENSION streampos;",
    "SELECT streampos.create_stream('bench');",
    "CREATE TABLE b_floor (id bigint, writer text, payload text);",
    "CREATE TABLE b_sp (id bigint, writer text, payload text);",
    "CREATE TABLE b_pin (x int);",
    "CREATE SEQUENCE b_floor_seq;",
    # One allocation per transaction (COMMIT inside a procedure).
    "CREATE PROCEDURE fill(n int) LANGUAGE plpgsql AS $$ BEGIN FOR i IN 1..n LOOP "
    "PERFORM streampos.next_id('bench', 'w1'); COMMIT; END LOOP; END $$;",
]

PINNED_RING = 1024
# A backend that used streampos: its catalog read once (see above).
WARM_UP = ["SELECT streampos.frontier('bench');"]
READS = ["SELECT 1", "frontier()", "current_room_token()"]
VARIANTS = {
    "quiet": dict(conf=[], preamble=[]),
    "pinned": dict(
        conf=[f"streampos.finished_ring_size = {PINNED_RING}"],
        # The prepared transaction survives in the template: every run
        # starts with its xid running.
        setup=["BEGIN;", "INSERT INTO b_pin VALUES (1);", "PREPARE TRANSACTION 'pin';"],
        preamble=[f"CALL fill({PINNED_RING * 3 // 2});"],
    ),
    "max_connections = 1000": dict(conf=["max_connections = 1000"], preamble=[], shapes=READS),
}


def as_postgres(cmd):
    return ["runuser", "-u", "postgres", "--"] + cmd if os.geteuid() == 0 else cmd


def single_user(pg_bin, data, lines, valgrind_out=None):
    """Run `lines` through a single-user backend; returns its output."""
    cmd = [os.path.join(pg_bin, "postgres"), "--single", "-D", data, "postgres"]
    if valgrind_out:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={valgrind_out}"] + cmd
    out = subprocess.run(as_postgres(cmd), input="\n".join(lines) + "\n", capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode != 0 or re.search(r"\b(ERROR|FATAL|PANIC|WARNING):", text):
        sys.exit(f"single-user run failed ({' '.join(cmd)}):\n{text[-3000:]}")
    return text


def make_template(pg_bin, root, name, variant):
    data = os.path.join(root, "template-" + re.sub(r"[^a-z0-9]+", "_", name))
    os.makedirs(data)
    if os.geteuid() == 0:
        shutil.chown(data, "postgres", "postgres")
    subprocess.run(as_postgres([os.path.join(pg_bin, "initdb"), "-D", data, "-A", "trust", "-U", "postgres"]),
                   check=True, capture_output=True)
    with open(os.path.join(data, "postgresql.conf"), "a") as f:
        f.write("shared_preload_libraries = 'streampos'\n")
        f.write("max_prepared_transactions = 2\n")
        # Instructions, not time: no need to wait for the disk.
        f.write("fsync = off\n")
        for line in variant["conf"]:
            f.write(line + "\n")
    single_user(pg_bin, data, SETUP + variant.get("setup", []))
    return data


def instructions(pg_bin, root, template, preamble, statement, n, label):
    data = os.path.join(root, "run")
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(template, data, symlinks=True)
    if os.geteuid() == 0:
        subprocess.run(["chown", "-R", "postgres:postgres", data], check=True)
    out_file = os.path.join(root, "callgrind.out")
    lines = WARM_UP + preamble + [f"PREPARE p AS {statement};", "EXECUTE p;"] + ["EXECUTE p;"] * n
    single_user(pg_bin, data, lines, valgrind_out=out_file)
    os.chmod(root, 0o777)
    with open(out_file) as f:
        total = int(re.search(r"^summary: (\d+)", f.read(), re.M).group(1))
    shutil.move(out_file, os.path.join(root, f"callgrind-{re.sub(r'[^a-z0-9]+', '_', label.lower())}-{n}.out"))
    return total


def function_costs(path):
    """Exclusive instructions per function of a callgrind file, by
    callgrind_annotate (`object:function` -> instructions)."""
    out = subprocess.run(["callgrind_annotate", "--threshold=100", path],
                         capture_output=True, text=True, check=True).stdout
    costs = {}
    for line in out.splitlines():
        m = re.match(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S.*?)\s*$", line)
        if not m or ":" not in m.group(2) or m.group(2).startswith("PROGRAM TOTALS"):
            continue
        name = m.group(2)
        obj = re.search(r"\[([^\]]+)\]$", name)
        function = re.sub(r"\s*\[[^\]]+\]$", "", name).split(":", 1)[-1]
        key = f"{os.path.basename(obj.group(1)) if obj else '?'}: {function}"
        costs[key] = costs.get(key, 0) + int(m.group(1).replace(",", ""))
    return costs


def profile(root, variant, shape, baseline, n, top=15):
    """Where a shape's extra instructions go: per function, (its cost with
    n transactions − with 0) / n, the shape's minus the baseline's."""
    def per_txn(s):
        label = re.sub(r"[^a-z0-9]+", "_", f"{variant} {s}".lower())
        with_n = function_costs(os.path.join(root, f"callgrind-{label}-{n}.out"))
        with_0 = function_costs(os.path.join(root, f"callgrind-{label}-0.out"))
        return {k: (with_n.get(k, 0) - with_0.get(k, 0)) / n for k in set(with_n) | set(with_0)}
    a, b = per_txn(shape), per_txn(baseline)
    diff = {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}
    by_object = {}
    for k, v in diff.items():
        obj = k.split(":", 1)[0]
        by_object[obj] = by_object.get(obj, 0) + v
    lines = [
        "",
        f"Where {shape} spends more than {baseline} ({variant}, N = {n}; callgrind_annotate, "
        "exclusive instructions per transaction, shape − baseline):",
        "",
        "| object | instructions per transaction |",
        "|---|---|",
    ]
    lines += [f"| {o} | {v:+,.0f} |" for o, v in sorted(by_object.items(), key=lambda kv: -abs(kv[1])) if abs(v) >= 5]
    lines += ["", f"| function (top {top}) | instructions per transaction |", "|---|---|"]
    lines += [f"| `{k}` | {v:+,.0f} |" for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]]
    lines += ["", "What each part is for, and what getting under the goal would take: docs/performance.md."]
    return lines


def pkglibdir(pg_bin):
    return subprocess.run([os.path.join(pg_bin, "pg_config"), "--pkglibdir"],
                          capture_output=True, text=True, check=True).stdout.strip()


def use_library(pg_bin, path):
    """Install the library at `path` as the server's streampos.so. Unlinked
    first: a running server that has the old one mapped keeps it."""
    target = os.path.join(pkglibdir(pg_bin), "streampos.so")
    if os.path.exists(target):
        os.unlink(target)
    shutil.copy(path, target)


def measure_variant(args, root, vname, counts, label_prefix=""):
    """Instructions per transaction of each shape of variant `vname`:
    {shape: [per N]}, printing a row per shape."""
    variant = VARIANTS[vname]
    template = make_template(args.pg_bin, root, label_prefix + vname, variant)
    per_txn = {}
    lines = []
    for shape, statement in SHAPES.items():
        if shape not in variant.get("shapes", SHAPES):
            continue
        label = f"{label_prefix}{vname} {shape}"
        base = instructions(args.pg_bin, root, template, variant["preamble"], statement, 0, label)
        per_txn[shape] = [
            (instructions(args.pg_bin, root, template, variant["preamble"], statement, n, label) - base) / n
            for n in counts
        ]
        line = f"| {vname} | {shape} | " + ", ".join(f"{x:,.0f}" for x in per_txn[shape]) + \
            f" | {statistics.median(per_txn[shape]):,.0f} |"
        lines.append(line)
        print(label_prefix + line, flush=True)
    return per_txn, lines


def compare(args, root, counts):
    """The variants of --compare-variants with the installed library (with
    statistics) and the one at --compare (without), side by side."""
    installed = os.path.join(root, "streampos-installed.so")
    shutil.copy(os.path.join(pkglibdir(args.pg_bin), "streampos.so"), installed)
    lines = [
        "",
        "#### With and without statistics",
        "",
        "The same statements with the extension built with the cargo feature `stats` (the default: "
        "what the writers' and readers' paths count) and without it, measured in this run "
        f"(N = {', '.join(map(str, counts))}; medians over N).",
        "",
        "| variant | statement | with statistics | without | with / without | difference |",
        "|---|---|---|---|---|---|",
    ]
    try:
        for vname in args.compare_variants.split(","):
            measured = {}
            for name, path in [("with", installed), ("without", args.compare)]:
                use_library(args.pg_bin, path)
                measured[name], _ = measure_variant(args, root, vname, counts, label_prefix=f"{name} ")
            for shape in measured["with"]:
                w = statistics.median(measured["with"][shape])
                wo = statistics.median(measured["without"][shape])
                lines.append(f"| {vname} | {shape} | {w:,.0f} | {wo:,.0f} | {w / wo:.4f} | {w - wo:+,.0f} |")
    finally:
        use_library(args.pg_bin, installed)
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pg-bin", required=True)
    ap.add_argument("--n", default="200,400,800", help="transaction counts (0 is always run)")
    ap.add_argument("--variants", default="quiet,pinned,max_connections = 1000")
    ap.add_argument("--keep", help="directory to keep the callgrind files in")
    ap.add_argument("--out")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the per-function profile of the ratios that miss their goal")
    ap.add_argument("--compare", help="streampos.so built without statistics, measured side by side")
    ap.add_argument("--compare-variants", default="quiet,pinned")
    args = ap.parse_args()
    counts = [int(x) for x in args.n.split(",")]
    started = time.monotonic()
    root = args.keep or tempfile.mkdtemp(prefix="streampos-callgrind-")
    os.makedirs(root, exist_ok=True)
    os.chmod(root, 0o777)
    lines = [
        "### Instructions per transaction (callgrind, single-user mode)",
        "",
        f"(instructions of N transactions − of 0) / N, N = {', '.join(map(str, counts))}, after one warm-up "
        "transaction; prepared statements, one transaction each. Command: bench/callgrind.py",
        "",
        "| variant | statement | instructions per transaction (N = " + ", ".join(map(str, counts)) + ") | median |",
        "|---|---|---|---|",
    ]
    ratio_lines = [
        "",
        "| variant | ratio | median (range over N) | goal |",
        "|---|---|---|---|",
    ]
    profile_lines = []
    for vname in args.variants.split(","):
        per_txn, shape_lines = measure_variant(args, root, vname, counts)
        lines += shape_lines
        for shape, baseline, goal in RATIOS:
            if shape not in per_txn:
                continue
            ratios = [a / b for a, b in zip(per_txn[shape], per_txn[baseline])]
            med = statistics.median(ratios)
            line = (f"| {vname} | {shape} / {baseline} | {med:.3f} ({min(ratios):.3f}–{max(ratios):.3f}) "
                    f"| ≤ {goal:.2f}: {'met' if max(ratios) <= goal else '**not met**'} |")
            ratio_lines.append(line)
            print(line, flush=True)
            # A goal missed: say where the instructions go (once, for the
            # first variant that misses it).
            if max(ratios) > goal and not args.no_profile and not any(
                f"Where {shape} spends" in x for x in profile_lines
            ):
                profile_lines += profile(root, vname, shape, baseline, max(counts))
    lines += ratio_lines + profile_lines
    if args.compare:
        lines += compare(args, root, counts)
    lines += ["", f"Run time: {time.monotonic() - started:.0f} s.", ""]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write(report + "\n")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
