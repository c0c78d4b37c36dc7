"""The house's rules, checked against the tree (no server needed):

- docs/design.md's Layout table names every Rust source file of the
  extension and of streampos-core, and names no file that is not there;
- a folder's `mod.rs` file table lists exactly the folder's files;
- nothing outside `src/sql/` runs SQL through SPI (the one boundary where
  the rules of internal SQL hold; the `pg_test` module of lib.rs, which
  tests the extension from inside, excepted).
"""

import os
import re

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))


def rust_files(top):
    """Every .rs file under `top`, relative to ROOT."""
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, top)):
        found += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".rs")]
    return sorted(found)


def layout_rows():
    """The Layout table of docs/design.md: {first cell: rest of the row}."""
    text = open(os.path.join(ROOT, "docs", "design.md")).read()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and "`" in cells[0]:
            rows[cells[0]] = " | ".join(cells[1:])
    return rows


def named_in_row(first, rest):
    """The .rs paths a layout row names: files in its first cell, and for a
    folder (`src/registry/`, `core/`), the file names in its description,
    under that folder (core's `token/` files under core/src/token/)."""
    named = set()
    for name in re.findall(r"`([^`]+)`", first):
        if name.endswith(".rs"):
            named.add(name)
    for folder in re.findall(r"`([^`]+/)`", first):
        base = "core/src/" if folder == "core/" else folder
        sub = ""
        for token in re.findall(r"`([^`]+)`", rest):
            if token.endswith("/"):
                sub = token
            elif token.endswith(".rs"):
                in_sub = base + sub + token
                named.add(in_sub if os.path.exists(os.path.join(ROOT, in_sub)) else base + token)
    return named


def test_the_layout_table_names_every_source_file_and_only_those():
    rows = layout_rows()
    named = set()
    for first, rest in rows.items():
        named |= named_in_row(first, rest)
    files = set(rust_files("src")) | set(rust_files("core/src"))
    # A folder's mod.rs and a crate's lib.rs are the folder itself.
    expected = {f for f in files if os.path.basename(f) not in ("mod.rs", "lib.rs")}
    missing = sorted(expected - named)
    unknown = sorted(n for n in named if not os.path.exists(os.path.join(ROOT, n)))
    assert not missing, f"docs/design.md, Layout, does not name: {missing}"
    assert not unknown, f"docs/design.md, Layout, names files that do not exist: {unknown}"


def test_every_mod_rs_file_table_lists_the_folders_files():
    checked = 0
    for path in rust_files("src") + rust_files("core/src"):
        if os.path.basename(path) != "mod.rs":
            continue
        text = open(os.path.join(ROOT, path)).read()
        table = [line for line in text.splitlines() if line.startswith("//! | `")]
        if not table:
            continue
        listed = {re.match(r"//! \| `([^`]+)`", line).group(1) for line in table}
        folder = os.path.dirname(path)
        present = {f for f in os.listdir(os.path.join(ROOT, folder)) if f.endswith(".rs") and f != "mod.rs"}
        assert listed == present, f"{path}: the file table lists {sorted(listed)}, the folder has {sorted(present)}"
        checked += 1
    assert checked >= 3, "the file tables of src/api, src/registry and src/sql"


SPI = re.compile(r"\bSpi::|\bpgrx::spi\b|\bSPI_[a-z]+\(")


def test_nothing_outside_src_sql_runs_sql():
    offenders = []
    for path in rust_files("src"):
        if path.startswith(os.path.join("src", "sql") + os.sep):
            continue
        text = open(os.path.join(ROOT, path)).read()
        if path == os.path.join("src", "lib.rs"):
            text = text.split("mod tests {", 1)[0]
        for number, line in enumerate(text.splitlines(), 1):
            if SPI.search(line) and not line.lstrip().startswith("//"):
                offenders.append(f"{path}:{number}: {line.strip()}")
    assert not offenders, "SQL run outside src/sql/:\n" + "\n".join(offenders)


# ------------------------------------------------------------- no circles


def module_of(path):
    """`src/registry/shmem.rs` -> `crate::registry::shmem`."""
    parts = os.path.relpath(path, "src")[: -len(".rs")].split(os.sep)
    if parts[-1] == "mod":
        parts = parts[:-1]
    return "::".join(["crate"] + ([] if parts == ["lib"] else parts))


def defined_names(text):
    """The items a file defines at its top level (and thread-local statics)."""
    names = set(re.findall(
        r"^(?:pub(?:\([a-z]+\))? )?(?:unsafe )?(?:fn|struct|const|enum|type|static|trait) ([A-Za-z_]\w*)",
        text, re.M))
    names |= set(re.findall(r"^\s+(?:pub(?:\([a-z]+\))? )?static ([A-Z_][A-Z0-9_]*)", text, re.M))
    return names


def split_top(text):
    """`a, b::{c, d}, e` -> its top-level items."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def use_tree_paths(prefix, tree):
    """Every path a `use` tree names: `crate::{a::{b, c}, d as e}` ->
    [crate, a, b], [crate, a, c], [crate, d]."""
    tree = re.sub(r"\s+", " ", tree).strip()
    brace = tree.find("{")
    if brace < 0:
        return [prefix + [p.strip() for p in tree.split(" as ")[0].split("::") if p.strip()]]
    head = [p.strip() for p in tree[:brace].split("::") if p.strip()]
    depth = 0
    for end in range(brace, len(tree)):
        depth += {"{": 1, "}": -1}.get(tree[end], 0)
        if depth == 0:
            break
    out = []
    for item in split_top(tree[brace + 1:end]):
        out += use_tree_paths(prefix + head, item)
    return out


def absolute(module, path):
    """A path as written in `module` (crate::…, super::super::…, self::…)
    from the crate's root, or None for another crate's."""
    if not path:
        return None
    if path[0] == "crate":
        return path
    if path[0] in ("super", "self"):
        base = module.split("::")
        while path and path[0] == "super":
            base, path = base[:-1], path[1:]
        if path and path[0] == "self":
            path = path[1:]
        return base + path
    return None


def import_graph():
    """Which file of src/ uses which: paths through `crate::` and `super::`
    (groups expanded), and, for a file that imports its parent with
    `use super::*` (the files of src/sql/), the items of its siblings it
    names. A folder's mod.rs declaring and re-exporting its files is the
    folder, not an import."""
    files = {module_of(p): p for p in rust_files("src")}
    texts = {m: re.sub(r"//[^\n]*", "", open(os.path.join(ROOT, p)).read()) for m, p in files.items()}

    def resolve(parts):
        for i in range(len(parts), 0, -1):
            if "::".join(parts[:i]) in files:
                return "::".join(parts[:i])
        return None

    edges = {m: set() for m in files}
    for m, text in texts.items():
        targets = []
        # `use` trees, groups nested to any depth (`use crate::{a::{b, c}, d};`).
        for found in re.finditer(r"\buse\s+((?:crate|super|self)\b[^;]*);", text):
            targets += use_tree_paths([], found.group(1))
        # Paths in code (`crate::worker::check()`, `super::super::x`).
        targets += [p.split("::") for p in re.findall(r"\b(?:crate|super)(?:::\w+)+", text)]
        for target in targets:
            path = absolute(m, target)
            r = path and resolve([t for t in path if t not in ("self", "*")])
            if r and r != m and not m.startswith(r + "::"):
                edges[m].add(r)
        parent = m.split("::")[:-1]
        if re.search(r"^use super::\*;", text, re.M):
            for sibling, sibling_text in texts.items():
                if sibling == m or sibling.split("::")[:-1] != parent:
                    continue
                if any(re.search(r"(?<![\w:.])" + re.escape(n) + r"\b", text)
                       for n in defined_names(sibling_text)):
                    edges[m].add(sibling)
    return edges


def cycles(edges):
    """The strongly connected components with more than one file (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_file_imports_a_file_that_imports_it_back():
    """A room below never imports a room above it: the files of src/ and
    what they import form no circle (issue 34)."""
    edges = import_graph()
    assert len(edges) > 40 and sum(len(e) for e in edges.values()) > 100, "the graph was read"
    # A grouped `use crate::{catalog, engine, …};` is read too (it was not
    # before 0.4.0's review: two circles through it went unseen).
    assert {"crate::catalog", "crate::held_back"} <= edges["crate::worker"], "grouped imports are read"
    found = cycles(edges)
    detail = "\n".join(
        " ↔ ".join(c) + ": " + "; ".join(f"{a} -> {sorted(b for b in edges[a] if b in c)}" for a in c)
        for c in found)
    assert not found, "import circles:\n" + detail
    # Nor between rooms: a folder (src/sql/, src/registry/, src/api/) is one.
    rooms = {}
    for a, targets in edges.items():
        room = "::".join(a.split("::")[:2])
        rooms.setdefault(room, set()).update(
            "::".join(b.split("::")[:2]) for b in targets if "::".join(b.split("::")[:2]) != room)
    assert not cycles(rooms), f"import circles between folders and files: {cycles(rooms)}"


def test_the_circle_check_sees_a_circle():
    """The check above fails where it should."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
