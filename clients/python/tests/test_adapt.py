"""psycopg adapters: parameters and results are token objects, in text and
binary format, for single values, arrays and binary COPY; registered per
connection."""

import psycopg
import pytest

import streampos
from client_support import conninfo, run
from streampos import MultiWriterToken as M, RoomStreamToken as R

VALUES = [R.parse("s5"), R.parse("t3--4"), R.parse("m56~2.58~3.59"), M.parse("-7"), M.parse("m5~1.6~9.12")]


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_results_and_parameters_are_tokens(db, binary):
    cur = db.cursor(binary=binary)
    row = cur.execute(
        "SELECT 'm56~3.59~2.58'::streampos.room_stream_token, '5'::streampos.multi_writer_token, "
        "NULL::streampos.room_stream_token, ARRAY['s1', NULL, 't1-2']::streampos.room_stream_token[]"
    ).fetchone()
    assert row == (R.parse("m56~2.58~3.59"), M(5), None, [R(1), None, R(2, topological=1)])
    assert all(type(v) in (R, M) for v in row[:2])
    for value in VALUES:
        for placeholder in ("%s", "%t", "%b"):
            back, text, sql_type = cur.execute(
                f"SELECT {placeholder}, ({placeholder})::text, pg_typeof({placeholder})::text",
                (value, value, value),
            ).fetchone()
            assert back == value and type(back) is type(value)
            assert text == str(value)
            assert sql_type == ("streampos.room_stream_token" if isinstance(value, R) else "streampos.multi_writer_token")
    arrays = cur.execute("SELECT %s, %s", ([R(1), R.parse("m2~4.5")], [M(3), None])).fetchone()
    assert arrays == ([R(1), R.parse("m2~4.5")], [M(3), None])


def test_token_parameters_select_rows(db, stream):
    """Tokens bound as parameters work in the functions that take them."""
    db.execute("SELECT streampos.create_stream(%s)", (stream,))
    db.execute(f"CREATE TABLE {stream}_rows (id bigint, instance_name text)")
    iid = db.execute("SELECT streampos.instance_id('adapt_writer')").fetchone()[0]
    for _ in range(4):
        db.execute(
            f"INSERT INTO {stream}_rows SELECT streampos.next_id(%s, 'adapt_writer'), 'adapt_writer'", (stream,)
        )
    token = db.execute("SELECT streampos.current_room_token(%s)", (stream,)).fetchone()[0]
    assert token == R(4)
    ids = db.execute(
        f"SELECT id FROM {stream}_rows WHERE streampos.in_range(%s, %s, %s, id) ORDER BY id",
        (R(1), R.parse("m2~%d.3" % iid), iid),
    ).fetchall()
    assert ids == [(2,), (3,)]


def test_binary_copy_round_trip(db):
    db.execute("CREATE TEMP TABLE copy_tokens (r streampos.room_stream_token, m streampos.multi_writer_token)")
    rows = [(R.parse("m5~2.7"), M(3)), (R(9, topological=-2), M.parse("m1~4.2")), (None, None)]
    with db.cursor() as cur:
        with cur.copy("COPY copy_tokens FROM STDIN (FORMAT binary)") as copy:
            copy.set_types(["streampos.room_stream_token", "streampos.multi_writer_token"])
            for row in rows:
                copy.write_row(row)
        with cur.copy("COPY copy_tokens TO STDOUT (FORMAT binary)") as copy:
            copy.set_types(["streampos.room_stream_token", "streampos.multi_writer_token"])
            assert list(copy.rows()) == rows
    assert db.execute("SELECT r::text FROM copy_tokens ORDER BY r::text").fetchall()[0] == ("m5~2.7",)


def test_registration_is_per_connection(database):
    with psycopg.connect(conninfo(), autocommit=True) as plain:
        assert plain.execute("SELECT 's5'::streampos.room_stream_token").fetchone()[0] == "s5"
        with pytest.raises(psycopg.ProgrammingError):
            plain.execute("SELECT %s", (R(5),))
        streampos.register(plain)
        assert plain.execute("SELECT 's5'::streampos.room_stream_token").fetchone()[0] == R(5)
        with psycopg.connect(conninfo(), autocommit=True) as other:
            assert other.execute("SELECT 's5'::streampos.room_stream_token").fetchone()[0] == "s5"
            # Infos fetched once can configure other connections (e.g. a pool's).
            streampos.register_types(other, streampos.fetch_type_infos(plain))
            assert other.execute("SELECT %s::text", (M(5),)).fetchone()[0] == "5"


def test_async_registration(database):
    async def main():
        async with await psycopg.AsyncConnection.connect(conninfo(), autocommit=True) as conn:
            await streampos.register(conn)
            cur = conn.cursor(binary=True)
            await cur.execute("SELECT %s, 'm1~2.3'::streampos.multi_writer_token", (R.parse("t1-2"),))
            return await cur.fetchone()

    assert run(main()) == (R.parse("t1-2"), M.parse("m1~2.3"))


def test_register_without_the_extension_fails_clearly(database):
    name = "streampos_pyclient_plain"
    with psycopg.connect(conninfo("postgres"), autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name}")
        admin.execute(f"CREATE DATABASE {name}")
        try:
            with psycopg.connect(conninfo(name), autocommit=True) as conn:
                with pytest.raises(psycopg.ProgrammingError, match="streampos extension"):
                    streampos.register(conn)
        finally:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
