"""What one Synapse process knows of a stream's positions, kept as Synapse
keeps it.

Synapse's processes learn other writers' progress over replication
(``advance``), and their caches are invalidated by the same replication
rows, so a position may only move when the process has processed what lies
below it: these positions are *this process's* view, not the database's.
The generator therefore keeps the rules of Synapse's
``MultiWriterIdGenerator`` for them (every number here is the one Synapse
would give for the same calls), and only its inputs change: start-up
positions come from the extension (exact for the start-up snapshot) instead
of ``stream_positions`` and table scans, and IDs come from the extension.

Everything is counted positive; the generator negates a backward stream's
values at its boundary, as Synapse does.
"""

from __future__ import annotations

import heapq
import threading
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence

from sortedcontainers import SortedList, SortedSet


class Positions:
    """Thread-safe: Synapse calls getters on the reactor thread and allocates
    on database threads. Methods without a leading underscore take the
    lock."""

    def __init__(self, instance_name: str, report: Callable[[int], None]) -> None:
        self.lock = threading.Lock()
        self._me = instance_name
        self._report = report
        # Writer -> position. Ours: the highest of our own finished IDs with
        # nothing of ours unfinished below it. Others': what replication said.
        self._positions: Dict[str, int] = {}
        # Every ID at or below this is finished, as far as we know. Stream
        # IDs are positive: 1 counts as seen.
        self._persisted = 1
        # Positions reported finished above _persisted, to close gaps with.
        self._reported: List[int] = []
        self._max_seen = 1
        # Our own position including the IDs others allocated while we had
        # nothing in flight (the token our own writes are at).
        self._max_local = 1
        self._unfinished: SortedSet = SortedSet()
        # For each allocation under way, _max_seen when it began: it may
        # return any ID above that, so nothing of ours above it is settled.
        self._fetching: SortedList = SortedList()
        self._finished: set = set()

    # ---------------------------------------------------------------- start

    def start(
        self,
        frontier: int,
        max_allocated: int,
        read: Mapping[str, int],
        writers: Sequence[str],
    ) -> None:
        """Seed from the extension: ``frontier`` and ``max_allocated`` of one
        snapshot, ``read`` the writer positions it listed (writers seen,
        holding IDs, or with a stored position). A configured writer it does
        not list holds nothing: ours is then at ``max_allocated`` (Synapse
        puts a writer at its sequence's value), another at the frontier
        (Synapse's "a new writer starts at the persisted-up-to position")."""
        with self.lock:
            self._persisted = max(frontier, 1)
            for w in writers:
                default = max_allocated if w == self._me else frontier
                self._positions[w] = max(read.get(w, default), self._persisted)
            self._max_seen = max([self._persisted, *self._positions.values()])
            self._max_local = self._max_seen
            if not writers:
                # Any instance may write: ours starts at the frontier.
                self._positions[self._me] = self._persisted
            self._report(self._persisted)

    # ---------------------------------------------------------------- allocation

    def begin_allocation(self) -> int:
        with self.lock:
            self._fetching.add(self._max_seen)
            return self._max_seen

    def end_allocation(self, ticket: int, ids: Iterable[int]) -> None:
        with self.lock:
            self._unfinished.update(ids)
            if self._unfinished:
                self._max_seen = max(self._max_seen, self._unfinished[-1])
            self._fetching.remove(ticket)

    def finish(self, ids: Sequence[int]) -> None:
        """Our IDs ``ids`` are finished (committed or abandoned)."""
        with self.lock:
            self._unfinished.difference_update(ids)
            self._finished.update(ids)
            bound: Optional[int] = self._unfinished[0] if self._unfinished else None
            if self._fetching:
                pending = self._fetching[0] + 1
                bound = pending if bound is None else min(bound, pending)
            if bound is None:
                settled = self._finished
                self._finished = set()
            else:
                settled = {i for i in self._finished if i < bound}
                self._finished -= settled
            if settled:
                top = max(settled)
                mine = max(self._positions.get(self._me, 0), top)
                self._positions[self._me] = mine
                self._max_local = max(self._max_local, mine)
            for i in ids:
                self._reported_finished(i)

    # ---------------------------------------------------------------- replication

    def advance(self, instance_name: str, position: int) -> None:
        with self.lock:
            self._positions[instance_name] = max(position, self._positions.get(instance_name, 0))
            self._max_seen = max(self._max_seen, position)
            self._reported_finished(position)

    def _reported_finished(self, position: int) -> None:
        heapq.heappush(self._reported, position)
        mine = self._positions.get(self._me, 0)
        others = [p for name, p in self._positions.items() if name != self._me]
        low = min(others) if others else mine
        busy = bool(self._unfinished or self._fetching)
        # Our own position only holds the others back while we have
        # something in flight: any ID we allocate later is above theirs.
        if mine and busy:
            low = min(low, mine)
        self._persisted = max(self._persisted, low)
        self._max_local = max(self._max_local, self._persisted)
        if not busy:
            self._max_local = max(self._max_local, self._max_seen)
        # A run of reported positions with no gap moves the bound on.
        while self._reported:
            head = self._reported[0]
            if head <= self._persisted:
                heapq.heappop(self._reported)
            elif head == self._persisted + 1:
                heapq.heappop(self._reported)
                self._persisted = head
            else:
                break
        self._report(self._persisted)

    # ---------------------------------------------------------------- getters

    def persisted(self) -> int:
        with self.lock:
            return self._persisted

    def writer(self, instance_name: str) -> int:
        with self.lock:
            if instance_name == self._me:
                return self._max_local
            return max(self._positions.get(instance_name, self._persisted), self._persisted)

    def minimal_local(self) -> int:
        with self.lock:
            return self._positions.get(self._me, self._persisted)

    def all(self) -> Dict[str, int]:
        with self.lock:
            return dict(self._positions)
