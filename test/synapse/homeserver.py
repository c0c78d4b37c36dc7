"""A real Synapse homeserver on PostgreSQL: main process, two event
persisters and a sync worker, replicating over Redis. Run by
scripts/synapse-homeserver (which brings the server and Redis); see
test/synapse/README.md.

For each mode (``stock``: Synapse as it is; ``streampos``: launched with
``python -m streampos.synapse``, the extension created, the homeserver's
role granted EXECUTE):

1. a database of its own owned by the role ``synapse``, Synapse's processes
   started, users registered, rooms created and joined;
2. **throughput**: every client sends its messages concurrently through the
   client-server API (retrying a failed send with the same transaction ID)
   while every client long-polls /sync on the sync worker; the processes
   are then stopped so that PostgreSQL's table statistics are flushed, and
   the rows written to ``stream_positions`` are counted;
3. **kill**: the processes are started again, and while the clients send
   another round, ``event_persister1`` is killed with SIGKILL and started
   again;
4. **checks**: every client's /sync received every acknowledged message
   exactly once, each sender's messages in the order it sent them, every
   client the same sequence per room, never a limited timeline; /messages
   paged backwards from the end gives the same sequence; with streampos, the
   streams' frontiers moved past everything allocated before the kill and
   nothing is left in flight.

Prints a table per mode and exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import psycopg

SERVER_NAME = "streampos.test"
STREAMS_CHECKED = ("events", "receipts", "caches", "account_data", "to_device", "presence_stream")


# ----------------------------------------------------------------- plumbing


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Http:
    """One keep-alive connection per thread."""

    def __init__(self, port: int, timeout: float = 60.0) -> None:
        self.port = port
        self.timeout = timeout
        self.conn: Optional[http.client.HTTPConnection] = None

    def request(self, method: str, path: str, body: Any = None, token: Optional[str] = None) -> Tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None if body is None else json.dumps(body).encode()
        for attempt in (1, 2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            try:
                self.conn.request(method, path, body=data, headers=headers)
                resp = self.conn.getresponse()
                raw = resp.read()
                try:
                    payload = json.loads(raw) if raw else None
                except ValueError:
                    payload = raw.decode(errors="replace")
                return resp.status, payload
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")


@dataclass
class Ports:
    base: int

    @property
    def main_client(self) -> int:
        return self.base + 1

    @property
    def main_replication(self) -> int:
        return self.base + 2

    @property
    def persister1(self) -> int:
        return self.base + 3

    @property
    def persister2(self) -> int:
        return self.base + 4

    @property
    def sync(self) -> int:
        return self.base + 5

    @property
    def redis(self) -> int:
        return self.base + 9


# ----------------------------------------------------------------- the homeserver


class Homeserver:
    WORKERS = ("event_persister1", "event_persister2", "sync1")

    def __init__(self, args: argparse.Namespace, mode: str) -> None:
        self.args = args
        self.mode = mode
        self.ports = Ports(args.port_base)
        self.dir = os.path.join(args.work, mode)
        self.dbname = f"synapse_hs_{mode}"
        self.procs: Dict[str, subprocess.Popen] = {}

    # ---- database

    def admin(self, dbname: str = "postgres") -> psycopg.Connection:
        return psycopg.connect(
            host=self.args.pghost, port=self.args.pgport, user="postgres", dbname=dbname, autocommit=True
        )

    def create_database(self) -> None:
        with self.admin() as c:
            c.execute(f"DROP DATABASE IF EXISTS {self.dbname} WITH (FORCE)")
            if not c.execute("SELECT 1 FROM pg_roles WHERE rolname = 'synapse'").fetchone():
                c.execute("CREATE ROLE synapse LOGIN")
            c.execute(
                f"CREATE DATABASE {self.dbname} OWNER synapse ENCODING 'UTF8' LC_COLLATE 'C' LC_CTYPE 'C' "
                "TEMPLATE template0"
            )
        if self.mode == "streampos":
            # The README's set-up: a superuser creates the extension and
            # grants the homeserver's role; the role does the rest.
            with self.admin(self.dbname) as c:
                c.execute("CREATE EXTENSION streampos")
                c.execute("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA streampos TO synapse")

    def sql(self, query: str, *params: Any) -> List[tuple]:
        with self.admin(self.dbname) as c:
            cur = c.execute(query, params or None)
            return cur.fetchall() if cur.description else []

    # ---- configuration

    def write_config(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)  # logs and media of an earlier run
        os.makedirs(self.dir)
        p = self.ports
        cfg = {
            "server_name": SERVER_NAME,
            "pid_file": os.path.join(self.dir, "main.pid"),
            "report_stats": False,
            "signing_key_path": os.path.join(self.args.work, "signing.key"),
            "media_store_path": os.path.join(self.dir, "media"),
            "log_config": os.path.join(self.dir, "log-main.yaml"),
            "macaroon_secret_key": "streampos-test-macaroon",
            "form_secret": "streampos-test-form",
            "registration_shared_secret": "streampos-test-registration",
            "enable_registration": True,
            "enable_registration_without_verification": True,
            "trusted_key_servers": [],
            "suppress_key_server_warning": True,
            "federation_sender_instances": [],
            "listeners": [
                {
                    "port": p.main_client,
                    "bind_addresses": ["127.0.0.1"],
                    "type": "http",
                    "x_forwarded": False,
                    "resources": [{"names": ["client"], "compress": False}],
                },
                {
                    "port": p.main_replication,
                    "bind_addresses": ["127.0.0.1"],
                    "type": "http",
                    "resources": [{"names": ["replication"]}],
                },
            ],
            "database": {
                "name": "psycopg2",
                "args": {
                    "user": "synapse",
                    "dbname": self.dbname,
                    "host": self.args.pghost,
                    "port": self.args.pgport,
                    "cp_min": 2,
                    "cp_max": 10,
                },
            },
            "redis": {"enabled": True, "host": "127.0.0.1", "port": p.redis},
            "instance_map": {
                "main": {"host": "127.0.0.1", "port": p.main_replication},
                "event_persister1": {"host": "127.0.0.1", "port": p.persister1},
                "event_persister2": {"host": "127.0.0.1", "port": p.persister2},
            },
            "stream_writers": {"events": ["event_persister1", "event_persister2"]},
            "rc_message": {"per_second": 100000, "burst_count": 100000},
            "rc_registration": {"per_second": 100000, "burst_count": 100000},
            "rc_login": {
                "address": {"per_second": 100000, "burst_count": 100000},
                "account": {"per_second": 100000, "burst_count": 100000},
                "failed_attempts": {"per_second": 100000, "burst_count": 100000},
            },
            "rc_joins": {
                "local": {"per_second": 100000, "burst_count": 100000},
                "remote": {"per_second": 100000, "burst_count": 100000},
            },
            "rc_joins_per_room": {"per_second": 100000, "burst_count": 100000},
            "rc_invites": {"per_room": {"per_second": 100000, "burst_count": 100000}},
        }
        self._write("homeserver.yaml", cfg)
        self._write_log_config("main")
        workers = {
            "event_persister1": [{"names": ["replication"]}],
            "event_persister2": [{"names": ["replication"]}],
            "sync1": [{"names": ["client"]}],
        }
        ports = {"event_persister1": p.persister1, "event_persister2": p.persister2, "sync1": p.sync}
        for name, resources in workers.items():
            self._write_log_config(name)
            self._write(
                f"{name}.yaml",
                {
                    "worker_app": "synapse.app.generic_worker",
                    "worker_name": name,
                    "worker_log_config": os.path.join(self.dir, f"log-{name}.yaml"),
                    "worker_pid_file": os.path.join(self.dir, f"{name}.pid"),
                    "worker_listeners": [
                        {
                            "type": "http",
                            "port": ports[name],
                            "bind_addresses": ["127.0.0.1"],
                            "resources": resources,
                        }
                    ],
                },
            )

    def _write(self, name: str, content: Dict[str, Any]) -> None:
        # JSON is YAML.
        with open(os.path.join(self.dir, name), "w") as f:
            json.dump(content, f, indent=1)

    def _write_log_config(self, name: str) -> None:
        self._write(
            f"log-{name}.yaml",
            {
                "version": 1,
                "formatters": {"f": {"format": "%(asctime)s %(name)s %(levelname)s %(request)s %(message)s"}},
                "filters": {"context": {"()": "synapse.logging.context.LoggingContextFilter", "request": ""}},
                "handlers": {
                    "file": {
                        "class": "logging.FileHandler",
                        "filename": os.path.join(self.dir, f"{name}.log"),
                        "formatter": "f",
                        "filters": ["context"],
                    }
                },
                "loggers": {"streampos": {"level": "INFO"}},
                "root": {"level": "WARNING", "handlers": ["file"]},
                "disable_existing_loggers": False,
            },
        )

    def generate_keys(self) -> None:
        if not os.path.exists(os.path.join(self.args.work, "signing.key")):
            subprocess.run(
                [sys.executable, "-m", "synapse.app.homeserver", "-c", os.path.join(self.dir, "homeserver.yaml"),
                 "--generate-keys"],
                check=True,
                capture_output=True,
            )

    # ---- processes

    def command(self, name: str) -> List[str]:
        app = "synapse.app.homeserver" if name == "main" else "synapse.app.generic_worker"
        configs = ["-c", os.path.join(self.dir, "homeserver.yaml")]
        if name != "main":
            configs += ["-c", os.path.join(self.dir, f"{name}.yaml")]
        launcher = ["-m", "streampos.synapse", app] if self.mode == "streampos" else ["-m", app]
        return [sys.executable, *launcher, *configs]

    def start(self, name: str) -> None:
        out = open(os.path.join(self.dir, f"{name}.out"), "a")
        self.procs[name] = subprocess.Popen(self.command(name), cwd=self.dir, stdout=out, stderr=subprocess.STDOUT)

    def wait_healthy(self, name: str, port: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.dir}/{name}.out and .log")
            try:
                status, _ = Http(port, timeout=5).request("GET", "/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{name} not healthy after {timeout}s")

    def port_of(self, name: str) -> int:
        return {
            "main": self.ports.main_client,
            "event_persister1": self.ports.persister1,
            "event_persister2": self.ports.persister2,
            "sync1": self.ports.sync,
        }[name]

    def start_all(self) -> None:
        self.start("main")
        self.wait_healthy("main", self.ports.main_client)
        for name in self.WORKERS:
            self.start(name)
        for name in self.WORKERS:
            self.wait_healthy(name, self.port_of(name))

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in list(self.procs.items()):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


# ----------------------------------------------------------------- clients


@dataclass
class Client:
    user: str
    token: str
    since: str = ""
    received: Dict[str, List[Tuple[str, str, float]]] = field(default_factory=dict)  # room -> (event_id, body, t)
    limited: int = 0
    errors: List[str] = field(default_factory=list)


SYNC_FILTER = json.dumps(
    {
        "room": {"timeline": {"limit": 1000}, "state": {"lazy_load_members": True}},
        "presence": {"not_types": ["*"]},
    }
)


class Run:
    def __init__(self, hs: Homeserver, args: argparse.Namespace) -> None:
        self.hs = hs
        self.args = args
        self.clients: List[Client] = []
        self.rooms: List[str] = []
        self.acked: Dict[str, Tuple[str, str, str, float, float]] = {}  # event_id -> (room, sender, body, t0, t1)
        self.acked_lock = threading.Lock()
        self.stop_sync = threading.Event()
        self.messages_reordered = 0

    def main_http(self) -> Http:
        return Http(self.hs.ports.main_client)

    def setup(self) -> None:
        h = self.main_http()
        for i in range(self.args.clients):
            status, body = h.request(
                "POST",
                "/_matrix/client/v3/register",
                {"username": f"user{i}", "password": "streampos-pass", "auth": {"type": "m.login.dummy"}},
            )
            assert status == 200, (status, body)
            self.clients.append(Client(user=body["user_id"], token=body["access_token"]))
        owner = self.clients[0]
        for r in range(self.args.rooms):
            status, body = h.request(
                "POST", "/_matrix/client/v3/createRoom", {"preset": "public_chat", "name": f"room{r}"}, owner.token
            )
            assert status == 200, (status, body)
            self.rooms.append(body["room_id"])
        for c in self.clients[1:]:
            for room in self.rooms:
                status, body = h.request("POST", f"/_matrix/client/v3/join/{urllib.parse.quote(room)}", {}, c.token)
                assert status == 200, (status, body)
        sync = Http(self.hs.ports.sync)
        for c in self.clients:
            status, body = sync.request("GET", f"/_matrix/client/v3/sync?filter={urllib.parse.quote(SYNC_FILTER)}",
                                        token=c.token)
            assert status == 200, (status, body)
            c.since = body["next_batch"]

    # ---- sync

    def sync_loop(self, c: Client) -> None:
        h = Http(self.hs.ports.sync, timeout=90)
        q = urllib.parse.quote(SYNC_FILTER)
        while not self.stop_sync.is_set():
            try:
                status, body = h.request(
                    "GET", f"/_matrix/client/v3/sync?filter={q}&timeout=5000&since={urllib.parse.quote(c.since)}",
                    token=c.token,
                )
            except OSError as e:
                c.errors.append(f"sync: {e}")
                time.sleep(0.5)
                continue
            now = time.monotonic()
            if status != 200:
                c.errors.append(f"sync {status}: {body}")
                time.sleep(0.5)
                continue
            for room, data in body.get("rooms", {}).get("join", {}).items():
                timeline = data.get("timeline", {})
                if timeline.get("limited"):
                    c.limited += 1
                for ev in timeline.get("events", []):
                    if ev.get("type") == "m.room.message" and str(ev["content"].get("body", "")).startswith("msg "):
                        c.received.setdefault(room, []).append((ev["event_id"], ev["content"]["body"], now))
            c.since = body["next_batch"]

    # ---- sending

    def send_loop(self, index: int, c: Client, phase: str, count: int, progress: List[int]) -> None:
        h = self.main_http()
        for k in range(count):
            room = self.rooms[(index + k) % len(self.rooms)]
            body = f"msg {phase} {index} {k}"
            txn = f"{phase}-{index}-{k}"
            path = f"/_matrix/client/v3/rooms/{urllib.parse.quote(room)}/send/m.room.message/{txn}"
            t0 = time.monotonic()
            deadline = t0 + 300
            while True:
                try:
                    status, resp = h.request("PUT", path, {"msgtype": "m.text", "body": body}, c.token)
                except OSError as e:
                    status, resp = 0, str(e)
                if status == 200:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"send {body} failed for 300s: {status} {resp}")
                time.sleep(0.2)
            with self.acked_lock:
                self.acked[resp["event_id"]] = (room, c.user, body, t0, time.monotonic())
                progress[0] += 1

    def phase(self, phase: str, during=None) -> Dict[str, float]:
        """Every client sends args.messages messages; ``during(progress)`` runs
        alongside (the kill). Returns the phase's figures."""
        self.stop_sync.clear()
        syncs = [threading.Thread(target=self.sync_loop, args=(c,), daemon=True) for c in self.clients]
        for t in syncs:
            t.start()
        progress = [0]
        before = set(self.acked)
        start = time.monotonic()
        senders = [
            threading.Thread(target=self.send_loop, args=(i, c, phase, self.args.messages, progress))
            for i, c in enumerate(self.clients)
        ]
        for t in senders:
            t.start()
        side = None
        if during is not None:
            side = threading.Thread(target=during, args=(progress,))
            side.start()
        for t in senders:
            t.join()
        elapsed = time.monotonic() - start
        if side is not None:
            side.join()
        new = [e for e in self.acked if e not in before]
        # Every client must receive every message of this phase.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all(self.received_all(c, new) for c in self.clients):
                break
            time.sleep(0.2)
        self.stop_sync.set()
        for t in syncs:
            t.join(30)
        latencies = []
        for c in self.clients:
            seen = {eid: t for events in c.received.values() for eid, _, t in events}
            for eid in new:
                if eid in seen and self.acked[eid][1] != c.user:
                    latencies.append(seen[eid] - self.acked[eid][3])
        latencies.sort()
        return {
            "messages": len(new),
            "seconds": elapsed,
            "per_second": len(new) / elapsed,
            "sync_p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"),
            "sync_p95_ms": 1000 * latencies[int(0.95 * (len(latencies) - 1))] if latencies else float("nan"),
            "sync_p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else float("nan"),
        }

    def received_all(self, c: Client, events: List[str]) -> bool:
        seen = {eid for evs in c.received.values() for eid, _, _ in evs}
        return all(e in seen for e in events)

    # ---- checks

    def check(self) -> List[str]:
        problems: List[str] = []
        by_room: Dict[str, List[str]] = {}
        for eid, (room, sender, body, t0, t1) in self.acked.items():
            by_room.setdefault(room, []).append(eid)
        reference: Dict[str, List[str]] = {}
        for c in self.clients:
            if c.limited:
                problems.append(f"{c.user}: {c.limited} limited timelines")
            for room in self.rooms:
                got = [eid for eid, _, _ in c.received.get(room, [])]
                if len(got) != len(set(got)):
                    dup = len(got) - len(set(got))
                    problems.append(f"{c.user} {room}: {dup} events received twice")
                missing = set(by_room.get(room, [])) - set(got)
                if missing:
                    problems.append(f"{c.user} {room}: {len(missing)} acknowledged events never received")
                extra = set(got) - set(self.acked)
                if extra:
                    problems.append(f"{c.user} {room}: {len(extra)} events never acknowledged")
                # Each sender's messages in the order it sent them.
                bodies = [body for _, body, _ in c.received.get(room, [])]
                per_sender: Dict[Tuple[str, str, str], List[int]] = {}
                for b in bodies:
                    _, phase, index, k = b.split()
                    per_sender.setdefault((phase, index, room), []).append(int(k))
                for key, ks in per_sender.items():
                    if ks != sorted(ks):
                        problems.append(f"{c.user}: sender {key} out of order: {ks}")
                if room in reference:
                    if got != reference[room]:
                        problems.append(f"{c.user} {room}: a different sequence from {self.clients[0].user}'s")
                else:
                    reference[room] = got
        # /messages, paged backwards from the end, gives the same sequence.
        h = Http(self.hs.ports.sync)
        reader = self.clients[-1]
        for room in self.rooms:
            events: List[str] = []
            frm = ""
            while True:
                q = f"dir=b&limit=37{'&from=' + urllib.parse.quote(frm) if frm else ''}"
                status, body = h.request(
                    "GET", f"/_matrix/client/v3/rooms/{urllib.parse.quote(room)}/messages?{q}", token=reader.token
                )
                if status != 200:
                    problems.append(f"/messages {room}: {status} {body}")
                    break
                for ev in body.get("chunk", []):
                    if ev.get("type") == "m.room.message" and str(ev["content"].get("body", "")).startswith("msg "):
                        events.append(ev["event_id"])
                if not body.get("chunk") or "end" not in body:
                    break
                frm = body["end"]
            events.reverse()
            # /messages orders by the room's DAG (depth, then stream
            # order), /sync by stream order: concurrent sends in one room
            # may order differently, but never one sender's messages.
            expected = reference.get(room, [])
            if len(events) != len(set(events)):
                problems.append(f"/messages {room}: {len(events) - len(set(events))} events twice")
            if set(events) != set(expected):
                problems.append(
                    f"/messages {room}: {len(set(expected) - set(events))} events missing, "
                    f"{len(set(events) - set(expected))} not in /sync"
                )
            order = [self.acked[e][2] for e in events if e in self.acked]
            per_sender: Dict[Tuple[str, str], List[int]] = {}
            for b in order:
                _, phase, index, k = b.split()
                per_sender.setdefault((phase, index), []).append(int(k))
            for key, ks in per_sender.items():
                if ks != sorted(ks):
                    problems.append(f"/messages {room}: sender {key} out of order: {ks}")
            self.messages_reordered += sum(1 for a, b in zip(events, expected) if a != b)
        return problems


# ----------------------------------------------------------------- one mode


def positions_writes(hs: Homeserver) -> Tuple[int, int]:
    """Rows written (inserted, updated or deleted) in Synapse's and in the
    extension's positions tables, from the statistics."""
    rows = hs.sql(
        "SELECT relid::regclass::text, n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables "
        "WHERE relid IN ('public.stream_positions'::regclass, "
        "COALESCE(to_regclass('streampos.stream_positions'), 'public.stream_positions'::regclass))"
    )
    d = dict(rows)
    return d.get("stream_positions", 0), d.get("streampos.stream_positions", 0)


def run_mode(args: argparse.Namespace, mode: str) -> Tuple[Dict[str, Any], List[str]]:
    hs = Homeserver(args, mode)
    log(f"{mode}: database {hs.dbname}, config in {hs.dir}")
    hs.create_database()
    hs.write_config()
    hs.generate_keys()
    figures: Dict[str, Any] = {}
    problems: List[str] = []
    run = Run(hs, args)
    try:
        t = time.monotonic()
        hs.start_all()
        figures["start_seconds"] = time.monotonic() - t
        log(f"{mode}: started in {figures['start_seconds']:.1f}s; registering {args.clients} users, {args.rooms} rooms")
        run.setup()
        events_before = hs.sql("SELECT COALESCE(max(stream_ordering), 0) FROM events")[0][0]
        hs.sql("SELECT pg_stat_reset()")
        log(f"{mode}: throughput phase")
        figures.update(run.phase("a"))
        # Stopped processes flush their backends' statistics (the
        # extension's position worker too, stopped here; the next
        # allocation starts it again).
        hs.stop_all()
        hs.sql(
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
            "WHERE datname = current_database() AND backend_type = 'streampos position worker'"
        )
        time.sleep(1)
        figures["events_persisted"] = hs.sql(
            "SELECT count(*) FROM events WHERE stream_ordering > %s", events_before
        )[0][0]
        synapse_rows, extension_rows = positions_writes(hs)
        figures["stream_positions_rows"] = synapse_rows
        figures["stream_positions_rows_per_event"] = synapse_rows / max(figures["events_persisted"], 1)
        figures["extension_positions_rows"] = extension_rows
        log(f"{mode}: {figures}")

        log(f"{mode}: kill phase (restart, send, SIGKILL event_persister1 mid-run, start it again)")
        hs.start_all()
        at_kill: Dict[str, Any] = {}

        def killer(progress: List[int]) -> None:
            total = args.clients * args.messages
            while progress[0] < total * 0.4:
                time.sleep(0.05)
            if mode == "streampos":
                at_kill.update(
                    {s: hs.sql("SELECT streampos.max_allocated(%s)", s)[0][0] for s in STREAMS_CHECKED}
                )
            hs.kill("event_persister1")
            log(f"{mode}: killed event_persister1 after {progress[0]} messages")
            time.sleep(args.kill_seconds)
            hs.start("event_persister1")
            hs.wait_healthy("event_persister1", hs.ports.persister1)
            log(f"{mode}: event_persister1 is back")

        kill_figures = run.phase("b", during=killer)
        figures["kill_phase_messages"] = kill_figures["messages"]
        problems += run.check()
        figures["messages_positions_differing_from_sync"] = run.messages_reordered
        if mode == "streampos":
            for s, before in at_kill.items():
                frontier = hs.sql("SELECT streampos.frontier(%s)", s)[0][0]
                if frontier < before:
                    problems.append(f"stream {s}: frontier {frontier} below {before}, allocated before the kill")
            figures["frontier_events_after"] = hs.sql("SELECT streampos.frontier('events')")[0][0]
            figures["max_allocated_events_at_kill"] = at_kill.get("events")
            left = hs.sql("SELECT stream_name, instance_name, min_id, max_id FROM streampos.in_flight()")
            if left:
                # Holds end with their context; give the last ones a moment.
                time.sleep(2)
                left = hs.sql("SELECT stream_name, instance_name, min_id, max_id FROM streampos.in_flight()")
                if left:
                    problems.append(f"still in flight after the run: {left}")
    finally:
        hs.stop_all()
    figures["acknowledged"] = len(run.acked)
    return figures, problems


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["stock", "streampos", "both"], default="both")
    parser.add_argument("--pghost", default="127.0.0.1")
    parser.add_argument("--pgport", type=int, required=True)
    parser.add_argument("--port-base", type=int, default=56450)
    parser.add_argument("--work", required=True)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--rooms", type=int, default=4)
    parser.add_argument("--messages", type=int, default=40, help="per client and phase")
    parser.add_argument("--kill-seconds", type=float, default=2.0)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    redis = subprocess.Popen(
        ["redis-server", "--port", str(Ports(args.port_base).redis), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"],
        stdout=open(os.path.join(args.work, "redis.log"), "w"),
        stderr=subprocess.STDOUT,
    )
    results: Dict[str, Any] = {}
    failed = False
    try:
        modes = ["stock", "streampos"] if args.mode == "both" else [args.mode]
        for mode in modes:
            figures, problems = run_mode(args, mode)
            results[mode] = {"figures": figures, "problems": problems}
            for p in problems:
                log(f"{mode}: PROBLEM {p}")
            failed |= bool(problems)
    finally:
        redis.terminate()
        redis.wait()
    keys = [
        ("messages", "messages sent (throughput phase)"),
        ("per_second", "messages persisted per second"),
        ("sync_p50_ms", "/sync latency p50 (ms)"),
        ("sync_p95_ms", "/sync latency p95 (ms)"),
        ("sync_p99_ms", "/sync latency p99 (ms)"),
        ("events_persisted", "events persisted (all types)"),
        ("stream_positions_rows", "rows written to stream_positions"),
        ("stream_positions_rows_per_event", "  per persisted event"),
        ("extension_positions_rows", "rows the extension's worker wrote"),
        ("kill_phase_messages", "messages in the kill phase"),
        ("acknowledged", "acknowledged messages checked"),
        ("messages_positions_differing_from_sync", "/messages positions != /sync order"),
    ]
    print()
    print(f"{'':40}" + "".join(f"{m:>14}" for m in results))
    for key, label in keys:
        cells = []
        for m in results:
            v = results[m]["figures"].get(key)
            cells.append(f"{v:14.2f}" if isinstance(v, float) else f"{str(v):>14}")
        print(f"{label:40}" + "".join(cells))
    for m in results:
        print(f"{m}: {'FAILED' if results[m]['problems'] else 'all checks passed'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
