"""``StreamposIdGenerator``: Synapse's ``MultiWriterIdGenerator``, on streampos.

Same constructor, same methods, same answers; what changes underneath:

* IDs come from the extension: ``get_next_txn`` / ``get_next_mult_txn`` call
  ``streampos.next_ids`` in Synapse's own transaction (the IDs are in flight
  until it ends), and ``get_next`` / ``get_next_mult`` hold theirs on a
  session of the generator's own (``streampos.hold_ids``) until the context
  exits, after the rows' transaction committed (``streampos.release_ids``).
  A crashed process's IDs are released by the server, never left to hold
  the stream back, and the database's frontier never passes a row that is
  not committed yet.
* Positions at start-up come from the extension (``frontier``,
  ``writer_positions``) in Synapse's start-up transaction, instead of
  ``stream_positions`` plus scans of the stream's tables.
* ``stream_positions`` is never written: the extension keeps positions
  (``streampos.stream_positions``). No upsert after each write.
* The stream registers itself on first use (``adopt_stream`` with
  Synapse's own sequence, ``add_table`` for each table), which is
  idempotent and safe when several workers start at once.

The getters keep Synapse's meaning exactly (see ``_positions.py``): a
process's positions move with its own writes and with replication.

On SQLite (a monolith without streams to share) constructing this class
gives Synapse's own ``MultiWriterIdGenerator``.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from synapse.metrics import SERVER_NAME_LABEL
from synapse.storage.database import DatabasePool, LoggingDatabaseConnection, LoggingTransaction
from synapse.storage.engines import PostgresEngine
from synapse.storage.util import id_generators as _synapse_id_generators
from synapse.storage.util.id_generators import AbstractStreamIdGenerator, stream_current_position_gauge

from ._positions import Positions
from ._sessions import Hold, HoldLostError, RegistrationError, sessions_for, sqlstate

if TYPE_CHECKING:
    from synapse.notifier import ReplicationNotifier

__all__ = ["StreamposIdGenerator", "HoldLostError", "RegistrationError"]

logger = logging.getLogger(__name__)

# Synapse's own class, whatever install() later binds in Synapse's modules.
SYNAPSE_MULTI_WRITER_ID_GENERATOR = _synapse_id_generators.MultiWriterIdGenerator

# One statement, one snapshot: frontier, highest allocated ID and the
# writers' positions agree with each other.
_POSITIONS_SQL = """
SELECT streampos.frontier(?), streampos.max_allocated(?), w.names, w.positions
  FROM (SELECT COALESCE(pg_catalog.array_agg(instance_name ORDER BY instance_id), '{}') AS names,
               COALESCE(pg_catalog.array_agg(stream_id ORDER BY instance_id), '{}') AS positions
          FROM streampos.writer_positions(?)) w
"""
_VISIBLE_SQL = "SELECT 1 FROM streampos.streams WHERE stream_name OPERATOR(pg_catalog.=) ?"


class StreamposIdGenerator(AbstractStreamIdGenerator):
    """A drop-in for Synapse's ``MultiWriterIdGenerator`` (same keyword-only
    constructor) that allocates with the streampos extension."""

    def __new__(cls, *, db: DatabasePool, **kwargs: Any) -> Any:
        if not isinstance(db.engine, PostgresEngine):
            return SYNAPSE_MULTI_WRITER_ID_GENERATOR(db=db, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        *,
        db_conn: LoggingDatabaseConnection,
        db: DatabasePool,
        notifier: "ReplicationNotifier",
        stream_name: str,
        server_name: str,
        instance_name: str,
        tables: List[Tuple[str, str, str]],
        sequence_name: str,
        writers: List[str],
        positive: bool = True,
    ) -> None:
        self._db = db
        self._notifier = notifier
        self._stream_name = stream_name
        self.server_name = server_name
        self._instance_name = instance_name
        self._writers = writers
        self._positive = positive
        self._return_factor = 1 if positive else -1
        self._sequence_name = sequence_name
        self._tables = list(tables)
        gauge = stream_current_position_gauge.labels(stream_name=stream_name, **{SERVER_NAME_LABEL: server_name})
        # Reported positive, for backward streams too (as Synapse does).
        self._positions = Positions(instance_name, gauge.set)

        sessions = sessions_for(db)
        sessions.check_extension()
        try:
            for line in sessions.register(stream_name, sequence_name, self._tables, not positive):
                logger.info("streampos stream %s: %s", stream_name, line)
        except Exception as e:
            if sqlstate(e) == "42501":
                raise RegistrationError(
                    f"cannot register stream {stream_name!r}: {e}; grant the homeserver's role "
                    f"EXECUTE ON ALL FUNCTIONS IN SCHEMA streampos (it must own {sequence_name})"
                ) from e
            raise
        self._load(db_conn)

    # ------------------------------------------------------------ start-up

    def _load(self, db_conn: LoggingDatabaseConnection) -> None:
        """Positions from the extension, read in Synapse's start-up
        transaction: the stores read their stream caches up to these
        positions in that same snapshot."""
        cur = db_conn.cursor(txn_name="streampos_load_positions")
        try:
            cur.execute(_VISIBLE_SQL, (self._stream_name,))
            if cur.fetchone() is None:
                # Registered just now by us or by another process, after
                # this transaction's snapshot was taken (Synapse's
                # connections are REPEATABLE READ): end it, so that the next
                # snapshot sees the stream. It has only read and done
                # idempotent housekeeping so far; this happens once per
                # stream, on the first start.
                db_conn.commit()
            s = self._stream_name
            cur.execute(_POSITIONS_SQL, (s, s, s))
            row = cur.fetchone()
        finally:
            cur.close()
        assert row is not None
        frontier, max_allocated, names, positions = row
        f = self._return_factor
        read = {name: int(p) * f for name, p in zip(names, positions)}
        self._positions.start(int(frontier) * f, int(max_allocated) * f, read, self._writers)

    # ------------------------------------------------------------ allocation

    def _check_writer(self) -> None:
        if self._writers and self._instance_name not in self._writers:
            raise Exception("Tried to allocate stream ID on non-writer")

    def _next_ids_txn(self, txn: LoggingTransaction, n: int) -> List[int]:
        """n IDs (internal values) in flight until ``txn`` ends."""
        if n == 0:
            return []
        ticket = self._positions.begin_allocation()
        ids: List[int] = []
        try:
            if not _autocommit(txn):
                txn.execute("SELECT streampos.next_ids(?, ?, ?)", (self._stream_name, self._instance_name, n))
                row = txn.fetchone()
                assert row is not None
                ids = [i * self._return_factor for i in row[0]]
            else:
                # An autocommit "transaction" would finish the IDs at the end
                # of the statement, before the rows are written: hold them
                # until Synapse's interaction is over instead.
                hold = sessions_for(self._db).hold(self._stream_name, self._instance_name, n)
                ids = [i * self._return_factor for i in hold.ids]
                txn.call_after(self._release_in_background, hold)
                txn.call_on_exception(self._release_in_background, hold)
        finally:
            self._positions.end_allocation(ticket, ids)
        return ids

    def get_next_txn(self, txn: LoggingTransaction) -> int:
        """One ID for rows written in ``txn``: finished when ``txn`` ends."""
        return self.get_next_mult_txn(txn, 1)[0]

    def get_next_mult_txn(self, txn: LoggingTransaction, n: int) -> List[int]:
        """n IDs for rows written in ``txn``: finished when ``txn`` ends."""
        self._check_writer()
        ids = self._next_ids_txn(txn, n)
        # Callbacks accumulate over Synapse's retries of the transaction, so
        # the IDs of a failed attempt are finished too (they are a gap).
        txn.call_after(self._positions.finish, ids)
        txn.call_on_exception(self._positions.finish, ids)
        txn.call_after(self._notifier.notify_replication)
        return [i * self._return_factor for i in ids]

    def get_next(self) -> "_HeldIds":
        """``async with gen.get_next() as stream_id:`` — in flight until the
        block exits."""
        self._check_writer()
        return _HeldIds(self, None)

    def get_next_mult(self, n: int) -> "_HeldIds":
        """``async with gen.get_next_mult(n) as stream_ids:``."""
        self._check_writer()
        return _HeldIds(self, n)

    def _hold_txn(self, txn: LoggingTransaction, ctx: "_HeldIds") -> None:
        # Runs on a database thread (Synapse's pool), but the hold is on a
        # session of ours: a pool connection is not the same from call to
        # call. Synapse may call this again if its own connection failed
        # around it: the first hold is kept.
        if ctx.hold is not None:
            return
        ticket = self._positions.begin_allocation()
        ids: List[int] = []
        try:
            ctx.hold = sessions_for(self._db).hold(self._stream_name, self._instance_name, ctx.n or 1)
            ids = [i * self._return_factor for i in ctx.hold.ids]
        finally:
            self._positions.end_allocation(ticket, ids)

    def _release_txn(self, txn: LoggingTransaction, hold: Hold) -> None:
        hold.owner.release(hold)

    async def _release(self, hold: Hold) -> None:
        await self._db.runInteraction("StreamposIdGenerator._release", self._release_txn, hold, db_autocommit=True)

    def _release_in_background(self, hold: Hold) -> None:
        async def release() -> None:
            try:
                await self._release(hold)
            except HoldLostError as e:
                logger.error("%s", e)

        self._db.hs.run_as_background_process("StreamposIdGenerator._release", release)

    # ------------------------------------------------------------ getters

    def get_current_token(self) -> int:
        return self._positions.persisted() * self._return_factor

    def get_persisted_upto_position(self) -> int:
        return self._positions.persisted() * self._return_factor

    def get_current_token_for_writer(self, instance_name: str) -> int:
        return self._positions.writer(instance_name) * self._return_factor

    def get_minimal_local_current_token(self) -> int:
        return self._positions.minimal_local() * self._return_factor

    def get_positions(self) -> Dict[str, int]:
        return {name: p * self._return_factor for name, p in self._positions.all().items()}

    def advance(self, instance_name: str, new_id: int) -> None:
        self._positions.advance(instance_name, new_id * self._return_factor)

    async def get_max_allocated_token(self) -> int:
        """The highest ID handed out (counted positive, as Synapse's)."""

        def read(txn: LoggingTransaction) -> int:
            txn.execute("SELECT streampos.max_allocated(?)", (self._stream_name,))
            row = txn.fetchone()
            assert row is not None
            return int(row[0]) * self._return_factor

        return await self._db.runInteraction("get_max_allocated_token", read)


def _autocommit(txn: LoggingTransaction) -> bool:
    return bool(getattr(txn.txn.connection, "autocommit", False))


class _HeldIds:
    """The async context manager of get_next / get_next_mult."""

    __slots__ = ("gen", "n", "hold")

    def __init__(self, gen: StreamposIdGenerator, n: Optional[int]) -> None:
        self.gen = gen
        self.n = n
        self.hold: Optional[Hold] = None

    def _ids(self) -> List[int]:
        assert self.hold is not None
        return [i * self.gen._return_factor for i in self.hold.ids]

    async def __aenter__(self) -> Any:
        gen = self.gen
        if self.n == 0:
            return []
        try:
            # As Synapse's: a database interaction named _load_next_mult_id
            # (a pool thread runs it; the hold is on our session).
            await gen._db.runInteraction("_load_next_mult_id", gen._hold_txn, self, db_autocommit=True)
        except BaseException:
            # Cancelled (or the coroutine closed) after the hold was taken:
            # __aexit__ will not run. Finish the IDs here and release them in
            # the background, so that they never pin the stream.
            if self.hold is not None:
                gen._positions.finish(self._ids())
                gen._notifier.notify_replication()
                gen._release_in_background(self.hold)
            raise
        assert self.hold is not None
        external = self.hold.ids
        return list(external) if self.n is not None else external[0]

    async def __aexit__(
        self,
        exc_type: Optional[type],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> bool:
        gen = self.gen
        if self.hold is None:  # get_next_mult(0)
            return False
        gen._positions.finish(self._ids())
        gen._notifier.notify_replication()
        try:
            await gen._release(self.hold)
        except HoldLostError as e:
            logger.error("%s", e)
            if exc_type is None:
                raise
        return False
