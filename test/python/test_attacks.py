"""Attacks on the hardened extension: an unprivileged LOGIN role, writers and
readers playing adversarial interleavings, and hostile input.

Each test is one attack. A test whose attack breaks a claim of the README or
docs/design.md FAILS on the code it was written against (its docstring says
what breaks and why); the others are attacks the code withstands, kept so
that a change cannot reopen them. Tests that need settings of their own
(an address-space limit, a slow WAL writer) run on clusters of their own
(cluster.py).
"""

import threading
import time
import uuid

import psycopg
import pytest

from cluster import Clusters
from cluster import _bin as cluster_bin
from cluster import _run as cluster_run
from failover_measure import setup_stream, token_positions, update_rows
from support import (
    commit_ids,
    connect_raw,
    create_stream,
    ensure_login_role,
    expect_error,
    force_parallel_setting,
    frontier,
    one,
    rows,
    stored_positions,
    wait_until,
)

ATTACKER = "streampos_intruder"


@pytest.fixture(scope="module")
def intruder_role(database):
    """A LOGIN role with nothing beyond PUBLIC's privileges."""
    return ensure_login_role(ATTACKER)


@pytest.fixture
def intruder(intruder_role, connect):
    return connect(user=intruder_role)






def many_instances(first, count, position=5):
    """make_multi_writer_token(0, ids first..first+count-1, every position
    `position`): a token at the cap when count is 10000."""
    return (
        "streampos.make_multi_writer_token(0, "
        f"(SELECT array_agg(i) FROM generate_series({first}, {first + count - 1}) i), "
        f"array_fill({position}::bigint, ARRAY[{count}]))"
    )


def big_token_sql(leaves):
    """A query whose one column t is a multi_writer_token listing
    leaves * 10000 instance positions, each leaf a token at the cap, merged
    with the advance() aggregate in a balanced tree (n log n work)."""
    q = (
        "SELECT g, streampos.make_multi_writer_token(0, "
        "(SELECT array_agg(i) FROM generate_series(g * 10000 + 1, g * 10000 + 10000) i), "
        "array_fill(5::bigint, ARRAY[10000])) AS t "
        f"FROM generate_series(0, {leaves - 1}) g"
    )
    n = leaves
    while n > 1:
        q = f"SELECT g / 4 AS g, streampos.advance(t) AS t FROM ({q}) s GROUP BY g / 4"
        n = (n + 3) // 4
    return f"SELECT t FROM ({q}) s"


# =====================================================================
# Exactness: the backwards-sequence guard
# =====================================================================


@pytest.mark.parametrize("how", ["setval", "restart"])
def test_a_sequence_moved_back_inside_a_writers_transaction_is_caught(db, connect, stream, how):
    """BREAKS "no missed rows". finish_allocation (registry/alloc.rs) checks
    that the sequence did not go back only for the first ID of the first
    allocation of a (transaction, stream, writer); a later allocation reuses
    the entry, whose min_id is never lowered. So when the sequence is moved
    back between two next_ids of one transaction (setval by any role with
    UPDATE on it, or ALTER SEQUENCE RESTART by its owner), the IDs of the
    second call are in flight below the entry's min_id: readers get a
    frontier past them, and rows with those IDs commit later. (A second
    transaction's allocation is caught: its lower bound is max_allocated.)
    Expected: the second call fails with 55000, or its IDs hold the
    frontier back."""
    seq = create_stream(db, stream)
    assert commit_ids(db, stream, "w0", 10)[-1] == 10
    writer = connect()
    writer.execute("BEGIN")
    assert one(writer, "SELECT streampos.next_id(%s, 'w1')", (stream,)) == 11
    if how == "setval":
        db.execute("SELECT setval(%s::regclass, 2)", (seq,))
    else:
        writer.execute(f"ALTER SEQUENCE {seq} RESTART WITH 3")
    try:
        ids = one(writer, "SELECT streampos.next_ids(%s, 'w1', 3)", (stream,))
    except psycopg.Error as e:
        assert e.diag.sqlstate == "55000", e
        writer.execute("ROLLBACK")
        return
    seen = frontier(db, stream)
    held = rows(db, "SELECT min_id, max_id FROM streampos.in_flight(%s)", (stream,))
    writer.execute("ROLLBACK")
    assert seen < min(ids), (
        f"IDs {ids} are in flight (in_flight says {held}) yet frontier() is {seen}: "
        f"a reader at {seen} misses these rows when the writer commits"
    )


def test_next_ids_across_a_sequence_wrap_is_caught(db, connect, stream):
    """BREAKS "no missed rows". The same guard looks only at the first ID a
    call got (`first < a.min_id`): a next_ids() whose sequence wraps in the
    middle of the call (CYCLE with a MAXVALUE; adopt_stream and allocation
    check INCREMENT and CACHE, not CYCLE) hands out IDs below the ones it
    registered, and frontier() passes them. Expected: 55000, or the IDs
    hold the frontier back."""
    seq = create_stream(db, stream)
    assert commit_ids(db, stream, "w0", 10)[-1] == 10
    db.execute(f"ALTER SEQUENCE {seq} MAXVALUE 12 CYCLE")
    writer = connect()
    writer.execute("BEGIN")
    try:
        ids = one(writer, "SELECT streampos.next_ids(%s, 'w1', 4)", (stream,))
    except psycopg.Error as e:
        assert e.diag.sqlstate == "55000", e
        writer.execute("ROLLBACK")
        return
    seen = frontier(db, stream)
    writer.execute("ROLLBACK")
    assert seen < min(ids), f"IDs {ids} in flight, frontier {seen}"


def test_an_altered_sequence_cache_is_refused_not_silent(db, connect, stream):
    """WITHSTANDS. The owner raises CACHE after create_stream: two backends
    then take IDs out of order. The out-of-order allocation fails (55000)
    instead of handing out an ID below the frontier."""
    seq = create_stream(db, stream)
    db.execute(f"ALTER SEQUENCE {seq} CACHE 10")
    a, b = connect(), connect()
    assert commit_ids(a, stream, "w", 1) == [1]  # a caches 1..10
    assert commit_ids(b, stream, "w", 1) == [11]
    a.execute("BEGIN")
    err = expect_error(a, "SELECT streampos.next_id(%s, 'w')", (stream,), "55000")
    assert "below one already allocated" in err.diag.message_primary
    a.execute("ROLLBACK")
    assert frontier(db, stream) == 11


# =====================================================================
# Exactness: subtransactions and rollbacks
# =====================================================================


def test_a_writer_name_created_in_a_rolled_back_savepoint_is_not_a_ghost(db, connect, stream):
    """BREAKS "no missed rows" (updates) and writer_position. next_id() with
    a new writer name creates its instance and caches the id in the
    backend (catalog.rs, instance_id); ROLLBACK TO SAVEPOINT removes the row
    but not the cached id (only a top-level abort clears the cache: no
    subtransaction callback). The backend goes on allocating as that ghost
    id; once another backend creates the name for real (a new id), tokens
    and writer_position('ghost') use the real id, which holds nothing: the
    ghost-id transaction's row is below the token a follower got, and the
    follower never receives it. A savepoint around a writer's first insert
    (a retry on a unique violation, nested transaction blocks of a client
    library) is all it takes; no privilege beyond USAGE."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f'CREATE TABLE "{table}" (id bigint, instance_name text)')
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    insert = f'INSERT INTO "{table}" SELECT streampos.next_id(%s, %s), %s RETURNING id'
    writer = f"{stream}_new"
    assert one(db, insert, (stream, "w0", "w0")) == 1
    a, b = connect(), connect()
    a.execute("BEGIN")
    a.execute("SAVEPOINT first_try")
    assert one(a, "SELECT streampos.next_id(%s, %s)", (stream, writer)) == 2
    a.execute("ROLLBACK TO SAVEPOINT first_try")
    assert one(a, insert, (stream, writer, writer)) == 3
    a.execute("COMMIT")
    assert one(b, insert, (stream, writer, writer)) == 4  # creates the name
    a.execute("BEGIN")
    held = one(a, insert, (stream, writer, writer))
    assert held == 5
    assert one(db, insert, (stream, "w0", "w0")) == 6
    position = one(db, "SELECT streampos.writer_position(%s, %s)", (stream, writer))
    answer = one(db, "SELECT streampos.updates(%s, '0')", (stream,))
    a.execute("COMMIT")
    after = one(db, "SELECT streampos.updates(%s, %s)", (stream, answer["token"]))
    got = sorted(r[0] for r in update_rows_generic(answer) + update_rows_generic(after))
    assert got == [1, 3, 4, 5, 6], f"the follower got {got}: row {held} is lost (token {answer['token']})"
    assert position < held, f"{writer} holds {held} yet writer_position() says {position}"


def test_a_rolled_back_drop_stream_leaves_the_stream_working(db, stream):
    """BREAKS robustness (stored positions). drop_stream() marks the
    stream's registry state dropped at once (registry::mark_dropped, shared
    memory, not transactional); if the transaction rolls back the stream
    lives on, but the position worker skips dropped states
    (registry/streams.rs, streams_of): its stream_positions never move
    again until a restart (and the state is reclaimable while in use)."""
    create_stream(db, stream)
    commit_ids(db, stream, "w")
    wait_until(lambda: stored_positions(db, stream) == {"w": 1}, timeout=5)
    db.execute("BEGIN")
    db.execute("SELECT streampos.drop_stream(%s)", (stream,))
    db.execute("ROLLBACK")
    assert commit_ids(db, stream, "w", 3) == [2, 3, 4]
    assert frontier(db, stream) == 4
    wait_until(lambda: stored_positions(db, stream) == {"w": 4}, timeout=3,
               message="stream_positions to move after a rolled-back drop_stream")


# =====================================================================
# Exactness: one answer per snapshot, whatever the catalog does
# =====================================================================


def test_a_cursor_keeps_its_stream_when_the_stream_is_dropped_and_created_again(db, connect, stream):
    """BREAKS "answers never go down for a fixed snapshot". The backend's
    catalog cache (catalog.rs, `stream`) returns a cached row whatever the
    caller's snapshot: a row cached by a newer statement of the same
    transaction is used by a cursor whose snapshot predates the change. The
    cursor's frontier drops from 5 to 0 between two FETCHes (it now answers
    for a stream its snapshot cannot see). Expected: the cursor answers 5
    on every FETCH (a cached row is used only by snapshots that see the
    change that made it, as design.md says of caching)."""
    create_stream(db, stream)
    commit_ids(db, stream, "w", 5)
    reader = connect()
    reader.execute("BEGIN")  # READ COMMITTED: each statement a new snapshot
    reader.execute(
        "DECLARE c CURSOR FOR SELECT streampos.frontier(%s), streampos.max_allocated(%s) "
        "FROM generate_series(1, 3)",
        (stream, stream),
    )
    first = reader.execute("FETCH 1 FROM c").fetchall()
    db.execute("SELECT streampos.drop_stream(%s)", (stream,))
    create_stream(db, stream)
    assert frontier(reader, stream) == 0  # a newer statement: the new stream
    second = reader.execute("FETCH 1 FROM c").fetchall()
    reader.execute("ROLLBACK")
    assert first == [(5, 5)]
    assert second == first, f"one cursor, one snapshot, two answers: {first} then {second}"


def test_a_cursor_keeps_its_writers_when_they_are_changed(db, connect, stream):
    """BREAKS "the same snapshot answers the same". As above, through
    set_writers: the cursor's snapshot saw writers w1, w2 (token m3~4.5,
    writer_position(w2) = 5); after set_writers(['w1']) and a newer
    statement, its next FETCH raises "w2 is not a writer" (55000), and
    current_token() for the same snapshot would drop w2."""
    create_stream(db, stream, writers=["w1", "w2"])
    commit_ids(db, stream, "w2", 3)
    holder = connect()
    holder.execute("BEGIN")
    assert one(holder, "SELECT streampos.next_id(%s, 'w1')", (stream,)) == 4
    commit_ids(db, stream, "w2", 1)
    reader = connect()
    reader.execute("BEGIN")
    reader.execute(
        "DECLARE c CURSOR FOR SELECT streampos.current_token(%s)::text, "
        "streampos.writer_position(%s, 'w2') FROM generate_series(1, 3)",
        (stream, stream),
    )
    first = reader.execute("FETCH 1 FROM c").fetchall()
    assert first == [("m3~%d.5" % one(db, "SELECT streampos.instance_id('w2')"), 5)]
    db.execute("SELECT streampos.set_writers(%s, ARRAY['w1'])", (stream,))
    reader.execute("SELECT streampos.current_token(%s)", (stream,))
    try:
        second = reader.execute("FETCH 1 FROM c").fetchall()
    except psycopg.Error as e:
        second = f"ERROR {e.diag.sqlstate}: {e.diag.message_primary}"
    holder.execute("ROLLBACK")
    assert second == first, f"one cursor, one snapshot: {first} then {second}"


def test_a_backend_never_keeps_a_catalog_row_older_than_a_committed_change(db, connect, stream):
    """BREAKS "no missed rows" (across transactions). A stream row is cached
    when the reading snapshot sees the transaction that last *called* a
    catalog-changing function (catalog.rs, snapshot_sees_catalog: one
    last_xid); a change that was called earlier but commits later is not
    that transaction. Here: A re-registers stream s (drop_stream +
    adopt_stream on the same sequence: a new stream key) and commits after
    B's unrelated create_stream; a REPEATABLE READ snapshot of backend R,
    taken in between, sees B's change but not A's, so R caches the old row,
    and keeps it after A's commit (the generation moved before R read). R's
    next transaction allocates under the dropped key: its ID is in flight
    in a registry state nobody reads, frontier() passes it, in_flight()
    does not show it."""
    other = stream + "_other"
    db.execute(f'CREATE SEQUENCE "{stream}_q"')
    db.execute("SELECT streampos.adopt_stream(%s, %s)", (stream, f"{stream}_q"))
    commit_ids(db, stream, "w", 3)
    a, b, r, writer, reader = connect(), connect(), connect(), connect(), connect()
    assert frontier(r, stream) == 3
    a.execute("BEGIN")
    a.execute("SELECT streampos.drop_stream(%s)", (stream,))
    a.execute("SELECT streampos.adopt_stream(%s, %s)", (stream, f"{stream}_q"))
    b.execute("SELECT streampos.create_stream(%s)", (other,))
    r.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    r.execute("SELECT 1")
    a.execute("COMMIT")
    assert frontier(r, stream) == 3  # the old stream: right for this snapshot
    r.execute("COMMIT")
    r.execute("BEGIN")
    held = one(r, "SELECT streampos.next_id(%s, 'w')", (stream,))
    assert held == 4
    assert one(writer, "SELECT streampos.next_id(%s, 'w')", (stream,)) == 5
    seen = frontier(reader, stream)
    shown = rows(reader, "SELECT min_id FROM streampos.in_flight(%s)", (stream,))
    r.execute("ROLLBACK")
    db.execute("SELECT streampos.drop_stream(%s)", (stream,))
    db.execute(f'DROP SEQUENCE "{stream}_q"')
    assert seen < held, f"ID {held} is in flight (in_flight shows {shown}), frontier() is {seen}"


def test_an_imported_snapshot_answers_as_its_exporter(db, connect, stream):
    """BREAKS "answers never go down for a fixed snapshot" (imported
    snapshots). The importing backend cached the recreated stream's row in
    an earlier transaction; with the exporter's snapshot (which sees the old
    stream, frontier 5) it answers 0 for the new one."""
    create_stream(db, stream)
    commit_ids(db, stream, "w", 5)
    exporter = connect()
    exporter.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    snapshot = one(exporter, "SELECT pg_export_snapshot()")
    assert frontier(exporter, stream) == 5
    db.execute("SELECT streampos.drop_stream(%s)", (stream,))
    create_stream(db, stream)
    importer = connect()
    assert frontier(importer, stream) == 0  # warms the importer's cache
    importer.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    importer.execute(f"SET TRANSACTION SNAPSHOT '{snapshot}'")
    got = frontier(importer, stream)
    again = frontier(exporter, stream)
    importer.execute("ROLLBACK")
    exporter.execute("ROLLBACK")
    assert again == 5
    assert got == 5, f"the exporter's snapshot answers 5, the same snapshot imported answers {got}"


# =====================================================================
# Exactness: parallel query
# =====================================================================


def test_followers_work_in_a_query_with_a_parallel_plan(db, connect, stream):
    """BREAKS "parallel query". wait_for() and updates() are PARALLEL
    RESTRICTED, so they run in the leader while a parallel plan is active
    elsewhere in the query; under READ COMMITTED they call
    GetLatestSnapshot() (api/follow.rs, answer_now and with_row_snapshot),
    which PostgreSQL refuses in parallel mode: "cannot update
    SecondarySnapshot during a parallel operation" (XX000). A follower that
    asks `SELECT updates(…), (SELECT count(*) FROM big)` fails; under
    force_parallel_mode every call fails. Expected: the same answer as
    without the parallel plan (e.g. mark them PARALLEL UNSAFE)."""
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f'CREATE TABLE "{table}" (id bigint, instance_name text)')
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    db.execute(f'INSERT INTO "{table}" SELECT streampos.next_id(%s, %s), %s', (stream, "w", "w"))
    p = connect()
    for setting in (
        "parallel_setup_cost = 0",
        "parallel_tuple_cost = 0",
        "min_parallel_table_scan_size = 0",
        "max_parallel_workers_per_gather = 2",
    ):
        p.execute(f"SET {setting}")
    p.execute(f'CREATE TABLE "{table}_big" AS SELECT g FROM generate_series(1, 100000) g')
    p.execute(f'ANALYZE "{table}_big"')
    plan = "\n".join(r[0] for r in rows(p, f'EXPLAIN SELECT (SELECT count(*) FROM "{table}_big")'))
    assert "Gather" in plan, plan
    failures = {}
    for name, sql in (
        ("wait_for", f'SELECT streampos.wait_for(%s, 1, 100), (SELECT count(*) FROM "{table}_big")'),
        ("updates", f'SELECT streampos.updates(%s, \'0\') IS NOT NULL, (SELECT count(*) FROM "{table}_big")'),
    ):
        try:
            p.execute(sql, (stream,))
        except psycopg.Error as e:
            failures[name] = f"{e.diag.sqlstate}: {e.diag.message_primary}"
    db.execute(f'DROP TABLE "{table}_big", "{table}"')
    assert failures == {}, f"followers fail next to a parallel plan: {failures}"


def test_a_parallel_worker_cannot_allocate(db, connect, stream):
    """WITHSTANDS. A wrapper mislabelled PARALLEL SAFE runs next_id() in a
    parallel worker (force_parallel_mode): the worker cannot take the
    sequence's value, the call fails, and nothing stays registered."""
    create_stream(db, stream)
    commit_ids(db, stream, "pw")
    fn = f'public."{stream}_nid"'
    db.execute(
        f"CREATE FUNCTION {fn}(s text) RETURNS bigint LANGUAGE plpgsql PARALLEL SAFE "
        "AS $$ BEGIN RETURN streampos.next_id(s, 'pw'); END $$"
    )
    try:
        p = connect()
        p.execute(f"SET {force_parallel_setting(p)} = on")
        p.execute("BEGIN")
        one(p, "SELECT txid_current()")
        expect_error(p, f"SELECT {fn}(%s)", (stream,))
        p.execute("ROLLBACK")
        assert rows(db, "SELECT * FROM streampos.in_flight(%s)", (stream,)) == []
        assert frontier(db, stream) == 1
        assert commit_ids(db, stream, "pw") == [2]
    finally:
        db.execute(f"DROP FUNCTION {fn}(text)")


# =====================================================================
# Hostile input: tokens beyond the cap, echoed input
# =====================================================================


def test_advance_never_builds_a_token_longer_than_the_cap(db):
    """BREAKS "tokens list at most 10000 instance positions". Input, binary
    receive and the constructors refuse more (54000), but advance()
    (core/src/token/lattice.rs, join_live) and the advance aggregate merge
    any two tokens without checking: two tokens at the cap give one of
    20000 entries, and the aggregate grows one without bound (up to the
    1 GB varlena limit; see the next tests for what that costs)."""
    a, b = many_instances(1, 10000), many_instances(10001, 10000)
    for sql in (
        f"SELECT streampos.advance({a}, {b})",
        f"SELECT streampos.advance(t) FROM (VALUES ({a}), ({b})) v(t)",
        f"SELECT streampos.advance({a}::streampos.room_stream_token, {b}::streampos.room_stream_token)",
    ):
        err = expect_error(db, f"SELECT streampos.max_stream_pos(x) FROM ({sql}) s(x)")
        assert err.diag.sqlstate == "54000", err


@pytest.mark.parametrize("fmt", ["text", "binary"])
def test_every_token_a_query_can_store_can_be_restored(db, stream, fmt):
    """BREAKS pg_dump/restore of user tables. A token built by advance()
    is stored, but COPY (and so pg_dump/pg_restore) cannot load it back:
    its text and binary input refuse more than 10000 instance positions
    (54000). A dump of a table holding one such value does not restore."""
    table = f'"{stream}_tok"'
    db.execute(f"CREATE TABLE {table} (t streampos.multi_writer_token)")
    try:
        try:
            db.execute(
                f"INSERT INTO {table} SELECT streampos.advance({many_instances(1, 10000)}, "
                f"{many_instances(10001, 10000)})"
            )
        except psycopg.Error as e:
            assert e.diag.sqlstate == "54000", e  # refused when built: fine
            return
        options = "(FORMAT binary)" if fmt == "binary" else ""
        with db.cursor() as cur:
            with cur.copy(f"COPY {table} TO STDOUT {options}") as copy:
                data = b"".join(bytes(block) for block in copy)
        db.execute(f"CREATE TABLE {table[:-1]}_restored\" (t streampos.multi_writer_token)")
        with db.cursor() as cur:
            with cur.copy(f"COPY {table[:-1]}_restored\" FROM STDIN {options}") as copy:
                copy.write(data)
        assert one(db, f"SELECT count(*) FROM {table[:-1]}_restored\"") == 1
    finally:
        db.execute(f"DROP TABLE IF EXISTS {table}, {table[:-1]}_restored\"")


def test_token_growth_cannot_abort_the_server_under_an_address_space_limit():
    """BREAKS "no input aborts the process" (cluster-wide). Under an
    address-space limit (ulimit -v, or vm.overcommit_memory=2), a plain
    SELECT by any role grows a token past the cap with the advance
    aggregate (2 000 000 entries here) and prints it: the text output
    reserves 33 bytes per entry on the Rust heap (token/text.rs,
    text_len_bound), 66 MB for a 24 MB token, and the failed Rust
    allocation aborts the backend ("memory allocation of 66000042 bytes
    failed", signal 6): the postmaster restarts every session of the
    cluster. Expected: a clean error (54000 or 53200), no restart."""
    with Clusters() as clusters:
        node = clusters.node(start=False)
        limit_kb = 300 * 1024
        cluster_run([
            "bash", "-c",
            f"ulimit -v {limit_kb} && exec {cluster_bin('pg_ctl')} -D {node.datadir} "
            f"-l {node.log} -w -t 60 start",
        ])
        try:
            wait_until(node._accepts, timeout=60, message="the node to accept connections")
            with node.connect() as c:
                c.execute("CREATE ROLE nobody LOGIN")
            with node.connect(user="nobody") as c:
                try:
                    c.execute(f"SELECT length(t::text) FROM ({big_token_sql(200)}) b")
                except psycopg.Error as e:
                    # psycopg raises OperationalError for classes 53 and 54
                    # too: a dead backend is a lost connection, no SQLSTATE.
                    if e.diag.sqlstate is None or c.broken:
                        pytest.fail(
                            f"the backend died: {e}\nserver log:\n{node.log_tail(6)}"
                        )
                    assert e.diag.sqlstate in ("54000", "53200"), e
            with node.connect() as c:
                assert one(c, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'checkpointer'") == 1
            with open(node.log, errors="replace") as f:
                log = f.read()
            assert "terminated by signal" not in log, log[-2000:]
        finally:
            node.stop("immediate")


def test_a_non_utf8_token_is_clipped_in_the_message(connect, database):
    """BREAKS "error messages do not echo unbounded input". Token input
    (types.rs, parse) clips the offending text to 200 bytes, except when
    the input is not UTF-8 — possible in a SQL_ASCII (or LATIN1) database —
    where it echoes all of it, each byte as a 3-byte U+FFFD: 100 KB of
    input give a 300 KB message."""
    name = f"streampos_ascii_{uuid.uuid4().hex[:8]}"
    with connect_raw("postgres") as admin:
        admin.execute(
            f"CREATE DATABASE {name} ENCODING 'SQL_ASCII' TEMPLATE template0 "
            "LC_COLLATE 'C' LC_CTYPE 'C'"
        )
    try:
        c = connect_raw(name)
        c.execute("CREATE EXTENSION streampos")
        c.execute("SET client_encoding = 'SQL_ASCII'")
        with pytest.raises(psycopg.Error) as info:
            c.execute(
                "SELECT repeat(convert_from('\\xff'::bytea, 'SQL_ASCII'), 100000)"
                "::streampos.multi_writer_token"
            )
        err = info.value
        assert err.diag.sqlstate == "22P02", err
        message = err.diag.message_primary or ""
        assert len(message) < 1000, f"a {len(message)}-byte message for a 100000-byte input"
        c.close()
    finally:
        with connect_raw("postgres") as admin:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


def test_the_resync_error_does_not_echo_the_whole_token(db, stream):
    """BREAKS "error messages do not echo unbounded input". updates()'s
    72000 error (api/follow.rs, refuse_ahead) quotes the caller's token in
    full: a token at the 10000-instance cap gives a 70 KB message (up to
    about 300 KB with long numbers); the project's own bound for messages
    is 2000 bytes."""
    create_stream(db, stream)
    token = "m0" + "".join(f"~{i}.1" for i in range(1, 10000)) + "~10000.999999999999"
    err = expect_error(db, "SELECT streampos.updates(%s, %s)", (stream, token), "72000")
    text = str(err) + (err.diag.message_detail or "") + (err.diag.message_hint or "")
    assert len(text) < 2000, f"a {len(text)}-byte message"


# =====================================================================
# Robustness
# =====================================================================


def test_a_dropped_stream_table_does_not_break_updates(db, stream):
    """BREAKS robustness of updates() and check_stream(). stream_tables
    keeps a regclass with no dependency; once the table is dropped,
    relation_name() (src/sql/mod.rs) returns "oid <n>" and the generated SQL is
    `FROM oid 16949 t`: every updates() and check_stream() of the stream
    fails with a syntax error (42601), for every follower, and no function
    removes a table from a stream (the catalog is not writable). Expected:
    a dropped table is skipped (or a clear error and a way to remove it)."""
    create_stream(db, stream)
    kept, dropped = f"{stream}_a", f"{stream}_b"
    for t in (kept, dropped):
        db.execute(f'CREATE TABLE "{t}" (id bigint, instance_name text)')
        db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, t))
    db.execute(f'INSERT INTO "{kept}" SELECT streampos.next_id(%s, %s), %s', (stream, "w", "w"))
    assert update_rows_generic(one(db, "SELECT streampos.updates(%s, '0')", (stream,))) == [[1, "w"]]
    db.execute(f'DROP TABLE "{dropped}"')
    try:
        answer = one(db, "SELECT streampos.updates(%s, '0')", (stream,))
        checks = rows(db, "SELECT * FROM streampos.check_stream(%s)", (stream,))
    except psycopg.Error as e:
        pytest.fail(f"updates()/check_stream() after a stream table was dropped: {e.diag.sqlstate}: {e}")
    finally:
        db.execute(f'DROP TABLE IF EXISTS "{kept}"')
    assert update_rows_generic(answer) == [[1, "w"]]
    assert checks


def test_updates_reads_a_table_with_more_than_100_columns(db, stream):
    """BREAKS updates() for wide tables (minor). Each row is built with one
    jsonb_build_array(t.c1, …, t.cN) call (src/sql/followers.rs, updates_answer), and a
    function takes at most 100 arguments: add_table() accepts a table of
    102 columns, and every updates() of the stream then fails (54023)."""
    create_stream(db, stream)
    table = f"{stream}_t"
    columns = ", ".join(f"c{i} int" for i in range(100))
    db.execute(f'CREATE TABLE "{table}" (id bigint, instance_name text, {columns})')
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    db.execute(f'INSERT INTO "{table}" (id, instance_name) SELECT streampos.next_id(%s, %s), %s', (stream, "w", "w"))
    try:
        answer = one(db, "SELECT streampos.updates(%s, '0')", (stream,))
    except psycopg.Error as e:
        pytest.fail(f"updates() of a 102-column table: {e.diag.sqlstate}: {e.diag.message_primary}")
    finally:
        db.execute(f'DROP TABLE "{table}"')
    assert [r[:2] for r in update_rows_generic(answer)] == [[1, "w"]]


def update_rows_generic(answer):
    """Every row of an updates() answer, in order (headers dropped)."""
    out, data, i = [], answer["data"], 0
    while i < len(data):
        count = data[i][2]
        out += data[i + 1:i + 1 + count]
        i += 1 + count
    return out


def test_positions_are_stored_for_a_stream_with_many_writers(db, connect, stream):
    """BREAKS "the worker stores positions". The position worker stores a
    stream's positions and sends pg_notify('streampos', stream || ' ' ||
    token) in one subtransaction (src/sql/worker.rs, store_positions). NOTIFY payloads
    are limited to 8000 bytes; a token lists every writer ahead of the
    frontier, so with a few hundred configured writers and one of them in
    flight the notify fails ("payload string too long"), the
    subtransaction rolls back the positions too, and the worker retries
    and fails every 200 ms: stream_positions stops moving for as long as
    anything is in flight."""
    writers = [f"writer{i}" for i in range(1, 601)]
    seq = create_stream(db, stream, writers=writers)
    db.execute("SELECT setval(%s::regclass, 1000000000000)", (seq,))
    commit_ids(db, stream, "writer1")
    wait_until(lambda: stored_positions(db, stream).get("writer1") == 1000000000001, timeout=5)
    holder = connect()
    holder.execute("BEGIN")
    one(holder, "SELECT streampos.next_id(%s, 'writer2')", (stream,))
    commit_ids(db, stream, "writer1")
    live = one(db, "SELECT streampos.writer_position(%s, 'writer1')", (stream,))
    assert live == 1000000000003
    try:
        wait_until(
            lambda: stored_positions(db, stream).get("writer1") == live,
            timeout=3,
            message=f"writer1's stored position to reach {live}",
        )
    finally:
        holder.execute("ROLLBACK")


def test_a_removed_writer_stays_removed_from_stream_positions(db, connect, stream):
    """BREAKS the hot standby's answers (forever). set_writers() deletes a
    removed writer's stored position; the position worker, whose pass
    started with the old writer list, upserts it again: its INSERT … ON
    CONFLICT waits for set_writers' row lock and, the row being deleted,
    inserts it back (src/sql/worker.rs, store_positions). Nothing ever updates or
    deletes it again, and a standby's frontier is the lowest stored
    position: it stays at the removed writer's last position for good."""
    create_stream(db, stream, writers=["w1", "w2"])
    commit_ids(db, stream, "w1")
    commit_ids(db, stream, "w2")
    wait_until(lambda: stored_positions(db, stream) == {"w1": 2, "w2": 2}, timeout=5)
    admin, other = connect(), connect()
    admin.execute("BEGIN")
    admin.execute("SELECT streampos.set_writers(%s, ARRAY['w1'])", (stream,))
    commit_ids(other, stream, "w1")  # the worker's next pass stores this stream
    time.sleep(1)  # …and waits for admin's row lock on w2's position
    admin.execute("COMMIT")
    assert commit_ids(other, stream, "w1", 3)[-1] == 6
    wait_until(lambda: stored_positions(db, stream).get("w1") == 6, timeout=5)
    assert stored_positions(db, stream) == {"w1": 6}, (
        "a removed writer's position came back; a standby's frontier is now "
        f"stuck at it: {stored_positions(db, stream)}"
    )


def test_stored_positions_catch_up_when_the_wal_is_flushed_late():
    """BREAKS "stream_positions caught up within a second of a commit". The
    worker stores a stream only when its generation moved (worker.rs,
    store_positions: `written`), and only an allocation's end moves it.
    When the pass after a commit runs before the commit's sequence record
    is durable (synchronous_commit = off, or a synchronous standby behind),
    it stores the older position; the WAL is flushed a moment later and
    frontier() moves, but stream_positions stays behind until the stream's
    next allocation (forever on a stream that goes quiet)."""
    with Clusters() as clusters:
        node = clusters.node(wal_writer_delay="10s")
        with node.connect() as admin, node.connect() as writer, node.connect() as load:
            admin.execute("SELECT streampos.create_stream('late')")
            admin.execute("SELECT streampos.next_id('late', 'w')")
            wait_until(lambda: node.all("SELECT stream_id FROM streampos.stream_positions") == [(1,)],
                       timeout=5)
            stop = threading.Event()

            def keep_wal_writer_awake():
                # Other asynchronous commits: the WAL writer does not
                # hibernate, so it flushes on its own schedule (10 s).
                load.execute("SET synchronous_commit = off")
                while not stop.is_set():
                    load.execute("SELECT pg_logical_emit_message(true, 'load', '')")
                    time.sleep(0.005)

            thread = threading.Thread(target=keep_wal_writer_awake)
            thread.start()
            try:
                time.sleep(0.5)
                admin.execute("CHECKPOINT")  # the next nextval writes a record
                writer.execute("SET synchronous_commit = off")
                with writer.transaction():
                    assert one(writer, "SELECT streampos.next_id('late', 'w')") == 2
                    writer.execute("SELECT pg_logical_emit_message(true, 'row', '')")
                wait_until(lambda: one(admin, "SELECT streampos.frontier('late')") == 2,
                           timeout=15, message="the commit to become durable")
                wait_until(
                    lambda: node.all("SELECT stream_id FROM streampos.stream_positions") == [(2,)],
                    timeout=2,
                    message="stream_positions to catch up once frontier() moved",
                )
            finally:
                stop.set()
                thread.join()


def test_sequences_at_the_bigint_limits(db, stream):
    """Was BROKEN "never panic on user input" (minor). A sequence adopted at
    its MINVALUE -9223372036854775808: as a backward stream, frontier()
    negated i64::MIN (a debug build panicked, XX000); as a forward stream,
    its first next_id() failed with a confusing message. Now such a
    sequence is refused when adopted (IDs are positive: MINVALUE 1 or more,
    NO CYCLE, 22023), and one altered there after adoption answers its
    frontier and refuses the allocation cleanly (55000)."""
    problems = []
    for backwards in (True, False):
        name = f"{stream}_{'b' if backwards else 'f'}"
        db.execute(
            f'CREATE SEQUENCE "{name}_seq" MINVALUE -9223372036854775808 START -9223372036854775808'
        )
        expect_error(
            db, "SELECT streampos.adopt_stream(%s, %s, backwards => %s)",
            (name, f"{name}_seq", backwards), "22023",
        )
        db.execute(f'ALTER SEQUENCE "{name}_seq" MINVALUE 1 START 1 RESTART 1')
        db.execute("SELECT streampos.adopt_stream(%s, %s, backwards => %s)", (name, f"{name}_seq", backwards))
        db.execute(
            f'ALTER SEQUENCE "{name}_seq" MINVALUE -9223372036854775808 RESTART -9223372036854775808'
        )
        try:
            assert frontier(db, name) == 0
            db.execute("BEGIN")
            expect_error(db, "SELECT streampos.next_id(%s, 'w')", (name,), "55000")
            db.execute("ROLLBACK")
            checks = dict((r[0], r[1]) for r in rows(db, "SELECT * FROM streampos.check_stream(%s)", (name,)))
            assert checks["sequence"] is False, checks
        except psycopg.Error as e:
            db.execute("ROLLBACK")
            problems.append(f"backwards={backwards}: {e.diag.sqlstate} {e.diag.message_primary}")
        db.execute("SELECT streampos.drop_stream(%s)", (name,))
        db.execute(f'DROP SEQUENCE "{name}_seq"')
    assert problems == []


def test_a_follower_ahead_by_less_than_the_logged_ahead_values_is_told_to_resync():
    """BREAKS "followers ahead of the server get 72000" within the first 32
    IDs. After an asynchronous failover that lost 10 commits, the new
    primary's sequence is where the last nextval record it replayed put it
    (up to 32 past what was handed out), and refuse_ahead (api/follow.rs)
    compares a follower's token with max_allocated loaded from it: a
    follower that received rows 21..30 from the lost primary is not
    refused, carries on from 30 and keeps ten rows the new primary never
    had (and never learns it)."""
    with Clusters() as clusters:
        pair = clusters.pair()
        primary, standby = pair
        setup_stream(primary, writers=["w1"])
        with primary.connect() as p:
            for _ in range(20):
                p.execute("INSERT INTO ev SELECT streampos.next_id('ev', 'w1'), 'w1', 'r'")
        pair.caught_up()
        pair.disconnect()
        with primary.connect() as p:
            for _ in range(10):
                p.execute("INSERT INTO ev SELECT streampos.next_id('ev', 'w1'), 'w1', 'r'")
            answer = p.execute("SELECT streampos.updates('ev', '20', timeout_ms => 1000)").fetchone()[0]
        assert [r[0] for r in update_rows(answer)] == list(range(21, 31))
        token = answer["token"]
        assert token_positions(token)[1] == 30
        primary.kill()
        standby.promote()
        with standby.connect() as c:
            assert one(c, "SELECT max(id) FROM ev") == 20
            try:
                got = c.execute("SELECT streampos.updates('ev', %s, timeout_ms => 500)", (token,)).fetchone()[0]
            except psycopg.Error as e:
                assert e.diag.sqlstate == "72000", e
                return
            pytest.fail(f"a follower holding rows 21..30, which this server never had, got {got}")


# =====================================================================
# Privileges and search_path (an unprivileged role)
# =====================================================================


def test_temp_objects_first_in_the_path_are_never_used(db, intruder, stream):
    """WITHSTANDS. The intruder puts pg_temp first in its search_path and
    creates temp tables named like every catalog table, temp views named
    like catalog relations, and temp domains over int8 and text whose CHECK
    logs to a temp table; then calls every function PUBLIC may call. The
    extension's internal SQL runs with search_path = pg_catalog, pg_temp
    and qualified names: nothing of the intruder's is read or run."""
    seq = create_stream(db, stream, writers=["w1", "w2"])
    table = f"{stream}_t"
    db.execute(f'CREATE TABLE "{table}" (id bigint, instance_name text)')
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    db.execute(f'GRANT SELECT ON "{table}" TO {ATTACKER}')
    db.execute(f'INSERT INTO "{table}" SELECT streampos.next_id(%s, %s), %s', (stream, "w1", "w1"))
    i = intruder
    i.execute("SET search_path = pg_temp, public, pg_catalog")
    i.execute("CREATE TEMP TABLE trap_log (what text)")
    i.execute("CREATE FUNCTION pg_temp.trap() RETURNS boolean LANGUAGE sql AS "
              "$$ INSERT INTO pg_temp.trap_log VALUES ('ran'); SELECT true $$")
    for name in ("streams", "instances", "stream_tables", "stream_positions"):
        i.execute(f"CREATE TEMP TABLE {name} (stream_name text, instance_name text, instance_id int, "
                  "stream_key int, seq oid, owns_sequence bool, backwards bool, writers text[], "
                  "tbl oid, id_column name, instance_column name, stream_id bigint)")
        i.execute(f"INSERT INTO pg_temp.{name} VALUES (%s, 'w1', 999, 999, 0, true, false, "
                  "ARRAY['evil'], 0, 'x', 'y', 1000000)", (stream,))
    # After the tables (whose own columns would otherwise use them).
    i.execute("CREATE DOMAIN pg_temp.int8 AS pg_catalog.int8 CHECK (pg_temp.trap())")
    i.execute("CREATE DOMAIN pg_temp.text AS pg_catalog.text CHECK (pg_temp.trap())")
    i.execute("CREATE TEMP VIEW pg_class AS SELECT * FROM pg_catalog.pg_class WHERE pg_temp.trap()")
    i.execute("CREATE TEMP VIEW pg_sequence AS SELECT * FROM pg_catalog.pg_sequence WHERE pg_temp.trap()")
    answers = {
        "frontier": one(i, "SELECT streampos.frontier(%s)", (stream,)),
        "max_allocated": one(i, "SELECT streampos.max_allocated(%s)", (stream,)),
        "writer_position": one(i, "SELECT streampos.writer_position(%s, 'w1')", (stream,)),
        "writer_positions": rows(i, "SELECT instance_name, stream_id FROM streampos.writer_positions(%s) ORDER BY 1",
                                 (stream,)),
        "token": one(i, "SELECT streampos.current_token(%s)::pg_catalog.text", (stream,)),
        "in_flight": rows(i, "SELECT * FROM streampos.in_flight(%s)", (stream,)),
        "wait_for": one(i, "SELECT streampos.wait_for(%s, 1, 10)", (stream,)),
        "updates": update_rows_generic(one(i, "SELECT streampos.updates(%s, '0')", (stream,))),
        "check": all(r[1] for r in rows(i, "SELECT * FROM streampos.check_stream(%s)", (stream,))),
        "instance": one(i, "SELECT streampos.instance_name(x.instance_id) FROM streampos.instances x "
                           "WHERE x.instance_name OPERATOR(pg_catalog.=) 'w1'"),
        "instance_pos": one(i, "SELECT streampos.instance_pos('m0~1.5'::streampos.multi_writer_token, 'w1')"),
    }
    assert rows(i, "SELECT * FROM pg_temp.trap_log") == []
    assert answers["frontier"] == answers["max_allocated"] == answers["writer_position"] == 1
    assert answers["writer_positions"] == [("w1", 1), ("w2", 1)]
    assert answers["token"] == "1" and answers["in_flight"] == [] and answers["wait_for"] == 1
    assert answers["updates"] == [[1, "w1"]] and answers["check"]
    assert answers["instance"] == "w1"
    w1 = one(db, "SELECT streampos.instance_id('w1')")
    assert answers["instance_pos"] == (5 if w1 == 1 else 0)
    del seq


def test_the_intruder_can_neither_repair_nor_read_what_it_may_not(db, intruder, stream):
    """WITHSTANDS. check_stream() and updates() are PUBLIC but read the
    stream's tables with the caller's privileges (42501 without SELECT), and
    repair => true moves the sequence with setval()'s privileges (42501
    without UPDATE on it); a role with only SELECT on the sequence cannot
    allocate, a role with only UPDATE can (as nextval())."""
    seq = create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f'CREATE TABLE "{table}" (id bigint, instance_name text)')
    db.execute("SELECT streampos.add_table(%s, %s, 'id', 'instance_name')", (stream, table))
    db.execute(f'INSERT INTO "{table}" VALUES (1000, %s)', ("w",))
    expect_error(intruder, "SELECT streampos.updates(%s, '0')", (stream,), "42501")
    expect_error(intruder, "SELECT * FROM streampos.check_stream(%s)", (stream,), "42501")
    db.execute(f'GRANT SELECT ON "{table}" TO {ATTACKER}')
    checks = {n: ok for n, ok, _ in rows(intruder, "SELECT * FROM streampos.check_stream(%s)", (stream,))}
    assert checks[f"table public.{table}"] is False, checks  # row 1000 above the sequence
    expect_error(intruder, "SELECT * FROM streampos.check_stream(%s, true)", (stream,), "42501")
    assert one(db, "SELECT last_value FROM " + seq) == 1  # not moved
    db.execute(f"GRANT SELECT ON SEQUENCE {seq} TO {ATTACKER}")
    expect_error(intruder, "SELECT streampos.next_id(%s, 'w')", (stream,), "42501")
    db.execute(f"REVOKE SELECT ON SEQUENCE {seq} FROM {ATTACKER}")
    db.execute(f"GRANT UPDATE ON SEQUENCE {seq} TO {ATTACKER}")
    intruder.execute("BEGIN")
    assert one(intruder, "SELECT streampos.next_id(%s, 'w')", (stream,)) == 1
    intruder.execute("ROLLBACK")
    db.execute(f"REVOKE UPDATE ON SEQUENCE {seq} FROM {ATTACKER}")


def test_the_intruders_locks_on_the_catalog_block_nothing(db, intruder, stream):
    """WITHSTANDS. SELECT on the catalog lets PUBLIC take ACCESS SHARE locks
    on it (LOCK TABLE, or a transaction that read it); allocation, reading
    and every catalog-changing function still go ahead."""
    intruder.execute("BEGIN")
    intruder.execute(
        "LOCK TABLE streampos.streams, streampos.instances, streampos.stream_tables, "
        "streampos.stream_positions IN ACCESS SHARE MODE"
    )
    expect_error(intruder, "LOCK TABLE streampos.streams IN ROW EXCLUSIVE MODE", None, "42501")
    intruder.execute("ROLLBACK")
    intruder.execute("BEGIN")
    intruder.execute(
        "LOCK TABLE streampos.streams, streampos.instances, streampos.stream_tables, "
        "streampos.stream_positions IN ACCESS SHARE MODE"
    )
    try:
        db.execute("SET lock_timeout = '3s'")
        create_stream(db, stream, writers=["a"])
        db.execute("SELECT streampos.set_writers(%s, ARRAY['a', %s])", (stream, f"{stream}_b"))
        db.execute(f'CREATE TABLE "{stream}_t" (id bigint)')
        db.execute("SELECT streampos.add_table(%s, %s, 'id')", (stream, f"{stream}_t"))
        assert commit_ids(db, stream, "a", 2) == [1, 2]
        assert frontier(db, stream) == 2
        db.execute("SELECT streampos.drop_stream(%s)", (stream,))
        db.execute(f'DROP TABLE "{stream}_t"')
    finally:
        db.execute("RESET lock_timeout")
        intruder.execute("ROLLBACK")


def test_the_intruders_repair_does_not_queue_for_the_sequence(db, connect, intruder, stream):
    """WITHSTANDS (written with the fix that makes a repair hold the
    sequence against allocation). A lock request queues ahead of later ones:
    a repair waiting for a long writer would stop every other writer of the
    stream behind it. A role that may not move the sequence (no UPDATE, as
    setval needs) is refused (42501) before it asks for the lock."""
    create_stream(db, stream)
    table = f'"{stream}_t"'
    db.execute(f"CREATE TABLE {table} (id bigint)")
    db.execute(f"GRANT SELECT ON {table} TO {ATTACKER}")
    db.execute("SELECT streampos.add_table(%s, %s, 'id')", (stream, f"{stream}_t"))
    db.execute(f"INSERT INTO {table} VALUES (10)")  # the sequence lags behind
    writer = connect()
    writer.execute("BEGIN")
    assert one(writer, "SELECT streampos.next_id(%s, 'w')", (stream,)) == 1
    try:
        intruder.execute("SET lock_timeout = '2s'")
        started = time.monotonic()
        expect_error(intruder, "SELECT * FROM streampos.check_stream(%s, repair => true)", (stream,), "42501")
        assert time.monotonic() - started < 1.5, "the refused repair waited for the writer"
    finally:
        writer.execute("ROLLBACK")


def test_prepare_after_an_allocation_rolled_back_to_a_savepoint_is_refused(db, connect, stream):
    """WITHSTANDS. IDs of a rolled-back savepoint stay in flight until the
    top-level transaction ends, so PREPARE TRANSACTION is still refused
    (0A000) and the transaction's IDs are released."""
    create_stream(db, stream)
    w = connect()
    w.execute("BEGIN")
    w.execute("SAVEPOINT s")
    assert one(w, "SELECT streampos.next_id(%s, 'w')", (stream,)) == 1
    w.execute("ROLLBACK TO SAVEPOINT s")
    expect_error(w, f"PREPARE TRANSACTION '{stream}'", None, "0A000")
    w.execute("ROLLBACK")
    assert rows(db, "SELECT gid FROM pg_prepared_xacts WHERE gid = %s", (stream,)) == []
    assert frontier(db, stream) == 1


def test_a_snapshot_from_before_promotion_is_not_told_about_rows_it_cannot_see():
    """BREAKS "no missed rows" across a promotion. A REPEATABLE READ
    transaction on a hot standby takes its snapshot, the standby replays
    ten more commits, and is promoted. The transaction's first frontier()
    call after promotion is answered from the registry (engine/answers.rs,
    fresh_answer: in_recovery() is false now), which was just loaded from
    the sequence and holds nothing: frontier() is 30 (or up to 32 more),
    but the snapshot, taken during recovery, sees rows 1..20 only. The
    registry cannot know what an old snapshot saw; a snapshot taken during
    recovery has to keep the standby's answer (stored positions), or be
    refused."""
    with Clusters() as clusters:
        pair = clusters.pair()
        primary, standby = pair
        setup_stream(primary, writers=["w1"])
        with primary.connect() as p:
            for _ in range(20):
                p.execute("INSERT INTO ev SELECT streampos.next_id('ev', 'w1'), 'w1', 'r'")
            p.execute("SELECT pg_sleep(0.5)")  # the worker stores the position
        pair.caught_up()
        reader = standby.connect()
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        assert one(reader, "SELECT count(*) FROM ev") == 20  # the snapshot
        with primary.connect() as p:
            for _ in range(10):
                p.execute("INSERT INTO ev SELECT streampos.next_id('ev', 'w1'), 'w1', 'r'")
        pair.caught_up()
        pair.failover()
        f = one(reader, "SELECT streampos.frontier('ev')")
        visible = one(reader, "SELECT count(*) FROM ev WHERE id <= streampos.frontier('ev')")
        reader.execute("ROLLBACK")
        with standby.connect() as c:
            committed = one(c, "SELECT count(*) FROM ev WHERE id <= %s", (f,))
        assert visible == committed, (
            f"frontier() {f} for a snapshot that sees {visible} of the {committed} rows at or below it"
        )
