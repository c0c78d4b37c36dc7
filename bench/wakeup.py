#!/usr/bin/env python3
"""wait_for() wake-up latency: from a writer's COMMIT to the waiters' return,
with 1 and 50 waiters blocked in streampos.wait_for().

Each round: the writer allocates an ID in a transaction (wait_for refuses a
target the server never allocated); every waiter calls wait_for(stream, that
ID, 5000) and blocks; the writer commits. Latency is measured
from the moment the writer sends COMMIT (t_sent) and from the moment the
commit is acknowledged (t_ack) to each waiter's return; the waiter's wake-up
happens inside the commit, so the second is often negative. The waiter's
return is stamped with the server's clock_timestamp() (same machine clock),
so Python's scheduling of the waiter threads is not counted. Reported: p50 and
p99 in milliseconds, with synchronous_commit on (with it off, an ID is final
only once the WAL writer made it durable: see docs/design.md). For
comparison, the same rounds with the waiters blocked on an advisory lock
the writer holds: PostgreSQL's own wake-up of many backends at a commit.
"""
import argparse
import statistics
import threading
import time

import psycopg


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


# What the waiters run, and what the writer does before its COMMIT.
WAITS = {
    # Wait for the ID the writer allocated.
    "streampos": "SELECT streampos.wait_for(%(stream)s, %(target)s, 5000), "
    "extract(epoch FROM clock_timestamp())::float8",
    # PostgreSQL's own wake-up at a commit, for comparison: every waiter
    # asks for a shared advisory lock the writer holds until it commits.
    "advisory lock": "SELECT pg_advisory_xact_lock_shared(%(key)s), "
    "extract(epoch FROM clock_timestamp())::float8",
}
ADVISORY_KEY = 7_700_451


def one_round(writer, waiters, stream, how):
    """One COMMIT and its waiters: (ms from COMMIT sent, ms from COMMIT
    acknowledged) to each waiter's return, by the server's clock."""
    writer.execute("BEGIN")
    target = writer.execute("SELECT streampos.next_id(%s, 'w1')", (stream,)).fetchone()[0]
    writer.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_KEY,))
    returned = [0.0] * len(waiters)
    ready = threading.Barrier(len(waiters) + 1)
    query = WAITS[how]
    params = dict(stream=stream, target=target, key=ADVISORY_KEY)

    def wait(i):
        ready.wait()
        # The server's clock when the wait returned: Python's thread
        # scheduling of 50 waiters would otherwise dominate.
        returned[i] = waiters[i].execute(query, params).fetchone()[1]

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(len(waiters))]
    for t in threads:
        t.start()
    ready.wait()
    time.sleep(0.05)  # let every waiter block
    sent = time.time()
    writer.execute("COMMIT")
    ack = time.time()
    for t in threads:
        t.join()
    return [(r - sent) * 1000 for r in returned], [(r - ack) * 1000 for r in returned]


def run(conninfo, stream, n_waiters, rounds):
    """Rounds of each kind of wait, interleaved: {how: (from_sent, from_ack)}."""
    writer = psycopg.connect(**conninfo, autocommit=True)
    waiters = [psycopg.connect(**conninfo, autocommit=True) for _ in range(n_waiters)]
    results = {how: ([], []) for how in WAITS}
    for _ in range(rounds):
        for how in WAITS:
            sent, ack = one_round(writer, waiters, stream, how)
            results[how][0].extend(sent)
            results[how][1].extend(ack)
    writer.close()
    for w in waiters:
        w.close()
    return results


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
        "From the writer's COMMIT to each waiter's return (server clock). The advisory-lock rows are",
        "PostgreSQL's own wake-up at a commit (waiters blocked on a lock the writer releases when it",
        "commits), in rounds interleaved with wait_for's: what the platform costs.",
        "",
        "| waiters | wait | samples | p50 from COMMIT sent | p99 from COMMIT sent | p50 from COMMIT acknowledged | p99 from COMMIT acknowledged |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in (1, 50):
        rounds = args.rounds if n == 1 else max(10, args.rounds // 5)
        for how, (sent, ack) in run(conninfo, "wakeup", n, rounds).items():
            lines.append(
                f"| {n} | {how} | {len(sent)} | {statistics.median(sent):.3f} | {percentile(sent, 99):.3f} "
                f"| {statistics.median(ack):.3f} | {percentile(ack, 99):.3f} |"
            )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
