#!/usr/bin/env python3
"""A follower's calls in instructions, each against the statement it
replaces, measured in the same run (issue 32's cells).

Single-user backends under callgrind, as bench/callgrind.py measures
(its helpers: a fresh copy of a template cluster per measurement, the
cost of one call = (instructions with N calls − with 0) / N, each call a
transaction of its own, prepared once). The template holds a stream with
one table of 20 000 rows (a table big enough that its plans are the ones
a homeserver gets) written by one writer, and a second stream whose
three writers stand at different positions (the general statement, which
compares each row's writer).

  updates, k rows      streampos.updates(stream, since, 100, 0) with k rows
                       after since (k = 0: a caught-up follower)
  hand-written, k rows SELECT id, instance_name, payload FROM t WHERE
                       id > since AND id <= streampos.frontier(stream)
                       ORDER BY id LIMIT 100 (what a follower writes itself)
  ack                  streampos.ack(stream, consumer, token) of a registered
                       consumer
  Synapse's UPDATE     UPDATE stream_positions SET stream_id = … WHERE
                       stream_name = … AND instance_name = … (its position
                       table, primary key on both)

Goals (issue 32): updates ≤ 1.25× its hand-written query; ack ≤ 1.3×
Synapse's UPDATE.

Usage: bench/follow_calls.py --pg-bin DIR [--n 200] [--out FILE]
"""
import argparse
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import callgrind as cg  # noqa: E402

ROWS = 20_000
SETUP = [
    "CREATE EXTENSION streampos;",
    "SELECT streampos.create_stream('f');",
    "CREATE TABLE ft (id bigint PRIMARY KEY, instance_name text, payload text);",
    "SELECT streampos.add_table('f', 'ft', 'id', 'instance_name');",
    "SELECT streampos.create_stream('g', writers => ARRAY['w1', 'w2', 'w3']);",
    "CREATE TABLE gt (id bigint PRIMARY KEY, instance_name text, payload text);",
    "SELECT streampos.add_table('g', 'gt', 'id', 'instance_name');",
    "CREATE TABLE stream_positions (stream_name text, instance_name text, stream_id bigint, "
    "PRIMARY KEY (stream_name, instance_name));",
    "INSERT INTO stream_positions VALUES ('f', 'c1', 0);",
    # One transaction per row, as writers commit them.
    "CREATE PROCEDURE fill(s text, t regclass, w text, n int) LANGUAGE plpgsql AS $$ BEGIN "
    "FOR i IN 1..n LOOP EXECUTE format('INSERT INTO %s VALUES (streampos.next_id(%L, %L), %L, "
    "repeat(''x'', 100))', t, s, w, w); COMMIT; END LOOP; END $$;",
    f"CALL fill('f', 'ft', 'w', {ROWS});",
    f"CALL fill('g', 'gt', 'w1', {ROWS // 2});",
    "CALL fill('g', 'gt', 'w2', 10);",
    "CALL fill('g', 'gt', 'w3', 5);",
    "SELECT streampos.register_consumer('f', 'c1');",
]
WARM_UP = ["SELECT streampos.frontier('f');", "SELECT streampos.frontier('g');"]


def token(position):
    return f"'{position}'::streampos.multi_writer_token"


def hand(stream, table, since):
    return (f"SELECT id, instance_name, payload FROM {table} WHERE id > {since} "
            f"AND id <= streampos.frontier('{stream}') ORDER BY id LIMIT 100")


# (cell, shape statement, baseline statement, goal)
CELLS = [
    (f"updates, {k} rows", f"SELECT streampos.updates('f', {token(ROWS - k)}, 100, 0)",
     hand("f", "ft", ROWS - k), 1.25)
    for k in (0, 1, 3, 100)
]
CELLS.append((
    "ack",
    f"SELECT streampos.ack('f', 'c1', {token(ROWS)})",
    f"UPDATE stream_positions SET stream_id = {ROWS} WHERE stream_name = 'f' AND instance_name = 'c1'",
    1.3,
))


def general_cell(args, template):
    """updates on the three-writer stream from a token whose writers stand
    apart (w1 and w2 at the top, w3 five IDs back: its five rows to
    return), the general statement, against the hand-written query."""
    out = cg.single_user(args.pg_bin, template, [
        "SELECT pg_catalog.string_agg(i.instance_name || '=' || i.instance_id, ',' ORDER BY i.instance_id) "
        "AS ids FROM streampos.instances i;",
        "SELECT streampos.max_allocated('g') AS top;",
    ])
    ids = dict(x.split("=") for x in re.search(r'ids = "([^"]+)"', out).group(1).split(","))
    top = int(re.search(r'top = "(\d+)"', out).group(1))
    entries = sorted((int(ids[w]), top) for w in ("w1", "w2"))
    since = f"m{top - 5}" + "".join(f"~{i}.{pos}" for i, pos in entries)
    return ("updates, 5 rows, three writers apart",
            f"SELECT streampos.updates('g', {token(since)}, 100, 0)",
            hand("g", "gt", top - 5), 1.25)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pg-bin", required=True)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--out")
    args = p.parse_args()
    cg.SETUP[:] = SETUP
    cg.WARM_UP[:] = WARM_UP
    root = tempfile.mkdtemp(prefix="streampos-follow-calls-")
    os.chmod(root, 0o777)
    template = cg.make_template(args.pg_bin, root, "follow", dict(conf=[]))
    cells = CELLS + [general_cell(args, template)]

    def per_call(label, statement):
        base = cg.instructions(args.pg_bin, root, template, [], statement, 0, label)
        return (cg.instructions(args.pg_bin, root, template, [], statement, args.n, label) - base) / args.n

    lines = [
        "### A follower's calls (callgrind, single-user mode)",
        "",
        f"Instructions per call, (N = {args.n} calls − 0) / N, each call a transaction of its own, "
        f"prepared once; a table of {ROWS:,} rows. Command: bench/follow_calls.py",
        "",
        "| cell | streampos | baseline | baseline instructions | ratio | goal |",
        "|---|---|---|---|---|---|",
    ]
    for cell, shape, baseline, goal in cells:
        s = per_call(f"{cell} shape", shape)
        b = per_call(f"{cell} baseline", baseline)
        kind = "Synapse's UPDATE" if cell == "ack" else "hand-written query"
        verdict = "met" if s / b <= goal else "**not met**"
        line = f"| {cell} | {s:,.0f} | {kind} | {b:,.0f} | {s / b:.3f} | ≤ {goal}: {verdict} |"
        lines.append(line)
        print(line, flush=True)
    lines.append("")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
