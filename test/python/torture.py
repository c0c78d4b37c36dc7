#!/usr/bin/env python3
"""Torture harness for streampos: many writers, many readers, one stream.

    python3 test/python/torture.py --host 127.0.0.1 --port 54330 --dbname D \\
        [--seconds 30 | --commits 100000] [--writers 6] [--instances 3] \\
        [--readers 4] [--stream torture] [--backwards] [--modes rc,rr,...]

Writers (one thread and one connection each, spread over ``--instances``
instance names) run transactions that allocate 1-5 IDs with
``streampos.next_ids``, insert one row per ID, sleep 0-5 ms inside the
transaction, and roll back about 10 % of the time. Some transactions insert
their rows in released savepoints (rows carrying subtransaction xids; 1 % use
70 savepoints, which overflows every snapshot's subxid cache), and some first
allocate IDs in a savepoint they roll back (a gap that stays in flight until
the transaction ends). An ID counts as committed only once COMMIT returned.

Readers sample positions, and the rows at or below them, in several ways:

``rc``          READ COMMITTED: ``frontier()``, then the rows in a later statement
``rr``          REPEATABLE READ: the snapshot is taken, a few ms pass, then
                ``frontier()`` and the rows, all in that one snapshot
``stmt_filter`` one statement: ``frontier()`` in the target list and in the
                aggregate's ``FILTER (WHERE id <= frontier())``
``stmt_cte``    one statement: the frontier computed once (a MATERIALIZED CTE)
                and the rows at or below it
``token``       REPEATABLE READ: ``current_token()``, then for each writer
                ``instance_pos(token, writer)`` and that writer's rows at or
                below it (plus the token's minimum and all rows below it,
                recorded as ``token_min``)
``cursor``      a server-side cursor (psycopg named cursor, 2 rows a fetch,
                writers committing and aborting between fetches) over the rows
                at or below ``frontier()``, with ``frontier()`` in its target
                list: every row must carry the same frontier (one answer per
                portal and snapshot), and the sample is what the cursor saw
``imported``    REPEATABLE READ snapshot exported by one session (which reads
                ``frontier()``), imported by a second session a few ms later
                (which reads ``frontier()`` and the rows): the importer must
                not answer less than the exporter did for the same snapshot

A sample is (position, number of rows seen, sum of their IDs); one in
eight counts every row, the others only the rows within ``--window`` IDs
(default 20000) below the reader's previous frontier. Once the
writers have stopped and every transaction has ended, each sample is checked
against the final table: if the table has a row with an ID at or below the
sample's position (for ``token`` samples: of that writer) that the sample did
not see, that is a *violation* of "a reader never misses a row". Every
reader's successive samples are taken with later snapshots, so its positions
must never go down: a decrease is a *regression*. Finally the frontier must
reach ``max_allocated`` (which must equal the sequence's value), nothing may
be left in flight, and the table must hold exactly the committed rows.

For a backward stream (``--backwards``) IDs are negative and "at or below"
means ``id >= position``; samples are stored in the internal, positive
numbering.

Prints one line::

    torture: commits=N aborts=N samples=N violations=N frontier=F max_allocated=M seconds=S ...

and exits non-zero on any violation, regression, lost or extra row, error,
or a frontier that did not reach max_allocated.

Importable: ``run(conninfo_kwargs, stream, seconds=..., commits=..., ...)``
returns a dict (see ``run``); ``verify`` and ``recheck_samples`` check a
result again later, e.g. after a server restart.
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
MODES = ("rc", "rr", "stmt_filter", "stmt_cte", "token", "cursor", "imported")


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


def setup_stream(conn, stream, table, names, backwards=False):
    """Create the stream and its table, or reuse them. Returns (the IDs
    already in the table, whether the stream is backward)."""
    conn.execute("CREATE EXTENSION IF NOT EXISTS streampos")
    exists = conn.execute(
        "SELECT writers, backwards FROM streampos.streams WHERE stream_name = %s", (stream,)
    ).fetchone()
    if exists is None:
        conn.execute(
            "SELECT streampos.create_stream(%s, backwards => %s, writers => %s::text[])",
            (stream, backwards, names),
        )
    else:
        backwards = exists[1]
        if exists[0] is not None and not set(names) <= set(exists[0]):
            conn.execute(
                "SELECT streampos.set_writers(%s, %s::text[])",
                (stream, sorted(set(exists[0]) | set(names))),
            )
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
    return initial, backwards


def sequence_value(conn, stream):
    """The stream's last handed-out ID according to its sequence, in the
    stream's external numbering (negative for a backward stream)."""
    seq, backwards = conn.execute(
        "SELECT seq::text, backwards FROM streampos.streams WHERE stream_name = %s", (stream,)
    ).fetchone()
    last, called = conn.execute(f"SELECT last_value, is_called FROM {seq}").fetchone()
    value = last if called else last - 1
    return -value if backwards else value


# --------------------------------------------------------------- the load


class _State:
    def __init__(self, names, commit_budget):
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.commits = 0
        self.aborts = 0
        self.commit_budget = commit_budget
        self.committed = {n: [] for n in names}  # instance -> IDs acknowledged by COMMIT
        self.uncertain = {n: [] for n in names}  # COMMIT sent, connection lost before the answer
        # (mode, instance or None, position, count, sum, reader, seq, window base);
        # positions, sums and bases in internal numbering
        self.samples = []
        self.errors = []  # unexpected exceptions (text)
        self.disconnects = 0
        self.writers_alive = 0


def _writer(conninfo, st, stream, table, instance, seed, abort_rate, tolerate):
    rng = random.Random(seed)
    t = sql.Identifier(table)
    insert_many = sql.SQL(
        "INSERT INTO {} (id, instance_name, payload) SELECT i, %s, %s || i FROM unnest(%s::bigint[]) i"
    ).format(t)
    insert_one = sql.SQL("INSERT INTO {} (id, instance_name, payload) VALUES (%s, %s, %s)").format(t)
    allocate = "SELECT streampos.next_ids(%s, %s, %s)"
    conn = None
    try:
        conn = connect(conninfo)
        while not st.stop.is_set():
            if st.commit_budget is not None and st.commits >= st.commit_budget:
                break
            sending_commit = None
            try:
                conn.execute("BEGIN")
                if rng.random() < 0.05:
                    # IDs allocated in a rolled-back savepoint: a gap, in
                    # flight until the top-level transaction ends.
                    conn.execute("SAVEPOINT gap")
                    conn.execute(allocate, (stream, instance, rng.randint(1, 3)))
                    conn.execute("ROLLBACK TO SAVEPOINT gap")
                shape = rng.random()
                if shape < 0.01:
                    # More subtransactions than PGPROC caches: every snapshot
                    # taken meanwhile is suboverflowed.
                    ids = conn.execute(allocate, (stream, instance, 70)).fetchone()[0]
                    for k, i in enumerate(ids):
                        conn.execute(f"SAVEPOINT s{k}")
                        conn.execute(insert_one, (i, instance, f"{instance}:{i}"))
                    # (savepoints released implicitly by COMMIT; rolled back by ROLLBACK)
                elif shape < 0.15:
                    ids = conn.execute(allocate, (stream, instance, rng.randint(1, 5))).fetchone()[0]
                    for i in ids:
                        conn.execute("SAVEPOINT r")
                        conn.execute(insert_one, (i, instance, f"{instance}:{i}"))
                        conn.execute("RELEASE SAVEPOINT r")
                else:
                    ids = conn.execute(allocate, (stream, instance, rng.randint(1, 5))).fetchone()[0]
                    conn.execute(insert_many, (instance, f"{instance}:", ids))
                time.sleep(rng.random() * 0.005)
                if rng.random() < abort_rate:
                    conn.execute("ROLLBACK")
                    with st.lock:
                        st.aborts += 1
                else:
                    sending_commit = ids
                    conn.execute("COMMIT")
                    with st.lock:
                        st.commits += 1
                        st.committed[instance].extend(ids)
                    sending_commit = None
            except Exception as e:
                if tolerate and is_disconnect(e):
                    with st.lock:
                        st.disconnects += 1
                        if sending_commit is not None:
                            st.uncertain[instance].extend(sending_commit)
                    return
                raise
    except Exception as e:
        if tolerate and is_disconnect(e):
            with st.lock:
                st.disconnects += 1
            return
        with st.lock:
            st.errors.append(f"writer {instance}: {type(e).__name__}: {e}")
        st.stop.set()
    finally:
        with st.lock:
            st.writers_alive -= 1
        for c in (conn,):
            if c is not None:
                try:
                    c.close()
                except Exception:
                    pass


def _reader(conninfo, st, stream, table, names, reader_ix, seed, tolerate, modes, backwards, window):
    rng = random.Random(seed)
    sign = -1 if backwards else 1
    t = sql.Identifier(table)
    # "at or below the position" in the stream's order, and "above".
    le = sql.SQL(">=" if backwards else "<=")
    gt = sql.SQL("<" if backwards else ">")
    # Every count is over the window (wbase, position]: wbase is 0 (all rows)
    # for every 8th sample, else `window` IDs below the reader's last
    # frontier, which keeps samples cheap on a big table.
    q_rows = sql.SQL("SELECT count(*), sum(id) FROM {t} WHERE id {le} %s AND id {gt} %s").format(t=t, le=le, gt=gt)
    # stmt_filter: rows in (wbase, base] are counted with a constant bound
    # (cheap, same snapshot); above base, frontier() is called per row by the
    # FILTER, as a user writing this form would have it.
    q_filter = sql.SQL(
        "SELECT streampos.frontier(%(s)s) AS f, "
        "(SELECT count(*) FROM {t} WHERE id {le} %(base)s AND id {gt} %(wbase)s) "
        "  + count(*) FILTER (WHERE id {le} streampos.frontier(%(s)s)), "
        "coalesce((SELECT sum(id) FROM {t} WHERE id {le} %(base)s AND id {gt} %(wbase)s), 0) "
        "  + coalesce(sum(id) FILTER (WHERE id {le} streampos.frontier(%(s)s)), 0) "
        "FROM {t} WHERE id {gt} %(base)s"
    ).format(t=t, le=le, gt=gt)
    q_cte = sql.SQL(
        "WITH x AS MATERIALIZED (SELECT streampos.frontier(%(s)s) AS f) "
        "SELECT x.f, (SELECT count(*) FROM {t} WHERE id {le} x.f AND id {gt} %(wbase)s), "
        "(SELECT sum(id) FROM {t} WHERE id {le} x.f AND id {gt} %(wbase)s) FROM x"
    ).format(t=t, le=le, gt=gt)
    q_token = (
        "WITH x AS MATERIALIZED (SELECT streampos.current_token(%s) AS tok) "
        "SELECT x.tok::text, streampos.stream_pos(x.tok), "
        "ARRAY(SELECT streampos.instance_pos(x.tok, n) FROM unnest(%s::text[]) WITH ORDINALITY u(n, o) ORDER BY o) "
        "FROM x"
    )
    q_token_rows = sql.SQL(
        "SELECT w.n, count(r.id), sum(r.id) "
        "FROM unnest(%s::text[], %s::bigint[]) AS w(n, p) "
        "LEFT JOIN {t} r ON r.instance_name = w.n AND r.id {le} w.p AND r.id {gt} %s GROUP BY w.n"
    ).format(t=t, le=le, gt=gt)

    q_cursor = sql.SQL(
        "SELECT id, streampos.frontier(%(s)s) FROM {t} "
        "WHERE id {gt} %(wbase)s AND id {le} streampos.frontier(%(s)s)"
    ).format(t=t, le=le, gt=gt)

    conn = None
    importer = None
    seq = 0
    last_front = 0  # internal numbering
    out = []

    wbase = 0  # internal numbering, exclusive

    def add(mode, inst, pos, count, total):
        nonlocal seq
        seq += 1
        out.append((mode, inst, sign * pos, int(count), sign * int(total or 0), reader_ix, seq, wbase))

    try:
        conn = connect(conninfo)
        if "imported" in modes:
            importer = connect(conninfo)
        modes = list(modes)
        while not st.stop.is_set():
            rng.shuffle(modes)
            for mode in modes:
                if st.stop.is_set():
                    break
                # The cursor fetches 2 rows at a time: over a whole table of
                # hundreds of thousands of rows one sample would take minutes,
                # so it always counts the window (what it tests is the
                # answer across FETCHes, not the table's size).
                full = window is None or last_front <= window or (mode != "cursor" and rng.random() < 0.125)
                wbase = 0 if full else last_front - window
                wb = sign * wbase  # external
                try:
                    if mode == "rc":
                        f = conn.execute("SELECT streampos.frontier(%s)", (stream,)).fetchone()[0]
                        add(mode, None, f, *conn.execute(q_rows, (f, wb)).fetchone())
                    elif mode == "rr":
                        with conn.transaction():
                            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                            conn.execute("SELECT 1")  # the snapshot is taken here
                            time.sleep(rng.random() * 0.003)
                            f = conn.execute("SELECT streampos.frontier(%s)", (stream,)).fetchone()[0]
                            add(mode, None, f, *conn.execute(q_rows, (f, wb)).fetchone())
                    elif mode == "stmt_filter":
                        base = sign * max(wbase, last_front - rng.randint(0, 300))
                        f, c, s = conn.execute(q_filter, {"s": stream, "base": base, "wbase": wb}).fetchone()
                        add(mode, None, f, c, s)
                    elif mode == "stmt_cte":
                        f, c, s = conn.execute(q_cte, {"s": stream, "wbase": wb}).fetchone()
                        add(mode, None, f, c, s)
                    elif mode == "cursor":
                        with conn.transaction():
                            with conn.cursor(name=f"torture_{reader_ix}") as cur:
                                cur.itersize = 2
                                cur.execute(q_cursor, {"s": stream, "wbase": wb})
                                answers, count, total = set(), 0, 0
                                while True:
                                    batch = cur.fetchmany(2)
                                    if not batch:
                                        break
                                    for row_id, row_f in batch:
                                        answers.add(row_f)
                                        count += 1
                                        total += row_id
                                    time.sleep(rng.random() * 0.002)
                        if len(answers) > 1:
                            with st.lock:
                                st.errors.append(f"reader {reader_ix}: one cursor, several frontiers {sorted(answers)}")
                            st.stop.set()
                        if not answers:
                            # No row at or below it: ask the same way for the position.
                            f = conn.execute("SELECT streampos.frontier(%s)", (stream,)).fetchone()[0]
                            add(mode, None, f, *conn.execute(q_rows, (f, wb)).fetchone())
                        else:
                            f = answers.pop()
                            add(mode, None, f, count, total)
                    elif mode == "imported":
                        with conn.transaction():
                            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                            snapshot = conn.execute("SELECT pg_export_snapshot()").fetchone()[0]
                            exported_f = conn.execute("SELECT streampos.frontier(%s)", (stream,)).fetchone()[0]
                            add(mode, None, exported_f, *conn.execute(q_rows, (exported_f, wb)).fetchone())
                            time.sleep(rng.random() * 0.003)
                            with importer.transaction():
                                importer.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                                importer.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
                                f = importer.execute("SELECT streampos.frontier(%s)", (stream,)).fetchone()[0]
                                add(mode, None, f, *importer.execute(q_rows, (f, wb)).fetchone())
                    else:  # token
                        with conn.transaction():
                            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                            _tok, f, positions = conn.execute(q_token, (stream, names)).fetchone()
                            add("token_min", None, f, *conn.execute(q_rows, (f, wb)).fetchone())
                            got = {
                                r[0]: (r[1], r[2]) for r in conn.execute(q_token_rows, (names, positions, wb))
                            }
                            for n, p in zip(names, positions):
                                add("token", n, p, *got[n])
                    last_front = sign * f
                except Exception as e:
                    if tolerate and is_disconnect(e):
                        with st.lock:
                            st.disconnects += 1
                        return
                    raise
    except Exception as e:
        if tolerate and is_disconnect(e):
            with st.lock:
                st.disconnects += 1
            return
        with st.lock:
            st.errors.append(f"reader {reader_ix}: {type(e).__name__}: {e}")
        st.stop.set()
    finally:
        with st.lock:
            st.samples.extend(out)
        for c in (conn, importer):
            if c is not None:
                try:
                    c.close()
                except Exception:
                    pass


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


def verify(conninfo, result, progress_timeout=5.0):
    """The end-of-run checks, on a fresh connection. ``result`` is what ``run``
    returned; it is updated and returned. Raises if the server cannot be
    reached (after a crash, call it again once the server is back)."""
    stream, table = result["stream"], result["table"]
    with connect(conninfo) as conn:
        # Progress: once every transaction has ended, nothing is in flight and
        # a fresh snapshot sees frontier = max_allocated.
        deadline = time.monotonic() + progress_timeout
        while True:
            front, maxa = conn.execute(
                "SELECT streampos.frontier(%s), streampos.max_allocated(%s)", (stream, stream)
            ).fetchone()
            in_flight = conn.execute(
                "SELECT count(*) FROM streampos.in_flight(%s)", (stream,)
            ).fetchone()[0]
            if (front == maxa and in_flight == 0) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        result["frontier"] = front
        result["max_allocated"] = maxa
        result["in_flight"] = in_flight
        result["sequence"] = sequence_value(conn, stream)

        table_ids = {
            r[0]: r[1]
            for r in conn.execute(
                sql.SQL("SELECT id, instance_name FROM {}").format(sql.Identifier(table))
            )
        }
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

        by_mode = {}
        violations, details = recheck_samples(
            conn, table, result["sample_list"], by_mode=by_mode, backwards=result["backwards"]
        )
        result["violations"] = violations
        result["violations_by_mode"] = by_mode
        result["violation_details"] = details
    regressions = find_regressions(result["sample_list"])
    result["regressions"] = len(regressions)
    result["regression_details"] = regressions[:20]
    result["verified"] = True
    result["ok"] = (
        not result["errors"]
        and result["violations"] == 0
        and result["regressions"] == 0
        and not result["lost"]
        and not result["extra"]
        and not result["wrong_owner"]
        and front == maxa
        and in_flight == 0
        and maxa == result["sequence"]
    )
    return result


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
):
    """Run the torture load and (unless ``verify_at_end`` is false) its checks.

    ``conninfo``: keyword arguments for ``psycopg.connect`` (host, port,
    dbname, user, ...). Stops after ``seconds``, or once ``commits``
    transactions have committed (then ``max_seconds`` bounds the time), or
    when every writer has gone. With ``tolerate_disconnect`` a lost connection
    ends that thread quietly; an ID whose COMMIT got no answer is *uncertain*:
    it may or may not be in the table. ``backwards`` applies when the stream
    is created (a reused stream keeps its direction). ``modes``: the reader
    sampling modes to use (default all of ``MODES``). ``window``: most
    samples count only the rows within that many IDs below the reader's
    previous frontier (a missed row would be an ID allocated by a
    transaction in flight near the sample, far inside the window); one in
    eight, and all while the stream is shorter, count every row. ``None``:
    always every row.

    Returns a dict: stream, table, backwards, commits, aborts, samples
    (number), samples_by_mode, sample_list, committed / uncertain
    ({instance: [ids]}), initial_ids, disconnects, errors, seconds, and after
    verification: violations, violations_by_mode, violation_details,
    regressions, regression_details, frontier, max_allocated, sequence,
    in_flight, lost, extra, wrong_owner, verified, ok.
    """
    if seconds is None and commits is None:
        seconds = 30
    if commits is not None and max_seconds is None:
        max_seconds = max(600, commits / 50)
    seed = random.randrange(1 << 30) if seed is None else seed
    table = table or table_name_for(stream)
    names = instance_names(instances, instance_prefix)
    with connect(conninfo) as conn:
        initial_ids, backwards = setup_stream(conn, stream, table, names, backwards)

    st = _State(names, commits)
    st.writers_alive = writers
    writer_threads = [
        threading.Thread(
            target=_writer,
            args=(conninfo, st, stream, table, names[w % instances], seed * 7919 + w, abort_rate, tolerate_disconnect),
            name=f"torture-writer-{w}",
            daemon=True,
        )
        for w in range(writers)
    ]
    reader_threads = [
        threading.Thread(
            target=_reader,
            args=(conninfo, st, stream, table, names, r, seed * 104729 + r, tolerate_disconnect, modes, backwards, window),
            name=f"torture-reader-{r}",
            daemon=True,
        )
        for r in range(readers)
    ]
    start = time.monotonic()
    for t in writer_threads + reader_threads:
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
        t.join(60)
    hung = [t.name for t in writer_threads + reader_threads if t.is_alive()]
    if hung:
        st.errors.append(f"threads did not stop: {hung}")
    elapsed = time.monotonic() - start

    result = {
        "stream": stream,
        "table": table,
        "backwards": backwards,
        "seed": seed,
        "commits": st.commits,
        "aborts": st.aborts,
        "samples": len(st.samples),
        "samples_by_mode": {m: sum(1 for s in st.samples if s[0] == m) for m in MODES + ("token_min",)},
        "sample_list": st.samples,
        "committed": st.committed,
        "uncertain": st.uncertain,
        "initial_ids": initial_ids,
        "disconnects": st.disconnects,
        "errors": st.errors,
        "seconds": round(elapsed, 1),
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
        )
    if r.get("violations_by_mode"):
        line += " violations_by_mode=" + ",".join(f"{m}:{n}" for m, n in sorted(r["violations_by_mode"].items()))
    if r["errors"]:
        line += f" errors={len(r['errors'])}"
    return line


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Torture streampos: concurrent writers and readers, then check every sample.",
    )
    p.add_argument("--host", default=os.environ.get("PGHOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("PGPORT", "5432")))
    p.add_argument("--dbname", default=os.environ.get("PGDATABASE", "postgres"))
    p.add_argument("--user", default=os.environ.get("PGUSER", "postgres"))
    g = p.add_mutually_exclusive_group()
    g.add_argument("--seconds", type=float, help="run for this long (default 30)")
    g.add_argument("--commits", type=int, help="run until this many transactions committed")
    p.add_argument("--writers", type=int, default=6)
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--stream", default="torture")
    p.add_argument("--backwards", action="store_true", help="create the stream as a backward stream")
    p.add_argument("--abort-rate", type=float, default=0.1)
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"reader sampling modes, comma-separated (default: {','.join(MODES)})",
    )
    p.add_argument(
        "--window", type=int, default=20000, help="IDs below the last frontier most samples count (0: all rows, always)"
    )
    p.add_argument("--verbose", "-v", action="store_true", help="print the seed and samples per mode")
    a = p.parse_args(argv)
    modes = tuple(m for m in a.modes.split(",") if m)
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes: {sorted(unknown)}")
    conninfo = dict(host=a.host, port=a.port, dbname=a.dbname, user=a.user)
    result = run(
        conninfo,
        a.stream,
        seconds=a.seconds,
        commits=a.commits,
        writers=a.writers,
        instances=a.instances,
        readers=a.readers,
        abort_rate=a.abort_rate,
        seed=a.seed,
        modes=modes,
        backwards=a.backwards,
        window=a.window or None,
    )
    print(summary_line(result), flush=True)
    for line in result["errors"][:10]:
        print(f"  error: {line}")
    for line in result.get("violation_details", []):
        print(f"  violation: {line}")
    for line in result.get("regression_details", []):
        print(f"  regression: {line}")
    if result.get("lost"):
        print(f"  lost committed IDs: {result['lost'][:20]}")
    if result.get("extra"):
        print(f"  rows never acknowledged: {result['extra'][:20]}")
    if a.verbose:
        print(f"  seed={result['seed']} samples by mode: {result['samples_by_mode']}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
