"""A third language: clients/javascript/example.js (node-postgres, nothing
but SQL: two writers, a follower with its token and a consumer that
acknowledges each batch in its transaction) run against the test database,
under the trap fixture. It exits 0 only if every row reached the follower
and the consumer exactly once (README, "From any language")."""

import json
import os
import shutil
import subprocess

import pytest

from support import PGHOST, PGPORT, PGUSER

EXAMPLE = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "clients", "javascript"))


def node():
    binary = shutil.which("node")
    modules = os.path.join(EXAMPLE, "node_modules", "pg")
    missing = "node is not installed" if binary is None else (
        None if os.path.isdir(modules) else "clients/javascript has no node_modules (scripts/setup runs npm ci)")
    if missing:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    return binary


def test_the_javascript_example_gets_every_row_once(database, stream):
    binary = node()
    env = dict(os.environ, PGHOST=PGHOST, PGPORT=str(PGPORT), PGUSER=PGUSER, PGDATABASE=database,
               STREAM=stream, ROWS="150")
    done = subprocess.run([binary, "example.js"], cwd=EXAMPLE, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] and all(result["checks"].values()), result
    # Two writers of 150 rows, every 17th rolled back.
    assert result["rows"] == 2 * (150 - len(range(5, 150, 17)))
