#!/usr/bin/env python3
"""Where a waiting follower's instructions go, per commit: the inclusive
cost of the pieces of an `updates_json` long-poll follower's window and of
a `wait_for` follower's, from the callgrind files bench/commit_wakeup.py
keeps (`--dir`).

    .venv/bin/python bench/commit_wakeup.py --pg-bin <bin> --followers 8 \\
        --mechanisms updates_json,wait_for --rounds 1 --dir /tmp/cw
    .venv/bin/python bench/follower_profile.py --dir /tmp/cw --commits 10 \\
        --out bench/results/follower_profile.md

Each figure is the median over the followers of (inclusive instructions of
the function in the follower's window) / commits. The window is the
follower's whole work per commit (woken, answering, its client's next call
until it sleeps again); the per-backend statistics flush is in it here.
"""

import argparse
import glob
import os
import re
import statistics
import subprocess

# (label, function as callgrind_annotate names it)
PIECES = [
    ("the whole window", "PostgresMain"),
    ("the statement around the call: bind, executor start and end, commit", None),
    ("the call (`updates_json`)", "updates_json_wrapper"),
    ("the call (`wait_for`)", "wait_for_wrapper"),
    ("its wait: the stream's condition variable", "streampos::registry::wait::wait_for_change"),
    ("the token for the latest snapshot, twice (before and after the wait)", "streampos::api::follow::token_now"),
    ("the privilege check at the call's start", "streampos::sql::followers::check_may_follow"),
    ("the rows' read (index read: relation, index, scan)", "streampos::sql::followers::update_rows"),
    ("the answer's JSON text", "streampos::sql::followers::updates_answer"),
]


def inclusive(path):
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", path],
                         capture_output=True, text=True, check=True).stdout
    costs = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) \([\s\d.]+%\)\s+\S*?:(.+?) \[", line)
        if m:
            costs.setdefault(m.group(2), int(m.group(1).replace(",", "")))
    return costs


def windows(root, mechanism):
    found = []
    for path in sorted(glob.glob(os.path.join(root, "cg", "cg.*.*"))):
        with open(path, errors="replace") as f:
            head = f.read(4096)
        if re.search(rf"Trigger: Client Request: follower r\d+ {mechanism} \d+ \d+", head):
            found.append(path)
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="commit_wakeup.py's kept directory")
    p.add_argument("--commits", type=int, default=10)
    p.add_argument("--out")
    args = p.parse_args()
    per = {}
    for mechanism in ("updates_json", "wait_for"):
        files = windows(args.dir, mechanism)
        if not files:
            raise SystemExit(f"no follower window of {mechanism} in {args.dir}")
        costs = [inclusive(f) for f in files]
        row = {}
        for label, function in PIECES:
            if function is None:
                continue
            values = [c.get(function, 0) / args.commits for c in costs]
            row[label] = statistics.median(values)
        call = row.get("the call (`updates_json`)") or row.get("the call (`wait_for`)")
        row["the statement around the call: bind, executor start and end, commit"] = \
            row["the whole window"] - call
        per[mechanism] = (row, len(files))
    lines = ["# Where a waiting follower's instructions go, per commit", "",
             "From the callgrind windows of bench/commit_wakeup.py (one round, "
             f"{per['updates_json'][1]} `updates_json` and {per['wait_for'][1]} `wait_for` followers, "
             f"{args.commits} commits), by bench/follower_profile.py: each figure is the median over the "
             "followers of a function's inclusive instructions in the window, per commit (the window "
             "includes the per-backend statistics flush here).", "",
             "| piece | `updates_json` follower | `wait_for` follower |", "|---|---|---|"]
    for label, _ in PIECES:
        a = per["updates_json"][0].get(label)
        b = per["wait_for"][0].get(label)
        cell = lambda v: "–" if not v else f"{v:,.0f}"
        lines.append(f"| {label} | {cell(a)} | {cell(b)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
