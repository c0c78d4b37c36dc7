#!/usr/bin/env python3
"""A sync reader: what a homeserver's /sync does with room tokens.

    python sync_reader.py --dsn "dbname=synapse" --stream events --table events

It long-polls ``streampos.updates`` until some writer moves past its token,
takes ``streampos.current_room_token()`` as the upper bound, and pages the
events between its token and that bound with ``streampos.in_range`` (tokens
are bound as parameters, as objects). After a full page it resumes from
exactly where the page stopped, ``since.copy_and_advance(upper.bound(last))``
(Synapse's ``advance_multiwriter_sharded_token_after_partial_read``), so no
event is skipped or repeated. Events of writers that are ahead of the
minimum are delivered as soon as their writer's position covers them, each
writer's in order.

Prints each event as a JSON line. With ``--writers N`` it stops once it has
seen a ``{"done": true}`` event from N instances (see event_persister.py).
"""

import argparse
import json
import sys
import time

import psycopg

import streampos
from streampos import RoomStreamToken

PAGE_SQL = """
SELECT e.stream_ordering, e.instance_name, e.body
  FROM {table} e
  LEFT JOIN streampos.instances i ON i.instance_name = e.instance_name
 WHERE e.stream_ordering > %(low_min)s AND e.stream_ordering <= %(high_max)s
   AND streampos.in_range(%(low)s, %(high)s, i.instance_id, e.stream_ordering)
 ORDER BY e.stream_ordering
 LIMIT %(page)s
"""


def read_range(conn, table, since, upper, page):
    """Every event with since < position <= upper, in pages of ``page``."""
    query = PAGE_SQL.format(table=table)
    while True:
        params = {"low": since, "high": upper, "low_min": since.stream, "high_max": upper.get_max_stream_pos()}
        rows = conn.execute(query, {**params, "page": page}).fetchall()
        yield from rows
        if len(rows) < page:
            return
        since = since.copy_and_advance(upper.bound_stream_token(rows[-1][0]))


def main(args):
    deadline = time.monotonic() + args.max_seconds
    since = RoomStreamToken.parse(args.since)
    done = set()
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        streampos.register(conn)
        while args.writers is None or len(done) < args.writers:
            if time.monotonic() > deadline:
                print(f"gave up after {args.max_seconds}s; done writers: {sorted(done)}", file=sys.stderr)
                return 2
            # Wait (server side) until some writer moves past our token.
            conn.execute(
                "SELECT streampos.updates(%s, %s, 1, %s)", (args.stream, since.to_multi_writer(), args.timeout_ms)
            )
            # A later statement: it sees every row the bound covers.
            upper = conn.execute("SELECT streampos.current_room_token(%s)", (args.stream,)).fetchone()[0]
            upper = since.copy_and_advance(upper)
            for stream_ordering, instance, body in read_range(conn, args.table, since, upper, args.page):
                print(json.dumps({"id": stream_ordering, "instance": instance, "body": body}), flush=True)
                if body.get("done"):
                    done.add(instance)
            since = upper
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True, help="libpq connection string")
    parser.add_argument("--stream", default="events")
    parser.add_argument("--table", default="events")
    parser.add_argument("--since", default="s0", help="room token to start after")
    parser.add_argument("--page", type=int, default=20)
    parser.add_argument("--timeout-ms", type=int, default=2000, help="long-poll timeout")
    parser.add_argument("--writers", type=int, help="stop after done events from this many instances")
    parser.add_argument("--max-seconds", type=float, default=120.0)
    sys.exit(main(parser.parse_args()))
