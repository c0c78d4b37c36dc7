"""The Python token classes agree with the extension: text (accepted forms,
canonical output, error classes), the binary wire form, the causal and total
orders and the lattice operations. Pure cases first, then the same inputs
sent through the server."""

import pickle
import random
import struct

import psycopg
import pytest

from streampos import (
    InvalidTokenError,
    MultiWriterToken,
    RoomStreamToken,
    TokenArgumentError,
    TokenBinaryError,
    TokenRangeError,
    TokenSyntaxError,
)

R, M = RoomStreamToken, MultiWriterToken

# (input, canonical) — the same table as core/src/token.rs.
ROOM_VALID = [
    ("s5", "s5"), ("s0", "s0"), ("s-5", "s-5"), ("s-0", "s0"), ("s007", "s7"), ("s-007", "s-7"),
    ("s2633508", "s2633508"), ("s9223372036854775807", "s9223372036854775807"),
    ("s-9223372036854775808", "s-9223372036854775808"), ("s00000000000000000000000000009", "s9"),
    ("t426-2633508", "t426-2633508"), ("t5-12", "t5-12"), ("t5--12", "t5--12"), ("t-3-4", "t-3-4"),
    ("t-3--4", "t-3--4"), ("t0-0", "t0-0"), ("t007-008", "t7-8"),
    ("t-9223372036854775808--9223372036854775808", "t-9223372036854775808--9223372036854775808"),
    ("t9223372036854775807-9223372036854775807", "t9223372036854775807-9223372036854775807"),
    ("m5", "s5"), ("m5~", "s5"), ("m-5~", "s-5"), ("m5~2.7", "m5~2.7"), ("m5~2.7~", "m5~2.7"),
    ("m56~2.58~3.59", "m56~2.58~3.59"), ("m56~3.59~2.58", "m56~2.58~3.59"),
    ("m1~9.2~-4.3~0.4~3.5", "m1~-4.3~0.4~3.5~9.2"), ("m-5~1.-3", "m-5~1.-3"), ("m5~-2.6", "m5~-2.6"),
    ("m05~02.06", "m5~2.6"), ("m5~2147483647.6", "m5~2147483647.6"), ("m5~-2147483648.6", "m5~-2147483648.6"),
    ("m-9223372036854775808~1.9223372036854775807", "m-9223372036854775808~1.9223372036854775807"),
]

ROOM_INVALID = [
    ("", "22P02"), ("s", "22P02"), ("x5", "22P02"), ("S5", "22P02"), ("5", "22P02"), ("-5", "22P02"),
    ("s5 ", "22P02"), (" s5", "22P02"), ("s+5", "22P02"), ("s5_0", "22P02"), ("s5.0", "22P02"),
    ("s-", "22P02"), ("s--5", "22P02"), ("s5x", "22P02"), ("s\u00e9", "22P02"), ("s5\u00e9", "22P02"),
    ("s5\n", "22P02"), ("s\u0665", "22P02"), ("t", "22P02"), ("t-", "22P02"), ("t5", "22P02"),
    ("t5-", "22P02"), ("t-5", "22P02"), ("t5--", "22P02"), ("t5---1", "22P02"), ("t5-1-", "22P02"),
    ("t5-1x", "22P02"), ("t5~1", "22P02"), ("t5-1~2.3", "22P02"), ("tt5-5", "22P02"), ("m", "22P02"),
    ("m~2.3", "22P02"), ("m-", "22P02"), ("m5~2", "22P02"), ("m5~2.", "22P02"), ("m5~.3", "22P02"),
    ("m5~2.3~2.4", "22P02"), ("m5~2.6~2.7", "22P02"), ("m5~2.5", "22P02"), ("m5~2.4", "22P02"),
    ("m5~~2.7", "22P02"), ("m5~~", "22P02"), ("m5~2.7~~", "22P02"), ("m5~2.7~~3.8", "22P02"),
    ("m5~2.7x", "22P02"), ("m5.2", "22P02"), ("m5~2.7.8", "22P02"), ("m5~2~3", "22P02"),
    ("m5~2.+7", "22P02"), ("m5~+2.7", "22P02"), ("m5 ~2.7", "22P02"),
    ("s9223372036854775808", "22003"), ("s-9223372036854775809", "22003"), ("s99999999999999999999", "22003"),
    ("t99999999999999999999-1", "22003"), ("t1-99999999999999999999", "22003"),
    ("m5~2147483648.9", "22003"), ("m5~-2147483649.9", "22003"), ("m5~2.99999999999999999999", "22003"),
    ("m99999999999999999999~2.3", "22003"),
    # A grammar error wins over a range error, a range error over semantics.
    ("s99999999999999999999x", "22P02"), ("m5~2147483648.9~", "22003"), ("m5~2147483648.9~~", "22P02"),
    ("m5~2.4~3.99999999999999999999", "22003"),
]

MW_VALID = [
    ("5", "5"), ("0", "0"), ("-5", "-5"), ("-0", "0"), ("007", "7"),
    ("9223372036854775807", "9223372036854775807"), ("-9223372036854775808", "-9223372036854775808"),
    ("m5", "5"), ("m5~", "5"), ("m5~1.6", "m5~1.6"), ("m5~3.9~1.6", "m5~1.6~3.9"), ("m5~1.6~", "m5~1.6"),
    ("m-5~1.-4", "m-5~1.-4"),
]

MW_INVALID = [
    ("", "22P02"), ("s5", "22P02"), ("t1-2", "22P02"), ("5x", "22P02"), ("-", "22P02"), ("--5", "22P02"),
    ("+5", "22P02"), (" 5", "22P02"), ("5 ", "22P02"), ("5_000", "22P02"), ("m", "22P02"),
    ("m5~1.5", "22P02"), ("m5~1.6~1.7", "22P02"), ("m5~~1.7", "22P02"), ("x", "22P02"),
    ("9223372036854775808", "22003"), ("-9223372036854775809", "22003"), ("m5~2147483648.9", "22003"),
]

CASES = [(R, ROOM_VALID, ROOM_INVALID), (M, MW_VALID, MW_INVALID)]


def random_text(rng):
    """Mostly near-valid token text: the grammar's alphabet, small numbers."""
    alphabet = "stm-~.0123456789"
    if rng.random() < 0.5:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
    stream = rng.randint(-3, 9)
    head = rng.choice(["s", "t", "m", ""])
    if head == "t":
        return f"t{rng.randint(-3, 9)}-{stream}"
    if head == "m":
        entries = "".join(f"~{rng.randint(-2, 4)}.{rng.randint(stream - 2, stream + 6)}" for _ in range(rng.randint(0, 3)))
        return f"m{stream}{entries}{rng.choice(['', '~'])}"
    return f"{head}{stream}"


def random_token(rng, cls, historical_share=0.2):
    stream = rng.randint(-5, 20)
    if cls is R and rng.random() < historical_share:
        return R(stream, topological=rng.randint(-3, 10))
    ids = rng.sample(range(-2, 6), rng.randint(0, 3))
    return cls(stream, {i: stream + rng.randint(1, 8) for i in ids})


# ------------------------------------------------------------------ pure


@pytest.mark.parametrize("cls,valid,invalid", CASES, ids=["room", "multi_writer"])
def test_valid_text_parses_to_canonical_form(cls, valid, invalid):
    for text, canonical in valid:
        token = cls.parse(text)
        assert str(token) == canonical, text
        assert cls.parse(canonical) == token


@pytest.mark.parametrize("cls,valid,invalid", CASES, ids=["room", "multi_writer"])
def test_invalid_text_fails_with_the_servers_error_class(cls, valid, invalid):
    for text, sqlstate in invalid:
        with pytest.raises(InvalidTokenError) as info:
            cls.parse(text)
        assert info.value.sqlstate == sqlstate, (text, info.value)
        assert isinstance(info.value, TokenRangeError if sqlstate == "22003" else TokenSyntaxError)
        assert isinstance(info.value, ValueError)


def test_fields_and_constructors():
    t = R.parse("m56~3.59~2.58")
    assert (t.stream, t.topological, dict(t.instance_map)) == (56, None, {2: 58, 3: 59})
    assert t.instances == ((2, 58), (3, 59))
    assert t.get_max_stream_pos() == 59
    assert t.get_stream_pos_for_instance(3) == 59 and t.get_stream_pos_for_instance(7) == 56
    assert t.persisted_after(2, 59) and not t.persisted_after(2, 58)
    assert R(56, {3: 59, 2: 58}) == t
    assert R(56, [(2, 58), (3, 59)]) == t
    h = R(12, topological=5)
    assert str(h) == "t5-12" and h.is_historical and h.as_historical_tuple() == (5, 12)
    with pytest.raises(ValueError):
        t.as_historical_tuple()
    assert M(5, {1: 6}).to_room() == R.parse("m5~1.6")
    assert R.parse("m5~1.6").to_multi_writer() == M.parse("m5~1.6")
    for bad in [
        lambda: R(5, {2: 5}),  # not ahead of the minimum
        lambda: R(5, [(2, 7), (2, 8)]),  # listed twice
        lambda: R(5, {2: 7}, topological=1),  # historical with entries
        lambda: R(2**63),
        lambda: R(5, {2**31: 7}),
        lambda: R("5"),
        lambda: R(True),
        lambda: R(12, topological=5).to_multi_writer(),
    ]:
        with pytest.raises(TokenArgumentError):
            bad()
    with pytest.raises(TypeError):
        R.parse(b"s5")


def test_tokens_are_immutable_hashable_and_picklable():
    t = R.parse("m5~2.7")
    with pytest.raises(AttributeError):
        t.stream = 6
    with pytest.raises(TypeError):
        t.instance_map[2] = 8
    assert {t: 1}[R.parse("m5~02.7~")] == 1
    assert t != M.parse("m5~2.7")
    for token in [t, R(3, topological=1), M.parse("m5~2.7"), M(4)]:
        copy = pickle.loads(pickle.dumps(token))
        assert copy == token and type(copy) is type(token)
    assert repr(t) == "RoomStreamToken.parse('m5~2.7')"
    assert eval(repr(t), {"RoomStreamToken": R}) == t


def test_causal_order_and_lattice_match_synapse_examples():
    a, b = M.parse("m5~1.8~2.6"), M.parse("m6~2.7~3.9")
    assert str(a.copy_and_advance(b)) == "m6~1.8~2.7~3.9"
    assert a.advance(b) == b.advance(a)
    assert a.is_before_or_eq(a.advance(b)) and b.is_before_or_eq(a.advance(b))
    assert not a.is_before_or_eq(b) and not b.is_before_or_eq(a)
    assert str(M.parse("m5~1.8~2.6").bound_stream_token(7)) == "m5~1.7~2.6"
    assert str(M.parse("m5~1.8").bound_stream_token(3)) == "3"
    h = R.parse
    assert h("t1-9").advance(h("t2-3")) == h("t2-9")
    assert h("t1-9").advance(h("s3")) == h("s9")
    assert h("t1-7").advance(h("m5~1.6~2.9")) == h("m7~2.9")
    # Synapse ignores a historical token's topological part: t{x}-{n} is
    # s{n} for the causal order.
    assert h("t3-5").is_before_or_eq(h("s5")) and h("s5").is_before_or_eq(h("t3-5"))
    assert h("t6-3").is_before_or_eq(h("t5-6")) and not h("t5-6").is_before_or_eq(h("t6-3"))
    with pytest.raises(TypeError):
        R.parse("s5").is_before_or_eq(M.parse("5"))


def test_total_order_extends_the_causal_order():
    rng = random.Random(7)
    for cls in (R, M):
        tokens = [random_token(rng, cls) for _ in range(300)]
        for a, b in zip(tokens, tokens[1:] + tokens[:1]):
            if a.is_before_or_eq(b) and not b.is_before_or_eq(a):
                assert a < b, (a, b)
            assert (a < b) + (a == b) + (a > b) == 1
    assert R.parse("t9-5") < R.parse("s5") < R.parse("m5~1.6") < R.parse("s6")
    assert M(5, {1: 100}) < M(6)
    with pytest.raises(TypeError):
        R.parse("s5") < M.parse("5")


def test_range_checks():
    low, high = M.parse("m5~1.8"), M.parse("m10~2.14")
    inside = [(i, p) for i, p in [(1, 9), (2, 12), (3, 12), (None, 6), (1, 8), (3, 10)]
              if M.is_stream_position_in_range(low, high, i, p)]
    assert inside == [(1, 9), (2, 12), (None, 6), (3, 10)]
    assert M.is_stream_position_in_range(None, None, 4, 99)
    assert R.is_event_in_range(R.parse("t3-10"), R.parse("t5-20"), 1, 4, 1)
    assert not R.is_event_in_range(R.parse("t3-10"), None, 1, 3, 10)
    assert R.is_event_in_range(R.parse("t3-10"), None, 1, 3, 11)


def test_binary_form_is_the_documented_layout():
    assert R.parse("s5").to_bytes() == bytes([1, 0]) + struct.pack(">qI", 5, 0)
    assert R.parse("t3-5").to_bytes() == bytes([1, 1]) + struct.pack(">qqI", 5, 3, 0)
    assert M.parse("m5~3.9~2.7").to_bytes() == bytes([1, 0]) + struct.pack(">qIiqiq", 5, 2, 2, 7, 3, 9)
    rng = random.Random(3)
    for cls in (R, M):
        for _ in range(200):
            t = random_token(rng, cls)
            assert cls.from_bytes(t.to_bytes()) == t
    # Pairs in any order are accepted, as by the server.
    assert M.from_bytes(bytes([1, 0]) + struct.pack(">qIiqiq", 5, 2, 3, 9, 2, 7)) == M.parse("m5~2.7~3.9")


BAD_BINARY = [
    b"",
    bytes([2, 0]) + struct.pack(">qI", 5, 0),  # version
    bytes([1]),  # no kind
    bytes([1, 2]) + struct.pack(">qI", 5, 0),  # kind
    bytes([1, 0]) + struct.pack(">q", 5),  # short header
    bytes([1, 0]) + struct.pack(">qI", 5, 1),  # count beyond the data
    bytes([1, 0]) + struct.pack(">qI", 5, 0) + b"\0",  # trailing byte
    bytes([1, 0]) + struct.pack(">qIiq", 5, 1, 2, 5),  # not ahead
    bytes([1, 0]) + struct.pack(">qIiqiq", 5, 2, 2, 7, 2, 8),  # duplicate
    bytes([1, 1]) + struct.pack(">qqIiq", 5, 1, 1, 2, 7),  # historical with entries
    bytes([1, 0]) + struct.pack(">qI", 5, 0xFFFFFFFF),  # huge count
]


def test_bad_binary_is_refused():
    for data in BAD_BINARY:
        for cls in (R, M):
            with pytest.raises(TokenBinaryError):
                cls.from_bytes(data)
    with pytest.raises(TokenBinaryError):
        M.from_bytes(bytes([1, 1]) + struct.pack(">qqI", 5, 1, 0))


# ------------------------------------------------------------------ against the server


def server_parse(db, cls, text):
    """(canonical text, None) or (None, sqlstate) from the server."""
    sql_type = "streampos.room_stream_token" if cls is R else "streampos.multi_writer_token"
    try:
        with db.transaction():
            return db.execute(f"SELECT %s::text::{sql_type}::text", (text,)).fetchone()[0], None
    except psycopg.Error as e:
        return None, e.diag.sqlstate


def client_parse(cls, text):
    try:
        return str(cls.parse(text)), None
    except InvalidTokenError as e:
        return None, e.sqlstate


def test_text_agrees_with_the_server(db):
    rng = random.Random(11)
    texts = {cls: [t for t, _ in valid] + [t for t, _ in invalid] for cls, valid, invalid in CASES}
    for cls in (R, M):
        texts[cls] += [random_text(rng) for _ in range(600)]
    # The server refuses NUL bytes in text; everything else goes through.
    for cls, inputs in texts.items():
        for text in inputs:
            assert client_parse(cls, text) == server_parse(db, cls, text), (cls.__name__, text)


def test_binary_agrees_with_the_server(db):
    rng = random.Random(5)
    for cls, send in ((R, "room_stream_token_send"), (M, "multi_writer_token_send")):
        for _ in range(200):
            t = random_token(rng, cls)
            assert db.execute(f"SELECT streampos.{send}(%t)", (t,)).fetchone()[0] == t.to_bytes()


def test_bad_binary_is_refused_by_the_server_too(db):
    class RawDumper(psycopg.adapt.Dumper):
        format = psycopg.pq.Format.BINARY

        def dump(self, obj):
            return obj

    for cls, sql_type in ((R, "streampos.room_stream_token"), (M, "streampos.multi_writer_token")):
        oid = psycopg.types.TypeInfo.fetch(db, sql_type).oid
        dumper = type("Raw", (RawDumper,), {"oid": oid})
        cur = db.cursor()
        cur.adapters.register_dumper(bytes, dumper)
        for data in BAD_BINARY:
            with pytest.raises(psycopg.Error) as info:
                cur.execute("SELECT %b::text", (data,))
            assert info.value.diag.sqlstate == "22P03", data
        good = random_token(random.Random(1), cls).to_bytes()
        assert cls.parse(cur.execute("SELECT %b::text", (good,)).fetchone()[0]).to_bytes() == good


def test_orders_and_lattice_agree_with_the_server(db):
    rng = random.Random(13)
    db.execute("SET search_path = streampos, public")
    for cls, sql_type in ((R, "streampos.room_stream_token"), (M, "streampos.multi_writer_token")):
        tokens = [random_token(rng, cls) for _ in range(120)]
        ordered = db.execute(
            f"SELECT u.tok::text AS canonical FROM unnest(%s::text[]::{sql_type}[]) AS u(tok) ORDER BY u.tok", ([str(t) for t in tokens],)
        ).fetchall()
        assert [r[0] for r in ordered] == [str(t) for t in sorted(tokens)]
        for a, b in zip(tokens, reversed(tokens)):
            row = db.execute(
                "SELECT streampos.is_before_or_eq(%(a)t, %(b)t), %(a)t < %(b)t, %(a)t = %(b)t, "
                "streampos.advance(%(a)t, %(b)t), streampos.bound(%(a)t, %(m)s)",
                {"a": a, "b": b, "m": b.stream},
            ).fetchone()
            assert row == (a.is_before_or_eq(b), a < b, a == b, a.advance(b), a.bound_stream_token(b.stream)), (a, b)
    low_high = [(M.parse(a), M.parse(b)) for a, b in [("5", "m10~2.14"), ("m5~1.9", "m10~2.14"), ("m5~1.7", "m8~1.11~3.13")]]
    for low, high in low_high:
        for instance in (None, 1, 2, 3):
            for pos in range(4, 16):
                server = db.execute("SELECT streampos.in_range(%t, %t, %s, %s)", (low, high, instance, pos)).fetchone()[0]
                assert server == M.is_stream_position_in_range(low, high, instance, pos)
