"""The registry's stream slots (streampos.max_streams) come back when their
streams are dropped, or their database is."""

import psycopg

from support import connect_raw, create_stream, one


def test_slots_of_a_dropped_database_are_reused(connect, stream):
    conn = connect()
    size = int(one(conn, "SHOW streampos.max_streams"))
    scratch = f"reclaim_{stream}"[:60]
    with connect_raw("postgres") as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{scratch}"')
        admin.execute(f'CREATE DATABASE "{scratch}"')
    try:
        with connect_raw(scratch) as other:
            other.execute("CREATE EXTENSION streampos")
            # Every slot taken (reading a stream is enough to take one).
            for i in range(size):
                create_stream(other, f"s{i}")
                try:
                    other.execute("SELECT streampos.frontier(%s)", (f"s{i}",))
                except psycopg.Error as e:  # full already: other tests' streams
                    assert e.diag.sqlstate == "53400"
                    break
    finally:
        with connect_raw("postgres") as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{scratch}" WITH (FORCE)')
    # The registry is full of the dropped database's streams: they are
    # reclaimed rather than refusing a stream of a live database.
    create_stream(conn, stream)
    assert one(conn, "SELECT streampos.next_id(%s, 'w')", (stream,)) == 1
    assert one(conn, "SELECT streampos.frontier(%s)", (stream,)) == 1
