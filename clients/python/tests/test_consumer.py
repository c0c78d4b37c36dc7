"""streampos.Consumer: rows through updates(consumer => …), acknowledged in
the transaction that processes them; and the federation sender example,
killed with SIGKILL again and again, ends with every committed event in
its outbox exactly once."""

import json
import random
import signal
import time
from collections import Counter

import pytest

import streampos
from client_support import conninfo, connect, wait_until
from test_examples import WRITERS, spawn


def setup_events(db, stream):
    table = f"{stream}_events"
    db.execute("SELECT streampos.create_stream(%s, writers => %s)", (stream, WRITERS))
    db.execute(f"CREATE TABLE {table} (stream_ordering bigint PRIMARY KEY, instance_name text NOT NULL, body jsonb)")
    db.execute("SELECT streampos.add_table(%s, %s, 'stream_ordering', 'instance_name')", (stream, table))
    return table


def write(db, stream, table, writer, n):
    with db.transaction():
        ids = db.execute("SELECT streampos.next_ids(%s, %s, %s)", (stream, writer, n)).fetchone()[0]
        for i in ids:
            db.execute(f"INSERT INTO {table} VALUES (%s, %s, '{{}}')", (i, writer))
    return ids


def test_a_batch_commits_with_its_acknowledgement(db, stream):
    table = setup_events(db, stream)
    write(db, stream, table, WRITERS[0], 2)
    with connect() as conn:
        consumer = streampos.Consumer(conn, stream, "c", max_rows=10, timeout_ms=0)
        assert consumer.position() is None
        assert consumer.register(since="0") == streampos.MultiWriterToken(0)
        assert consumer.register() == streampos.MultiWriterToken(0), "a restart keeps the position"
        conn.execute(f"CREATE TEMP TABLE seen (id bigint)")
        with pytest.raises(RuntimeError):
            with consumer.batch() as batch:
                assert [r["stream_ordering"] for r in batch.tables[f"public.{table}"].dicts()] == [1, 2]
                conn.execute("INSERT INTO seen VALUES (1)")
                raise RuntimeError("processing failed")
        assert consumer.position() == streampos.MultiWriterToken(0)
        assert conn.execute("SELECT count(*) FROM seen").fetchone()[0] == 0
        with consumer.batch() as batch:
            assert len(batch) == 2 and not batch.limited
            conn.execute("INSERT INTO seen SELECT pg_catalog.unnest(%s::bigint[])", ([1, 2],))
        assert consumer.position() == streampos.MultiWriterToken(2)
        with consumer.batch() as batch:
            assert len(batch) == 0
        # A consumer reading with its own query: nothing past its position
        # (the wait times out there), then a commit wakes it.
        assert consumer.wait(timeout_ms=50) == streampos.MultiWriterToken(2)
        write(db, stream, table, WRITERS[0], 1)
        assert consumer.wait() == streampos.MultiWriterToken(3)
        assert consumer.unregister() is True
        assert consumer.position() is None


def ids_in(output):
    return [e["id"] for e in map(json.loads, output.splitlines()) if "id" in e]


def test_federation_sender_survives_sigkill(db, stream):
    table = setup_events(db, stream)
    outbox = f"{stream}_outbox"
    db.execute(f"CREATE TABLE {outbox} (stream_ordering bigint, instance_name text)")
    dsn = conninfo()
    # From the first event on: registered before anything is written (the
    # example registers at the current token on its first start).
    db.execute("SELECT streampos.register_consumer(%s, 'sender', '0')", (stream,))
    sender_args = ("federation_sender.py", "--dsn", dsn, "--stream", stream, "--consumer", "sender",
                   "--outbox", outbox, "--max-rows", "7", "--timeout-ms", "200")
    persisters = [
        spawn("event_persister.py", "--dsn", dsn, "--stream", stream, "--table", table, "--instance", name,
              "--events", "80", "--concurrency", "4")
        for name in WRITERS
    ]
    rng = random.Random(5)
    printed = []
    kills = 0
    sender = spawn(*sender_args)
    try:
        while any(p.poll() is None for p in persisters) or kills < 6:
            # Long enough for the process to start and take some batches.
            time.sleep(rng.uniform(0.4, 1.2))
            sender.send_signal(signal.SIGKILL)
            out, _ = sender.communicate(timeout=30)
            printed += ids_in(out)
            kills += 1
            sender = spawn(*sender_args)
        summaries = []
        for proc in persisters:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            summaries.append(json.loads(out))
        final = db.execute("SELECT streampos.current_token(%s)::text", (stream,)).fetchone()[0]
        wait_until(
            lambda: db.execute(
                "SELECT count(*) FROM streampos.consumer_positions WHERE stream_name = %s "
                "AND consumer_name = 'sender' "
                "AND streampos.is_before_or_eq(%s::streampos.multi_writer_token, position)",
                (stream, final),
            ).fetchone()[0] == 1,
            timeout=60,
            message="the sender caught up",
        )
        # Stopped cleanly once it has installed its signal handlers.
        assert json.loads(sender.stdout.readline()) == {"started": True}
        sender.send_signal(signal.SIGTERM)
        out, err = sender.communicate(timeout=30)
        assert sender.returncode == 0, err
        printed += ids_in(out)
    finally:
        for proc in [sender, *persisters]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    committed = sorted(i for s in summaries for i in s["committed"])
    queued = [r[0] for r in db.execute(f"SELECT stream_ordering FROM {outbox}").fetchall()]
    assert [i for i, n in Counter(queued).items() if n > 1] == [], "an event queued twice"
    assert sorted(queued) == committed, "an event lost"
    # Outside the database: at least once.
    assert set(printed) == set(committed)
    print(f"\n  {len(committed)} events, sender killed {kills} times, "
          f"{len(printed) - len(set(printed))} printed again after a kill")


def test_a_connection_not_in_autocommit_is_refused(db, stream):
    setup_events(db, stream)
    with connect(autocommit=False) as conn:
        with pytest.raises(ValueError, match="autocommit"):
            streampos.Consumer(conn, stream, "c")


def test_another_roles_session_holding_the_consumers_lock_is_an_error_not_a_wait(db, stream):
    """Issue 31: every lock a client takes for mutual exclusion is one no
    other role can take, or has a bound. Any role can take the consumer's
    advisory lock (its key is in the source); the consumer used to wait for
    it forever. A second process of the same role still waits for the
    first; a session of another role holding it is 55P03 at once, naming
    it."""
    import psycopg

    setup_events(db, stream)
    role = "streampos_client_squatter"
    if not db.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
        db.execute(f"CREATE ROLE {role} LOGIN")
    with connect() as conn, connect(user=role) as squatter:
        consumer = streampos.Consumer(conn, stream, "c", timeout_ms=0)
        consumer.register(since="0")
        key, text = consumer._lock_key()
        squatter.execute("SELECT pg_advisory_lock(%s::int4, hashtext(%s))", (key, text))
        started = time.monotonic()
        with pytest.raises(psycopg.errors.LockNotAvailable, match=role):
            with consumer.batch():
                pass
        assert time.monotonic() - started < 5
        squatter.execute("SELECT pg_advisory_unlock_all()")
        with consumer.batch() as batch:
            assert len(batch) == 0


def test_a_prepared_transaction_holding_the_consumers_lock_is_an_error_not_a_wait(db, stream):
    """The adversary's variant: a prepared transaction holds the consumer's
    lock (transaction-level, kept by PREPARE TRANSACTION): no session is
    its holder, and the consumer waited for good."""
    import psycopg

    if int(db.execute("SHOW max_prepared_transactions").fetchone()[0]) == 0:
        pytest.skip("max_prepared_transactions = 0")
    setup_events(db, stream)
    with connect() as conn, connect() as squatter:
        consumer = streampos.Consumer(conn, stream, "c", timeout_ms=0)
        consumer.register(since="0")
        key, text = consumer._lock_key()
        gid = f"{stream}_squat"
        squatter.execute("BEGIN")
        squatter.execute("SELECT pg_advisory_xact_lock(%s::int4, hashtext(%s))", (key, text))
        squatter.execute(f"PREPARE TRANSACTION '{gid}'")
        try:
            with pytest.raises(psycopg.errors.LockNotAvailable, match="prepared transaction"):
                with consumer.batch():
                    pass
        finally:
            db.execute(f"ROLLBACK PREPARED '{gid}'")
        with consumer.batch() as batch:
            assert len(batch) == 0
