"""A named consumer of a stream: registered once, it reads rows with
``streampos.updates(…, consumer => name)`` and acknowledges them with
``streampos.ack`` in the same transaction as whatever it does with them.

Work done in the database inside :meth:`Consumer.batch` commits with the
acknowledgement, so after a crash (the process killed, the connection
lost) the consumer resumes from its last acknowledged position and
processes every row exactly once. Work outside the database (a request to
a remote server) happens before the acknowledgement commits: after a crash
between the two it is done again, at least once.

Only one process should run a consumer at a time: with ``exclusive=True``
(the default) the consumer takes a session-level advisory lock on its
name, and a second process waits for the first to go. A session of
another role that holds the lock (any role can take an advisory lock) is
an error at once (55P03), never a wait.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Union

import psycopg

from .tokens import MultiWriterToken

__all__ = ["Batch", "Consumer", "TableRows"]

# The first key of the consumers' advisory locks: "spCN".
_LOCK_CLASS = 0x7370434E


@dataclass(frozen=True)
class TableRows:
    """One table's rows of a batch, oldest first, as lists in the order of
    ``columns``."""

    table: str
    columns: List[str]
    rows: List[List[Any]]

    def dicts(self) -> Iterator[Dict[str, Any]]:
        for row in self.rows:
            yield dict(zip(self.columns, row))


@dataclass(frozen=True)
class Batch:
    """An ``updates()`` answer: the rows after the consumer's position, up
    to ``token``; ``limited`` when more rows are waiting."""

    token: MultiWriterToken
    limited: bool
    tables: Dict[str, TableRows] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(t.rows) for t in self.tables.values())

    @classmethod
    def from_answer(cls, answer: Dict[str, Any]) -> "Batch":
        data = answer["data"]
        tables: Dict[str, TableRows] = {}
        i = 0
        while i < len(data):
            name, _position, row_count, column_count = data[i][:4]
            columns = list(data[i][4 : 4 + column_count])
            tables[name] = TableRows(name, columns, data[i + 1 : i + 1 + row_count])
            i += 1 + row_count
        return cls(MultiWriterToken.parse(answer["token"]), bool(answer["limited"]), tables)


class Consumer:
    """A consumer ``name`` of ``stream`` on ``conn``, a psycopg 3 connection
    in autocommit mode (ValueError otherwise) that this object uses; each
    batch is a transaction of its own.

    The role needs EXECUTE on ``register_consumer``, ``ack`` and
    ``unregister_consumer`` (granted by the database owner) and SELECT on
    the stream's tables.

    ``read_conn``: another autocommit connection, to a hot standby of
    ``conn``'s server, on which batches are read (``updates_json`` from the
    position this object last acknowledged, first the one ``conn`` reads):
    the rows leave the primary, the acknowledgement stays there, in the
    transaction of ``conn`` that processes them. A standby's copy of the
    consumer's position lags the primary's, so batches there follow the
    acknowledged token, never the replicated position.
    """

    def __init__(
        self,
        conn: psycopg.Connection,
        stream: str,
        name: str,
        *,
        max_rows: int = 100,
        timeout_ms: int = 30_000,
        exclusive: bool = True,
        read_conn: Optional[psycopg.Connection] = None,
    ) -> None:
        if not conn.autocommit or (read_conn is not None and not read_conn.autocommit):
            # Otherwise the first statement opens a transaction that every
            # batch would only be a savepoint of: nothing would ever commit.
            raise ValueError("streampos.Consumer needs a connection in autocommit mode")
        self.read_conn = read_conn
        # With read_conn: the position last acknowledged (text).
        self._since: Optional[str] = None
        self.conn = conn
        self.stream = stream
        self.name = name
        self.max_rows = max_rows
        self.timeout_ms = timeout_ms
        self._exclusive = exclusive
        self._locked = False

    def register(self, since: Optional[Union[MultiWriterToken, str]] = None) -> MultiWriterToken:
        """Register the consumer (at ``since``, default the stream's current
        token); a consumer this role already registered keeps its position.
        Returns the position."""
        row = self.conn.execute(
            "SELECT streampos.register_consumer(%s, %s, %s::streampos.multi_writer_token)::text",
            (self.stream, self.name, None if since is None else str(since)),
        ).fetchone()
        assert row is not None
        return MultiWriterToken.parse(row[0])

    def unregister(self) -> bool:
        """Forget the consumer; whether it was registered."""
        row = self.conn.execute(
            "SELECT streampos.unregister_consumer(%s, %s)", (self.stream, self.name)
        ).fetchone()
        if self._locked:
            self.conn.execute("SELECT pg_catalog.pg_advisory_unlock(%s::pg_catalog.int4, pg_catalog.hashtext(%s))", self._lock_key())
            self._locked = False
        return bool(row and row[0])

    def position(self) -> Optional[MultiWriterToken]:
        """The acknowledged position (None: not registered)."""
        row = self.conn.execute(
            "SELECT position::text FROM streampos.consumer_positions "
            "WHERE stream_name OPERATOR(pg_catalog.=) %s AND consumer_name OPERATOR(pg_catalog.=) %s",
            (self.stream, self.name),
        ).fetchone()
        return None if row is None else MultiWriterToken.parse(row[0])

    def wait(self, timeout_ms: Optional[int] = None) -> MultiWriterToken:
        """``streampos.wait_for_consumer``: sleep until the stream is past
        the acknowledged position (or ``timeout_ms``, default the
        consumer's), and return the stream's current token: for a consumer
        that reads its rows with a query of its own, then acknowledges the
        token in the transaction that processed them (also when no rows
        came: an idle writer's position moves the token too)."""
        row = self.conn.execute(
            "SELECT streampos.wait_for_consumer(%s, %s, %s)::text",
            (self.stream, self.name, self.timeout_ms if timeout_ms is None else timeout_ms),
        ).fetchone()
        assert row is not None
        return MultiWriterToken.parse(row[0])

    def _lock(self) -> None:
        if not self._exclusive or self._locked:
            return
        # A session lock: held until the connection ends, so a restarted
        # process waits for the old session to be gone. The server notices
        # a vanished client within a second while it long-polls (PostgreSQL
        # 14 and later).
        if self.conn.info.server_version >= 140000:
            self.conn.execute("SET client_connection_check_interval = '1s'")
        # Any role can take an advisory lock: wait only while a session of
        # this consumer's own role holds it (an earlier process of the
        # consumer); a session of another role holding it is an error at
        # once, naming it, never a silent wait.
        while True:
            row = self.conn.execute(
                "SELECT pg_catalog.pg_try_advisory_lock(%s::pg_catalog.int4, pg_catalog.hashtext(%s))",
                self._lock_key(),
            ).fetchone()
            if row and row[0]:
                break
            holder = self._lock_holder()
            if holder is None:
                continue  # released meanwhile
            # No session holds it (a prepared transaction does), or one of
            # another role does: never wait for that.
            if holder[0] is None or holder[1] != self.conn.info.parameter_status("session_authorization"):
                who = "a prepared transaction" if holder[0] is None else f"process {holder[0]} of role {holder[1]!r}"
                raise psycopg.errors.LockNotAvailable(
                    f"the lock of consumer {self.name!r} of stream {self.stream!r} is held by "
                    f"{who}, not a process of this consumer"
                )
            time.sleep(0.2)
        self._locked = True

    def _lock_holder(self) -> Optional[tuple]:
        """(pid, role) of the session that holds the consumer's lock ((None,
        None): a prepared transaction holds it; None: nothing does)."""
        key, text = self._lock_key()
        row = self.conn.execute(
            "SELECT l.pid, a.usename::pg_catalog.text FROM pg_catalog.pg_locks l "
            "LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) l.pid "
            "WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory' AND l.granted "
            "AND l.objsubid OPERATOR(pg_catalog.=) 2 "
            "AND l.classid OPERATOR(pg_catalog.=) (%s::pg_catalog.int8 OPERATOR(pg_catalog.&) 4294967295)::pg_catalog.oid "
            "AND l.objid OPERATOR(pg_catalog.=) "
            "(pg_catalog.hashtext(%s)::pg_catalog.int8 OPERATOR(pg_catalog.&) 4294967295)::pg_catalog.oid "
            "AND l.database OPERATOR(pg_catalog.=) "
            "(SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()) "
            "LIMIT 1",
            (key, text),
        ).fetchone()
        return row

    def _lock_key(self) -> tuple:
        # The two-integer advisory lock space (the application's bigint
        # locks are another), with a class of its own in the first key.
        return (_LOCK_CLASS, f"{self.stream}\x1f{self.name}")

    @contextmanager
    def batch(self) -> Iterator[Batch]:
        """One transaction: the rows after the acknowledged position (waiting
        up to ``timeout_ms`` for some), then whatever the block does with
        ``self.conn``, then ``ack`` of the batch's token; it all commits when
        the block ends, or none of it if the block raises."""
        self._lock()
        if self.read_conn is not None:
            yield from self._batch_from_standby()
            return
        with self.conn.transaction():
            row = self.conn.execute(
                "SELECT streampos.updates_json(%s, consumer => %s, max_rows => %s, timeout_ms => %s)",
                (self.stream, self.name, self.max_rows, self.timeout_ms),
            ).fetchone()
            assert row is not None
            batch = Batch.from_answer(row[0])
            yield batch
            self._ack(batch)

    def _batch_from_standby(self) -> Iterator[Batch]:
        """``batch`` with ``read_conn``: read there, acknowledge on ``conn``."""
        assert self.read_conn is not None
        if self._since is None:
            position = self.position()
            if position is None:
                raise LookupError(f"consumer {self.name!r} of stream {self.stream!r} is not registered")
            self._since = str(position)
        row = self.read_conn.execute(
            "SELECT streampos.updates_json(%s, %s::streampos.multi_writer_token, %s, %s)",
            (self.stream, self._since, self.max_rows, self.timeout_ms),
        ).fetchone()
        assert row is not None
        batch = Batch.from_answer(row[0])
        with self.conn.transaction():
            yield batch
            self._ack(batch)
        # Committed: the next batch goes on from here (a block that raised
        # reads the same rows again).
        self._since = str(batch.token)

    def _ack(self, batch: Batch) -> None:
        """Acknowledge ``batch``'s token, in ``conn``'s open transaction."""
        self.conn.execute(
            "SELECT streampos.ack(%s, %s, %s::streampos.multi_writer_token)",
            (self.stream, self.name, str(batch.token)),
        )
