"""streampos.synapse inside Synapse's own test harness: a real homeserver
(HomeserverTestCase, one PostgreSQL database per test, cloned from a base
database the shim created the extension in), with install() in effect.

What each test shows is in its docstring. An observer connection of the
test's own (psycopg2, autocommit) reads what the database says while
Synapse's transactions and holds are open.
"""

import threading
import time
from typing import Any, List
from unittest import mock

import psycopg2
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred
from twisted.internet.testing import MemoryReactor

import streampos.synapse
from streampos.synapse import HoldLostError, StreamposIdGenerator
from streampos.synapse._sessions import Sessions, new_sessions
from streampos.synapse.generator import SYNAPSE_MULTI_WRITER_ID_GENERATOR
from synapse.logging.context import LoggingContext, make_deferred_yieldable
from synapse.rest import admin
from synapse.rest.client import login, room
from synapse.server import HomeServer
from synapse.storage.database import LoggingDatabaseConnection, LoggingTransaction
from synapse.util.clock import Clock
from tests.unittest import HomeserverTestCase
from tests.utils import USE_POSTGRES_FOR_TESTS

# Every MultiWriterIdGenerator a homeserver's main store constructs
# (docs/synapse-streams.md): attribute, stream, sequence, backwards.
STREAMS = {
    "_stream_id_gen": ("events", "events_stream_seq", False),
    "_backfill_id_gen": ("backfill", "events_backfill_stream_seq", True),
    "_receipts_id_gen": ("receipts", "receipts_sequence", False),
    "_account_data_id_gen": ("account_data", "account_data_sequence", False),
    "_to_device_msg_id_gen": ("to_device", "device_inbox_sequence", False),
    "_presence_id_gen": ("presence_stream", "presence_stream_sequence", False),
    "_push_rules_stream_id_gen": ("push_rules_stream", "push_rules_stream_sequence", False),
    "_pushers_id_gen": ("pushers", "pushers_sequence", False),
    "_device_list_id_gen": ("device_lists_stream", "device_lists_sequence", False),
    "_un_partial_stated_rooms_stream_id_gen": (
        "un_partial_stated_room_stream",
        "un_partial_stated_room_stream_sequence",
        False,
    ),
    "_un_partial_stated_events_stream_id_gen": (
        "un_partial_stated_event_stream",
        "un_partial_stated_event_stream_sequence",
        False,
    ),
    "_thread_subscriptions_id_gen": ("thread_subscriptions", "thread_subscriptions_sequence", False),
    "_sticky_events_id_gen": ("sticky_events", "sticky_events_sequence", False),
    "_cache_id_gen": ("caches", "cache_invalidation_stream_seq", False),
    "_cross_signing_id_gen": ("e2e_cross_signing_keys", "e2e_cross_signing_keys_sequence", False),
    "_profile_updates_id_gen": ("profile_updates", "profile_updates_sequence", False),
    "_quarantined_media_changes_id_gen": ("quarantined_media", "quarantined_media_id_seq", False),
}


class StreamposGeneratorTestCase(HomeserverTestCase):
    if not USE_POSTGRES_FOR_TESTS:
        skip = "Requires PostgreSQL with the streampos extension"

    servlets = [admin.register_servlets, room.register_servlets, login.register_servlets]

    def prepare(self, reactor: MemoryReactor, clock: Clock, hs: HomeServer) -> None:
        self.store = hs.get_datastores().main
        self.db_pool = self.store.db_pool
        args = {k: v for k, v in self.db_pool._database_config.config["args"].items() if not k.startswith("cp_")}
        self.observer = psycopg2.connect(**args)
        self.observer.autocommit = True
        self.addCleanup(self.observer.close)

    def sql(self, query: str, *args: Any) -> List[tuple]:
        with self.observer.cursor() as cur:
            cur.execute(query, args)
            return cur.fetchall() if cur.description else []

    def gen(self, attribute: str) -> StreamposIdGenerator:
        g = getattr(self.store, attribute)
        self.assertIsInstance(g, StreamposIdGenerator)
        return g

    def wait_until(self, predicate: Any, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                self.fail("timed out")
            time.sleep(0.05)

    def enter(self, ctx: Any) -> Any:
        return self.get_success(ctx.__aenter__())

    def exit(self, ctx: Any) -> None:
        self.get_success(ctx.__aexit__(None, None, None))

    # ------------------------------------------------------------ wiring

    def test_every_stream_is_a_streampos_generator(self) -> None:
        """Every generator of the main store is the replacement, registered
        with Synapse's own sequence, direction and tables."""
        self.assertIn("synapse.storage.databases.main.events_worker", streampos.synapse.installed())
        registered = {
            name: (seq, backwards)
            for name, seq, backwards in self.sql(
                "SELECT stream_name, seq::regclass::text, backwards FROM streampos.streams"
            )
        }
        for attribute, (stream, sequence, backwards) in STREAMS.items():
            g = self.gen(attribute)
            self.assertIsInstance(g, SYNAPSE_MULTI_WRITER_ID_GENERATOR)  # what Synapse's asserts check
            self.assertEqual(g._stream_name, stream)
            self.assertEqual(registered[stream], (sequence, backwards))
            tables = sorted(
                self.sql(
                    "SELECT tbl::regclass::text, instance_column, id_column FROM streampos.stream_tables "
                    "WHERE stream_name = %s",
                    stream,
                )
            )
            self.assertEqual(tables, sorted(g._tables))
        self.assertEqual(len(registered), len(STREAMS))

    def test_positions_come_from_the_extension(self) -> None:
        """A generator built later (a restarting worker) starts from the
        extension's positions, which match the running one's."""
        user = self.register_user("u", "pass")
        tok = self.login("u", "pass")
        room_id = self.helper.create_room_as(user, tok=tok)
        for i in range(5):
            self.helper.send(room_id, f"m{i}", tok=tok)
        events = self.gen("_stream_id_gen")
        frontier = self.sql("SELECT streampos.frontier('events')")[0][0]
        self.assertEqual(events.get_current_token(), frontier)
        self.assertEqual(self.sql("SELECT max(stream_ordering) FROM events")[0][0], frontier)

        def create(conn: LoggingDatabaseConnection) -> StreamposIdGenerator:
            g = StreamposIdGenerator(
                db_conn=conn,
                db=self.db_pool,
                notifier=self.hs.get_replication_notifier(),
                stream_name="events",
                server_name=self.hs.hostname,
                instance_name="worker9",
                tables=list(events._tables),
                sequence_name="events_stream_seq",
                writers=["master"],
            )
            conn.commit()
            return g

        other = self.get_success(self.db_pool.runWithConnection(create))
        self.assertEqual(other.get_current_token(), frontier)
        self.assertEqual(other.get_positions(), {"master": frontier})

    def test_stream_positions_is_never_written(self) -> None:
        """Synapse's stream_positions gets no row from the generators."""
        before = self.sql("SELECT count(*) FROM stream_positions")[0][0]
        user = self.register_user("u", "pass")
        tok = self.login("u", "pass")
        room_id = self.helper.create_room_as(user, tok=tok)
        for i in range(10):
            self.helper.send(room_id, f"m{i}", tok=tok)
        self.assertGreater(self.sql("SELECT count(*) FROM events")[0][0], 10)
        self.assertEqual(self.sql("SELECT count(*) FROM stream_positions")[0][0], before)

    # ------------------------------------------------------------ get_next_txn

    def test_get_next_txn_is_in_flight_until_the_transaction_commits(self) -> None:
        """The ID belongs to Synapse's own transaction: in flight (with its
        xid) while it runs, finished by its commit."""
        g = self.gen("_cache_id_gen")
        seen = {}

        def txn(t: LoggingTransaction) -> int:
            stream_id = g.get_next_txn(t)
            seen["in_flight"] = self.sql(
                "SELECT min_id, max_id, xid IS NOT NULL FROM streampos.in_flight('caches')"
            )
            seen["frontier"] = self.sql("SELECT streampos.frontier('caches')")[0][0]
            return stream_id

        stream_id = self.get_success(self.db_pool.runInteraction("test", txn))
        self.assertEqual(seen["in_flight"], [(stream_id, stream_id, True)])
        self.assertEqual(seen["frontier"], stream_id - 1)
        self.assertEqual(self.sql("SELECT streampos.frontier('caches')")[0][0], stream_id)
        self.assertEqual(g.get_current_token(), stream_id)

    def test_get_next_txn_rolled_back_is_a_gap(self) -> None:
        g = self.gen("_cache_id_gen")
        ids = []

        def txn(t: LoggingTransaction) -> None:
            ids.append(g.get_next_txn(t))
            raise ValueError("roll back")

        self.get_failure(self.db_pool.runInteraction("test", txn), ValueError)
        self.assertEqual(self.sql("SELECT count(*) FROM streampos.in_flight('caches')")[0][0], 0)
        self.assertEqual(self.sql("SELECT streampos.frontier('caches')")[0][0], ids[0])
        self.assertEqual(g.get_current_token(), ids[0])

    # ------------------------------------------------------------ get_next

    def test_get_next_holds_until_the_context_exits(self) -> None:
        """get_next's IDs stay in flight across transactions (the rows are
        written by another one) until the context exits."""
        g = self.gen("_receipts_id_gen")
        ctx = g.get_next_mult(3)
        ids = self.enter(ctx)
        self.assertEqual(ids, sorted(ids))
        rows = self.sql("SELECT min_id, max_id, ids, xid, pid FROM streampos.in_flight('receipts')")
        self.assertEqual([r[:4] for r in rows], [(ids[0], ids[-1], 3, None)])  # a hold: no xid
        # The session holding them is not in a transaction.
        self.assertEqual(self.sql("SELECT state FROM pg_stat_activity WHERE pid = %s", rows[0][4]), [("idle",)])
        self.assertEqual(self.sql("SELECT streampos.frontier('receipts')")[0][0], ids[0] - 1)
        self.assertEqual(g.get_current_token(), ids[0] - 1)
        self.exit(ctx)
        self.assertEqual(self.sql("SELECT count(*) FROM streampos.in_flight('receipts')")[0][0], 0)
        self.assertEqual(self.sql("SELECT streampos.frontier('receipts')")[0][0], ids[-1])
        self.assertEqual(g.get_current_token(), ids[-1])
        # Zero IDs: nothing allocated, nothing held.
        none = g.get_next_mult(0)
        self.assertEqual(self.enter(none), [])
        self.exit(none)
        self.assertEqual(self.sql("SELECT streampos.max_allocated('receipts')")[0][0], ids[-1])

    def test_get_next_backwards(self) -> None:
        """backfill hands out negative IDs, held like the others."""
        g = self.gen("_backfill_id_gen")
        before = g.get_current_token()
        ctx = g.get_next_mult(2)
        ids = self.enter(ctx)
        self.assertEqual(ids, [before - 1, before - 2])
        self.assertEqual(self.sql("SELECT streampos.frontier('backfill')")[0][0], before)
        self.exit(ctx)
        self.assertEqual(self.sql("SELECT streampos.frontier('backfill')")[0][0], before - 2)
        self.assertEqual(g.get_current_token(), before - 2)

    def test_many_open_contexts(self) -> None:
        """More contexts open at once than one session may hold: more
        sessions are opened, and every context releases on its own. The
        generator knows a session is full before the server refuses (no
        53400 ERROR in the server's log on this normal path)."""
        g = self.gen("_receipts_id_gen")
        limit = int(self.sql("SELECT current_setting('streampos.max_held_per_session')")[0][0])
        n = limit + 3
        refused: List[str] = []
        execute = Sessions._execute

        def recording(sessions, session, sql, args=()):  # type: ignore[no-untyped-def]
            try:
                return execute(sessions, session, sql, args)
            except Exception as e:
                refused.append(f"{getattr(e, 'pgcode', None)}: {sql}")
                raise

        with mock.patch.object(Sessions, "_execute", new=recording):
            ctxs = [g.get_next() for _ in range(n)]
            ids = [self.enter(c) for c in ctxs]
        self.assertEqual(refused, [])
        self.assertEqual(self.sql("SELECT sum(ids) FROM streampos.in_flight('receipts')")[0][0], n)
        self.assertEqual(self.sql("SELECT count(DISTINCT pid) FROM streampos.in_flight('receipts')")[0][0], 2)
        for c in reversed(ctxs):
            self.exit(c)
        self.assertEqual(self.sql("SELECT count(*) FROM streampos.in_flight('receipts')")[0][0], 0)
        self.assertEqual(g.get_current_token(), max(ids))

    def test_cancelled_enter_releases(self) -> None:
        """Synapse's test_cancelled_enter_does_not_wedge_position, and the
        database side: a get_next cancelled after its hold was taken
        releases it (in the background)."""
        g = self.gen("_account_data_id_gen")
        cancel: "Deferred[None]" = Deferred()
        original = g._db.runInteraction

        async def run_interaction(desc, func, *args, **kwargs):  # type: ignore[no-untyped-def]
            result = await original(desc, func, *args, **kwargs)
            if desc == "_load_next_mult_id":
                await make_deferred_yieldable(cancel)
            return result

        async def write() -> None:
            with LoggingContext(name="w", server_name=self.hs.hostname):
                async with g.get_next():
                    pass

        with mock.patch.object(g._db, "runInteraction", new=run_interaction):
            d = ensureDeferred(write())
            self.pump()  # Synapse's test database runs interactions on the reactor
            self.assertNoResult(d)
            held = self.sql("SELECT max_id FROM streampos.in_flight('account_data')")
            self.assertEqual(len(held), 1)
            cancel.errback(CancelledError())
            self.get_failure(d, CancelledError)
        self.pump()
        self.assertEqual(self.sql("SELECT count(*) FROM streampos.in_flight('account_data')")[0][0], 0)
        self.assertEqual(g.get_current_token(), held[0][0])

    def test_lost_session_fails_loudly(self) -> None:
        """The session holding a context's IDs is terminated: the server
        releases them, and the context fails when it exits (the rows must
        not be trusted); the next context uses a new session."""
        g = self.gen("_receipts_id_gen")
        ctx = g.get_next()
        stream_id = self.enter(ctx)
        pid = self.sql("SELECT pid FROM streampos.in_flight('receipts')")[0][0]
        self.sql("SELECT pg_terminate_backend(%s, 10000)", pid)
        # Orphaned, then released by the position worker (no transaction
        # was running when the session ended).
        self.wait_until(lambda: self.sql("SELECT streampos.frontier('receipts')")[0][0] >= stream_id)
        self.assertEqual(self.sql("SELECT count(*) FROM streampos.in_flight('receipts')")[0][0], 0)
        f = self.get_failure(ctx.__aexit__(None, None, None), HoldLostError)
        self.assertIn(str(stream_id), str(f.value))
        ctx2 = g.get_next()
        second = self.enter(ctx2)
        self.assertGreater(second, stream_id)
        self.exit(ctx2)
        self.assertEqual(g.get_current_token(), second)

    def test_lost_session_after_a_failed_body_is_only_logged(self) -> None:
        g = self.gen("_receipts_id_gen")
        ctx = g.get_next()
        self.enter(ctx)
        pid = self.sql("SELECT pid FROM streampos.in_flight('receipts')")[0][0]
        self.sql("SELECT pg_terminate_backend(%s, 10000)", pid)
        self.get_success(ctx.__aexit__(ValueError, ValueError("persist failed"), None))

    def test_get_next_txn_in_autocommit_is_held_until_the_interaction_ends(self) -> None:
        """In an autocommit interaction each statement commits: the IDs are
        held instead, and released once the interaction is over."""
        g = self.gen("_cache_id_gen")
        seen = {}

        def txn(t: LoggingTransaction) -> int:
            stream_id = g.get_next_txn(t)
            t.execute("SELECT 1")  # a statement of its own: commits
            seen["in_flight"] = self.sql("SELECT min_id, xid FROM streampos.in_flight('caches')")
            return stream_id

        stream_id = self.get_success(self.db_pool.runInteraction("test", txn, db_autocommit=True))
        self.assertEqual(seen["in_flight"], [(stream_id, None)])
        self.pump()
        self.assertEqual(self.sql("SELECT count(*) FROM streampos.in_flight('caches')")[0][0], 0)
        self.assertEqual(self.sql("SELECT streampos.frontier('caches')")[0][0], stream_id)

    # ------------------------------------------------------------ registration

    def other_database(self, name: str) -> Sessions:
        """Sessions on a new database of the same server."""
        self.sql(f"DROP DATABASE IF EXISTS {name}")
        self.sql(f"CREATE DATABASE {name}")
        self.addCleanup(self.sql, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        args = {k: v for k, v in self.db_pool._database_config.config["args"].items() if not k.startswith("cp_")}
        args["dbname"] = name
        sessions = Sessions(lambda: psycopg2.connect(**args), self.db_pool.engine, "test")
        self.addCleanup(sessions.close)
        return sessions

    def test_extension_missing_or_old(self) -> None:
        sessions = self.other_database("streampos_trial_noext")
        with self.assertRaises(streampos.synapse.RegistrationError) as e:
            sessions.check_extension()
        self.assertIn("CREATE EXTENSION streampos", str(e.exception))

        sessions = self.other_database("streampos_trial_old")
        args = {k: v for k, v in self.db_pool._database_config.config["args"].items() if not k.startswith("cp_")}
        with psycopg2.connect(**{**args, "dbname": "streampos_trial_old"}) as c:
            c.autocommit = True
            c.cursor().execute("CREATE EXTENSION streampos VERSION '0.2.0'")
        c.close()
        with self.assertRaises(streampos.synapse.RegistrationError) as e:
            sessions.check_extension()
        self.assertIn("ALTER EXTENSION streampos UPDATE", str(e.exception))

    def test_registration_connection_closes_once_the_reactor_runs(self) -> None:
        sessions = new_sessions(self.db_pool)
        self.addCleanup(sessions.close)
        sessions.check_extension()
        pid = sessions._admin.conn.get_backend_pid()
        self.assertEqual(self.sql("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", pid), [(1,)])
        self.pump()
        self.wait_until(lambda: self.sql("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", pid) == [(0,)])

    def test_concurrent_registration(self) -> None:
        """Eight processes' start-ups registering the same new stream at
        once: one registers it, the others find it done; nobody fails."""
        self.sql("CREATE SEQUENCE reg_seq")
        self.sql("SELECT nextval('reg_seq')")
        self.sql("CREATE TABLE reg_rows (stream_id bigint, instance_name text)")
        barrier = threading.Barrier(8)
        results: List[Any] = []

        def start() -> None:
            sessions = new_sessions(self.db_pool)
            try:
                barrier.wait()
                results.append(
                    sessions.register("reg", "reg_seq", [("reg_rows", "instance_name", "stream_id")], False)
                )
            except Exception as e:  # reported below
                results.append(e)
            finally:
                sessions.close()

        threads = [threading.Thread(target=start) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual(len(results), 8)
        errors = [r for r in results if isinstance(r, Exception)]
        self.assertEqual(errors, [])
        registrations = [r for r in results if any(line.startswith("registered") for line in r)]
        self.assertEqual(len(registrations), 1, results)
        self.assertEqual(
            self.sql("SELECT seq::regclass::text FROM streampos.streams WHERE stream_name = 'reg'"), [("reg_seq",)]
        )
        self.assertEqual(self.sql("SELECT count(*) FROM streampos.stream_tables WHERE stream_name = 'reg'"), [(1,)])

    def test_registered_with_another_sequence_is_refused(self) -> None:
        self.sql("CREATE SEQUENCE other_seq")
        self.sql("SELECT streampos.adopt_stream('mismatch', 'other_seq')")
        self.sql("CREATE SEQUENCE mine_seq")
        sessions = new_sessions(self.db_pool)
        self.addCleanup(sessions.close)
        with self.assertRaises(streampos.synapse.RegistrationError) as e:
            sessions.register("mismatch", "mine_seq", [], False)
        self.assertIn("other_seq", str(e.exception))
