"""adopt_stream(): an existing sequence (Synapse's events_stream_seq) becomes a
stream with no data migration; sequences that cannot be tracked are refused."""

from support import expect_error, one


def test_adopt_existing_sequence_keeps_its_position(db, stream):
    seq = f"{stream}_seq"
    db.execute(f"CREATE SEQUENCE {seq}")
    db.execute(f"SELECT setval('{seq}', 41)")
    db.execute("SELECT streampos.adopt_stream(%s, %s::regclass)", (stream, seq))
    assert one(db, "SELECT streampos.frontier(%s)", (stream,)) == 41
    assert one(db, "SELECT streampos.next_id(%s, 'w')", (stream,)) == 42
    # Not owned: dropping the stream leaves the sequence.
    db.execute("SELECT streampos.drop_stream(%s)", (stream,))
    assert one(db, f"SELECT last_value FROM {seq}") == 42


def test_adopt_refuses_what_it_cannot_track(db, stream):
    db.execute(f"CREATE TABLE {stream}_t (id bigint)")
    err = expect_error(db, "SELECT streampos.adopt_stream(%s, %s::regclass)", (stream, f"{stream}_t"), "22023")
    assert "is not a sequence" in err.diag.message_primary
    db.execute(f"CREATE SEQUENCE {stream}_cached CACHE 10")
    err = expect_error(
        db, "SELECT streampos.adopt_stream(%s, %s::regclass)", (stream, f"{stream}_cached"), "22023"
    )
    assert "CACHE 1" in err.diag.message_primary
    # Nothing was registered.
    assert one(db, "SELECT count(*) FROM streampos.streams WHERE stream_name = %s", (stream,)) == 0
