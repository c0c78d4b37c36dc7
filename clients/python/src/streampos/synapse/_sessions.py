"""Connections of the generator's own: registration, and the sessions that
hold the IDs of ``get_next()`` / ``get_next_mult()``.

An ID handed out by ``get_next()`` is written by *other* transactions (on
Synapse's pooled connections), so it cannot belong to a transaction: it is
held by a database session with ``streampos.hold_ids`` and released with
``streampos.release_ids`` on the same session once the context exits. Pool
connections differ from call to call, so the sessions here are connections
opened for the purpose, one set per ``DatabasePool`` (per process and
database), shared by every generator of that pool: normally one connection,
another only while every open one holds ``streampos.max_held_per_session``
allocations (53400). The first session also registers streams at start-up.

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
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from synapse.storage.database import DatabasePool, LoggingDatabaseConnection

logger = logging.getLogger(__name__)

# A transaction-level advisory lock taken while registering streams: two
# processes starting at once register one after the other, and the second
# finds the work done. The key spells "streampo" in ASCII.
_REGISTER_LOCK_KEY = 0x73747265616D706F

_EXTENSION_SQL = """
SELECT e.extversion,
       EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
                WHERE p.pronamespace = e.extnamespace AND p.proname = 'hold_ids')
  FROM pg_catalog.pg_extension e WHERE e.extname = 'streampos'
"""
_STREAM_SQL = """
SELECT st.backwards, st.seq::regclass::text, st.seq = ?::regclass
  FROM streampos.streams st WHERE st.stream_name = ?
"""
_TABLE_REGISTERED_SQL = "SELECT 1 FROM streampos.stream_tables WHERE stream_name = ? AND tbl = ?::regclass"


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
        self.full = False
        self.lost = False


class Hold:
    """What a context holds: its IDs (external values) and their session."""

    __slots__ = ("session", "stream", "ids", "released")

    def __init__(self, session: _Session, stream: str, ids: List[int]) -> None:
        self.session = session
        self.stream = stream
        self.ids = ids
        self.released = False


class Sessions:
    """The generator connections of one ``DatabasePool``."""

    def __init__(self, db: "DatabasePool") -> None:
        self._config = db._database_config
        self._engine = db.engine
        self._server_name = db.server_name
        self._lock = threading.Lock()
        self._sessions: List[_Session] = []
        self._extension: Optional[Tuple[str, bool]] = None
        self._closed = False

    # ------------------------------------------------------------ plumbing

    def _connect(self) -> _Session:
        from synapse.storage.database import make_conn

        if self._closed:
            raise HoldLostError("the homeserver is shutting down: no new stream IDs")
        conn = make_conn(
            db_config=self._config,
            engine=self._engine,
            default_txn_name="streampos",
            server_name=self._server_name,
        )
        self._engine.attempt_to_set_autocommit(conn.conn, True)
        return _Session(conn)

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

    def _first(self) -> _Session:
        """The first live session (registration and checks use it)."""
        with self._lock:
            for s in self._sessions:
                if not s.lost and not self._engine.is_connection_closed(s.conn.conn):
                    return s
            session = self._connect()
            self._sessions.insert(0, session)
            return session

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
            session = self._first()
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
        session = self._first()
        done: List[str] = []
        with session.lock:
            self._execute(session, "BEGIN ISOLATION LEVEL READ COMMITTED")
            try:
                self._execute(session, "SELECT pg_catalog.pg_advisory_xact_lock(?)", (_REGISTER_LOCK_KEY,))
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
                    ids = self._execute(session, "SELECT streampos.hold_ids(?, ?, ?)", (stream, writer, n))[0][0]
                    session.holds += 1
                return Hold(session, stream, list(ids))
            except Exception as e:
                if sqlstate(e) == "53400":
                    # This session holds as many allocations as a session may.
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


def sessions_for(db: "DatabasePool") -> Sessions:
    """The sessions of ``db``, created on first use and closed with
    Synapse's connection pool (at shutdown; in Synapse's tests, before each
    test's database is dropped)."""
    with _by_pool_lock:
        sessions = _by_pool.get(db)
        if sessions is None:
            sessions = _by_pool[db] = Sessions(db)
            pool = db._db_pool
            final_close = pool.finalClose

            # The pool's shutdown trigger and close() both call finalClose.
            def close_with_pool() -> None:
                sessions.close()
                final_close()

            pool.finalClose = close_with_pool
        return sessions
