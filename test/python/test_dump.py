"""pg_dump carries the catalog: streams, instances, tables, stored positions
and the streams' sequences survive a dump and restore into a new database."""

import os
import subprocess

from support import PG_BIN, PGHOST, PGPORT, connect_raw, create_stream, one, rows, wait_until


def pg(tool, *args):
    env = dict(os.environ, PGHOST=PGHOST, PGPORT=str(PGPORT), PGUSER="postgres")
    return subprocess.run([os.path.join(PG_BIN, tool), *args], check=True, capture_output=True, env=env, timeout=120)


def test_dump_and_restore_keep_streams_positions_and_sequences(connect, stream, tmp_path):
    conn = connect()
    create_stream(conn, stream, writers=["p1", "p2"])
    conn.execute(f"CREATE TABLE {stream} (id bigint PRIMARY KEY, instance_name text)")
    conn.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, stream))
    for w in ["p1", "p2", "p1"]:
        conn.execute(f"INSERT INTO {stream} VALUES (streampos.next_id(%s, %s), %s)", (stream, w, w))
    wait_until(
        lambda: one(conn, "SELECT count(*) FROM streampos.stream_positions WHERE stream_name = %s", (stream,)) == 2,
        message="stored positions",
    )
    catalog = """
        SELECT s.stream_name, s.seq::text, s.backwards, s.writers, t.tbl::text, t.id_column,
               (SELECT array_agg(instance_name || '=' || stream_id ORDER BY instance_name)
                  FROM streampos.stream_positions p WHERE p.stream_name = s.stream_name)
        FROM streampos.streams s LEFT JOIN streampos.stream_tables t USING (stream_name)
        WHERE s.stream_name = %s"""
    before = rows(conn, catalog, (stream,))
    instances_before = rows(conn, "SELECT instance_id, instance_name FROM streampos.instances ORDER BY 1")

    dump = tmp_path / "dump.sql"
    pg("pg_dump", "-d", "streampos_pytest", "-f", str(dump))
    target = f"restore_{stream}"[:60]
    with connect_raw("postgres") as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{target}"')
        admin.execute(f'CREATE DATABASE "{target}"')
    try:
        pg("psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", target, "-f", str(dump))
        with connect_raw(target) as restored:
            assert rows(restored, catalog, (stream,)) == before
            assert rows(restored, "SELECT instance_id, instance_name FROM streampos.instances ORDER BY 1") == instances_before
            # The restored stream continues where it was, with no ID reused.
            assert one(restored, "SELECT streampos.frontier(%s)", (stream,)) == 3
            assert one(restored, "SELECT streampos.next_id(%s, 'p2')", (stream,)) == 4
            # A new instance gets a new id, never a restored one.
            new_id = one(restored, "SELECT streampos.instance_id('brand_new_instance')")
            assert new_id > max(i for i, _ in instances_before)
    finally:
        with connect_raw("postgres") as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{target}" WITH (FORCE)')
