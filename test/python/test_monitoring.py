"""Monitoring (issue 21): the held-back warning as it appears in the server
log, and the Prometheus exporter's queries file
(monitoring/postgres_exporter_queries.yaml) run by the real
prometheus-postgres-exporter against the test server, its /metrics scraped
and compared with the views."""

import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid

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
    a function (database name) -> the /metrics URL."""
    binary = shutil.which(EXPORTER)
    if not binary:
        pytest.skip(f"{EXPORTER} is not installed (scripts/setup installs it)")
    procs = []

    def start(dbname):
        port = free_port()
        env = dict(
            os.environ,
            DATA_SOURCE_NAME=f"host={PGHOST} port={PGPORT} user={PGUSER} dbname={dbname} sslmode=disable",
        )
        proc = subprocess.Popen(
            [binary, f"--extend.query-path={os.path.abspath(QUERIES)}",
             f"--web.listen-address=127.0.0.1:{port}",
             "--disable-default-metrics", "--disable-settings-metrics"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}/metrics"

        def up():
            try:
                return scrape(url)[0]
            except OSError:
                return None

        wait_until(up, timeout=10, interval=0.1, message="the exporter")
        return url

    yield start
    for proc in procs:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        # The exporter logs a query that failed (e.g. a column it cannot
        # read) and goes on: that would be a bug of the queries file.
        assert b"level=error" not in out, out.decode()[-2000:]


def view_rows(conn, view):
    cur = conn.execute(f"SELECT * FROM streampos.{view}")
    names = [d.name for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


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
    for column in ["streams_max", "ring_size"]:
        assert metrics[(f"streampos_registry_{column}", frozenset())] == registry[column]
    assert metrics[("streampos_registry_ring_folds_total", frozenset())] == registry["ring_folds"]
    assert metrics[("streampos_registry_position_workers", frozenset())] >= 1
    [pusher] = consumers
    labels = frozenset({("stream", "events"), ("consumer", "pusher")})
    assert pusher["lag_ids"] == 7
    assert metrics[("streampos_consumer_lag_ids", labels)] == pusher["lag_ids"]
    assert pusher["lag_time"].total_seconds() > 0.5
    for metric, column in [("lag_seconds", "lag_time"), ("since_ack_seconds", "since_ack")]:
        assert metrics[(f"streampos_consumer_{metric}", labels)] == pytest.approx(pusher[column].total_seconds(), abs=2)


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
