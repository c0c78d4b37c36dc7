#!/usr/bin/env python3
"""The price of the follower path (scripts/bench, "Followers"), against a
running cluster with streampos preloaded. Every ratio is measured side by
side in one run, round by round, and reported as the median of the
rounds' ratios with their range.

1. One `updates()` call, and one `updates_json()` call (the same answer
   as json), against the hand-written query that returns the same rows
   under the same rule (pgbench -M prepared, 1 client, rows always
   available):
       updates('ev', since, n, 0)
       SELECT id, w, body FROM ev WHERE id > since
              AND id <= (SELECT streampos.frontier('ev')) ORDER BY id LIMIT n
   for n = 1, 3, 100, on a stream of one table and of two.
2. Followers' cost on writers: 2 pgbench writer clients (next_id + INSERT)
   alone, then with N long-polling followers (each its own session,
   looping `updates(stream, its token, 100, 1000)`, or `updates_json`),
   N = 8 and 32. Each
   follower checks that it receives every row exactly once; one of them
   records each row's delivery latency (from its writer's commit, on the
   server's clock).
3. The usual hand-written PostgreSQL follower on the same load: writers
   `NOTIFY` in each transaction, followers `LISTEN` and run the query of 1
   on each wake-up.
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

SETUP = """
DROP TABLE IF EXISTS f_ev, f_ev2, f_ev2b, f_ev3, f_ev4;
CREATE TABLE f_ev (id bigint PRIMARY KEY, w text NOT NULL, body text NOT NULL);
CREATE TABLE f_ev2 (LIKE f_ev INCLUDING ALL);
CREATE TABLE f_ev2b (LIKE f_ev INCLUDING ALL);
CREATE TABLE f_ev3 (id bigint PRIMARY KEY, w text NOT NULL, body text NOT NULL,
                    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE f_ev4 (LIKE f_ev3 INCLUDING ALL);
"""

FILL_ROWS = 20000


def fmt(values):
    med, lo, hi = statistics.median(values), min(values), max(values)
    return f"{med:.2f} ({lo:.2f}–{hi:.2f})"


class Bench:
    def __init__(self, args):
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="streampos-followers-")
        self.conninfo = dict(host=args.host, port=args.port, dbname=args.dbname, user="postgres")

    def connect(self, **kw):
        return psycopg.connect(**self.conninfo, autocommit=True, **kw)

    def setup(self):
        with psycopg.connect(**dict(self.conninfo, dbname="postgres"), autocommit=True) as c:
            if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.args.dbname,)).fetchone():
                c.execute(f'CREATE DATABASE "{self.args.dbname}"')
        with self.connect() as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS streampos")
            for s in ("f_one", "f_two", "f_live", "f_notify"):
                if c.execute("SELECT 1 FROM streampos.streams WHERE stream_name = %s", (s,)).fetchone():
                    c.execute("SELECT streampos.drop_stream(%s)", (s,))
            c.execute(SETUP)
            for s in ("f_one", "f_two", "f_live", "f_notify"):
                c.execute("SELECT streampos.create_stream(%s)", (s,))
            c.execute("SELECT streampos.add_table('f_one', 'f_ev', 'id', 'w')")
            c.execute("SELECT streampos.add_table('f_two', 'f_ev2', 'id', 'w')")
            c.execute("SELECT streampos.add_table('f_two', 'f_ev2b', 'id', 'w')")
            c.execute("SELECT streampos.add_table('f_live', 'f_ev3', 'id', 'w')")
            # Rows for the call cells, allocated from their streams: f_one's
            # in f_ev; f_two's alternating between its two tables.
            c.execute(f"INSERT INTO f_ev SELECT streampos.next_id('f_one', 'w' || (k % 3)), "
                      f"'w' || (k % 3), repeat('x', 100) FROM generate_series(1, {FILL_ROWS}) k")
            ids = c.execute(f"SELECT streampos.next_ids('f_two', 'w0', {FILL_ROWS})").fetchone()[0]
            c.execute("INSERT INTO f_ev2 SELECT i, 'w0', repeat('x', 100) FROM unnest(%s::bigint[]) i "
                      "WHERE i %% 2 = 0", (ids,))
            c.execute("INSERT INTO f_ev2b SELECT i, 'w0', repeat('x', 100) FROM unnest(%s::bigint[]) i "
                      "WHERE i %% 2 = 1", (ids,))
            c.execute("VACUUM ANALYZE f_ev, f_ev2, f_ev2b")

    def script(self, name, body):
        path = os.path.join(self.dir, re.sub(r"[^a-z0-9]+", "_", name.lower()) + ".sql")
        with open(path, "w") as f:
            f.write(body)
        return path

    def pgbench(self, script, clients, seconds, defines=()):
        cmd = [self.args.pgbench, "-h", self.args.host, "-p", str(self.args.port), "-U", "postgres",
               "-n", "-M", "prepared", "-c", str(clients), "-j", str(min(clients, 4)), "-T", str(seconds)]
        for d in defines:
            cmd += ["-D", d]
        cmd += ["-f", script, self.args.dbname]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"pgbench failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
        return float(re.search(r"tps = ([0-9.]+)", out.stdout).group(1))

    # ------------------------------------------------------------ 1. calls

    def call_cells(self):
        rows = []
        hi = FILL_ROWS - 200
        for stream, label in (("f_one", "one table"), ("f_two", "two tables")):
            tables = ["f_ev"] if stream == "f_one" else ["f_ev2", "f_ev2b"]
            for n in (1, 3, 100):
                # The frontier once per query (an initplan), as a careful
                # hand-written follower computes it.
                # Each table's first n rows, then the first n of those (what
                # a careful hand-written follower of two tables runs).
                union = " UNION ALL ".join(
                    f"(SELECT id, w, body FROM {t} WHERE id > :since "
                    f"AND id <= (SELECT streampos.frontier('{stream}')) ORDER BY id LIMIT {n})"
                    for t in tables)
                shapes = {
                    "updates()": f"\\set since random(1, {hi})\n"
                                 f"SELECT streampos.updates('{stream}', :since, {n}, 0);\n",
                    "updates_json()": f"\\set since random(1, {hi})\n"
                                      f"SELECT streampos.updates_json('{stream}', :since, {n}, 0);\n",
                    "hand-written": f"\\set since random(1, {hi})\n"
                                    f"SELECT * FROM ({union}) x ORDER BY id LIMIT {n};\n",
                }
                runs = {k: [] for k in shapes}
                for r in range(self.args.rounds):
                    for name in (list(shapes) if r % 2 == 0 else list(shapes)[::-1]):
                        runs[name].append(self.pgbench(self.script(f"{stream}{n}{name}", shapes[name]), 1,
                                                       self.args.seconds))
                ratios = [u / h for u, h in zip(runs["updates()"], runs["hand-written"])]
                json_ratios = [u / h for u, h in zip(runs["updates_json()"], runs["hand-written"])]
                rows.append((label, n, statistics.median(runs["updates()"]),
                             statistics.median(runs["updates_json()"]),
                             statistics.median(runs["hand-written"]), ratios, json_ratios))
                print(f"  calls {label} n={n}: updates {statistics.median(runs['updates()']):.0f}/s, "
                      f"updates_json {statistics.median(runs['updates_json()']):.0f}/s, "
                      f"hand-written {statistics.median(runs['hand-written']):.0f}/s, ratios {fmt(ratios)}, "
                      f"{fmt(json_ratios)}", flush=True)
        return rows

    # ------------------------------------------------------ 2./3. followers

    def writer_script(self, notify):
        return self.script(
            f"writer_{notify}",
            "\\set w random(1, 2)\n"
            + ("BEGIN;\n" if notify else "")
            + f"INSERT INTO {'f_ev4' if notify else 'f_ev3'} (id, w, body) "
              f"SELECT streampos.next_id('{'f_notify' if notify else 'f_live'}', 'w' || :w), 'w' || :w, 'x';\n"
            + ("NOTIFY f_live;\nCOMMIT;\n" if notify else ""),
        )

    def run_followers(self, kind, n_followers, seconds, stop, results):
        """Followers until `stop`: kind 'updates' or 'updates_json'
        (long-poll) or 'listen' (LISTEN/NOTIFY + the hand-written query)."""
        def follower(k):
            seen, latencies, dup = set(), [], 0
            try:
                with self.connect() as c:
                    if kind in ("updates", "updates_json"):
                        token = c.execute("SELECT streampos.current_token('f_live')::text").fetchone()[0]
                        while not stop.is_set():
                            answer = c.execute(
                                f"SELECT streampos.{kind}('f_live', %s, 100, 1000)", (token,)).fetchone()[0]
                            token = answer["token"]
                            now = c.execute("SELECT extract(epoch FROM clock_timestamp())").fetchone()[0] \
                                if k == 0 and len(answer["data"]) > 1 else None
                            i, data = 0, answer["data"]
                            while i < len(data):
                                count = data[i][2]
                                for row in data[i + 1:i + 1 + count]:
                                    if row[0] in seen:
                                        dup += 1
                                    seen.add(row[0])
                                    if now is not None:
                                        latencies.append(float(now) - _epoch(row[3]))
                                i += 1 + count
                    else:
                        c.execute("LISTEN f_live")
                        last = c.execute("SELECT coalesce(max(id), 0) FROM f_ev4").fetchone()[0]
                        while not stop.is_set():
                            # A generator of its own each time, run to its
                            # end: a suspended one keeps the connection's
                            # lock, and the query below would wait forever.
                            got = any(True for _ in c.notifies(timeout=1.0, stop_after=1))
                            if not got:
                                continue
                            rows = c.execute(
                                "SELECT id, extract(epoch FROM clock_timestamp()) - extract(epoch FROM at) "
                                "FROM f_ev4 WHERE id > %s AND id <= (SELECT streampos.frontier('f_notify')) "
                                "ORDER BY id LIMIT 100", (last,)).fetchall()
                            for i, lat in rows:
                                if i in seen:
                                    dup += 1
                                seen.add(i)
                                if k == 0:
                                    latencies.append(float(lat))
                                last = max(last, i)
            except Exception as e:  # reported with the results
                results.append(("error", k, repr(e)))
                return
            results.append(("ok", k, (len(seen), dup, latencies)))

        threads = [threading.Thread(target=follower, args=(k,)) for k in range(n_followers)]
        for t in threads:
            t.start()
        return threads

    def follower_cells(self):
        rows = []
        for kind in ("updates", "updates_json", "listen"):
            for n in ((0, 8, 32) if kind == "updates" else (8, 32)):
                ratios, lat_all, checks = [], [], []
                for r in range(self.args.rounds):
                    # The baseline: the same writers with no follower and no NOTIFY.
                    alone = self.pgbench(self.writer_script(False), 2, self.args.seconds)
                    stop, results = threading.Event(), []
                    threads = self.run_followers(kind, n, self.args.seconds, stop, results)
                    time.sleep(0.5)
                    table = "f_ev4" if kind == "listen" else "f_ev3"
                    with self.connect() as c:
                        before = c.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                    loaded = self.pgbench(self.writer_script(kind == "listen"), 2, self.args.seconds)
                    time.sleep(1.5)
                    stop.set()
                    for t in threads:
                        t.join(timeout=30)
                    with self.connect() as c:
                        after = c.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
                    ratios.append(loaded / alone)
                    for status, k, value in results:
                        if status != "ok":
                            checks.append(f"follower {k}: {value}")
                            continue
                        received, dup, lat = value
                        if dup:
                            checks.append(f"follower {k} received {dup} rows twice")
                        if received < after - before:
                            checks.append(f"follower {k} received {received} of {after - before} new rows")
                        lat_all += lat
                lat_all.sort()
                p50 = lat_all[len(lat_all) // 2] * 1000 if lat_all else float("nan")
                p99 = lat_all[int(len(lat_all) * 0.99)] * 1000 if lat_all else float("nan")
                rows.append((kind, n, ratios, p50, p99, checks))
                print(f"  {kind} followers {n}: writers {fmt(ratios)} of alone, latency p50 {p50:.1f} ms "
                      f"p99 {p99:.1f} ms; {'; '.join(checks[:3]) or 'every row once'}", flush=True)
        return rows


def _epoch(value):
    """The epoch seconds of a timestamptz as updates() renders it."""
    from datetime import datetime
    return datetime.fromisoformat(value).timestamp()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dbname", default="streampos_bench")
    p.add_argument("--pgbench", default="pgbench")
    p.add_argument("--seconds", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--part", choices=("calls", "followers", "all"), default="all")
    p.add_argument("--out")
    args = p.parse_args()
    b = Bench(args)
    b.setup()
    lines = []
    if args.part in ("calls", "all"):
        lines += ["### Followers: one call", "",
                  "`updates(stream, since, n, 0)` (jsonb) and `updates_json(…)` (the same answer as json) "
                  "against the hand-written query returning the same rows (pgbench -M prepared, 1 client, "
                  "results as text); ratio of calls per second. Goal (issue 32): ≥ 0.9.", "",
                  "| stream | n | updates() calls/s | updates_json() calls/s | hand-written calls/s "
                  "| updates() ratio | updates_json() ratio |", "|---|---|---|---|---|---|---|"]
        for label, n, u, j, h, ratios, json_ratios in b.call_cells():
            lines.append(f"| {label} | {n} | {u:.0f} | {j:.0f} | {h:.0f} | {fmt(ratios)} | {fmt(json_ratios)} |")
        lines.append("")
    if args.part in ("followers", "all"):
        lines += ["### Followers: their cost on writers", "",
                  "2 writer clients (pgbench), with N followers: long-polling `updates()` or `updates_json()` "
                  "(Python, parsing each answer), or LISTEN + a NOTIFY "
                  "per commit + the hand-written query. Ratio: writers' TPS with the followers / alone. "
                  "Latency: from the row's commit to its delivery (one follower, server clock).", "",
                  "| followers | N | writers vs alone | latency p50 | p99 | rows |", "|---|---|---|---|---|---|"]
        for kind, n, ratios, p50, p99, checks in b.follower_cells():
            name = {"updates": "updates() long-poll", "updates_json": "updates_json() long-poll"}.get(
                kind, "LISTEN/NOTIFY + query")
            lines.append(f"| {name} | {n} | {fmt(ratios)} | {p50:.1f} ms | {p99:.1f} ms | "
                         f"{'; '.join(checks[:2]) or 'every row once'} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
