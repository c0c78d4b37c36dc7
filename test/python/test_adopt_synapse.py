"""streampos.adopt_synapse(): one call turns a stopped Synapse's database into
streampos streams, against Synapse's real schema (synapse_db.py).

The contract: every stream of the map (sql/synapse_streams.tsv, checked
against Synapse's source below) is registered with its existing sequence,
tables and direction; instance_map is imported keeping every instance_id, so
tokens clients hold decode to the same writers; stream_positions is
imported; check_stream repairs lagging sequences; the result says what was
done and what was skipped and why; a second call changes nothing; a
database that is not Synapse's is refused.

The result's vocabulary and the SQLSTATEs are the constants below, so the
implementation can settle them in one place.
"""

import contextlib
import threading
import uuid

import psycopg
import pytest

import synapse_db
from support import connect_raw, durable_commit, expect_error, one, rows, scratch_database

# The call, its result columns, and the actions the tests rely on.
ADOPT = "SELECT stream, action, detail FROM streampos.adopt_synapse()"
ADOPT_IN = "SELECT stream, action, detail FROM streampos.adopt_synapse(%s)"
ADOPTED = "adopted"  # the stream was registered by this call
REPAIRED = "repaired"  # its sequence was moved forward (detail: to what)
UNCHANGED = "unchanged"  # already registered as the map says: nothing done
SKIPPED = "skipped"  # not adopted (detail: the missing or unusable object)

# A schema without Synapse's tables (schema_version, instance_map,
# stream_positions): undefined_table, what PostgreSQL raises for a table that
# does not exist, and distinct from the conflict below, so that a caller can
# tell "wrong database or schema" from "streampos disagrees with Synapse".
NOT_SYNAPSE_SQLSTATE = "42P01"
# A schema that does not exist: invalid_schema_name, as PostgreSQL raises it.
NO_SCHEMA_SQLSTATE = "3F000"
# streampos.instances already gives a Synapse instance name another id, or
# a Synapse id to another name: importing would change what tokens mean
# (object_not_in_prerequisite_state: the database is Synapse's, streampos's
# state is what stands in the way).
INSTANCE_CONFLICT_SQLSTATE = "55000"

STREAMS = synapse_db.load_stream_map()
BY_NAME = {s.name: s for s in STREAMS}

# A token a client may hold, minted by Synapse with its instance_map ids:
# every writer at 56, except instance 2 at 58 and instance 3 at 59.
CLIENT_TOKEN = "m56~2.58~3.59"


# --------------------------------------------------------------- fixtures


def _adopt(conn, schema=None):
    if schema is None:
        return rows(conn, ADOPT)
    return rows(conn, ADOPT_IN, (schema,))


class Adopted:
    """A copy of the Synapse template after one adopt_synapse() call, and
    what the Synapse database said before it."""

    def __init__(self, dbname):
        self.dbname = dbname
        with connect_raw(dbname) as c:
            self.facts = synapse_db.observe(c)
            self.instance_map = synapse_db.instance_map(c)
            # One transaction, so the imported positions are seen before the
            # position worker moves them.
            c.execute("BEGIN")
            self.result = _adopt(c)
            self.positions_at_adoption = rows(
                c, "SELECT stream_name, instance_name, stream_id FROM streampos.stream_positions"
            )
            c.execute("COMMIT")

    def connect(self):
        return connect_raw(self.dbname)


@pytest.fixture(scope="module")
def adopted(synapse_template):
    with scratch_database("streampos_synapse_adopted", template=synapse_template) as name:
        yield Adopted(name)


@pytest.fixture
def synapse_copy(synapse_template, request):
    """A fresh copy of the Synapse template, for a test that changes it."""
    name = "streampos_synapse_" + request.node.name.removeprefix("test_")[:30]
    with scratch_database(name, template=synapse_template) as dbname:
        yield dbname


@pytest.fixture
def adopted_db(adopted):
    with adopted.connect() as c:
        yield c


def actions(result, stream):
    return [(action, detail) for s, action, detail in result if s == stream]


def registered(conn):
    """{stream: (seq regclass text, backwards, owns_sequence, writers)}."""
    return {
        r[0]: r[1:]
        for r in rows(conn, "SELECT stream_name, seq::text, backwards, owns_sequence, writers FROM streampos.streams")
    }


def registered_tables(conn, stream):
    return set(
        rows(
            conn,
            "SELECT tbl::text, instance_column::text, id_column::text FROM streampos.stream_tables "
            "WHERE stream_name = %s",
            (stream,),
        )
    )


def catalog_snapshot(conn):
    """Everything adopt_synapse may change, except stream_positions (the
    position worker moves them on its own)."""
    sequences = {
        s.name: one(conn, f"SELECT last_value::text || ' ' || is_called::text FROM public.{s.sequence}")
        for s in STREAMS
    }
    return (
        rows(conn, "SELECT * FROM streampos.streams ORDER BY stream_name"),
        rows(
            conn,
            "SELECT stream_name, tbl::text, id_column, instance_column FROM streampos.stream_tables ORDER BY 1, 2",
        ),
        rows(conn, "SELECT * FROM streampos.instances ORDER BY instance_id"),
        sequences,
    )


# --------------------------------------------------------------- the map


def test_stream_map_matches_synapse_source():
    """sql/synapse_streams.tsv is exactly what the pinned Synapse constructs:
    every MultiWriterIdGenerator(...) with its stream name, sequence,
    direction, tables (in order) and writers."""
    from_source = synapse_db.stream_map_from_synapse_source()
    assert synapse_db.format_stream_map(from_source) == synapse_db.format_stream_map(
        sorted(STREAMS, key=lambda s: s.name)
    ), "sql/synapse_streams.tsv is stale: regenerate it with `python test/python/synapse_db.py --map`"
    assert len(STREAMS) == 17


def test_stream_map_matches_synapse_schema(synapse_template):
    """Every sequence, table and column of the map exists in the schema
    Synapse's prepare_database creates, with INCREMENT 1 and CACHE 1 (what
    adopt_stream requires)."""
    with connect_raw(synapse_template) as c:
        for spec in STREAMS:
            increment, cache = c.execute(
                "SELECT seqincrement, seqcache FROM pg_catalog.pg_sequence WHERE seqrelid = %s::regclass",
                (f"public.{spec.sequence}",),
            ).fetchone()
            assert (increment, cache) == (1, 1), spec.sequence
            for table, instance_column, id_column in spec.tables:
                columns = {
                    name: type_name
                    for name, type_name in rows(
                        c,
                        "SELECT attname::text, format_type(atttypid, atttypmod) FROM pg_catalog.pg_attribute "
                        "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped",
                        (f"public.{table}",),
                    )
                }
                assert columns.get(instance_column) == "text", (spec.name, table, instance_column)
                assert columns.get(id_column) in ("bigint", "integer"), (spec.name, table, id_column)


def test_template_has_rows_for_every_stream_and_writer(synapse_template):
    """The helper's data: every table of every stream has rows, configurable
    streams from all three writers, and events_stream_seq lags its tables by
    32 while every other sequence is at its tables' highest ID."""
    with connect_raw(synapse_template) as c:
        facts = synapse_db.observe(c)
        assert set(facts) == set(BY_NAME)
        for name, f in facts.items():
            assert set(f.table_highest) == {t for t, _i, _c in f.spec.tables}
            assert all(h > 1 for h in f.table_highest.values()), name
            expected_writers = set(f.spec.fixed_writers or synapse_db.WRITERS)
            assert f.writers == expected_writers, name
            table_highest = max(f.table_highest.values())
            if name == synapse_db.LAGGING_STREAM:
                assert f.sequence_value == table_highest - synapse_db.LAG
            else:
                assert f.sequence_value == table_highest, name
        assert synapse_db.instance_map(c) == synapse_db.INSTANCE_MAP


# --------------------------------------------------------------- one call


def test_every_stream_is_registered_with_its_sequence_direction_and_tables(adopted, adopted_db):
    streams = registered(adopted_db)
    assert set(streams) == set(BY_NAME)
    for spec in STREAMS:
        seq, backwards, owns_sequence, _writers = streams[spec.name]
        assert seq == spec.sequence, spec.name  # public is on the search_path
        assert backwards == spec.backwards, spec.name
        assert owns_sequence is False, spec.name  # Synapse's sequence: never dropped with the stream
        assert registered_tables(adopted_db, spec.name) == {
            (table, instance_column, id_column) for table, instance_column, id_column in spec.tables
        }, spec.name


def test_events_and_backfill_share_the_events_table(adopted_db):
    """Positive IDs in events belong to the events stream, negative ones to
    backfill: both streams list the table, in opposite directions."""
    assert ("events", "instance_name", "stream_ordering") in registered_tables(adopted_db, "events")
    assert ("events", "instance_name", "stream_ordering") in registered_tables(adopted_db, "backfill")
    assert registered(adopted_db)["backfill"][1] is True
    assert registered(adopted_db)["events"][1] is False


def test_the_result_says_what_was_done(adopted):
    for spec in STREAMS:
        done = actions(adopted.result, spec.name)
        assert (ADOPTED in [a for a, _d in done]), (spec.name, done)
        assert SKIPPED not in [a for a, _d in done], (spec.name, done)
    for stream, action, detail in adopted.result:
        if action in (SKIPPED, REPAIRED):
            assert detail, (stream, action, detail)


def test_lagging_sequence_is_repaired_and_reported(adopted, adopted_db):
    """events_stream_seq was 32 behind its tables (and behind stored
    positions): it is moved forward to the highest of them, and the result
    says so; no other sequence needed it."""
    events = adopted.facts["events"]
    assert events.sequence_value == max(events.table_highest.values()) - synapse_db.LAG
    repaired = [(s, d) for s, a, d in adopted.result if a == REPAIRED]
    assert [s for s, _d in repaired] == ["events"], adopted.result
    assert str(events.highest) in repaired[0][1]
    last_value, is_called = adopted_db.execute("SELECT last_value, is_called FROM events_stream_seq").fetchone()
    assert (last_value, is_called) == (events.highest, True)


def test_sequences_are_not_moved_otherwise(adopted, adopted_db):
    for name, f in adopted.facts.items():
        if name == "events":
            continue
        last_value, is_called = adopted_db.execute(f"SELECT last_value, is_called FROM {f.spec.sequence}").fetchone()
        assert (last_value if is_called else last_value - 1) == f.sequence_value, name


def test_instance_ids_are_synapses(adopted, adopted_db):
    assert adopted.instance_map == synapse_db.INSTANCE_MAP
    imported = dict(rows(adopted_db, "SELECT instance_name, instance_id FROM streampos.instances"))
    for name, instance_id in adopted.instance_map.items():
        assert imported.get(name) == instance_id, name
        assert one(adopted_db, "SELECT streampos.instance_id(%s)", (name,)) == instance_id
        assert one(adopted_db, "SELECT streampos.instance_name(%s)", (instance_id,)) == name


def test_a_token_a_client_holds_decodes_to_the_same_writers(adopted, adopted_db):
    """m56~2.58~3.59, minted by Synapse: instance 2 is worker2, 3 is worker1
    (Synapse's instance_map), whatever order streampos met the names in."""
    by_id = {i: n for n, i in adopted.instance_map.items()}
    assert (by_id[2], by_id[3]) == ("worker2", "worker1")
    for token_type in ("streampos.room_stream_token", "streampos.multi_writer_token"):
        token = f"'{CLIENT_TOKEN}'::{token_type}"
        assert one(adopted_db, f"SELECT streampos.instance_pos({token}, 'worker2')") == 58
        assert one(adopted_db, f"SELECT streampos.instance_pos({token}, 'worker1')") == 59
        assert one(adopted_db, f"SELECT streampos.instance_pos({token}, 'master')") == 56
        assert one(adopted_db, f"SELECT streampos.instance_pos({token}, {adopted.instance_map['master']})") == 56


def test_new_instances_get_ids_synapse_never_gave(adopted, adopted_db):
    """Past every imported id, and past instance_map's sequence too: its
    upserts burn values, and Synapse may have handed out the burnt ones."""
    new_id = one(adopted_db, "SELECT streampos.instance_id('worker_added_after_adoption')")
    assert new_id > max(adopted.instance_map.values())
    assert new_id > synapse_db.INSTANCE_MAP_SEQUENCE_VALUE


def test_positions_after_adoption(adopted, adopted_db):
    """With Synapse stopped nothing is in flight: every stream is at its
    sequence, which is at least every row and every stored position, and
    every writer is there too (writer ids: Synapse's)."""
    for name, f in adopted.facts.items():
        assert one(adopted_db, "SELECT streampos.frontier(%s)", (name,)) == f.frontier, name
        assert one(adopted_db, "SELECT streampos.max_allocated(%s)", (name,)) == f.frontier, name
        writers = rows(
            adopted_db, "SELECT instance_name, instance_id, stream_id FROM streampos.writer_positions(%s)", (name,)
        )
        for instance_name, instance_id, stream_id in writers:
            assert stream_id == f.frontier, (name, instance_name)
            if instance_name in adopted.instance_map:
                assert instance_id == adopted.instance_map[instance_name], (name, instance_name)
        token = one(adopted_db, "SELECT streampos.current_token(%s)::text", (name,))
        assert token == str(f.frontier), name
    assert one(adopted_db, "SELECT streampos.current_room_token()::text") == f"s{adopted.facts['events'].highest}"


def test_stream_positions_are_imported(adopted, adopted_db):
    """Synapse's stream_positions rows arrive unchanged (backfill's negative);
    rows the call adds are at the frontier; later the worker only moves them
    forward, never past the frontier."""
    at_adoption = {(s, i): p for s, i, p in adopted.positions_at_adoption}
    for name, f in adopted.facts.items():
        for instance, position in f.positions.items():
            assert at_adoption.get((name, instance)) == position, (name, instance)
    synapse_rows = {(n, i) for n, f in adopted.facts.items() for i in f.positions}
    for (name, instance), position in at_adoption.items():
        if (name, instance) not in synapse_rows:
            assert position == adopted.facts[name].frontier, (name, instance, position)
    for name, instance, position in rows(
        adopted_db, "SELECT stream_name, instance_name, stream_id FROM streampos.stream_positions"
    ):
        f = adopted.facts[name]
        before = at_adoption.get((name, instance))
        if before is not None:
            assert abs(before) <= abs(position), (name, instance)
        assert abs(position) <= f.highest, (name, instance, position)
        assert (position <= 0) if f.spec.backwards else (position >= 0), (name, instance, position)


def test_every_synapse_writer_may_write(adopted, adopted_db):
    """Writer lists live in homeserver.yaml, not in the database: a stream
    is open (writers NULL) or lists at least every instance Synapse kept a
    position for; Synapse's writer-less streams (caches,
    e2e_cross_signing_keys) are open."""
    streams = registered(adopted_db)
    for name, f in adopted.facts.items():
        writers = streams[name][3]
        if f.spec.writers == "{}":
            assert writers is None, name
        elif writers is not None:
            assert set(f.positions) <= set(writers), (name, writers)


def test_second_call_changes_nothing(adopted, adopted_db):
    before = catalog_snapshot(adopted_db)
    again = _adopt(adopted_db)
    assert catalog_snapshot(adopted_db) == before
    for spec in STREAMS:
        assert [a for a, _d in actions(again, spec.name)] == [UNCHANGED], (spec.name, again)
    assert {a for _s, a, _d in again} == {UNCHANGED}, again


# --------------------------------------------------------------- after adoption


def test_writers_continue_above_the_tables(synapse_copy):
    with connect_raw(synapse_copy) as c:
        facts = synapse_db.observe(c)
        ids = synapse_db.instance_map(c)
        _adopt(c)
    events = facts["events"].highest
    sessions = [connect_raw(synapse_copy) for _ in range(3)]
    try:
        a, b, observer = sessions
        # One ID from each writer, in turn: right above everything Synapse wrote.
        allocated = []
        for writer in synapse_db.WRITERS:
            a.execute("BEGIN")
            allocated.append(one(a, "SELECT streampos.next_id('events', %s)", (writer,)))
            durable_commit(a)
        assert allocated == [events + 1, events + 2, events + 3]
        assert one(observer, "SELECT streampos.current_room_token()::text") == f"s{events + 3}"

        # worker1 holds an ID while worker2 commits a later one: the token
        # names worker2 by Synapse's id for it.
        a.execute("BEGIN")
        held = one(a, "SELECT streampos.next_id('events', 'worker1')")
        b.execute("BEGIN")
        later = one(b, "SELECT streampos.next_id('events', 'worker2')")
        durable_commit(b)
        token = one(observer, "SELECT streampos.current_room_token()::text")
        assert token.startswith(f"m{held - 1}~"), token
        entries = dict(e.split(".") for e in token.split("~")[1:])
        assert entries.get(str(ids["worker2"])) == str(later), token
        assert str(ids["worker1"]) not in entries, token
        by_id = {str(i): n for n, i in ids.items()}
        for instance_id, position in entries.items():
            name = by_id.get(instance_id) or one(observer, "SELECT streampos.instance_name(%s)", (int(instance_id),))
            assert one(observer, "SELECT streampos.writer_position('events', %s)", (name,)) == int(position)
        durable_commit(a)
        assert one(observer, "SELECT streampos.current_room_token()::text") == f"s{later}"

        # Backfill goes on downwards, other streams upwards.
        backfill = facts["backfill"].highest
        a.execute("BEGIN")
        assert one(a, "SELECT streampos.next_id('backfill', 'master')") == -(backfill + 1)
        assert one(a, "SELECT streampos.next_id('receipts', 'worker2')") == facts["receipts"].highest + 1
        durable_commit(a)
        assert one(observer, "SELECT streampos.frontier('backfill')") == -(backfill + 1)
    finally:
        for s in sessions:
            s.close()


# --------------------------------------------------------------- refusals


def _assert_nothing_registered(conn):
    assert one(conn, "SELECT count(*) FROM streampos.streams") == 0
    assert one(conn, "SELECT count(*) FROM streampos.stream_positions") == 0


def test_a_database_that_is_not_synapses_is_refused():
    with scratch_database("streampos_not_synapse") as name, connect_raw(name) as c:
        err = expect_error(c, ADOPT, sqlstate=NOT_SYNAPSE_SQLSTATE)
        detail = err.diag.message_detail or ""
        assert any(t in detail for t in ("schema_version", "instance_map", "stream_positions")), detail
        _assert_nothing_registered(c)
        assert one(c, "SELECT count(*) FROM streampos.instances") == 0

        # A lookalike with an events table and sequence is not Synapse either.
        c.execute("CREATE TABLE events (stream_ordering bigint, instance_name text)")
        c.execute("CREATE SEQUENCE events_stream_seq")
        err = expect_error(c, ADOPT, sqlstate=NOT_SYNAPSE_SQLSTATE)
        detail = err.diag.message_detail or ""
        assert any(t in detail for t in ("schema_version", "instance_map", "stream_positions")), detail
        _assert_nothing_registered(c)

        # A schema that does not exist.
        with pytest.raises(psycopg.Error) as info:
            c.execute(ADOPT_IN, ("no_such_schema",))
        assert info.value.diag.sqlstate == NO_SCHEMA_SQLSTATE, info.value
        assert "no_such_schema" in str(info.value), info.value
        _assert_nothing_registered(c)


def test_synapse_in_another_schema(synapse_copy):
    """Synapse's tables in schema synapse (public empty): the default
    refuses, adopt_synapse('synapse') registers the tables and sequences of
    that schema."""
    with connect_raw(synapse_copy) as c:
        c.execute("ALTER SCHEMA public RENAME TO synapse")
        c.execute("CREATE SCHEMA public")
        facts = synapse_db.observe(c, "synapse")
        ids = synapse_db.instance_map(c, "synapse")
        expect_error(c, ADOPT, sqlstate=NOT_SYNAPSE_SQLSTATE)
        _assert_nothing_registered(c)

        result = _adopt(c, "synapse")
        for spec in STREAMS:
            assert ADOPTED in [a for a, _d in actions(result, spec.name)], (spec.name, result)
        streams = registered(c)
        assert set(streams) == set(BY_NAME)
        for spec in STREAMS:
            assert streams[spec.name][0] == f"synapse.{spec.sequence}", spec.name
            assert registered_tables(c, spec.name) == {
                (f"synapse.{table}", instance_column, id_column)
                for table, instance_column, id_column in spec.tables
            }, spec.name
            assert one(c, "SELECT streampos.frontier(%s)", (spec.name,)) == facts[spec.name].frontier, spec.name
        assert dict(rows(c, "SELECT instance_name, instance_id FROM streampos.instances")) == ids
        assert [s for s, a, _d in result if a == REPAIRED] == ["events"]


def test_an_older_schema_adopts_what_it_has(synapse_copy):
    """What a schema lacks is skipped, with the missing object named:
    sticky_events (schema 93) without its sequence and table; a table of
    device_lists_stream gone (the stream is adopted with the other five);
    a sequence with a cache (adopt_stream cannot track it)."""
    with connect_raw(synapse_copy) as c:
        c.execute("DROP TABLE sticky_events CASCADE")
        c.execute("DROP SEQUENCE sticky_events_sequence")
        c.execute("DELETE FROM stream_positions WHERE stream_name = 'sticky_events'")
        c.execute("DROP TABLE device_lists_changes_converted_stream_position")
        c.execute("ALTER SEQUENCE presence_stream_sequence CACHE 10")
        result = _adopt(c)
        streams = registered(c)

        sticky = actions(result, "sticky_events")
        assert [a for a, _d in sticky] == [SKIPPED], result
        assert "sticky_events_sequence" in sticky[0][1]
        assert "sticky_events" not in streams

        presence = actions(result, "presence_stream")
        assert [a for a, _d in presence] == [SKIPPED], result
        assert "presence_stream_sequence" in presence[0][1] and "CACHE" in presence[0][1].upper()
        assert "presence_stream" not in streams
        # Its positions stay in Synapse's table: there is no stream to hold them.
        assert one(c, "SELECT count(*) FROM streampos.stream_positions WHERE stream_name = 'presence_stream'") == 0

        devices = actions(result, "device_lists_stream")
        assert ADOPTED in [a for a, _d in devices], result
        assert any(
            a == SKIPPED and "device_lists_changes_converted_stream_position" in d for a, d in devices
        ), result
        assert registered_tables(c, "device_lists_stream") == {
            t for t in BY_NAME["device_lists_stream"].tables if t[0] != "device_lists_changes_converted_stream_position"
        }

        assert set(streams) == set(BY_NAME) - {"sticky_events", "presence_stream"}
        for name in streams:
            assert ADOPTED in [a for a, _d in actions(result, name)], (name, result)

        # Once the schema is complete, a second call adopts what was missing.
        c.execute("ALTER SEQUENCE presence_stream_sequence CACHE 1")
        again = _adopt(c)
        assert ADOPTED in [a for a, _d in actions(again, "presence_stream")], again
        assert [a for a, _d in actions(again, "events")] == [UNCHANGED], again


@pytest.mark.parametrize(
    "before",
    [
        # worker1 is 3 in Synapse; streampos met it first and gave it 1.
        "SELECT streampos.instance_id('worker1')",
        # Synapse's id 2 (worker2) already names another instance.
        "INSERT INTO streampos.instances (instance_id, instance_name) VALUES (2, 'someone_else')",
    ],
    ids=["name_with_another_id", "id_with_another_name"],
)
def test_conflicting_instances_are_refused(synapse_copy, before):
    with connect_raw(synapse_copy) as c:
        c.execute(before)
        instances_before = rows(c, "SELECT * FROM streampos.instances ORDER BY 1")
        err = expect_error(c, ADOPT, sqlstate=INSTANCE_CONFLICT_SQLSTATE)
        text = f"{err.diag.message_primary} {err.diag.message_detail}"
        assert "worker1" in text or "worker2" in text, text
        _assert_nothing_registered(c)
        assert rows(c, "SELECT * FROM streampos.instances ORDER BY 1") == instances_before


def test_a_newer_synapse_schema_is_reported(synapse_copy):
    """The map is schema 94's: a newer database may have streams it does
    not know. The call adopts what the map knows and says so."""
    with connect_raw(synapse_copy) as c:
        c.execute("UPDATE schema_version SET version = version + 1")
        version = one(c, "SELECT version FROM schema_version")
        result = _adopt(c)
        notes = [d for s, a, d in result if s is None and a == SKIPPED]
        assert len(notes) == 1 and str(version) in notes[0] and "94" in notes[0], result
        assert set(registered(c)) == set(BY_NAME)


def test_what_cannot_be_adopted_as_it_is_is_skipped(synapse_copy):
    """An UNLOGGED sequence, a stream registered already with another
    sequence, a Synapse sequence another stream uses, a table without its ID
    column or its instance column: each is reported, nothing of it changed,
    and its positions stay behind."""
    with connect_raw(synapse_copy) as c:
        c.execute("ALTER SEQUENCE receipts_sequence SET UNLOGGED")
        own_seq = one(c, "SELECT streampos.create_stream('to_device')::text")
        c.execute("SELECT streampos.adopt_stream('my_pushers', 'pushers_sequence')")
        c.execute("ALTER TABLE device_lists_remote_pending DROP COLUMN instance_name")
        c.execute("ALTER TABLE current_state_delta_stream DROP COLUMN stream_id CASCADE")
        c.execute("INSERT INTO instance_map (instance_id, instance_name) VALUES (11, repeat('w', 64))")
        result = _adopt(c)
        streams = registered(c)

        receipts = actions(result, "receipts")
        assert [a for a, _d in receipts] == [SKIPPED] and "UNLOGGED" in receipts[0][1], result
        assert "receipts" not in streams

        to_device = actions(result, "to_device")
        assert [a for a, _d in to_device] == [SKIPPED] and own_seq in to_device[0][1], result
        assert streams["to_device"][0] == own_seq
        assert registered_tables(c, "to_device") == set()

        pushers = actions(result, "pushers")
        assert [a for a, _d in pushers] == [SKIPPED] and "my_pushers" in pushers[0][1], result
        assert "pushers" not in streams and streams["my_pushers"][0] == "pushers_sequence"

        for skipped in ("receipts", "to_device", "pushers"):
            assert one(c, "SELECT count(*) FROM streampos.stream_positions WHERE stream_name = %s", (skipped,)) == 0

        devices = actions(result, "device_lists_stream")
        assert any(a == SKIPPED and "device_lists_remote_pending" in d and "instance_name" in d for a, d in devices)
        assert ("device_lists_remote_pending", None, "stream_id") in registered_tables(c, "device_lists_stream")
        events = actions(result, "events")
        assert any(a == SKIPPED and "current_state_delta_stream" in d and "stream_id" in d for a, d in events)
        assert "current_state_delta_stream" not in {t for t, _i, _c in registered_tables(c, "events")}

        # An instance streampos cannot name (64 bytes): skipped, its id
        # never given to another name.
        notes = [d for s, a, d in result if s is None and a == SKIPPED]
        assert len(notes) == 1 and "id 11" in notes[0], result
        assert one(c, "SELECT count(*) FROM streampos.instances WHERE instance_id = 11") == 0
        assert one(c, "SELECT streampos.instance_id('after_adoption')") > 11

        # A second call changes none of it.
        again = _adopt(c)
        assert [a for a, _d in actions(again, "receipts")] == [SKIPPED]
        assert [a for a, _d in actions(again, "to_device")] == [SKIPPED]
        assert registered(c) == streams


def test_a_schema_name_that_needs_quoting(synapse_copy):
    with connect_raw(synapse_copy) as c:
        c.execute('ALTER SCHEMA public RENAME TO "Syn""apse db"')
        c.execute("CREATE SCHEMA public")
        result = _adopt(c, 'Syn"apse db')
        assert {s for s, a, _d in result if a == ADOPTED} == set(BY_NAME), result
        assert registered(c)["events"][0] == '"Syn""apse db".events_stream_seq'
        assert ('"Syn""apse db".events', "instance_name", "stream_ordering") in registered_tables(c, "events")
        expect_error(c, ADOPT_IN, ("Syn\"apse db; DROP TABLE x",), sqlstate=NO_SCHEMA_SQLSTATE)


def test_concurrent_adoptions_wait_for_each_other(synapse_copy):
    """The second call waits for the first to commit, then finds every
    stream registered (it reads with a snapshot taken after the wait)."""
    with connect_raw(synapse_copy) as first, connect_raw(synapse_copy) as second:
        first.execute("BEGIN")
        assert ADOPTED in {a for _s, a, _d in _adopt(first)}
        results = []
        waiter = threading.Thread(target=lambda: results.append(_adopt(second)))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive(), "the second adoption did not wait for the first"
        first.execute("COMMIT")
        waiter.join(30)
        assert not waiter.is_alive()
        assert {a for _s, a, _d in results[0]} == {UNCHANGED}, results[0]


# --------------------------------------------------------------- privileges


@contextlib.contextmanager
def role(dbname, prefix):
    """A login role of its own for a test, dropped afterwards with what it
    was granted in ``dbname``."""
    name = f"{prefix}_{uuid.uuid4().hex[:6]}"
    with connect_raw("postgres") as admin:
        admin.execute(f"CREATE ROLE {name} LOGIN")
    try:
        yield name
    finally:
        with connect_raw(dbname) as c:
            c.execute(f"DROP OWNED BY {name} CASCADE")
        with connect_raw("postgres") as admin:
            admin.execute(f"DROP ROLE {name}")


def sequence_values(conn):
    return {s.name: one(conn, f"SELECT last_value::text || ' ' || is_called::text FROM public.{s.sequence}") for s in STREAMS}


def _give_synapses_tables_to(conn, owner):
    """Make ``owner`` own every table and sequence of schema public, as the
    role a homeserver connects as does."""
    conn.execute(
        f"""
        DO $$
        DECLARE r record;
        BEGIN
            FOR r IN SELECT c.oid::regclass AS rel FROM pg_class c
                     WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p')
            LOOP
                EXECUTE format('ALTER TABLE %s OWNER TO {owner}', r.rel);
            END LOOP;
            -- Sequences a column owns moved with their table.
            FOR r IN SELECT c.oid::regclass AS rel FROM pg_class c
                     WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'S'
                       AND c.relowner <> '{owner}'::regrole
            LOOP
                EXECUTE format('ALTER SEQUENCE %s OWNER TO {owner}', r.rel);
            END LOOP;
        END
        $$
        """
    )


def test_adoption_is_not_for_public(synapse_copy):
    with role(synapse_copy, "adopt_nobody") as nobody, connect_raw(synapse_copy, user=nobody) as c:
        expect_error(c, ADOPT, sqlstate="42501")
        _assert_nothing_registered(c)


def test_a_caller_that_does_not_own_synapses_sequences_cannot_adopt_them(synapse_copy):
    """EXECUTE and SELECT on every table are not enough: registering a
    sequence lets streampos move it, so adopt_stream's rule holds (the
    caller must own it), and Synapse's tables are read as their owner, so
    the caller must be able to act as it (the first refusal names
    schema_version). Nothing is registered or imported."""
    with role(synapse_copy, "adopt_reader") as reader:
        with connect_raw(synapse_copy) as admin:
            admin.execute(f"GRANT EXECUTE ON FUNCTION streampos.adopt_synapse(name) TO {reader}")
            admin.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {reader}")
            instances = rows(admin, "SELECT * FROM streampos.instances ORDER BY 1")
            sequences = sequence_values(admin)
        with connect_raw(synapse_copy, user=reader) as c:
            err = expect_error(c, ADOPT, sqlstate="42501")
            assert "must be owner of table public.schema_version" in err.diag.message_primary, err
            # Not even the instances (checks come before writes; an error
            # rolls the call back).
            _assert_nothing_registered(c)
            assert rows(c, "SELECT * FROM streampos.instances ORDER BY 1") == instances
        with connect_raw(synapse_copy) as admin:
            assert sequence_values(admin) == sequences


def test_the_owner_of_synapses_tables_adopts_without_being_superuser(synapse_copy):
    """The role that owns Synapse's tables and sequences, granted EXECUTE,
    adopts everything: the catalog is written as the extension's owner,
    although the role itself may not write it."""
    with role(synapse_copy, "adopt_homeserver") as owner:
        with connect_raw(synapse_copy) as admin:
            _give_synapses_tables_to(admin, owner)
            admin.execute(f"GRANT EXECUTE ON FUNCTION streampos.adopt_synapse(name) TO {owner}")
        with connect_raw(synapse_copy, user=owner) as c:
            assert not one(c, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            facts = synapse_db.observe(c)
            result = _adopt(c)
            assert {s for s, a, _d in result if a == ADOPTED} == set(BY_NAME), result
            assert [s for s, a, _d in result if a == REPAIRED] == ["events"]
            assert dict(rows(c, "SELECT instance_name, instance_id FROM streampos.instances")) == synapse_db.INSTANCE_MAP
            assert one(c, "SELECT streampos.frontier('events')") == facts["events"].frontier
            expect_error(c, "INSERT INTO streampos.instances VALUES (100, 'intruder')", sqlstate="42501")
            expect_error(c, "DELETE FROM streampos.stream_positions", sqlstate="42501")


# Every function and operator adoption's SQL uses, overloaded in a schema
# that comes before pg_catalog in the caller's search_path, each raising.
HOSTILE_OBJECTS = """
CREATE FUNCTION evil.trap() RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'evil trap ran'; END $$;
CREATE FUNCTION evil.quote_ident(text) RETURNS text LANGUAGE sql AS 'SELECT evil.trap()::text';
CREATE FUNCTION evil.format(text) RETURNS text LANGUAGE sql AS 'SELECT evil.trap()::text';
CREATE FUNCTION evil.format(text, text) RETURNS text LANGUAGE sql AS 'SELECT evil.trap()::text';
CREATE FUNCTION evil.abs(bigint) RETURNS bigint LANGUAGE sql AS 'SELECT evil.trap()::int::bigint';
CREATE FUNCTION evil.setval(regclass, bigint) RETURNS bigint LANGUAGE sql AS 'SELECT evil.trap()::int::bigint';
CREATE FUNCTION evil.setval(regclass, bigint, boolean) RETURNS bigint LANGUAGE sql AS 'SELECT evil.trap()::int::bigint';
CREATE FUNCTION evil.nextval(regclass) RETURNS bigint LANGUAGE sql AS 'SELECT evil.trap()::int::bigint';
CREATE FUNCTION evil.unnest(integer[]) RETURNS SETOF integer LANGUAGE sql AS 'SELECT evil.trap()::int';
CREATE FUNCTION evil.unnest(text[]) RETURNS SETOF text LANGUAGE sql AS 'SELECT evil.trap()::text';
CREATE FUNCTION evil.unnest(bigint[]) RETURNS SETOF bigint LANGUAGE sql AS 'SELECT evil.trap()::int::bigint';
CREATE FUNCTION evil.max_step(bigint, bigint) RETURNS bigint LANGUAGE sql AS 'SELECT evil.trap()::int::bigint';
CREATE AGGREGATE evil.max(bigint) (SFUNC = evil.max_step, STYPE = bigint);
CREATE FUNCTION evil.max_step(bigint, integer) RETURNS bigint LANGUAGE sql AS 'SELECT evil.trap()::int::bigint';
CREATE AGGREGATE evil.max(integer) (SFUNC = evil.max_step, STYPE = bigint);
CREATE FUNCTION evil.to_regclass(text) RETURNS regclass LANGUAGE sql AS 'SELECT evil.trap()::int::oid::regclass';
CREATE FUNCTION evil.pg_get_serial_sequence(text, text) RETURNS text LANGUAGE sql AS 'SELECT evil.trap()::text';
CREATE FUNCTION evil.eq(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT evil.trap()';
CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.eq);
CREATE FUNCTION evil.eq(name, text) RETURNS boolean LANGUAGE sql AS 'SELECT evil.trap()';
CREATE OPERATOR evil.= (LEFTARG = name, RIGHTARG = text, FUNCTION = evil.eq);
CREATE FUNCTION evil.eq(name, name) RETURNS boolean LANGUAGE sql AS 'SELECT evil.trap()';
CREATE OPERATOR evil.= (LEFTARG = name, RIGHTARG = name, FUNCTION = evil.eq);
CREATE FUNCTION evil.eq(oid, oid) RETURNS boolean LANGUAGE sql AS 'SELECT evil.trap()';
CREATE OPERATOR evil.= (LEFTARG = oid, RIGHTARG = oid, FUNCTION = evil.eq);
CREATE FUNCTION evil.eq("char", "char") RETURNS boolean LANGUAGE sql AS 'SELECT evil.trap()';
CREATE OPERATOR evil.= (LEFTARG = "char", RIGHTARG = "char", FUNCTION = evil.eq);
CREATE FUNCTION evil.eq(integer, integer) RETURNS boolean LANGUAGE sql AS 'SELECT evil.trap()';
CREATE OPERATOR evil.= (LEFTARG = integer, RIGHTARG = integer, FUNCTION = evil.eq);
CREATE FUNCTION evil.eq(bigint, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT evil.trap()';
CREATE OPERATOR evil.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = evil.eq);
CREATE FUNCTION evil.gt(bigint, bigint) RETURNS boolean LANGUAGE sql AS 'SELECT evil.trap()';
CREATE OPERATOR evil.> (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = evil.gt);
CREATE FUNCTION evil.gt(smallint, integer) RETURNS boolean LANGUAGE sql AS 'SELECT evil.trap()';
CREATE OPERATOR evil.> (LEFTARG = smallint, RIGHTARG = integer, FUNCTION = evil.gt);
CREATE FUNCTION evil.minus(bigint, integer) RETURNS bigint LANGUAGE sql AS 'SELECT evil.trap()::int::bigint';
CREATE OPERATOR evil.- (LEFTARG = bigint, RIGHTARG = integer, FUNCTION = evil.minus);
CREATE FUNCTION evil.neg(bigint) RETURNS bigint LANGUAGE sql AS 'SELECT evil.trap()::int::bigint';
CREATE OPERATOR evil.- (RIGHTARG = bigint, FUNCTION = evil.neg);
CREATE FUNCTION evil.cat(text, text) RETURNS text LANGUAGE sql AS 'SELECT evil.trap()::text';
CREATE OPERATOR evil.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.cat);
"""


def test_a_hostile_search_path_runs_none_of_its_functions(synapse_copy):
    """A schema another role owns, first in the caller's search_path
    (before pg_catalog), overloading every function and operator the
    adoption's SQL uses: none of them runs, and adoption does what it does
    with a clean path."""
    with role(synapse_copy, "adopt_evil") as evil_role:
        with connect_raw(synapse_copy) as admin:
            admin.execute(f"CREATE SCHEMA evil AUTHORIZATION {evil_role}")
        with connect_raw(synapse_copy, user=evil_role) as evil:
            evil.execute(HOSTILE_OBJECTS)
        with connect_raw(synapse_copy) as c:
            facts = synapse_db.observe(c)
            c.execute("SET search_path = evil, pg_catalog, public")
            # The traps work: unqualified SQL with this path runs them.
            for probe in (
                "SELECT 'a'::text = 'b'::text",
                "SELECT quote_ident('a')",
                "SELECT abs(-1::bigint)",
                "SELECT max(x) FROM (VALUES (1::bigint)) v(x)",
                "SELECT 1::bigint > 0::bigint",
            ):
                err = expect_error(c, probe)
                assert "evil trap ran" in str(err), probe
            result = _adopt(c)
            assert {s for s, a, _d in result if a == ADOPTED} == set(BY_NAME), result
            assert [s for s, a, _d in result if a == REPAIRED] == ["events"]
            c.execute("RESET search_path")
            assert dict(rows(c, "SELECT instance_name, instance_id FROM streampos.instances")) == synapse_db.INSTANCE_MAP
            assert one(c, "SELECT streampos.frontier('events')") == facts["events"].frontier
            assert one(c, "SELECT streampos.instance_id('after_adoption')") > synapse_db.INSTANCE_MAP_SEQUENCE_VALUE



def test_synapse_columns_of_another_type_are_refused(synapse_copy):
    """Adoption casts Synapse's columns to bigint or text: a column of
    another type (whose owner could write the cast function, which would
    run as the caller) is refused before it is read."""
    with connect_raw(synapse_copy) as c:
        c.execute("CREATE DOMAIN stream_number AS bigint")
        c.execute("ALTER TABLE stream_positions ALTER COLUMN stream_id TYPE stream_number")
        err = expect_error(c, ADOPT, sqlstate=NOT_SYNAPSE_SQLSTATE)
        assert "stream_positions.stream_id" in err.diag.message_detail, err
        _assert_nothing_registered(c)


def test_a_table_that_appears_later_is_added(synapse_copy):
    """A stream registered without a table (it did not exist then) gets it
    from a later call; the streams that had everything stay unchanged; the
    writer list set in between keeps a removed writer's position deleted."""
    with connect_raw(synapse_copy) as c:
        c.execute("ALTER TABLE ex_outlier_stream RENAME TO ex_outlier_stream_away")
        first = _adopt(c)
        assert ("ex_outlier_stream", "instance_name", "event_stream_ordering") not in registered_tables(c, "events")
        assert any(a == SKIPPED and "ex_outlier_stream" in d for a, d in actions(first, "events")), first
        c.execute("SELECT streampos.set_writers('events', ARRAY['master', 'worker1', 'worker2'])")
        c.execute("ALTER TABLE ex_outlier_stream_away RENAME TO ex_outlier_stream")
        again = _adopt(c)
        for name in ("events", "backfill"):
            done = actions(again, name)
            # The stream's highest ID may be in the table: then the sequence
            # is repaired up to it as well.
            assert [a for a, _d in done][0] == ADOPTED and "public.ex_outlier_stream" in done[0][1], again
            assert {a for a, _d in done[1:]} <= {REPAIRED}, again
            assert ("ex_outlier_stream", "instance_name", "event_stream_ordering") in registered_tables(c, name)
        assert {a for s, a, _d in again if s not in ("events", "backfill")} == {UNCHANGED}, again
        assert "retired_worker" not in dict(
            rows(c, "SELECT instance_name, stream_id FROM streampos.stream_positions WHERE stream_name = 'events'")
        )

