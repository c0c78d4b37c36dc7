"""Many followers of one stream at once (issue 33): each gets exactly the
answer the contract gives it alone, whatever the others ask.

- Followers at different positions, asking for different numbers of rows,
  in both forms, while writers commit and roll back: each ends with
  exactly the rows committed after its start, each once, each writer's in
  ID order (checked against what the writers committed).
- A follower that may not read a column, among followers that may: it is
  refused (42501) at once, never after waiting, while the others go on;
  and a follower whose privilege is revoked while it waits gets no row of
  a commit after the revoke (42501), never more than it may see.
"""

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from support import connect_raw, create_stream, expect_error, one, rows, wait_until

WRITERS = ["w1", "w2", "w3"]


def feed(conn, stream):
    create_stream(conn, stream, writers=WRITERS)
    conn.execute(f"CREATE TABLE {stream}_ev (id bigint PRIMARY KEY, instance_name text, body text, secret text)")
    conn.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, f"{stream}_ev"))


def ids_of(answer):
    """The (id, writer) pairs of an updates answer (json or jsonb), and
    whether it was limited."""
    if isinstance(answer, str):
        answer = json.loads(answer)
    out, data, i = [], answer["data"], 0
    while i < len(data):
        count = data[i][2]
        out += [(row[0], row[1]) for row in data[i + 1:i + 1 + count]]
        i += 1 + count
    return answer["token"], answer["limited"], out


def test_followers_at_different_positions_each_get_exactly_their_rows(connect, stream):
    admin = connect()
    feed(admin, stream)
    # Rows before any follower starts: the followers start at different
    # places among them.
    with connect_raw() as w:
        for k in range(30):
            w.execute("BEGIN")
            i = one(w, "SELECT streampos.next_id(%s, %s)", (stream, WRITERS[k % 3]))
            w.execute(f"INSERT INTO {stream}_ev VALUES (%s, %s, 'b', 's')", (i, WRITERS[k % 3]))
            w.execute("COMMIT")
    starts = ["0"]
    with connect_raw() as c:
        starts.append(one(c, "SELECT streampos.current_token(%s)::text", (stream,)))
        # A token in the middle: the one an answer of 10 rows from 0 gives.
        starts.append(ids_of(one(c, "SELECT streampos.updates(%s, '0', 10, 0)", (stream,)))[0])
    stop, writers_done = threading.Event(), threading.Event()

    def writer(name, seed):
        rng = random.Random(seed)
        with connect_raw() as w:
            while not stop.is_set():
                w.execute("BEGIN")
                for i in one(w, "SELECT streampos.next_ids(%s, %s, %s)", (stream, name, rng.randint(1, 3))):
                    w.execute(f"INSERT INTO {stream}_ev VALUES (%s, %s, 'x', 's')", (i, name))
                time.sleep(rng.random() * 0.005)
                w.execute("ROLLBACK" if rng.random() < 0.1 else "COMMIT")

    def follower(since, max_rows, function):
        got = []
        with connect_raw() as c:
            while not stop.is_set():
                since, limited, ids = ids_of(one(c, f"SELECT streampos.{function}(%s, %s, %s, 300)",
                                                 (stream, since, max_rows)))
                # Its own limit, not another follower's: one row per ID
                # here, so a cut answer has exactly max_rows rows.
                assert len(ids) <= max_rows and (not limited or len(ids) == max_rows), \
                    (max_rows, limited, len(ids))
                got += ids
            # Drain, once the writers are done: everything they committed.
            writers_done.wait(60)
            limited = True
            while limited:
                since, limited, ids = ids_of(one(c, f"SELECT streampos.{function}(%s, %s, 1000, 0)",
                                                 (stream, since)))
                got += ids
        return got

    shapes = [(start, max_rows, function) for start in starts for max_rows in (1, 7, 100)
              for function in ("updates", "updates_json")]
    with ThreadPoolExecutor(len(WRITERS) + len(shapes)) as pool:
        followers = [pool.submit(follower, *shape) for shape in shapes]
        time.sleep(0.3)
        writers = [pool.submit(writer, name, k) for k, name in enumerate(WRITERS)]
        time.sleep(3)
        stop.set()
        for w in writers:
            w.result(timeout=30)
        writers_done.set()
        results = [f.result(timeout=60) for f in followers]
    committed = rows(admin, f"SELECT id, instance_name FROM {stream}_ev ORDER BY id")
    assert len(committed) > 60
    for (start, max_rows, function), got in zip(shapes, results):
        # What a follower from `start` must get: every row not covered by
        # the start token.
        with connect_raw() as c:
            before = {r[0] for r in rows(c, f"SELECT id FROM {stream}_ev WHERE streampos.in_range("
                                            "'0'::streampos.multi_writer_token, %s::streampos.multi_writer_token, "
                                            "streampos.instance_id(instance_name), id)", (start,))}
        expected = [(i, w) for i, w in committed if i not in before]
        label = f"from {start!r}, {max_rows} rows, {function}"
        assert len(got) == len(set(got)), f"a row delivered twice ({label})"
        assert sorted(got) == expected, f"rows missed or foreign ({label})"
        for name in WRITERS:
            mine = [i for i, w in got if w == name]
            assert mine == sorted(mine), f"{name}'s rows out of order ({label})"


def test_a_follower_that_may_not_see_a_column_is_refused_among_followers_that_may(connect, stream):
    admin = connect()
    feed(admin, stream)
    all_columns, some_columns = f"{stream}_all", f"{stream}_some"
    for role in (all_columns, some_columns):
        admin.execute(f"DROP ROLE IF EXISTS {role}")
        admin.execute(f"CREATE ROLE {role}")
    admin.execute(f"GRANT SELECT ON {stream}_ev TO {all_columns}")
    admin.execute(f"GRANT SELECT (id, instance_name, body) ON {stream}_ev TO {some_columns}")
    token = one(admin, "SELECT streampos.current_token(%s)::text", (stream,))

    def follow(role, timeout_ms=3000):
        with connect_raw() as c:
            c.execute(f"SET ROLE {role}")
            return ids_of(one(c, "SELECT streampos.updates_json(%s, %s, 100, %s)", (stream, token, timeout_ms)))

    def commit_row(body):
        with connect_raw() as w:
            w.execute("BEGIN")
            i = one(w, "SELECT streampos.next_id(%s, 'w1')", (stream,))
            w.execute(f"INSERT INTO {stream}_ev VALUES (%s, 'w1', %s, 'secret')", (i, body))
            w.execute("COMMIT")
        return i

    with ThreadPoolExecutor(4) as pool:
        waiting = [pool.submit(follow, all_columns) for _ in range(3)]
        time.sleep(0.3)
        # Refused at once, while the others wait: never after waiting.
        started = time.monotonic()
        with connect_raw() as c:
            c.execute(f"SET ROLE {some_columns}")
            expect_error(c, "SELECT streampos.updates_json(%s, %s, 100, 3000)", (stream, token), "42501")
        assert time.monotonic() - started < 2.5, "refused only after waiting (3 s)"
        first = commit_row("a")
        for f in waiting:
            assert f.result(timeout=10)[2] == [(first, "w1")]

    # Revoked while a follower waits (its backend seen waiting in the call):
    # the row committed after the revoke is never in its answer, which is
    # 42501.
    token = one(admin, "SELECT streampos.current_token(%s)::text", (stream,))
    with ThreadPoolExecutor(2) as pool:
        revoked = pool.submit(follow, all_columns, 10000)
        others = pool.submit(follow, "postgres", 10000)
        wait_until(lambda: one(admin, "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
                                      "AND wait_event_type = 'Extension' AND query LIKE '%%updates_json%%'") >= 2,
                   timeout=10, message="both followers to wait")
        admin.execute(f"REVOKE SELECT ON {stream}_ev FROM {all_columns}")
        admin.execute(f"GRANT SELECT (id, instance_name, body) ON {stream}_ev TO {all_columns}")
        second = commit_row("b")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            revoked.result(timeout=15)
        assert others.result(timeout=15)[2] == [(second, "w1")]
    for role in (all_columns, some_columns):
        admin.execute(f"DROP OWNED BY {role}")
        admin.execute(f"DROP ROLE {role}")
