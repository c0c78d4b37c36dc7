"""A PostgreSQL database with Synapse's real schema, for the adoption tests.

The schema comes from the pinned Synapse release itself: its
``prepare_database`` (full schema 72 plus every delta up to the current
schema version, SQL and Python, exactly as a new homeserver runs them) with
Synapse's ``PostgresEngine``. Nothing here hand-writes a Synapse table.

``fill`` then writes what a homeserver with three writers leaves behind once
it is stopped: rows in every table of every stream of the stream map
(sql/synapse_streams.tsv), ``instance_map`` rows with ids that are neither
dense nor in name order, ``stream_positions`` rows, and ``events_stream_seq``
32 behind its tables' highest ID (the failover case ``check_stream`` repairs).

``observe`` reads back, with plain SQL, what the database says each stream
should be at after adoption (sequence, tables' highest IDs, stored
positions).

The stream map itself is checked against Synapse's source: every
``MultiWriterIdGenerator(...)`` construction in the installed package
(``stream_map_from_synapse_source``).

Command line:
    python test/python/synapse_db.py DSN [--schema NAME]   create and fill, print timings
    python test/python/synapse_db.py --map                 print the map read from Synapse's source
"""

import argparse
import ast
import contextlib
import importlib
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

MAP_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "sql", "synapse_streams.tsv")

MAP_COLUMNS = (
    "stream_name",
    "sequence_name",
    "backwards",
    "table_position",
    "table_name",
    "instance_column",
    "id_column",
    "writers",
    "source",
)

# The writers of the filled database, and Synapse's instance_map for them.
# The ids are neither dense nor in name order (Synapse's upsert burns
# sequence values), so an import that re-numbers cannot pass by luck.
WRITERS = ("master", "worker1", "worker2")
RETIRED_WRITER = "retired_worker"
INSTANCE_MAP = {"worker2": 2, "worker1": 3, RETIRED_WRITER: 5, "master": 7}
INSTANCE_MAP_SEQUENCE_VALUE = 9

# The stream whose sequence is left behind its tables, and by how much.
LAGGING_STREAM = "events"
LAG = 32

ROWS_PER_STREAM = 16
ID_SPACING = 4

# A single-row table in device_lists_stream's list: the converter's progress
# marker (schema delta 73/12), not a stream of rows. Its one row is updated,
# never inserted.
SINGLE_ROW_TABLES = {"device_lists_changes_converted_stream_position"}

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


# --------------------------------------------------------------- the stream map


@dataclass
class StreamSpec:
    """One of Synapse's MultiWriterIdGenerator streams."""

    name: str
    sequence: str
    backwards: bool
    tables: list = field(default_factory=list)  # [(table, instance_column, id_column)]
    writers: str = ""  # 'stream_writers.<key>', '{master}' or '{}'
    source: str = ""  # 'synapse/…/file.py:Class'

    @property
    def fixed_writers(self):
        """Writers hard-coded in Synapse ('{master}' → ['master']), or None
        when they come from homeserver.yaml's stream_writers."""
        if self.writers.startswith("{"):
            inner = self.writers.strip("{}")
            return [w for w in inner.split(",") if w]
        return None


def load_stream_map(path=MAP_PATH):
    """The stream map, from sql/synapse_streams.tsv (PostgreSQL COPY text
    format with a header line), in file order."""
    streams = {}
    with open(path, encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        assert tuple(header) == MAP_COLUMNS, f"unexpected header in {path}: {header}"
        for line in f:
            if not line.strip():
                continue
            values = dict(zip(MAP_COLUMNS, line.rstrip("\n").split("\t")))
            spec = streams.get(values["stream_name"])
            if spec is None:
                spec = streams[values["stream_name"]] = StreamSpec(
                    name=values["stream_name"],
                    sequence=values["sequence_name"],
                    backwards=values["backwards"] == "t",
                    writers=values["writers"],
                    source=values["source"],
                )
            assert int(values["table_position"]) == len(spec.tables) + 1, line
            spec.tables.append((values["table_name"], values["instance_column"], values["id_column"]))
    return list(streams.values())


def _writers_expression(node):
    """How a MultiWriterIdGenerator(writers=...) argument configures writers."""
    text = ast.unparse(node)
    config = re.fullmatch(r"hs\.config\.worker\.writers\.(\w+)", text)
    if config:
        return f"stream_writers.{config.group(1)}"
    value = ast.literal_eval(node)
    assert isinstance(value, list), text
    return "{" + ",".join(value) + "}"


@contextlib.contextmanager
def _quiet_imports():
    """Synapse's modules use APIs their dependencies deprecate: not ours to
    report."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def _resolve_attribute(tree, node):
    """The value of ``Name.ATTR`` (e.g. QuarantinedMediaStream.NAME), Name
    imported with ``from module import Name`` in the same file: importing
    just that module, not the store's (which pulls in half of Synapse)."""
    assert isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name), ast.unparse(node)
    for statement in ast.walk(tree):
        if isinstance(statement, ast.ImportFrom) and any(a.name == node.value.id for a in statement.names):
            with _quiet_imports():
                module = importlib.import_module(statement.module)
            return getattr(getattr(module, node.value.id), node.attr)
    raise LookupError(f"cannot resolve {ast.unparse(node)}")


def stream_map_from_synapse_source():
    """Every ``MultiWriterIdGenerator(...)`` construction in the installed
    Synapse, read from its source with ``ast``, as StreamSpecs sorted by
    stream name."""
    import synapse

    package_dir = os.path.dirname(synapse.__file__)
    found = []
    for dirpath, _dirs, files in os.walk(package_dir):
        for file_name in sorted(files):
            if not file_name.endswith(".py"):
                continue
            path = os.path.join(dirpath, file_name)
            with open(path, encoding="utf-8") as f:
                source = f.read()
            if "MultiWriterIdGenerator(" not in source:
                continue
            tree = ast.parse(source)
            relative = os.path.relpath(path, os.path.dirname(package_dir))
            for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
                for call in ast.walk(cls):
                    if not (
                        isinstance(call, ast.Call)
                        and getattr(call.func, "id", getattr(call.func, "attr", None))
                        == "MultiWriterIdGenerator"
                    ):
                        continue
                    args = {k.arg: k.value for k in call.keywords}
                    stream_node = args["stream_name"]
                    if isinstance(stream_node, ast.Constant):
                        stream_name = stream_node.value
                    else:
                        stream_name = _resolve_attribute(tree, stream_node)
                    positive = args.get("positive")
                    found.append(
                        StreamSpec(
                            name=stream_name,
                            sequence=ast.literal_eval(args["sequence_name"]),
                            backwards=positive is not None and not ast.literal_eval(positive),
                            tables=[tuple(t) for t in ast.literal_eval(args["tables"])],
                            writers=_writers_expression(args["writers"]),
                            source=f"{relative.replace(os.sep, '/')}:{cls.name}",
                        )
                    )
    found.sort(key=lambda s: s.name)
    return found


def format_stream_map(streams):
    """The map as sql/synapse_streams.tsv text."""
    lines = ["\t".join(MAP_COLUMNS)]
    for s in streams:
        for position, (table, instance_column, id_column) in enumerate(s.tables, start=1):
            lines.append(
                "\t".join(
                    [
                        s.name,
                        s.sequence,
                        "t" if s.backwards else "f",
                        str(position),
                        table,
                        instance_column,
                        id_column,
                        s.writers,
                        s.source,
                    ]
                )
            )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------- schema


def _check_schema_name(schema):
    if not _SCHEMA_NAME.match(schema):
        raise ValueError(f"schema name {schema!r} must be a plain lower-case identifier")


def create_schema(conninfo, schema="public"):
    """Create Synapse's schema in ``schema`` of the (empty) database
    ``conninfo`` with Synapse's own prepare_database. Returns the seconds
    spent in prepare_database."""
    _check_schema_name(schema)
    # Synapse's database layer is psycopg2's; its PostgresEngine needs it.
    import psycopg2

    with _quiet_imports():
        from synapse.storage.database import LoggingDatabaseConnection
        from synapse.storage.engines import PostgresEngine
        from synapse.storage.prepare_database import prepare_database

    with psycopg.connect(conninfo, autocommit=True) as c:
        c.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))

    # allow_unsafe_locale: a test cluster's databases need not be C-collated.
    engine = PostgresEngine({"name": "psycopg2", "args": {}, "allow_unsafe_locale": True})
    raw = psycopg2.connect(conninfo, options=f"-c search_path={schema}")
    try:
        conn = LoggingDatabaseConnection(
            conn=raw, engine=engine, default_txn_name="synapse_db", server_name="synapse_db.test"
        )
        engine.on_new_connection(conn)
        started = time.monotonic()
        prepare_database(conn, engine, config=None)
        return time.monotonic() - started
    finally:
        raw.close()


# --------------------------------------------------------------- filling


def _column_value(type_name, length, n):
    """A value of the given column type, distinct for each n (unique
    constraints are on text and integer columns)."""
    if type_name in ("text", "character varying", "character"):
        value = f"v{n}"
        return value[-length:] if length else value
    if type_name in ("smallint", "integer", "bigint"):
        return n
    if type_name == "boolean":
        return False
    if type_name in ("jsonb", "json"):
        return "{}"
    if type_name == "bytea":
        return b""
    if type_name in ("real", "double precision", "numeric"):
        return 0
    raise NotImplementedError(f"no filler value for column type {type_name}")


class _Filler:
    """Inserts rows that satisfy a table's NOT NULL, unique and foreign-key
    constraints, read from the catalog, so the filler follows the schema
    Synapse created rather than a copy of it."""

    def __init__(self, conn, schema):
        self.conn = conn
        self.schema = schema
        self.counter = 1000
        self._required = {}
        self._foreign = {}
        # Rotates through a referenced table's keys, so that rows of one
        # table reference distinct parents (unique indexes cover some).
        self._next_parent = {}

    def required_columns(self, table):
        """[(column, type name, length)] that are NOT NULL without default."""
        if table not in self._required:
            self._required[table] = self.conn.execute(
                """
                SELECT a.attname, t.typname::regtype::text,
                       CASE WHEN a.atttypmod > 4 AND t.typname IN ('varchar', 'bpchar')
                            THEN a.atttypmod - 4 END
                FROM pg_catalog.pg_attribute a
                JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
                WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped
                  AND a.attnotnull AND NOT a.atthasdef AND a.attidentity = '' AND a.attgenerated = ''
                ORDER BY a.attnum
                """,
                (self.qualified(table),),
            ).fetchall()
        return self._required[table]

    def foreign_values(self, table):
        """{column: [values in the referenced table]} for single-column
        foreign keys."""
        if table not in self._foreign:
            refs = self.conn.execute(
                """
                SELECT a.attname, c.confrelid::regclass::text, fa.attname
                FROM pg_catalog.pg_constraint c
                JOIN pg_catalog.pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]
                JOIN pg_catalog.pg_attribute fa ON fa.attrelid = c.confrelid AND fa.attnum = c.confkey[1]
                WHERE c.conrelid = %s::regclass AND c.contype = 'f' AND cardinality(c.conkey) = 1
                """,
                (self.qualified(table),),
            ).fetchall()
            values = {}
            for column, ref_table, ref_column in refs:
                values[column] = [
                    r[0]
                    for r in self.conn.execute(
                        sql.SQL("SELECT {} FROM {} ORDER BY 1").format(
                            sql.Identifier(ref_column), sql.SQL(ref_table)
                        )
                    )
                ]
                if not values[column]:
                    raise RuntimeError(f"{table}.{column} references the empty table {ref_table}")
            self._foreign[table] = values
        return self._foreign[table]

    def qualified(self, table):
        return f"{self.schema}.{table}"

    def insert(self, table, rows):
        """Insert rows given as {column: value} dicts; every other required
        column gets a filler value (or a referenced row's key)."""
        required = self.required_columns(table)
        foreign = self.foreign_values(table)
        full_rows = []
        for given in rows:
            self.counter += 1
            row = dict(given)
            for column, choices in foreign.items():
                if column not in row:
                    k = self._next_parent.get((table, column), 0)
                    self._next_parent[(table, column)] = k + 1
                    row[column] = choices[k % len(choices)]
            for column, type_name, length in required:
                if column not in row:
                    row[column] = _column_value(type_name, length, self.counter)
            full_rows.append(row)
        columns = sorted({c for r in full_rows for c in r})
        statement = sql.SQL("INSERT INTO {}.{} ({}) VALUES ({})").format(
            sql.Identifier(self.schema),
            sql.Identifier(table),
            sql.SQL(", ").join(sql.Identifier(c) for c in columns),
            sql.SQL(", ").join(sql.Placeholder() for _ in columns),
        )
        with self.conn.cursor() as cur:
            cur.executemany(statement, [[r.get(c) for c in columns] for r in full_rows])


def stream_writers(spec):
    """The instances that write a stream in the filled database: Synapse's
    hard-coded writers where it has them ({master}), else all three."""
    fixed = spec.fixed_writers
    return list(fixed) if fixed else list(WRITERS)


def stream_ids(spec, index):
    """The IDs written to a stream (ascending in allocation order, so
    negative and descending for a backward stream): spaced, with gaps, and
    a top that differs from every other stream's so that cross-wired
    sequences cannot pass."""
    top = 80 + 13 * index
    ids = sorted(top - ID_SPACING * j for j in range(ROWS_PER_STREAM))
    return [-i for i in ids] if spec.backwards else ids


def assign_rows(spec, tables, ids, writers):
    """[(table spec, writer, id)]: which table and writer each ID went to.

    Runs of IDs round robin over the tables, the highest ID in the last table (an
    adoption that registers only the first table misses it), the three
    highest IDs from three different writers. In the events stream a
    current_state_delta_stream row shares its state event's ID, as in
    Synapse, so every ID but the ex-outliers' has an events row (other
    tables reference events)."""
    rows = []
    last = len(ids) - 1
    for i, stream_id in enumerate(ids):
        writer = writers[(last - i) % len(writers)]
        # Runs of len(writers) IDs per table: every table gets every writer.
        turn = i // len(writers)
        if spec.name == "events":
            events, deltas, outliers = tables
            if i == last or turn % 3 == 2:
                rows.append((outliers, writer, stream_id))
            else:
                rows.append((events, writer, stream_id))
                if turn % 3 == 1:
                    rows.append((deltas, writer, stream_id))
            continue
        table = tables[-1] if i == last else tables[turn % len(tables)]
        rows.append((table, writer, stream_id))
    # Rows from before Synapse recorded instance names.
    if spec.name == "events":
        rows[0] = (rows[0][0], None, rows[0][2])
    return rows


def fill(conninfo, schema="public", streams=None):
    """Write a stopped three-writer homeserver's state into Synapse's schema.

    Returns {stream: [(table, instance, id)]}, the rows written."""
    _check_schema_name(schema)
    streams = streams if streams is not None else load_stream_map()
    written = {}
    with psycopg.connect(conninfo) as conn:
        conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
        filler = _Filler(conn, schema)

        # Parents that stream tables reference (rooms, users; events come
        # first among the streams below).
        filler.insert("rooms", [{"room_id": f"!room{n}:test"} for n in range(3)])
        filler.insert("users", [{"name": f"@user{n}:test"} for n in range(3)])

        # Synapse's instance map, as get_id_for_instance leaves it.
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO instance_map (instance_id, instance_name) VALUES (%s, %s)",
                sorted((i, n) for n, i in INSTANCE_MAP.items()),
            )
        conn.execute("SELECT setval('instance_map_instance_id_seq', %s)", (INSTANCE_MAP_SEQUENCE_VALUE,))

        # events and backfill before the streams whose rows reference events.
        order = sorted(
            enumerate(streams),
            key=lambda item: (item[1].name not in ("events", "backfill"), item[0]),
        )
        for index, spec in order:
            writers = stream_writers(spec)
            ids = stream_ids(spec, index)
            tables = [t for t in spec.tables if t[0] not in SINGLE_ROW_TABLES]
            rows = assign_rows(spec, tables, ids, writers)
            written[spec.name] = []
            for table, instance_column, id_column in tables:
                mine = [r for r in rows if r[0] == (table, instance_column, id_column)]
                payload = []
                for _t, writer, stream_id in mine:
                    row = {instance_column: writer, id_column: stream_id}
                    if table == "events":
                        row["event_id"] = f"$event{stream_id}:test"
                    payload.append(row)
                filler.insert(table, payload)
                written[spec.name] += [(table, w, i) for _t, w, i in mine]
            for table, instance_column, id_column in spec.tables:
                if table in SINGLE_ROW_TABLES:
                    # The marker sits at a mid ID, written by the first writer.
                    conn.execute(
                        sql.SQL("UPDATE {} SET {} = %s, {} = %s").format(
                            sql.Identifier(table), sql.Identifier(id_column), sql.Identifier(instance_column)
                        ),
                        (ids[len(ids) // 2], writers[0]),
                    )
                    written[spec.name].append((table, writers[0], ids[len(ids) // 2]))

            # The sequence: at the highest ID (internal numbering: positive),
            # except the lagging one.
            highest = max(abs(i) for _t, _w, i in written[spec.name])
            value = highest - LAG if spec.name == LAGGING_STREAM else highest
            conn.execute("SELECT setval(%s, %s)", (spec.sequence, value))

            # stream_positions: Synapse keeps them only for streams with
            # writers; each writer at its highest row, except that the first
            # writer lags one row behind (its last write's position was not
            # stored before the stop). Stored with the stream's sign.
            if spec.writers == "{}":
                continue
            for n, writer in enumerate(writers):
                own = sorted((abs(i) for _t, w, i in written[spec.name] if w == writer))
                position = own[-2] if n == 0 and len(own) > 1 else own[-1]
                conn.execute(
                    "INSERT INTO stream_positions (stream_name, instance_name, stream_id) VALUES (%s, %s, %s)",
                    (spec.name, writer, -position if spec.backwards else position),
                )
        # A writer removed from the configuration since Synapse last started
        # (Synapse deletes its row at its next start-up).
        conn.execute(
            "INSERT INTO stream_positions (stream_name, instance_name, stream_id) VALUES ('events', %s, 3)",
            (RETIRED_WRITER,),
        )
        conn.commit()
    return written


# --------------------------------------------------------------- observing


@dataclass
class StreamFacts:
    """What a Synapse database says about one stream, read with plain SQL
    (no streampos): the expected state after adoption."""

    spec: StreamSpec
    sequence_value: int  # the last value handed out (is_called honoured)
    table_highest: dict  # {table: highest ID, internal numbering (positive)}
    positions: dict  # {instance: stream_id} from Synapse's stream_positions, signed
    writers: set  # instances in the stream's instance columns

    @property
    def highest(self):
        """Everything the sequence must be at least at: its own value, every
        table's highest ID and every stored position (positive numbering)."""
        return max(
            [self.sequence_value, *self.table_highest.values(), *(abs(p) for p in self.positions.values())]
        )

    @property
    def frontier(self):
        """The frontier after adoption with nothing in flight, signed."""
        return -self.highest if self.spec.backwards else self.highest


def observe(conn, schema="public", streams=None):
    """{stream: StreamFacts} for every stream of the map whose sequence
    exists in ``schema`` (tables that do not exist are left out)."""
    streams = streams if streams is not None else load_stream_map()
    facts = {}
    for spec in streams:
        seq = f"{schema}.{spec.sequence}"
        if conn.execute("SELECT pg_catalog.to_regclass(%s)", (seq,)).fetchone()[0] is None:
            continue
        last, called = conn.execute(
            sql.SQL("SELECT last_value, is_called FROM {}.{}").format(
                sql.Identifier(schema), sql.Identifier(spec.sequence)
            )
        ).fetchone()
        highest = {}
        writers = set()
        for table, instance_column, id_column in spec.tables:
            if conn.execute("SELECT pg_catalog.to_regclass(%s)", (f"{schema}.{table}",)).fetchone()[0] is None:
                continue
            aggregate = "max({})" if not spec.backwards else "-min({})"
            highest[table] = conn.execute(
                sql.SQL("SELECT coalesce(" + aggregate + ", 0) FROM {}.{}").format(
                    sql.Identifier(id_column), sql.Identifier(schema), sql.Identifier(table)
                )
            ).fetchone()[0]
            writers |= {
                r[0]
                for r in conn.execute(
                    sql.SQL("SELECT DISTINCT {} FROM {}.{} WHERE {} IS NOT NULL").format(
                        sql.Identifier(instance_column),
                        sql.Identifier(schema),
                        sql.Identifier(table),
                        sql.Identifier(instance_column),
                    )
                )
            }
        positions = dict(
            conn.execute(
                sql.SQL("SELECT instance_name, stream_id FROM {}.stream_positions WHERE stream_name = %s").format(
                    sql.Identifier(schema)
                ),
                (spec.name,),
            ).fetchall()
        )
        facts[spec.name] = StreamFacts(
            spec=spec,
            sequence_value=last if called else last - 1,
            table_highest=highest,
            positions=positions,
            writers=writers,
        )
    return facts


def instance_map(conn, schema="public"):
    """Synapse's instance_map as {instance_name: instance_id}."""
    return dict(
        conn.execute(
            sql.SQL("SELECT instance_name, instance_id FROM {}.instance_map").format(sql.Identifier(schema))
        ).fetchall()
    )


def create(conninfo, schema="public"):
    """create_schema + fill; returns (schema seconds, fill seconds)."""
    schema_seconds = create_schema(conninfo, schema)
    started = time.monotonic()
    fill(conninfo, schema)
    return schema_seconds, time.monotonic() - started


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dsn", nargs="?", help="libpq connection string of an empty database")
    parser.add_argument("--schema", default="public")
    parser.add_argument("--map", action="store_true", help="print the stream map read from Synapse's source")
    args = parser.parse_args(argv)
    if args.map:
        sys.stdout.write(format_stream_map(stream_map_from_synapse_source()))
        return 0
    if not args.dsn:
        parser.error("a DSN or --map is needed")
    started = time.monotonic()
    schema_seconds, fill_seconds = create(args.dsn, args.schema)
    print(
        f"Synapse schema in {schema_seconds:.2f}s (prepare_database), filled in {fill_seconds:.2f}s, "
        f"{time.monotonic() - started:.2f}s in all (with imports)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
