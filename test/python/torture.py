#!/usr/bin/env python3
"""Torture harness for streampos: many writers, many readers, one stream,
and every answer checked against a reference model of the contract.

    python3 test/python/torture.py --host 127.0.0.1 --port 54330 --dbname D \\
        [--seconds 30 | --commits 100000] [--writers 6] [--instances 3] \\
        [--readers 4] [--stream torture] [--backwards] [--modes rc,rr,...] \\
        [--scenario checkpoint,many_writers,long_cursor,standby] \\
        [--checkpoint-ms 300] [--open-stream] [--standby-port P]

Writers (one thread and one connection each; each thread writes as one of
``--instances`` instance names, or picks one of its share of them per
transaction when there are more names than threads) run transactions that
allocate 1-5 IDs with ``streampos.next_ids``, insert one row per ID, sleep
0-5 ms inside the transaction, and roll back about 10 % of the time. Some
transactions insert their rows in released savepoints (rows carrying
subtransaction xids; 1 % use 70 savepoints, which overflows every snapshot's
subxid cache), and some first allocate IDs in a savepoint they roll back (a
gap that stays in flight until the transaction ends). An ID counts as
committed only once COMMIT returned.

**The reference model.** Every writer transaction is recorded: its xid
(``pg_current_xact_id()``, in the statement of its first allocation), the
IDs it allocated per instance, its fate (committed, rolled back, or unknown
when the connection died during COMMIT: decided afterwards by its rows) and
when its COMMIT/ROLLBACK was sent and returned. Every reading statement
records, with ``pg_current_snapshot()`` in the same statement (the cursor's
snapshot for a cursor, the exporter's for an imported snapshot), the answer:
``frontier``, ``max_allocated``, ``current_token`` and ``writer_positions``
(some forms only the frontier). ``check_contract`` then decides from the
model, for each answer, which committed IDs its snapshot must treat as in
flight (allocated by a transaction the snapshot does not see as ended:
xid >= xmax or in the xip list) and checks docs/contract.md:

``covers_invisible_commit``  no answer (frontier, a writer's position, the
                             token's minimum or a writer's entry) covers an
                             ID of a committed transaction its snapshot does
                             not see as ended (invariant 1)
``above_max_allocated``      no answer exceeds max_allocated of its statement
``inconsistent``             one statement's answers agree: token minimum =
                             frontier <= every writer position = that
                             writer's token position
``missing_writer``           writer_positions lists every writer that has
                             committed before the snapshot's xmin
``answer_changed``           one snapshot, one transaction: one answer
                             (statements, cursor rows, FETCHes)
``went_back``                a later snapshot never answers less, per
                             component (frontier, token minimum, each
                             writer's position, each writer's token
                             position): later = taken after the other
                             answer returned; or xmin >= the other's xmax, or
                             the same snapshot (an importer), and first asked
                             after the other answer returned (invariant 3)
``no_progress``              once every writer stopped: nothing in flight and
                             a fresh snapshot's frontier, writer positions
                             and token all equal max_allocated, which equals
                             the sequence (invariant 2), within 5 s (IDs not
                             yet durable may hold it back that long)

Readers sample positions, and the rows at or below them, in several ways:

``rc``          READ COMMITTED: the answer, then the rows in a later statement
``rr``          REPEATABLE READ: the snapshot is taken, a few ms pass, then
                the answer (twice, commits in between) and the rows
``stmt_filter`` one statement: ``frontier()`` in the target list and in the
                aggregate's ``FILTER (WHERE id <= frontier())``
``stmt_cte``    one statement: the frontier computed once (a MATERIALIZED CTE)
                and the rows at or below it
``token``       REPEATABLE READ: ``current_token()``, then for each writer
                ``instance_pos(token, writer)`` and that writer's rows at or
                below it (plus the token's minimum and all rows below it,
                recorded as ``token_min``)
``cursor``      a server-side cursor (psycopg named cursor, 2 rows a fetch
                for ten fetches, then 100; writers committing and aborting
                between fetches) over the rows
                at or below ``frontier()``, with ``frontier()`` and the token in
                its target list: every row must carry the same answer
``imported``    REPEATABLE READ snapshot exported by one session, imported by
                a second session a few ms later: the importer must not answer
                less than the exporter did for the same snapshot

and, each in a thread of its own (``--modes`` or ``--scenario``):

``long_cursor`` a READ COMMITTED transaction holds an ID in a helper session,
                opens a cursor over the rows <= ``frontier()`` (frontier and
                token in the target list), FETCHes 1, rolls the helper back,
                then runs more than 8192 statements that each take a new,
                distinct snapshot (a helper commits xids in a loop) and ask
                ``frontier()``; then FETCH ALL: every row must carry the first
                answer, and no row at or below it may be missing
``standby``     a reader on a hot standby (``--standby-port``): its answers
                must never cover an ID of a transaction whose COMMIT the
                primary had not yet been sent when the answer returned
                (``standby_covers_in_flight``), never go back
                (``standby_went_back``), its rows <= frontier are checked
                like any sample, and it must catch up with the primary once
                the writers stopped (``standby_no_catch_up``)

``follower``    a follower (scenario ``followers``): ``updates_json`` in a
                loop from the token current before the writers started, each
                call with a random ``max_rows`` (1 to 500) and ``timeout_ms``
                (0 or a long poll), the next call from the answer's token;
                once the writers stopped it drains what is left. Every
                committed row must arrive exactly once
                (``follower_missed``, ``follower_repeated``), no row that is
                not in the final table (``follower_extra``), and each
                writer's rows in ID order (``follower_out_of_order``)
``ordered_follower`` the same with ``ordered => true``: every row in global
                ID order across all its calls (``follower_out_of_order``).
                Forward streams only (``updates`` follows no backward one)

Load variations: ``--checkpoint-ms N`` runs CHECKPOINT every ~N ms while a
quarter of the transactions allocate, wait for the next checkpoint, and
allocate again (scenario ``checkpoint``); ``--open-stream`` creates the
stream open to any writer; many instance names (scenario ``many_writers``:
90 names over 8 writer threads, open stream) make tokens carry many entries;
``--fresh-writers P`` makes a transaction use a brand-new instance name with
probability P and hold it 0.25-0.5 s (scenario ``standby``).

A sample is also (position, number of rows seen, sum of their IDs); one in
eight counts every row, the others only the rows within ``--window`` IDs
(default 20000) below the reader's previous frontier. Once the writers have
stopped and every transaction has ended, each sample is checked against the
final table: if the table has a row with an ID at or below the sample's
position (for ``token`` samples: of that writer) that the sample did not
see, that is a *violation* of "a reader never misses a row". Every reader's
successive samples are taken with later snapshots, so its positions must
never go down: a decrease is a *regression*. The table must hold exactly the
committed rows.

For a backward stream (``--backwards``) IDs are negative and "at or below"
means ``id >= position``; samples and the model are in the internal,
positive numbering.

Prints one line::

    torture: commits=N aborts=N samples=N violations=N frontier=F max_allocated=M seconds=S ...

then each contract violation by kind, and exits non-zero on any violation,
regression, contract violation, lost or extra row, or error.

Importable: ``run(conninfo_kwargs, stream, seconds=..., commits=..., ...)``
returns a dict (see ``run``); ``verify`` and ``recheck_samples`` check a
result again later, e.g. after a server restart; ``check_contract`` is the
model's checker alone (pure Python, on ``Txn`` and ``Answer`` records).
"""

import argparse
import bisect
import os
import random
import sys
import threading
import time

import psycopg
from psycopg import sql

DEFAULT_INSTANCE_PREFIX = "torture_w"
# The reader modes each reader cycles through.
MODES = ("rc", "rr", "stmt_filter", "stmt_cte", "token", "cursor", "imported")
# Modes that run in a thread of their own.
THREAD_MODES = ("long_cursor", "standby", "follower", "ordered_follower")
ALL_MODES = MODES + THREAD_MODES
SCENARIOS = ("checkpoint", "many_writers", "long_cursor", "standby", "followers")
# The per-transaction answer cache of 0.2.0 kept this many snapshots.
CACHED_SNAPSHOTS = 8192

KINDS = (
    "covers_invisible_commit",
    "above_max_allocated",
    "inconsistent",
    "missing_writer",
    "answer_changed",
    "went_back",
    "no_progress",
    "standby_covers_in_flight",
    "standby_went_back",
    "standby_no_catch_up",
    "follower_missed",
    "follower_repeated",
    "follower_extra",
    "follower_out_of_order",
)


class ContractViolation(AssertionError):
    """A run broke the contract (a missed row, a regression, or a kind of
    ``KINDS``): raised by the tests' checks, so that a test expected to fail
    on a known engine bug (xfail with ``raises``) still fails on anything
    else."""


# --------------------------------------------------------------- helpers


def is_disconnect(exc):
    """Errors that mean the connection or the server went away."""
    if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return True
    state = getattr(getattr(exc, "diag", None), "sqlstate", None) or ""
    # 57P0x: admin/crash shutdown, cannot connect now; 08xxx: connection exceptions.
    return state.startswith("57P") or state.startswith("08")


def connect(conninfo, autocommit=True):
    params = dict(conninfo)
    params.setdefault("connect_timeout", 10)
    return psycopg.connect(autocommit=autocommit, **params)


def table_name_for(stream):
    return f"{stream}_rows"


def instance_names(instances, prefix=DEFAULT_INSTANCE_PREFIX):
    return [f"{prefix}{i + 1}" for i in range(instances)]


PROBE_FUNCTION = "streampos_torture_snapshots"
CHURN_PROCEDURE = "streampos_torture_churn"


def _create_helpers(conn):
    """The long_cursor mode's server-side helpers, in the table's schema:
    a VOLATILE function that, under READ COMMITTED, takes a new snapshot at
    each expression and returns ``frontier() || ' ' || snapshot`` for n
    successive snapshots that differ from the one before (or as many as it
    saw within the time given), and a procedure that commits n transactions
    with an xid each (every commit changes the snapshots taken after it)."""
    have = {
        r[0]
        for r in conn.execute(
            "SELECT proname FROM pg_catalog.pg_proc WHERE proname IN (%s, %s) "
            "AND pronamespace = (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = current_schema())",
            (PROBE_FUNCTION, CHURN_PROCEDURE),
        )
    }
    if PROBE_FUNCTION not in have:
        conn.execute(
            f"CREATE FUNCTION {PROBE_FUNCTION}(s text, n int, seconds float8) RETURNS SETOF text "
            "VOLATILE LANGUAGE plpgsql AS $$ "
            "DECLARE x text; snap text; last text := ''; got int := 0; "
            "until timestamptz := pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => seconds); "
            "BEGIN "
            "  WHILE got < n AND pg_catalog.clock_timestamp() < until LOOP "
            "    x := streampos.frontier(s)::text || ' ' || pg_catalog.pg_current_snapshot()::text; "
            "    snap := pg_catalog.split_part(x, ' ', 2); "
            "    IF snap <> last THEN RETURN NEXT x; got := got + 1; last := snap; END IF; "
            "  END LOOP; "
            "END $$"
        )
    if CHURN_PROCEDURE not in have:
        conn.execute(
            f"CREATE PROCEDURE {CHURN_PROCEDURE}(n int) LANGUAGE plpgsql AS $$ "
            "BEGIN FOR i IN 1..n LOOP PERFORM pg_catalog.pg_current_xact_id(); COMMIT; END LOOP; END $$"
        )


def setup_stream(conn, stream, table, names, backwards=False, open_stream=False):
    """Create the stream and its table, or reuse them. Returns (the IDs
    already in the table, whether the stream is backward, its configured
    writers or None for an open stream)."""
    conn.execute("CREATE EXTENSION IF NOT EXISTS streampos")
    exists = conn.execute(
        "SELECT writers, backwards FROM streampos.streams WHERE stream_name = %s", (stream,)
    ).fetchone()
    writers = None if open_stream else list(names)
    if exists is None:
        conn.execute(
            "SELECT streampos.create_stream(%s, backwards => %s, writers => %s::text[])",
            (stream, backwards, writers),
        )
    else:
        backwards = exists[1]
        writers = exists[0]
        if writers is not None and not set(names) <= set(writers):
            writers = sorted(set(writers) | set(names))
            conn.execute("SELECT streampos.set_writers(%s, %s::text[])", (stream, writers))
    t = sql.Identifier(table)
    conn.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (id bigint PRIMARY KEY, instance_name text NOT NULL, payload text)"
        ).format(t)
    )
    conn.execute(
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (instance_name, id)").format(
            sql.Identifier(f"{table}_instance_idx"), t
        )
    )
    conn.execute(
        "SELECT streampos.add_table(%s, %s::regclass, 'id', 'instance_name')",
        (stream, sql.Identifier(table).as_string(conn)),
    )
    initial = {r[0] for r in conn.execute(sql.SQL("SELECT id FROM {}").format(t))}
    _create_helpers(conn)
    return initial, backwards, writers


def sequence_value(conn, stream):
    """The stream's last handed-out ID according to its sequence, in the
    stream's external numbering (negative for a backward stream)."""
    seq, backwards = conn.execute(
        "SELECT seq::text, backwards FROM streampos.streams WHERE stream_name = %s", (stream,)
    ).fetchone()
    last, called = conn.execute(f"SELECT last_value, is_called FROM {seq}").fetchone()
    value = last if called else last - 1
    return -value if backwards else value


def parse_snapshot(text):
    """``pg_current_snapshot()`` text (xmin:xmax:xip,...) as (xmin, xmax,
    frozenset of the xip list)."""
    xmin, xmax, xip = text.split(":")
    return int(xmin), int(xmax), frozenset(int(x) for x in xip.split(",") if x)


def sees_ended(snap, xid):
    """Does a snapshot see transaction ``xid`` as ended (committed or
    aborted)? ``pg_visible_in_snapshot`` for a top-level xid."""
    xmin, xmax, xip = snap
    return xid < xmin or (xid < xmax and xid not in xip)


def parse_token(text):
    """A multi_writer_token's text as (stream position, {instance id: position})."""
    if text.startswith("m"):
        parts = text[1:].split("~")
        entries = {}
        for part in parts[1:]:
            if part:
                i, p = part.split(".")
                entries[int(i)] = int(p)
        return int(parts[0]), entries
    return int(text), {}


# --------------------------------------------------------------- the model


class Txn:
    """One writer transaction of the reference model. ``ids``: {instance:
    [IDs]} in internal numbering, every ID it allocated (those of a
    rolled-back savepoint too). ``fate``: committed, aborted, unknown (the
    connection died during COMMIT) or None (the thread failed). ``t_end0`` /
    ``t_end1``: monotonic times just before COMMIT/ROLLBACK was sent and
    after it returned. ``rows``: the IDs it inserted rows for."""

    __slots__ = ("xid", "ids", "fate", "t_end0", "t_end1", "rows", "gap", "label")

    def __init__(self, label="", xid=None, ids=None, fate=None, t_end0=None, t_end1=None):
        self.xid = xid
        self.ids = dict(ids or {})
        self.fate = fate
        self.t_end0 = t_end0
        self.t_end1 = t_end1
        self.rows = []
        self.gap = []  # IDs allocated in a savepoint that was rolled back
        self.label = label

    def add(self, instance, ids):
        self.ids.setdefault(instance, []).extend(ids)

    def min_id(self):
        return min(min(v) for v in self.ids.values() if v)

    def __repr__(self):
        ids = {k: (min(v), max(v), len(v)) for k, v in self.ids.items() if v}
        gap = f" (rolled-back savepoint: {self.gap})" if self.gap else ""
        return f"txn {self.label} xid {self.xid} {self.fate} ids(min,max,n) {ids}{gap}"


class Answer:
    """One answer a reader got, in internal numbering. ``snap``: (xmin,
    xmax, xip) of the snapshot it was computed for (None on a standby);
    ``txn``: the reader's transaction (a key: answers of one transaction and
    snapshot must be identical); ``t_snap``: a time before the snapshot was
    taken; ``t_ans0`` / ``t_ans1``: before the statement was sent and after
    its answer returned. ``positions``: {writer: position} from
    writer_positions (or None); ``token``: (minimum, {instance id or name:
    position}) or None."""

    __slots__ = (
        "mode", "node", "reader", "txn", "seq", "snap", "t_snap", "t_ans0", "t_ans1",
        "frontier", "max_allocated", "positions", "token", "note",
    )

    def __init__(self, mode, reader, txn, snap, t_snap, t_ans0, t_ans1, frontier, max_allocated=None,
                 positions=None, token=None, node="primary", seq=0, note=""):
        self.mode = mode
        self.node = node
        self.reader = reader
        self.txn = txn
        self.seq = seq
        self.snap = snap
        self.t_snap = t_snap
        self.t_ans0 = t_ans0
        self.t_ans1 = t_ans1
        self.frontier = frontier
        self.max_allocated = max_allocated
        self.positions = positions
        self.token = token
        self.note = note

    def describe(self, t0=0.0):
        snap = "-" if self.snap is None else f"{self.snap[0]}:{self.snap[1]}:{','.join(map(str, sorted(self.snap[2])))}"
        parts = [
            f"{self.node} {self.mode}{(' ' + self.note) if self.note else ''} reader {self.reader} txn {self.txn}",
            f"snapshot {snap}",
            f"at {self.t_snap - t0:.3f}..{self.t_ans1 - t0:.3f}s",
            f"frontier {self.frontier}",
        ]
        if self.max_allocated is not None:
            parts.append(f"max_allocated {self.max_allocated}")
        if self.token is not None:
            parts.append(f"token {format_token(self.token)}")
        if self.positions is not None:
            parts.append(f"positions {format_positions(self.positions)}")
        return ", ".join(parts)


def format_token(token, limit=8):
    sp, entries = token
    items = sorted(entries.items(), key=lambda kv: str(kv[0]))
    shown = "~".join(f"{k}.{v}" for k, v in items[:limit])
    more = f"~…(+{len(items) - limit})" if len(items) > limit else ""
    return f"m{sp}~{shown}{more}" if items else str(sp)


def format_positions(positions, limit=8):
    items = sorted(positions.items())
    shown = ", ".join(f"{k}={v}" for k, v in items[:limit])
    return "{" + shown + (f", …(+{len(items) - limit})" if len(items) > limit else "") + "}"


def token_position(token, writer):
    """A writer's position in a token: its entry, else the minimum."""
    sp, entries = token
    return entries.get(writer, sp)


# --------------------------------------------------------------- the checker


class Report:
    """Contract violations by kind (``KINDS``): a count each, and the first
    ``limit`` descriptions of each kind."""

    def __init__(self, limit=10):
        self.limit = limit
        self.counts = {k: 0 for k in KINDS}
        self.details = []
        self._shown = {}

    def add(self, kind, text):
        self.counts[kind] += 1
        if self._shown.get(kind, 0) < self.limit:
            self._shown[kind] = self._shown.get(kind, 0) + 1
            self.details.append(f"{kind}: {text}")

    def total(self):
        return sum(self.counts.values())

    def found(self):
        """{kind: count} of the kinds that occurred."""
        return {k: n for k, n in self.counts.items() if n}


class _MinIndex:
    """Transactions ordered by ``key`` with suffix minimums of their IDs
    (overall and per writer): the lowest ID of the transactions whose key is
    above (or at least) a value, and the transaction that has it."""

    def __init__(self, txns, key):
        txns = sorted(txns, key=key)
        self.keys = [key(t) for t in txns]
        self.mins = self._suffix([(t.min_id(), t) for t in txns])
        per = {}
        for t in txns:
            for w, ids in t.ids.items():
                if ids:
                    per.setdefault(w, []).append((key(t), min(ids), t))
        self.w_keys = {w: [k for k, _, _ in lst] for w, lst in per.items()}
        self.w_mins = {w: self._suffix([(m, t) for _, m, t in lst]) for w, lst in per.items()}

    @staticmethod
    def _suffix(pairs):
        out = [None] * (len(pairs) + 1)
        best = None
        for i in range(len(pairs) - 1, -1, -1):
            if best is None or pairs[i][0] < best[0]:
                best = pairs[i]
            out[i] = best
        return out

    def above(self, k, strict, writer=None):
        """(lowest ID, txn) over the transactions with key > k (strict) or
        >= k, of one writer when given; None if there are none."""
        keys = self.keys if writer is None else self.w_keys.get(writer)
        if keys is None:
            return None
        i = bisect.bisect_right(keys, k) if strict else bisect.bisect_left(keys, k)
        return (self.mins if writer is None else self.w_mins[writer])[i]


def _lower(a, b):
    """The lower of two (ID, txn) pairs, None meaning none."""
    if a is None:
        return b
    if b is None:
        return a
    return a if a[0] <= b[0] else b


def _components(a, names):
    """(component, value) pairs of an answer that must never go back."""
    # (Not max_allocated: across a crash it can go back to the sequence's
    # durable value; the positions only ever passed durable IDs.)
    out = [("frontier", a.frontier)]
    if a.token is not None:
        sp, entries = a.token
        out.append(("token", sp))
        for w in names:
            out.append((("token", w), entries.get(w, sp)))
    if a.positions is not None:
        for w, p in a.positions.items():
            out.append((("position", w), p))
    return out


def _component_name(c):
    return c if isinstance(c, str) else f"{c[0]}[{c[1]}]"


class _MaxTree:
    """Fenwick tree of prefix maximums of (value, answer)."""

    def __init__(self, n):
        self.tree = [None] * (n + 1)

    def update(self, i, item):
        while i < len(self.tree):
            cur = self.tree[i]
            if cur is None or item[0] > cur[0]:
                self.tree[i] = item
            i += i & -i

    def query(self, i):
        best = None
        while i > 0:
            cur = self.tree[i]
            if cur is not None and (best is None or cur[0] > best[0]):
                best = cur
            i -= i & -i
        return best


def _sweep_went_back(answers, key_check, names, report, kind, why, t0):
    """Answers become known when they return (t_ans1); each answer B is
    checked at ``key_check(B)`` against every answer returned strictly
    before: no component may be lower."""
    events = [(a.t_ans1, 1, i) for i, a in enumerate(answers)]
    events += [(key_check(a), 0, i) for i, a in enumerate(answers)]
    events.sort(key=lambda e: (e[0], e[1]))
    best = {}
    for _, what, i in events:
        a = answers[i]
        comps = _components(a, names)
        if what == 1:
            for c, v in comps:
                cur = best.get(c)
                if cur is None or v > cur[0]:
                    best[c] = (v, a)
            continue
        lower = []
        for c, v in comps:
            cur = best.get(c)
            if cur is not None and v < cur[0]:
                lower.append((c, v, cur))
        if lower:
            shown = "; ".join(f"{_component_name(c)} {v} < {cur[0]}" for c, v, cur in lower[:6])
            more = f" (+{len(lower) - 6} more)" if len(lower) > 6 else ""
            report.add(
                kind,
                f"{why}: {shown}{more}. Later: [{a.describe(t0)}]. Earlier: [{lower[0][2][1].describe(t0)}]",
            )


def check_contract(txns, answers, backwards=False, limit=10, report=None, t0=0.0):
    """Check every answer against the reference model (see the module's
    docstring for the kinds). ``txns``: ``Txn`` records (fates decided);
    ``answers``: ``Answer`` records, tokens keyed by instance name. Pure
    Python; returns a ``Report``."""
    report = report or Report(limit)
    committed = [t for t in txns if t.fate == "committed" and t.xid is not None and any(t.ids.values())]
    by_xid = {t.xid: t for t in committed}
    xid_index = _MinIndex(committed, key=lambda t: t.xid)
    timed = [t for t in committed if t.t_end0 is not None]
    time_index = _MinIndex(timed, key=lambda t: t.t_end0)
    firsts = {}
    for t in committed:
        for w, ids in t.ids.items():
            if ids and t.xid < firsts.get(w, t.xid + 1):
                firsts[w] = t.xid
    first_commit = sorted((x, w) for w, x in firsts.items())
    first_commit_xids = [x for x, _ in first_commit]
    names = sorted(
        {w for t in txns for w in t.ids}
        | {w for a in answers if a.token is not None for w in a.token[1]}
        | {w for a in answers if a.positions is not None for w in a.positions}
    )
    primary = [a for a in answers if a.node == "primary"]
    standby = [a for a in answers if a.node != "primary"]

    # ---- one answer, alone: safety, bounds, consistency, completeness
    for a in primary:
        if a.snap is None:
            continue
        xmin, xmax, xip = a.snap
        lim = xid_index.above(xmax, strict=False)
        invisible = [by_xid[x] for x in xip if x in by_xid]
        for t in invisible:
            lim = _lower(lim, (t.min_id(), t))

        def writer_limit(w):
            out = xid_index.above(xmax, strict=False, writer=w)
            for t in invisible:
                ids = t.ids.get(w)
                if ids:
                    out = _lower(out, (min(ids), t))
            return out

        covered = []
        if lim is not None:
            if a.frontier >= lim[0]:
                covered.append(("frontier", a.frontier, lim))
            if a.token is not None and a.token[0] >= lim[0]:
                covered.append(("token", a.token[0], lim))
        for label, items in (("position", (a.positions or {}).items()), ("token", (a.token or (0, {}))[1].items())):
            for w, p in items:
                wl = writer_limit(w)
                if wl is not None and p >= wl[0]:
                    covered.append((f"{label}[{w}]", p, wl))
        if covered:
            c, p, (i, t) = covered[0]
            report.add(
                "covers_invisible_commit",
                f"{c} {p} covers ID {i} of {t!r}, which the snapshot does not see as ended"
                + (f" (+{len(covered) - 1} more components)" if len(covered) > 1 else "")
                + f". [{a.describe(t0)}]",
            )
        if a.max_allocated is not None:
            over = [("frontier", a.frontier)] if a.frontier > a.max_allocated else []
            if a.token is not None:
                over += [("token", a.token[0])] if a.token[0] > a.max_allocated else []
                over += [(f"token[{w}]", p) for w, p in a.token[1].items() if p > a.max_allocated]
            over += [(f"position[{w}]", p) for w, p in (a.positions or {}).items() if p > a.max_allocated]
            if over:
                report.add("above_max_allocated", f"{over[:4]} > max_allocated. [{a.describe(t0)}]")
        bad = []
        if a.token is not None and a.token[0] != a.frontier:
            bad.append(f"token minimum {a.token[0]} != frontier {a.frontier}")
        if a.positions is not None:
            for w, p in a.positions.items():
                if p < a.frontier:
                    bad.append(f"position[{w}] {p} below the frontier")
                if a.token is not None and not backwards and token_position(a.token, w) != p:
                    bad.append(f"token[{w}] {token_position(a.token, w)} != position {p}")
            if a.token is not None:
                # A writer whose name the snapshot cannot see yet (its first
                # transaction is running) is in the token, not in
                # writer_positions: only writers that committed before xmin.
                named = {w for _, w in first_commit[: bisect.bisect_left(first_commit_xids, xmin)]}
                bad += [
                    f"token lists {w}, writer_positions does not"
                    for w in a.token[1]
                    if w not in a.positions and w in named
                ]
        if bad:
            report.add("inconsistent", f"{'; '.join(bad[:4])}. [{a.describe(t0)}]")
        if a.positions is not None:
            need = first_commit[: bisect.bisect_left(first_commit_xids, xmin)]
            missing = [w for _, w in need if w not in a.positions]
            if missing:
                report.add(
                    "missing_writer",
                    f"writer_positions omits {len(missing)} writer(s) that committed before the snapshot's "
                    f"xmin: {missing[:5]}. [{a.describe(t0)}]",
                )

    # ---- one snapshot in one transaction: one answer
    groups = {}
    for a in primary:
        if a.snap is not None and a.txn is not None:
            groups.setdefault((a.txn, a.snap), []).append(a)
    first_asked = {}
    for key, group in groups.items():
        group.sort(key=lambda x: x.t_ans0)
        first_asked[key] = group[0].t_ans0
        ref = {}
        for a in group:
            for field in ("frontier", "max_allocated", "token", "positions"):
                v = getattr(a, field)
                if v is None:
                    continue
                if field not in ref:
                    ref[field] = (v, a)
                elif ref[field][0] != v:
                    r = ref[field]
                    report.add(
                        "answer_changed",
                        f"{field} {v if field != 'token' else format_token(v)} after "
                        f"{r[0] if field != 'token' else format_token(r[0])} for the same snapshot in one "
                        f"transaction. Later: [{a.describe(t0)}]. First: [{r[1].describe(t0)}]",
                    )
                    break

    def asked(a):
        # A cursor's answer is computed when it is declared (the planner
        # evaluates frontier() in its WHERE clause for its estimates, with
        # the cursor's snapshot), before its first FETCH.
        if a.mode in ("cursor", "long_cursor"):
            return a.t_snap
        if a.snap is None or a.txn is None:
            return a.t_ans0
        return first_asked.get((a.txn, a.snap), a.t_ans0)

    # ---- later snapshots never answer less
    _sweep_went_back(primary, lambda a: a.t_snap, names, report, "went_back",
                     "snapshot taken after the earlier answer returned", t0)
    # xmin >= the other's xmax: sees everything the other did; first asked after it returned.
    with_snap = [a for a in primary if a.snap is not None]
    xmaxes = sorted({a.snap[1] for a in with_snap})
    trees = {"frontier": _MaxTree(len(xmaxes)), "token": _MaxTree(len(xmaxes))}
    events = [(a.t_ans1, 1, a) for a in with_snap] + [(asked(a), 0, a) for a in with_snap]
    events.sort(key=lambda e: (e[0], e[1]))
    for _, what, a in events:
        values = {"frontier": a.frontier, "token": None if a.token is None else a.token[0]}
        if what == 1:
            r = bisect.bisect_left(xmaxes, a.snap[1]) + 1
            for c, v in values.items():
                if v is not None:
                    trees[c].update(r, (v, a))
            continue
        r = bisect.bisect_right(xmaxes, a.snap[0])
        for c, v in values.items():
            best = trees[c].query(r) if v is not None else None
            if best is not None and v < best[0]:
                report.add(
                    "went_back",
                    f"{c} {v} < {best[0]}: the snapshot's xmin is at or past the earlier one's xmax and it "
                    f"first asked after that answer returned. Later: [{a.describe(t0)}]. "
                    f"Earlier: [{best[1].describe(t0)}]",
                )
                break
    # The same snapshot in several transactions (exported and imported).
    by_snap = {}
    for a in with_snap:
        by_snap.setdefault(a.snap, []).append(a)
    for group in by_snap.values():
        if len({a.txn for a in group}) > 1:
            _sweep_went_back(group, asked, names, report, "went_back",
                             "the same snapshot, first asked after the earlier answer returned", t0)

    # ---- a standby: never ahead of the primary's commits, never back
    for a in standby:
        lim = time_index.above(a.t_ans1, strict=True)
        covered = []
        if lim is not None:
            if a.frontier >= lim[0]:
                covered.append(("frontier", a.frontier, lim))
            if a.token is not None and a.token[0] >= lim[0]:
                covered.append(("token", a.token[0], lim))
        for label, items in (("position", (a.positions or {}).items()), ("token", (a.token or (0, {}))[1].items())):
            for w, p in items:
                wl = time_index.above(a.t_ans1, strict=True, writer=w)
                if wl is not None and p >= wl[0]:
                    covered.append((f"{label}[{w}]", p, wl))
        if covered:
            c, p, (i, t) = covered[0]
            report.add(
                "standby_covers_in_flight",
                f"{c} {p} covers ID {i} of {t!r}, whose COMMIT was sent to the primary "
                f"{t.t_end0 - a.t_ans1:.3f}s after this answer returned"
                + (f" (+{len(covered) - 1} more components)" if len(covered) > 1 else "")
                + f". [{a.describe(t0)}]",
            )
    _sweep_went_back(standby, lambda a: a.t_snap, names, report, "standby_went_back",
                     "standby snapshot taken after the earlier standby answer returned", t0)
    return report


# --------------------------------------------------------------- the load


class _State:
    def __init__(self, names, commit_budget):
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.done = threading.Event()  # every writer and reader has stopped
        self.commits = 0
        self.aborts = 0
        self.commit_budget = commit_budget
        self.committed = {n: [] for n in names}  # instance -> IDs acknowledged by COMMIT
        self.uncertain = {n: [] for n in names}  # COMMIT sent, connection lost before the answer
        # (mode, instance or None, position, count, sum, reader, seq, window base);
        # positions, sums and bases in internal numbering
        self.samples = []
        self.txns = []  # Txn records of every writer transaction
        self.answers = []  # Answer records of every reading statement
        self.errors = []  # unexpected exceptions (text)
        self.disconnects = 0
        self.writers_alive = 0
        # checkpoint mode
        self.checkpoint_cond = threading.Condition()
        self.checkpoints = 0
        self.spanning = 0  # transactions that allocated again after a CHECKPOINT
        # long_cursor mode: the churner commits while this is set
        self.churn = threading.Event()
        self.churned = 0
        self.long_cursors = []
        # standby mode
        self.standby_conflicts = 0
        # follower modes: (mode, [(internal id, instance) in delivery order],
        # last token, calls, error) per follower
        self.followers = []

    def wait_checkpoint(self, seen, timeout):
        with self.checkpoint_cond:
            return self.checkpoint_cond.wait_for(
                lambda: self.checkpoints > seen or self.stop.is_set(), timeout=timeout
            )


# next_ids and the transaction's xid (assigned by next_ids itself) in one statement.
ALLOCATE = "SELECT streampos.next_ids(%s, %s, %s), pg_catalog.pg_current_xact_id()::text::bigint"


def _writer(conninfo, st, stream, table, my_names, w, seed, abort_rate, tolerate, sign, opts):
    rng = random.Random(seed)
    t = sql.Identifier(table)
    insert_many = sql.SQL(
        "INSERT INTO {} (id, instance_name, payload) SELECT i, %s, %s || i FROM pg_catalog.unnest(%s::bigint[]) i"
    ).format(t)
    insert_one = sql.SQL("INSERT INTO {} (id, instance_name, payload) VALUES (%s, %s, %s)").format(t)
    conn = None
    mine = []
    fresh = 0
    try:
        conn = connect(conninfo)
        while not st.stop.is_set():
            if st.commit_budget is not None and st.commits >= st.commit_budget:
                break
            instance = my_names[0] if len(my_names) == 1 else rng.choice(my_names)
            hold = 0.0
            if opts["fresh_writers"] and fresh < opts["fresh_cap"] and rng.random() < opts["fresh_writers"]:
                # A brand-new instance name whose first transaction stays in
                # flight across a few passes of the position worker.
                fresh += 1
                instance = f"{opts['prefix']}f{w}_{fresh}"
                hold = rng.uniform(0.25, 0.5)
            txn = Txn(f"{instance}#{len(mine)}")
            mine.append(txn)

            def allocate(n):
                ids, xid = conn.execute(ALLOCATE, (stream, instance, n)).fetchone()
                txn.xid = xid
                txn.add(instance, [sign * i for i in ids])
                return ids

            sending_commit = None
            try:
                conn.execute("BEGIN")
                if rng.random() < 0.05:
                    # IDs allocated in a rolled-back savepoint: a gap, in
                    # flight until the top-level transaction ends.
                    conn.execute("SAVEPOINT gap")
                    txn.gap = [sign * i for i in allocate(rng.randint(1, 3))]
                    conn.execute("ROLLBACK TO SAVEPOINT gap")
                shape = rng.random()
                if shape < 0.01:
                    # More subtransactions than PGPROC caches: every snapshot
                    # taken meanwhile is suboverflowed.
                    ids = allocate(70)
                    for k, i in enumerate(ids):
                        conn.execute(f"SAVEPOINT s{k}")
                        conn.execute(insert_one, (i, instance, f"{instance}:{i}"))
                    # (savepoints released implicitly by COMMIT; rolled back by ROLLBACK)
                elif shape < 0.15:
                    ids = allocate(rng.randint(1, 5))
                    for i in ids:
                        conn.execute("SAVEPOINT r")
                        conn.execute(insert_one, (i, instance, f"{instance}:{i}"))
                        conn.execute("RELEASE SAVEPOINT r")
                else:
                    ids = allocate(rng.randint(1, 5))
                    conn.execute(insert_many, (instance, f"{instance}:", ids))
                if opts["checkpoint"] and rng.random() < opts["span"]:
                    # Keep the transaction open across a CHECKPOINT, then
                    # allocate again (the next nextval writes a new WAL
                    # record): the first IDs were durable, the new ones not.
                    seen = st.checkpoints
                    if st.wait_checkpoint(seen, timeout=2.0) and not st.stop.is_set():
                        more = allocate(rng.randint(1, 3))
                        conn.execute(insert_many, (instance, f"{instance}:", more))
                        ids = list(ids) + list(more)
                        with st.lock:
                            st.spanning += 1
                txn.rows = list(ids)
                time.sleep(rng.random() * 0.005 + hold)
                if rng.random() < abort_rate:
                    txn.t_end0 = time.monotonic()
                    conn.execute("ROLLBACK")
                    txn.t_end1 = time.monotonic()
                    txn.fate = "aborted"
                    with st.lock:
                        st.aborts += 1
                else:
                    sending_commit = ids
                    txn.t_end0 = time.monotonic()
                    conn.execute("COMMIT")
                    txn.t_end1 = time.monotonic()
                    txn.fate = "committed"
                    with st.lock:
                        st.commits += 1
                        st.committed.setdefault(instance, []).extend(ids)
                    sending_commit = None
            except Exception as e:
                if txn.fate is None:
                    txn.fate = "unknown" if sending_commit is not None else "aborted"
                if tolerate and is_disconnect(e):
                    with st.lock:
                        st.disconnects += 1
                        if sending_commit is not None:
                            st.uncertain.setdefault(instance, []).extend(sending_commit)
                    return
                raise
    except Exception as e:
        if tolerate and is_disconnect(e):
            with st.lock:
                st.disconnects += 1
            return
        with st.lock:
            st.errors.append(f"writer {w}: {type(e).__name__}: {e}")
        st.stop.set()
    finally:
        with st.lock:
            st.writers_alive -= 1
            st.txns.extend(mine)
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass


def _checkpointer(conninfo, st, interval_ms, seed, tolerate):
    """CHECKPOINT every interval_ms (0.5-1.5 times), until the load stops."""
    rng = random.Random(seed)
    conn = None
    try:
        conn = connect(conninfo)
        while not st.stop.wait(interval_ms / 1000.0 * (0.5 + rng.random())):
            conn.execute("CHECKPOINT")
            with st.checkpoint_cond:
                st.checkpoints += 1
                st.checkpoint_cond.notify_all()
    except Exception as e:
        if not (tolerate and is_disconnect(e)):
            with st.lock:
                st.errors.append(f"checkpointer: {type(e).__name__}: {e}")
            st.stop.set()
    finally:
        with st.checkpoint_cond:
            st.checkpoint_cond.notify_all()
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass


def _churner(conninfo, st, tolerate):
    """While a long cursor asks for new snapshots: commit transactions with
    an xid in a loop, so that each snapshot differs from the one before."""
    conn = None
    try:
        conn = connect(conninfo)
        conn.execute("SET synchronous_commit = off")
        while not st.done.is_set():
            if st.churn.wait(0.05):
                conn.execute(f"CALL {CHURN_PROCEDURE}(200)")
                st.churned += 200
    except Exception as e:
        if not (tolerate and is_disconnect(e)):
            with st.lock:
                st.errors.append(f"churner: {type(e).__name__}: {e}")
            st.stop.set()
    finally:
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass


# Every answer of one snapshot, in one statement: frontier, max_allocated,
# token, writer positions, and the snapshot itself.
FULL = (
    "streampos.frontier(%(s)s), streampos.max_allocated(%(s)s), streampos.current_token(%(s)s)::text, "
    "(SELECT pg_catalog.json_object_agg(instance_name, stream_id) FROM streampos.writer_positions(%(s)s)), "
    "pg_catalog.pg_current_snapshot()::text"
)


class _Reader:
    """One reader thread: samples (rows at or below a position) and answers
    (for the model)."""

    def __init__(self, conninfo, st, stream, table, names, ix, seed, tolerate, backwards, window, t0):
        self.conninfo = conninfo
        self.st = st
        self.stream = stream
        self.names = names
        self.ix = ix
        self.rng = random.Random(seed)
        self.tolerate = tolerate
        self.sign = -1 if backwards else 1
        self.backwards = backwards
        self.window = window
        self.t0 = t0
        self.samples = []
        self.answers = []
        self.txns = []
        self.seq = 0
        self.txn_no = 0
        self.last_front = 0  # internal numbering
        self.wbase = 0  # internal numbering, exclusive
        t = sql.Identifier(table)
        self.t = t
        le = sql.SQL(">=" if backwards else "<=")
        gt = sql.SQL("<" if backwards else ">")
        self.le, self.gt = le, gt
        # Every count is over the window (wbase, position]: wbase is 0 (all
        # rows) for every 8th sample, else `window` IDs below the reader's
        # last frontier, which keeps samples cheap on a big table.
        self.q_rows = sql.SQL("SELECT count(*), sum(id) FROM {t} WHERE id {le} %s AND id {gt} %s").format(
            t=t, le=le, gt=gt
        )

    # ---- records

    def new_txn(self):
        self.txn_no += 1
        return (self.ix, self.txn_no)

    def add(self, mode, inst, pos, count, total):
        self.seq += 1
        self.samples.append(
            (mode, inst, self.sign * pos, int(count), self.sign * int(total or 0), self.ix, self.seq, self.wbase)
        )

    def answer(self, mode, txn, t_snap, t_ans0, t_ans1, frontier, max_allocated=None, token=None,
               positions=None, snap=None, node="primary", note=""):
        s = self.sign
        a = Answer(
            mode, self.ix, txn,
            None if snap is None else parse_snapshot(snap),
            t_snap, t_ans0, t_ans1,
            s * frontier,
            None if max_allocated is None else s * max_allocated,
            None if positions is None else {k: s * v for k, v in positions.items()},
            None if token is None else _signed_token(parse_token(token), s),
            node=node, seq=self.seq, note=note,
        )
        self.answers.append(a)
        return a

    def full(self, conn, mode, txn, t_snap, note=""):
        """The FULL answer in a statement of its own; returns the frontier
        (external numbering)."""
        t_ans0 = time.monotonic()
        f, m, tok, wp, snap = conn.execute(f"SELECT {FULL}", {"s": self.stream}).fetchone()
        t_ans1 = time.monotonic()
        self.answer(mode, txn, t_snap if t_snap is not None else t_ans0, t_ans0, t_ans1, f, m, tok, wp or {}, snap,
                    note=note)
        return f

    def finish(self):
        with self.st.lock:
            self.st.samples.extend(self.samples)
            self.st.answers.extend(self.answers)
            self.st.txns.extend(self.txns)

    def failed(self, e):
        if self.tolerate and is_disconnect(e):
            with self.st.lock:
                self.st.disconnects += 1
            return
        with self.st.lock:
            self.st.errors.append(f"reader {self.ix}: {type(e).__name__}: {e}")
        self.st.stop.set()

    def next_window(self, mode):
        # The cursors fetch a few rows at a time: over a whole table of
        # hundreds of thousands of rows one sample would take minutes, so
        # they always count the window (what they test is the answer across
        # FETCHes, not the table's size).
        w = self.window
        full = w is None or self.last_front <= w or (mode not in ("cursor", "long_cursor") and self.rng.random() < 0.125)
        self.wbase = 0 if full else self.last_front - w
        return self.sign * self.wbase  # external

    # ---- the cycling modes

    def run_cycle(self, modes):
        st, rng, s = self.st, self.rng, self.stream
        t, le, gt = self.t, self.le, self.gt
        sign = self.sign
        q_filter = sql.SQL(
            "SELECT streampos.frontier(%(s)s) AS f, "
            "(SELECT count(*) FROM {t} WHERE id {le} %(base)s AND id {gt} %(wbase)s) "
            "  + count(*) FILTER (WHERE id {le} streampos.frontier(%(s)s)), "
            "coalesce((SELECT sum(id) FROM {t} WHERE id {le} %(base)s AND id {gt} %(wbase)s), 0) "
            "  + coalesce(sum(id) FILTER (WHERE id {le} streampos.frontier(%(s)s)), 0), "
            "streampos.max_allocated(%(s)s), pg_catalog.pg_current_snapshot()::text "
            "FROM {t} WHERE id {gt} %(base)s"
        ).format(t=t, le=le, gt=gt)
        q_cte = sql.SQL(
            "WITH x AS MATERIALIZED (SELECT streampos.frontier(%(s)s) AS f) "
            "SELECT x.f, (SELECT count(*) FROM {t} WHERE id {le} x.f AND id {gt} %(wbase)s), "
            "(SELECT sum(id) FROM {t} WHERE id {le} x.f AND id {gt} %(wbase)s), "
            "streampos.max_allocated(%(s)s), pg_catalog.pg_current_snapshot()::text FROM x"
        ).format(t=t, le=le, gt=gt)
        # instance_pos of every writer whose name the snapshot sees (an
        # unknown name is an error: on an open stream names come and go).
        known = (
            "FROM pg_catalog.unnest(%(names)s::text[]) WITH ORDINALITY u(n, o) "
            "WHERE EXISTS (SELECT FROM streampos.instances i WHERE i.instance_name = u.n) ORDER BY o"
        )
        q_token = (
            "WITH x AS MATERIALIZED (SELECT streampos.current_token(%(s)s) AS tok) "
            f"SELECT x.tok::text, streampos.stream_pos(x.tok), ARRAY(SELECT n {known}), "
            f"ARRAY(SELECT streampos.instance_pos(x.tok, n) {known}), " + FULL + " FROM x"
        )
        q_token_rows = sql.SQL(
            "SELECT w.n, count(r.id), sum(r.id) "
            "FROM unnest(%s::text[], %s::bigint[]) AS w(n, p) "
            "LEFT JOIN {t} r ON r.instance_name = w.n AND r.id {le} w.p AND r.id {gt} %s GROUP BY w.n"
        ).format(t=t, le=le, gt=gt)
        q_cursor = sql.SQL(
            "SELECT id, streampos.frontier(%(s)s), streampos.current_token(%(s)s)::text, "
            "pg_catalog.pg_current_snapshot()::text FROM {t} "
            "WHERE id {gt} %(wbase)s AND id {le} streampos.frontier(%(s)s)"
        ).format(t=t, le=le, gt=gt)

        conn = importer = None
        try:
            conn = connect(self.conninfo)
            if "imported" in modes:
                importer = connect(self.conninfo)
            modes = list(modes)
            while not st.stop.is_set():
                rng.shuffle(modes)
                for mode in modes:
                    if st.stop.is_set():
                        break
                    wb = self.next_window(mode)
                    try:
                        if mode == "rc":
                            f = self.full(conn, mode, self.new_txn(), None)
                            self.add(mode, None, f, *conn.execute(self.q_rows, (f, wb)).fetchone())
                        elif mode == "rr":
                            txn = self.new_txn()
                            with conn.transaction():
                                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                                t_snap = time.monotonic()
                                conn.execute("SELECT 1")  # the snapshot is taken here
                                time.sleep(rng.random() * 0.003)
                                f = self.full(conn, mode, txn, t_snap)
                                if rng.random() < 0.5:
                                    # The same snapshot again, after commits and aborts.
                                    time.sleep(rng.random() * 0.003)
                                    self.full(conn, mode, txn, t_snap, note="again")
                                self.add(mode, None, f, *conn.execute(self.q_rows, (f, wb)).fetchone())
                        elif mode == "stmt_filter":
                            base = sign * max(self.wbase, self.last_front - rng.randint(0, 300))
                            t_ans0 = time.monotonic()
                            f, c, total, m, snap = conn.execute(
                                q_filter, {"s": s, "base": base, "wbase": wb}
                            ).fetchone()
                            self.answer(mode, self.new_txn(), t_ans0, t_ans0, time.monotonic(), f, m, snap=snap)
                            self.add(mode, None, f, c, total)
                        elif mode == "stmt_cte":
                            t_ans0 = time.monotonic()
                            f, c, total, m, snap = conn.execute(q_cte, {"s": s, "wbase": wb}).fetchone()
                            self.answer(mode, self.new_txn(), t_ans0, t_ans0, time.monotonic(), f, m, snap=snap)
                            self.add(mode, None, f, c, total)
                        elif mode == "cursor":
                            f = self.cursor_sample(conn, q_cursor, wb)
                            if f is None:
                                break
                        elif mode == "imported":
                            f = self.imported_sample(conn, importer, wb)
                        else:  # token
                            txn = self.new_txn()
                            with conn.transaction():
                                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                                t_ans0 = time.monotonic()
                                row = conn.execute(q_token, {"s": s, "names": self.names}).fetchone()
                                _tok, f, known_names, positions = row[:4]
                                f2, m, tok, wp, snap = row[4:]
                                self.answer(mode, txn, t_ans0, t_ans0, time.monotonic(), f2, m, tok, wp or {}, snap)
                                self.add("token_min", None, f, *conn.execute(self.q_rows, (f, wb)).fetchone())
                                got = {
                                    r[0]: (r[1], r[2])
                                    for r in conn.execute(q_token_rows, (known_names, positions, wb))
                                }
                                for n, p in zip(known_names, positions):
                                    self.add("token", n, p, *got[n])
                        self.last_front = sign * f
                    except Exception as e:
                        if self.tolerate and is_disconnect(e):
                            with st.lock:
                                st.disconnects += 1
                            return
                        raise
        except Exception as e:
            self.failed(e)
        finally:
            self.finish()
            for c in (conn, importer):
                if c is not None:
                    try:
                        c.close()
                    except Exception:
                        pass

    def _cursor_rows(self, rows, txn, t_snap, t_ans0, t_ans1, seen, mode, note):
        """Rows (id, frontier, token, snapshot) of a cursor: one answer per
        distinct (frontier, token, snapshot); returns (count, sum, last frontier)."""
        count = total = 0
        last = None
        for row_id, f, tok, snap in rows:
            key = (f, tok, snap)
            if key not in seen:
                seen.add(key)
                self.answer(mode, txn, t_snap, t_ans0, t_ans1, f, token=tok, snap=snap, note=note)
            count += 1
            total += row_id
            last = f
        return count, total, last

    def cursor_sample(self, conn, q_cursor, wb):
        rng = self.rng
        txn = self.new_txn()
        seen = set()
        count = total = 0
        last = None
        with conn.transaction():
            with conn.cursor(name=f"torture_{self.ix}") as cur:
                t_snap = time.monotonic()
                cur.execute(q_cursor, {"s": self.stream, "wbase": wb})
                fetches = 0
                while True:
                    if self.st.stop.is_set():
                        # Stopped half-way: the answers count, the rows do not.
                        return None
                    t_ans0 = time.monotonic()
                    # 2 rows a fetch for the first ten fetches, then 100: a
                    # few FETCHes with commits between are what this tests.
                    batch = cur.fetchmany(2 if fetches < 10 else 100)
                    fetches += 1
                    if not batch:
                        break
                    c, s, f = self._cursor_rows(batch, txn, t_snap, t_ans0, time.monotonic(), seen, "cursor", "fetch")
                    count += c
                    total += s
                    last = f
                    time.sleep(rng.random() * 0.002)
        if last is None:
            # No row at or below it: ask the same way for the position.
            f = self.full(conn, "cursor", self.new_txn(), None, note="no rows")
            self.add("cursor", None, f, *conn.execute(self.q_rows, (f, wb)).fetchone())
            return f
        # The position a caller keeps is the last row's.
        self.add("cursor", None, last, count, total)
        return last

    def imported_sample(self, conn, importer, wb):
        rng = self.rng
        exporter_txn, importer_txn = self.new_txn(), self.new_txn()
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            t_snap = time.monotonic()
            snapshot = conn.execute("SELECT pg_export_snapshot()").fetchone()[0]
            exported_f = self.full(conn, "imported", exporter_txn, t_snap, note="exporter")
            self.add("imported", None, exported_f, *conn.execute(self.q_rows, (exported_f, wb)).fetchone())
            time.sleep(rng.random() * 0.003)
            with importer.transaction():
                importer.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                importer.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
                f = self.full(importer, "imported", importer_txn, t_snap, note="importer")
                self.add("imported", None, f, *importer.execute(self.q_rows, (f, wb)).fetchone())
        return f

    # ---- long_cursor

    def run_long_cursors(self, target, limit_seconds):
        st = self.st
        conn = helper = None
        try:
            conn = connect(self.conninfo)
            helper = connect(self.conninfo)
            while not st.stop.is_set():
                f = self.long_cursor_sample(conn, helper, target, limit_seconds)
                if f is not None:
                    self.last_front = self.sign * f
                else:
                    time.sleep(0.05)
        except Exception as e:
            self.failed(e)
        finally:
            self.st.churn.clear()
            self.finish()
            for c in (conn, helper):
                if c is not None:
                    try:
                        c.close()
                    except Exception:
                        pass

    def long_cursor_sample(self, conn, helper, target, limit_seconds):
        """One long cursor (see the module's docstring); returns its
        position, or None when it found no row at or below the frontier."""
        st, s, sign = self.st, self.stream, self.sign
        wb = self.next_window("long_cursor")
        q = sql.SQL(
            "DECLARE torture_long NO SCROLL CURSOR FOR "
            "SELECT id, streampos.frontier(%(s)s), streampos.current_token(%(s)s)::text, "
            "pg_catalog.pg_current_snapshot()::text FROM {t} "
            "WHERE id {gt} %(wbase)s AND id {le} streampos.frontier(%(s)s)"
        ).format(t=self.t, le=self.le, gt=self.gt)
        # A helper transaction holds an ID while the cursor's snapshot is
        # taken, and rolls back after the first FETCH: an answer computed
        # again for that snapshot would be higher than the first.
        instance = self.names[0]
        hold = Txn(f"long_cursor helper of reader {self.ix}")
        self.txns.append(hold)
        helper.execute("BEGIN")
        try:
            ids, xid = helper.execute(ALLOCATE, (s, instance, 1)).fetchone()
            hold.xid = xid
            hold.add(instance, [sign * i for i in ids])
            # The held ID becomes the lowest in flight (what was allocated
            # before it ends), and writers commit rows above it.
            waited = time.monotonic() + 1.0
            while time.monotonic() < waited:
                f = conn.execute("SELECT streampos.frontier(%s)", (s,)).fetchone()[0]
                if sign * f >= sign * ids[0] - 1:
                    break
                time.sleep(0.005)
            time.sleep(0.05)
            txn = self.new_txn()
            conn.execute("BEGIN")
            t_snap = time.monotonic()
            conn.execute(q, {"s": s, "wbase": wb})
            t_ans0 = time.monotonic()
            first = conn.execute("FETCH 1 FROM torture_long").fetchall()
            t_ans1 = time.monotonic()
        finally:
            hold.t_end0 = time.monotonic()
            helper.execute("ROLLBACK")
            hold.t_end1 = time.monotonic()
            hold.fate = "aborted"
        if not first:
            conn.execute("ROLLBACK")
            return None
        seen = set()
        count, total, last = self._cursor_rows(first, txn, t_snap, t_ans0, t_ans1, seen, "long_cursor", "FETCH 1")
        # More than `target` distinct snapshots, each asking frontier(), in
        # this transaction while the cursor stays open.
        snapshots = set()
        calls = 0
        deadline = time.monotonic() + limit_seconds
        st.churn.set()
        try:
            while len(snapshots) <= target and time.monotonic() < deadline:
                tb0 = time.monotonic()
                out = conn.execute(
                    f"SELECT {PROBE_FUNCTION}(%s, %s, %s)",
                    (s, target + 1 - len(snapshots), max(0.1, min(5.0, deadline - tb0))),
                ).fetchall()
                tb1 = time.monotonic()
                batch = {}
                for (text,) in out:
                    f, snap = text.split(" ", 1)
                    calls += 1
                    snapshots.add(snap)
                    batch.setdefault((int(f), snap), None)
                for f, snap in batch:
                    self.answer("long_cursor", txn, tb0, tb0, tb1, f, snap=snap, note="probe")
        finally:
            st.churn.clear()
        t_ans0 = time.monotonic()
        rest = conn.execute("FETCH ALL FROM torture_long").fetchall()
        t_ans1 = time.monotonic()
        conn.execute("COMMIT")
        c, tot, f = self._cursor_rows(rest, txn, t_snap, t_ans0, t_ans1, seen, "long_cursor", "FETCH ALL")
        count += c
        total += tot
        last = f if f is not None else last
        frontiers = sorted({k[0] for k in seen})
        with st.lock:
            st.long_cursors.append(
                {"snapshots": len(snapshots), "statements": calls, "rows": count, "frontiers": frontiers}
            )
        self.add("long_cursor", None, last, count, total)
        return last

    # ---- standby

    def run_follower(self, since, ordered):
        """A follower of the stream (modes ``follower``, ``ordered_follower``):
        ``updates_json`` from ``since`` until the run stops, recorded for
        ``check_followers``."""
        st, rng = self.st, self.rng
        mode = "ordered_follower" if ordered else "follower"
        delivered, calls, conn = [], 0, None
        try:
            conn = connect(self.conninfo)
            while not st.stop.is_set():
                max_rows = rng.choice((1, 3, 50, 500))
                timeout_ms = rng.choice((0, 0, 200))
                since, _ = follow_once(conn, self.stream, since, max_rows, timeout_ms, ordered, self.sign, delivered)
                calls += 1
        except Exception as e:
            self.failed(e)
        finally:
            with st.lock:
                st.followers.append((mode, delivered, since, calls))
            if conn is not None:
                try:
                    conn.close()
                except Exception:
                    pass

    def run_standby(self, standby_conninfo):
        st, rng, s = self.st, self.rng, self.stream
        q = sql.SQL(
            "WITH x AS MATERIALIZED (SELECT streampos.frontier(%(s)s) AS f, "
            "streampos.current_token(%(s)s)::text AS tok, "
            "(SELECT pg_catalog.json_object_agg(instance_name, stream_id) "
            " FROM streampos.writer_positions(%(s)s)) AS wp) "
            "SELECT x.f, x.tok, x.wp, (SELECT count(*) FROM {t} WHERE id {le} x.f AND id {gt} %(wbase)s), "
            "(SELECT sum(id) FROM {t} WHERE id {le} x.f AND id {gt} %(wbase)s) FROM x"
        ).format(t=self.t, le=self.le, gt=self.gt)
        conn = None
        try:
            conn = connect(standby_conninfo)
            while not st.stop.is_set():
                wb = self.next_window("standby")
                t_ans0 = time.monotonic()
                try:
                    f, tok, wp, c, total = conn.execute(q, {"s": s, "wbase": wb}).fetchone()
                except psycopg.Error as e:
                    # Not replayed yet (the stream, its table), or a query
                    # cancelled by a conflict with recovery: try again.
                    if getattr(e.diag, "sqlstate", None) in ("42704", "42P01", "40001"):
                        with st.lock:
                            st.standby_conflicts += 1
                        time.sleep(0.05)
                        continue
                    raise
                self.answer("standby", self.new_txn(), t_ans0, t_ans0, time.monotonic(), f, None, tok, wp or {},
                            node="standby")
                self.add("standby", None, f, c, total)
                self.last_front = self.sign * f
                time.sleep(rng.uniform(0.002, 0.02))
        except Exception as e:
            self.failed(e)
        finally:
            self.finish()
            if conn is not None:
                try:
                    conn.close()
                except Exception:
                    pass


FOLLOW = "SELECT streampos.updates_json(%s, %s, %s, %s, ordered => %s)"


def follow_once(conn, stream, since, max_rows, timeout_ms, ordered, sign, delivered):
    """One ``updates_json`` call from ``since``: its rows' (internal ID,
    instance) appended to ``delivered`` in the answer's order (tables merged
    in ID order); returns (the answer's token, whether it was limited)."""
    answer = conn.execute(FOLLOW, (stream, since, max_rows, timeout_ms, ordered)).fetchone()[0]
    data, rows, i = answer["data"], [], 0
    while i < len(data):
        count = data[i][2]
        rows.extend(data[i + 1 : i + 1 + count])
        i += 1 + count
    rows.sort(key=lambda r: sign * int(r[0]))
    delivered.extend((sign * int(r[0]), r[1]) for r in rows)
    return answer["token"], answer["limited"]


def follower_findings(ordered, delivered, wanted):
    """What a follower was given (``delivered``: (internal ID, instance) in
    delivery order) against ``wanted`` ({internal ID: instance}): {kind:
    [finding, ...]} for the follower_* kinds."""
    seen, repeated, extra, out_of_order = set(), [], [], []
    last_by_writer, last = {}, None
    for i, inst in delivered:
        if i in seen:
            repeated.append(i)
        seen.add(i)
        if i not in wanted:
            extra.append(i)
        if ordered and last is not None and i <= last:
            out_of_order.append((last, i))
        elif inst in last_by_writer and i <= last_by_writer[inst]:
            out_of_order.append((last_by_writer[inst], i))
        last_by_writer[inst] = i
        last = i
    return {
        "follower_missed": sorted(set(wanted) - seen),
        "follower_repeated": repeated,
        "follower_extra": extra,
        "follower_out_of_order": out_of_order,
    }


def check_followers(conninfo, result, report, wanted):
    """Drain each follower from its last token (the writers have stopped
    and nothing is in flight), then check what it was given against
    ``wanted`` ({internal ID: instance}: the committed rows of the run)."""
    sign = -1 if result["backwards"] else 1
    summary = []
    with connect(conninfo) as conn:
        for mode, delivered, since, calls in result["followers"]:
            ordered = mode == "ordered_follower"
            delivered = list(delivered)
            for _ in range(10000):
                since, limited = follow_once(conn, result["stream"], since, 1000, 0, ordered, sign, delivered)
                calls += 1
                if not limited:
                    break
            for kind, found in follower_findings(ordered, delivered, wanted).items():
                if found:
                    report.add(kind, f"{mode}: {len(found)}, first {found[:8]} ({calls} calls, {len(delivered)} rows)")
            summary.append({"mode": mode, "calls": calls, "rows": len(delivered)})
    result["follower_summary"] = summary


def _signed_token(token, sign):
    sp, entries = token
    return sign * sp, {k: sign * v for k, v in entries.items()}


# --------------------------------------------------------------- checks


def find_regressions(samples):
    """Each reader's samples in order: positions must never go down.
    Frontier-like samples (every mode but token) form one sequence per
    reader, each writer's token position another. Returns descriptions."""
    last = {}
    regressions = []
    for mode, inst, pos, _c, _s, reader, seq, _w in sorted(samples, key=lambda x: (x[5], x[6])):
        key = (reader, inst if mode == "token" else None)
        prev = last.get(key)
        if prev is not None and pos < prev[0]:
            regressions.append(
                f"reader {reader} sample {seq} ({mode}{'/' + inst if inst else ''}): "
                f"position {pos} after {prev[0]} (sample {prev[1]}, {prev[2]})"
            )
        last[key] = (pos, seq, mode)
    return regressions


def recheck_samples(conn, table, samples, limit=20, by_mode=None, backwards=None):
    """Compare every sample with the rows the table holds now. Returns
    (number of violations, details of the first ``limit``); counts them per
    sampling mode into the dict ``by_mode`` when given. Positions and sums
    in the samples are in internal (positive) numbering; ``backwards``
    (default: guessed from the table's IDs being negative) says how to map
    the table's IDs."""
    rows = conn.execute(
        sql.SQL("SELECT id, instance_name FROM {}").format(sql.Identifier(table))
    ).fetchall()
    if backwards is None:
        backwards = any(r[0] < 0 for r in rows)
    sign = -1 if backwards else 1
    rows = sorted((sign * i, n) for i, n in rows)
    all_ids = [r[0] for r in rows]
    per_instance = {}
    for i, n in rows:
        per_instance.setdefault(n, []).append(i)

    def prefix_sums(ids):
        out = [0]
        for i in ids:
            out.append(out[-1] + i)
        return out

    sums_all = prefix_sums(all_ids)
    sums_inst = {n: prefix_sums(ids) for n, ids in per_instance.items()}
    violations = 0
    details = []
    for mode, inst, pos, count, total, reader, seq, wbase in samples:
        if mode == "token":
            ids = per_instance.get(inst, [])
            sums = sums_inst.get(inst, [0])
        else:
            ids, sums = all_ids, sums_all
        # Rows in (wbase, pos].
        hi = bisect.bisect_right(ids, pos)
        lo = min(hi, bisect.bisect_right(ids, wbase))
        want_count, want_sum = hi - lo, sums[hi] - sums[lo]
        if (count, total) != (want_count, want_sum):
            violations += 1
            if by_mode is not None:
                by_mode[mode] = by_mode.get(mode, 0) + 1
            if len(details) < limit:
                missing = ""
                if want_count - count == 1:
                    missing = f"; missed ID {sign * (want_sum - total)}"
                window = f" (rows above {sign * wbase})" if wbase else ""
                details.append(
                    f"{mode}{'/' + inst if inst else ''} reader {reader} sample {seq}: position {sign * pos}{window}, "
                    f"saw {count} rows (sum {sign * total}), the table has {want_count} (sum {sign * want_sum}){missing}"
                )
    return violations, details



STANDBY_QUERY = (
    "SELECT streampos.frontier(%(s)s), streampos.current_token(%(s)s)::text, "
    "(SELECT pg_catalog.json_object_agg(instance_name, stream_id) FROM streampos.writer_positions(%(s)s))"
)


def _answer_now(conn, stream, sign, mode, node="primary", extra=""):
    """A fresh statement's answer (its own snapshot), and the extra columns."""
    t0 = time.monotonic()
    if node == "primary":
        row = conn.execute(f"SELECT {FULL}{extra}", {"s": stream}).fetchone()
        f, m, tok, wp, snap = row[:5]
        rest = row[5:]
    else:
        f, tok, wp = conn.execute(STANDBY_QUERY, {"s": stream}).fetchone()
        m = snap = None
        rest = ()
    t1 = time.monotonic()
    a = Answer(
        mode, "verify", ("verify", mode, t0), None if snap is None else parse_snapshot(snap), t0, t0, t1,
        sign * f, None if m is None else sign * m,
        {k: sign * v for k, v in (wp or {}).items()},
        _signed_token(parse_token(tok), sign), node=node,
    )
    return a, rest


def _name_token(a, names):
    """Tokens name instance ids; the model names writers (an id that is no
    longer in streampos.instances, its creation rolled back, as #id)."""
    if a.token is not None and any(isinstance(k, int) for k in a.token[1]):
        a.token = (a.token[0], {names.get(k, f"#{k}") if isinstance(k, int) else k: p for k, p in a.token[1].items()})


def _not_at(a, target, required):
    """Why answer ``a`` is not the quiescent answer ``target`` (internal),
    with every writer of ``required`` listed."""
    why = []
    if a.frontier != target:
        why.append(f"frontier {a.frontier}")
    if a.max_allocated is not None and a.max_allocated != target:
        why.append(f"max_allocated {a.max_allocated}")
    behind = {w: p for w, p in (a.positions or {}).items() if p != target}
    if behind:
        why.append(f"writer positions {format_positions(behind)}")
    missing = sorted(set(required) - set(a.positions or {}))
    if missing:
        why.append(f"writer_positions omits {len(missing)} writer(s) {missing[:5]}")
    if a.token is not None and a.token != (target, {}):
        why.append(f"token {format_token(a.token)}")
    return why


def verify(conninfo, result, progress_timeout=5.0, standby_timeout=20.0):
    """The end-of-run checks, on a fresh connection. ``result`` is what ``run``
    returned; it is updated and returned. Raises if the server cannot be
    reached (after a crash, call it again once the server is back)."""
    stream, table = result["stream"], result["table"]
    sign = -1 if result["backwards"] else 1
    answers = result["answers"]
    report = Report()
    with connect(conninfo) as conn:
        table_ids = {
            r[0]: r[1]
            for r in conn.execute(sql.SQL("SELECT id, instance_name FROM {}").format(sql.Identifier(table)))
        }
        # The model's fates: a COMMIT without an answer committed if its rows are there.
        for t in result["txns"]:
            if t.fate == "unknown":
                t.fate = "committed" if any(i in table_ids for i in t.rows) else "aborted"
            elif t.fate is None:
                t.fate = "aborted"
        committed_writers = sorted({w for t in result["txns"] if t.fate == "committed" for w, v in t.ids.items() if v})

        # Progress: once every transaction has ended, nothing is in flight and
        # a fresh snapshot's answers are all max_allocated.
        deadline = time.monotonic() + progress_timeout
        while True:
            a, (in_flight,) = _answer_now(
                conn, stream, sign, "final", extra=", (SELECT count(*) FROM streampos.in_flight(%(s)s))"
            )
            answers.append(a)
            why = _not_at(a, a.max_allocated, committed_writers)
            if in_flight:
                why.append(f"{in_flight} allocation(s) in flight")
            if not why or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        front, maxa = sign * a.frontier, sign * a.max_allocated
        result["frontier"] = front
        result["max_allocated"] = maxa
        result["in_flight"] = in_flight
        result["sequence"] = sequence_value(conn, stream)
        if maxa != result["sequence"]:
            why.append(f"max_allocated {maxa} != the sequence's {result['sequence']}")
        names = dict(conn.execute("SELECT instance_id, instance_name FROM streampos.instances").fetchall())
        _name_token(a, names)
        if why:
            report.add(
                "no_progress",
                f"{progress_timeout:.0f}s after the writers stopped: {'; '.join(why)}. [{a.describe(result['t0'])}]",
            )

        acknowledged = {i: n for n, ids in result["committed"].items() for i in ids}
        uncertain = {i: n for n, ids in result["uncertain"].items() for i in ids}
        initial = result["initial_ids"]
        result["lost"] = sorted(i for i in acknowledged if i not in table_ids)
        result["extra"] = sorted(
            i for i in table_ids if i not in acknowledged and i not in uncertain and i not in initial
        )
        result["wrong_owner"] = sorted(
            i for i, n in acknowledged.items() if i in table_ids and table_ids[i] != n
        )
        result["uncertain_committed"] = sum(1 for i in uncertain if i in table_ids)
        if result.get("followers"):
            wanted = {sign * i: n for i, n in table_ids.items() if i not in initial}
            check_followers(conninfo, result, report, wanted)

        by_mode = {}
        violations, details = recheck_samples(
            conn, table, result["sample_list"], by_mode=by_mode, backwards=result["backwards"]
        )
        result["violations"] = violations
        result["violations_by_mode"] = by_mode
        result["violation_details"] = details

    # A standby catches up once the writers stopped.
    if result.get("standby_conninfo"):
        target = a.max_allocated
        with connect(result["standby_conninfo"]) as sc:
            deadline = time.monotonic() + standby_timeout
            while True:
                s_answer, _ = _answer_now(sc, stream, sign, "final", node="standby")
                answers.append(s_answer)
                why = _not_at(s_answer, target, ())
                if not why or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
        result["standby_frontier"] = sign * s_answer.frontier
        _name_token(s_answer, names)
        if why:
            report.add(
                "standby_no_catch_up",
                f"{standby_timeout:.0f}s after the writers stopped, the primary at {target}: {'; '.join(why)}. "
                f"[{s_answer.describe(result['t0'])}]",
            )

    for x in answers:
        _name_token(x, names)
    check_contract(result["txns"], answers, backwards=result["backwards"], report=report, t0=result["t0"])
    result["contract"] = report.found()
    result["contract_violations"] = report.total()
    result["contract_details"] = report.details
    result["max_token_entries"] = max((len(x.token[1]) for x in answers if x.token is not None), default=0)
    result["max_writer_positions"] = max((len(x.positions) for x in answers if x.positions is not None), default=0)

    regressions = find_regressions(result["sample_list"])
    result["regressions"] = len(regressions)
    result["regression_details"] = regressions[:20]
    result["verified"] = True
    result["ok"] = (
        not result["errors"]
        and result["violations"] == 0
        and result["regressions"] == 0
        and result["contract_violations"] == 0
        and not result["lost"]
        and not result["extra"]
        and not result["wrong_owner"]
        and front == maxa
        and in_flight == 0
        and maxa == result["sequence"]
    )
    return result


def scenario_options(scenarios, options=None):
    """Keyword arguments of ``run`` for the named scenarios (see the
    module's docstring), merged into ``options``."""
    out = dict(options or {})
    modes = tuple(out.get("modes", MODES))
    for name in scenarios:
        if name == "checkpoint":
            out.setdefault("checkpoint_ms", 300)
        elif name == "many_writers":
            out["instances"] = max(out.get("instances", 3), 90)
            out["writers"] = max(out.get("writers", 6), 8)
            out["open_stream"] = True
        elif name == "long_cursor":
            modes += ("long_cursor",) if "long_cursor" not in modes else ()
        elif name == "followers":
            modes += tuple(m for m in ("follower", "ordered_follower") if m not in modes)
        elif name == "standby":
            modes += ("standby",) if "standby" not in modes else ()
            out["open_stream"] = True
            out.setdefault("fresh_writers", 0.03)
        else:
            raise ValueError(f"unknown scenario {name!r} (known: {', '.join(SCENARIOS)})")
    out["modes"] = modes
    return out


def run(
    conninfo,
    stream="torture",
    seconds=None,
    commits=None,
    writers=6,
    instances=3,
    readers=4,
    abort_rate=0.1,
    seed=None,
    tolerate_disconnect=False,
    verify_at_end=True,
    table=None,
    instance_prefix=DEFAULT_INSTANCE_PREFIX,
    progress_timeout=5.0,
    max_seconds=None,
    modes=MODES,
    backwards=False,
    window=20000,
    checkpoint_ms=None,
    span_rate=0.25,
    open_stream=False,
    fresh_writers=0.0,
    fresh_cap=5,
    standby=None,
    long_cursor_snapshots=CACHED_SNAPSHOTS + 300,
    long_cursor_seconds=30.0,
    first_front=0,
):
    """Run the torture load and (unless ``verify_at_end`` is false) its checks.

    ``conninfo``: keyword arguments for ``psycopg.connect`` (host, port,
    dbname, user, ...). Stops after ``seconds``, or once ``commits``
    transactions have committed (then ``max_seconds`` bounds the time), or
    when every writer has gone. With ``tolerate_disconnect`` a lost connection
    ends that thread quietly; an ID whose COMMIT got no answer is *uncertain*:
    it may or may not be in the table. ``backwards`` and ``open_stream``
    apply when the stream is created (a reused stream keeps its direction
    and writers). ``modes``: the reader sampling modes to use (default all
    of ``MODES``; ``long_cursor`` and ``standby`` add a thread each;
    ``standby`` needs ``standby``, the standby's conninfo). ``window``: most
    samples count only the rows within that many IDs below the reader's
    previous frontier (a missed row would be an ID allocated by a
    transaction in flight near the sample, far inside the window); one in
    eight, and all while the stream is shorter, count every row. ``None``:
    always every row. ``first_front``: the readers' first "previous
    frontier" (internal numbering): on a table earlier runs filled, the
    first samples count the window too (a cursor's would fetch the whole
    table). ``checkpoint_ms``: CHECKPOINT about that often, and
    ``span_rate`` of the transactions allocate again after the next one.
    ``fresh_writers``: the probability that a transaction writes as a new
    instance name (at most ``fresh_cap`` per writer thread) and stays open
    0.25-0.5 s. ``long_cursor_snapshots``: how many distinct snapshots a
    long cursor's transaction asks for (at most ``long_cursor_seconds``).

    Returns a dict: stream, table, backwards, commits, aborts, samples
    (number), samples_by_mode, sample_list, committed / uncertain
    ({instance: [ids]}), initial_ids, txns and answers (the model),
    disconnects, errors, seconds, checkpoints, spanning, long_cursors,
    standby_conflicts, and after verification: violations,
    violations_by_mode, violation_details, regressions, regression_details,
    contract ({kind: count}), contract_violations, contract_details,
    max_token_entries, max_writer_positions, frontier, max_allocated,
    sequence, in_flight, lost, extra, wrong_owner, verified, ok.
    """
    if seconds is None and commits is None:
        seconds = 30
    if commits is not None and max_seconds is None:
        max_seconds = max(600, commits / 50)
    unknown = set(modes) - set(ALL_MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)}")
    if "standby" in modes and not standby:
        raise ValueError("mode standby needs the standby's conninfo (standby=...)")
    seed = random.randrange(1 << 30) if seed is None else seed
    table = table or table_name_for(stream)
    names = instance_names(instances, instance_prefix)
    with connect(conninfo) as conn:
        initial_ids, backwards, configured = setup_stream(conn, stream, table, names, backwards, open_stream)
    if fresh_writers and configured is not None:
        raise ValueError("fresh_writers needs an open stream (open_stream=True)")
    sign = -1 if backwards else 1

    st = _State(names, commits)
    st.writers_alive = writers
    opts = {
        "checkpoint": bool(checkpoint_ms),
        "span": span_rate,
        "fresh_writers": fresh_writers,
        "fresh_cap": fresh_cap,
        "prefix": instance_prefix,
    }
    start = time.monotonic()

    def share(w):
        mine = names[w::writers] if instances > writers else []
        return mine or [names[w % instances]]

    writer_threads = [
        threading.Thread(
            target=_writer,
            args=(conninfo, st, stream, table, share(w), w, seed * 7919 + w, abort_rate, tolerate_disconnect,
                  sign, opts),
            name=f"torture-writer-{w}",
            daemon=True,
        )
        for w in range(writers)
    ]
    cycle = tuple(m for m in modes if m in MODES)
    reader_threads = []
    if cycle:
        for r in range(readers):
            rd = _Reader(conninfo, st, stream, table, names, r, seed * 104729 + r, tolerate_disconnect, backwards,
                         window, start)
            rd.last_front = first_front
            reader_threads.append(threading.Thread(target=rd.run_cycle, args=(cycle,), name=f"torture-reader-{r}",
                                                   daemon=True))
    helpers = []
    if "long_cursor" in modes:
        rd = _Reader(conninfo, st, stream, table, names, readers, seed * 104729 + readers, tolerate_disconnect,
                     backwards, window, start)
        reader_threads.append(threading.Thread(
            target=rd.run_long_cursors, args=(long_cursor_snapshots, long_cursor_seconds),
            name="torture-long-cursor", daemon=True))
        helpers.append(threading.Thread(target=_churner, args=(conninfo, st, tolerate_disconnect),
                                        name="torture-churner", daemon=True))
    if "standby" in modes:
        rd = _Reader(conninfo, st, stream, table, names, readers + 1, seed * 104729 + readers + 1,
                     tolerate_disconnect, backwards, window, start)
        reader_threads.append(threading.Thread(target=rd.run_standby, args=(standby,), name="torture-standby",
                                               daemon=True))
    if "follower" in modes or "ordered_follower" in modes:
        # Followers start from the token current before any writer runs:
        # every row the run commits is theirs to receive.
        with connect(conninfo) as conn:
            start_token = conn.execute("SELECT streampos.current_token(%s)::text", (stream,)).fetchone()[0]
        for k, mode in enumerate(m for m in ("follower", "ordered_follower") if m in modes):
            rd = _Reader(conninfo, st, stream, table, names, readers + 2 + k, seed * 104729 + readers + 2 + k,
                         tolerate_disconnect, backwards, window, start)
            reader_threads.append(threading.Thread(target=rd.run_follower, args=(start_token, mode != "follower"),
                                                   name=f"torture-{mode}", daemon=True))
    if checkpoint_ms:
        helpers.append(threading.Thread(target=_checkpointer,
                                        args=(conninfo, st, checkpoint_ms, seed * 31 + 1, tolerate_disconnect),
                                        name="torture-checkpointer", daemon=True))
    for t in writer_threads + reader_threads + helpers:
        t.start()
    while not st.stop.is_set():
        elapsed = time.monotonic() - start
        if seconds is not None and elapsed >= seconds:
            break
        if max_seconds is not None and elapsed >= max_seconds:
            break
        if commits is not None and st.commits >= commits:
            break
        if st.writers_alive <= 0:
            break
        time.sleep(0.05)
    st.stop.set()
    for t in writer_threads + reader_threads:
        t.join(60 + (long_cursor_seconds if t.name == "torture-long-cursor" else 0))
    st.done.set()
    for t in helpers:
        t.join(60)
    hung = [t.name for t in writer_threads + reader_threads + helpers if t.is_alive()]
    if hung:
        st.errors.append(f"threads did not stop: {hung}")
    elapsed = time.monotonic() - start

    result = {
        "stream": stream,
        "table": table,
        "backwards": backwards,
        "writers_configured": configured,
        "seed": seed,
        "t0": start,
        "commits": st.commits,
        "aborts": st.aborts,
        "samples": len(st.samples),
        "samples_by_mode": {m: sum(1 for s in st.samples if s[0] == m) for m in ALL_MODES + ("token_min",)},
        "sample_list": st.samples,
        "answers": st.answers,
        "txns": st.txns,
        "committed": st.committed,
        "uncertain": st.uncertain,
        "initial_ids": initial_ids,
        "disconnects": st.disconnects,
        "errors": st.errors,
        "seconds": round(elapsed, 1),
        "checkpoints": st.checkpoints,
        "spanning": st.spanning,
        "long_cursors": st.long_cursors,
        "churned": st.churned,
        "standby_conninfo": standby if "standby" in modes else None,
        "standby_conflicts": st.standby_conflicts,
        "followers": st.followers,
        "verified": False,
        "ok": False,
    }
    if verify_at_end:
        try:
            verify(conninfo, result, progress_timeout=progress_timeout)
        except Exception as e:
            if not (tolerate_disconnect and is_disconnect(e)):
                raise
    return result


def summary_line(result):
    r = result
    line = (
        f"torture: commits={r['commits']} aborts={r['aborts']} samples={r['samples']} "
        f"violations={r.get('violations', '?')} frontier={r.get('frontier', '?')} "
        f"max_allocated={r.get('max_allocated', '?')} seconds={r['seconds']}"
    )
    if r.get("verified"):
        line += (
            f" regressions={r['regressions']} lost={len(r['lost'])} extra={len(r['extra'])}"
            f" sequence={r['sequence']} in_flight={r['in_flight']}"
            f" answers={len(r['answers'])} contract_violations={r['contract_violations']}"
        )
        if r["contract"]:
            line += " contract=" + ",".join(f"{k}:{n}" for k, n in r["contract"].items())
    if r.get("violations_by_mode"):
        line += " violations_by_mode=" + ",".join(f"{m}:{n}" for m, n in sorted(r["violations_by_mode"].items()))
    if r.get("checkpoints"):
        line += f" checkpoints={r['checkpoints']} spanning={r['spanning']}"
    if r.get("long_cursors"):
        line += " long_cursors=" + ",".join(
            f"{c['snapshots']}snap/{len(c['frontiers'])}ans" for c in r["long_cursors"]
        )
    if r.get("max_token_entries"):
        line += f" max_token_entries={r['max_token_entries']}"
    if r.get("standby_conninfo"):
        line += f" standby_samples={r['samples_by_mode'].get('standby', 0)}"
    if r["errors"]:
        line += f" errors={len(r['errors'])}"
    return line


def add_connection_arguments(p):
    """--host, --port, --dbname, --user (libpq's environment as defaults),
    for this and nemesis.py's command lines."""
    p.add_argument("--host", default=os.environ.get("PGHOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("PGPORT", "5432")))
    p.add_argument("--dbname", default=os.environ.get("PGDATABASE", "postgres"))
    p.add_argument("--user", default=os.environ.get("PGUSER", "postgres"))


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Torture streampos: concurrent writers and readers, then check every answer and sample.",
    )
    add_connection_arguments(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--seconds", type=float, help="run for this long (default 30)")
    g.add_argument("--commits", type=int, help="run until this many transactions committed")
    p.add_argument("--writers", type=int, default=6)
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--stream", default="torture")
    p.add_argument("--backwards", action="store_true", help="create the stream as a backward stream")
    p.add_argument("--open-stream", action="store_true", help="create the stream open to any writer")
    p.add_argument("--abort-rate", type=float, default=0.1)
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"reader sampling modes, comma-separated (default: {','.join(MODES)}; also: {','.join(THREAD_MODES)})",
    )
    p.add_argument(
        "--scenario",
        default="",
        help=f"comma-separated presets: {', '.join(SCENARIOS)} (see the module's docstring)",
    )
    p.add_argument("--checkpoint-ms", type=int, help="CHECKPOINT about this often (ms)")
    p.add_argument("--fresh-writers", type=float, help="probability of a brand-new instance name (open stream)")
    p.add_argument("--standby-host", default=None, help="the hot standby's host (default: --host)")
    p.add_argument("--standby-port", type=int, help="the hot standby's port (mode standby)")
    p.add_argument(
        "--window", type=int, default=20000, help="IDs below the last frontier most samples count (0: all rows, always)"
    )
    p.add_argument("--verbose", "-v", action="store_true", help="print the seed and samples per mode")
    a = p.parse_args(argv)
    modes = tuple(m for m in a.modes.split(",") if m)
    unknown = set(modes) - set(ALL_MODES)
    if unknown:
        p.error(f"unknown modes: {sorted(unknown)}")
    options = {"modes": modes, "writers": a.writers, "instances": a.instances}
    if a.checkpoint_ms:
        options["checkpoint_ms"] = a.checkpoint_ms
    if a.fresh_writers:
        options["fresh_writers"] = a.fresh_writers
    if a.open_stream:
        options["open_stream"] = True
    try:
        options = scenario_options([x for x in a.scenario.split(",") if x], options)
    except ValueError as e:
        p.error(str(e))
    conninfo = dict(host=a.host, port=a.port, dbname=a.dbname, user=a.user)
    if "standby" in options["modes"]:
        if not a.standby_port:
            p.error("mode standby needs --standby-port")
        options["standby"] = dict(conninfo, host=a.standby_host or a.host, port=a.standby_port)
    try:
        result = run(
            conninfo,
            a.stream,
            seconds=a.seconds,
            commits=a.commits,
            readers=a.readers,
            abort_rate=a.abort_rate,
            seed=a.seed,
            backwards=a.backwards,
            window=a.window or None,
            **options,
        )
    except ValueError as e:
        p.error(str(e))
    print(summary_line(result), flush=True)
    for line in result["errors"][:10]:
        print(f"  error: {line}")
    for line in result.get("violation_details", []):
        print(f"  violation: {line}")
    for line in result.get("regression_details", []):
        print(f"  regression: {line}")
    for line in result.get("contract_details", []):
        print(f"  contract: {line}")
    if result.get("lost"):
        print(f"  lost committed IDs: {result['lost'][:20]}")
    if result.get("extra"):
        print(f"  rows never acknowledged: {result['extra'][:20]}")
    if a.verbose:
        print(f"  seed={result['seed']} samples by mode: {result['samples_by_mode']}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
