"""The examples together, end to end: several event persister processes
(different instance names, out-of-order and aborted transactions) and a sync
reader started before them. The reader must receive every committed event
exactly once, each writer's events in order, and no rolled-back one."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from client_support import conninfo

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
WRITERS = ["event_persister1", "event_persister2", "event_persister3"]
EVENTS_PER_WRITER = 60


def spawn(script, *args):
    env = dict(os.environ)
    # Run from a checkout as well as from an installed package.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent / "src"), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_persisters_and_reader(db, stream):
    table = f"{stream}_events"
    db.execute("SELECT streampos.create_stream(%s, writers => %s)", (stream, WRITERS))
    db.execute(f"CREATE TABLE {table} (stream_ordering bigint PRIMARY KEY, instance_name text NOT NULL, body jsonb)")
    db.execute("SELECT streampos.add_table(%s, %s, 'stream_ordering', 'instance_name')", (stream, table))
    dsn = conninfo()

    reader = spawn(
        "sync_reader.py", "--dsn", dsn, "--stream", stream, "--table", table, "--writers", str(len(WRITERS)),
        "--page", "7", "--timeout-ms", "1000", "--max-seconds", "120",
    )
    persisters = [
        spawn(
            "event_persister.py", "--dsn", dsn, "--stream", stream, "--table", table, "--instance", name,
            "--events", str(EVENTS_PER_WRITER), "--concurrency", "4",
        )
        for name in WRITERS
    ]
    summaries = []
    try:
        for proc in persisters:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            summaries.append(json.loads(out))
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0, err
    finally:
        for proc in [reader, *persisters]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    received = [json.loads(line) for line in out.splitlines()]
    ids = [event["id"] for event in received]
    committed = sorted(i for s in summaries for i in s["committed"])
    aborted = {i for s in summaries for i in s["aborted"]}
    in_table = [r[0] for r in db.execute(f"SELECT stream_ordering FROM {table} ORDER BY 1").fetchall()]

    assert in_table == committed
    duplicates = [i for i, n in Counter(ids).items() if n > 1]
    assert duplicates == []
    assert sorted(ids) == committed
    assert not aborted & set(ids)
    assert len(aborted) >= len(WRITERS)  # the gaps were really there
    for name in WRITERS:
        own = [e["id"] for e in received if e["instance"] == name]
        assert own == sorted(own), f"{name}'s events out of order"
        assert received[[e["id"] for e in received].index(max(own))]["body"].get("done")
    # Every ID ever handed out was either committed or rolled back.
    assert sorted([*committed, *aborted]) == list(range(1, len(committed) + len(aborted) + 1))
