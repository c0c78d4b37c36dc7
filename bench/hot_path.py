#!/usr/bin/env python3
"""The path a warm `next_id` call takes through the code, file by file.

Runs `postgres --single` (one process, nothing else between statements)
under gdb with a breakpoint on every function of the extension's crates
(`rbreak ^streampos`: this crate and streampos-core), armed only for the
traced statement: the same `SELECT streampos.next_id('s', 'w1')` as the
two before it, so the stream, its sequence, the writer's instance and the
session's caches are loaded, after a pause of 1.1 s (so that the call
takes the branch of its once-a-second check, which also prunes) (the cold path: first use, load, repair, history
are not traced). Each statement is a transaction of its own (autocommit):
its commit's callbacks are part of the trace.

Every function entry is classified by the file of its code against the
files of the extension's frames below it on the stack:

  stays     the caller's own file;
  descends  a file not entered before in this call;
  returns   a file entered before in this call and left since (it is not on
            the stack): the path comes back to a file it left; "returns to a
            helper" when that file calls no other file in the trace
            (error.rs, fast_hash.rs, the registry's accessors);
  passed down
            a closure of a frame below, run by the function it was passed to
            (`with_index(meta, |index| …)`);
  climbs    any other call into a file on the stack below the caller: a
            call up, a circle at run time;
  from PostgreSQL
            no frame of the extension below it (the function-call wrapper,
            a transaction callback, a hook).

Build the extension without optimisation (a debug build: nothing inlined,
every call is seen), install it into the PostgreSQL of --pg-bin, then:

    .venv/bin/python bench/hot_path.py --pg-bin <bin> [--out FILE]

Writes the trace and the counts (markdown) to --out or stdout.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import callgrind as cg  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STATEMENT = "SELECT streampos.next_id('s', 'w1');"
SETUP = [
    "CREATE EXTENSION streampos;",
    "SELECT streampos.create_stream('s');",
]
# Two warm-up runs of the statement, a pause past the allocation path's
# once-a-second check (so the traced call always takes that branch, the
# costlier one), then the traced statement: the fourth parsed after
# start-up (pg_parse_query, which a stripped server binary exports too).
WARM_UP = [STATEMENT, STATEMENT, "SELECT pg_sleep(1.1);"]
TRACED_QUERY = len(WARM_UP) + 1

GDB_SCRIPT = r'''
import gdb, json

calls = {"n": 0}

def stack_of(frame):
    """(file, function) of the frames of the extension's own source files,
    from `frame` outward: the files the build names relative to the
    workspace (`src/…`, `core/src/…`), wherever it was built; other crates'
    and the standard library's are absolute."""
    out = []
    while frame is not None:
        sal = frame.find_sal()
        path = sal.symtab.filename if sal.symtab else ""
        if path.startswith(SOURCES):
            out.append((path, frame.name() or "?"))
        frame = frame.older()
    return out

class Query(gdb.Breakpoint):
    """Stops at the traced statement and at the one after it."""
    def stop(self):
        calls["n"] += 1
        return calls["n"] in (TRACED, TRACED + 1)

gdb.execute("set pagination off")
gdb.execute("set breakpoint pending on")
gdb.execute("set confirm off")
Query("pg_parse_query", internal=True)
# A breakpoint on every function of the extension's crates, set before the
# run (pending until the library loads) and disabled: enabled only at the
# traced statement. (Set while stopped there, they were sometimes not hit.)
entries = []
for symbol in open(SYMBOLS).read().split():
    try:
        bp = gdb.Breakpoint("'" + symbol + "'", internal=True)
        bp.enabled = False
        entries.append(bp)
    except gdb.error:
        pass
gdb.execute("run " + ARGS + " < " + INPUT + " > " + INPUT + ".out 2>&1")
if calls["n"] != TRACED:
    raise gdb.GdbError("not stopped at the traced statement")
for bp in entries:
    bp.enabled = True
events = []
while True:
    gdb.execute("continue", to_string=True)
    frame = gdb.newest_frame()
    if frame.name() == "pg_parse_query":
        break
    stack = stack_of(frame)
    # A function of another crate instantiated with the extension's types
    # (a Vec's drop, say) is not the extension's code.
    if stack and stack[0][1] == frame.name():
        events.append(stack)
# Written only for a whole trace: from the traced statement to the next.
if calls["n"] != TRACED + 1:
    raise gdb.GdbError(f"the trace did not end at the next statement ({calls['n']})")
with open(OUT, "w") as f:
    json.dump(events, f)
gdb.execute("kill")
'''


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pg-bin", required=True)
    p.add_argument("--out")
    args = p.parse_args()
    report = summarise(trace(args.pg_bin), describe_build(args.pg_bin))
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    else:
        sys.stdout.write(report)


def trace(pg_bin):
    """The traced statement's function entries: for each, the stack of the
    extension's frames (file, function), innermost first."""
    root = tempfile.mkdtemp(prefix="streampos-hot-path-")
    try:
        os.chmod(root, 0o777)
        data = os.path.join(root, "data")
        os.makedirs(data)
        if os.geteuid() == 0:
            shutil.chown(data, "postgres", "postgres")
        subprocess.run(cg.as_postgres([os.path.join(pg_bin, "initdb"), "-D", data, "-A", "trust",
                                       "-U", "postgres"]), check=True, capture_output=True)
        with open(os.path.join(data, "postgresql.conf"), "a") as f:
            f.write("shared_preload_libraries = 'streampos'\nfsync = off\n")
        cg.single_user(pg_bin, data, SETUP)

        input_path = os.path.join(root, "input.sql")
        with open(input_path, "w") as f:
            f.write("\n".join(WARM_UP + [STATEMENT, STATEMENT]) + "\n")
        trace_path = os.path.join(root, "trace.json")
        # Every function of the library whose symbol names the extension's
        # crates (their own functions, closures, trait implementations and
        # generic instantiations; the trace keeps the ones in its sources).
        library = os.path.join(cg.pkglibdir(pg_bin), "streampos.so")
        nm = subprocess.run(["nm", library], check=True, capture_output=True, text=True).stdout
        symbols = sorted({parts[2] for parts in (line.split() for line in nm.splitlines())
                          if len(parts) == 3 and parts[1] in "tT" and "streampos" in parts[2]})
        symbols_path = os.path.join(root, "symbols.txt")
        with open(symbols_path, "w") as f:
            f.write("\n".join(symbols) + "\n")
        script = os.path.join(root, "trace.py")
        with open(script, "w") as f:
            f.write(f"TRACED = {TRACED_QUERY}\nOUT = {trace_path!r}\nINPUT = {input_path!r}\n"
                    f"ARGS = {('--single -D ' + data + ' postgres')!r}\nSYMBOLS = {symbols_path!r}\n"
                    "SOURCES = ('src/', 'core/src/')\n")
            f.write(GDB_SCRIPT)
        os.chmod(root, 0o777)
        for path in (input_path, script, symbols_path):
            os.chmod(path, 0o644)
        cmd = ["gdb", "-nx", "-batch", "-x", script, os.path.join(pg_bin, "postgres")]
        out = subprocess.run(cg.as_postgres(cmd), capture_output=True, text=True)
        if not os.path.exists(trace_path):
            backend = open(input_path + ".out").read() if os.path.exists(input_path + ".out") else ""
            raise RuntimeError(f"no trace written:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}\n"
                               f"{backend[-3000:]}")
        with open(trace_path) as f:
            events = json.load(f)
        return events
    finally:
        shutil.rmtree(root, ignore_errors=True)


def short(path):
    return path


# The cold path: a warm call never enters these.
COLD_PATH = ("src/sql/", "src/engine/load.rs")


def classify(events):
    """Each entry as (depth, function, caller file, callee file, kind); see
    the module comment. A file that calls no other file of the extension
    in the trace is a helper (error.rs, fast_hash.rs, the registry's
    accessors): entering it again is counted apart from the returns."""
    rows, entered = [], set()
    for stack in events:
        files = [short(f) for f, _ in stack]
        callee, name, below = files[0], stack[0][1], files[1:]
        if not below:
            kind = "from PostgreSQL"
        elif below[0] == callee:
            kind = "stays"
        elif callee in below and "{closure" in name:
            # A closure a frame below passed down (`with_index(meta, |index| …)`),
            # run by the function it was passed to.
            kind = "passed down"
        elif callee in below:
            kind = "climbs"
        elif callee in entered:
            kind = "returns"
        else:
            kind = "descends"
        entered.add(callee)
        rows.append((len(below), name, below[0] if below else "PostgreSQL", callee, kind))
    callers = {caller for _, _, caller, callee, _ in rows if caller != callee}
    return [(d, n, a, b, "returns to a helper" if k == "returns" and b not in callers else k)
            for d, n, a, b, k in rows]


KINDS = ["stays", "descends", "returns", "returns to a helper", "passed down", "climbs", "from PostgreSQL"]


def counts(rows):
    c = {k: 0 for k in KINDS}
    for row in rows:
        c[row[4]] += 1
    return c


def cold_path_entries(rows):
    return [r for r in rows if r[3].startswith(COLD_PATH)]


def describe_build(pg_bin):
    """Which source and server the trace is of (the library is assumed to
    be built from the working tree)."""
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "src", "core"],
                           capture_output=True, text=True).stdout.strip()
    version = subprocess.run([os.path.join(pg_bin, "pg_config"), "--version"],
                             capture_output=True, text=True).stdout.strip()
    return f"commit {commit}{' with changes to src/' if dirty else ''}, {version}"


def summarise(events, build="the working tree"):
    rows = classify(events)
    c = counts(rows)
    files = sorted({r[3] for r in rows})
    out = ["# next_id's warm path, file by file", "",
           f"`{STATEMENT}` (autocommit, after the same statement twice and a 1.1 s pause, in one "
           "session of `postgres --single`: its commit's callbacks included), traced by bench/hot_path.py under gdb in a debug build "
           f"(nothing inlined) of {build}. Kinds: see bench/hot_path.py. Command:", "",
           "    .venv/bin/python bench/hot_path.py --pg-bin <PostgreSQL bin> --out bench/results/hot_path.md", "",
           "| " + " | ".join(KINDS) + " | files | cold-path entries |", "|" + "---|" * (len(KINDS) + 2),
           "| " + " | ".join(str(c[k]) for k in KINDS) + f" | {len(files)} | {len(cold_path_entries(rows))} |", "",
           "Files entered: " + ", ".join(f"`{f}`" for f in files) + ".", "",
           "Entries other than stays and helpers:", "",
           "| depth | function | file → file | |", "|---|---|---|---|"]
    out += [f"| {d} | `{n}` | {a} → {b} | {k} |" for d, n, a, b, k in rows
            if k not in ("stays", "returns to a helper")]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
