"""The database-backed MultiWriterIdGenerator, through every scenario of
Synapse's tests/storage/test_id_generators.py, against a real server.

Rows are written the way Synapse's test helpers write them (``insert_rows``:
one transaction that takes IDs from the stream and inserts rows as a given
instance), but the IDs come from ``streampos.next_id``, and the positions
come from the database rather than from in-memory bookkeeping. Where a value
differs from Synapse's, the test says what Synapse answers and why:

* streampos streams start at 0 and hand out 1 first (Synapse's start at 1);
* the database knows that an idle writer holds nothing back, so after a read
  positions are at least Synapse's (``at_least_synapse``);
* between reads the view holds only facts: what the database said and what
  ``advance`` reported. It does not guess, as Synapse does, that a run of
  positions has no gap or that an idle local writer is at the highest ID
  allocated anywhere (an ID another writer holds can be handed out again
  after a crash until the WAL is flushed; only the database knows).
"""

import asyncio

import psycopg
import pytest

from client_support import conninfo, connect, crash_and_restart_server, run
from streampos import MultiWriterIdGenerator, MultiWriterToken, NotAWriterError, SyncMultiWriterIdGenerator

# ------------------------------------------------------------------ helpers


def create_stream(db, stream, writers=None, backwards=False, tables=("rows",)):
    """The stream, and tables of rows (stream_id, instance_name, data)
    registered with it (Synapse's foobar tables)."""
    db.execute(
        "SELECT streampos.create_stream(%s, backwards => %s, writers => %s::text[])", (stream, backwards, writers)
    )
    for table in tables:
        db.execute(
            f"CREATE TABLE {stream}_{table} (stream_id bigint NOT NULL, instance_name text NOT NULL, data text)"
        )
        db.execute("SELECT streampos.add_table(%s, %s, 'stream_id', 'instance_name')", (stream, f"{stream}_{table}"))


def insert_rows(db, stream, instance, number, table="rows"):
    """Synapse's _insert_rows: ``number`` rows as ``instance``, IDs from the
    stream, in one transaction."""
    with db.transaction():
        for _ in range(number):
            db.execute(
                f"INSERT INTO {stream}_{table} (stream_id, instance_name) SELECT streampos.next_id(%s, %s), %s",
                (stream, instance, instance),
            )


async def insert_row(stream, instance, stream_id, table="rows"):
    """Synapse's _insert_row: the row for an ID held by a generator's
    context, written by other code in its own transaction."""
    async with await psycopg.AsyncConnection.connect(conninfo(), autocommit=True) as conn:
        await conn.execute(
            f"INSERT INTO {stream}_{table} (stream_id, instance_name) VALUES (%s, %s)", (stream_id, instance)
        )


async def generator(stream, instance="master", writers=None, **kwargs):
    return await MultiWriterIdGenerator.create(
        conninfo(), stream_name=stream, instance_name=instance, writers=writers, **kwargs
    )


def replicate(gens, instance):
    """Synapse's _replicate: tell every other generator where ``instance``
    is, as replication would."""
    token = gens[instance].get_current_token_for_writer(instance)
    for name, gen in gens.items():
        if name != instance:
            gen.advance(instance, token)


def replicate_all(gens):
    for instance in list(gens):
        replicate(gens, instance)


def at_least_synapse(ours, synapse, positive=True):
    """Our positions after a read are at or past Synapse's, never behind."""
    sign = 1 if positive else -1
    assert set(ours) == set(synapse), (ours, synapse)
    assert all(ours[k] * sign >= synapse[k] * sign for k in ours), (ours, synapse)


def frontier(db, stream):
    return db.execute("SELECT streampos.frontier(%s)", (stream,)).fetchone()[0]


def in_flight_ids(db, stream):
    return db.execute(
        "SELECT instance_name, min_id, max_id FROM streampos.in_flight(%s) ORDER BY min_id", (stream,)
    ).fetchall()


async def close_all(*gens):
    for gen in gens:
        await gen.close()


# ------------------------------------------------------------------ MultiWriterIdGeneratorTestCase


def test_empty(db, stream):
    create_stream(db, stream)

    async def main():
        gen = await generator(stream, writers=["master"])
        # Synapse: {"master": 1} (its streams start at 1, streampos's at 0).
        assert gen.get_positions() == {"master": 0}
        assert gen.get_current_token() == 0
        assert gen.get_current_token_for_writer("master") == 0
        assert gen.get_minimal_local_current_token() == 0
        assert await gen.get_max_allocated_token() == 0
        async with gen.get_next() as stream_id:
            assert stream_id == 1
        assert gen.get_positions() == {"master": 1}
        await gen.close()

    run(main())


def test_single_instance(db, stream):
    create_stream(db, stream, writers=["master"])
    insert_rows(db, stream, "master", 7)

    async def main():
        gen = await generator(stream, writers=["master"])
        assert gen.get_positions() == {"master": 7}
        assert gen.get_current_token_for_writer("master") == 7

        async with gen.get_next() as stream_id:
            assert stream_id == 8
            assert gen.get_positions() == {"master": 7}
            assert gen.get_current_token_for_writer("master") == 7
            # Not only the view: the database says 8 is in flight.
            await gen.refresh()
            assert gen.get_positions() == {"master": 7}
            assert frontier(db, stream) == 7
            assert in_flight_ids(db, stream) == [("master", 8, 8)]

        assert gen.get_positions() == {"master": 8}
        assert gen.get_current_token_for_writer("master") == 8
        assert frontier(db, stream) == 8
        await gen.close()

    run(main())


class StallAfterAllocating(psycopg.AsyncConnection):
    """A connection that, once armed, stops after ``next_ids`` has run: the
    point where a cancellation reaches Synapse's ``__aenter__``."""

    armed = False
    allocated: asyncio.Event

    async def execute(self, query, params=None, **kwargs):
        cur = await super().execute(query, params, **kwargs)
        if type(self).armed and "next_ids" in str(query):
            type(self).armed = False
            type(self).allocated.set()
            await asyncio.Event().wait()  # until cancelled
        return cur


def test_cancelled_enter_does_not_wedge_position(db, stream):
    create_stream(db, stream, writers=["master"])
    insert_rows(db, stream, "master", 7)

    async def main():
        StallAfterAllocating.allocated = asyncio.Event()

        async def connect_stalling():
            return await StallAfterAllocating.connect(conninfo(), autocommit=True)

        gen = await generator(stream, writers=["master"], connect=connect_stalling)
        assert gen.get_current_token_for_writer("master") == 7

        async def presence_like_write():
            async with gen.get_next():
                pass

        StallAfterAllocating.armed = True
        write = asyncio.get_running_loop().create_task(presence_like_write())
        await StallAfterAllocating.allocated.wait()
        # ID 8 is allocated and in flight when the request is cancelled.
        assert in_flight_ids(db, stream) == [("master", 8, 8)]
        write.cancel()
        with pytest.raises(asyncio.CancelledError):
            await write
        # The cancelled __aenter__ rolled its transaction back before
        # re-raising: nothing is left in flight, and the position moved on.
        assert in_flight_ids(db, stream) == []
        assert frontier(db, stream) == 8

        async with gen.get_next() as stream_id:
            assert stream_id == 9
        assert gen.get_current_token_for_writer("master") == 9
        await gen.close()

    run(main())


def test_cancelled_while_the_allocation_waits(db, stream):
    """A cancellation that arrives while next_ids itself is running: psycopg
    cancels the query and the transaction is rolled back."""
    create_stream(db, stream, writers=["master"])
    insert_rows(db, stream, "master", 2)

    async def main():
        gen = await generator(stream, writers=["master"])
        blocker = connect()
        blocker.execute("BEGIN")
        # next_id reads the stream's catalog row: hold it away.
        blocker.execute("LOCK TABLE streampos.streams IN ACCESS EXCLUSIVE MODE")
        try:

            async def write():
                async with gen.get_next():
                    pass

            task = asyncio.get_running_loop().create_task(write())
            await asyncio.sleep(0.5)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert in_flight_ids(db, stream) == []
        async with gen.get_next() as stream_id:
            assert stream_id == 3
        assert gen.get_current_token() == 3
        await gen.close()

    run(main())


def test_out_of_order_finish(db, stream):
    create_stream(db, stream, writers=["master"])
    insert_rows(db, stream, "master", 7)

    async def main():
        gen = await generator(stream, writers=["master"])
        assert gen.get_positions() == {"master": 7}
        ctx1, ctx2, ctx3, ctx4 = (gen.get_next() for _ in range(4))
        s1, s2, s3, s4 = [await c.__aenter__() for c in (ctx1, ctx2, ctx3, ctx4)]
        assert (s1, s2, s3, s4) == (8, 9, 10, 11)
        assert gen.get_positions() == {"master": 7}

        # The same numbers as Synapse's, now read from the database at each
        # exit.
        for ctx, expected in ((ctx2, 7), (ctx1, 9), (ctx4, 9), (ctx3, 11)):
            await ctx.__aexit__(None, None, None)
            assert gen.get_positions() == {"master": expected}
            assert gen.get_current_token_for_writer("master") == expected
            assert frontier(db, stream) == expected
        await gen.close()

    run(main())


def test_get_next_txn(db, stream):
    create_stream(db, stream, writers=["master"])
    insert_rows(db, stream, "master", 7)

    async def main():
        gen = await generator(stream, writers=["master"])
        assert gen.get_positions() == {"master": 7}
        async with await psycopg.AsyncConnection.connect(conninfo()) as txn:
            stream_id = await gen.get_next_txn(txn)
            assert stream_id == 8
            await txn.execute(f"INSERT INTO {stream}_rows VALUES (%s, 'master')", (stream_id,))
            assert gen.get_positions() == {"master": 7}
            await gen.refresh()
            assert gen.get_current_token_for_writer("master") == 7
            # Another session cannot see row 8 yet, and the frontier says so.
            assert frontier(db, stream) == 7
            await txn.commit()
        # The transaction's end is the ID's end; the view learns it on its
        # next read (or at once with start_watching, below).
        await gen.refresh()
        assert gen.get_positions() == {"master": 8}
        assert gen.get_current_token_for_writer("master") == 8
        assert gen.get_minimal_local_current_token() == 8

        # Rolled back: the ID is a gap, and the position passes it.
        async with await psycopg.AsyncConnection.connect(conninfo()) as txn:
            assert await gen.get_next_txn(txn) == 9
            await txn.rollback()
        await gen.refresh()
        assert gen.get_positions() == {"master": 9}

        # Several IDs in one transaction.
        async with await psycopg.AsyncConnection.connect(conninfo()) as txn:
            assert await gen.get_next_mult_txn(txn, 3) == [10, 11, 12]
            await txn.commit()
        await gen.refresh()
        assert gen.get_current_token() == 12
        await gen.close()

    run(main())


def test_get_next_txn_needs_a_transaction(db, stream):
    create_stream(db, stream, writers=["master"])

    async def main():
        gen = await generator(stream)
        async with await psycopg.AsyncConnection.connect(conninfo(), autocommit=True) as conn:
            with pytest.raises(psycopg.ProgrammingError, match="open transaction"):
                await gen.get_next_txn(conn)
            async with conn.transaction():
                assert await gen.get_next_txn(conn.cursor()) == 1
        await gen.close()

    run(main())


def test_watching_keeps_the_view_current(db, stream):
    """start_watching() stands in for replication: commits elsewhere move
    the view without refresh() or advance()."""
    create_stream(db, stream, writers=["master", "other"])

    async def main():
        gen = await generator(stream)
        gen.start_watching(timeout_ms=5000)
        async with await psycopg.AsyncConnection.connect(conninfo()) as txn:
            assert await gen.get_next_txn(txn) == 1
            await txn.commit()
        await wait_async(lambda: gen.get_positions() == {"master": 1, "other": 1}, "the watcher to see 1")
        # Another writer's transaction, in flight then committed.
        other = connect()
        other.execute("BEGIN")
        other.execute("SELECT streampos.next_id(%s, 'other')", (stream,))
        await wait_async(lambda: gen.get_positions() == {"master": 2, "other": 1}, "the watcher to see 2 allocated")
        assert gen.get_current_token() == 1
        assert gen.get_current_multi_writer_token() == MultiWriterToken.parse(
            "m1~%d.2" % db.execute("SELECT streampos.instance_id('master')").fetchone()[0]
        )
        other.execute("COMMIT")
        other.close()
        await wait_async(lambda: gen.get_current_token() == 2, "the watcher to see 2 finished")
        await gen.close()

    run(main())


async def wait_async(predicate, message, timeout=10.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {message}")
        await asyncio.sleep(0.02)


def test_exception_in_context_rolls_back(db, stream):
    create_stream(db, stream, writers=["master"])

    async def main():
        gen = await generator(stream)
        with pytest.raises(RuntimeError):
            async with gen.get_next() as stream_id:
                assert stream_id == 1
                raise RuntimeError("persisting failed")
        # Either way the ID is finished: a gap, and the position passes it.
        assert gen.get_current_token() == 1
        assert in_flight_ids(db, stream) == []
        async with gen.get_next_mult(3) as ids:
            assert ids == [2, 3, 4]
        assert gen.get_current_token() == 4
        await gen.close()

    run(main())


def test_restart_during_out_of_order_persistence(db, stream):
    """Another worker (a new generator object) starts while a writer's
    contexts are open and finishing out of order."""
    create_stream(db, stream, writers=["master"])
    insert_rows(db, stream, "master", 7)

    async def main():
        gen = await generator(stream, writers=["master"])
        ctx1, ctx2 = gen.get_next(), gen.get_next()
        s1, s2 = await ctx1.__aenter__(), await ctx2.__aenter__()
        assert (s1, s2) == (8, 9)
        await insert_row(stream, "master", s2)
        await ctx2.__aexit__(None, None, None)
        assert gen.get_positions() == {"master": 7}

        worker = await generator(stream, "worker", writers=["master"])
        # The restarted worker does not see the second persisted row.
        assert worker.get_positions() == {"master": 7}
        assert worker.get_current_token_for_writer("master") == 7

        await insert_row(stream, "master", s1)
        await ctx1.__aexit__(None, None, None)
        assert gen.get_positions() == {"master": 9}
        worker.advance("master", 9)
        assert worker.get_positions() == {"master": 9}

        # Yet another worker started now reads 9 straight away.
        late = await generator(stream, "late_worker", writers=["master"])
        assert late.get_positions() == {"master": 9}

        # And when the earlier ID is aborted instead, the position passes
        # the gap as soon as it ends.
        ctx3, ctx4 = gen.get_next(), gen.get_next()
        s3, s4 = await ctx3.__aenter__(), await ctx4.__aenter__()
        assert (s3, s4) == (10, 11)
        await insert_row(stream, "master", s4)
        await ctx4.__aexit__(None, None, None)
        await late.refresh()
        assert late.get_positions() == {"master": 9}
        await ctx3.__aexit__(RuntimeError, RuntimeError("aborted"), None)
        await late.refresh()
        assert late.get_positions() == {"master": s4}
        rows = db.execute(f"SELECT stream_id FROM {stream}_rows WHERE stream_id > 7 ORDER BY 1").fetchall()
        assert rows == [(8,), (9,), (s4,)]
        await close_all(gen, worker, late)

    run(main())


# ------------------------------------------------------------------ WorkerMultiWriterIdGeneratorTestCase


def test_get_persisted_upto_position(db, stream):
    create_stream(db, stream, writers=["first", "second"])
    insert_rows(db, stream, "first", 3)
    insert_rows(db, stream, "second", 2)

    async def main():
        gen = await generator(stream, "worker", writers=["first", "second"])
        # Synapse: {"first": 3, "second": 5} and 3, from stream_positions;
        # the database knows "first" has nothing in flight.
        assert gen.get_positions() == {"first": 5, "second": 5}
        assert gen.get_persisted_upto_position() == 5

        first, second = connect(), connect()

        async def step(expected_positions, expected_upto):
            await gen.refresh()
            assert gen.get_positions() == expected_positions
            assert gen.get_persisted_upto_position() == expected_upto

        first.execute("BEGIN")
        first.execute("SELECT streampos.next_id(%s, 'first')", (stream,))  # 6, in flight
        second.execute("SELECT streampos.next_id(%s, 'second')", (stream,))  # 7, committed
        await step({"first": 5, "second": 7}, 5)
        first.execute("COMMIT")
        await step({"first": 7, "second": 7}, 7)
        second.execute("BEGIN")
        second.execute("SELECT streampos.next_id(%s, 'second')", (stream,))  # 8, in flight
        first.execute("SELECT streampos.next_id(%s, 'first')", (stream,))  # 9, committed
        await step({"first": 9, "second": 7}, 7)
        second.execute("COMMIT")
        await step({"first": 9, "second": 9}, 9)
        # Jump forward with gaps: two aborted IDs, then four committed.
        first.execute("BEGIN")
        first.execute("SELECT streampos.next_ids(%s, 'first', 2)", (stream,))
        first.execute("ROLLBACK")
        second.execute("SELECT streampos.next_ids(%s, 'second', 4)", (stream,))
        await step({"first": 15, "second": 15}, 15)
        first.close()
        second.close()

        # advance() alone, as in Synapse's test: the current token is the
        # lowest writer position. Synapse also jumps over runs of positions
        # it believes gapless (6, then 7, 9); streampos's positions include
        # other writers' in-flight IDs, so such a run proves nothing here.
        fresh = await generator(stream, "worker2", writers=["first", "second"])
        for instance, position, expected in [
            ("first", 16, 15), ("second", 17, 16), ("second", 19, 16), ("first", 18, 18), ("first", 21, 19),
            ("second", 25, 21),
        ]:
            fresh.advance(instance, position)
            assert fresh.get_persisted_upto_position() == expected, (instance, position)
        # advance never moves anything back.
        fresh.advance("first", 3)
        assert fresh.get_positions() == {"first": 21, "second": 25}
        await close_all(gen, fresh)

    run(main())


def test_get_persisted_upto_position_get_next(db, stream):
    create_stream(db, stream, writers=["first", "second"])
    insert_rows(db, stream, "first", 3)
    insert_rows(db, stream, "second", 2)

    async def main():
        gen = await generator(stream, "first", writers=["first", "second"])
        assert gen.get_positions() == {"first": 5, "second": 5}
        assert gen.get_persisted_upto_position() == 5
        async with gen.get_next() as stream_id:
            assert stream_id == 6
            assert gen.get_persisted_upto_position() == 5
        assert gen.get_persisted_upto_position() == 6
        await gen.close()

    run(main())


def test_multi_instance(db, stream):
    writers = ["first", "second"]
    create_stream(db, stream, writers=writers)

    async def main():
        insert_rows(db, stream, "first", 3)
        first = await generator(stream, "first", writers=writers)
        insert_rows(db, stream, "second", 4)
        second = await generator(stream, "second", writers=writers)
        gens = {"first": first, "second": second}
        replicate_all(gens)

        # Synapse's numbers for the first generator's view, from the same
        # facts: its own start (3) and what replication said (7).
        assert first.get_positions() == {"first": 3, "second": 7}
        assert first.get_current_token_for_writer("second") == 7
        # Synapse answers 7 for "first" by inference; a read says so.
        assert first.get_current_token_for_writer("first") == 3
        await first.refresh()
        assert first.get_current_token_for_writer("first") == 7
        at_least_synapse(first.get_positions(), {"first": 3, "second": 7})
        at_least_synapse(second.get_positions(), {"first": 3, "second": 7})
        assert second.get_current_token_for_writer("first") == 7
        assert second.get_current_token_for_writer("second") == 7

        async with first.get_next() as stream_id:
            assert stream_id == 8
            assert first.get_positions() == {"first": 7, "second": 7}
            assert second.get_positions() == {"first": 7, "second": 7}
            assert first.get_persisted_upto_position() == 7
        at_least_synapse(first.get_positions(), {"first": 8, "second": 7})
        # The second generator has not read or heard of it...
        assert second.get_positions() == {"first": 7, "second": 7}

        # ... but its next ID is unique all the same.
        async with second.get_next() as stream_id:
            assert stream_id == 9
            assert second.get_positions() == {"first": 7, "second": 7}
        at_least_synapse(second.get_positions(), {"first": 3, "second": 9})
        second.advance("first", 8)
        at_least_synapse(second.get_positions(), {"first": 8, "second": 9})
        assert second.get_positions() == {"first": 9, "second": 9}
        await close_all(first, second)

    run(main())


def test_multi_instance_empty_row(db, stream):
    writers = ["first", "second", "third"]
    create_stream(db, stream, writers=writers)

    async def main():
        insert_rows(db, stream, "first", 3)
        first = await generator(stream, "first", writers=writers)
        insert_rows(db, stream, "second", 4)
        second = await generator(stream, "second", writers=writers)
        third = await generator(stream, "third", writers=writers)
        gens = {"first": first, "second": second, "third": third}
        replicate_all(gens)

        assert first.get_positions() == {"first": 3, "second": 7, "third": 7}  # as Synapse
        assert first.get_current_token_for_writer("second") == 7
        assert first.get_current_token_for_writer("third") == 7
        for gen in (second, third):
            at_least_synapse(gen.get_positions(), {"first": 3, "second": 7, "third": 7})
            assert all(gen.get_current_token_for_writer(w) == 7 for w in writers)

        async with third.get_next() as stream_id:
            assert stream_id == 8
            assert third.get_positions() == {"first": 7, "second": 7, "third": 7}
            assert third.get_persisted_upto_position() == 7
        at_least_synapse(third.get_positions(), {"first": 3, "second": 7, "third": 8})
        assert third.get_positions() == {"first": 8, "second": 8, "third": 8}
        await close_all(first, second, third)

    run(main())


def test_writer_config_change(db, stream):
    create_stream(db, stream, writers=["first", "second"])
    insert_rows(db, stream, "first", 3)
    insert_rows(db, stream, "second", 2)

    def stored(stream):
        return dict(
            db.execute(
                "SELECT instance_name, stream_id FROM streampos.stream_positions WHERE stream_name = %s", (stream,)
            ).fetchall()
        )

    async def main():
        gen = await generator(stream, "worker", writers=["first", "second"])
        # Synapse: 3, 3 and 5 (from stream_positions); "first" is idle.
        assert gen.get_persisted_upto_position() == 5
        assert gen.get_current_token_for_writer("first") == 5
        assert gen.get_current_token_for_writer("second") == 5

        # The new configuration removes "first": it is assumed shut down
        # and finished, and its stored position goes (stored here by hand,
        # as Synapse's test does, not to wait for the background worker).
        db.execute(
            "INSERT INTO streampos.stream_positions VALUES (%s, 'first', 3) "
            "ON CONFLICT (stream_name, instance_name) DO NOTHING",
            (stream,),
        )
        assert "first" in stored(stream)
        gen2 = await generator(stream, "second", writers=["second"])
        assert gen2.get_persisted_upto_position() == 5
        assert gen2.get_current_token_for_writer("second") == 5
        # (set_writers deletes it; the background worker stores the others.)
        assert "first" not in stored(stream)

        # A single, previously unused writer starts at the current token.
        gen3 = await generator(stream, "third", writers=["third"])
        assert gen3.get_persisted_upto_position() == 5
        assert gen3.get_current_token_for_writer("third") == 5
        gen4 = await generator(stream, "fourth", writers=["third"])
        assert gen4.get_current_token_for_writer("third") == 5
        with pytest.raises(NotAWriterError):
            async with gen4.get_next():
                pass

        async with gen3.get_next() as stream_id:
            assert stream_id == 6
        assert gen3.get_persisted_upto_position() == 6

        # Adding back "first" does not take the position back to 3.
        gen5 = await generator(stream, "five", writers=["first", "third"])
        assert gen5.get_persisted_upto_position() == 6
        assert gen5.get_current_token_for_writer("first") == 6
        assert gen5.get_current_token_for_writer("third") == 6

        # A generator with a stale configuration: the database refuses its
        # allocation, and nothing is left in flight.
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
            async with gen2.get_next():
                pass
        assert in_flight_ids(db, stream) == []
        await gen2.refresh()
        assert gen2.get_positions() == {"first": 6, "third": 6}
        with pytest.raises(NotAWriterError):
            async with gen2.get_next():
                pass
        await close_all(gen, gen2, gen3, gen4, gen5)

    run(main())


def test_sequence_consistency(db, stream):
    """A row written without the stream's sequence: creating a writer's
    generator with repair=True (an operator's action) moves the sequence
    past it (streampos.check_stream repair); by default it does not."""
    create_stream(db, stream, writers=["master"])
    insert_rows(db, stream, "master", 3)
    db.execute(f"INSERT INTO {stream}_rows VALUES (26, 'master')")

    async def lagging():
        async with await psycopg.AsyncConnection.connect(conninfo(), autocommit=True) as conn:
            cur = await conn.execute("SELECT ok FROM streampos.check_stream(%s)", (stream,))
            return False in [r[0] for r in await cur.fetchall()]

    async def main():
        reader = await generator(stream, "reader", repair=True)  # not a writer: checks nothing
        assert await lagging()
        default = await generator(stream)  # a writer, without the operator's repair
        assert await lagging()
        gen = await generator(stream, repair=True)
        async with gen.get_next() as stream_id:
            assert stream_id == 27
        await close_all(reader, default, gen)

    run(main())


def test_the_start_up_repair_is_not_a_default(db, stream):
    """A writer's generator created with the defaults, sync or async, does
    not repair: a repair reads every table of the stream and moves the
    sequence as far as any of them says, which is an operator's decision
    (a planted row of 10^12 moved it there when it was the default)."""
    create_stream(db, stream, writers=["master"])
    insert_rows(db, stream, "master", 2)
    db.execute(f"INSERT INTO {stream}_rows VALUES (1000000000000, 'master')")

    async def main():
        gen = await generator(stream)
        async with gen.get_next() as stream_id:
            assert stream_id == 3
        await close_all(gen)

    run(main())
    sync = SyncMultiWriterIdGenerator(conninfo(), stream_name=stream, instance_name="master")
    with sync.get_next() as stream_id:
        assert stream_id == 4
    sync.close()
    checks = {name: ok for name, ok, _ in db.execute("SELECT * FROM streampos.check_stream(%s)", (stream,))}
    assert checks[f"table public.{stream}_rows"] is False, checks


def test_minimal_local_token(db, stream):
    writers = ["first", "second"]
    create_stream(db, stream, writers=writers)

    async def main():
        insert_rows(db, stream, "first", 3)
        first = await generator(stream, "first", writers=writers)
        insert_rows(db, stream, "second", 4)
        second = await generator(stream, "second", writers=writers)
        replicate_all({"first": first, "second": second})

        assert first.get_positions() == {"first": 3, "second": 7}
        assert first.get_minimal_local_current_token() == 3
        at_least_synapse(second.get_positions(), {"first": 3, "second": 7})
        assert second.get_minimal_local_current_token() == 7

        # Reads do not move it: it is the position of this instance's own
        # writes. Its writes do.
        await first.refresh()
        assert first.get_positions() == {"first": 7, "second": 7}
        assert first.get_minimal_local_current_token() == 3
        async with first.get_next() as stream_id:
            assert stream_id == 8
            assert first.get_minimal_local_current_token() == 3
        assert first.get_minimal_local_current_token() == 8
        # A non-writer's minimal token is the current token.
        reader = await generator(stream, "reader")
        assert reader.get_minimal_local_current_token() == reader.get_current_token() == 8
        await close_all(first, second, reader)

    run(main())


def test_current_token_gap(db, stream):
    """A writer that never writes ("third") holds Synapse's current token
    back for ever; in the database it holds nothing back."""
    writers = ["first", "second", "third"]
    create_stream(db, stream, writers=writers)

    async def main():
        insert_rows(db, stream, "first", 3)
        first = await generator(stream, "first", writers=writers)
        insert_rows(db, stream, "second", 4)
        second = await generator(stream, "second", writers=writers)
        replicate_all({"first": first, "second": second})

        assert second.get_current_token_for_writer("first") == 7
        assert second.get_current_token_for_writer("second") == 7
        assert second.get_current_token() == 7

        async with first.get_next_mult(2) as ids:
            assert ids == [8, 9]
        second.advance("first", 9)
        # As Synapse: "first" is at 9, the current token stays at 7. (Synapse
        # also puts idle "second" at 9 by inference.)
        assert second.get_current_token_for_writer("first") == 9
        assert second.get_current_token() == 7

        async with first.get_next_mult(2) as ids:
            assert ids == [10, 11]
        ctx = second.get_next()
        assert await ctx.__aenter__() == 12
        second.advance("first", 11)
        assert second.get_current_token_for_writer("first") == 11
        assert second.get_current_token() == 7
        # What the database says meanwhile: everything up to 11 is finished,
        # and the never-writing "third" is not waited for.
        await second.refresh()
        assert second.get_current_token() == 11
        assert second.get_current_token_for_writer("second") == 11
        assert second.get_current_token_for_writer("third") == 12

        await ctx.__aexit__(None, None, None)
        # Synapse: first 11, second 12, current token 7.
        assert second.get_current_token_for_writer("first") == 12
        assert second.get_current_token_for_writer("second") == 12
        assert second.get_current_token() == 12
        await close_all(first, second)

    run(main())


# ------------------------------------------------------------------ BackwardsMultiWriterIdGeneratorTestCase


def test_backwards_single_instance(db, stream):
    create_stream(db, stream, writers=["master"], backwards=True)

    async def main():
        gen = await generator(stream, writers=["master"], positive=False)
        assert gen.get_positions() == {"master": 0}
        async with gen.get_next() as stream_id:
            assert stream_id == -1
            await insert_row(stream, "master", stream_id)
        assert gen.get_positions() == {"master": -1}
        assert gen.get_current_token_for_writer("master") == -1
        assert gen.get_persisted_upto_position() == -1

        async with gen.get_next_mult(3) as stream_ids:
            assert stream_ids == [-2, -3, -4]
            for stream_id in stream_ids:
                await insert_row(stream, "master", stream_id)
        assert gen.get_positions() == {"master": -4}
        assert gen.get_current_token_for_writer("master") == -4
        assert gen.get_persisted_upto_position() == -4
        assert gen.get_minimal_local_current_token() == -4
        assert gen.get_current_multi_writer_token() == MultiWriterToken(-4)

        second = await generator(stream, writers=["master"])
        assert second.get_positions() == {"master": -4}
        assert second.get_current_token_for_writer("master") == -4
        assert second.get_persisted_upto_position() == -4
        with pytest.raises(ValueError, match="backwards"):
            await generator(stream, positive=True)
        await close_all(gen, second)

    run(main())


def test_backwards_multiple_instance(db, stream):
    writers = ["first", "second"]
    create_stream(db, stream, writers=writers, backwards=True)

    async def main():
        gen1 = await generator(stream, "first", writers=writers)
        gen2 = await generator(stream, "second", writers=writers)
        gens = {"first": gen1, "second": gen2}

        async with gen1.get_next() as stream_id:
            await insert_row(stream, "first", stream_id)
        replicate(gens, "first")
        assert gen1.get_positions() == {"first": -1, "second": -1}
        assert gen1.get_persisted_upto_position() == -1
        # Synapse: {-1, -1} and -1 (its idle "second" starts at -1).
        assert gen2.get_positions() == {"first": -1, "second": 0}
        await gen2.refresh()
        assert gen2.get_positions() == {"first": -1, "second": -1}
        assert gen2.get_persisted_upto_position() == -1

        async with gen2.get_next() as stream_id:
            await insert_row(stream, "second", stream_id)
        replicate(gens, "second")
        at_least_synapse(gen2.get_positions(), {"first": -1, "second": -2}, positive=False)
        assert gen2.get_persisted_upto_position() == -2
        assert gen1.get_positions() == {"first": -1, "second": -2}
        await gen1.refresh()
        assert gen1.get_persisted_upto_position() == -2
        await close_all(gen1, gen2)

    run(main())


# ------------------------------------------------------------------ MultiTableMultiWriterIdGeneratorTestCase


def test_load_existing_stream(db, stream):
    """Rows in two tables, and stream_positions out of date: the generator
    does not read stream_positions at all."""
    writers = ["first", "second"]
    create_stream(db, stream, writers=writers, tables=("rows1", "rows2"))

    async def main():
        insert_rows(db, stream, "first", 3, table="rows1")
        first = await generator(stream, "first", writers=writers)
        insert_rows(db, stream, "second", 3, table="rows2")
        insert_rows(db, stream, "second", 1, table="rows2")
        db.execute("DELETE FROM streampos.stream_positions WHERE stream_name = %s", (stream,))
        second = await generator(stream, "second", writers=writers)
        replicate_all({"first": first, "second": second})

        assert first.get_positions() == {"first": 3, "second": 7}
        assert first.get_current_token_for_writer("second") == 7
        await first.refresh()
        for gen in (first, second):
            at_least_synapse(gen.get_positions(), {"first": 3, "second": 7})
            assert gen.get_current_token_for_writer("first") == 7
            assert gen.get_current_token_for_writer("second") == 7
            assert gen.get_persisted_upto_position() == 7
        await close_all(first, second)

    run(main())


# ------------------------------------------------------------------ beyond Synapse's tests


def test_many_concurrent_writers_never_share_an_id(db, stream):
    writers = ["w1", "w2", "w3"]
    create_stream(db, stream, writers=writers)

    async def main():
        gens = [await generator(stream, w) for w in writers]

        # Bounded: each write holds up to two connections.
        limit = asyncio.Semaphore(20)

        async def write(gen, k):
            async with limit:
                return await write_one(gen, k)

        async def write_one(gen, k):
            if k % 3 == 0:
                async with await psycopg.AsyncConnection.connect(conninfo()) as txn:
                    sid = await gen.get_next_txn(txn)
                    await asyncio.sleep(0.001 * (k % 5))
                    await txn.execute(f"INSERT INTO {stream}_rows VALUES (%s, %s)", (sid, gen.instance_name))
                    await txn.commit()
            else:
                async with gen.get_next() as sid:
                    await asyncio.sleep(0.001 * (k % 7))
                    await insert_row(stream, gen.instance_name, sid)
            return sid

        ids = await asyncio.gather(*(write(gens[k % 3], k) for k in range(90)))
        assert sorted(ids) == list(range(1, 91))
        for gen in gens:
            await gen.refresh()
            assert gen.get_current_token() == 90
            assert gen.get_positions() == {w: 90 for w in writers}
        rows = db.execute(f"SELECT count(*), count(DISTINCT stream_id) FROM {stream}_rows").fetchone()
        assert rows == (90, 90)
        await close_all(*gens)

    run(main())


def test_sync_generator(db, stream):
    from concurrent.futures import ThreadPoolExecutor

    create_stream(db, stream, writers=["master"])
    insert_rows(db, stream, "master", 7)
    with SyncMultiWriterIdGenerator(conninfo(), stream_name=stream, instance_name="master") as gen:
        assert gen.get_positions() == {"master": 7}
        ctx1, ctx2 = gen.get_next(), gen.get_next()
        assert (ctx1.__enter__(), ctx2.__enter__()) == (8, 9)
        ctx2.__exit__(None, None, None)
        assert gen.get_current_token() == 7
        ctx1.__exit__(None, None, None)
        assert gen.get_current_token() == 9
        with connect(autocommit=False) as txn:
            assert gen.get_next_txn(txn.cursor()) == 10
            txn.commit()
        gen.refresh()
        assert gen.get_positions() == {"master": 10}
        assert gen.get_max_allocated_token() == 10

        def one(_):
            with gen.get_next() as sid:
                return sid

        with ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(one, range(40)))
        assert sorted(ids) == list(range(11, 51))
        assert gen.get_current_token() == 50


@pytest.mark.restarts_server
def test_server_restart_during_out_of_order_persistence(db, stream):
    """The server crashes while a writer's contexts are open, one finished
    and one not. Nothing finished is lost or handed out again, the open
    context's exit does not fail, and every generator carries on."""
    create_stream(db, stream, writers=["master"])
    insert_rows(db, stream, "master", 7)
    db.close()

    async def main():
        gen = await generator(stream, writers=["master"])
        worker = await generator(stream, "worker")
        ctx1, ctx2 = gen.get_next(), gen.get_next()
        s1, s2 = await ctx1.__aenter__(), await ctx2.__aenter__()
        assert (s1, s2) == (8, 9)
        await insert_row(stream, "master", s2)
        await ctx2.__aexit__(None, None, None)
        assert gen.get_current_token() == 7

        crash_and_restart_server()

        # ID 8's transaction died with the server: its exit cannot commit,
        # and says so in the log only.
        await ctx1.__aexit__(None, None, None)
        # A generator of a restarted process reads the recovered stream: 9
        # is finished (its row survived), 8 never will be written.
        restarted = await generator(stream, writers=["master"])
        after = restarted.get_current_token()
        assert after >= 9
        assert after == await restarted.get_max_allocated_token()
        async with restarted.get_next() as stream_id:
            assert stream_id == after + 1
        # The generators that lived through the crash reconnect on use.
        await worker.refresh()
        assert worker.get_current_token() == after + 1
        async with gen.get_next() as stream_id:
            assert stream_id == after + 2
        assert gen.get_current_token() == after + 2
        with connect() as check:
            rows = check.execute(f"SELECT stream_id FROM {stream}_rows WHERE stream_id > 7").fetchall()
        assert rows == [(9,)]
        await close_all(gen, worker, restarted)

    run(main())
