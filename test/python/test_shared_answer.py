"""One read for many (src/shared_answer.rs): a follower whose question
another follower has just answered, with a snapshot taken during its call,
copies that answer instead of reading the tables. The tests see it by what
a read would wait for: a lock on the table that the copying follower never
needs, and the settings, transactions and privileges under which it must
read for itself (or be refused) all the same.

Each test: follower B answers once, then long-polls with a batch window
(streampos.follower_batch_ms) that keeps it from answering for a while
after it is woken; a writer commits a row; follower A reads (and
publishes) at once; then a session takes ACCESS EXCLUSIVE on the table.
B, when its window ends, either copies A's answer (never touching the
table) or reads for itself and waits for the lock (lock_timeout: 55P03)."""

import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

import support
from support import create_stream, one

WINDOW_MS = 1000
READER = "streampos_shared_reader"


def setup(connect, stream):
    db = connect()
    create_stream(db, stream)
    db.execute(f"CREATE TABLE {stream}_ev (id bigint PRIMARY KEY, instance_name text, body text)")
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, f"{stream}_ev"))
    db.execute(f"INSERT INTO {stream}_ev SELECT streampos.next_id(%s, 'w1'), 'w1', 'first'", (stream,))
    return db


def scene(connect, stream, b, prepare=None, before_call=None, after_publish=None, b_sql=None):
    """B answers once, then long-polls (in a thread) while a row commits, A
    reads it, and a session locks the table; returns (B's answer or its
    exception, A's answer)."""
    db = setup(connect, stream)
    table = f"{stream}_ev"
    if prepare:
        prepare(db)
    b.execute(f"SET streampos.follower_batch_ms = {WINDOW_MS}")
    b.execute("SET lock_timeout = '1s'")
    token = one(b, "SELECT streampos.updates_json(%s, '0')", (stream,))["token"]
    if before_call:
        before_call()
    locker = connect()
    with ThreadPoolExecutor(1) as pool:
        def call():
            try:
                return one(b, b_sql or "SELECT streampos.updates_json(%s, %s, 100, 20000)::text", (stream, token))
            except psycopg.Error as e:
                return e
        waiting = pool.submit(call)
        time.sleep(0.1)
        db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w1'), 'w1', 'second'", (stream,))
        a = one(connect(), "SELECT streampos.updates_json(%s, %s, 100, 0)::text", (stream, token))
        assert '"second"' in a
        if after_publish:
            after_publish()
        locker.execute("BEGIN")
        locker.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        try:
            got = waiting.result(timeout=20)
        finally:
            locker.execute("ROLLBACK")
    return got, a


def test_a_follower_copies_the_answer_read_during_its_call(connect, stream):
    """B is answered with A's answer, byte for byte, while the table is
    locked against any read."""
    b = connect()
    got, a = scene(connect, stream, b)
    assert got == a


def test_a_transaction_that_has_written_reads_for_itself(connect, stream):
    """B's transaction has an xid (it wrote elsewhere): its own read counts
    its own rows, so it reads, and waits for the lock."""
    b = connect()
    b.execute(f"CREATE TABLE {stream}_other (x int)")

    def write_first():
        b.execute("BEGIN")
        b.execute(f"INSERT INTO {stream}_other VALUES (1)")

    got, _ = scene(connect, stream, b, before_call=write_first)
    b.execute("ROLLBACK")
    assert isinstance(got, psycopg.errors.LockNotAvailable), got


def test_another_setting_is_another_question(connect, stream):
    """B prints bigints as strings, A does not: B reads for itself."""
    b = connect()
    b.execute("SET streampos.json_bigint_as_string = on")
    got, _ = scene(connect, stream, b)
    assert isinstance(got, psycopg.errors.LockNotAvailable), got


def test_the_jsonb_form_is_another_question(connect, stream):
    """B asks updates() (jsonb), A answered updates_json: B reads."""
    b = connect()
    got, _ = scene(connect, stream, b, b_sql="SELECT streampos.updates(%s, %s, 100, 20000)::text")
    assert isinstance(got, psycopg.errors.LockNotAvailable), got


def test_a_revoke_while_waiting_is_refused_not_answered(connect, stream):
    """B's role loses SELECT while it waits; A (allowed) publishes: B is
    checked again before it copies, and refused (42501)."""
    role = support.ensure_login_role(READER)
    db = connect()
    b = connect(user=role)
    got, _ = scene(connect, stream, b,
                   prepare=lambda d: d.execute(f"GRANT SELECT ON {stream}_ev TO {role}"),
                   after_publish=lambda: db.execute(f"REVOKE SELECT ON {stream}_ev FROM {role}"))
    assert isinstance(got, psycopg.errors.InsufficientPrivilege), got


def test_a_late_caller_does_not_take_an_answer_read_before_its_call(connect, stream):
    """An answer read before a follower's call began is not this call's
    own: C, whose call begins after A read, reads for itself."""
    db = setup(connect, stream)
    table = f"{stream}_ev"
    token = one(db, "SELECT streampos.updates_json(%s, '0')", (stream,))["token"]
    db.execute(f"INSERT INTO {table} SELECT streampos.next_id(%s, 'w1'), 'w1', 'second'", (stream,))
    one(connect(), "SELECT streampos.updates_json(%s, %s, 100, 0)", (stream, token))
    locker = connect()
    locker.execute("BEGIN")
    locker.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
    try:
        c = connect()
        c.execute("SET lock_timeout = '300ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            c.execute("SELECT streampos.updates_json(%s, %s, 100, 0)", (stream, token))
    finally:
        locker.execute("ROLLBACK")
