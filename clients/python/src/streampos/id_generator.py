"""Synapse's ``MultiWriterIdGenerator``, backed by streampos.

Synapse hands out stream IDs from a sequence and then tracks, in each
process's memory, which IDs are still being written, learning other writers'
positions over replication (``advance``). With streampos the database knows:
an ID is *in flight* until the transaction that called ``streampos.next_id``
ends, and ``streampos.frontier`` / ``writer_positions`` are exact. This
generator keeps Synapse's interface and meaning on top of that:

* ``get_next_txn(txn)`` allocates in the caller's own transaction: the ID is
  finished exactly when that transaction commits or rolls back. The best
  path: rows and ID become visible together.
* ``get_next()`` / ``get_next_mult(n)`` are async context managers, as in
  Synapse, for code that writes the rows elsewhere. The ID is allocated in a
  transaction held open on a connection of the generator's own for the
  duration of the context, and that transaction ends at exit (committed, or
  rolled back on an exception; either way the ID is finished). Rows written
  by other transactions inside the context are therefore visible before the
  position covers them.
* The getters (``get_current_token`` and friends) are synchronous and
  answer from the generator's *view*: positions read from the database (at
  creation, at every context exit, on ``refresh()``, or continuously with
  ``start_watching()``), merged with what ``advance()`` reports. Every value
  in the view was true when read and positions only move forward, so a
  getter is never ahead of the truth; it can only lag until the next read.

After a read, values are at least Synapse's and never ahead of the truth:
an idle writer's position is the stream's maximum allocated ID, and a writer
that never writes holds nothing back. Between reads the view holds facts
only; it does not make Synapse's inferences (a run of positions without a
gap, an idle local writer at the highest ID allocated anywhere), which the
database cannot confirm until the WAL is flushed. An empty stream is at 0
and allocates 1 first (Synapse's start at 1). See README.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, Union

import psycopg
from psycopg import pq

from .tokens import MultiWriterToken

__all__ = ["MultiWriterIdGenerator", "SyncMultiWriterIdGenerator", "NotAWriterError"]

logger = logging.getLogger(__name__)

# One statement, hence one snapshot: every position in the view is
# consistent with the others.
_VIEW_SQL = """
SELECT streampos.frontier(%(s)s),
       streampos.max_allocated(%(s)s),
       (SELECT COALESCE(pg_catalog.jsonb_agg(
                   pg_catalog.jsonb_build_array(w.instance_name, w.instance_id, w.stream_id)
                   ORDER BY w.instance_id), '[]'::jsonb)
          FROM streampos.writer_positions(%(s)s) w),
       (SELECT st.backwards FROM streampos.streams st WHERE st.stream_name OPERATOR(pg_catalog.=) %(s)s),
       (SELECT st.writers FROM streampos.streams st WHERE st.stream_name OPERATOR(pg_catalog.=) %(s)s)
"""

_NEXT_IDS_SQL = "SELECT streampos.next_ids(%s, %s, %s)"
_MAX_ALLOCATED_SQL = "SELECT streampos.max_allocated(%s)"
_SET_WRITERS_SQL = "SELECT streampos.set_writers(%s, %s::text[])"
_REPAIR_SQL = "SELECT check_name, ok, detail FROM streampos.check_stream(%s, repair => true)"
_UPDATES_SQL = "SELECT streampos.updates(%s, %s::streampos.multi_writer_token, 1, %s)"
_WAIT_FOR_SQL = "SELECT streampos.wait_for(%s, %s, %s)"


class NotAWriterError(Exception):
    """This instance is not one of the stream's configured writers."""


# ------------------------------------------------------------------ state


class _View:
    """The generator's knowledge of the stream, counted positive (backward
    streams are negated at the boundary, as Synapse does). Thread-safe:
    Synapse calls getters from database threads.

    Sources, each true when learnt, merged by maximum: rows of _VIEW_SQL
    (exact for their snapshot), ``advance`` (replication), and what this
    generator knows of its own allocations. That last one assumes what
    Synapse assumes: one generator per instance name, and every ID of that
    instance allocated through it."""

    def __init__(self, instance_name: str, backwards: bool) -> None:
        self.lock = threading.Lock()
        self.instance_name = instance_name
        self.factor = -1 if backwards else 1
        self.frontier = 0
        self.max_allocated = 0
        # Writer positions as read or advanced (not raised by our idleness).
        self.positions: Dict[str, int] = {}
        self.instance_ids: Dict[str, int] = {}
        self.writers: Optional[Tuple[str, ...]] = None
        # Our position as of our own writes (Synapse's "minimal local
        # current token"); None until the first read.
        self.local_position: Optional[int] = None
        # IDs we allocated whose end we have not seen yet, and those seen
        # ended above our local position.
        self.unfinished: set = set()
        self.finished: set = set()

    # Every method below is called with self.lock held.

    def is_writer(self) -> bool:
        return self.writers is None or self.instance_name in self.writers

    def merge_read(self, row: Sequence[Any]) -> None:
        """Merge one row of _VIEW_SQL (external values)."""
        frontier, max_allocated, writer_rows, backwards, writers = row
        f = self.factor
        if (f == -1) != bool(backwards):
            raise psycopg.ProgrammingError("the stream's direction changed under the generator")
        self.writers = None if writers is None else tuple(writers)
        self.frontier = max(self.frontier, frontier * f)
        self.max_allocated = max(self.max_allocated, max_allocated * f)
        fresh: Dict[str, int] = {}
        for name, instance_id, position in writer_rows:
            fresh[name] = max(self.positions.get(name, position * f), position * f)
            self.instance_ids[name] = instance_id
        if self.writers is not None:
            # A writer removed from the configuration leaves the view, as a
            # restarted Synapse forgets it.
            self.positions = fresh
        else:
            self.positions.update(fresh)
        own = fresh.get(self.instance_name)
        if own is not None:
            # Every ID of ours up to our database position is finished.
            done = {i for i in self.unfinished if i <= own}
            self.unfinished -= done
            self.finished |= done
            if self.local_position is None:
                self.local_position = own
        elif self.local_position is None and self.is_writer():
            # A writer that has not written yet starts at the current token
            # (Synapse pre-seeds its own position so).
            self.local_position = self.frontier
        self._settle()

    def allocated(self, ids: Sequence[int]) -> None:
        internal = [i * self.factor for i in ids]
        self.unfinished.update(internal)
        self.max_allocated = max([self.max_allocated, *internal])
        self._settle()

    def ended(self, ids: Sequence[int]) -> None:
        internal = {i * self.factor for i in ids}
        self.unfinished -= internal
        self.finished |= internal
        self._settle()

    def advance(self, instance_name: str, new_id: int) -> None:
        new = new_id * self.factor
        self.positions[instance_name] = max(new, self.positions.get(instance_name, new))
        self.max_allocated = max(self.max_allocated, new)
        self._settle()

    def _settle(self) -> None:
        # Our own position: the largest finished ID below the smallest
        # unfinished one (Synapse's _mark_ids_as_finished).
        if self.finished:
            low = min(self.unfinished) if self.unfinished else None
            below = [i for i in self.finished if low is None or i < low]
            self.finished = {i for i in self.finished if low is not None and i >= low}
            if below:
                top = max(below)
                self.local_position = top if self.local_position is None else max(self.local_position, top)
        if self.writers:
            # Every ID belongs to a configured writer, so every ID up to the
            # lowest writer position is finished. (For an open stream the
            # writers are unknown: only a read moves the frontier.) Unlike
            # Synapse we do not leave out our own position while we are
            # idle, nor jump it to the highest allocated ID: an ID another
            # writer holds can come back after a crash until the WAL is
            # flushed, which only the database knows.
            lowest = min(self.writer_position(w) for w in self.writers)
            self.frontier = max(self.frontier, lowest)

    def writer_position(self, instance_name: str) -> int:
        position = max(self.positions.get(instance_name, self.frontier), self.frontier)
        if instance_name == self.instance_name and self.local_position is not None:
            position = max(position, self.local_position)
        return position

    def check_writer(self) -> None:
        if not self.is_writer():
            raise NotAWriterError(
                f"tried to allocate a stream ID on non-writer {self.instance_name!r}; "
                f"the stream's writers are {list(self.writers or ())}"
            )


class _Base:
    """What both generators share: the view and the synchronous getters."""

    _view: _View

    def __init__(self, stream_name: str, instance_name: str) -> None:
        self._stream_name = stream_name
        self._instance_name = instance_name

    @property
    def stream_name(self) -> str:
        return self._stream_name

    @property
    def instance_name(self) -> str:
        return self._instance_name

    @property
    def positive(self) -> bool:
        return self._view.factor == 1

    def get_current_token(self) -> int:
        """The largest position with every ID at or before it finished
        (``streampos.frontier`` as of the view)."""
        with self._view.lock:
            return self._view.frontier * self._view.factor

    def get_persisted_upto_position(self) -> int:
        """Same as :meth:`get_current_token`."""
        return self.get_current_token()

    def get_current_token_for_writer(self, instance_name: str) -> int:
        """The position of one writer: every ID of it at or before this is
        finished. A writer the view does not know is at the current token
        (Synapse: "for new writers we assume their initial position to be
        the current persisted up to position")."""
        with self._view.lock:
            return self._view.writer_position(instance_name) * self._view.factor

    def get_minimal_local_current_token(self) -> int:
        """The local instance's position as of its own writes (not moved by
        other writers' progress); the current token if it is not a writer."""
        with self._view.lock:
            v = self._view
            position = v.local_position if v.local_position is not None else v.frontier
            return position * v.factor

    def get_positions(self) -> Dict[str, int]:
        """A copy of the position of every writer in the view: the stream's
        configured writers, or for an open stream the writers seen."""
        with self._view.lock:
            return {name: p * self._view.factor for name, p in self._view.positions.items()}

    def get_current_multi_writer_token(self) -> MultiWriterToken:
        """The view as a token: the current token plus every writer ahead of
        it, keyed by instance id (what ``streampos.current_token`` returns).
        A backward stream's token is its current token alone."""
        with self._view.lock:
            v = self._view
            if v.factor == -1:
                return MultiWriterToken(-v.frontier)
            return MultiWriterToken(
                v.frontier,
                {v.instance_ids[name]: p for name, p in v.positions.items() if name in v.instance_ids and p > v.frontier},
            )

    def advance(self, instance_name: str, new_id: int) -> None:
        """Replication says ``instance_name`` has finished everything up to
        ``new_id``: move the view forward (never back)."""
        with self._view.lock:
            self._view.advance(instance_name, new_id)

    def _merge(self, row: Sequence[Any]) -> None:
        with self._view.lock:
            self._view.merge_read(row)

    def _check_txn(self, conn: Any) -> None:
        if conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE:
            raise psycopg.ProgrammingError(
                "get_next_txn() needs an open transaction: in autocommit mode the ID "
                "would be finished before the rows are written; use conn.transaction()"
            )


def _check_direction(stream_name: str, row: Sequence[Any], positive: Optional[bool]) -> bool:
    """Whether the stream counts backwards; refuses a ``positive`` that
    says otherwise."""
    backwards = bool(row[3])
    if positive is not None and positive == backwards:
        raise ValueError(
            f"stream {stream_name!r} counts {'backwards' if backwards else 'forwards'}, "
            f"but positive={positive} was given"
        )
    return backwards


def _log_repairs(stream_name: str, rows: Sequence[Sequence[Any]]) -> None:
    for check_name, ok, detail in rows:
        if not ok or check_name == "repair":
            logger.warning("stream %s: check %s: %s", stream_name, check_name, detail)


def _writers_differ(configured: Optional[Sequence[str]], wanted: Sequence[str]) -> bool:
    if not wanted:
        return configured is not None
    return configured is None or sorted(set(configured)) != sorted(set(wanted))


# ------------------------------------------------------------------ async


class _AsyncIds:
    """The async context manager of get_next / get_next_mult."""

    def __init__(self, gen: "MultiWriterIdGenerator", n: Optional[int]) -> None:
        self._gen = gen
        self._n = n
        self._conn: Optional[psycopg.AsyncConnection] = None
        self._ids: List[int] = []

    async def __aenter__(self) -> Union[int, List[int]]:
        gen = self._gen
        with gen._view.lock:
            gen._view.check_writer()
        conn, pooled = await gen._acquire()
        try:
            try:
                self._ids = await self._allocate(conn)
            except psycopg.OperationalError:
                if not (pooled and conn.closed):
                    raise
                # A kept connection died while idle (say, a server restart):
                # once more on a new one.
                conn = await gen._connect()
                self._ids = await self._allocate(conn)
        except BaseException:
            # Cancelled or failed: end the transaction now, so that no ID is
            # left in flight (psycopg cancels a running query first).
            await asyncio.shield(gen._dispose(conn, rollback=True))
            raise
        self._conn = conn
        with gen._view.lock:
            gen._view.allocated(self._ids)
        return self._ids if self._n is not None else self._ids[0]

    async def _allocate(self, conn: psycopg.AsyncConnection) -> List[int]:
        gen = self._gen
        await conn.execute("BEGIN")
        cur = await conn.execute(_NEXT_IDS_SQL, (gen._stream_name, gen._instance_name, self._n or 1))
        row = await cur.fetchone()
        assert row is not None
        return list(row[0])

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        gen, conn = self._gen, self._conn
        assert conn is not None
        self._conn = None
        # Shielded: a cancelled caller must not leave the transaction open.
        await asyncio.shield(gen._finish(conn, self._ids, commit=exc_type is None))
        return False


class MultiWriterIdGenerator(_Base):
    """Synapse's ``MultiWriterIdGenerator`` on psycopg async connections.

    Create with :meth:`create` and close with :meth:`close` (or use it as an
    async context manager)::

        gen = await MultiWriterIdGenerator.create(
            conninfo, stream_name="events", instance_name="event_persister1")
        async with gen.get_next() as stream_id:
            ...                       # write rows with stream_id
        gen.get_current_token()
    """

    def __init__(self, *, conninfo: str, connect_kwargs: Dict[str, Any], stream_name: str, instance_name: str,
                 max_idle_connections: int,
                 connect: Optional[Callable[[], Awaitable[psycopg.AsyncConnection]]]) -> None:
        super().__init__(stream_name, instance_name)
        self._conninfo = conninfo
        self._connect_kwargs = connect_kwargs
        self._connect_factory = connect
        self._max_idle = max_idle_connections
        self._idle: List[psycopg.AsyncConnection] = []
        self._main: Optional[psycopg.AsyncConnection] = None
        self._main_lock = asyncio.Lock()
        self._watcher: Optional[asyncio.Task] = None
        self._closed = False

    @classmethod
    async def create(
        cls,
        conninfo: str = "",
        *,
        stream_name: str,
        instance_name: str,
        writers: Optional[Sequence[str]] = None,
        positive: Optional[bool] = None,
        repair: bool = False,
        connect: Optional[Callable[[], Awaitable[psycopg.AsyncConnection]]] = None,
        max_idle_connections: int = 4,
        **connect_kwargs: Any,
    ) -> "MultiWriterIdGenerator":
        """Connect and read the stream's positions.

        ``conninfo`` and ``connect_kwargs`` go to
        ``psycopg.AsyncConnection.connect``; or ``connect`` is a coroutine
        function returning a new connection (it is switched to autocommit).

        ``writers``: None keeps the stream's writer configuration; a list
        makes it exactly that (``streampos.set_writers``; an empty list lets
        any instance write), as Synapse's generator prunes
        ``stream_positions`` to its configured writers at start-up.
        ``positive``, when given, must match the stream's direction.
        ``repair``: when this instance may write, move the sequence past
        the highest ID in the stream's tables first
        (``streampos.check_stream(…, repair => true)``), as Synapse checks
        its sequences at start-up. Off by default: a repair is an
        operator's action (after a restore, or rows written without the
        sequence), not something every start of a writer does: it reads
        every table of the stream, and moves the sequence as far as any of
        them says.
        ``max_idle_connections`` bounds the connections kept for
        ``get_next`` contexts (more are opened while more are open at once).
        """
        gen = cls(conninfo=conninfo, connect_kwargs=connect_kwargs, stream_name=stream_name,
                  instance_name=instance_name, max_idle_connections=max_idle_connections, connect=connect)
        try:
            gen._main = main = await gen._connect()

            async def read() -> Sequence[Any]:
                cur = await main.execute(_VIEW_SQL, {"s": stream_name})
                row = await cur.fetchone()
                assert row is not None
                return row

            row = await read()
            gen._view = _View(instance_name, _check_direction(stream_name, row, positive))
            if writers is not None and _writers_differ(row[4], writers):
                await main.execute(_SET_WRITERS_SQL, (stream_name, list(writers) or None))
                row = await read()
            gen._merge(row)
            if repair and gen._view.is_writer():
                cur = await main.execute(_REPAIR_SQL, (stream_name,))
                _log_repairs(stream_name, await cur.fetchall())
                gen._merge(await read())
        except BaseException:
            await gen.close()
            raise
        return gen

    async def __aenter__(self) -> "MultiWriterIdGenerator":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop watching and close every connection of the generator."""
        self._closed = True
        await self.stop_watching()
        conns = self._idle + ([self._main] if self._main is not None else [])
        self._idle, self._main = [], None
        for conn in conns:
            await conn.close()

    # -------------------------------------------------------- connections

    async def _connect(self) -> psycopg.AsyncConnection:
        if self._connect_factory is None:
            return await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True, **self._connect_kwargs)
        conn = await self._connect_factory()
        if not conn.autocommit:
            await conn.set_autocommit(True)
        return conn

    async def _acquire(self) -> Tuple[psycopg.AsyncConnection, bool]:
        """A connection for an allocation, and whether it was kept idle."""
        if self._closed:
            raise psycopg.InterfaceError("the generator is closed")
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.info.transaction_status == pq.TransactionStatus.IDLE:
                return conn, True
            await conn.close()
        return await self._connect(), False

    async def _release(self, conn: psycopg.AsyncConnection) -> None:
        if self._closed or len(self._idle) >= self._max_idle or conn.closed:
            await conn.close()
        else:
            self._idle.append(conn)

    async def _dispose(self, conn: psycopg.AsyncConnection, rollback: bool) -> None:
        """End the connection's transaction (rollback) and keep it, or close
        it if it is broken: the server then ends the transaction."""
        try:
            if rollback and not conn.closed:
                await conn.execute("ROLLBACK")
            await self._release(conn)
        except psycopg.Error:
            await conn.close()

    async def _finish(self, conn: psycopg.AsyncConnection, ids: List[int], commit: bool) -> None:
        try:
            await conn.execute("COMMIT" if commit else "ROLLBACK")
        except psycopg.OperationalError as e:
            # The session is gone and the server ended its transaction with
            # it. After a crash the IDs may be handed out again, so they stay
            # unfinished in the view until a read shows our position past them.
            logger.warning("stream %s: allocation connection lost at exit (%s)", self._stream_name, e)
            await conn.close()
            return
        with self._view.lock:
            self._view.ended(ids)
        try:
            cur = await conn.execute(_VIEW_SQL, {"s": self._stream_name})
            row = await cur.fetchone()
            assert row is not None
            self._merge(row)
        except psycopg.OperationalError as e:
            # The view only lags; the next read catches up.
            logger.warning("stream %s: could not refresh positions (%s)", self._stream_name, e)
            await conn.close()
            return
        await self._release(conn)

    # -------------------------------------------------------- allocation

    def get_next(self) -> _AsyncIds:
        """``async with gen.get_next() as stream_id:`` — one ID, in flight
        until the block exits."""
        return _AsyncIds(self, None)

    def get_next_mult(self, n: int) -> _AsyncIds:
        """``async with gen.get_next_mult(n) as stream_ids:`` — n IDs in
        allocation order (not necessarily consecutive under concurrency)."""
        return _AsyncIds(self, n)

    async def get_next_txn(self, txn: Union[psycopg.AsyncConnection, psycopg.AsyncCursor]) -> int:
        """One ID allocated in the caller's transaction (``txn`` is an async
        connection or cursor with a transaction open or about to open): it
        is finished exactly when that transaction ends, so the rows MUST be
        written in it."""
        return (await self.get_next_mult_txn(txn, 1))[0]

    async def get_next_mult_txn(self, txn: Union[psycopg.AsyncConnection, psycopg.AsyncCursor], n: int) -> List[int]:
        """n IDs allocated in the caller's transaction (see get_next_txn)."""
        with self._view.lock:
            self._view.check_writer()
        conn = txn.connection if isinstance(txn, psycopg.AsyncCursor) else txn
        self._check_txn(conn)
        cur = await txn.execute(_NEXT_IDS_SQL, (self._stream_name, self._instance_name, n))
        row = await cur.fetchone()
        assert row is not None
        ids = list(row[0])
        with self._view.lock:
            self._view.allocated(ids)
        return ids

    # -------------------------------------------------------- reading

    async def _query_main(self, sql: str, params: Any) -> Sequence[Any]:
        """One row from the generator's own connection, reconnecting once if
        that connection died (say, a server restart)."""
        async with self._main_lock:
            for attempt in (1, 2):
                if self._main is None or self._main.closed:
                    if self._closed:
                        raise psycopg.InterfaceError("the generator is closed")
                    self._main = await self._connect()
                try:
                    cur = await self._main.execute(sql, params)
                    row = await cur.fetchone()
                    assert row is not None
                    return row
                except psycopg.OperationalError:
                    if attempt == 2 or not self._main.closed:
                        raise
            raise AssertionError("unreachable")

    async def refresh(self) -> None:
        """Read the stream's positions now and merge them into the view."""
        self._merge(await self._query_main(_VIEW_SQL, {"s": self._stream_name}))

    async def get_max_allocated_token(self) -> int:
        """The largest ID handed out so far (``streampos.max_allocated``)."""
        return int((await self._query_main(_MAX_ALLOCATED_SQL, (self._stream_name,)))[0])

    def start_watching(self, timeout_ms: int = 10000) -> None:
        """Keep the view current in the background: a connection of its own
        long-polls ``streampos.updates`` (``wait_for`` on a backward stream)
        and refreshes the view whenever a writer moves. This replaces
        Synapse's replication for positions; ``advance`` still works."""
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch(timeout_ms))

    async def stop_watching(self) -> None:
        task, self._watcher = self._watcher, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, psycopg.Error):
                await task

    async def _watch(self, timeout_ms: int) -> None:
        conn: Optional[psycopg.AsyncConnection] = None
        try:
            while True:
                try:
                    if conn is None or conn.closed:
                        conn = await self._connect()
                    cur = await conn.execute(_VIEW_SQL, {"s": self._stream_name})
                    row = await cur.fetchone()
                    assert row is not None
                    self._merge(row)
                    if self.positive:
                        since = str(self.get_current_multi_writer_token())
                        await conn.execute(_UPDATES_SQL, (self._stream_name, since, timeout_ms))
                    else:
                        target = self.get_current_token() - 1
                        await conn.execute(_WAIT_FOR_SQL, (self._stream_name, target, timeout_ms))
                except psycopg.OperationalError as e:
                    logger.warning("stream %s: watcher lost its connection (%s); retrying", self._stream_name, e)
                    if conn is not None:
                        await conn.close()
                    conn = None
                    await asyncio.sleep(1.0)
        finally:
            if conn is not None:
                await conn.close()


# ------------------------------------------------------------------ sync


class _SyncIds:
    """The context manager of SyncMultiWriterIdGenerator.get_next(_mult)."""

    def __init__(self, gen: "SyncMultiWriterIdGenerator", n: Optional[int]) -> None:
        self._gen = gen
        self._n = n
        self._conn: Optional[psycopg.Connection] = None
        self._ids: List[int] = []

    def __enter__(self) -> Union[int, List[int]]:
        gen = self._gen
        with gen._view.lock:
            gen._view.check_writer()
        conn, pooled = gen._acquire()
        try:
            try:
                self._ids = self._allocate(conn)
            except psycopg.OperationalError:
                if not (pooled and conn.closed):
                    raise
                conn = gen._connect()
                self._ids = self._allocate(conn)
        except BaseException:
            gen._dispose(conn, rollback=True)
            raise
        self._conn = conn
        with gen._view.lock:
            gen._view.allocated(self._ids)
        return self._ids if self._n is not None else self._ids[0]

    def _allocate(self, conn: psycopg.Connection) -> List[int]:
        gen = self._gen
        conn.execute("BEGIN")
        row = conn.execute(_NEXT_IDS_SQL, (gen._stream_name, gen._instance_name, self._n or 1)).fetchone()
        assert row is not None
        return list(row[0])

    def __exit__(self, exc_type, exc, tb) -> bool:
        conn, self._conn = self._conn, None
        assert conn is not None
        self._gen._finish(conn, self._ids, commit=exc_type is None)
        return False


class SyncMultiWriterIdGenerator(_Base):
    """The same generator on blocking psycopg connections (thread-safe):
    ``with gen.get_next() as stream_id:``, ``gen.get_next_txn(cursor)``."""

    def __init__(self, conninfo: str = "", *, stream_name: str, instance_name: str,
                 writers: Optional[Sequence[str]] = None, positive: Optional[bool] = None,
                 repair: bool = False, connect: Optional[Callable[[], psycopg.Connection]] = None,
                 max_idle_connections: int = 4, **connect_kwargs: Any) -> None:
        super().__init__(stream_name, instance_name)
        self._conninfo = conninfo
        self._connect_kwargs = connect_kwargs
        self._connect_factory = connect
        self._max_idle = max_idle_connections
        self._idle: List[psycopg.Connection] = []
        self._pool_lock = threading.Lock()
        self._main_lock = threading.Lock()
        self._closed = False
        self._main: Optional[psycopg.Connection] = None
        try:
            self._main = main = self._connect()

            def read() -> Sequence[Any]:
                row = main.execute(_VIEW_SQL, {"s": stream_name}).fetchone()
                assert row is not None
                return row

            row = read()
            self._view = _View(instance_name, _check_direction(stream_name, row, positive))
            if writers is not None and _writers_differ(row[4], writers):
                main.execute(_SET_WRITERS_SQL, (stream_name, list(writers) or None))
                row = read()
            self._merge(row)
            if repair and self._view.is_writer():
                _log_repairs(stream_name, main.execute(_REPAIR_SQL, (stream_name,)).fetchall())
                self._merge(read())
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "SyncMultiWriterIdGenerator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        with self._pool_lock:
            conns = self._idle + ([self._main] if self._main is not None else [])
            self._idle, self._main = [], None
        for conn in conns:
            conn.close()

    def _connect(self) -> psycopg.Connection:
        if self._connect_factory is None:
            return psycopg.Connection.connect(self._conninfo, autocommit=True, **self._connect_kwargs)
        conn = self._connect_factory()
        if not conn.autocommit:
            conn.autocommit = True
        return conn

    def _acquire(self) -> Tuple[psycopg.Connection, bool]:
        if self._closed:
            raise psycopg.InterfaceError("the generator is closed")
        while True:
            with self._pool_lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect(), False
            if not conn.closed and conn.info.transaction_status == pq.TransactionStatus.IDLE:
                return conn, True
            conn.close()

    def _release(self, conn: psycopg.Connection) -> None:
        with self._pool_lock:
            if not (self._closed or len(self._idle) >= self._max_idle or conn.closed):
                self._idle.append(conn)
                return
        conn.close()

    def _dispose(self, conn: psycopg.Connection, rollback: bool) -> None:
        try:
            if rollback and not conn.closed:
                conn.execute("ROLLBACK")
            self._release(conn)
        except psycopg.Error:
            conn.close()

    def _finish(self, conn: psycopg.Connection, ids: List[int], commit: bool) -> None:
        try:
            conn.execute("COMMIT" if commit else "ROLLBACK")
        except psycopg.OperationalError as e:
            # See MultiWriterIdGenerator._finish.
            logger.warning("stream %s: allocation connection lost at exit (%s)", self._stream_name, e)
            conn.close()
            return
        with self._view.lock:
            self._view.ended(ids)
        try:
            row = conn.execute(_VIEW_SQL, {"s": self._stream_name}).fetchone()
            assert row is not None
            self._merge(row)
        except psycopg.OperationalError as e:
            logger.warning("stream %s: could not refresh positions (%s)", self._stream_name, e)
            conn.close()
            return
        self._release(conn)

    def get_next(self) -> _SyncIds:
        return _SyncIds(self, None)

    def get_next_mult(self, n: int) -> _SyncIds:
        return _SyncIds(self, n)

    def get_next_txn(self, txn: Union[psycopg.Connection, psycopg.Cursor]) -> int:
        return self.get_next_mult_txn(txn, 1)[0]

    def get_next_mult_txn(self, txn: Union[psycopg.Connection, psycopg.Cursor], n: int) -> List[int]:
        with self._view.lock:
            self._view.check_writer()
        conn = txn.connection if isinstance(txn, psycopg.Cursor) else txn
        self._check_txn(conn)
        row = txn.execute(_NEXT_IDS_SQL, (self._stream_name, self._instance_name, n)).fetchone()
        assert row is not None
        ids = list(row[0])
        with self._view.lock:
            self._view.allocated(ids)
        return ids

    def _query_main(self, sql: str, params: Any) -> Sequence[Any]:
        with self._main_lock:
            for attempt in (1, 2):
                if self._main is None or self._main.closed:
                    if self._closed:
                        raise psycopg.InterfaceError("the generator is closed")
                    self._main = self._connect()
                try:
                    row = self._main.execute(sql, params).fetchone()
                    assert row is not None
                    return row
                except psycopg.OperationalError:
                    if attempt == 2 or not self._main.closed:
                        raise
            raise AssertionError("unreachable")

    def refresh(self) -> None:
        """Read the stream's positions now and merge them into the view."""
        self._merge(self._query_main(_VIEW_SQL, {"s": self._stream_name}))

    def get_max_allocated_token(self) -> int:
        """The largest ID handed out so far (``streampos.max_allocated``)."""
        return int(self._query_main(_MAX_ALLOCATED_SQL, (self._stream_name,))[0])
