#!/usr/bin/env python3
"""The retention job's price (scripts/bench, "Retention"), against a running
cluster with streampos preloaded: a stream table of a million rows by
three writers, one consumer, and a DELETE of what it has acknowledged,
against the DELETE of the same rows by ID (`DELETE … WHERE id <= D`), the
baseline. Each statement runs in a transaction that is rolled back, so
every round deletes the same rows; rounds alternate the order, and each
cell is reported as the median of its rounds' ratios with their range.

The cells, each for 2 000 rows to delete and for none:
    per row:   NOT persisted_after(safe_to_delete(s), …)   (0.3.0's README)
    subquery:  NOT persisted_after((SELECT safe_to_delete(s)), …)
    bounded:   the subquery, and id <= max_stream_pos(safe) so that the
               primary key's index finds the rows
    README:    the answer and each writer's position in it computed once
               (materialized), the rows found by the index below the
               highest position (README, "Consumers")
"""
import argparse
import statistics
import time

import psycopg

from followers import fmt

ROWS = 1_000_000
TO_DELETE = 2000
WRITERS = ("w0", "w1", "w2")

JOBS = {
    "per row": """DELETE FROM r_ev d USING streampos.instances i
                  WHERE i.instance_name = d.w
                    AND NOT streampos.persisted_after(streampos.safe_to_delete('r_s'), i.instance_id, d.id)""",
    "subquery": """DELETE FROM r_ev d USING streampos.instances i
                   WHERE i.instance_name = d.w
                     AND NOT streampos.persisted_after((SELECT streampos.safe_to_delete('r_s')),
                                                       i.instance_id, d.id)""",
    "bounded": """DELETE FROM r_ev d USING streampos.instances i,
                        (SELECT streampos.safe_to_delete('r_s') AS safe) s
                 WHERE i.instance_name = d.w
                   AND d.id <= streampos.max_stream_pos(s.safe)
                   AND NOT streampos.persisted_after(s.safe, i.instance_id, d.id)""",
    "README": """WITH s AS MATERIALIZED (SELECT streampos.safe_to_delete('r_s') AS safe),
                      w AS MATERIALIZED (SELECT i.instance_name,
                                                streampos.instance_pos(s.safe, i.instance_id) AS upto
                                         FROM streampos.instances i, s)
                 DELETE FROM r_ev d USING w
                 WHERE d.w = w.instance_name AND d.id <= w.upto
                   AND d.id <= (SELECT streampos.max_stream_pos(s.safe) FROM s)""",
}


def connect(args):
    return psycopg.connect(host=args.host, port=args.port, dbname=args.dbname, user=args.user, autocommit=True)


def setup(args):
    with psycopg.connect(host=args.host, port=args.port, dbname="postgres", user=args.user,
                         autocommit=True) as c:
        if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (args.dbname,)).fetchone():
            c.execute(f'CREATE DATABASE "{args.dbname}"')
    with connect(args) as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS streampos")
        if c.execute("SELECT 1 FROM streampos.streams WHERE stream_name = 'r_s'").fetchone():
            c.execute("SELECT streampos.drop_stream('r_s')")
        c.execute("DROP TABLE IF EXISTS r_ev")
        c.execute("CREATE TABLE r_ev (id bigint PRIMARY KEY, w text NOT NULL, body text NOT NULL)")
        c.execute("SELECT streampos.create_stream('r_s')")
        c.execute("SELECT streampos.add_table('r_s', 'r_ev', 'id', 'w')")
        c.execute(f"INSERT INTO r_ev SELECT streampos.next_id('r_s', 'w' || (k % 3)), 'w' || (k % 3), "
                  f"repeat('x', 50) FROM generate_series(1, {args.rows}) k")
        c.execute("VACUUM ANALYZE r_ev")
        c.execute("SELECT streampos.register_consumer('r_s', 'r_c', '0')")


def timed(c, sql):
    """Seconds the statement took, and the rows it deleted (rolled back)."""
    c.execute("BEGIN")
    started = time.perf_counter()
    deleted = c.execute(sql).rowcount
    took = time.perf_counter() - started
    c.execute("ROLLBACK")
    return took, deleted


def measure(args, acked, rounds):
    """{cell: [ratio per round]} with the consumer at `acked`."""
    with connect(args) as c:
        # Positions only move forward: the cells run at 0 first.
        c.execute("SELECT streampos.ack('r_s', 'r_c', %s)", (str(acked),))
        baseline_sql = f"DELETE FROM r_ev WHERE id <= {acked}"
        ratios = {name: [] for name in JOBS}
        seconds = {name: [] for name in list(JOBS) + ["baseline"]}
        for r in range(rounds):
            names = list(JOBS) if r % 2 == 0 else list(reversed(JOBS))
            base, base_rows = timed(c, baseline_sql)
            seconds["baseline"].append(base)
            for name in names:
                took, rows = timed(c, JOBS[name])
                assert rows == base_rows, f"{name} deleted {rows} rows, the baseline {base_rows}"
                seconds[name].append(took)
                ratios[name].append(took / base)
        return ratios, seconds, base_rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--user", default="postgres")
    p.add_argument("--dbname", default="streampos_bench")
    p.add_argument("--rows", type=int, default=ROWS)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    setup(args)
    lines = [
        "### Retention",
        "",
        f"A stream table of {args.rows:,} rows (three writers), one consumer; each DELETE in a transaction "
        "rolled back, against `DELETE … WHERE id <= D` of the same rows. Median of "
        f"{args.rounds} rounds' ratios (range); the baseline's median time. Command: "
        "`bench/retention.py` (in scripts/bench).",
        "",
        "| rows deleted | baseline | per row (0.3.0's README) | subquery | bounded | README's job |",
        "|---|---|---|---|---|---|",
    ]
    for acked in (0, TO_DELETE):
        ratios, seconds, deleted = measure(args, acked, args.rounds)
        lines.append(f"| {deleted:,} | {statistics.median(seconds['baseline']) * 1000:.1f} ms | "
                     + " | ".join(f"{fmt(ratios[n])}× ({statistics.median(seconds[n]) * 1000:.0f} ms)"
                                  for n in JOBS) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
