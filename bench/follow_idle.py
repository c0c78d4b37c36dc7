#!/usr/bin/env python3
"""What a follower costs while nothing happens, and how soon a killed
client's wait ends (issue 32's cells).

Idle: a backend's CPU time (the first field of /proc/<pid>/schedstat,
nanoseconds; the server must run on this machine) over a 5 s call that
nothing wakes — `wait_for` for the next ID, an `updates` long-poll and
`wait_for_consumer` of a caught-up consumer — against `pg_sleep(5)` in the
same session, each after a warm-up call, rounds interleaved. Goal: within
2× `pg_sleep(5)`'s.

Killed client: a client process long-polling (`wait_for`, 30 s timeout)
is killed with SIGKILL; the time until its backend has left
pg_stat_activity. Goal: within 1 s.

Usage: bench/follow_idle.py --port P [--host H] [--dbname D] [--rounds 3] [--out FILE]
"""
import argparse
import signal
import statistics
import subprocess
import sys
import time

import psycopg

STREAM = "bench_idle"


def cpu_ns(pid):
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dbname", default="postgres")
    p.add_argument("--user", default="postgres")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args()
    dsn = f"host={a.host} port={a.port} user={a.user} dbname={a.dbname}"
    admin = psycopg.connect(dsn, autocommit=True)
    admin.execute("CREATE EXTENSION IF NOT EXISTS streampos")
    if not admin.execute("SELECT 1 FROM streampos.streams WHERE stream_name = %s", (STREAM,)).fetchone():
        admin.execute("SELECT streampos.create_stream(%s)", (STREAM,))
        admin.execute(f"CREATE TABLE {STREAM}_ev (id bigint PRIMARY KEY, instance_name text)")
        admin.execute(f"SELECT streampos.add_table(%s, '{STREAM}_ev', 'id', 'instance_name')", (STREAM,))
    admin.execute(f"INSERT INTO {STREAM}_ev SELECT streampos.next_id(%s, 'w'), 'w'", (STREAM,))
    top = admin.execute("SELECT streampos.frontier(%s)", (STREAM,)).fetchone()[0]
    admin.execute("SELECT streampos.register_consumer(%s, 'idle', %s)", (STREAM, str(top)))
    admin.execute("SELECT streampos.ack(%s, 'idle', %s)", (STREAM, str(top)))

    calls = {
        "pg_sleep(5)": "SELECT pg_sleep(5)",
        "wait_for, next ID": f"SELECT streampos.wait_for('{STREAM}', {top + 1}, 5000)",
        "updates long-poll": f"SELECT streampos.updates('{STREAM}', '{top}', 100, 5000)",
        "wait_for_consumer": f"SELECT streampos.wait_for_consumer('{STREAM}', 'idle', 5000)",
    }
    conn = psycopg.connect(dsn, autocommit=True)
    pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
    for sql in calls.values():  # warm-up: caches, first use
        conn.execute(sql.replace("5000)", "10)").replace("pg_sleep(5)", "pg_sleep(0.01)"))
    spent = {name: [] for name in calls}
    for _ in range(a.rounds):
        for name, sql in calls.items():
            before = cpu_ns(pid)
            conn.execute(sql)
            spent[name].append((cpu_ns(pid) - before) / 1e6)
    base = statistics.median(spent["pg_sleep(5)"])

    killed = []
    script = (
        "import psycopg\n"
        f"c = psycopg.connect({dsn + ' application_name=bench_killed'!r}, autocommit=True)\n"
        f"c.execute(\"SELECT streampos.wait_for('{STREAM}', {top + 1}, 30000)\")\n"
    )
    waiting = ("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'bench_killed' "
               "AND wait_event_type = 'Extension'")
    present = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'bench_killed'"
    for _ in range(a.rounds):
        child = subprocess.Popen([sys.executable, "-c", script])
        deadline = time.monotonic() + 10
        while not admin.execute(waiting).fetchone()[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        child.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        child.wait()
        while admin.execute(present).fetchone()[0] and time.monotonic() < killed_at + 40:
            time.sleep(0.002)
        killed.append((time.monotonic() - killed_at) * 1000)

    lines = [
        "### An idle follower, a killed client",
        "",
        f"Backend CPU over a 5 s call nothing wakes (/proc/<pid>/schedstat), median of {a.rounds} "
        "interleaved rounds, and the time from SIGKILL of a long-polling client to its backend's exit. "
        "Command: bench/follow_idle.py",
        "",
        "| call | CPU ms (rounds) | / pg_sleep(5) | goal |",
        "|---|---|---|---|",
    ]
    for name, values in spent.items():
        m = statistics.median(values)
        goal = "" if name == "pg_sleep(5)" else ("≤ 2: met" if m / base <= 2 else "≤ 2: **not met**")
        lines.append(f"| {name} | {m:.2f} ({', '.join(f'{v:.2f}' for v in values)}) | {m / base:.2f} | {goal} |")
    k = statistics.median(killed)
    lines += [
        "",
        f"Killed client's backend gone after {k:.1f} ms (median; rounds "
        f"{', '.join(f'{v:.1f}' for v in killed)}); goal ≤ 1000 ms: {'met' if k <= 1000 else '**not met**'}.",
        "",
    ]
    admin.execute("SELECT streampos.unregister_consumer(%s, 'idle')", (STREAM,))
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "a") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
