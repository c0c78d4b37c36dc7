#!/usr/bin/env python3
"""An event persister: one homeserver process that writes events.

Start several, each with its own instance name (a writer of the stream):

    python event_persister.py --dsn "dbname=synapse" --stream events \\
        --table events --instance event_persister1 --events 100

Each event is written the way a homeserver would, with a few tasks at once
so that transactions finish out of order:

* most take their stream ID with ``get_next_txn`` inside the transaction that
  inserts the row: ID and row become visible together;
* some use ``get_next()``, Synapse's context manager: the row is written by
  another transaction inside the context, and the ID is finished when the
  context exits;
* some are rolled back after taking an ID, leaving a gap readers must skip.

Finally each writes a ``{"done": true}`` event, so that a reader knows when
it has seen everything. The table needs (stream_ordering bigint, instance_name
text, body jsonb). Prints one JSON line: the IDs committed and rolled back.
"""

import argparse
import asyncio
import json
import random

import psycopg
from psycopg.types.json import Jsonb

import streampos


async def persist(args, gen, k, committed, aborted, rng):
    body = {"instance": args.instance, "seq": k}
    insert = f"INSERT INTO {args.table} (stream_ordering, instance_name, body) VALUES (%s, %s, %s)"
    async with await psycopg.AsyncConnection.connect(args.dsn) as conn:
        if k % 5 == 4:
            async with gen.get_next() as stream_id:
                await asyncio.sleep(rng.random() * 0.01)
                await conn.execute(insert, (stream_id, args.instance, Jsonb(body)))
                await conn.commit()
            committed.append(stream_id)
            return
        stream_id = await gen.get_next_txn(conn)
        await conn.execute(insert, (stream_id, args.instance, Jsonb(body)))
        # Hold the transaction a little: later IDs overtake this one.
        await asyncio.sleep(rng.random() * 0.01)
        if k % 7 == 6:
            await conn.rollback()
            aborted.append(stream_id)
        else:
            await conn.commit()
            committed.append(stream_id)


async def main(args):
    rng = random.Random(args.instance)
    committed, aborted = [], []
    gen = await streampos.MultiWriterIdGenerator.create(
        args.dsn, stream_name=args.stream, instance_name=args.instance
    )
    try:
        queue = list(range(args.events))

        async def worker():
            while queue:
                await persist(args, gen, queue.pop(0), committed, aborted, rng)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        async with await psycopg.AsyncConnection.connect(args.dsn) as conn:
            stream_id = await gen.get_next_txn(conn)
            await conn.execute(
                f"INSERT INTO {args.table} (stream_ordering, instance_name, body) VALUES (%s, %s, %s)",
                (stream_id, args.instance, Jsonb({"instance": args.instance, "done": True})),
            )
            await conn.commit()
        committed.append(stream_id)
        await gen.refresh()
        summary = {
            "instance": args.instance,
            "committed": sorted(committed),
            "aborted": sorted(aborted),
            "position": gen.get_current_token_for_writer(args.instance),
        }
        print(json.dumps(summary), flush=True)
    finally:
        await gen.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True, help="libpq connection string")
    parser.add_argument("--stream", default="events")
    parser.add_argument("--table", default="events")
    parser.add_argument("--instance", required=True, help="this process's writer name")
    parser.add_argument("--events", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
