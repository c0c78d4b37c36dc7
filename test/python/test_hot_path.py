"""The hot path reads straight (issue 34): a warm `next_id` call, traced
function by function under gdb (bench/hot_path.py, a single-user server of
the PostgreSQL in PG_BIN with the library installed there, a debug build),
goes from the SQL function down to the registry and the sequence and back:

- no call goes up to a file below it on the stack (a closure passed down,
  `with_index(meta, |index| …)`, excepted);
- every call from one file into another is one the imports allow downward
  (the callee's file is reachable from the caller's in test_layout's import
  graph, which has no circles);
- it never enters the cold path: `src/sql/` (no statement is run) and
  `src/engine/load.rs` (a stream's first use).
"""

import os
import shutil
import subprocess
import sys

import pytest

from support import PG_BIN
from test_layout import ROOT, import_graph, module_of

sys.path.insert(0, os.path.join(ROOT, "bench"))
import hot_path  # noqa: E402


def library_has_debug_info():
    library = os.path.join(hot_path.cg.pkglibdir(PG_BIN), "streampos.so")
    sections = subprocess.run(["readelf", "-S", "-W", library], capture_output=True, text=True).stdout
    return ".debug_info" in sections


@pytest.fixture(scope="module")
def rows():
    if shutil.which("gdb") is None:
        pytest.skip("gdb is not installed")
    if not library_has_debug_info():
        pytest.skip("the installed library is a release build (no debug information)")
    rows = hot_path.classify(hot_path.trace(PG_BIN))
    assert any(r[1].endswith("engine::allocation::allocate") for r in rows), "the call was traced"
    return rows


def reachable(edges, start):
    seen, todo = set(), [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_a_warm_next_id_never_calls_up(rows):
    climbs = [r for r in rows if r[4] == "climbs"]
    assert not climbs, f"calls up the stack: {climbs}"


def test_a_warm_next_id_calls_only_down_the_imports(rows):
    edges = import_graph()
    wrong = []
    for depth, name, caller, callee, kind in rows:
        if kind in ("stays", "from PostgreSQL", "passed down") or caller == callee:
            continue
        a, b = module_of(caller), module_of(callee)
        # A folder's files may reach each other's items through the
        # folder (`super::`), which the graph names as the folder itself.
        if b not in reachable(edges, a) and b.rsplit("::", 1)[0] not in reachable(edges, a):
            wrong.append((name, caller, callee))
    assert not wrong, "calls the imports do not lead down to:\n" + "\n".join(map(str, sorted(set(wrong))))


def test_a_warm_next_id_never_enters_the_cold_path(rows):
    entered = hot_path.cold_path_entries(rows)
    assert not entered, f"the cold path entered: {entered}"
