#!/usr/bin/env python3
"""What a role with no privilege but SELECT on a stream's table can do to
the stream's writers by flooding the server: writers' throughput (pgbench)
alone, next to N `SELECT 1` clients and N `wait_for()` long-polls (any
role can do these), and next to N followers long-polling `updates()` (what
a role with SELECT on the table can do).

Writers: `-c WRITERS` pgbench clients, each committing one row with
`next_id` per transaction. Followers: pgbench clients of a role that may
only SELECT the table, each calling
`updates(stream, current_token(stream), 100, 10000)`: it sleeps until a
writer commits past its token, then reads the new rows (a follower that
keeps up, woken by every commit). Each load runs ROUNDS times, interleaved,
each round for SECONDS; the result is writers' transactions per second,
median and range, and its ratio to the writers alone.

    python3 bench/public_load.py --port 5432 --clients 40

It creates (and drops) a database of its own, and the roles
streampos_bench_follower (SELECT on the table) and streampos_bench_nobody
(nothing).
"""
import argparse
import os
import re
import statistics
import subprocess
import tempfile
import threading

import psycopg

WRITE = "INSERT INTO ev SELECT streampos.next_id('ev', 'w'), 'w', 'body';\n"
SELECT_1 = "SELECT 1;\n"
FOLLOW = "SELECT streampos.updates('ev', streampos.current_token('ev'), 100, 10000);\n"
WAIT = "SELECT streampos.wait_for('ev', streampos.max_allocated('ev'), 10000);\n"
NOBODY = "streampos_bench_nobody"
FOLLOWER = "streampos_bench_follower"


def pgbench(args, script, clients, seconds, user, dbname):
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(script)
        path = f.name
    os.chmod(path, 0o644)
    try:
        out = subprocess.run(
            [os.path.join(args.pg_bin, "pgbench"), "-n", "-h", args.host, "-p", str(args.port),
             "-U", user, "-c", str(clients), "-j", str(min(clients, 4)), "-T", str(seconds),
             "-f", path, dbname],
            capture_output=True, text=True, check=True,
        ).stdout
    finally:
        os.unlink(path)
    return float(re.search(r"tps = ([0-9.]+)", out).group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5432)
    p.add_argument("--user", default="postgres")
    p.add_argument("--pg-bin", default=os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--clients", type=int, default=40)
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    dbname = "streampos_bench_public"
    conn = dict(host=args.host, port=args.port, user=args.user)
    with psycopg.connect(dbname="postgres", autocommit=True, **conn) as c:
        c.execute(f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)")
        c.execute(f"CREATE DATABASE {dbname}")
        for role in (FOLLOWER, NOBODY):
            c.execute(f"DO $$ BEGIN CREATE ROLE {role} LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    try:
        with psycopg.connect(dbname=dbname, autocommit=True, **conn) as c:
            c.execute("CREATE EXTENSION streampos")
            c.execute("SELECT streampos.create_stream('ev')")
            c.execute("CREATE TABLE ev (id bigint PRIMARY KEY, instance_name text, body text)")
            c.execute("SELECT streampos.add_table('ev', 'ev', 'id', 'instance_name')")
            c.execute(f"GRANT SELECT ON ev TO {FOLLOWER}")
        loads = {
            "writers alone": None,
            f"{args.clients} x SELECT 1": (SELECT_1, NOBODY),
            f"{args.clients} x wait_for() long-poll (no privilege)": (WAIT, NOBODY),
            f"{args.clients} x updates() long-poll (SELECT only)": (FOLLOW, FOLLOWER),
        }
        results = {name: [] for name in loads}
        for _ in range(args.rounds):
            for name, load in loads.items():
                background = None
                if load is not None:
                    script, user = load
                    background = threading.Thread(
                        target=pgbench, args=(args, script, args.clients, args.seconds + 2, user, dbname)
                    )
                    background.start()
                results[name].append(pgbench(args, WRITE, args.writers, args.seconds, args.user, dbname))
                if background is not None:
                    background.join()
        alone = statistics.median(results["writers alone"])
        print(f"{args.writers} writers, {args.seconds} s x {args.rounds} rounds, {os.cpu_count()} cores")
        print("| load | writers' TPS (median, range) | ratio |")
        print("|---|---|---|")
        for name, tps in results.items():
            m = statistics.median(tps)
            print(f"| {name} | {m:.0f} ({min(tps):.0f}–{max(tps):.0f}) | {m / alone:.2f} |")
    finally:
        with psycopg.connect(dbname="postgres", autocommit=True, **conn) as c:
            c.execute(f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)")


if __name__ == "__main__":
    main()
