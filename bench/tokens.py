#!/usr/bin/env python3
"""Token text round trip against int8[]: text -> value -> text for a million
generated values, the same digits both ways, interleaved rounds, one server.

Usage: bench/tokens.py --port 54320 [--rows 1000000] [--rounds 7]
Prints a markdown table and the ratio (int8[] time / token time: > 1 means
tokens are faster).
"""
import argparse
import statistics
import time

import psycopg

SETUP = """
DROP TABLE IF EXISTS bench_token_text, bench_array_text;
CREATE UNLOGGED TABLE bench_token_text AS
  SELECT 'm' || i || '~2.' || (i + 2) || '~3.' || (i + 3) AS t FROM generate_series(1, %(rows)s) i;
CREATE UNLOGGED TABLE bench_array_text AS
  SELECT '{' || i || ',2,' || (i + 2) || ',3,' || (i + 3) || '}' AS t FROM generate_series(1, %(rows)s) i;
ANALYZE bench_token_text, bench_array_text;
"""

SHAPES = {
    "room_stream_token": "SELECT count(t::streampos.room_stream_token::text) FROM bench_token_text",
    "multi_writer_token": "SELECT count(t::streampos.multi_writer_token::text) FROM bench_token_text",
    "int8[]": "SELECT count(t::int8[]::text) FROM bench_array_text",
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=54320)
    ap.add_argument("--dbname", default="streampos_demo")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    with psycopg.connect(host=args.host, port=args.port, dbname=args.dbname, user="postgres", autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS streampos")
        conn.execute("SET max_parallel_workers_per_gather = 0")
        for stmt in SETUP.split(";"):
            if stmt.strip():
                conn.execute(stmt.replace("%(rows)s", str(args.rows)))
        for sql in SHAPES.values():  # warm the cache
            conn.execute(sql)
        times = {name: [] for name in SHAPES}
        for _ in range(args.rounds):
            for name, sql in SHAPES.items():
                start = time.perf_counter()
                conn.execute(sql).fetchone()
                times[name].append(time.perf_counter() - start)
        conn.execute("DROP TABLE bench_token_text, bench_array_text")
    base = statistics.median(times["int8[]"])
    lines = [
        f"Token text round trip, {args.rows:,} values, median of {args.rounds} interleaved rounds",
        "",
        "| shape | median s | ns/value | int8[] time / shape time |",
        "|---|---|---|---|",
    ]
    for name, ts in times.items():
        m = statistics.median(ts)
        lines.append(f"| {name} | {m:.3f} | {m / args.rows * 1e9:.0f} | {base / m:.2f} |")
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
