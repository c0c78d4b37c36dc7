#!/usr/bin/env python3
"""A follower's calls in instructions, each against the statement it
replaces, measured in the same run (issue 32's cells).

A server under callgrind (`valgrind --tool=callgrind
--callgrind-out-file=…/cg.%p`: every backend writes its own counts when it
exits). Each measurement is one connection: it prepares the statement,
runs it once to warm up, then N times, each call a transaction of its own
whose answer is sent to the client as text, as a follower receives it;
the cost of one call = (its backend's instructions with N calls − with 0)
/ N. (Single-user mode, which bench/callgrind.py uses for statements that
answer one value, prints each column of each row with printf: it charged
a query returning 100 rows of three columns far more for its output than
the network protocol does, and `updates()`, one value, far less.)

The template holds a stream with one table of 20 000 rows (a table big
enough that its plans are the ones a homeserver gets) written by one
writer, and a second stream whose three writers stand at different
positions (the general statement, which compares each row's writer).

  updates, k rows      streampos.updates(stream, since, 100, 0) with k rows
                       after since (k = 0: a caught-up follower)
  updates_json, k rows the same as json (updates_json)
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

Usage: bench/follow_calls.py --pg-bin DIR [--n 200] [--port 54391] [--out FILE] [--only CELL] [--keep]
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

import psycopg

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
    # Every page all-visible from the start: no measurement pays for the
    # hint bits or gains from a vacuum that ran in the middle of the run.
    "VACUUM (FREEZE, ANALYZE);",
]
WARM_UP = ["SELECT streampos.frontier('f');", "SELECT streampos.frontier('g');"]


def token(position):
    return f"'{position}'::streampos.multi_writer_token"


def hand(stream, table, since):
    return (f"SELECT id, instance_name, payload FROM {table} WHERE id > {since} "
            f"AND id <= streampos.frontier('{stream}') ORDER BY id LIMIT 100")


# (cell, shape statement, baseline statement, goal)
CELLS = [
    (f"{function}, {k} rows", f"SELECT streampos.{function}('f', {token(ROWS - k)}, 100, 0)",
     hand("f", "ft", ROWS - k), 1.25)
    for function in ("updates", "updates_json") for k in (0, 1, 3, 100)
]
CELLS.append((
    "ack",
    f"SELECT streampos.ack('f', 'c1', {token(ROWS)})",
    f"UPDATE stream_positions SET stream_id = {ROWS} WHERE stream_name = 'f' AND instance_name = 'c1'",
    1.3,
))


class Server:
    """A copy of the template cluster, its postmaster under callgrind."""

    def __init__(self, pg_bin, root, template, port, keep=False):
        self.pg_bin, self.root, self.port = pg_bin, root, port
        self.keep, self.keep_label = keep, "warm-up"
        self.data = os.path.join(root, "server")
        self.counts = os.path.join(root, "counts")
        shutil.copytree(template, self.data, symlinks=True)
        os.makedirs(self.counts)
        if os.geteuid() == 0:
            subprocess.run(["chown", "-R", "postgres:postgres", self.data, self.counts], check=True)
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.counts}/cg.%p",
               os.path.join(pg_bin, "postgres"), "-D", self.data, "-p", str(port),
               "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=/tmp",
               "-c", "autovacuum=off"]
        self.log = open(os.path.join(root, "server.log"), "w")
        self.process = subprocess.Popen(cg.as_postgres(cmd), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while True:
            try:
                self.connect().close()
                break
            except psycopg.OperationalError:
                if time.time() > deadline or self.process.poll() is not None:
                    sys.exit(f"the server under callgrind did not start: {root}/server.log")
                time.sleep(1)
        # The first backends rebuild what the server's start left to build
        # (the relation cache's init file): not in any measurement.
        for _ in range(2):
            self.backend_instructions("SELECT 1", 0)

    def connect(self):
        return psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                               autocommit=True)

    def backend_instructions(self, statement, n):
        """One connection: the warm-up, PREPARE, one EXECUTE, then n; the
        instructions its backend counted."""
        with self.connect() as c:
            pid = c.execute("SELECT pg_backend_pid()").fetchone()[0]
            for line in WARM_UP:
                c.execute(line)
            c.execute(f"PREPARE p AS {statement}")
            for _ in range(n + 1):
                cur = c.execute("EXECUTE p", prepare=False)
                if cur.description:
                    cur.fetchall()
        path = os.path.join(self.counts, f"cg.{pid}")
        deadline = time.time() + 120
        while True:
            # Written when the backend exits.
            if os.path.exists(path):
                with open(path) as f:
                    found = re.search(r"^(?:summary|totals): (\d+)", f.read(), re.M)
                if found:
                    if self.keep:
                        os.rename(path, os.path.join(self.counts, f"{self.keep_label}-{n}-{pid}.out"))
                    else:
                        os.remove(path)
                    return int(found.group(1))
            if time.time() > deadline:
                sys.exit(f"no callgrind counts from backend {pid}")
            time.sleep(0.5)

    def per_call(self, statement, n, repeats=3):
        """The median of `repeats` measurements (a backend's count moves by
        a few thousand instructions a call between identical runs)."""
        return statistics.median(
            (self.backend_instructions(statement, n) - self.backend_instructions(statement, 0)) / n
            for _ in range(repeats))

    def stop(self):
        subprocess.run(cg.as_postgres([os.path.join(self.pg_bin, "pg_ctl"), "-D", self.data, "-m", "fast",
                                       "-w", "-t", "300", "stop"]), capture_output=True)
        self.process.wait(timeout=300)
        self.log.close()


def general_cells(server):
    """updates and updates_json on the three-writer stream from a token
    whose writers stand apart (w1 and w2 at the top, w3 five IDs back: its
    five rows to return), against the hand-written query."""
    with server.connect() as c:
        ids = dict(c.execute("SELECT instance_name, instance_id FROM streampos.instances").fetchall())
        top = c.execute("SELECT streampos.max_allocated('g')").fetchone()[0]
    entries = sorted((int(ids[w]), top) for w in ("w1", "w2"))
    since = f"m{top - 5}" + "".join(f"~{i}.{pos}" for i, pos in entries)
    return [(f"{function}, 5 rows, three writers apart",
             f"SELECT streampos.{function}('g', {token(since)}, 100, 0)",
             hand("g", "gt", top - 5), 1.25) for function in ("updates", "updates_json")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pg-bin", required=True)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--port", type=int, default=54391)
    p.add_argument("--out")
    p.add_argument("--only", help="only the cells whose name contains this")
    p.add_argument("--keep", action="store_true",
                   help="keep each backend's callgrind file (printed: the directory) for callgrind_annotate")
    args = p.parse_args()
    cg.SETUP[:] = SETUP
    cg.WARM_UP[:] = WARM_UP
    root = tempfile.mkdtemp(prefix="streampos-follow-calls-")
    os.chmod(root, 0o777)
    template = cg.make_template(args.pg_bin, root, "follow", dict(conf=[]))
    server = Server(args.pg_bin, root, template, args.port, keep=args.keep)
    if args.keep:
        print(f"callgrind files: {server.counts}", flush=True)
    lines = [
        "### A follower's calls (callgrind, across the network protocol)",
        "",
        f"Instructions per call in the server's backend, (N = {args.n} calls − 0) / N, each call a "
        f"transaction of its own, prepared once, its answer sent as text; a table of {ROWS:,} rows; "
        "the median of 3 measurements. Command: bench/follow_calls.py",
        "",
        "| cell | streampos | baseline | baseline instructions | ratio | goal |",
        "|---|---|---|---|---|---|",
    ]
    try:
        for cell, shape, baseline, goal in CELLS + general_cells(server):
            if args.only and args.only not in cell:
                continue
            server.keep_label = re.sub(r"[^a-z0-9]+", "_", f"{cell} shape")
            s = server.per_call(shape, args.n)
            server.keep_label = re.sub(r"[^a-z0-9]+", "_", f"{cell} baseline")
            b = server.per_call(baseline, args.n)
            kind = "Synapse's UPDATE" if cell == "ack" else "hand-written query"
            verdict = "met" if s / b <= goal else "**not met**"
            line = f"| {cell} | {s:,.0f} | {kind} | {b:,.0f} | {s / b:.3f} | ≤ {goal}: {verdict} |"
            lines.append(line)
            print(line, flush=True)
    finally:
        server.stop()
    lines.append("")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
