#!/usr/bin/env python3
"""wait_for() wake-up latency: from a writer's COMMIT to the waiters' return,
with 1 and 50 waiters blocked in streampos.wait_for().

Each round: every waiter calls wait_for(stream, next_id, 5000) and blocks; the
writer allocates next_id in a transaction and commits. Latency is measured
from the moment the writer sends COMMIT (t_sent) and from the moment the
commit is acknowledged (t_ack) to each waiter's return; the waiter's wake-up
happens inside the commit, so the second is often negative. The waiter's
return is stamped with the server's clock_timestamp() (same machine clock),
so Python's scheduling of the waiter threads is not counted. Reported: p50 and
p99 in milliseconds, with synchronous_commit on (with it off, an ID is final
only once the WAL writer made it durable: see docs/design.md).
"""
import argparse
import statistics
import threading
import time

import psycopg


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def run(conninfo, stream, n_waiters, rounds):
    writer = psycopg.connect(**conninfo, autocommit=True)
    waiters = [psycopg.connect(**conninfo, autocommit=True) for _ in range(n_waiters)]
    from_sent, from_ack = [], []
    for _ in range(rounds):
        target = writer.execute("SELECT streampos.max_allocated(%s)", (stream,)).fetchone()[0] + 1
        returned = [0.0] * n_waiters
        ready = threading.Barrier(n_waiters + 1)

        def wait(i):
            conn = waiters[i]
            ready.wait()
            # The server's clock when wait_for returned: Python's thread
            # scheduling of 50 waiters would otherwise dominate.
            row = conn.execute(
                "SELECT streampos.wait_for(%s, %s, 5000), extract(epoch FROM clock_timestamp())::float8",
                (stream, target),
            ).fetchone()
            returned[i] = row[1]

        threads = [threading.Thread(target=wait, args=(i,)) for i in range(n_waiters)]
        for t in threads:
            t.start()
        ready.wait()
        time.sleep(0.05)  # let every waiter block inside wait_for
        writer.execute("BEGIN")
        writer.execute("SELECT streampos.next_id(%s, 'w1')", (stream,))
        sent = time.time()
        writer.execute("COMMIT")
        ack = time.time()
        for t in threads:
            t.join()
        from_sent += [(r - sent) * 1000 for r in returned]
        from_ack += [(r - ack) * 1000 for r in returned]
    writer.close()
    for w in waiters:
        w.close()
    return from_sent, from_ack


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dbname", default="streampos_bench")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--out")
    args = ap.parse_args()
    conninfo = dict(host=args.host, port=args.port, dbname=args.dbname, user="postgres")
    with psycopg.connect(**conninfo, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS streampos")
        if not conn.execute("SELECT 1 FROM streampos.streams WHERE stream_name = 'wakeup'").fetchone():
            conn.execute("SELECT streampos.create_stream('wakeup')")
    lines = [
        "### wait_for() wake-up latency (ms, synchronous_commit on)",
        "",
        "| waiters | samples | p50 from COMMIT sent | p99 from COMMIT sent | p50 from COMMIT acknowledged | p99 from COMMIT acknowledged |",
        "|---|---|---|---|---|---|",
    ]
    for n in (1, 50):
        rounds = args.rounds if n == 1 else max(10, args.rounds // 5)
        sent, ack = run(conninfo, "wakeup", n, rounds)
        lines.append(
            f"| {n} | {len(sent)} | {statistics.median(sent):.3f} | {percentile(sent, 99):.3f} "
            f"| {statistics.median(ack):.3f} | {percentile(ack, 99):.3f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
