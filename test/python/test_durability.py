"""Durability is per allocation: an ID is final once the WAL record that made
the sequence hand it out is durable, and a later allocation of the same
transaction that needs a newer record never makes the earlier, already
durable IDs hold every writer back again (0.2.0 kept one WAL position per
in-flight entry: the second allocation raised it, and positions and tokens
went back for later snapshots after a routine CHECKPOINT, or when the
sequence crossed its 32 logged-ahead values).
"""

import pytest

from support import commit_ids, create_stream, one


@pytest.mark.parametrize("how", ["checkpoint", "log_boundary"])
def test_a_second_allocation_never_sends_positions_back(connect, db, stream, how):
    create_stream(db, stream)
    holder = connect()
    holder.execute("BEGIN")
    assert one(holder, "SELECT streampos.next_id(%s, 'w1')", (stream,)) == 1
    # Another writer commits past it: 2..6, or up to the last value the
    # sequence's first WAL record covers (1 + 32), so that the holder's next
    # nextval writes a new record.
    last = 6 if how == "checkpoint" else 33
    for _ in range(2, last + 1):
        commit_ids(db, stream, "w2")
    w2 = one(db, "SELECT streampos.instance_id('w2')")
    reader = connect()
    query = "SELECT streampos.current_token(%s)::text, streampos.writer_position(%s, 'w2')"
    before = reader.execute(query, (stream, stream)).fetchone()
    assert before == (f"m0~{w2}.{last}", last)
    if how == "checkpoint":
        db.execute("CHECKPOINT")
    # A new WAL record for the sequence, not yet flushed when the holder's
    # entry records it.
    assert one(holder, "SELECT streampos.next_id(%s, 'w1')", (stream,)) == last + 1
    after = reader.execute(query, (stream, stream)).fetchone()
    assert after == before, f"positions went back after the {how}: {before} then {after}"
    holder.execute("COMMIT")
    assert reader.execute(query, (stream, stream)).fetchone() == (f"{last + 1}", last + 1)

