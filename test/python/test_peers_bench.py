"""bench/peers.py, the side-by-side harness of README's "Beside other
designs" (issue 36), works: run in its quickest form against the test
server (about 30 s, in a database of its own), streampos's two readers miss
and repeat no row in any scenario, the ordered one delivers in global ID
order, the xid8 recipe misses nothing, and the checker can fail: the naive
poller's misses in the bulk import are seen."""

import json
import os
import subprocess
import sys

from support import PGHOST, PGPORT, PGUSER, connect_raw

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
DBNAME = "streampos_peers_test"


def test_the_side_by_side_bench_runs_and_its_checker_sees_misses(tmp_path):
    numbers = tmp_path / "peers.json"
    command = [sys.executable, os.path.join(ROOT, "bench", "peers.py"), "--host", PGHOST, "--port", str(PGPORT),
               "--user", PGUSER, "--dbname", DBNAME, "--quick", "--json", str(numbers),
               "--out", str(tmp_path / "peers.md")]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=240)
    finally:
        with connect_raw("postgres") as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {DBNAME} WITH (FORCE)")
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(numbers.read_text())
    scenarios = {s["key"]: s for s in result["scenarios"]}
    assert list(scenarios) == ["steady", "big", "import", "rollback", "idle", "idle_id", "slow", "kill"]
    # The harness agrees with itself: the table holds exactly the commits it
    # recorded, nothing of the killed client, and no reader delivered an ID
    # that is not a committed row.
    broken = [n for n in result["notes"] if "not settled" not in n]
    assert not broken, broken

    for s in scenarios.values():
        for reader in ("streampos", "ordered", "xid8"):
            cell = s["readers"][reader]
            assert (cell["missed"], cell["twice"]) == (0, 0), (s["label"], reader, cell)
        assert s["readers"]["ordered"]["out_of_order"] == 0, s
        assert s["rows"] > 0, s
    # The checker can fail: every import row commits after higher IDs the
    # naive poller has passed.
    assert scenarios["import"]["rows"] >= 5000
    assert scenarios["import"]["readers"]["naive"]["missed"] > 0, scenarios["import"]
    assert "FINDING" not in run.stderr, run.stderr
    assert "| naive `id > last` |" in (tmp_path / "peers.md").read_text()
