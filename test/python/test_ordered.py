"""Ordered delivery: updates_json(…, ordered => true) gives rows only up to
the stream's frontier, so that across a follower's calls every row comes in
global ID order (event-store projections assume it), while the per-writer
form gives a writer's rows as soon as that writer finished them. Checked
against real concurrent writers and a model of what was committed."""

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from support import create_stream, expect_error, one
from test_followers import parse_updates

WRITERS = ["w1", "w2", "w3"]


def feed(conn, stream, tables=("ev",)):
    create_stream(conn, stream, writers=WRITERS)
    for t in tables:
        conn.execute(f"CREATE TABLE {stream}_{t} (id bigint PRIMARY KEY, instance_name text, body text)")
        conn.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, f"{stream}_{t}"))


def answer(conn, stream, since, ordered, max_rows=100, timeout_ms=0):
    """(token, limited, every row's ID in the answer's order, tables merged
    in ID order)."""
    got = one(conn, "SELECT streampos.updates_json(%s, %s, %s, %s, ordered => %s)",
              (stream, since, max_rows, timeout_ms, ordered))
    token, limited, tables = parse_updates(got)
    ids = sorted(row[0] for rows in tables.values() for row in rows)
    return token, limited, ids


def test_a_slower_writer_holds_ordered_delivery_at_the_frontier(connect, stream):
    """w1 takes ID 1 and has not committed; w2 commits 2 and 3. The
    per-writer form gives 2 and 3 now (and 1 later, out of order); the
    ordered form gives nothing until 1 is committed, then 1, 2, 3, and its
    tokens are plain positions."""
    db = connect()
    feed(db, stream)
    slow = connect()
    slow.execute("BEGIN")
    slow.execute(f"INSERT INTO {stream}_ev SELECT streampos.next_id(%s, 'w1'), 'w1', 'slow'", (stream,))
    for _ in range(2):
        db.execute(f"INSERT INTO {stream}_ev SELECT streampos.next_id(%s, 'w2'), 'w2', 'fast'", (stream,))

    token, _, ids = answer(db, stream, "0", ordered=False)
    assert ids == [2, 3] and token.startswith("m")
    assert answer(db, stream, "0", ordered=True) == ("0", False, [])
    slow.execute("COMMIT")
    assert answer(db, stream, "0", ordered=True) == ("3", False, [1, 2, 3])
    # The per-writer follower gets the late row after the rows above it.
    assert answer(db, stream, token, ordered=False)[2] == [1]
    # From a per-writer token, ordered delivery repeats nothing.
    _, _, from_writer_token = answer(db, stream, token, ordered=True)
    assert from_writer_token == [1]


def test_an_ordered_long_poll_waits_for_the_frontier_not_for_any_writer(connect, stream):
    """A long-polling ordered follower at the frontier is not answered by a
    faster writer's commit above a running transaction's ID; it is woken by
    that transaction's commit."""
    db = connect()
    feed(db, stream)
    db.execute(f"INSERT INTO {stream}_ev SELECT streampos.next_id(%s, 'w2'), 'w2', 'first'", (stream,))
    slow = connect()
    slow.execute("BEGIN")
    slow.execute(f"INSERT INTO {stream}_ev SELECT streampos.next_id(%s, 'w1'), 'w1', 'slow'", (stream,))
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(answer, connect(), stream, "1", True, 100, 20000)
        time.sleep(0.2)
        db.execute(f"INSERT INTO {stream}_ev SELECT streampos.next_id(%s, 'w2'), 'w2', 'fast'", (stream,))
        time.sleep(0.5)
        assert not waiting.done(), "an ordered follower was answered past a running transaction's ID"
        slow.execute("COMMIT")
        assert waiting.result(timeout=15) == ("3", False, [2, 3])


def test_ordered_answers_are_cut_at_max_rows_and_continue(connect, stream):
    """max_rows cuts an ordered answer at an ID boundary: the next call
    continues exactly there, across both tables of the stream."""
    db = connect()
    feed(db, stream, tables=("ev", "delta"))
    for i in range(7):
        db.execute(f"INSERT INTO {stream}_{['ev', 'delta'][i % 2]} "
                   f"SELECT streampos.next_id(%s, %s), %s, 'r'", (stream, WRITERS[i % 3], WRITERS[i % 3]))
    since, got = "0", []
    while True:
        since, limited, ids = answer(db, stream, since, ordered=True, max_rows=3)
        got += ids
        if not limited:
            break
    assert got == list(range(1, 8)) and since == "7"


def test_a_consumer_reads_in_order(connect, stream):
    """A consumer's ordered batches start at its acknowledged position, and
    the token acknowledged moves it as any token does; a NULL `ordered` is a
    NULL answer, as for any other argument."""
    db = connect()
    feed(db, stream)
    db.execute("SELECT streampos.register_consumer(%s, 'projector', '0')", (stream,))
    for w in ("w1", "w2", "w3"):
        db.execute(f"INSERT INTO {stream}_ev SELECT streampos.next_id(%s, %s), %s, 'r'", (stream, w, w))
    got = one(db, "SELECT streampos.updates_json(%s, consumer => 'projector', ordered => true)", (stream,))
    token, _, tables = parse_updates(got)
    assert [r[0] for r in tables[f"public.{stream}_ev"]] == [1, 2, 3] and token == "3"
    db.execute("SELECT streampos.ack(%s, 'projector', %s)", (stream, token))
    assert one(db, "SELECT position::text FROM streampos.consumers WHERE stream_name = %s "
               "AND consumer_name = 'projector'", (stream,)) == "3"
    assert one(db, "SELECT streampos.updates_json(%s, '0', ordered => NULL) IS NULL", (stream,))
    expect_error(db, "SELECT streampos.updates_json(%s, ordered => true)", (stream,), "22023")


@pytest.mark.parametrize("seed", [1, 2])
def test_concurrent_writers_reach_an_ordered_follower_in_id_order(connect, stream, seed):
    """Three writers commit, hold their transactions a while and roll back
    at random, over two tables, while an ordered follower long-polls: every
    ID it is given is above every ID it was given before (the model: the
    highest ID delivered so far), and at the end it has exactly the
    committed rows, each once. A per-writer follower beside it gets the same
    rows, not always in ID order (that order is what ordered delivery adds)."""
    db = connect()
    feed(db, stream, tables=("ev", "delta"))
    committed, lock, stop, errors = set(), threading.Lock(), threading.Event(), []

    def writer(name, k):
        rng = random.Random(seed * 10 + k)
        conn = connect()
        try:
            for _ in range(40):
                conn.execute("BEGIN")
                table = f"{stream}_{rng.choice(['ev', 'delta'])}"
                new = [one(conn, f"INSERT INTO {table} SELECT streampos.next_id(%s, %s), %s, 'x' RETURNING id",
                           (stream, name, name)) for _ in range(rng.randint(1, 3))]
                time.sleep(rng.random() * 0.01)
                if rng.random() < 0.2:
                    conn.execute("ROLLBACK")
                else:
                    conn.execute("COMMIT")
                    with lock:
                        committed.update(new)
        except Exception as e:  # reported below
            errors.append(repr(e))

    def follower(ordered, out):
        conn, since, highest = connect(), "0", 0
        try:
            while True:
                done = stop.is_set()
                since, limited, ids = answer(conn, stream, since, ordered, max_rows=5, timeout_ms=200)
                if ordered and ids and ids[0] <= highest:
                    errors.append(f"ordered follower got {ids[0]} after {highest}")
                highest = max([highest] + ids)
                out.extend(ids)
                if done and not limited and not ids:
                    return
        except Exception as e:  # reported below
            errors.append(repr(e))

    ordered_rows, writer_rows = [], []
    followers = [threading.Thread(target=follower, args=(True, ordered_rows)),
                 threading.Thread(target=follower, args=(False, writer_rows))]
    writers = [threading.Thread(target=writer, args=(w, k)) for k, w in enumerate(WRITERS)]
    for t in followers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in followers:
        t.join(timeout=60)
    assert not errors, errors[:3]
    assert sorted(ordered_rows) == sorted(committed) and len(ordered_rows) == len(set(ordered_rows))
    assert ordered_rows == sorted(ordered_rows)
    assert sorted(writer_rows) == sorted(committed) and len(writer_rows) == len(set(writer_rows))
