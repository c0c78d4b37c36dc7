#!/usr/bin/env python3
"""A nemesis for the reference-model torture (docs/torture.md, "Nemesis").

    python3 test/python/nemesis.py --port 54391 --pgdata /tmp/n/primary \\
        [--standby-port 54392 --standby-pgdata /tmp/n/standby] \\
        [--seed N] [--steps 40 | --seconds 600] [--phase-seconds 3]

The torture load of torture.py (writers, readers, the model) runs in
phases of a few seconds; during each phase the nemesis takes seeded random
steps (crash and clean restarts, a promotion of a synchronous standby,
prepared transactions across them, holds whose session dies, a session's
holds filled to the limit, set_writers, add_table and dropped tables, an ID
column's type changed, setval / ALTER SEQUENCE forward, consumers
processing, acknowledging, registering and leaving, retention), and
between phases sometimes drops the stream and creates it again (a new
history). After each phase: torture.verify of the phase, the model's
check_contract over every answer of the history so far (so nothing goes
back across phases, restarts and promotions), every sample of the history
rechecked against the rows now there (no ID handed out twice), the
nemesis's own samples of its rows, every consumer exactly once, and every
row retention deleted acknowledged by every registered consumer. Every SQL
error a step gets must be one the contract lists for that step.

A seed replays the same schedule of steps and the same random choices
(not the scheduling of the threads, so the counts differ from run to run).
"""

import argparse
import os
import random
import shutil
import sys
import threading
import time

import psycopg
from psycopg import sql

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torture  # noqa: E402
# initdb, pg_ctl and pg_basebackup refuse root: run as postgres, no Rust
# backtraces in the server's messages (cluster.py's runner).
from cluster import _run as run_tool  # noqa: E402
from torture import ContractViolation, connect  # noqa: E402

NEMESIS_WRITER = "nemesis_w"
EXTRA_WRITER = "nemesis_x"
READER_MODES = ("rc", "rr", "stmt_cte", "token", "cursor")
# Steps taken while the load runs.
PHASE_STEPS = (
    "prepared_hold",
    "hold_dies",
    "holds_full",
    "set_writers",
    "add_drop_table",
    "column_type",
    "setval",
    "consume",
    "prepared_consumer",
    "consumer_leaves",
    "retention",
)
# At most one per phase, last: the load's sessions die with the server.
RESTART_STEPS = (
    "crash",
    "clean_restart",
    "prepared_across_crash",
    "prepared_across_clean_restart",
    "prepared_consumer_across_crash",
    "promote",
)
# Between phases, with no load.
BETWEEN_STEPS = ("drop_create", "drop_blocked_by_consumer")
# Steps that find a known defect of the extension, skipped unless asked
# for (docs/torture.md, "Nemesis"). None now: a prepared transaction that
# outlived a start sent every writer's position back until 0.4.0 recorded
# the holds given out at PREPARE (finding 1), and a standby's
# hot_standby_feedback did the same (finding 2); both fixed.
KNOWN_FINDINGS = ()
SLOT = "nemesis_standby"


class Nemesis:
    def __init__(self, conninfo, pgdata=None, pg_bin=None, stream="nemesis", seed=None, phase_seconds=3.0,
                 writers=4, readers=2, log=print, restarts=True, exclude=(), standby=None, feedback=False):
        """``standby``: (data directory, port) for a synchronous hot standby
        the nemesis makes (pg_basebackup, with hot_standby_feedback =
        ``feedback``) and promotes; without it, no promotion."""
        self.conninfo = dict(conninfo)
        self.pgdata = pgdata
        self.pg_bin = pg_bin or os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin")
        self.stream = stream
        self.seed = random.randrange(1 << 30) if seed is None else seed
        self.rng = random.Random(self.seed)
        self.phase_seconds = phase_seconds
        self.writers = writers
        self.readers = readers
        self.log = log
        self.restarts = restarts and pgdata is not None
        self.standby = standby if self.restarts else None
        self.feedback = feedback
        self.exclude = set(exclude) | (set() if self.standby else {"promote"})
        self.step_no = 0
        self.lost_range_fallbacks = 0
        self.current = "setup"
        self.phase_no = 0
        self.histories = 0
        self.promotions = 0
        self.counts = {}
        self.admin = None
        self.last_front = 0

    # ------------------------------------------------------------ plumbing

    def say(self, text):
        self.log(f"nemesis seed={self.seed} step={self.step_no} history={self.histories} {text}")

    def fail(self, text):
        raise ContractViolation(f"seed={self.seed} step={self.step_no} ({self.current}): {text}")

    def db(self):
        return connect(self.conninfo)

    def expect(self, conn, query, params=None, allowed=()):
        """Run ``query``; an error whose SQLSTATE is in ``allowed`` is returned
        (as the exception), any other error is a violation: the contract lists
        every error a step may get."""
        try:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description is not None else []
        except psycopg.Error as e:
            if e.sqlstate in allowed:
                return e
            self.fail(f"unlisted error {e.sqlstate} ({type(e).__name__}: {e}) from {query!r} {params!r}")

    def expect_error(self, conn, query, params, sqlstate):
        got = self.expect(conn, query, params, allowed=(sqlstate,))
        if not isinstance(got, psycopg.Error):
            self.fail(f"{query!r} {params!r} answered {got!r}, the contract says {sqlstate}")

    def pg_ctl(self, pgdata, *args, check=True):
        run_tool([os.path.join(self.pg_bin, "pg_ctl"), "-D", pgdata, *args], timeout=180, check=check)

    def wait_ready(self, writable=True):
        deadline = time.monotonic() + 120
        while True:
            try:
                with self.db() as c:
                    if not writable or not c.execute("SELECT pg_is_in_recovery()").fetchone()[0]:
                        return
            except psycopg.OperationalError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {self.conninfo['port']} did not come up")
            time.sleep(0.1)

    def close_admin(self):
        if self.admin is not None:
            self.admin.close()
            self.admin = None

    def restart(self, mode):
        if self.admin is not None:
            self.nsample()  # the last answer before the stop
        self.close_admin()
        self.pg_ctl(self.pgdata, "-m", mode, "-w", "-t", "120", "stop")
        self.pg_ctl(self.pgdata, "-l", os.path.join(self.pgdata, "server.log"), "-w", "-t", "120", "start")
        self.wait_ready()
        self.admin = self.db()

    def make_standby(self):
        """A fresh hot standby of the primary, then synchronous: a promotion
        keeps every commit and every ID the primary reported finished
        (contract, "Exactness": durable where a commit is)."""
        pgdata, port = self.standby
        c = self.admin
        # Commits must not wait for a standby that is not there yet.
        c.execute("ALTER SYSTEM SET synchronous_standby_names = ''")
        c.execute("SELECT pg_reload_conf()")
        if os.path.exists(os.path.join(pgdata, "postmaster.pid")):
            # Not checked: already gone (a crashed old primary).
            self.pg_ctl(pgdata, "-m", "immediate", "-w", "-t", "60", "stop", check=False)
        shutil.rmtree(pgdata, ignore_errors=True)
        c.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                  (SLOT,))
        run_tool([os.path.join(self.pg_bin, "pg_basebackup"), "-h", self.conninfo["host"],
                  "-p", str(self.conninfo["port"]), "-U", self.conninfo.get("user", "postgres"), "-D", pgdata,
                  "-R", "-X", "stream", "-c", "fast", "-C", "-S", SLOT, "--no-sync"], timeout=180)
        # Read after postgresql.conf and the copied auto.conf; the standby
        # keeps synchronous_standby_names empty for when it is promoted.
        with open(os.path.join(pgdata, "postgresql.auto.conf"), "a") as f:
            f.write(f"port = {port}\nsynchronous_standby_names = ''\nhot_standby = on\n"
                    f"hot_standby_feedback = {'on' if self.feedback else 'off'}\n")
        try:
            os.remove(os.path.join(pgdata, "server.log"))
        except FileNotFoundError:
            pass
        self.pg_ctl(pgdata, "-l", os.path.join(pgdata, "server.log"), "-w", "-t", "120", "start")
        c.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        c.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 60
        while not c.execute("SELECT 1 FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = 'sync'"
                            ).fetchone():
            if time.monotonic() > deadline:
                raise RuntimeError("the standby did not become synchronous")
            time.sleep(0.1)

    # ------------------------------------------------------------ history

    def new_history(self):
        """Create the stream, its torture table, the nemesis's table (rows of
        held IDs), the archive of rows retention deleted, and two consumers."""
        self.histories += 1
        s = self.stream
        self.table = torture.table_name_for(s)
        self.ntable = f"{s}_n"
        self.archive = f"{s}_archive"
        self.processed = f"{s}_processed"
        self.names = torture.instance_names(self.writers)
        c = self.admin
        for t in (self.table, self.ntable, self.archive, self.processed):
            c.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(t)))
        torture.setup_stream(c, s, self.table, self.names)
        c.execute("SELECT streampos.set_writers(%s, %s::text[])", (s, self.names + [NEMESIS_WRITER]))
        c.execute(sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, instance_name text NOT NULL, payload text)")
                  .format(sql.Identifier(self.ntable)))
        c.execute("SELECT streampos.add_table(%s, %s::regclass, 'id', 'instance_name')", (s, self.ntable))
        c.execute(sql.SQL("CREATE TABLE {} (id bigint, instance_name text)").format(sql.Identifier(self.archive)))
        # No key: a row processed twice must show, not fail the consumer.
        c.execute(sql.SQL("CREATE TABLE {} (consumer text, tbl text, id bigint, instance_name text)")
                  .format(sql.Identifier(self.processed)))
        self.txns, self.answers, self.samples = [], [], []
        self.nsamples = []  # (frontier, ids of the nemesis's rows at or below it) in one statement
        self.consumers = {}  # name -> registration position (text)
        self.last_front = 0
        for _ in range(2):
            self.register_consumer()

    def consumer_name(self):
        n = self.counts.get("consumer_names", 0)
        self.counts["consumer_names"] = n + 1
        return f"nem_c{n}"

    def register_consumer(self, since=None):
        """Register a new consumer, at ``since`` if given: 22023 is then
        allowed (past the snapshot or below the registration floor) and the
        consumer registers at the current token instead."""
        name = self.consumer_name()
        got = None
        if since is not None:
            got = self.expect(self.admin, "SELECT streampos.register_consumer(%s, %s, %s)::text",
                              (self.stream, name, since), allowed=("22023",))
        if got is None or isinstance(got, psycopg.Error):
            got = self.expect(self.admin, "SELECT streampos.register_consumer(%s, %s)::text", (self.stream, name))
        [(pos,)] = got
        self.consumers[name] = pos
        return name

    def nsample(self, conn=None):
        """Frontier, current token and the nemesis's rows at or below the
        frontier (its table and the archive retention moves rows to, in one
        transaction), in one statement: checked against the rows at the end
        (invariant 1); neither the frontier nor any writer's token position
        below an earlier sample's (invariant 3: each sample is a later
        snapshot, across restarts and promotions too)."""
        c = conn or self.admin
        q = sql.SQL(
            "WITH f AS MATERIALIZED (SELECT streampos.frontier(%s) AS f, streampos.current_token(%s)::text AS tok) "
            "SELECT f.f, f.tok, ARRAY(SELECT id FROM {} WHERE id <= f.f UNION ALL SELECT id FROM {} WHERE id <= f.f), "
            "(SELECT json_object_agg(instance_name, instance_id) FROM streampos.instances) FROM f"
        ).format(sql.Identifier(self.ntable), sql.Identifier(self.archive))
        [(f, tok, ids, iids)] = self.expect(c, q, (self.stream, self.stream))
        sp, entries = torture.parse_token(tok)
        # A writer the token does not list is at its minimum. Only the
        # writers that stay configured: one set_writers removed leaves it.
        positions = {w: entries.get((iids or {}).get(w), sp) for w in self.names + [NEMESIS_WRITER]}
        if self.nsamples:
            pf, ptok, ppos = self.nsamples[-1][0], self.nsamples[-1][2], self.nsamples[-1][3]
            back = [f"{w} {ppos[w]} -> {p}" for w, p in positions.items() if p < ppos[w]]
            # After a promotion, writer positions the old primary reported
            # past what the new one had may be in its lost range: the
            # contract says a token there is 72000 (resynchronise), and
            # the new server never reports a position in it.
            if back and f >= pf and self.in_lost_range(c, ptok):
                self.lost_range_fallbacks += 1
                back = []
            if f < pf or back:
                self.fail(f"went back (invariant 3): frontier {pf} -> {f}, token {ptok} -> {tok}"
                          + (f", writers {', '.join(back)}" if back else ""))
        self.nsamples.append((f, set(ids), tok, positions))
        return f

    def in_lost_range(self, conn, token):
        """Whether ``updates`` refuses ``token`` as in the stream's lost
        range (72000)."""
        got = self.expect(conn, "SELECT streampos.updates(%s, %s::streampos.multi_writer_token, 1, 0)",
                          (self.stream, token), allowed=("72000",))
        return isinstance(got, psycopg.Error)

    # ------------------------------------------------------------ steps

    def step(self, name):
        self.step_no += 1
        self.counts[name] = self.counts.get(name, 0) + 1
        self.current = name
        detail = getattr(self, "do_" + name)() or ""
        self.say(f"{name} {detail}".rstrip())

    def hold(self, conn, n):
        [(ids,)] = self.expect(conn, "SELECT streampos.hold_ids(%s, %s, %s)", (self.stream, NEMESIS_WRITER, n))
        return ids

    def write_rows(self, conn, ids, prepare=None):
        conn.execute("BEGIN")
        conn.execute(
            sql.SQL("INSERT INTO {} SELECT i, %s, 'held' FROM unnest(%s::bigint[]) i").format(
                sql.Identifier(self.ntable)), (NEMESIS_WRITER, ids))
        if prepare:
            conn.execute(f"PREPARE TRANSACTION '{prepare}'")
        else:
            conn.execute("COMMIT")

    def check_held_not_passed(self, ids, why):
        f = self.nsample()
        if f >= min(ids):
            self.fail(f"frontier {f} passed held ID {min(ids)} ({why})")

    def gid(self):
        return f"nem_{self.seed}_{self.step_no}"

    def do_prepared_hold(self, restart=None):
        """Rows of held IDs in a prepared transaction: in flight until
        released after COMMIT PREPARED (Holds); across a start, in flight
        while the prepared transaction lives (invariant 3: "an ID for which
        a row may still commit is in flight until it no longer can")."""
        h, p = self.db(), self.db()
        ids = self.hold(h, self.rng.randint(1, 3))
        gid = self.gid()
        self.write_rows(p, ids, prepare=gid)
        p.close()
        self.check_held_not_passed(ids, "prepared, not released")
        # A transaction that takes a hold cannot be prepared (0A000).
        q = self.db()
        q.execute("BEGIN")
        self.hold(q, 1)
        self.expect_error(q, "PREPARE TRANSACTION 'nem_refused'", None, "0A000")
        q.close()
        if restart:
            h.close()  # the hold's session dies with the server anyway
            self.restart(restart)
            self.check_held_not_passed(ids, f"prepared across a {restart} restart")
            self.expect(self.admin, f"COMMIT PREPARED '{gid}'")
        else:
            self.expect(self.admin, f"COMMIT PREPARED '{gid}'")
            self.check_held_not_passed(ids, "committed, not yet released")
            self.expect(h, "SELECT streampos.release_ids(%s, %s::bigint[])", (self.stream, ids))
            h.close()
        self.nsample()
        return f"ids={ids} restart={restart}"

    def do_prepared_across_crash(self):
        return self.do_prepared_hold("immediate")

    def do_prepared_across_clean_restart(self):
        return self.do_prepared_hold("fast")

    def do_hold_dies(self):
        """A session with holds is terminated: held until the worker
        releases them; rows written before are then below the frontier
        (checked at the end of the phase: nothing missed)."""
        h, w = self.db(), self.db()
        ids = self.hold(h, self.rng.randint(1, 4))
        self.write_rows(w, ids[: self.rng.randint(0, len(ids))])
        w.close()
        self.check_held_not_passed(ids, "held by a live session")
        [(pid,)] = h.execute("SELECT pg_backend_pid()").fetchall()
        self.admin.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
        h.close()
        self.nsample()
        return f"ids={ids}"

    def do_holds_full(self):
        """The session's holds filled to streampos.max_held_per_session: one
        more is 53400 and takes nothing (Limits; design.md, "Tables of fixed
        size"); releasing them all leaves nothing held, and an array that is
        no hold of the session any more is 22023."""
        h = self.db()
        [(limit,)] = h.execute("SELECT current_setting('streampos.max_held_per_session')::int").fetchall()
        arrays = [self.hold(h, 1) for _ in range(limit)]
        self.expect_error(h, "SELECT streampos.hold_ids(%s, %s, 1)", (self.stream, NEMESIS_WRITER), "53400")
        [(held,)] = h.execute("SELECT coalesce(sum(ids), 0) FROM streampos.in_flight(%s) WHERE pid = pg_backend_pid()",
                              (self.stream,)).fetchall()
        if held != limit:
            self.fail(f"after the refused hold, in_flight lists {held} IDs of the session, not {limit}")
        self.check_held_not_passed([a[0] for a in arrays], "held")
        h.execute("BEGIN")
        for a in arrays:
            self.expect(h, "SELECT streampos.release_ids(%s, %s::bigint[])", (self.stream, a))
        h.execute("COMMIT")
        self.expect_error(h, "SELECT streampos.release_ids(%s, %s::bigint[])", (self.stream, arrays[0]), "22023")
        h.close()
        self.nsample()
        return f"limit={limit}"

    def do_set_writers(self):
        """A writer added while the load runs, then removed: the load's
        writers never notice; the removed one is refused (55000)."""
        c = self.admin
        base = self.names + [NEMESIS_WRITER]
        self.expect(c, "SELECT streampos.set_writers(%s, %s::text[])", (self.stream, base + [EXTRA_WRITER]))
        w = self.db()
        w.execute("BEGIN")
        [(i,)] = self.expect(w, "SELECT streampos.next_id(%s, %s)", (self.stream, EXTRA_WRITER))
        w.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s, 'x')").format(sql.Identifier(self.ntable)),
                  (i, EXTRA_WRITER))
        w.execute("COMMIT")
        self.expect(c, "SELECT streampos.set_writers(%s, %s::text[])", (self.stream, base))
        w.execute("BEGIN")
        self.expect_error(w, "SELECT streampos.next_id(%s, %s)", (self.stream, EXTRA_WRITER), "55000")
        w.execute("ROLLBACK")
        w.close()
        self.nsample()
        return f"id={i}"

    def _updates_tables(self, conn):
        """The tables updates() answers for (one header each)."""
        [(ans,)] = self.expect(conn, "SELECT streampos.updates(%s, since => '0', max_rows => 1)", (self.stream,))
        data, names, i = ans["data"], [], 0
        while i < len(data):
            names.append(data[i][0].split(".")[-1])
            i += 1 + data[i][2]
        return names

    def _extra_table(self):
        n = self.counts.get("extra_names", 0)
        self.counts["extra_names"] = n + 1
        t = f"{self.stream}_x{n}"
        c = self.admin
        c.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(t)))
        c.execute(sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, instance_name text)").format(sql.Identifier(t)))
        self.expect(c, "SELECT streampos.add_table(%s, %s::regclass, 'id', 'instance_name')", (self.stream, t))
        c.execute("BEGIN")
        c.execute(sql.SQL("INSERT INTO {} VALUES (streampos.next_id(%s, %s), %s)").format(sql.Identifier(t)),
                  (self.stream, NEMESIS_WRITER, NEMESIS_WRITER))
        c.execute("COMMIT")
        return t

    def do_add_drop_table(self):
        """add_table while the load runs, then DROP TABLE: updates() reads
        it, then goes on without it (Columns; Untrusted objects)."""
        t = self._extra_table()
        if t not in self._updates_tables(self.admin):
            self.fail(f"updates() does not list the added table {t}")
        self.admin.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(t)))
        names = self._updates_tables(self.admin)
        if t in names or self.table not in names:
            self.fail(f"after DROP TABLE {t}, updates() lists {names}")
        return t

    def do_column_type(self):
        """An ID column altered to a type that is not an integer: the table
        is skipped by updates(), the stream's other tables go on (Columns)."""
        t = self._extra_table()
        self.admin.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN id TYPE numeric").format(sql.Identifier(t)))
        names = self._updates_tables(self.admin)
        if t in names or self.table not in names or self.ntable not in names:
            self.fail(f"after {t}.id became numeric, updates() lists {names}")
        self.admin.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(t)))
        return t

    def do_setval(self):
        """The owner moves the sequence forward (setval or ALTER SEQUENCE
        RESTART) under load: the next ID is past it, and nothing goes back
        (checked by the model)."""
        c = self.admin
        [(seq,)] = c.execute("SELECT seq::regclass::text FROM streampos.streams WHERE stream_name = %s",
                             (self.stream,)).fetchall()
        [(last,)] = c.execute(f"SELECT last_value FROM {seq}").fetchall()
        # Far enough ahead that the load cannot pass it before it lands
        # (that would be the sequence going backwards, 55000).
        target = last + 100000
        how = self.rng.choice(("setval", "restart"))
        if how == "setval":
            self.expect(c, "SELECT setval(%s::regclass, %s)", (seq, target))
        else:
            self.expect(c, f"ALTER SEQUENCE {seq} RESTART WITH {target + 1}")
        c.execute("BEGIN")
        [(i,)] = self.expect(c, "SELECT streampos.next_id(%s, %s)", (self.stream, NEMESIS_WRITER))
        c.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s, 'setval')").format(sql.Identifier(self.ntable)),
                  (i, NEMESIS_WRITER))
        c.execute("COMMIT")
        if i <= target:
            self.fail(f"after {how} to {target}, next_id handed out {i}")
        self.nsample()
        return f"{how} {last}->{target} next={i}"

    def process_batch(self, c, name, rows=None):
        """In c's open transaction: one updates() batch of the consumer,
        recorded as processed, and acknowledged (exactly once: Consumers)."""
        [(ans,)] = self.expect(c, "SELECT streampos.updates(%s, consumer => %s, max_rows => %s)",
                               (self.stream, name, rows or self.rng.choice((50, 500, 2000))))
        data, i, got = ans["data"], 0, []
        while i < len(data):
            # Header: qualified table name, position, rows, columns, column names.
            tbl, _pos, n, ncols = data[i][:4]
            tbl, cols = tbl.split(".")[-1], data[i][4: 4 + ncols]
            ix, iw = cols.index("id"), cols.index("instance_name")
            got += [(tbl, r[ix], r[iw]) for r in data[i + 1: i + 1 + n]]
            i += 1 + n
        if got:
            c.execute(
                sql.SQL("INSERT INTO {} SELECT %s, t, i, w FROM unnest(%s::text[], %s::bigint[], %s::text[]) "
                        "AS x(t, i, w)").format(sql.Identifier(self.processed)),
                (name, [g[0] for g in got], [g[1] for g in got], [g[2] for g in got]))
        self.expect(c, "SELECT streampos.ack(%s, %s, %s::streampos.multi_writer_token)",
                    (self.stream, name, ans["token"]))
        return len(got), ans["limited"]

    def do_consume(self, name=None):
        """A consumer processes rows and acknowledges them in one
        transaction (sometimes rolled back): exactly once (Consumers)."""
        name = name or self.rng.choice(sorted(self.consumers))
        c = self.db()
        done = 0
        for _ in range(self.rng.randint(1, 4)):
            c.execute("BEGIN")
            n, _ = self.process_batch(c, name)
            if self.rng.random() < 0.2:
                c.execute("ROLLBACK")
            else:
                c.execute("COMMIT")
                done += n
        c.close()
        return f"{name} rows={done}"

    def catch_up(self, name, batches=20):
        """The consumer processes batches until updates() is not limited."""
        c = self.db()
        for _ in range(batches):
            c.execute("BEGIN")
            _, limited = self.process_batch(c, name, rows=2000)
            c.execute("COMMIT")
            if not limited:
                break
        c.close()

    def do_prepared_consumer(self, restart=None):
        """A consumer's processing and acknowledgement, or a registration,
        in a prepared transaction (across a crash with ``restart``), then
        COMMIT or ROLLBACK PREPARED: exactly once either way."""
        what = self.rng.choice(("ack", "register"))
        commit = self.rng.random() < 0.7
        gid = self.gid()
        c = self.db()
        c.execute("BEGIN")
        if what == "ack":
            name = self.rng.choice(sorted(self.consumers))
            n, _ = self.process_batch(c, name)
        else:
            name = self.consumer_name()
            [(pos,)] = self.expect(c, "SELECT streampos.register_consumer(%s, %s)::text", (self.stream, name))
            n = 0
        c.execute(f"PREPARE TRANSACTION '{gid}'")
        c.close()
        if restart:
            self.restart(restart)
        self.expect(self.admin, f"{'COMMIT' if commit else 'ROLLBACK'} PREPARED '{gid}'")
        if what == "register" and commit:
            self.consumers[name] = pos
        return f"{what} {name} rows={n} {'committed' if commit else 'rolled back'} restart={restart}"

    def do_prepared_consumer_across_crash(self):
        return self.do_prepared_consumer("immediate")

    def do_consumer_leaves(self):
        """A consumer unregisters (its acknowledged position raises the
        registration floor) and a new one registers: at the current token,
        or at '0' or safe_to_delete, which are 22023 below the floor (rows
        there may be deleted already)."""
        name = self.rng.choice(sorted(self.consumers))
        [(was,)] = self.expect(self.admin, "SELECT streampos.unregister_consumer(%s, %s)", (self.stream, name))
        if not was:
            self.fail(f"unregister_consumer({name}) says it was not registered")
        del self.consumers[name]
        how = self.rng.choice(("current", "zero", "safe"))
        since = None
        if how == "zero":
            since = "0"
        elif how == "safe":
            [(since,)] = self.admin.execute("SELECT streampos.safe_to_delete(%s)::text", (self.stream,)).fetchall()
        new = self.register_consumer(since)
        return f"{name} left, {new} at {self.consumers[new]} (asked {how} {since})"

    def do_retention(self):
        """Every consumer catches up now and then; rows of the nemesis's
        table at or below safe_to_delete are deleted (moved to the
        archive): every registered consumer must have processed each, or
        have registered after it (Consumers)."""
        c = self.admin
        if self.rng.random() < 0.5:
            for name in sorted(self.consumers):
                self.catch_up(name)
        [(safe,)] = c.execute("SELECT streampos.safe_to_delete(%s)::text", (self.stream,)).fetchall()
        if safe is None:
            self.fail("safe_to_delete is NULL with consumers registered")
        c.execute("BEGIN")
        deleted = c.execute(
            sql.SQL("WITH d AS (DELETE FROM {} WHERE id <= streampos.instance_pos(%s::streampos.multi_writer_token, "
                    "instance_name) RETURNING id, instance_name) INSERT INTO {} SELECT * FROM d RETURNING id, "
                    "instance_name").format(sql.Identifier(self.ntable), sql.Identifier(self.archive)),
            (safe,)).fetchall()
        c.execute("COMMIT")
        for name, start in self.consumers.items():
            missing = c.execute(
                sql.SQL("SELECT a.id FROM unnest(%s::bigint[], %s::text[]) a(id, w) "
                        "WHERE a.id > streampos.instance_pos(%s::streampos.multi_writer_token, a.w) "
                        "AND NOT EXISTS (SELECT 1 FROM {} p WHERE p.consumer = %s AND p.tbl = %s AND p.id = a.id)")
                .format(sql.Identifier(self.processed)),
                ([d[0] for d in deleted], [d[1] for d in deleted], start, name, self.ntable)).fetchall()
            if missing:
                self.fail(f"retention below safe_to_delete {safe} deleted rows {missing[:10]} consumer {name} "
                          f"never processed")
        self.counts["rows_deleted"] = self.counts.get("rows_deleted", 0) + len(deleted)
        return f"safe={safe} deleted={len(deleted)}"

    def do_drop_blocked_by_consumer(self):
        """drop_stream waits at most lock_timeout for a consumer's open
        transaction, then 55P03, and leaves the stream as it was."""
        name = sorted(self.consumers)[0]
        c = self.db()
        c.execute("BEGIN")
        [(tok,)] = c.execute("SELECT streampos.current_token(%s)::text", (self.stream,)).fetchall()
        self.expect(c, "SELECT streampos.ack(%s, %s, %s::streampos.multi_writer_token)", (self.stream, name, tok))
        d = self.db()
        d.execute("SET lock_timeout = '300ms'")
        self.expect_error(d, "SELECT streampos.drop_stream(%s)", (self.stream,), "55P03")
        c.execute("ROLLBACK")
        c.close()
        d.close()
        self.nsample()
        return name

    def do_drop_create(self):
        """drop_stream / create_stream of the same name: the old name is
        unknown (42704) in between; a new history starts."""
        c = self.admin
        self.expect(c, "SELECT streampos.drop_stream(%s)", (self.stream,))
        self.expect_error(c, "SELECT streampos.frontier(%s)", (self.stream,), "42704")
        self.expect_error(c, "SELECT streampos.safe_to_delete(%s)", (self.stream,), "42704")
        self.new_history()
        return "new history"

    def do_crash(self):
        self.restart("immediate")
        self.nsample()

    def do_clean_restart(self):
        self.restart("fast")
        self.nsample()

    def do_promote(self):
        """The primary is lost (immediate stop) and its synchronous standby
        promoted; the history goes on there: nothing reported finished is
        lost or handed out again, nothing goes back (Exactness, invariant
        3). A new standby is made of the new primary."""
        old = (self.pgdata, self.conninfo["port"])
        self.nsample()  # the last answer before the primary is lost
        self.close_admin()
        self.pg_ctl(self.pgdata, "-m", "immediate", "-w", "-t", "120", "stop")
        self.pg_ctl(self.standby[0], "-w", "-t", "120", "promote")
        self.pgdata, self.conninfo["port"] = self.standby
        self.standby = old
        self.wait_ready()
        self.admin = self.db()
        self.promotions += 1
        f = self.nsample()
        c = self.admin
        [(maxa,)] = c.execute("SELECT streampos.max_allocated(%s)", (self.stream,)).fetchall()
        seq = torture.sequence_value(c, self.stream)
        if seq > maxa:
            # The sequence's record logged IDs ahead that the old primary
            # never handed out: the lost range, which a follower's since
            # token may not point into (72000) and no answer reports.
            self.expect_error(c, "SELECT streampos.updates(%s, since => %s)", (self.stream, str(maxa + 1)), "72000")
        self.make_standby()
        # One allocation moves past the lost range: then max_allocated is
        # the sequence's value again (checked at the end of the phase).
        c.execute("BEGIN")
        [(i,)] = self.expect(c, "SELECT streampos.next_id(%s, %s)", (self.stream, NEMESIS_WRITER))
        c.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s, 'promoted')").format(sql.Identifier(self.ntable)),
                  (i, NEMESIS_WRITER))
        c.execute("COMMIT")
        if i <= max(maxa, seq):
            self.fail(f"after the promotion next_id handed out {i}, max_allocated was {maxa}, the sequence {seq}")
        self.nsample()
        return f"now port {self.conninfo['port']}, frontier {f}, max_allocated {maxa}, sequence {seq}, next {i}"

    # ------------------------------------------------------------ checks

    def check_history(self, r):
        """Everything the history's answers and rows must satisfy now."""
        self.current = f"checks after phase {self.phase_no}"
        # Generous: orphaned holds wait for the position worker's pass.
        torture.verify(self.conninfo, r, progress_timeout=30.0)
        problems = []
        if r["errors"]:
            problems.append(f"load errors: {r['errors'][:5]}")
        for k in ("violation_details", "regression_details", "contract_details"):
            if r.get(k):
                problems.append(f"{k}: {r[k][:5]}")
        for k in ("lost", "extra", "wrong_owner"):
            if r.get(k):
                problems.append(f"{k}: {r[k][:10]}")
        if not (r["frontier"] == r["max_allocated"] == r["sequence"] and r["in_flight"] == 0):
            problems.append(f"no progress: frontier {r['frontier']} max_allocated {r['max_allocated']} "
                            f"sequence {r['sequence']} in flight {r['in_flight']}")
        self.last_front = r["frontier"]
        # The whole history: every answer against every transaction
        # (nothing went back across phases, restarts and promotions), every
        # sample against the rows now there (no ID handed out twice).
        self.txns += r["txns"]
        self.answers += r["answers"]
        self.samples += r["sample_list"]
        report = torture.Report()
        torture.check_contract(self.txns, self.answers, report=report, t0=r["t0"])
        if report.total():
            problems.append(f"history contract: {report.details[:5]}")
        with self.db() as c:
            v, details = torture.recheck_samples(c, self.table, self.samples)
            if v:
                problems.append(f"history samples: {details[:5]}")
            problems += self.check_nemesis_rows(c)
            problems += self.check_consumers(c)
        if problems:
            self.fail("; ".join(str(p) for p in problems))

    def check_nemesis_rows(self, c):
        self.nsample(c)  # nothing in flight now: must not be below any earlier one
        q = sql.SQL("SELECT id FROM {} UNION ALL SELECT id FROM {}").format(
            sql.Identifier(self.ntable), sql.Identifier(self.archive))
        have = [x[0] for x in c.execute(q)]
        out = []
        if len(have) != len(set(have)):
            out.append(f"nemesis IDs twice: {sorted(i for i in set(have) if have.count(i) > 1)[:10]}")
        have = set(have)
        for f, ids, _tok, _pos in self.nsamples:
            now = {i for i in have if i <= f}
            if now != ids:
                out.append(f"frontier {f}: answered with rows {sorted(ids)[-5:]}, now missing {sorted(ids - now)[:10]}"
                           f" and more {sorted(now - ids)[:10]} (invariant 1)")
        return out

    def check_consumers(self, c):
        """Every consumer processed exactly the committed rows between its
        registration position and its acknowledged position."""
        out = []
        p = sql.Identifier(self.processed)
        rows_of = sql.SQL(
            "SELECT %s::text AS t, id, instance_name FROM {} UNION ALL SELECT %s, id, instance_name FROM {} "
            "UNION ALL SELECT %s, id, instance_name FROM {}").format(
            sql.Identifier(self.table), sql.Identifier(self.ntable), sql.Identifier(self.archive))
        for name, start in self.consumers.items():
            [(pos,)] = c.execute("SELECT position::text FROM streampos.consumers WHERE stream_name = %s AND "
                                 "consumer_name = %s", (self.stream, name)).fetchall()
            twice = c.execute(sql.SQL("SELECT tbl, id, count(*) FROM {} WHERE consumer = %s GROUP BY 1, 2 "
                                      "HAVING count(*) > 1 LIMIT 10").format(p), (name,)).fetchall()
            if twice:
                out.append(f"consumer {name} processed rows twice: {twice}")
            q = sql.SQL(
                "WITH r AS ({}), due AS (SELECT t, id FROM r WHERE id > streampos.instance_pos(%s::streampos."
                "multi_writer_token, instance_name) AND id <= streampos.instance_pos(%s::streampos."
                "multi_writer_token, instance_name)), got AS (SELECT tbl AS t, id FROM {} WHERE consumer = %s "
                "AND tbl = ANY(%s::text[])) "
                "SELECT (SELECT array_agg(id) FROM (SELECT * FROM due EXCEPT SELECT * FROM got) x), "
                "(SELECT array_agg(id) FROM (SELECT * FROM got EXCEPT SELECT * FROM due) y)").format(rows_of, p)
            [(missed, extra)] = c.execute(q, (self.table, self.ntable, self.ntable, start, pos, name,
                                              [self.table, self.ntable])).fetchall()
            if missed or extra:
                out.append(f"consumer {name} (from {start} to {pos}): never processed {sorted(missed or [])[:10]}, "
                           f"processed but not due {sorted(extra or [])[:10]}")
        return out

    # ------------------------------------------------------------ driver

    def choices(self, steps):
        return tuple(s for s in steps if s not in self.exclude) or steps

    def phase(self):
        """One torture phase with nemesis steps during it; then the checks."""
        self.phase_no += 1
        holder = {}
        conninfo = dict(self.conninfo)

        def load():
            try:
                holder["r"] = torture.run(
                    conninfo, self.stream, seconds=self.phase_seconds, writers=self.writers,
                    instances=self.writers, readers=self.readers, seed=self.seed * 1000 + self.phase_no,
                    tolerate_disconnect=True, verify_at_end=False, modes=READER_MODES,
                    # Cursors count a window of recent IDs, not the whole
                    # table earlier phases filled.
                    window=3000, first_front=self.last_front,
                )
            except Exception as e:  # reported below
                holder["e"] = e

        t = threading.Thread(target=load, daemon=True, name="nemesis-load")
        t.start()
        time.sleep(0.3)
        # Drawn before the steps run, so that the schedule depends on the
        # seed alone, not on what a step found.
        plan = [self.rng.choice(self.choices(PHASE_STEPS)) for _ in range(self.rng.randint(1, 3))]
        if self.restarts and self.rng.random() < 0.4:
            plan.append(self.rng.choice(self.choices(RESTART_STEPS)))
        for name in plan:
            self.step(name)
        t.join(self.phase_seconds + 120)
        if t.is_alive():
            self.fail("the torture load did not stop (a hang)")
        if "e" in holder:
            self.fail(f"the torture load failed: {holder['e']!r}")
        r = holder["r"]
        self.check_history(r)
        self.say(f"phase {self.phase_no} ok: " + torture.summary_line(r))
        if self.rng.random() < 0.15:
            self.step(self.rng.choice(self.choices(BETWEEN_STEPS)))

    def run(self, steps=None, seconds=None):
        start = time.monotonic()
        self.admin = self.db()
        self.admin.execute("CREATE EXTENSION IF NOT EXISTS streampos")
        for (gid,) in self.admin.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE 'nem\\_%'").fetchall():
            self.admin.execute(f"ROLLBACK PREPARED '{gid}'")
        if self.admin.execute("SELECT 1 FROM streampos.streams WHERE stream_name = %s", (self.stream,)).fetchone():
            self.admin.execute("SELECT streampos.drop_stream(%s)", (self.stream,))
        if self.standby and not self.admin.execute(
                "SELECT 1 FROM pg_stat_replication WHERE state = 'streaming' AND sync_state = 'sync'").fetchone():
            self.make_standby()
        self.say(f"start stream={self.stream} phase_seconds={self.phase_seconds} restarts={self.restarts} "
                 f"standby={self.standby}")
        self.new_history()
        while True:
            if steps is not None and self.step_no >= steps:
                break
            if seconds is not None and time.monotonic() - start >= seconds:
                break
            self.phase()
        self.close_admin()
        return {"seed": self.seed, "steps": self.step_no, "phases": self.phase_no, "histories": self.histories,
                "promotions": self.promotions,
                "counts": {k: v for k, v in sorted(self.counts.items()) if not k.endswith("_names")},
                "seconds": round(time.monotonic() - start, 1)}


def main(argv=None):
    p = argparse.ArgumentParser(description="The torture load with a nemesis (docs/torture.md, Nemesis).")
    torture.add_connection_arguments(p)
    p.add_argument("--pgdata", default=os.environ.get("STREAMPOS_PGDATA"),
                   help="the server's data directory (restarts; without it, none)")
    p.add_argument("--standby-pgdata", help="where to make a synchronous standby to promote (with --standby-port)")
    p.add_argument("--standby-port", type=int)
    p.add_argument("--standby-feedback", action="store_true",
                   help="the standby sends hot_standby_feedback")
    p.add_argument("--stream", default="nemesis")
    p.add_argument("--seed", type=int)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--steps", type=int, help="stop after this many steps (default 40)")
    g.add_argument("--seconds", type=float, help="stop after this long (the phase running then finishes)")
    p.add_argument("--phase-seconds", type=float, default=3.0)
    p.add_argument("--writers", type=int, default=4)
    p.add_argument("--readers", type=int, default=2)
    p.add_argument("--exclude", default="", help="comma-separated steps never to take")
    p.add_argument("--include-known", action="store_true",
                   help=f"also take the steps that find a known defect ({', '.join(KNOWN_FINDINGS)})")
    a = p.parse_args(argv)
    if a.steps is None and a.seconds is None:
        a.steps = 40
    if bool(a.standby_pgdata) != bool(a.standby_port):
        p.error("--standby-pgdata and --standby-port go together")
    conninfo = dict(host=a.host, port=a.port, dbname=a.dbname, user=a.user)
    n = Nemesis(conninfo, pgdata=a.pgdata, stream=a.stream, seed=a.seed, phase_seconds=a.phase_seconds,
                writers=a.writers, readers=a.readers, log=lambda s: print(s, flush=True),
                exclude=[x for x in a.exclude.split(",") if x] + ([] if a.include_known else list(KNOWN_FINDINGS)),
                standby=(a.standby_pgdata, a.standby_port) if a.standby_pgdata else None,
                feedback=a.standby_feedback)
    print(f"nemesis seed {n.seed} (replay: --seed {n.seed})", flush=True)
    try:
        out = n.run(steps=a.steps, seconds=a.seconds)
    except ContractViolation as e:
        print(f"FAILED (replay with --seed {n.seed}): {e}", flush=True)
        return 1
    print(f"nemesis ok: {out}", flush=True)
    if n.pgdata != a.pgdata:
        # After a promotion the primary is the other node.
        print(f"nemesis: the primary is now port {n.conninfo['port']}, data {n.pgdata}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
