"""Reading a range of a multi-writer stream, as Synapse's
MultiWriterShardedTokenBoundsTestCase does, with streampos.in_range in SQL and
the Python tokens, and Synapse's own helpers as the oracle: the same rows
are selected, and a limited read resumes with
``since.copy_and_advance(upper.bound_stream_token(last))`` exactly where
Synapse's ``advance_multiwriter_sharded_token_after_partial_read`` does."""

import pytest

from streampos import MultiWriterToken

synapse_types = pytest.importorskip("synapse.types")
id_generators = pytest.importorskip("synapse.storage.util.id_generators")
immutabledict = pytest.importorskip("immutabledict").immutabledict

ROWS = [(6, "worker1"), (7, "worker1"), (8, "worker2"), (9, "worker1"), (10, "worker3"), (11, "worker1"),
        (12, "worker2"), (13, "worker3"), (14, "worker2")]

# (from, to) as (stream, {name: position}).
RANGES = [
    ((5, {}), (14, {})),
    ((5, {}), (10, {"worker2": 14})),
    ((5, {"worker1": 9}), (10, {"worker2": 14})),
    ((5, {"worker1": 7}), (8, {"worker1": 11, "worker3": 13})),
    ((5, {"worker1": 9, "worker2": 8}), (10, {"worker1": 11, "worker2": 14, "worker3": 13})),
]


@pytest.fixture
def table(db, stream):
    name = f"{stream}_rows"
    db.execute(f"CREATE TABLE {name} (stream_id bigint PRIMARY KEY, instance_name text)")
    db.cursor().executemany(f"INSERT INTO {name} VALUES (%s, %s)", ROWS)
    ids = {w: db.execute("SELECT streampos.instance_id(%s)", (w,)).fetchone()[0] for w in ("worker1", "worker2", "worker3")}
    return name, ids


def ours(spec, ids):
    stream, positions = spec
    return MultiWriterToken(stream, {ids[n]: p for n, p in positions.items()})


def theirs(spec):
    stream, positions = spec
    return synapse_types.MultiWriterStreamToken(stream=stream, instance_map=immutabledict(positions))


def names_of(token, ids):
    by_id = {i: n for n, i in ids.items()}
    return (token.stream, {by_id[i]: p for i, p in token.instance_map.items()})


def select(db, name, low, high, limit=None):
    return db.execute(
        f"SELECT t.stream_id, t.instance_name FROM {name} t "
        "LEFT JOIN streampos.instances i ON i.instance_name = t.instance_name "
        "WHERE t.stream_id > %s AND t.stream_id <= %s AND streampos.in_range(%s, %s, i.instance_id, t.stream_id) "
        "ORDER BY t.stream_id LIMIT %s",
        (low.stream, high.get_max_stream_pos(), low, high, limit),
    ).fetchall()


def test_bounds_select_the_rows_synapse_expects(db, table):
    name, ids = table
    for low_spec, high_spec in RANGES:
        low, high = ours(low_spec, ids), ours(high_spec, ids)
        expected = [
            (sid, w) for sid, w in ROWS
            if synapse_types.MultiWriterStreamToken.is_stream_position_in_range(theirs(low_spec), theirs(high_spec), w, sid)
        ]
        assert select(db, name, low, high) == expected, (low_spec, high_spec)
        assert [(s, w) for s, w in ROWS if MultiWriterToken.is_stream_position_in_range(low, high, ids[w], s)] == expected


def test_token_after_partial_read(db, table):
    name, ids = table
    for low_spec, high_spec in RANGES:
        low, high = ours(low_spec, ids), ours(high_spec, ids)
        everything = select(db, name, low, high)
        for limit in range(1, len(everything) + 1):
            read = select(db, name, low, high, limit)
            resume = low.copy_and_advance(high.bound_stream_token(read[-1][0]))
            synapse_resume = id_generators.advance_multiwriter_sharded_token_after_partial_read(
                from_token_exclusive=theirs(low_spec),
                to_token_inclusive=theirs(high_spec),
                last_read_stream_id=read[-1][0],
            )
            assert names_of(resume, ids) == (synapse_resume.stream, dict(synapse_resume.instance_map))
            assert low.is_before_or_eq(resume) and resume.is_before_or_eq(high)
            assert read + select(db, name, resume, high) == everything, (low_spec, high_spec, limit)
            # The server's lattice functions agree.
            assert db.execute("SELECT streampos.advance(%s, streampos.bound(%s, %s))", (low, high, read[-1][0])).fetchone()[0] == resume


def test_token_after_partial_read_does_not_go_backwards(database):
    low, high = MultiWriterToken(60), MultiWriterToken(10, {2: 70})
    resume = low.copy_and_advance(high.bound_stream_token(64))
    assert resume == MultiWriterToken(60, {2: 64})
    assert low.is_before_or_eq(resume)
