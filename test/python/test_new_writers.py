"""A writer's first transaction creates its instance name, and with it the
id tokens know it by. Two ways that went wrong in 0.2.0 (found by the
torture harness's reference model, docs/torture.md):

- the name created in a savepoint that is rolled back, then created again
  under a new id: the IDs taken in the savepoint stayed in flight under the
  vanished id, and the writer's position (and token entry) under its new id
  passed them, although the transaction could still write a row with one;
- a new writer listed in tokens while its first transaction held IDs, then
  dropped when it aborted: its token position fell back to the minimum, so
  a later token was no longer at or after an earlier one.
"""

from support import commit_ids, create_stream, one


def token(conn, stream):
    return one(conn, "SELECT streampos.current_token(%s)::text", (stream,))


def test_ids_taken_under_a_name_a_savepoint_took_back_hold_the_name(connect, db, stream):
    create_stream(db, stream)
    table = f"{stream}_t"
    db.execute(f"CREATE TABLE {table} (id bigint, writer text)")
    assert commit_ids(db, stream, "old", 3) == [1, 2, 3]
    writer = connect()
    writer.execute("BEGIN")
    writer.execute("SAVEPOINT s")
    ghost = one(writer, "SELECT streampos.next_id(%s, 'brand_new')", (stream,))
    assert ghost == 4
    writer.execute("ROLLBACK TO SAVEPOINT s")
    assert commit_ids(db, stream, "old", 3) == [5, 6, 7]
    # The name again, under a new id; the transaction still has ID 4.
    assert one(writer, "SELECT streampos.next_id(%s, 'brand_new')", (stream,)) == 8
    writer.execute(f"INSERT INTO {table} VALUES (4, 'brand_new'), (8, 'brand_new')")
    new_id = one(writer, "SELECT streampos.instance_id('brand_new')")
    reader = connect()
    assert one(reader, "SELECT streampos.writer_position(%s, 'brand_new')", (stream,)) <= 3
    reads = one(
        writer,
        "SELECT streampos.instance_pos(streampos.current_token(%s), %s)",
        (stream, new_id),
    )
    assert reads <= 3, f"brand_new's token position {reads} passes its ID 4 in flight"
    writer.execute("COMMIT")
    # Committed: both rows are there, and positions move past them.
    assert one(reader, "SELECT streampos.writer_position(%s, 'brand_new')", (stream,)) == 8
    assert one(reader, f"SELECT count(*) FROM {table} WHERE id <= streampos.frontier(%s)", (stream,)) == 2


def test_a_new_writer_that_aborts_never_sends_a_token_back(connect, db, stream):
    create_stream(db, stream)
    holder = connect()
    holder.execute("BEGIN")
    assert one(holder, "SELECT streampos.next_id(%s, 'slow')", (stream,)) == 1
    assert commit_ids(db, stream, "slow2", 2) == [2, 3]
    newcomer = connect()
    newcomer.execute("BEGIN")
    assert one(newcomer, "SELECT streampos.next_id(%s, 'newcomer')", (stream,)) == 4
    assert commit_ids(db, stream, "slow2", 2) == [5, 6]
    earlier = token(db, stream)
    newcomer.execute("ROLLBACK")
    # The slow holder keeps the minimum at 0: a writer no longer listed
    # reads as 0.
    later = token(db, stream)
    holder.execute("COMMIT")
    assert one(db, "SELECT streampos.is_before_or_eq(%s::streampos.multi_writer_token, "
                   "%s::streampos.multi_writer_token)", (earlier, later)), (earlier, later)
