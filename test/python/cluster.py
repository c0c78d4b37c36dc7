"""Clusters of their own for the failover tests: a primary and a streaming
hot standby, each with streampos preloaded, that a test can lag, kill and
promote without touching the server the rest of the suite uses.

    with Clusters() as clusters:
        pair = clusters.pair(synchronous=True)
        primary, standby = pair
        ...
        standby.stop()        # the standby is away (or pair.disconnect():
                              # it stays up, replication is cut)
        pair.failover()       # pg_ctl stop -m immediate on the primary,
                              # start the standby if stopped, promote it and
                              # wait until it accepts writes

Lag without losing WAL: standby.pause_replay() / resume_replay(). (Stopping
the walreceiver with SIGSTOP does not reliably cut replication: the kernel
keeps buffering what the walsender sends, and the walreceiver reads it on
SIGCONT, even after the primary is gone.)

Every cluster is a copy of one template (initdb, database and extension made
once per process), so a pair costs a copy, a start and a pg_basebackup.

Ports: STREAMPOS_FAILOVER_PORT (default STREAMPOS_PGPORT + 20) and the next
few (one per node alive at once, at most MAX_NODES). Data:
STREAMPOS_FAILOVER_DIR (default a "failover" directory next to
STREAMPOS_PGDATA, else /tmp/streampos-failover-<port>). Each run first stops
whatever a previous run left under that directory (only postmasters whose
data directory is there) and removes it; teardown does the same, and an
atexit hook covers an interrupted run.
"""

import atexit
import os
import pwd
import shutil
import signal
import subprocess
import time

import psycopg

from support import PG_BIN, PGDATA, PGPORT, wait_until

BASE_PORT = int(os.environ.get("STREAMPOS_FAILOVER_PORT", PGPORT + 20))
BASE_DIR = os.environ.get("STREAMPOS_FAILOVER_DIR") or (
    os.path.join(os.path.dirname(PGDATA.rstrip("/")), "failover")
    if PGDATA
    else f"/tmp/streampos-failover-{BASE_PORT}"
)
DBNAME = "streampos_failover"
USER = "postgres"
# The template runs (briefly, before any node exists) on the first port.
TEMPLATE_PORT = BASE_PORT
# Nodes take the lowest free port from BASE_PORT on; a destroyed node frees
# its port. A pair and a failover pair at once need four.
MAX_NODES = 8

# Appended to every cluster's postgresql.conf. Per-node settings (port,
# synchronous_standby_names, …) go to postgresql.auto.conf (Node.set), which
# is read last and which pg_basebackup -R also writes.
BASE_CONF = [
    "shared_preload_libraries = 'streampos'",
    "listen_addresses = '127.0.0.1'",
    "unix_socket_directories = '/tmp'",
    "max_connections = 60",
    "shared_buffers = '32MB'",
    "fsync = on",
    "wal_level = replica",
    "max_wal_senders = 8",
    "max_replication_slots = 8",
    "hot_standby = on",
    "hot_standby_feedback = on",
    # Followers on a standby woken by replay (the primary logs, every
    # standby replays: the same id on both).
    "streampos.standby_wakeup_rmgr_id = 171",
    # The standby reports its flush and replay positions promptly, and
    # reconnects quickly after a disconnect.
    "wal_receiver_status_interval = '1s'",
    "wal_retrieve_retry_interval = '200ms'",
    "log_line_prefix = '%m [%p] %b '",
    "log_min_messages = warning",
]

# No Rust backtraces in error details, as scripts/lib.sh.
SERVER_ENV = dict(os.environ, RUST_BACKTRACE="0", RUST_LIB_BACKTRACE="0")


def _as_postgres(args):
    if os.geteuid() == 0:
        return ["runuser", "-u", USER, "--"] + args
    return args


def _run(args, timeout=120, check=True):
    proc = subprocess.run(
        _as_postgres(args), capture_output=True, text=True, timeout=timeout, env=SERVER_ENV
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
    return proc


def _chown(path):
    if os.geteuid() == 0:
        pw = pwd.getpwnam(USER)
        os.chown(path, pw.pw_uid, pw.pw_gid)


def _bin(name):
    return os.path.join(PG_BIN, name)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _postmaster_pid(datadir):
    """The pid in datadir/postmaster.pid if that process is alive and is a
    postgres started on this data directory (never anybody else's)."""
    try:
        with open(os.path.join(datadir, "postmaster.pid")) as f:
            pid = int(f.readline().strip())
    except (OSError, ValueError):
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().split(b"\0")
    except OSError:
        return None
    if not any(os.path.realpath(arg.decode(errors="replace")) == os.path.realpath(datadir)
               for arg in cmdline if arg):
        return None
    return pid


def _children(pid):
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(entry))
    return kids


def force_stop(datadir):
    """Stop the postmaster of datadir whatever state it is in: an immediate
    stop, then SIGCONT (a test may have stopped a process) and SIGKILL for
    what is left of it and its children."""
    if not os.path.exists(os.path.join(datadir, "postmaster.pid")):
        return
    _run([_bin("pg_ctl"), "-D", datadir, "-m", "immediate", "-w", "-t", "15", "stop"],
         timeout=30, check=False)
    pid = _postmaster_pid(datadir)
    if pid is None:
        return
    victims = [pid] + _children(pid)
    for p in victims:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    while any(_pid_alive(p) for p in victims) and time.monotonic() < deadline:
        time.sleep(0.05)


def cleanup_leftovers():
    """Stop every server a previous run left under BASE_DIR and remove it."""
    if not os.path.isdir(BASE_DIR):
        return
    for entry in os.listdir(BASE_DIR):
        path = os.path.join(BASE_DIR, entry)
        if os.path.isdir(path):
            force_stop(path)
    shutil.rmtree(BASE_DIR, ignore_errors=True)


class Node:
    """One PostgreSQL cluster (a data directory and a port)."""

    def __init__(self, name, datadir, port):
        self.name = name
        self.datadir = datadir
        self.port = port
        self.log = os.path.join(datadir, "server.log")

    def __repr__(self):
        return f"<Node {self.name} port={self.port}>"

    # ------------------------------------------------------------ settings

    def set(self, **settings):
        """Write settings to postgresql.auto.conf (replacing earlier values
        of the same names); reload() or restart to apply them."""
        path = os.path.join(self.datadir, "postgresql.auto.conf")
        keys = {k.replace("__", ".") for k in settings}
        kept = []
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    key = line.split("=", 1)[0].strip()
                    if key not in keys:
                        kept.append(line if line.endswith("\n") else line + "\n")
        for key, value in settings.items():
            key = key.replace("__", ".")
            text = str(value).replace("'", "''")
            kept.append(f"{key} = '{text}'\n")
        with open(path, "w") as f:
            f.writelines(kept)
        _chown(path)

    def setting(self, key):
        """A value from postgresql.auto.conf, or None."""
        path = os.path.join(self.datadir, "postgresql.auto.conf")
        with open(path) as f:
            for line in f:
                k, _, v = line.partition("=")
                if k.strip() == key:
                    v = v.strip()
                    return v[1:-1].replace("''", "'") if v.startswith("'") else v
        return None

    def tool(self, name, *args, timeout=120):
        """Run a client program (pg_dump, pg_restore, …) against this node
        as the postgres user."""
        return _run([_bin(name), "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, *args],
                    timeout=timeout)

    def reload(self):
        _run([_bin("pg_ctl"), "-D", self.datadir, "reload"])

    # ------------------------------------------------------------ control

    def start(self, wait_ready=True):
        try:
            _run([_bin("pg_ctl"), "-D", self.datadir, "-l", self.log, "-w", "-t", "60", "start"])
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.name} log:\n{self.log_tail()}") from None
        if wait_ready:
            wait_until(self._accepts, timeout=60, interval=0.05, message=f"{self.name} to accept connections")

    def stop(self, mode="fast"):
        _run([_bin("pg_ctl"), "-D", self.datadir, "-m", mode, "-w", "-t", "60", "stop"], timeout=90)

    def kill(self):
        """An immediate stop: no shutdown checkpoint, no more WAL sent."""
        self.stop("immediate")

    def log_tail(self, lines=20):
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def running(self):
        return _postmaster_pid(self.datadir) is not None

    def promote(self):
        """Promote a standby and wait until it accepts writes; returns the
        time.monotonic() at which pg_ctl promote returned."""
        _run([_bin("pg_ctl"), "-D", self.datadir, "-w", "-t", "60", "promote"], timeout=90)
        done = time.monotonic()
        wait_until(lambda: self._accepts() and not self.in_recovery(), timeout=60,
                   interval=0.02, message=f"{self.name} to finish promotion")
        return done

    def destroy(self):
        force_stop(self.datadir)
        shutil.rmtree(self.datadir, ignore_errors=True)
        _PORTS_IN_USE.discard(self.port)

    def _accepts(self):
        try:
            with self.connect("postgres", connect_timeout=2) as c:
                c.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            return False

    # ------------------------------------------------------------ SQL

    def conninfo(self, dbname=DBNAME):
        return f"host=127.0.0.1 port={self.port} user={USER} dbname={dbname}"

    def connect(self, dbname=DBNAME, autocommit=True, **kwargs):
        params = dict(host="127.0.0.1", port=self.port, user=USER, dbname=dbname, connect_timeout=10)
        params.update(kwargs)
        return psycopg.connect(autocommit=autocommit, **params)

    def one(self, sql, params=None, dbname=DBNAME):
        with self.connect(dbname) as c:
            cur = c.execute(sql, params)
            if cur.description is None:
                return None
            row = cur.fetchone()
            return row[0] if row else None

    def all(self, sql, params=None, dbname=DBNAME):
        with self.connect(dbname) as c:
            return c.execute(sql, params).fetchall()

    def in_recovery(self):
        return self.one("SELECT pg_is_in_recovery()", dbname="postgres")

    # ------------------------------------------------------------ WAL positions

    def flush_lsn(self):
        """The primary's WAL flushed up to here (pg_lsn as text)."""
        return self.one("SELECT pg_current_wal_flush_lsn()::text", dbname="postgres")

    def replay_lsn(self):
        return self.one("SELECT pg_last_wal_replay_lsn()::text", dbname="postgres")

    def receive_lsn(self):
        return self.one("SELECT pg_last_wal_receive_lsn()::text", dbname="postgres")

    def wait_replayed(self, lsn, timeout=30):
        """Wait until this standby replayed the WAL up to lsn."""
        wait_until(
            lambda: self.one("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,), dbname="postgres"),
            timeout=timeout, interval=0.02, message=f"{self.name} to replay up to {lsn}",
        )

    def pause_replay(self):
        """Stop applying WAL (it is still received and flushed, so a
        promotion applies it all: this lags readers, not durability)."""
        self.one("SELECT pg_wal_replay_pause()", dbname="postgres")
        wait_until(lambda: self.one("SELECT pg_get_wal_replay_pause_state()", dbname="postgres") == "paused",
                   timeout=10, message="replay to pause")

    def resume_replay(self):
        self.one("SELECT pg_wal_replay_resume()", dbname="postgres")


class Pair:
    """A primary and its streaming standby (physical slot, pg_basebackup -R)."""

    def __init__(self, primary, standby, synchronous):
        self.primary = primary
        self.standby = standby
        self.synchronous = synchronous

    def __iter__(self):
        return iter((self.primary, self.standby))

    def caught_up(self, timeout=30):
        """Wait until the standby replayed everything the primary flushed."""
        self.standby.wait_replayed(self.primary.flush_lsn(), timeout=timeout)

    def wait_streaming(self, timeout=30):
        """Wait until the primary streams to the standby (as a synchronous
        standby when the pair is synchronous)."""
        want = "sync" if self.synchronous else "async"

        def streaming():
            states = self.primary.all(
                "SELECT state, sync_state FROM pg_stat_replication", dbname="postgres")
            return ("streaming", want) in states

        wait_until(streaming, timeout=timeout, interval=0.05, message=f"the standby to stream ({want})")

    def disconnect(self):
        """Block replication while the standby keeps serving reads: point
        primary_conninfo at nothing, so the walreceiver stops and cannot
        reconnect. What it already received stays."""
        self._conninfo = self.standby.setting("primary_conninfo")
        self.standby.set(primary_conninfo=f"host=127.0.0.1 port=1 user={USER} connect_timeout=1")
        self.standby.reload()
        wait_until(lambda: not self._walsender_alive() and self.standby.one(
                       "SELECT count(*) FROM pg_stat_wal_receiver WHERE status = 'streaming'",
                       dbname="postgres") == 0,
                   timeout=20, interval=0.05, message="replication to stop")

    def reconnect(self):
        self.standby.set(primary_conninfo=self._conninfo)
        self.standby.reload()
        self.wait_streaming()

    def _walsender_alive(self):
        try:
            return bool(self.primary.one("SELECT count(*) FROM pg_stat_replication", dbname="postgres"))
        except psycopg.OperationalError:
            return False

    def failover(self):
        """Immediate stop of the primary, then promote the standby (started
        if it was stopped). Returns the monotonic time the promotion ended."""
        self.primary.kill()
        if not self.standby.running():
            self.standby.start()
        return self.standby.promote()


class Clusters:
    """Makes nodes on ports BASE_PORT.. and destroys them all on close()."""

    _template_ready = False

    def __init__(self):
        self.nodes = []
        os.makedirs(BASE_DIR, exist_ok=True)
        os.chmod(BASE_DIR, 0o755)
        _chown(BASE_DIR)
        _ALIVE.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for node in reversed(self.nodes):
            node.destroy()
        self.nodes.clear()
        if self in _ALIVE:
            _ALIVE.remove(self)

    # ------------------------------------------------------------ making nodes

    @classmethod
    def _template(cls):
        """initdb, the database and the extension, once per process."""
        path = os.path.join(BASE_DIR, "template")
        if cls._template_ready:
            return path
        cleanup_leftovers()
        os.makedirs(BASE_DIR, exist_ok=True)
        os.chmod(BASE_DIR, 0o755)
        _chown(BASE_DIR)
        _run([_bin("initdb"), "-D", path, "-A", "trust", "-U", USER, "--no-sync"])
        with open(os.path.join(path, "postgresql.conf"), "a") as f:
            f.write("\n".join(BASE_CONF) + "\n")
        node = Node("template", path, TEMPLATE_PORT)
        node.set(port=TEMPLATE_PORT)
        try:
            node.start()
            node.one(f"CREATE DATABASE {DBNAME}", dbname="postgres")
            node.one("CREATE EXTENSION streampos")
            node.stop("fast")
        except BaseException:
            node.destroy()
            raise
        cls._template_ready = True
        return path

    def _new_node(self, role):
        free = [p for p in range(BASE_PORT, BASE_PORT + MAX_NODES) if p not in _PORTS_IN_USE]
        assert free, f"more than {MAX_NODES} failover test nodes at once"
        port = free[0]
        _PORTS_IN_USE.add(port)
        datadir = os.path.join(BASE_DIR, f"{role}-{port}")
        force_stop(datadir)
        shutil.rmtree(datadir, ignore_errors=True)
        node = Node(role, datadir, port)
        self.nodes.append(node)
        return node

    def node(self, start=True, **settings):
        """A stand-alone primary with database DBNAME and the extension."""
        template = self._template()
        node = self._new_node("primary")
        _run(["cp", "-a", template, node.datadir])
        node.set(port=node.port, cluster_name=f"{node.name}{node.port}", **settings)
        if start:
            node.start()
        return node

    def pair(self, synchronous=False, primary_settings=None, standby_settings=None):
        """A primary and a hot standby streaming from it through a physical
        slot. Synchronous: synchronous_standby_names = '*' and
        synchronous_commit = on, so a commit returns once the standby flushed
        it. Returns a Pair, once the standby streams."""
        primary_settings = dict(primary_settings or {})
        if synchronous:
            primary_settings.setdefault("synchronous_standby_names", "*")
            primary_settings.setdefault("synchronous_commit", "on")
        primary = self.node(**primary_settings)
        standby = self._new_node("standby")
        _run([_bin("pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port), "-U", USER,
              "-D", standby.datadir, "-R", "-X", "stream", "-c", "fast",
              "-C", "-S", f"standby{standby.port}", "--no-sync"], timeout=180)
        standby.set(port=standby.port, cluster_name=f"standby{standby.port}",
                    synchronous_standby_names="", **(standby_settings or {}))
        # The base backup copied the primary's log.
        try:
            os.remove(standby.log)
        except FileNotFoundError:
            pass
        standby.start()
        pair = Pair(primary, standby, synchronous)
        pair.wait_streaming()
        return pair

    def cascade(self, upstream):
        """A hot standby streaming from the standby ``upstream`` (a
        cascading standby); returned once it accepts connections."""
        node = self._new_node("cascade")
        _run([_bin("pg_basebackup"), "-h", "127.0.0.1", "-p", str(upstream.port), "-U", USER,
              "-D", node.datadir, "-R", "-X", "stream", "-c", "fast", "--no-sync"], timeout=180)
        # Not the upstream's slot on the primary (its settings were copied).
        node.set(port=node.port, cluster_name=f"cascade{node.port}", synchronous_standby_names="",
                 primary_slot_name="")
        try:
            os.remove(node.log)
        except FileNotFoundError:
            pass
        node.start()
        return node


_ALIVE = []
_PORTS_IN_USE = set()


@atexit.register
def _close_all():
    for clusters in list(_ALIVE):
        try:
            clusters.close()
        except Exception:
            pass
    if Clusters._template_ready:
        cleanup_leftovers()
