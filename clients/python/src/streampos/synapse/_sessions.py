"""Connections of the generator's own: registration, and the sessions that
hold the IDs of ``get_next()`` / ``get_next_mult()``.

An ID handed out by ``get_next()`` is written by *other* transactions (on
Synapse's pooled connections), so it cannot belong to a transaction: it is
held by a database session with ``streampos.hold_ids`` and released with
``streampos.release_ids`` on the same session once the context exits. Pool
connections differ from call to call, so the sessions here are connections
opened for the purpose, like those of Synapse's connection pool (same
arguments, same set-up), one set per pool (per process and database),
shared by every generator using it: normally one connection, another only
while every open one holds ``streampos.max_held_per_session`` allocations
(53400). Streams are registered at start-up on one more connection, closed
once the reactor runs.

If a session dies (its backend is terminated, the server restarts, the
network fails), the server keeps its IDs held until every transaction
running at that moment has ended, then releases them. A transaction that was
already writing the rows when the session died is therefore safe; one that
starts afterwards is not, so the generator must not let Synapse trust those
IDs: every context whose session died fails with :class:`HoldLostError` when
it exits (a loud failure of the request that persisted the rows), and new
contexts use a new session.

Every method here blocks: the generator calls them from Synapse's database
threads (inside ``runInteraction``) or during start-up.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from synapse.storage.database import DatabasePool, LoggingDatabaseConnection

logger = logging.getLogger(__name__)

# A transaction-level advisory lock taken while registering streams: two
# processes starting at once register one after the other, and the second
# finds the work done. The key spells "streampo" in ASCII.
_REGISTER_LOCK_KEY = 0x73747265616D706F
# The longest a start waits for that lock: registering takes a moment per
# stream, so other processes starting at once are done well before it.
_REGISTER_LOCK_WAIT = "60s"

_EXTENSION_SQL = """
SELECT e.extversion,
       EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
                WHERE p.pronamespace OPERATOR(pg_catalog.=) e.extnamespace
                  AND p.proname OPERATOR(pg_catalog.=) 'hold_ids')
  FROM pg_catalog.pg_extension e WHERE e.extname OPERATOR(pg_catalog.=) 'streampos'
"""
_STREAM_SQL = """
SELECT st.backwards, st.seq::pg_catalog.regclass::pg_catalog.text,
       st.seq OPERATOR(pg_catalog.=) ?::pg_catalog.regclass
  FROM streampos.streams st WHERE st.stream_name OPERATOR(pg_catalog.=) ?
"""
_TABLE_REGISTERED_SQL = (
    "SELECT 1 FROM streampos.stream_tables "
    "WHERE stream_name OPERATOR(pg_catalog.=) ? AND tbl OPERATOR(pg_catalog.=) ?::pg_catalog.regclass"
)


class HoldLostError(Exception):
    """The session holding a ``get_next()`` context's IDs ended before the
    context exited: the server has released them, and a reader's frontier
    may have passed them before the rows were committed. Raised when the
    context exits; the IDs are named in the message."""


class RegistrationError(Exception):
    """The stream cannot be registered or used (no extension, an extension
    older than 0.3.0, privileges, a registration that is not Synapse's)."""


def sqlstate(e: BaseException) -> Optional[str]:
    """The SQLSTATE of a psycopg2 or psycopg 3 error."""
    return getattr(e, "pgcode", None) or getattr(e, "sqlstate", None)


class _Session:
    """One connection of ours (autocommit). ``lock`` serialises its use."""

    def __init__(self, conn: "LoggingDatabaseConnection") -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.holds = 0
        # streampos.max_held_per_session, read at the first hold: a full
        # session is known before the server refuses (an ERROR in its log).
        self.limit: Optional[int] = None
        self.full = False
        self.lost = False


class Hold:
    """What a context holds: its IDs (external values) and their session."""

    __slots__ = ("owner", "session", "stream", "ids", "released")

    def __init__(self, owner: "Sessions", session: _Session, stream: str, ids: List[int]) -> None:
        self.owner = owner
        self.session = session
        self.stream = stream
        self.ids = ids
        self.released = False


class Sessions:
    """The generator connections of one of Synapse's connection pools.

    ``connect`` opens a DB-API connection set up as the pool's are;
    ``call_soon`` runs a function once the reactor runs (to close the
    registration connection after start-up)."""

    def __init__(
        self,
        connect: Callable[[], Any],
        engine: Any,
        server_name: str,
        call_soon: Optional[Callable[[Callable[[], None]], Any]] = None,
    ) -> None:
        self._connect_raw = connect
        self._engine = engine
        self._server_name = server_name
        self._call_soon = call_soon
        self._lock = threading.Lock()
        self._sessions: List[_Session] = []
        self._admin: Optional[_Session] = None
        self._extension: Optional[Tuple[str, bool]] = None
        self._closed = False

    # ------------------------------------------------------------ plumbing

    def _connect(self) -> _Session:
        from synapse.storage.database import LoggingDatabaseConnection

        if self._closed:
            raise HoldLostError("the homeserver is shutting down: no new stream IDs")
        raw = self._connect_raw()
        self._engine.attempt_to_set_autocommit(raw, True)
        return _Session(
            LoggingDatabaseConnection(
                conn=raw, engine=self._engine, default_txn_name="streampos", server_name=self._server_name
            )
        )

    def _is_dead(self, session: _Session, e: BaseException) -> bool:
        module = self._engine.module
        return isinstance(e, (module.OperationalError, module.InterfaceError)) and (
            self._engine.is_connection_closed(session.conn.conn) or sqlstate(e) in (None, "57P01", "57P02", "57P03")
        )

    def _execute(self, session: _Session, sql: str, args: Sequence[Any] = ()) -> List[Tuple[Any, ...]]:
        cur = session.conn.cursor(txn_name="streampos")
        try:
            cur.execute(sql, args)
            return cur.fetchall() if cur.description is not None else []
        finally:
            cur.close()

    def _admin_session(self) -> _Session:
        """The registration connection: opened when a generator is
        constructed, closed once the reactor runs (start-up is over)."""
        with self._lock:
            admin = self._admin
            if admin is not None and not admin.lost and not self._engine.is_connection_closed(admin.conn.conn):
                return admin
            admin = self._admin = self._connect()
        if self._call_soon is not None:
            self._call_soon(lambda: self._close_admin(admin))
        return admin

    def _close_admin(self, admin: _Session) -> None:
        with self._lock:
            if self._admin is admin:
                self._admin = None
        with admin.lock:
            admin.lost = True
            try:
                admin.conn.close()
            except Exception:  # already gone
                pass

    def _drop(self, session: _Session) -> None:
        session.lost = True
        with self._lock:
            if session in self._sessions:
                self._sessions.remove(session)
        try:
            session.conn.close()
        except Exception:  # already gone
            pass

    def close(self) -> None:
        """Close every connection (at shutdown). IDs still held stay in
        flight until the transactions running now have ended."""
        with self._lock:
            self._closed = True
            sessions, self._sessions = self._sessions, []
            if self._admin is not None:
                sessions.append(self._admin)
                self._admin = None
        for s in sessions:
            s.lost = True
            try:
                s.conn.close()
            except Exception:  # already gone
                pass

    # ------------------------------------------------------------ registration

    def check_extension(self) -> None:
        """The extension must be in the database, with holds (0.3.0)."""
        if self._extension is None:
            session = self._admin_session()
            with session.lock:
                rows = self._execute(session, _EXTENSION_SQL)
            if not rows:
                raise RegistrationError(
                    "the streampos extension is not installed in this database: as a superuser, "
                    "CREATE EXTENSION streampos (with shared_preload_libraries = 'streampos')"
                )
            self._extension = (rows[0][0], bool(rows[0][1]))
        version, holds = self._extension
        if not holds:
            raise RegistrationError(
                f"the streampos extension in this database is {version}; streampos.synapse needs "
                f"0.3.0 or later (hold_ids): as a superuser, ALTER EXTENSION streampos UPDATE"
            )

    def register(
        self,
        stream: str,
        sequence_name: str,
        tables: Sequence[Tuple[str, str, str]],
        backwards: bool,
    ) -> List[str]:
        """Register the stream with Synapse's own sequence and tables, unless
        it is registered already; then check it (``check_stream`` with
        repair, Synapse's start-up consistency check). Idempotent, and safe
        when several processes start at once: READ COMMITTED under an
        advisory lock, committed at once (not in Synapse's start-up
        transaction). Returns what it did, for the log."""
        session = self._admin_session()
        done: List[str] = []
        with session.lock:
            self._execute(session, "BEGIN ISOLATION LEVEL READ COMMITTED")
            try:
                # Any role can take an advisory lock: the wait is bounded, so
                # that a session holding this key stops the start with an
                # error (55P03) rather than forever.
                self._execute(session, f"SET LOCAL lock_timeout = '{_REGISTER_LOCK_WAIT}'")
                self._execute(session, "SELECT pg_catalog.pg_advisory_xact_lock(?)", (_REGISTER_LOCK_KEY,))
                self._execute(session, "SET LOCAL lock_timeout = DEFAULT")
                rows = self._execute(session, _STREAM_SQL, (sequence_name, stream))
                if not rows:
                    self._execute(
                        session,
                        "SELECT streampos.adopt_stream(?, ?::regclass, ?)",
                        (stream, sequence_name, backwards),
                    )
                    done.append(f"registered with sequence {sequence_name}")
                else:
                    registered_backwards, registered_seq, same_seq = rows[0]
                    if not same_seq or bool(registered_backwards) != backwards:
                        raise RegistrationError(
                            f"stream {stream!r} is registered with sequence {registered_seq} "
                            f"({'backwards' if registered_backwards else 'forwards'}), but Synapse "
                            f"uses {sequence_name} ({'backwards' if backwards else 'forwards'})"
                        )
                for table, instance_column, id_column in tables:
                    if self._execute(session, _TABLE_REGISTERED_SQL, (stream, table)):
                        continue
                    self._execute(
                        session,
                        "SELECT streampos.add_table(?, ?::regclass, ?, ?)",
                        (stream, table, id_column, instance_column),
                    )
                    done.append(f"table {table} added")
                self._execute(session, "COMMIT")
            except BaseException:
                try:
                    self._execute(session, "ROLLBACK")
                except Exception:
                    session.lost = True
                raise
            # Synapse's check_consistency: move the sequence past every row
            # (after a restore, say); the extension never moves it back.
            for check_name, ok, detail in self._execute(
                session, "SELECT check_name, ok, detail FROM streampos.check_stream(?, repair => true)", (stream,)
            ):
                if not ok or check_name == "repair":
                    done.append(f"check {check_name}: {detail}")
        return done

    # ------------------------------------------------------------ holds

    def _pick(self) -> _Session:
        with self._lock:
            for s in self._sessions:
                if not s.lost and not s.full:
                    return s
        # Every session is full (or there is none yet).
        session = self._connect()
        with self._lock:
            self._sessions.append(session)
        return session

    def hold(self, stream: str, writer: str, n: int) -> Hold:
        """Allocate n IDs (external values, allocation order), held by one of
        our sessions until :meth:`release`."""
        while True:
            session = self._pick()
            try:
                with session.lock:
                    if session.limit is None:
                        session.limit = int(
                            self._execute(
                                session, "SELECT pg_catalog.current_setting('streampos.max_held_per_session')"
                            )[0][0]
                        )
                    if session.holds >= session.limit:
                        session.full = True
                        continue
                    ids = self._execute(session, "SELECT streampos.hold_ids(?, ?, ?)", (stream, writer, n))[0][0]
                    session.holds += 1
                return Hold(self, session, stream, list(ids))
            except Exception as e:
                if sqlstate(e) == "53400":
                    # This session holds as many allocations as a session may
                    # (counted here too; this is the server's word for it).
                    session.full = True
                    continue
                if self._is_dead(session, e):
                    # Died while idle: the contexts it held for learn it at
                    # their exit. Take a new one.
                    self._drop(session)
                    continue
                raise

    def release(self, hold: Hold) -> None:
        """Finish the IDs of ``hold`` (after the rows' transaction
        committed). Idempotent. Raises HoldLostError if its session died
        first."""
        if hold.released:
            return
        session = hold.session
        hold.released = True
        if session.lost:
            raise self._lost(hold)
        try:
            with session.lock:
                self._execute(session, "SELECT streampos.release_ids(?, ?::bigint[])", (hold.stream, hold.ids))
                session.holds -= 1
                session.full = False
        except Exception as e:
            if self._is_dead(session, e):
                self._drop(session)
                raise self._lost(hold) from e
            raise

    @staticmethod
    def _lost(hold: Hold) -> HoldLostError:
        return HoldLostError(
            f"stream {hold.stream!r}: the session holding IDs {hold.ids} ended before they were "
            f"released; the server released them once the transactions running then had ended, so "
            f"rows written with them by a transaction that began later may be missed by readers"
        )


_by_pool: "weakref.WeakKeyDictionary[Any, Sessions]" = weakref.WeakKeyDictionary()
_by_pool_lock = threading.Lock()


def new_sessions(db: "DatabasePool") -> Sessions:
    """Sessions connecting as ``db``'s connection pool does, now.

    They refer to the pool and the reactor weakly: ``_by_pool`` holds them
    as the value of the pool's key, and a value that referred to its key
    would keep the pool, and every connection in it, alive for good. A
    query Synapse dispatched before its shutdown opens one more connection
    in the closed pool (tests.app.test_homeserver_shutdown); only the pool's
    collection closes it, and until then the database cannot be dropped."""
    pool_ref = weakref.ref(db._db_pool)
    reactor_ref = weakref.ref(db.hs.get_reactor())

    def connect() -> Any:
        pool = pool_ref()
        if pool is None:
            raise HoldLostError("the homeserver's connection pool is gone: no new stream IDs")
        conn = pool.dbapi.connect(*pool.connargs, **pool.connkw)
        if pool.openfun is not None:
            pool.openfun(conn)  # Synapse's set-up of a new connection
        return conn

    def call_soon(f: Callable[[], None]) -> None:
        reactor = reactor_ref()
        if reactor is not None:
            reactor.callLater(0, f)

    return Sessions(connect, db.engine, db.server_name, call_soon)


def sessions_for(db: "DatabasePool") -> Sessions:
    """The sessions of the connection pool ``db`` uses now, created on first
    use and closed with it (at shutdown; in Synapse's tests, before each
    test's database is dropped). Looked up at each use: Synapse's tests give
    a worker's store the main process's pool after building it."""
    pool = db._db_pool
    with _by_pool_lock:
        sessions = _by_pool.get(pool)
        if sessions is None:
            sessions = _by_pool[pool] = new_sessions(db)
            final_close = pool.finalClose

            # The pool's shutdown trigger and close() both call finalClose.
            def close_with_pool() -> None:
                sessions.close()
                final_close()

            pool.finalClose = close_with_pool
        return sessions
