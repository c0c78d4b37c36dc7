"""pg_upgrade of a database that uses streampos, from one PostgreSQL
version to a later one (README, "Supported versions"): streams, writers,
committed rows, stored positions and frontiers, and indexes on token
columns, upgraded, then used.

pg_upgrade moves the data files (tables, sequences, indexes) as they are
and recreates the catalog with the same OIDs; the registry in shared memory
starts from the sequences, as after any restart. So after the upgrade the
same state must be reported, allocation must continue above every ID
handed out before, and an index built by the old server over token values
must agree with the new server's comparison functions.
"""

import time

import pytest

from conftest import run, work_dir
from test_upgrade import catalog

DB = "streampos_upgrade"


def one(conn, sql, params=None):
    row = conn.execute(sql, params).fetchone()
    assert row is not None, sql
    return row[0]


def rows(conn, sql, params=None):
    return conn.execute(sql, params).fetchall()


def wait_until(predicate, message, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {message}"
        time.sleep(0.05)


def write(conn, stream, writer, n):
    """One transaction of ``writer`` committing ``n`` rows, each with a
    room token and a multi-writer token made from its ID."""
    conn.execute(
        """
        INSERT INTO events
        SELECT id, %(writer)s,
               (CASE id %% 3 WHEN 0 THEN 's' || id
                            WHEN 1 THEN 't' || (id %% 40) || '-' || id
                            ELSE 'm' || id || '~1.' || (id + 1 + id %% 7) || '~2.' || (id + 2) END
               )::streampos.room_stream_token,
               (CASE id %% 2 WHEN 0 THEN id::text
                            ELSE 'm' || id || '~1.' || (id + 1 + id %% 5) END)::streampos.multi_writer_token
        FROM unnest(streampos.next_ids(%(stream)s, %(writer)s, %(n)s)) AS id
        """,
        dict(stream=stream, writer=writer, n=n),
    )


def populate(conn):
    conn.execute("CREATE EXTENSION streampos")
    conn.execute("SELECT streampos.create_stream('events', writers => ARRAY['w1', 'w2'])")
    conn.execute("SELECT streampos.create_stream('backfill', backwards => true)")
    conn.execute(
        """
        CREATE TABLE events (
            stream_ordering bigint PRIMARY KEY,
            instance_name text NOT NULL,
            token streampos.room_stream_token NOT NULL,
            mw streampos.multi_writer_token NOT NULL
        )
        """
    )
    conn.execute("CREATE INDEX events_token ON events (token)")
    conn.execute("CREATE INDEX events_mw ON events (mw)")
    conn.execute("CREATE INDEX events_token_hash ON events USING hash (token)")
    conn.execute("SELECT streampos.add_table('events', 'events', 'stream_ordering', 'instance_name')")
    for _ in range(5):
        write(conn, "events", "w1", 200)
        write(conn, "events", "w2", 100)
    # A rolled-back allocation: a gap below the highest ID.
    conn.execute("BEGIN")
    conn.execute("SELECT streampos.next_ids('events', 'w2', 7)")
    conn.execute("ROLLBACK")
    write(conn, "events", "w1", 3)
    conn.execute("SELECT streampos.next_ids('backfill', 'b1', 25)")
    # The position worker stores every writer's position and the frontier.
    wait_until(
        lambda: stored(conn) == writer_positions(conn, "events")
        and one(conn, "SELECT stream_id FROM streampos.stream_frontiers WHERE stream_name = 'events'")
        == one(conn, "SELECT streampos.frontier('events')"),
        "the position worker to store the positions",
    )


def stored(conn):
    return rows(
        conn,
        "SELECT instance_name, stream_id FROM streampos.stream_positions "
        "WHERE stream_name = 'events' ORDER BY 1",
    )


def writer_positions(conn, stream):
    return rows(conn, "SELECT instance_name, stream_id FROM streampos.writer_positions(%s) ORDER BY 1", (stream,))


def state(conn):
    """Everything the upgrade must keep, as the server reports it."""
    return {
        "version": one(conn, "SELECT extversion FROM pg_extension WHERE extname = 'streampos'"),
        "streams": rows(conn, "SELECT stream_name, backwards, writers FROM streampos.streams ORDER BY 1"),
        "instances": rows(conn, "SELECT instance_id, instance_name FROM streampos.instances ORDER BY 1"),
        "max_allocated": [one(conn, "SELECT streampos.max_allocated(%s)", (s,)) for s in ("events", "backfill")],
        "frontier": [one(conn, "SELECT streampos.frontier(%s)", (s,)) for s in ("events", "backfill")],
        "current_token": one(conn, "SELECT streampos.current_token('events')::text"),
        "room_token": one(conn, "SELECT streampos.current_room_token('events')::text"),
        "writer_positions": writer_positions(conn, "events"),
        "stored": stored(conn),
        "frontiers": rows(conn, "SELECT stream_name, stream_id FROM streampos.stream_frontiers ORDER BY 1"),
        "rows": one(conn, "SELECT count(*) FROM events"),
        "tokens": one(conn, "SELECT array_agg(token::text ORDER BY stream_ordering) FROM events"),
        "multi_writer_tokens": one(conn, "SELECT array_agg(mw::text ORDER BY stream_ordering) FROM events"),
    }


QUERIES = [
    "SELECT array_agg(stream_ordering ORDER BY token, stream_ordering) FROM events WHERE token < 's600'",
    "SELECT array_agg(stream_ordering ORDER BY token, stream_ordering) FROM events "
    "WHERE token > 't5-20' AND token <= 'm900~1.903~2.902'",
    "SELECT array_agg(stream_ordering ORDER BY stream_ordering) FROM events WHERE token = 's999'",
    "SELECT array_agg(stream_ordering ORDER BY mw, stream_ordering) FROM events WHERE mw >= 'm700~1.702'",
    "SELECT count(*) FROM events WHERE token = 'm500~1.502~2.502'",
]


def index_agrees_with_a_sequential_scan(conn):
    """The indexes the old server built answer what a sequential scan
    answers on the new one, and amcheck finds every heap row in them in
    the new server's order."""
    conn.execute("SET search_path = public, streampos")
    conn.execute("SET enable_seqscan = off")
    conn.execute("SET enable_bitmapscan = off")
    by_index = []
    for q in QUERIES:
        plan = "\n".join(r[0] for r in rows(conn, "EXPLAIN " + q))
        assert "Index" in plan, plan
        by_index.append(one(conn, q))
    conn.execute("RESET enable_seqscan")
    conn.execute("SET enable_indexscan = off")
    conn.execute("SET enable_indexonlyscan = off")
    by_scan = []
    for q in QUERIES:
        plan = "\n".join(r[0] for r in rows(conn, "EXPLAIN " + q))
        assert "Seq Scan" in plan, plan
        by_scan.append(one(conn, q))
    assert by_index == by_scan
    assert all(r for r in by_index[:4]), by_index
    for key in ("enable_bitmapscan", "enable_indexscan", "enable_indexonlyscan", "search_path"):
        conn.execute(f"RESET {key}")
    conn.execute("CREATE EXTENSION IF NOT EXISTS amcheck")
    for index in ("events_token", "events_mw", "events_pkey"):
        conn.execute("SELECT bt_index_check(%s::regclass, true)", (index,))


# Not from Debian's 15: its 15.20 gives every column a vendor attribute
# option (pg_attver) that it will not reset and that stock PostgreSQL
# refuses when pg_upgrade restores the schema, whatever the database holds
# (README, "Supported versions").
@pytest.mark.parametrize("old_version,new_version", [(16, 17), (14, 18)], ids=["16-to-17", "14-to-18"])
def test_pg_upgrade(servers, old_version, new_version):
    name = f"upgrade-{old_version}-{new_version}"
    old = servers(old_version, f"{name}-old").start()
    assert old.server_version() == old_version
    with old.connect() as admin:
        admin.execute(f"CREATE DATABASE {DB}")
    with old.connect(DB) as conn:
        populate(conn)
        before = state(conn)
        index_agrees_with_a_sequential_scan(conn)
    assert before["rows"] == 5 * 300 + 3
    assert before["frontier"][0] == before["max_allocated"][0] == 1510
    old.stop()

    new = servers(new_version, f"{name}-new")
    run(
        [new.tool("pg_upgrade"), "-b", old.bin, "-B", new.bin, "-d", old.data, "-D", new.data,
         "-p", str(old.port), "-P", str(new.port), "-U", "postgres"],
        cwd=work_dir(f"{name}-run"),
    )
    new.start()
    assert new.server_version() == new_version

    with new.connect(DB) as conn:
        after = state(conn)
        assert after == before
        index_agrees_with_a_sequential_scan(conn)

        # The catalog is what a fresh install on the new version makes.
        with new.connect() as admin:
            admin.execute("CREATE DATABASE fresh")
        with new.connect("fresh") as fresh:
            fresh.execute("CREATE EXTENSION streampos")
            want = catalog(fresh)
        got = catalog(conn)
        for part in want:
            assert got[part] == want[part], f"{part} differs after pg_upgrade"

        # Allocation continues above every ID handed out before (the gap
        # included), and the frontier and tokens follow.
        highest = before["max_allocated"][0]
        conn.execute("BEGIN")
        first = one(conn, "SELECT streampos.next_id('events', 'w2')")
        assert first > highest
        # In flight: the frontier stays where it was.
        with new.connect(DB) as other:
            assert one(other, "SELECT streampos.frontier('events')") == before["frontier"][0]
            assert one(other, "SELECT count(*) FROM streampos.in_flight('events')") == 1
        conn.execute(
            "INSERT INTO events VALUES (%s, 'w2', ('s' || %s)::streampos.room_stream_token, %s::text::streampos.multi_writer_token)",
            (first, first, first),
        )
        conn.execute("COMMIT")
        write(conn, "events", "w1", 10)
        last = one(conn, "SELECT max(stream_ordering) FROM events")
        assert last == first + 10
        assert one(conn, "SELECT streampos.frontier('events')") == last
        assert one(conn, "SELECT streampos.max_allocated('events')") == last
        assert writer_positions(conn, "events") == [("w1", last), ("w2", last)]
        assert one(conn, "SELECT streampos.current_token('events')::text") == str(last)
        assert one(conn, "SELECT streampos.current_room_token('events')::text") == f"s{last}"
        # A backward stream continues below its lowest ID.
        lowest = before["max_allocated"][1]
        assert one(conn, "SELECT streampos.next_id('backfill', 'b1')") == lowest - 1
        # The position worker of the new server stores the new positions.
        wait_until(lambda: stored(conn) == [("w1", last), ("w2", last)], "the new positions to be stored")
        # The indexes took the new rows in the new server's order.
        index_agrees_with_a_sequential_scan(conn)
        assert one(conn, "SELECT count(*) FROM events WHERE token OPERATOR(streampos.=) ('s' || %s)::streampos.room_stream_token", (first,)) == 1
    new.stop()
