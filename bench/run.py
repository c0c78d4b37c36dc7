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
  synapse-after   the upsert in its own transaction after the commit
Readers (8 clients, while 8 streampos writers run):
  SELECT 1  /  streampos.frontier('bench')  /  streampos.current_room_token('bench')
"""
import argparse
import os
import re
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
    "synapse-after": f"""
\\set w random(1, :writers)
INSERT INTO b_after SELECT nextval('b_after_seq'), 'w' || :w, {PAYLOAD} RETURNING id AS new_id \\gset
INSERT INTO b_after_pos VALUES ('w' || :w, :new_id) ON CONFLICT (writer) DO UPDATE
    SET stream_id = EXCLUDED.stream_id WHERE b_after_pos.stream_id < EXCLUDED.stream_id;
""",
}

READER_SHAPES = {
    "SELECT 1": "SELECT 1;\n",
    "frontier()": "SELECT streampos.frontier('bench');\n",
    "current_room_token()": "SELECT streampos.current_room_token('bench');\n",
}

SETUP = """
DROP TABLE IF EXISTS b_floor, b_sp, b_syn, b_syn_pos, b_after, b_after_pos;
DROP SEQUENCE IF EXISTS b_floor_seq, b_syn_seq, b_after_seq;
CREATE TABLE b_floor (id bigint, writer text, payload text);
CREATE TABLE b_sp (id bigint, writer text, payload text);
CREATE TABLE b_syn (id bigint, writer text, payload text);
CREATE TABLE b_after (id bigint, writer text, payload text);
CREATE TABLE b_syn_pos (writer text PRIMARY KEY, stream_id bigint NOT NULL);
CREATE TABLE b_after_pos (writer text PRIMARY KEY, stream_id bigint NOT NULL);
CREATE SEQUENCE b_floor_seq;
CREATE SEQUENCE b_syn_seq;
CREATE SEQUENCE b_after_seq;
"""


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
            if not conn.execute("SELECT 1 FROM streampos.streams WHERE stream_name = 'bench'").fetchone():
                conn.execute("SELECT streampos.create_stream('bench')")
        self.reset()

    def reset(self):
        self.sql("TRUNCATE b_floor, b_sp, b_syn, b_after, b_syn_pos, b_after_pos")

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

    def writer_cells(self):
        cells = [(c, w, True) for c in (1, 8, 32) for w in (1, 4)]
        cells.append((32, 1, False))
        cells.append((32, 4, False))
        rows = []
        for clients, writers, sync in cells:
            results = {name: [] for name in WRITER_SHAPES}
            for _ in range(self.args.rounds):
                for name, body in WRITER_SHAPES.items():
                    self.reset()
                    results[name].append(
                        self.pgbench(self.script(name, body), clients, self.args.seconds, writers, sync)
                    )
            floor = statistics.median(t for t, _ in results["floor"])
            for name, runs in results.items():
                tps = statistics.median(t for t, _ in runs)
                lat = statistics.median(latency for _, latency in runs)
                rows.append((clients, writers, "on" if sync else "off", name, tps, lat, tps / floor))
            line = ", ".join(f"{n} {statistics.median(t for t, _ in r):.0f}" for n, r in results.items())
            print(f"  {clients} clients, {writers} writers, sync {sync}: {line}", flush=True)
        return rows

    def reader_cells(self, label):
        writer_script = self.script("streampos", WRITER_SHAPES["streampos"])
        results = {name: [] for name in READER_SHAPES}
        for _ in range(self.args.rounds):
            for name, body in READER_SHAPES.items():
                self.reset()
                load = threading.Thread(
                    target=self.pgbench, args=(writer_script, 8, self.args.seconds + 2, 4, True)
                )
                load.start()
                time.sleep(1)
                results[name].append(self.pgbench(self.script(name, body), 8, self.args.seconds))
                load.join()
        base = statistics.median(t for t, _ in results["SELECT 1"])
        rows = []
        for name, runs in results.items():
            tps = statistics.median(t for t, _ in runs)
            lat = statistics.median(latency for _, latency in runs)
            rows.append((label, name, tps, lat, tps / base))
        print(f"  readers ({label}): " + ", ".join(f"{r[1]} {r[2]:.0f}" for r in rows), flush=True)
        return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dbname", default="streampos_bench")
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pgbench", default="/usr/lib/postgresql/15/bin/pgbench")
    ap.add_argument("--part", choices=["writers", "readers"], required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    bench = Bench(args)
    bench.setup()
    with open(args.out, "a") as out:
        if args.part == "writers":
            rows = bench.writer_cells()
            out.write("### Writers (TPS, median of interleaved rounds)\n\n")
            out.write("| clients | writers | sync commit | shape | TPS | mean latency ms | ratio to floor |\n")
            out.write("|---|---|---|---|---|---|---|\n")
            for c, w, s, name, tps, lat, ratio in rows:
                out.write(f"| {c} | {w} | {s} | {name} | {tps:.0f} | {lat:.2f} | {ratio:.2f} |\n")
            out.write("\n")
        else:
            rows = bench.reader_cells(args.label)
            out.write(f"### Readers, 8 clients, under 8 streampos writer clients ({args.label})\n\n")
            out.write("| max_connections | shape | TPS | mean latency ms | ratio to SELECT 1 |\n")
            out.write("|---|---|---|---|---|\n")
            for label, name, tps, lat, ratio in rows:
                out.write(f"| {label} | {name} | {tps:.0f} | {lat:.3f} | {ratio:.2f} |\n")
            out.write("\n")


if __name__ == "__main__":
    main()
