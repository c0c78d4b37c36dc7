#!/usr/bin/env python3
"""A federation sender: a consumer of the events stream that survives a
crash with no event lost or sent twice.

    python federation_sender.py --dsn "dbname=synapse" --stream events \\
        --consumer federation_sender --outbox federation_outbox

It registers itself once (``streampos.register_consumer``, at the current
token or ``--since``; a restart keeps the acknowledged position) and then
loops: ``Consumer.batch()`` reads the
events after its position, the block queues each one in the outbox table
(stream_ordering, instance_name) and the batch's token is acknowledged in
the same transaction. Kill it with ``kill -9`` at any moment and start it
again: the outbox holds every committed event exactly once, because
queueing and acknowledging commit together.

It also prints each event as a JSON line the moment it queues it: that is
work outside the database, done again for the events of a batch that did
not commit (at least once). Its first line is {"started": true}. Runs
until SIGTERM or SIGINT.
"""

import argparse
import json
import signal

import psycopg

import streampos

stopping = False


def stop(_signum, _frame):
    global stopping
    stopping = True


def main(args):
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(json.dumps({"started": True}), flush=True)
    insert = f"INSERT INTO {args.outbox} (stream_ordering, instance_name) VALUES (%s, %s)"
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        consumer = streampos.Consumer(
            conn, args.stream, args.consumer, max_rows=args.max_rows, timeout_ms=args.timeout_ms
        )
        consumer.register(since=args.since)
        while not stopping:
            with consumer.batch() as batch:
                for table in batch.tables.values():
                    for event in table.dicts():
                        conn.execute(insert, (event["stream_ordering"], event["instance_name"]))
                        print(json.dumps({"id": event["stream_ordering"]}), flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True, help="libpq connection string")
    parser.add_argument("--stream", default="events")
    parser.add_argument("--consumer", default="federation_sender")
    parser.add_argument("--outbox", default="federation_outbox")
    parser.add_argument("--since", help="where a first start begins (default: the current token)")
    parser.add_argument("--max-rows", type=int, default=20)
    parser.add_argument("--timeout-ms", type=int, default=500)
    raise SystemExit(main(parser.parse_args()))
