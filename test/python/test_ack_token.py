"""A consumer's batch under READ COMMITTED acknowledges the token updates()
returned just before in the same transaction, while another transaction
allocates many IDs at once: positions never go back for a later statement.

0.3.0 held an allocation between publishing its lower bound and recording
its WAL position (a pending entry, or a later next_ids of the transaction
into its entry) back for its own writer only. Another writer committing an
ID above the IDs the big allocation had already taken let updates() report
every other writer up to that ID; once the big allocation recorded a WAL
position not yet flushed, every writer was held from its first ID, so the
ack() statement's snapshot had "seen" less than updates() returned (22023
"token … is past the frontier"), and current_token() went back between two
statements. (The same gap let readers pass IDs whose sequence record was not
yet durable: after a crash they could be handed out again.)
"""

import psycopg
import pytest

from support import create_stream, flush_wal, one, sequence_value, wait_until

WRITERS = ["big", "w1", "w2"]
BIG = 200_000
ATTEMPTS = 20


def setup_stream(conn, stream):
    seq = create_stream(conn, stream, writers=WRITERS)
    conn.execute(f"CREATE TABLE {stream}_ev (id bigint PRIMARY KEY, instance_name text, body text)")
    conn.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, f"{stream}_ev"))
    for writer in WRITERS:
        write(conn, stream, writer)
    return seq


def write(conn, stream, writer):
    """One row of `writer` in a transaction of its own (its commit flushes)."""
    conn.execute("BEGIN")
    (i,) = one(conn, "SELECT streampos.next_ids(%s, %s, 1)", (stream, writer))
    conn.execute(f"INSERT INTO {stream}_ev VALUES (%s, %s, 'x')", (i, writer))
    conn.execute("COMMIT")
    return i


def start_big_allocation(db, big, stream, seq, pool):
    """`next_ids(stream, 'big', BIG)` in `big`'s open transaction, on a
    thread: its future, once the call has taken its first 2 000 IDs (or
    finished)."""
    start = sequence_value(db, seq)
    future = pool.submit(
        one,
        big,
        "SELECT x[1] FROM (SELECT streampos.next_ids(%s, 'big', %s) x) s",
        (stream, BIG),
    )
    wait_until(
        lambda: future.done() or sequence_value(db, seq) >= start + 2000,
        timeout=10,
        interval=0.001,
        message="the big allocation to be under way",
    )
    return future


def not_behind(conn, stream, token):
    """Is `token` at or before the stream's current token for this
    statement's snapshot?"""
    return one(
        conn,
        "SELECT streampos.advance(%s::streampos.multi_writer_token, t)::text = t::text "
        "FROM streampos.current_token(%s) t",
        (token, stream),
    )


@pytest.mark.parametrize("call", ["first", "later"])
def test_ack_takes_the_token_updates_returned_while_a_big_allocation_runs(connect, db, stream, pool, call):
    seq = setup_stream(db, stream)
    one(db, "SELECT streampos.register_consumer(%s, 'c')::text", (stream,))
    big, w1, consumer = connect(), connect(), connect()
    during = 0
    for attempt in range(ATTEMPTS):
        big.execute("BEGIN")
        if call == "later":
            # The transaction's entry exists, its WAL position durable: the
            # big call below reuses it (and moves its WAL position on).
            one(big, "SELECT streampos.next_ids(%s, 'big', 1)", (stream,))
            flush_wal(db)
        # Another writer commits above the IDs the big call has taken so far.
        future = start_big_allocation(db, big, stream, seq, pool)
        w1_id = write(w1, stream, "w1")
        consumer.execute("BEGIN")
        answer = one(
            consumer,
            "SELECT streampos.updates(%s, consumer => 'c', max_rows => 10000)",
            (stream,),
        )
        token = answer["token"]
        if not future.done():
            during += 1
        first = future.result(timeout=30)
        # The big call has recorded its WAL position (not flushed yet, unless
        # something committed meanwhile): a later statement of the same
        # transaction has seen at least what updates() returned.
        later = one(consumer, "SELECT streampos.current_token(%s)::text", (stream,))
        assert not_behind(consumer, stream, token), (
            f"attempt {attempt}: current_token went back from updates()' {token} to {later} "
            f"(big call from {first}, w1's ID {w1_id})"
        )
        try:
            one(consumer, "SELECT streampos.ack(%s, 'c', %s)::text", (stream, token))
        except psycopg.Error as e:
            consumer.execute("ROLLBACK")
            big.execute("ROLLBACK")
            pytest.fail(
                f"attempt {attempt}: ack refused the token updates() returned: "
                f"{e.diag.sqlstate} {e.diag.message_primary} ({e.diag.message_detail})"
            )
        consumer.execute("COMMIT")
        big.execute("ROLLBACK")
    assert during > 0, "the big allocation always finished before updates() ran: the machine is too fast for this test"


def test_a_plain_follower_is_never_handed_a_position_a_later_statement_has_not_seen(connect, db, stream, pool):
    """The same, for updates(stream, since) without a consumer: the token it
    returns is never ahead of the next statement's current token (never
    backwards), and every row at or below it is in the answers."""
    seq = setup_stream(db, stream)
    big, w1, follower = connect(), connect(), connect()
    token = "0"
    seen = set()
    for attempt in range(ATTEMPTS):
        big.execute("BEGIN")
        future = start_big_allocation(db, big, stream, seq, pool)
        write(w1, stream, "w1")
        answer = one(follower, "SELECT streampos.updates(%s, %s::streampos.multi_writer_token, 10000)", (stream, token))
        token = answer["token"]
        data = answer["data"]
        k = 0
        while k < len(data):
            _name, _position, count, _columns = data[k][:4]
            seen.update(r[0] for r in data[k + 1 : k + 1 + count])
            k += 1 + count
        future.result(timeout=30)
        assert not_behind(follower, stream, token), f"attempt {attempt}: the stream went back from {token}"
        big.execute("ROLLBACK")
    # Every committed row the final token covers was delivered.
    minimum, per_writer = parse_token(token)
    rows = db.execute(
        f"SELECT e.id, i.instance_id FROM {stream}_ev e "
        "JOIN streampos.instances i ON i.instance_name = e.instance_name"
    ).fetchall()
    missed = [i for i, w in rows if i <= per_writer.get(w, minimum) and i not in seen]
    assert not missed, f"rows at or below {token} never delivered: {missed[:10]}"


def parse_token(text):
    """(minimum, {instance_id: position}) of a multi-writer token's text."""
    if not text.startswith("m"):
        return int(text), {}
    head, *rest = text[1:].split("~")
    return int(head), {int(w): int(p) for w, p in (part.split(".") for part in rest)}
