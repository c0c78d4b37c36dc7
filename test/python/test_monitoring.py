"""Monitoring (issues 21 and 35): the held-back warning as it appears in the
server log; the Prometheus exporter's queries file
(monitoring/postgres_exporter_queries.yaml) run by the real
prometheus-postgres-exporter against the test server, its /metrics scraped
and compared with the views; the alert rules (monitoring/alerts.yml) in
promtool's unit tests and in a real Prometheus scraping that exporter; and
the Grafana dashboard (monitoring/grafana-dashboard.json), every panel's
query evaluated by that Prometheus."""

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from support import (
    PGHOST,
    PGPORT,
    PGUSER,
    ServerLog,
    backend_pid,
    commit_ids,
    connect_raw,
    create_stream,
    next_id,
    one,
    rows,
    scratch_database,
    server_settings,
    wait_until,
)

QUERIES = os.path.join(os.path.dirname(__file__), "..", "..", "monitoring", "postgres_exporter_queries.yaml")
EXPORTER = "prometheus-postgres-exporter"


# --------------------------------------------------------------- held-back warnings


def held_back_lines(log, stream):
    return [line for line in log.lines() if f'stream "{stream}"' in line and "held back" in line]


def test_a_transaction_holding_a_stream_back_is_logged_once_and_when_it_ends(connect, db, stream):
    log = ServerLog()
    create_stream(db, stream)
    with server_settings({"streampos.log_held_back_after": "500ms"}):
        holder = connect()
        holder.execute("BEGIN")
        held = next_id(holder, stream, "slow_persister")
        commit_ids(connect(), stream, "fast_persister", 3)
        warning = wait_until(lambda: held_back_lines(log, stream), timeout=5, message="the warning")
        time.sleep(1)  # more passes: still one line
        assert len(held_back_lines(log, stream)) == 1
        line = warning[0]
        assert " WARNING:  streampos: " in line
        assert re.search(
            rf'stream "{stream}" held back for [0-9.]+ s by ID {held} of instance "slow_persister" '
            rf"\(pid {backend_pid(holder)}, its transaction started [0-9.]+ s ago\); "
            r"3 IDs above it are finished and wait for it",
            line,
        ), line
        holder.execute("COMMIT")
        ended = wait_until(lambda: held_back_lines(log, stream)[1:], timeout=5, message="the end line")
        assert " LOG:  streampos: " in ended[0]
        assert re.search(
            rf'stream "{stream}" is no longer held back by ID {held} of instance "slow_persister" '
            rf"\(pid {backend_pid(holder)}\): it held the stream back for [0-9.]+ s",
            ended[0],
        ), ended[0]


def test_a_session_hold_is_named_and_zero_disables_the_warning(connect, db, stream):
    log = ServerLog()
    create_stream(db, stream)
    with server_settings({"streampos.log_held_back_after": "0"}):
        holder = connect()
        holder.execute("BEGIN")
        next_id(holder, stream, "w1")
        commit_ids(connect(), stream, "w2")
        time.sleep(1.5)
        assert held_back_lines(log, stream) == []
        holder.execute("COMMIT")
    with server_settings({"streampos.log_held_back_after": "300ms"}):
        holder = connect()
        ids = rows(holder, "SELECT unnest(streampos.hold_ids(%s, 'persister', 2))", (stream,))
        commit_ids(connect(), stream, "w2")
        line = wait_until(lambda: held_back_lines(log, stream), timeout=5, message="the warning")[0]
        assert f'by ID {ids[0][0]} held by instance "persister" (pid {backend_pid(holder)}, a hold of its session' in line
        holder.execute("SELECT streampos.release_ids(%s, %s)", (stream, [i for (i,) in ids]))
        wait_until(lambda: held_back_lines(log, stream)[1:], timeout=5, message="the end line")


# --------------------------------------------------------------- the exporter


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url):
    """{(metric, frozenset(labels)): value} of the streampos metrics."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    metrics = {}
    for line in text.splitlines():
        m = re.match(r"^(streampos_\w+)(?:\{(.*)\})? (\S+)$", line)
        if not m:
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        labels = frozenset((k, v) for k, v in labels if k != "server")
        metrics[(m.group(1), labels)] = float(m.group(3))
    return metrics, text


@pytest.fixture
def exporter():
    """The exporter started against a database of the test server; yields
    a function (database name, queries file, whether its log may have
    errors) -> the /metrics URL."""
    binary = shutil.which(EXPORTER)
    if not binary:
        pytest.skip(f"{EXPORTER} is not installed (scripts/setup installs it)")
    procs = []

    def start(dbname, queries=QUERIES, errors_expected=False):
        port = free_port()
        env = dict(
            os.environ,
            DATA_SOURCE_NAME=f"host={PGHOST} port={PGPORT} user={PGUSER} dbname={dbname} sslmode=disable",
        )
        # Not the bgwriter collector: 0.11's reads pg_stat_bgwriter's
        # checkpoint columns, which PostgreSQL 17 moved (an error each scrape).
        proc = subprocess.Popen(
            [binary, f"--extend.query-path={os.path.abspath(queries)}",
             f"--web.listen-address=127.0.0.1:{port}",
             "--disable-default-metrics", "--disable-settings-metrics", "--no-collector.bgwriter"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        procs.append((proc, errors_expected))
        url = f"http://127.0.0.1:{port}/metrics"

        def up():
            try:
                return scrape(url)
            except OSError:
                return None

        wait_until(up, timeout=10, interval=0.1, message="the exporter")
        return url

    yield start
    for proc, errors_expected in procs:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        # The exporter logs a query that failed (e.g. a column it cannot
        # read) and goes on: that would be a bug of the queries file.
        assert errors_expected or b"level=error" not in out, out.decode()[-2000:]


def view_rows(conn, view):
    cur = conn.execute(f"SELECT * FROM streampos.{view}")
    names = [d.name for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def in_flight_series(metrics, column):
    """{(stream, instance_name): value} of streampos_in_flight_<column>."""
    return {
        (dict(labels)["stream"], dict(labels)["instance_name"]): value
        for (metric, labels), value in metrics.items()
        if metric == f"streampos_in_flight_{column}"
    }


def test_the_exporter_shows_the_views(exporter, connect):
    name = f"streampos_exporter_{uuid.uuid4().hex[:6]}"
    with scratch_database(name), connect_raw(name) as c:
        create_stream(c, "events")
        create_stream(c, "receipts")
        create_stream(c, "backfill", backwards=True)
        # A consumer that acknowledges nothing: its lag grows.
        c.execute("SELECT streampos.register_consumer('events', 'pusher')")
        commit_ids(c, "events", "persister1", 3)
        commit_ids(c, "backfill", "persister1", 2)
        with connect_raw(name) as w:
            w.execute("BEGIN")
            next_id(w, "events", "persister1")
            w.execute("ROLLBACK")
        holder = connect_raw(name)
        holder.execute("BEGIN")
        next_id(holder, "events", "slow")
        commit_ids(c, "events", "persister2", 2)
        # Quiet from here on: the worker has stored what it can, and
        # marked the token that passed the consumer (its lag in time counts
        # from that mark; on a loaded machine the pass comes later).
        wait_until(lambda: view_rows(c, "stat_streams")[1]["store_lag_ids"] == 0 and
                   view_rows(c, "stat_streams")[1]["frontier_lag_seconds"] > 0.5 and
                   view_rows(c, "consumers")[0]["lag_time"].total_seconds() > 0.5,
                   message="the worker's passes")
        url = exporter(name)
        metrics, text = scrape(url)
        streams = {r["stream_name"]: r for r in view_rows(c, "stat_streams")}
        consumers = view_rows(c, "consumers")
        safe = one(c, "SELECT streampos.stream_pos(streampos.safe_to_delete('events'))")
        newest = one(c, "SELECT streampos.max_stream_pos(streampos.current_token('events'))")
        registry = view_rows(c, "stat_registry")[0]
        holder.execute("ROLLBACK")
        holder.close()

    print("\n".join(line for line in text.splitlines() if line.startswith("streampos_")))
    assert set(streams) == {"events", "receipts", "backfill"}
    exact = {
        "ids_allocated_total": "ids_allocated",
        "xact_commit_total": "xact_commit",
        "xact_rollback_total": "xact_rollback",
        "max_allocated": "max_allocated",
        "frontier": "frontier",
        "frontier_lag_ids": "frontier_lag_ids",
        "ids_in_flight": "ids_in_flight",
        "followers_waiting": "followers_waiting",
        "store_lag_ids": "store_lag_ids",
    }
    for stream, row in streams.items():
        labels = frozenset({("stream", stream)})
        for metric, column in exact.items():
            assert metrics[(f"streampos_stream_{metric}", labels)] == row[column], (stream, metric)
        stored = row["last_store"].timestamp() if row["last_store"] else 0
        assert metrics[("streampos_stream_last_store_timestamp_seconds", labels)] == pytest.approx(stored, abs=0.01)
        for metric in ["frontier_lag_seconds", "oldest_in_flight_seconds", "store_lag_seconds"]:
            assert metrics[(f"streampos_stream_{metric}", labels)] == pytest.approx(row[metric] or 0, abs=2), metric
    events = streams["events"]
    assert (events["ids_allocated"], events["xact_commit"], events["xact_rollback"]) == (7, 2, 1)
    assert events["frontier_lag_ids"] == 3 and events["ids_in_flight"] == 1
    assert metrics[("streampos_stream_frontier_lag_seconds", frozenset({("stream", "events")}))] > 0.5
    assert metrics[("streampos_stream_oldest_in_flight_seconds", frozenset({("stream", "events")}))] > 0.5
    assert metrics[("streampos_stream_frontier", frozenset({("stream", "backfill")}))] == -2
    in_flight = frozenset({("stream", "events"), ("instance_name", "slow")})
    assert metrics[("streampos_in_flight_ids", in_flight)] == 1
    assert metrics[("streampos_in_flight_holders", in_flight)] == 1
    # Every writer a stream knows has its series, 0 with nothing in flight,
    # and every stream one with instance_name "" (IDs no writer is named
    # for): summed, they are the stream's ids_in_flight.
    assert in_flight_series(metrics, "ids") == {
        ("events", ""): 0, ("events", "persister1"): 0, ("events", "persister2"): 0, ("events", "slow"): 1,
        ("receipts", ""): 0, ("backfill", ""): 0, ("backfill", "persister1"): 0,
    }
    for stream, row in streams.items():
        assert sum(v for (s, _), v in in_flight_series(metrics, "ids").items() if s == stream) == row["ids_in_flight"]
    for column in ["streams_max", "ring_size"]:
        assert metrics[(f"streampos_registry_{column}", frozenset())] == registry[column]
    assert metrics[("streampos_registry_ring_folds_total", frozenset())] == registry["ring_folds"]
    assert metrics[("streampos_registry_position_workers", frozenset())] >= 1
    # Retention: only streams with consumers.
    retention = frozenset({("stream", "events")})
    assert metrics[("streampos_retention_safe_to_delete_position", retention)] == safe
    assert metrics[("streampos_retention_held_ids", retention)] == newest - safe > 0
    assert not any(m.startswith("streampos_retention_") and ("stream", "receipts") in labels
                   for m, labels in metrics)
    [pusher] = consumers
    labels = frozenset({("stream", "events"), ("consumer", "pusher")})
    assert pusher["lag_ids"] == 7
    assert metrics[("streampos_consumer_lag_ids", labels)] == pusher["lag_ids"]
    assert pusher["lag_time"].total_seconds() > 0.5
    for metric, column in [("lag_seconds", "lag_time"), ("since_ack_seconds", "since_ack")]:
        assert metrics[(f"streampos_consumer_{metric}", labels)] == pytest.approx(pusher[column].total_seconds(), abs=2)


def test_the_in_flight_series_exist_with_zero_when_nothing_is_in_flight(exporter):
    """A rule or panel on streampos_in_flight_* tells "none in flight" (0)
    from "not scraped" (no series): with nothing in flight every stream has
    its series, one per writer it knows (configured writers, or every writer
    seen) and one with instance_name "", all 0; with something in flight the
    label sets are the same."""
    name = f"streampos_exporter_{uuid.uuid4().hex[:6]}"
    with scratch_database(name), connect_raw(name) as c:
        create_stream(c, "events")
        create_stream(c, "receipts", writers=["r1", "r2"])
        create_stream(c, "backfill", backwards=True)
        commit_ids(c, "events", "persister1", 2)
        commit_ids(c, "events", "persister2")
        ids = rows(c, "SELECT unnest(streampos.hold_ids('events', 'persister2', 2))")
        c.execute("SELECT streampos.release_ids('events', %s)", ([i for (i,) in ids],))
        url = exporter(name)
        idle, _ = scrape(url)
        with connect_raw(name) as holder, connect_raw(name) as writer:
            holder.execute("SELECT streampos.hold_ids('receipts', 'r2', 3)")
            writer.execute("BEGIN")
            next_id(writer, "events", "persister1")
            busy, _ = scrape(url)
            writer.execute("ROLLBACK")

    zeros = {("events", ""): 0, ("events", "persister1"): 0, ("events", "persister2"): 0,
             ("receipts", ""): 0, ("receipts", "r1"): 0, ("receipts", "r2"): 0, ("backfill", ""): 0}
    assert in_flight_series(idle, "ids") == zeros
    assert in_flight_series(idle, "holders") == zeros
    assert in_flight_series(busy, "ids") == {**zeros, ("events", "persister1"): 1, ("receipts", "r2"): 3}
    assert in_flight_series(busy, "holders") == {**zeros, ("events", "persister1"): 1, ("receipts", "r2"): 1}


def test_a_locked_table_fails_one_query_at_once_and_the_others_answer(exporter, connect):
    """An operator's lock on consumer_positions: the scrape does not wait
    for it (it sat in Lock/relation for as long as the lock was held). The
    consumers' query fails at once (55P03), its series are missing, every
    other series is there, and the exporter says a query failed
    (pg_exporter_last_scrape_error, StreamposExporterQueryFailing)."""
    name = f"streampos_exporter_{uuid.uuid4().hex[:6]}"
    with scratch_database(name), connect_raw(name) as c:
        create_stream(c, "events")
        c.execute("SELECT streampos.register_consumer('events', 'pusher')")
        commit_ids(c, "events", "persister1", 3)
        url = exporter(name, errors_expected=True)
        assert any(m == "streampos_consumer_lag_ids" for m, _ in scrape(url)[0])
        holder = connect_raw(name)
        try:
            holder.execute("BEGIN")
            holder.execute("LOCK TABLE streampos.consumer_positions IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            metrics, text = scrape(url)
            took = time.monotonic() - started
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        names = {m for m, _ in metrics}
        assert not any(m.startswith("streampos_consumer_") for m in names), names
        assert {"streampos_stream_frontier", "streampos_registry_streams_max", "streampos_in_flight_ids"} <= names
        assert re.search(r"^pg_exporter_last_scrape_error(\{[^}]*\})? 1$", text, re.M), text[-2000:]
        # The scrape's own statement timeout would be the exporter's; here
        # it answered without waiting for the lock.
        assert took < 5, took
        metrics, text = scrape(url)
        assert any(m == "streampos_consumer_lag_ids" for m, _ in metrics)
        assert re.search(r"^pg_exporter_last_scrape_error(\{[^}]*\})? 0$", text, re.M)


# --------------------------------------------------------------- alert rules

MONITORING = os.path.join(os.path.dirname(__file__), "..", "..", "monitoring")


def promtool():
    tool = shutil.which("promtool")
    if tool is None:
        # scripts/setup installs it (Debian's prometheus); CI must run this.
        if os.environ.get("CI"):
            pytest.fail("promtool is missing: scripts/setup installs Debian's prometheus")
        pytest.skip("promtool is not installed (scripts/setup installs Debian's prometheus)")
    return tool


def test_the_alert_rules_are_valid_and_each_fires_in_promtools_unit_tests():
    """monitoring/alerts.yml passes `promtool check rules`, and
    monitoring/alerts_test.yml (each alert fires after its `for`, not
    before; with nothing scraped only the absence fires; a healthy server
    fires nothing) passes `promtool test rules`."""
    tool = promtool()
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run([tool, *args], cwd=MONITORING, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"


def test_every_alert_has_a_summary_a_description_a_runbook_and_is_tested():
    rules = [r for g in yaml.safe_load(open(os.path.join(MONITORING, "alerts.yml")))["groups"] for r in g["rules"]]
    tests = yaml.safe_load(open(os.path.join(MONITORING, "alerts_test.yml")))["tests"]
    fired = {t["alertname"] for group in tests for t in group["alert_rule_test"] if t["exp_alerts"]}
    for rule in rules:
        assert {"summary", "description", "runbook"} <= set(rule.get("annotations", {})), rule["alert"]
        assert rule["alert"] in fired, f"{rule['alert']} is never fired in alerts_test.yml"
    # The README lists every alert (README, "Monitoring").
    readme = open(os.path.join(MONITORING, "..", "README.md")).read()
    for rule in rules:
        assert f"`{rule['alert']}`" in readme, f"README does not list {rule['alert']}"


# --------------------------------------------------------------- a real Prometheus

ALERTS = os.path.join(MONITORING, "alerts.yml")
DASHBOARD = os.path.join(MONITORING, "grafana-dashboard.json")


def prometheus_binary():
    binary = shutil.which("prometheus")
    if binary is None:
        # scripts/setup installs it (Debian's prometheus); CI must run this.
        if os.environ.get("CI"):
            pytest.fail("prometheus is missing: scripts/setup installs Debian's prometheus")
        pytest.skip("prometheus is not installed (scripts/setup installs Debian's prometheus)")
    return binary


class Prometheus:
    """A running Prometheus: its HTTP API (/api/v1/...)."""

    def __init__(self, proc, url, log):
        self.proc, self.url, self.log = proc, url, log

    def api(self, path, **params):
        """The answer of /api/v1/<path> (a query's error too: 400, 422)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = urllib.request.urlopen(url, timeout=10).read()
        except urllib.error.HTTPError as e:
            body = e.read()
        return json.loads(body)

    def query(self, expr):
        """An instant query's series; fails the test if it does not parse."""
        answer = self.api("query", query=expr)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def alerts(self, state=None):
        """{(alert name, stream or instance): alert} of the pending and firing
        alerts (of one state)."""
        return {
            (a["labels"]["alertname"], a["labels"].get("stream") or a["labels"].get("instance")): a
            for a in self.api("alerts")["data"]["alerts"]
            if state in (None, a["state"])
        }

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def prometheus(tmp_path):
    """A real Prometheus (Debian's prometheus) with a generated
    configuration: each target scraped every second, the rules evaluated
    every second, its own storage under tmp_path, a free port. Yields a
    function ({job: exporter's /metrics URL}, rules file) -> Prometheus,
    up once it scraped every target. A test stops it (Prometheus.stop)
    before it drops the database the exporters read: a scrape after that
    would make the exporter log an error."""
    binary = prometheus_binary()
    started = []

    def start(targets, rules):
        port = free_port()
        work = tmp_path / f"prometheus-{port}"
        work.mkdir()
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [os.path.abspath(rules)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [urllib.parse.urlsplit(url).netloc]}]}
                for job, url in targets.items()
            ],
        }
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = work / "prometheus.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT,
            )
        prom = Prometheus(proc, f"http://127.0.0.1:{port}", log)
        started.append(prom)

        def ready():
            assert proc.poll() is None, f"prometheus exited:\n{log.read_text()[-3000:]}"
            try:
                return urllib.request.urlopen(f"{prom.url}/-/ready", timeout=5).status == 200
            except OSError:
                return False

        wait_until(ready, timeout=60, interval=0.2, message="Prometheus to be ready")
        wait_until(lambda: {s["metric"]["job"] for s in prom.query("up == 1")} == set(targets),
                   timeout=30, interval=0.2, message="a scrape of every target")
        return prom

    yield start
    for prom in started:
        prom.stop()
        # A rule that failed to evaluate is logged (as a warning).
        text = prom.log.read_text()
        assert "level=error" not in text and "Evaluating rule failed" not in text, text[-3000:]


def rules_for_a_test(tmp_path):
    """A copy of monitoring/alerts.yml whose alerts fire within seconds:
    each rule's `for` is 1s, and its threshold in seconds (60 or 300 s) is
    1 s. The expressions are otherwise the shipped ones (metrics, labels,
    comparison), so what fires here from live data fires from the shipped
    rules after their durations."""
    rules = yaml.safe_load(open(ALERTS))
    shortened = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = "1s"
            expr = re.sub(r"(_seconds > )\d+$", r"\g<1>1", rule["expr"])
            if expr != rule["expr"]:
                shortened.add(rule["alert"])
                rule["expr"] = expr
    assert shortened == {"StreamposStreamHeldBack", "StreamposOldTransactionInFlight",
                         "StreamposPositionsNotStored", "StreamposConsumerBehind"}, shortened
    path = tmp_path / "alerts-for-a-test.yml"
    path.write_text(yaml.safe_dump(rules))
    return path


def firing(prom, expected, timeout=30):
    """Waits until every (alert, stream or instance) in ``expected`` fires;
    each went through pending first (Prometheus' ALERTS series recorded
    it). Returns the firing alerts."""
    def all_firing():
        alerts = prom.alerts("firing")
        return alerts if expected <= set(alerts) else None

    alerts = wait_until(all_firing, timeout=timeout, interval=0.2, message=f"{sorted(expected)} to fire")
    for name, where in expected:
        label = "stream" if alerts[(name, where)]["labels"].get("stream") else "instance"
        pending = f'ALERTS{{alertname="{name}", alertstate="pending", {label}="{where}"}}'
        assert prom.query(f"count_over_time({pending}[10m])"), f"{name} was never pending"
    return alerts


def test_a_real_prometheus_fires_the_alerts_from_live_data(exporter, prometheus, tmp_path):
    """Prometheus scraping the real exporter with the alert rules (a copy
    whose `for` and thresholds in seconds are 1 s, rules_for_a_test): a
    transaction holding a stream back fires StreamposStreamHeldBack and
    StreamposOldTransactionInFlight for that stream, a consumer that does
    not acknowledge StreamposConsumerBehind, an exporter whose queries file
    does not load StreamposExporterQueriesNotLoaded for that exporter, a
    catalog change left open StreamposPositionsNotStored; each goes
    pending, then firing; nothing fires for the idle stream, and the
    alerts resolve when their cause ends."""
    name = f"streampos_exporter_{uuid.uuid4().hex[:6]}"
    broken = tmp_path / "broken_queries.yaml"
    broken.write_text("streampos_stream:\n  query: [not closed\n")
    with scratch_database(name), connect_raw(name) as c:
        create_stream(c, "events")
        create_stream(c, "receipts")
        c.execute("SELECT streampos.register_consumer('events', 'pusher')")
        commit_ids(c, "events", "persister1", 3)
        holder = connect_raw(name)
        holder.execute("BEGIN")
        next_id(holder, "events", "slow")
        commit_ids(c, "events", "persister2", 2)
        good, bad = exporter(name), exporter(name, queries=broken, errors_expected=True)
        prom = prometheus({"streampos": good, "broken": bad}, rules_for_a_test(tmp_path))
        try:
            good_instance, bad_instance = (urllib.parse.urlsplit(u).netloc for u in (good, bad))
            alerts = firing(prom, {("StreamposStreamHeldBack", "events"),
                                   ("StreamposOldTransactionInFlight", "events"),
                                   ("StreamposConsumerBehind", "events"),
                                   ("StreamposExporterQueriesNotLoaded", bad_instance)})
            held = alerts[("StreamposStreamHeldBack", "events")]
            assert held["labels"]["instance"] == good_instance and held["labels"]["severity"] == "warning"
            assert held["annotations"]["summary"] == "stream events has been held back for over a minute"
            assert "streampos.in_flight('events')" in held["annotations"]["runbook"]
            assert alerts[("StreamposConsumerBehind", "events")]["labels"]["consumer"] == "pusher"
            assert alerts[("StreamposExporterQueriesNotLoaded", bad_instance)]["labels"]["filename"] == str(broken)
            # Nothing for the idle stream, the good exporter's queries, the
            # registry; the series are there, so no absence.
            for alert_name, where in prom.alerts():
                assert where not in ("receipts", good_instance), (alert_name, where)
                assert alert_name not in ("StreamposMetricsAbsent", "StreamposRegistryNearlyFull"), alert_name
            assert prom.query('streampos_in_flight_ids{stream="events", instance_name="slow"} == 1')

            # The transaction ends: the stream is no longer held back. An
            # operator's catalog change left open (set_writers in a
            # transaction): the worker does not overtake it, and stores
            # nothing for the stream while its frontier moves.
            holder.execute("ROLLBACK")
            holder.close()
            with connect_raw(name) as operator:
                operator.execute("BEGIN")
                operator.execute("SELECT streampos.set_writers('events', NULL)")
                commit_ids(c, "events", "persister1", 2)
                alerts = firing(prom, {("StreamposPositionsNotStored", "events")})
                assert "pg_locks" in alerts[("StreamposPositionsNotStored", "events")]["annotations"]["runbook"]
                wait_until(lambda: ("StreamposStreamHeldBack", "events") not in prom.alerts(), timeout=30,
                           interval=0.2, message="the held-back alert to resolve")
                operator.execute("ROLLBACK")
            wait_until(lambda: ("StreamposPositionsNotStored", "events") not in prom.alerts(), timeout=30,
                       interval=0.2, message="the store alert to resolve")
        finally:
            prom.stop()


def dashboard_queries(dashboard):
    """(panel title, expression with the template variables substituted)
    of every panel's target: each variable as its "All" (.*), Grafana's
    intervals as 1m."""
    variables = {v["name"]: v.get("allValue") or ".*" for v in dashboard["templating"]["list"]}
    builtin = {"__rate_interval": "1m", "__interval": "1m", "__range": "1m"}

    def substitute(expr):
        def value(m):
            name = m.group(1) or m.group(2)
            assert name in variables or name in builtin, f"unknown variable ${name} in {expr}"
            return variables.get(name) or builtin[name]
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)

    return [(panel["title"], substitute(target["expr"]))
            for panel in dashboard["panels"] if panel["type"] != "row"
            for target in panel["targets"]]


def test_the_dashboard_is_a_grafana_model_with_a_datasource_input():
    """monitoring/grafana-dashboard.json imports anywhere: a Grafana
    dashboard model whose every datasource is the ${DS_PROMETHEUS} input
    (asked for at import), panels with unique ids and a place on the grid
    that overlaps no other, each with Prometheus targets (an expression, a
    unique refId); the series the queries file exports and the exporter's
    load error are on it."""
    dashboard = json.load(open(DASHBOARD))
    assert dashboard["__inputs"] == [{
        "name": "DS_PROMETHEUS", "label": "Prometheus", "description": dashboard["__inputs"][0]["description"],
        "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}]
    source = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    assert dashboard["id"] is None and dashboard["uid"] and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    required = {r["id"] for r in dashboard["__requires"]}
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["type"] in required, panel["type"]
        assert panel["title"] and panel["description"], panel
        assert panel["datasource"] == source, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == source and target["expr"].strip(), panel["title"]
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"] == source and variable["query"], variable["name"]
    for annotation in dashboard["annotations"]["list"]:
        assert annotation.get("builtIn") or annotation["datasource"] == source, annotation["name"]
    # Every streampos series of the queries file and the load error, but
    # those the dashboard shows otherwise: the positions themselves (their
    # difference is the frontier lag), the last store (store_lag_seconds
    # counts from it), a stream's IDs in flight (the per-writer panel).
    exported = {"pg_exporter_user_queries_load_error"}
    for query, spec in yaml.safe_load(open(QUERIES)).items():
        for metric in spec["metrics"]:
            [(column, about)] = metric.items()
            if about["usage"] != "LABEL":
                exported.add(f"{query}_{column}")
    shown = " ".join(expr for _, expr in dashboard_queries(dashboard))
    assert {m for m in exported if not re.search(rf"\b{m}\b", shown)} == {
        "streampos_stream_max_allocated", "streampos_stream_last_store_timestamp_seconds",
        "streampos_stream_ids_in_flight"}


def label_values(prom, query):
    """A template variable's query (Grafana's label_values(selector,
    label)) through Prometheus' label values API."""
    m = re.fullmatch(r"label_values\((.*), *(\w+)\)", query)
    assert m, query
    answer = prom.api(f"label/{m.group(2)}/values", **{"match[]": m.group(1)})
    assert answer["status"] == "success", (query, answer)
    return answer["data"]


def test_every_dashboard_query_returns_series_from_a_real_prometheus(exporter, prometheus):
    """Prometheus with the shipped rules (every rule loads and evaluates)
    scraping the exporter of a server with streams, a consumer, a follower
    waiting and a transaction holding a stream back: every panel's query of
    the dashboard, its variables as "All", parses and returns at least one
    series after a few scrapes; the template variables' queries find the
    exporter, the streams and the consumer; the annotation's query parses."""
    dashboard = json.load(open(DASHBOARD))
    queries = dashboard_queries(dashboard)
    name = f"streampos_exporter_{uuid.uuid4().hex[:6]}"
    with scratch_database(name), connect_raw(name) as c, ThreadPoolExecutor(1) as pool:
        create_stream(c, "events")
        create_stream(c, "backfill", backwards=True)
        create_stream(c, "receipts")
        c.execute("SELECT streampos.register_consumer('events', 'pusher')")
        commit_ids(c, "events", "persister1", 3)
        commit_ids(c, "backfill", "persister1", 2)
        holder, follower = connect_raw(name), connect_raw(name)
        holder.execute("BEGIN")
        next_id(holder, "events", "slow")
        commit_ids(c, "events", "persister2", 2)
        waited = pool.submit(lambda: follower.execute("SELECT streampos.wait_for('receipts', 1, 60000)").fetchone())
        wait_until(lambda: rows(c, "SELECT followers_waiting FROM streampos.stat_streams "
                                   "WHERE stream_name = 'receipts'") == [(1,)], message="the follower's wait")
        url = exporter(name)
        prom = prometheus({"streampos": url}, ALERTS)
        try:
            shipped = [r["alert"] for g in yaml.safe_load(open(ALERTS))["groups"] for r in g["rules"]]
            wait_until(lambda: all(r["health"] == "ok" and r.get("lastEvaluation", "").startswith("2")
                                   for g in prom.api("rules")["data"]["groups"] for r in g["rules"]),
                       timeout=10, interval=0.2, message="every rule evaluated")
            rules = [r for g in prom.api("rules")["data"]["groups"] for r in g["rules"]]
            assert sorted(r["name"] for r in rules) == sorted(shipped)
            assert all(r["health"] == "ok" for r in rules), rules

            # Rates need two samples in their window: a few scrapes.
            def empty():
                return [(title, expr) for title, expr in queries if not prom.query(expr)]

            wait_until(lambda: not empty(), timeout=30, interval=0.5, message="a series for every query")
            results = [(title, expr, prom.query(expr)) for title, expr in queries]
            print("\n".join(f"{title}: {expr}: {len(series)} series" for title, expr, series in results))
            variables = {v["name"]: v["query"].replace("$instance", ".*").replace("$stream", ".*")
                         for v in dashboard["templating"]["list"]}
            assert label_values(prom, variables["instance"]) == [urllib.parse.urlsplit(url).netloc]
            assert label_values(prom, variables["stream"]) == ["backfill", "events", "receipts"]
            assert label_values(prom, variables["consumer"]) == ["pusher"]
            for annotation in dashboard["annotations"]["list"]:
                if "expr" in annotation:
                    prom.query(annotation["expr"].replace("$instance", ".*"))
            # What the live panels show: who holds events back, a follower
            # waiting on receipts.
            panels = {title: series for title, _, series in results}
            [by_whom] = panels["Writers holding a stream back"]
            assert (by_whom["metric"]["stream"], by_whom["metric"]["instance_name"]) == ("events", "slow")
            waiting = {r["metric"]["stream"]: r["value"][1] for r in panels["Followers waiting"]}
            assert waiting == {"events": "0", "backfill": "0", "receipts": "1"}
        finally:
            prom.stop()
            holder.execute("ROLLBACK")
            holder.close()
            commit_ids(c, "receipts", "w1")
            assert waited.result(timeout=30) == (1,)
            follower.close()
