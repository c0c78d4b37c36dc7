#!/usr/bin/env python3
"""The price of consumers (scripts/bench, "Consumers"), against a running
cluster with streampos preloaded. Every ratio is measured side by side in
one run, round by round (the order alternating), and reported as the
median of the rounds' ratios with their range.

1. Acknowledging, one transaction each (pgbench -M prepared, 1 client and
   4 clients, each client its own consumer), with one processed row
   written in the same transaction as a consumer does:
       ack:          INSERT processed row; SELECT streampos.ack('c_s', 'c<client>', token)
       hand-written: INSERT processed row; UPDATE c_positions SET stream_id = …
                     WHERE type = 'c<client>' AND instance_name = 'master'
   (the second is what Synapse does for federation_stream_position).
2. Reading a batch: updates('c_s', consumer => 'c1', n, 0) against
   updates('c_s', since, n, 0) with the same position, n = 1 and 100.
3. What the lag in time costs writers (4 clients, one row a transaction):
   a stream with a consumer that never acknowledges (the position worker
   marks its token every second and keeps every mark) against one without
   consumers.
"""
import argparse
import statistics

import psycopg

from followers import Bench, fmt

FILL_ROWS = 20000
CLIENTS = (1, 4)


class ConsumerBench(Bench):
    """followers.Bench's connection, script and pgbench helpers, with the
    consumers' tables and cells."""

    def setup(self):
        with psycopg.connect(**dict(self.conninfo, dbname="postgres"), autocommit=True) as c:
            if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.args.dbname,)).fetchone():
                c.execute(f'CREATE DATABASE "{self.args.dbname}"')
        with self.connect() as c:
            c.execute("CREATE EXTENSION IF NOT EXISTS streampos")
            if c.execute("SELECT 1 FROM streampos.streams WHERE stream_name = 'c_s'").fetchone():
                c.execute("SELECT streampos.drop_stream('c_s')")
            c.execute("DROP TABLE IF EXISTS c_ev, c_done, c_positions")
            c.execute("CREATE TABLE c_ev (id bigint PRIMARY KEY, w text NOT NULL, body text NOT NULL)")
            c.execute("CREATE TABLE c_done (consumer text, id bigint)")
            c.execute("CREATE TABLE c_positions (type text, instance_name text, stream_id bigint NOT NULL, "
                      "PRIMARY KEY (type, instance_name))")
            c.execute("SELECT streampos.create_stream('c_s')")
            c.execute("SELECT streampos.add_table('c_s', 'c_ev', 'id', 'w')")
            c.execute(f"INSERT INTO c_ev SELECT streampos.next_id('c_s', 'w' || (k % 3)), 'w' || (k % 3), "
                      f"repeat('x', 100) FROM generate_series(1, {FILL_ROWS}) k")
            for k in range(1, max(CLIENTS) + 1):
                c.execute("SELECT streampos.register_consumer('c_s', %s, '0')", (f"c{k}",))
                c.execute("INSERT INTO c_positions VALUES (%s, 'master', 0)", (f"c{k}",))
            for stream in ("c_marked", "c_plain"):
                if c.execute("SELECT 1 FROM streampos.streams WHERE stream_name = %s", (stream,)).fetchone():
                    c.execute("SELECT streampos.drop_stream(%s)", (stream,))
                c.execute(f"DROP TABLE IF EXISTS {stream}_ev")
                c.execute(f"CREATE TABLE {stream}_ev (id bigint PRIMARY KEY, w text NOT NULL, body text NOT NULL)")
                c.execute("SELECT streampos.create_stream(%s)", (stream,))
                c.execute("SELECT streampos.add_table(%s, %s, 'id', 'w')", (stream, f"{stream}_ev"))
            c.execute("SELECT streampos.register_consumer('c_marked', 'idle')")
            c.execute("VACUUM ANALYZE c_ev, c_positions")

    def compare(self, label, shapes, clients):
        """Rounds of the two shapes, alternating which goes first; (median
        tps of each, the rounds' ratios first/second)."""
        names = list(shapes)
        runs = {k: [] for k in names}
        for r in range(self.args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                runs[name].append(self.pgbench(self.script(f"{label}{name}", shapes[name]), clients,
                                               self.args.seconds))
        ratios = [a / b for a, b in zip(runs[names[0]], runs[names[1]])]
        print(f"  {label}: {names[0]} {statistics.median(runs[names[0]]):.0f}/s, "
              f"{names[1]} {statistics.median(runs[names[1]]):.0f}/s, ratio {fmt(ratios)}", flush=True)
        return statistics.median(runs[names[0]]), statistics.median(runs[names[1]]), ratios

    def acks(self):
        rows = []
        hi = FILL_ROWS
        for clients in CLIENTS:
            shapes = {
                "ack": f"\\set p random(1, {hi})\nBEGIN;\n"
                       "INSERT INTO c_done VALUES ('c' || :client_id + 1, :p);\n"
                       "SELECT streampos.ack('c_s', 'c' || :client_id + 1, (:p)::text::streampos.multi_writer_token);\n"
                       "COMMIT;\n",
                "hand-written": f"\\set p random(1, {hi})\nBEGIN;\n"
                                "INSERT INTO c_done VALUES ('c' || :client_id + 1, :p);\n"
                                "UPDATE c_positions SET stream_id = :p "
                                "WHERE type = 'c' || :client_id + 1 AND instance_name = 'master';\n"
                                "COMMIT;\n",
            }
            rows.append((clients, *self.compare(f"ack, {clients} client(s)", shapes, clients)))
        return rows

    def reads(self):
        rows = []
        with self.connect() as c:
            position = FILL_ROWS // 2
            c.execute("SELECT streampos.ack('c_s', 'c1', %s::text::streampos.multi_writer_token)", (position,))
        for n in (1, 100):
            shapes = {
                "consumer": f"SELECT streampos.updates('c_s', consumer => 'c1', max_rows => {n});\n",
                "since": f"SELECT streampos.updates('c_s', '{position}', {n}, 0);\n",
            }
            rows.append((n, *self.compare(f"updates n={n}", shapes, 1)))
        return rows


    def marks(self):
        clients = 4
        shapes = {
            stream: f"INSERT INTO {stream}_ev VALUES (streampos.next_id('{stream}', 'w' || :client_id), "
                    f"'w' || :client_id, 'x');\n"
            for stream in ("c_marked", "c_plain")
        }
        result = self.compare("writers, a lagging consumer", shapes, clients)
        with self.connect() as c:
            kept = c.execute("SELECT count(*) FROM streampos.frontier_marks WHERE stream_name = 'c_marked'").fetchone()[0]
        return (clients, *result, kept)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dbname", default="streampos_bench")
    p.add_argument("--pgbench", default="pgbench")
    p.add_argument("--seconds", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    bench = ConsumerBench(args)
    bench.setup()
    acks = bench.acks()
    reads = bench.reads()
    marks = bench.marks()
    lines = ["### Consumers", "",
             f"pgbench -M prepared, {args.rounds} rounds of {args.seconds} s, order alternating; "
             "ratio: median (range) of the rounds' ratios.", "",
             "| acknowledging (with one processed row) | clients | ack tps | hand-written UPDATE tps | ratio |",
             "|---|---|---|---|---|"]
    for clients, a, h, ratios in acks:
        lines.append(f"| `ack()` vs Synapse's position UPDATE | {clients} | {a:.0f} | {h:.0f} | {fmt(ratios)} |")
    lines += ["", "| reading a batch | rows | consumer => tps | since => tps | ratio |", "|---|---|---|---|---|"]
    for n, a, b, ratios in reads:
        lines.append(f"| `updates()` | {n} | {a:.0f} | {b:.0f} | {fmt(ratios)} |")
    clients, a, b, ratios, kept = marks
    lines += ["", "| writers | clients | with a lagging consumer tps | without consumers tps | ratio | marks kept |",
              "|---|---|---|---|---|---|",
              f"| one row a transaction | {clients} | {a:.0f} | {b:.0f} | {fmt(ratios)} | {kept} |"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
