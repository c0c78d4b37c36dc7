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


def test_a_dropped_streams_slot_is_kept_while_a_snapshot_may_still_see_it(connect, stream):
    """A snapshot from before a drop_stream still sees the stream, and asks
    about it (a cursor, a REPEATABLE READ transaction, or the same snapshot
    imported elsewhere): its answer comes from the stream's registry slot.
    With every slot taken, that slot used to be given to the next new stream
    at once, and the importer got XX000 (the sequence was gone). It is kept
    until every snapshot sees the drop; other slots are reclaimed first, and
    with none left a new stream gets 53400."""
    db = connect()
    create_stream(db, stream)
    one(db, "SELECT streampos.next_ids(%s, 'w', 5)", (stream,))
    exporter = connect()
    exporter.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    snapshot = one(exporter, "SELECT pg_export_snapshot()")
    assert one(exporter, "SELECT streampos.frontier(%s)", (stream,)) == 5
    db.execute("SELECT streampos.drop_stream(%s)", (stream,))
    size = int(one(db, "SHOW streampos.max_streams"))
    scratch = f"keep_{stream}"[:60]
    with connect_raw("postgres") as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{scratch}"')
        admin.execute(f'CREATE DATABASE "{scratch}"')
    try:
        with connect_raw(scratch) as other:
            other.execute("CREATE EXTENSION streampos")
            full = None
            for i in range(size + 1):
                create_stream(other, f"s{i}")
                try:
                    other.execute("SELECT streampos.frontier(%s)", (f"s{i}",))
                except psycopg.Error as e:
                    full = e.diag.sqlstate
                    break
            assert full == "53400", "the registry never filled up"
        importer = connect()
        importer.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        importer.execute(f"SET TRANSACTION SNAPSHOT '{snapshot}'")
        assert one(importer, "SELECT streampos.frontier(%s)", (stream,)) == 5
        importer.execute("ROLLBACK")
    finally:
        exporter.execute("ROLLBACK")
        with connect_raw("postgres") as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{scratch}" WITH (FORCE)')
