"""Connections of the generator's own: registration, and the sessions that
hold the IDs of ``get_next()`` / ``get_next_mult()``.

An ID handed out by ``get_next()`` is written by *other* transactions (on
Synapse's pooled connections), so it cannot belong to a transaction: it is
held by a database session with ``streampos.hold_ids`` and released with
``streampos.release_ids`` on the same session once the context exits. Pool
connections differ from call to call, so the sessions here are connections
opened for the purpose, one set per ``DatabasePool`` (per process and
database), shared by every generator of that pool. A session holds at most
``streampos.max_held_per_session`` allocations; beyond that (53400) another
session is opened.

If a session dies (its backend is terminated, the server restarts, the
network fails), the server releases its IDs once every transaction running
at that moment has ended. A transaction that was already writing the rows
when the session died is therefore safe; one that starts afterwards is not,
so the generator must not let Synapse use those IDs: every context whose
session died fails with :class:`HoldLostError` when it exits (a loud failure
of the request that persisted the rows), and new contexts use a new session.

Before 0.3.0 the extension has no ``hold_ids``: the IDs are then allocated
by ``streampos.next_ids`` in a transaction held open on a connection of its
own per running context (committed at exit), with the same loud failure if
that connection dies. That transaction pins the cluster's xmin horizon for
the duration of the context.

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
# finds the work done. The key spells "streampos" in ASCII in the high bytes.
_REGISTER_LOCK_KEY = 0x73747265616D706F

_EXTENSION_SQL = "SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'streampos'"
_HOLDS_SUPPORTED_SQL = """
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
                 JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
                WHERE n.nspname = 'streampos' AND p.proname = 'hold_ids')
"""
_STREAM_SQL = """
SELECT st.backwards, st.seq::regclass::text, st.seq = ?::regclass
  FROM streampos.streams st WHERE st.stream_name = ?
"""
_TABLES_SQL = """
SELECT tbl::regclass::text, id_column, instance_column, tbl = ?::regclass
  FROM streampos.stream_tables WHERE stream_name = ?
"""


class HoldLostError(Exception):
    """The session holding a ``get_next()`` context's IDs ended before the
    context exited: the server has released them, and a reader's frontier
    may have passed them before the rows were committed. Raised when the
    context exits; the IDs are named in the message."""


class RegistrationError(Exception):
    """The stream cannot be registered or used (no extension, privileges,
    a registration that does not match Synapse's)."""


def sqlstate(e: BaseException) -> Optional[str]:
    """The SQLSTATE of a psycopg2 or psycopg 3 error."""
    return getattr(e, "pgcode", None) or getattr(e, "sqlstate", None)


class _Session:
    """One connection of ours. ``lock`` serialises its use."""

    def __init__(self, conn: "LoggingDatabaseConnection", transactional: bool) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.holds = 0
        self.full = False
        self.lost = False
        # Transaction holds: the connection is busy with one open context.
        self.transactional = transactional
        self.busy = False


class Hold:
    """What a context holds: its IDs and the session they are held by."""

    __slots__ = ("session", "stream", "ids", "released")

    def __init__(self, session: _Session, stream: str, ids: List[int]) -> None:
        self.session = session
        self.stream = stream
        self.ids = ids
        self.released = False


class Sessions:
    """The generator connections of one ``DatabasePool``."""

    def __init__(self, db: "DatabasePool") -> None:
        self._db_ref = weakref.ref(db)
        self._config = db._database_config
        self._engine = db.engine
        self._server_name = db.server_name
        self._lock = threading.Lock()
        self._sessions: List[_Session] = []
        self._admin: Optional[_Session] = None
        self._holds_supported: Optional[bool] = None
        self._version: Optional[str] = None
        self._instances: set = set()
        self._closed = False

    # ------------------------------------------------------------ plumbing

    def _connect(self) -> "LoggingDatabaseConnection":
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
        return conn

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
        """The connection for registration and checks (never holds IDs)."""
        if self._admin is None or self._admin.lost or self._engine.is_connection_closed(self._admin.conn.conn):
            self._admin = _Session(self._connect(), transactional=False)
        return self._admin

    def close(self) -> None:
        """Close every connection (at shutdown): IDs still held are released
        by the server once the transactions running now have ended."""
        with self._lock:
            self._closed = True
            sessions, self._sessions = self._sessions, []
            admin, self._admin = self._admin, None
        for s in sessions + ([admin] if admin else []):
            s.lost = True
            try:
                s.conn.close()
            except Exception:  # already gone
                pass

    # ------------------------------------------------------------ registration

    def extension_version(self) -> Optional[str]:
        if self._version is not None:
            return self._version
        with self._lock:
            session = self._admin_session()
        with session.lock:
            rows = self._execute(session, _EXTENSION_SQL)
        self._version = rows[0][0] if rows else None
        return self._version

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
        with self._lock:
            session = self._admin_session()
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
                    known = self._execute(session, _TABLES_SQL, (table, stream))
                    if any(row[3] for row in known):
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
            # (after a restore, say); the extension refuses to move it back.
            for check_name, ok, detail in self._execute(
                session, "SELECT check_name, ok, detail FROM streampos.check_stream(?, repair => true)", (stream,)
            ):
                if not ok or check_name == "repair":
                    done.append(f"check {check_name}: {detail}")
        return done

    # ------------------------------------------------------------ holds

    def holds_supported(self) -> bool:
        if self._holds_supported is None:
            with self._lock:
                session = self._admin_session()
            with session.lock:
                self._holds_supported = bool(self._execute(session, _HOLDS_SUPPORTED_SQL)[0][0])
            if not self._holds_supported:
                logger.warning(
                    "the streampos extension in this database has no hold_ids (older than 0.3.0): "
                    "get_next() holds its IDs in an open transaction per context; run "
                    "ALTER EXTENSION streampos UPDATE"
                )
        return self._holds_supported

    def _pick(self) -> _Session:
        transactional = not self.holds_supported()
        with self._lock:
            for s in self._sessions:
                if s.lost or (s.busy if transactional else s.full):
                    continue
                if transactional:
                    s.busy = True
                return s
            session = _Session(self._connect(), transactional)
            session.busy = transactional
            self._sessions.append(session)
            return session

    def _drop(self, session: _Session) -> None:
        session.lost = True
        with self._lock:
            if session in self._sessions:
                self._sessions.remove(session)
        try:
            session.conn.close()
        except Exception:
            pass

    def _ensure_instance(self, session: _Session, writer: str) -> None:
        """A writer's first allocation creates its instance row; in an open
        transaction that row's lock would be held until the context exits,
        and Synapse's own transactions allocating as the same writer would
        wait for it (a wait no server sees: a deadlock through the client).
        Create it in a transaction of its own first."""
        if writer in self._instances:
            return
        try:
            self._execute(session, "SELECT streampos.instance_id(?)", (writer,))
        except Exception as e:
            if self._is_dead(session, e) or sqlstate(e) != "42501":
                raise
            # Without the grant next_ids creates it; nothing else to do.
        self._instances.add(writer)

    def hold(self, stream: str, writer: str, n: int) -> Hold:
        """Allocate n IDs (external values, allocation order) held until
        :meth:`release`."""
        while True:
            session = self._pick()
            try:
                with session.lock:
                    if session.transactional:
                        self._ensure_instance(session, writer)
                        self._execute(session, "BEGIN")
                        ids = self._execute(session, "SELECT streampos.next_ids(?, ?, ?)", (stream, writer, n))[0][0]
                    else:
                        ids = self._execute(session, "SELECT streampos.hold_ids(?, ?, ?)", (stream, writer, n))[0][0]
                        session.holds += 1
                return Hold(session, stream, list(ids))
            except BaseException as e:
                if session.transactional:
                    self._end_transaction(session, "ROLLBACK")
                if sqlstate(e) == "53400" and not session.transactional:
                    # This session holds as many allocations as a session may.
                    session.full = True
                    continue
                if self._is_dead(session, e):
                    # Died while idle: nothing of ours was held by it that a
                    # context has not already been told about. Once more.
                    self._drop(session)
                    continue
                raise

    def _end_transaction(self, session: _Session, statement: str) -> None:
        try:
            with session.lock:
                self._execute(session, statement)
        except Exception as e:
            if self._is_dead(session, e):
                self._drop(session)
            raise
        finally:
            session.busy = False

    def release(self, hold: Hold) -> None:
        """Finish the IDs of ``hold`` (after the rows' transaction committed).
        Idempotent. Raises HoldLostError if its session died first."""
        if hold.released:
            return
        session = hold.session
        if session.lost:
            hold.released = True
            raise self._lost(hold)
        try:
            if session.transactional:
                try:
                    self._end_transaction(session, "COMMIT")
                except Exception as e:
                    if session.lost:
                        raise self._lost(hold) from e
                    raise
            else:
                try:
                    with session.lock:
                        self._execute(
                            session, "SELECT streampos.release_ids(?, ?::bigint[])", (hold.stream, hold.ids)
                        )
                except Exception as e:
                    if self._is_dead(session, e):
                        self._drop(session)
                        raise self._lost(hold) from e
                    raise
                session.holds -= 1
                session.full = False
        finally:
            hold.released = True

    @staticmethod
    def _lost(hold: Hold) -> HoldLostError:
        return HoldLostError(
            f"stream {hold.stream!r}: the session holding IDs {hold.ids} ended before they were "
            f"released; the server released them, so rows written with them by a transaction that "
            f"began after that may be missed by readers"
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
