"""psycopg 3 adapters for the two token types, text and binary.

``register(conn)`` looks up the OIDs of ``streampos.room_stream_token`` and
``streampos.multi_writer_token`` on that connection and registers, on that
connection only, loaders (results become token objects) and dumpers
(token objects are accepted as parameters, in text or binary format; ``%s``
sends binary). Arrays of tokens are adapted too.
"""

from __future__ import annotations

from typing import Any, Awaitable, Optional, Tuple, Union

import psycopg
from psycopg.abc import AdaptContext
from psycopg.adapt import Buffer, Dumper, Loader
from psycopg.pq import Format
from psycopg.types import TypeInfo

from .tokens import MultiWriterToken, RoomStreamToken

__all__ = ["register", "register_types", "fetch_type_infos", "TYPE_NAMES"]

#: The SQL types, schema-qualified, and the Python class each maps to.
TYPE_NAMES = {
    "streampos.room_stream_token": RoomStreamToken,
    "streampos.multi_writer_token": MultiWriterToken,
}


class _TokenTextLoader(Loader):
    format = Format.TEXT
    token_class: type = RoomStreamToken

    def load(self, data: Buffer) -> Any:
        return self.token_class.parse(bytes(data).decode("ascii"))


class _TokenBinaryLoader(Loader):
    format = Format.BINARY
    token_class: type = RoomStreamToken

    def load(self, data: Buffer) -> Any:
        return self.token_class.from_bytes(data)


class _TokenTextDumper(Dumper):
    format = Format.TEXT

    def dump(self, obj: Any) -> Buffer:
        return str(obj).encode("ascii")


class _TokenBinaryDumper(Dumper):
    format = Format.BINARY

    def dump(self, obj: Any) -> Buffer:
        return obj.to_bytes()


def _adapter_classes(token_class: type, oid: int) -> Tuple[type, type, type, type]:
    name = token_class.__name__
    return (
        type(f"{name}TextLoader", (_TokenTextLoader,), {"token_class": token_class}),
        type(f"{name}BinaryLoader", (_TokenBinaryLoader,), {"token_class": token_class}),
        type(f"{name}TextDumper", (_TokenTextDumper,), {"oid": oid}),
        type(f"{name}BinaryDumper", (_TokenBinaryDumper,), {"oid": oid}),
    )


def register_types(context: AdaptContext, infos: Tuple[TypeInfo, TypeInfo]) -> None:
    """Register the adapters on ``context`` (a connection or cursor) from
    type infos already fetched (see :func:`fetch_type_infos`): useful to
    configure every connection of a pool without a look-up each."""
    for info, token_class in zip(infos, TYPE_NAMES.values()):
        info.register(context)  # the type and its array
        text_loader, binary_loader, text_dumper, binary_dumper = _adapter_classes(token_class, info.oid)
        adapters = context.adapters
        adapters.register_loader(info.oid, text_loader)
        adapters.register_loader(info.oid, binary_loader)
        # The dumper registered last is used for %s: binary, the compact form.
        adapters.register_dumper(token_class, text_dumper)
        adapters.register_dumper(token_class, binary_dumper)


def _check(infos: Tuple[Optional[TypeInfo], ...]) -> Tuple[TypeInfo, TypeInfo]:
    missing = [name for name, info in zip(TYPE_NAMES, infos) if info is None]
    if missing:
        raise psycopg.ProgrammingError(
            f"type {missing[0]} not found: is the streampos extension installed in this database?"
        )
    return infos  # type: ignore[return-value]


def fetch_type_infos(
    conn: Union[psycopg.Connection, psycopg.AsyncConnection],
) -> Union[Tuple[TypeInfo, TypeInfo], Awaitable[Tuple[TypeInfo, TypeInfo]]]:
    """The :class:`TypeInfo` of both token types; awaitable for an async
    connection, as psycopg's own ``TypeInfo.fetch`` is."""
    if isinstance(conn, psycopg.AsyncConnection):

        async def fetch() -> Tuple[TypeInfo, TypeInfo]:
            return _check(tuple([await TypeInfo.fetch(conn, name) for name in TYPE_NAMES]))

        return fetch()
    return _check(tuple(TypeInfo.fetch(conn, name) for name in TYPE_NAMES))


def register(
    conn: Union[psycopg.Connection, psycopg.AsyncConnection],
) -> Optional[Awaitable[None]]:
    """Adapt both token types on ``conn``. For an async connection, await
    the result: ``await streampos.register(aconn)``."""
    if isinstance(conn, psycopg.AsyncConnection):

        async def run() -> None:
            register_types(conn, await fetch_type_infos(conn))  # type: ignore[misc]

        return run()
    register_types(conn, fetch_type_infos(conn))  # type: ignore[arg-type]
    return None
