"""Monitoring reads never wait for a lock (issue 35; src/sql/monitoring.rs).

An exporter's scrape used to sit in Lock/relation for as long as an
operator's command held a lock on one of the extension's tables. Every
relation of the schema streampos, tables and indexes alike, found in
pg_class rather than listed here (a table a later version adds is covered
without a change to this file), is locked ACCESS EXCLUSIVE by another
session in turn; each monitoring read then answers or refuses with 55P03
at once, never running into its statement_timeout."""

import threading
import time

import psycopg
import pytest

from support import commit_ids, create_stream, expect_error, one, rows, wait_until

READS = [
    "SELECT count(*) FROM streampos.stat_streams",
    "SELECT count(*) FROM streampos.consumers",
    "SELECT count(*) FROM streampos.in_flight()",
    "SELECT count(*) FROM streampos.stat_registry",
]


def schema_relations(conn):
    """(name, kind) of every table and index of the schema streampos."""
    return rows(
        conn,
        "SELECT c.relname, c.relkind::text FROM pg_catalog.pg_class c "
        "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = 'streampos' AND c.relkind IN ('r', 'p', 'i') ORDER BY 1",
    )


def lock_exclusively(conn, name, kind):
    """In conn's open transaction: ACCESS EXCLUSIVE on the relation (an
    index: REINDEX INDEX, which holds it to the transaction's end)."""
    if kind == "i":
        conn.execute(f"REINDEX INDEX streampos.{name}")
    else:
        conn.execute(f"LOCK TABLE streampos.{name} IN ACCESS EXCLUSIVE MODE")


def read_at_once(conn, sql):
    """Run a monitoring read under a statement_timeout: (outcome, seconds);
    outcome 'rows' or the SQLSTATE of its error."""
    started = time.monotonic()
    try:
        conn.execute(sql).fetchall()
        outcome = "rows"
    except psycopg.Error as e:
        outcome = e.diag.sqlstate
    return outcome, time.monotonic() - started


@pytest.fixture
def watched(connect, db, stream):
    """A stream with a consumer behind it and stored positions, so every
    monitoring read has something to read."""
    create_stream(db, stream)
    db.execute("SELECT streampos.register_consumer(%s, 'pusher')", (stream,))
    commit_ids(db, stream, "persister1", 3)
    wait_until(
        lambda: one(db, "SELECT store_lag_ids FROM streampos.stat_streams WHERE stream_name = %s",
                    (stream,)) == 0,
        timeout=10, message="the worker's store",
    )
    return stream


def test_no_monitoring_read_waits_for_a_lock_on_any_relation_of_the_schema(connect, db, watched):
    reader = connect()
    reader.execute("SET statement_timeout = '3s'")
    relations = schema_relations(db)
    assert {"streams", "consumer_positions", "stream_frontiers", "frontier_marks"} <= {r[0] for r in relations}
    refused = {}
    for name, kind in relations:
        holder = connect()
        holder.execute("BEGIN")
        lock_exclusively(holder, name, kind)
        for sql in READS:
            outcome, seconds = read_at_once(reader, sql)
            assert outcome in ("rows", "55P03"), (name, sql, outcome)
            assert seconds < 2, (name, sql, seconds)
            if outcome == "55P03":
                refused.setdefault(name, []).append(sql)
        holder.execute("ROLLBACK")
        holder.close()
    # The registry is shared memory: it never refuses. stat_streams has a
    # stand-in for the stored frontier.
    assert not any("stat_registry" in sql for reads in refused.values() for sql in reads), refused
    assert "stream_frontiers" not in refused, refused
    assert any("consumers" in sql for sql in refused["consumer_positions"]), refused
    for sql in READS:
        assert read_at_once(reader, sql)[0] == "rows", sql


def test_a_lock_that_waits_is_not_queued_behind_either(connect, db, watched):
    """The usual case: an ALTER TABLE waits behind a long transaction, and
    every later reader of the table queues behind the ALTER."""
    long_reader = connect()
    long_reader.execute("BEGIN")
    long_reader.execute("SELECT count(*) FROM streampos.consumer_positions")
    alter = connect()
    alter.execute("SET lock_timeout = '20s'")
    alter.execute("BEGIN")
    alter_pid = one(alter, "SELECT pg_backend_pid()")
    t = threading.Thread(
        target=lambda: expect_error(alter, "LOCK TABLE streampos.consumer_positions IN ACCESS EXCLUSIVE MODE"),
    )
    t.start()
    try:
        wait_until(
            lambda: one(db, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (alter_pid,)) == "Lock",
            message="the LOCK TABLE to wait",
        )
        reader = connect()
        reader.execute("SET statement_timeout = '3s'")
        err = expect_error(reader, "SELECT * FROM streampos.consumers", sqlstate="55P03")
        assert str(err).startswith(
            'streampos.consumers cannot be read now: relation "streampos.consumer_positions" is locked'
        ), str(err)
        assert "monitoring reads do not wait for it" in err.diag.message_detail
        assert "pg_locks" in err.diag.message_hint
        # What does not read consumer_positions answers.
        assert read_at_once(reader, "SELECT * FROM streampos.stat_registry")[0] == "rows"
    finally:
        db.execute("SELECT pg_cancel_backend(%s)", (alter_pid,))
        t.join()
        alter.execute("ROLLBACK")
        long_reader.execute("ROLLBACK")


def test_stat_streams_shows_the_stored_frontier_the_worker_last_stored_while_its_table_is_locked(
    connect, db, watched
):
    stream = watched
    before = rows(db, "SELECT frontier, stored_frontier, store_lag_ids FROM streampos.stat_streams "
                      "WHERE stream_name = %s", (stream,))
    assert before == [(3, 3, 0)]
    holder = connect()
    holder.execute("BEGIN")
    holder.execute("LOCK TABLE streampos.stream_frontiers IN ACCESS EXCLUSIVE MODE")
    # The worker cannot store meanwhile: the stored frontier stays, the lag grows.
    commit_ids(db, stream, "persister1", 2)
    reader = connect()
    reader.execute("SET statement_timeout = '3s'")
    assert rows(reader, "SELECT frontier, stored_frontier, store_lag_ids FROM streampos.stat_streams "
                        "WHERE stream_name = %s", (stream,)) == [(5, 3, 2)]
    holder.execute("ROLLBACK")
    wait_until(
        lambda: rows(reader, "SELECT stored_frontier, store_lag_ids FROM streampos.stat_streams "
                             "WHERE stream_name = %s", (stream,)) == [(5, 0)],
        timeout=10, message="the worker's store after the lock",
    )


def test_a_stream_not_loaded_is_loaded_past_a_locked_table(connect, db, stream):
    """Reading a stream nobody used since it was created (or since
    start-up) loads it: its sequence is read, and its tables only in a
    promoted server's new history (test_failover covers that). So a lock
    on one of its tables (a migration's ALTER TABLE) refuses nothing here,
    and the reader holds no lock on a table it did not read (an
    adversary's review); a lock on its sequence refuses at once, naming
    it."""
    create_stream(db, stream)
    db.execute(f"CREATE TABLE {stream}_rows (id bigint PRIMARY KEY, instance_name text)")
    db.execute(f"SELECT streampos.add_table(%s, '{stream}_rows', 'id', 'instance_name')", (stream,))
    holder = connect()
    holder.execute("BEGIN")
    holder.execute(f"LOCK TABLE {stream}_rows IN ACCESS EXCLUSIVE MODE")
    reader = connect()
    reader.execute("SET statement_timeout = '3s'")
    reader.execute("BEGIN")
    assert read_at_once(reader, "SELECT * FROM streampos.stat_streams")[0] == "rows"
    reader_locks = one(db, "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                           "WHERE l.relation = %s::regclass AND a.pid = %s",
                       (f"{stream}_rows", reader.info.backend_pid))
    assert reader_locks == 0
    reader.execute("ROLLBACK")
    holder.execute("ROLLBACK")
    # The sequence: a fresh stream, not loaded by anything yet.
    other = f"{stream}_b"
    seq = create_stream(db, other)
    holder.execute("BEGIN")
    holder.execute(f"ALTER SEQUENCE {seq} RENAME TO {other}_renamed")  # ACCESS EXCLUSIVE
    err = expect_error(reader, "SELECT * FROM streampos.stat_streams", sqlstate="55P03")
    assert str(err).startswith(f'streampos.stat_streams cannot be read now: the sequence of stream "{other}" is locked'), str(err)
    assert "ALTER SEQUENCE" in err.diag.message_detail
    holder.execute("ROLLBACK")
    assert read_at_once(reader, "SELECT * FROM streampos.stat_streams")[0] == "rows"


def test_the_exporters_queries_do_not_wait_for_a_lock_on_a_view(connect, db, watched):
    """A view is locked while a query naming it is parsed, before its
    function can refuse: the exporter's queries call the functions, so a
    command holding the views' locks (ALTER EXTENSION UPDATE replaces
    consumers) holds no scrape (an adversary's review)."""
    import os

    import yaml

    path = os.path.join(os.path.dirname(__file__), "..", "..", "monitoring", "postgres_exporter_queries.yaml")
    queries = {name: spec["query"] for name, spec in yaml.safe_load(open(path)).items()}
    holder = connect()
    holder.execute("BEGIN")
    for view in ("stat_streams", "consumers", "stat_registry"):
        holder.execute(f"LOCK TABLE streampos.{view} IN ACCESS EXCLUSIVE MODE")
    reader = connect()
    reader.execute("SET statement_timeout = '3s'")
    for name, query in queries.items():
        assert read_at_once(reader, query)[0] == "rows", name
    # The views themselves wait (PostgreSQL's parse-time lock): what the
    # exporter's queries avoid.
    assert read_at_once(reader, "SELECT count(*) FROM streampos.consumers")[0] == "57014"
    holder.execute("ROLLBACK")
