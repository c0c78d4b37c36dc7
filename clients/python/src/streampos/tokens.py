"""Synapse stream tokens as immutable Python values.

:class:`RoomStreamToken` is ``streampos.room_stream_token`` (``s5``,
``t426-2633508``, ``m56~2.58~3.59``) and :class:`MultiWriterToken` is
``streampos.multi_writer_token`` (``56``, ``m56~2.58~3.59``). They follow the
extension's rules exactly (docs/tokens.md): the same grammar, ranges, errors,
canonical text, binary wire format, causal order, total order and lattice
operations, so a token means the same thing on either side of the wire.

Writers are identified by their instance *ids* (``streampos.instance_id``),
as in the text form; Synapse's own classes key their maps by instance name
and resolve ids through the database when parsing.
"""

from __future__ import annotations

import re
import struct
from types import MappingProxyType
from typing import Iterable, Mapping, Optional, Tuple, TypeVar, Union

__all__ = [
    "InvalidTokenError",
    "TokenSyntaxError",
    "TokenRangeError",
    "TokenArgumentError",
    "TokenBinaryError",
    "RoomStreamToken",
    "MultiWriterToken",
    "WIRE_VERSION",
]

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1

#: The version byte that starts the binary wire form.
WIRE_VERSION = 1


class InvalidTokenError(ValueError):
    """A token that the extension would refuse too. ``sqlstate`` is the
    error code the server reports for the same input."""

    sqlstate = "22P02"


class TokenSyntaxError(InvalidTokenError):
    """Malformed text, or a listed position not above the minimum, or an
    instance listed twice (the server's 22P02)."""

    sqlstate = "22P02"


class TokenRangeError(InvalidTokenError):
    """A number that does not fit its 64-bit (32-bit for instance ids) field
    (the server's 22003)."""

    sqlstate = "22003"


class TokenArgumentError(InvalidTokenError):
    """A constructor given values that make no token (the server's 22023)."""

    sqlstate = "22023"


class TokenBinaryError(InvalidTokenError):
    """Bytes that are not a valid wire form (the server's 22P03)."""

    sqlstate = "22P03"


# ASCII digits only: Python's \d and int() also take other scripts' digits,
# underscores and spaces, which the extension refuses.
_NUM = r"-?[0-9]+"
_ROOM_LIVE = re.compile(rf"s({_NUM})")
_ROOM_HISTORICAL = re.compile(rf"t({_NUM})-({_NUM})")
_VECTOR = re.compile(rf"m({_NUM})((?:~{_NUM}\.{_NUM})*)~?")
_MW_LIVE = re.compile(_NUM)
_ENTRY = re.compile(rf"~({_NUM})\.({_NUM})")


def _check_int(value: object, what: str, lo: int, hi: int, bits: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TokenArgumentError(f"{what} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise TokenArgumentError(f"{what} {value} does not fit in a signed {bits}-bit integer")
    return value


def _normalise(stream: int, pairs: Iterable[Tuple[int, int]]) -> Tuple[Tuple[int, int], ...]:
    """Sorted (id, position) pairs; raises TokenSyntaxError as the server
    does: first a position not above the minimum (in the given order), then
    a duplicate id."""
    listed = list(pairs)
    for iid, pos in listed:
        if pos <= stream:
            raise TokenSyntaxError(
                f"position {pos} of instance {iid} is not greater than the minimum {stream}"
            )
    listed.sort()
    for (a, _), (b, _) in zip(listed, listed[1:]):
        if a == b:
            raise TokenSyntaxError(f"instance {a} is listed twice")
    return tuple(listed)


def _excess(token: "_Token") -> int:
    return sum(pos - token.stream for _, pos in token._instances)


T = TypeVar("T", bound="_Token")


class _Token:
    """The shared part of both token types: a minimum ``stream`` position and
    the writers ahead of it (``instance_map``: instance id -> position)."""

    __slots__ = ("_stream", "_topological", "_instances", "_hash")
    _type_name = ""

    def __init__(
        self,
        stream: int,
        instance_map: Optional[Union[Mapping[int, int], Iterable[Tuple[int, int]]]] = None,
        *,
        topological: Optional[int] = None,
    ) -> None:
        _check_int(stream, "stream position", I64_MIN, I64_MAX, 64)
        if topological is not None:
            _check_int(topological, "topological position", I64_MIN, I64_MAX, 64)
        if instance_map is None:
            pairs: list = []
        elif isinstance(instance_map, Mapping):
            pairs = list(instance_map.items())
        else:
            pairs = list(instance_map)
        for iid, pos in pairs:
            _check_int(iid, "instance id", I32_MIN, I32_MAX, 32)
            _check_int(pos, "position", I64_MIN, I64_MAX, 64)
        if topological is not None and pairs:
            raise TokenArgumentError("a historical token lists no instance positions")
        try:
            instances = _normalise(stream, pairs)
        except TokenSyntaxError as e:
            raise TokenArgumentError(str(e)) from None
        self._init(stream, topological, instances)

    def _init(self, stream: int, topological: Optional[int], instances: Tuple[Tuple[int, int], ...]) -> None:
        object.__setattr__(self, "_stream", stream)
        object.__setattr__(self, "_topological", topological)
        object.__setattr__(self, "_instances", instances)
        object.__setattr__(self, "_hash", hash((type(self).__name__, topological, stream, instances)))

    @classmethod
    def _make(cls: type[T], stream: int, topological: Optional[int], instances: Tuple[Tuple[int, int], ...]) -> T:
        """A token from parts already validated and sorted."""
        token = object.__new__(cls)
        token._init(stream, topological, instances)
        return token

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __reduce__(self):
        return (_rebuild, (type(self), self._stream, self._topological, self._instances))

    # ------------------------------------------------------------ fields

    @property
    def stream(self) -> int:
        """The minimum position: every writer not listed is here."""
        return self._stream

    @property
    def instance_map(self) -> Mapping[int, int]:
        """The writers ahead of the minimum, instance id -> position,
        ascending by id (read-only)."""
        return MappingProxyType(dict(self._instances))

    @property
    def instances(self) -> Tuple[Tuple[int, int], ...]:
        """``instance_map`` as sorted (instance id, position) pairs."""
        return self._instances

    def get_max_stream_pos(self) -> int:
        """The largest position in the token."""
        return max((pos for _, pos in self._instances), default=self._stream)

    def get_stream_pos_for_instance(self, instance_id: int) -> int:
        """The position of writer ``instance_id``: its listed position, else
        the minimum."""
        for iid, pos in self._instances:
            if iid == instance_id:
                return pos
        return self._stream

    def persisted_after(self, instance_id: int, stream_id: int) -> bool:
        """Whether ``stream_id`` of writer ``instance_id`` is after this token."""
        return stream_id > self.get_stream_pos_for_instance(instance_id)

    # ------------------------------------------------------------ orders

    def is_before_or_eq(self: T, other: T) -> bool:
        """Synapse's causal order: every writer's position in ``self`` is at
        most its position in ``other``; a historical token counts as
        ``s{stream}`` (its topological part is ignored, as Synapse's is)."""
        self._same_type(other)
        if self._stream > other._stream:
            return False
        theirs = dict(other._instances)
        return all(pos <= theirs.get(iid, other._stream) for iid, pos in self._instances)

    def _sort_key(self):
        # The extension's total order (docs/tokens.md): by stream, total
        # excess over the minimum, the instance list, then the topological
        # part with live tokens last. It extends the causal order: if
        # is_before_or_eq(a, b) and not is_before_or_eq(b, a), then a < b.
        topological = (0, self._topological) if self._topological is not None else (1, 0)
        return (self._stream, _excess(self), self._instances, topological)

    def _same_type(self, other: object) -> None:
        if type(other) is not type(self):
            raise TypeError(f"cannot compare {type(self).__name__} with {type(other).__name__}")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return (
            self._stream == other._stream  # type: ignore[attr-defined]
            and self._topological == other._topological  # type: ignore[attr-defined]
            and self._instances == other._instances  # type: ignore[attr-defined]
        )

    def __hash__(self) -> int:
        return self._hash

    def __lt__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._sort_key() < other._sort_key()  # type: ignore[attr-defined]

    def __le__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._sort_key() <= other._sort_key()  # type: ignore[attr-defined]

    def __gt__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._sort_key() > other._sort_key()  # type: ignore[attr-defined]

    def __ge__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._sort_key() >= other._sort_key()  # type: ignore[attr-defined]

    # ------------------------------------------------------------ lattice

    def copy_and_advance(self: T, other: T) -> T:
        """The least upper bound in the causal order: component-wise maximum,
        entries that fall to the new minimum dropped. Two historical tokens
        join to a historical one, a historical and a live one to a live one
        (the extension's ``advance``)."""
        self._same_type(other)
        if self._topological is not None and other._topological is not None:
            return type(self)._make(
                max(self._stream, other._stream), max(self._topological, other._topological), ()
            )
        stream = max(self._stream, other._stream)
        mine, theirs = dict(self._instances), dict(other._instances)
        joined = []
        for iid in sorted(mine.keys() | theirs.keys()):
            pos = max(mine.get(iid, self._stream), theirs.get(iid, other._stream))
            if pos > stream:
                joined.append((iid, pos))
        return type(self)._make(stream, None, tuple(joined))

    advance = copy_and_advance

    def bound_stream_token(self: T, max_stream: int) -> T:
        """Every component capped at ``max_stream`` (the topological part is
        kept); never raises a component."""
        _check_int(max_stream, "max_stream", I64_MIN, I64_MAX, 64)
        stream = min(self._stream, max_stream)
        capped = tuple(
            (iid, min(pos, max_stream)) for iid, pos in self._instances if min(pos, max_stream) > stream
        )
        return type(self)._make(stream, self._topological, capped)

    bound = bound_stream_token

    @staticmethod
    def is_stream_position_in_range(
        low: Optional["_Token"],
        high: Optional["_Token"],
        instance_id: Optional[int],
        stream_id: int,
    ) -> bool:
        """Whether ``low < position <= high`` for the row ``stream_id`` of writer
        ``instance_id`` (``streampos.in_range``): ``None`` bounds are
        unbounded, a ``None`` instance compares against each token's
        minimum."""

        def pos(t: "_Token") -> int:
            return t._stream if instance_id is None else t.get_stream_pos_for_instance(instance_id)

        if low is not None and stream_id <= pos(low):
            return False
        if high is not None and stream_id > pos(high):
            return False
        return True

    # ------------------------------------------------------------ text

    def _vector_text(self) -> str:
        return "m%d%s" % (self._stream, "".join("~%d.%d" % p for p in self._instances))

    def __repr__(self) -> str:
        return f"{type(self).__name__}.parse({str(self)!r})"

    @classmethod
    def _parse_vector(cls: type[T], text: str, match: "re.Match[str]") -> T:
        # Grammar is known good; now ranges (reading order), then semantics.
        stream_text = match.group(1)
        entries = [(m.group(1), m.group(2)) for m in _ENTRY.finditer(match.group(2))]
        stream = _parse_int(cls, text, stream_text, 64)
        pairs = [(_parse_int(cls, text, i, 32), _parse_int(cls, text, p, 64)) for i, p in entries]
        return cls._make(stream, None, _semantic(cls, text, stream, pairs))

    # ------------------------------------------------------------ binary

    def to_bytes(self) -> bytes:
        """The binary wire form (``send``): big-endian; version byte 1; kind
        byte (0 live, 1 historical); stream i64; topological i64 when
        historical; u32 count; count x (i32 id, i64 position)."""
        parts = [struct.pack(">BBq", WIRE_VERSION, self._topological is not None, self._stream)]
        if self._topological is not None:
            parts.append(struct.pack(">q", self._topological))
        parts.append(struct.pack(">I", len(self._instances)))
        parts.extend(struct.pack(">iq", iid, pos) for iid, pos in self._instances)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls: type[T], data: Union[bytes, bytearray, memoryview]) -> T:
        """Reads the binary wire form, validating as the extension's
        ``recv`` does; faults raise :class:`TokenBinaryError`."""
        data = bytes(data)
        name = cls._type_name
        if not data:
            raise TokenBinaryError(f"invalid binary data for type {name}: the message is empty")
        if data[0] != WIRE_VERSION:
            raise TokenBinaryError(
                f"invalid binary data for type {name}: unsupported format version {data[0]}"
            )
        if len(data) < 2:
            raise TokenBinaryError(f"invalid binary data for type {name}: no kind byte")
        kind = data[1]
        if kind not in (0, 1):
            raise TokenBinaryError(f"invalid binary data for type {name}: unknown kind byte {kind}")
        historical = kind == 1
        if historical and cls is MultiWriterToken:
            raise TokenBinaryError(f"invalid binary data for type {name}: a multi-writer token cannot be historical")
        need = 22 if historical else 14
        if len(data) < need:
            raise TokenBinaryError(
                f"invalid binary data for type {name}: {len(data)} bytes, the header needs {need}"
            )
        (stream,) = struct.unpack_from(">q", data, 2)
        topological = struct.unpack_from(">q", data, 10)[0] if historical else None
        (count,) = struct.unpack_from(">I", data, need - 4)
        if historical and count:
            raise TokenBinaryError(
                f"invalid binary data for type {name}: a historical token lists {count} instance positions"
            )
        if len(data) - need != 12 * count:
            raise TokenBinaryError(
                f"invalid binary data for type {name}: {count} instance positions need {12 * count} bytes, "
                f"{len(data) - need} follow"
            )
        pairs = [struct.unpack_from(">iq", data, need + 12 * k) for k in range(count)]
        try:
            instances = _normalise(stream, pairs)
        except TokenSyntaxError as e:
            raise TokenBinaryError(f"invalid binary data for type {name}: {e}") from None
        return cls._make(stream, topological, instances)


def _rebuild(cls, stream: int, topological: Optional[int], instances: Tuple[Tuple[int, int], ...]) -> "_Token":
    """Unpickling: a module-level function pickles by name under any
    ``copyreg`` setup (Twisted replaces how bound methods pickle)."""
    return cls._make(stream, topological, tuple(tuple(p) for p in instances))


def _parse_int(cls, text: str, digits: str, bits: int) -> int:
    value = int(digits)
    lo, hi = (I32_MIN, I32_MAX) if bits == 32 else (I64_MIN, I64_MAX)
    if not lo <= value <= hi:
        raise TokenRangeError(
            f'value out of range for type {cls._type_name}: "{text}": '
            f'"{digits}" does not fit in a signed {bits}-bit integer'
        )
    return value


def _semantic(cls, text: str, stream: int, pairs) -> Tuple[Tuple[int, int], ...]:
    try:
        return _normalise(stream, pairs)
    except TokenSyntaxError as e:
        raise TokenSyntaxError(f'invalid input syntax for type {cls._type_name}: "{text}": {e}') from None


def _syntax(cls, text: str) -> TokenSyntaxError:
    return TokenSyntaxError(f'invalid input syntax for type {cls._type_name}: "{text}"')


class RoomStreamToken(_Token):
    """``streampos.room_stream_token``: a live token (``s{stream}``, or
    ``m{stream}~{id}.{pos}~...`` when writers are ahead of the minimum) or a
    historical one (``t{topological}-{stream}``)."""

    __slots__ = ()
    _type_name = "room_stream_token"

    @property
    def topological(self) -> Optional[int]:
        """The topological part of a historical token; ``None`` when live."""
        return self._topological

    @property
    def is_historical(self) -> bool:
        return self._topological is not None

    def as_historical_tuple(self) -> Tuple[int, int]:
        """``(topological, stream)`` of a historical token."""
        if self._topological is None:
            raise ValueError("a live token has no historical tuple")
        return self._topological, self._stream

    @classmethod
    def parse(cls, text: str) -> "RoomStreamToken":
        """Parses ``s…``, ``t…-…`` or ``m…`` exactly as the extension does."""
        if not isinstance(text, str):
            raise TypeError(f"expected str, not {type(text).__name__}")
        if m := _ROOM_LIVE.fullmatch(text):
            return cls._make(_parse_int(cls, text, m.group(1), 64), None, ())
        if m := _ROOM_HISTORICAL.fullmatch(text):
            topo = _parse_int(cls, text, m.group(1), 64)
            return cls._make(_parse_int(cls, text, m.group(2), 64), topo, ())
        if m := _VECTOR.fullmatch(text):
            return cls._parse_vector(text, m)
        raise _syntax(cls, text)

    def __str__(self) -> str:
        if self._topological is not None:
            return "t%d-%d" % (self._topological, self._stream)
        if not self._instances:
            return "s%d" % self._stream
        return self._vector_text()

    def to_multi_writer(self) -> "MultiWriterToken":
        """The same live position as a multi-writer token (the SQL cast)."""
        if self._topological is not None:
            raise TokenArgumentError("a historical token has no multi-writer form")
        return MultiWriterToken._make(self._stream, None, self._instances)

    @staticmethod
    def is_event_in_range(
        low: Optional["RoomStreamToken"],
        high: Optional["RoomStreamToken"],
        instance_id: Optional[int],
        topological: int,
        stream_id: int,
    ) -> bool:
        """Synapse's ``_filter_results`` (the five-argument
        ``streampos.in_range``): a historical bound compares
        ``(topological, stream_id)`` tuples, a live bound the writer's
        position."""

        def pos(t: RoomStreamToken) -> int:
            return t._stream if instance_id is None else t.get_stream_pos_for_instance(instance_id)

        event = (topological, stream_id)
        if low is not None:
            if low._topological is not None:
                if event <= (low._topological, low._stream):
                    return False
            elif stream_id <= pos(low):
                return False
        if high is not None:
            if high._topological is not None:
                if (high._topological, high._stream) < event:
                    return False
            elif pos(high) < stream_id:
                return False
        return True


class MultiWriterToken(_Token):
    """``streampos.multi_writer_token``: ``{stream}``, or
    ``m{stream}~{id}.{pos}~...`` when writers are ahead of the minimum."""

    __slots__ = ()
    _type_name = "multi_writer_token"

    def __init__(
        self,
        stream: int,
        instance_map: Optional[Union[Mapping[int, int], Iterable[Tuple[int, int]]]] = None,
    ) -> None:
        super().__init__(stream, instance_map)

    @classmethod
    def parse(cls, text: str) -> "MultiWriterToken":
        """Parses ``{stream}`` or ``m…`` exactly as the extension does."""
        if not isinstance(text, str):
            raise TypeError(f"expected str, not {type(text).__name__}")
        if _MW_LIVE.fullmatch(text):
            return cls._make(_parse_int(cls, text, text, 64), None, ())
        if m := _VECTOR.fullmatch(text):
            return cls._parse_vector(text, m)
        raise _syntax(cls, text)

    def __str__(self) -> str:
        if not self._instances:
            return "%d" % self._stream
        return self._vector_text()

    def to_room(self) -> RoomStreamToken:
        """The same position as a live room token (the SQL cast)."""
        return RoomStreamToken._make(self._stream, None, self._instances)
