"""Python client for the streampos PostgreSQL extension.

- :class:`RoomStreamToken`, :class:`MultiWriterToken`: the SQL token types as
  immutable Python values (text and binary forms, Synapse's comparisons).
- :func:`register`: psycopg 3 adapters for both types on one connection.
- :class:`MultiWriterIdGenerator` (async) and
  :class:`SyncMultiWriterIdGenerator`: Synapse's ID generator interface,
  backed by ``streampos.next_id`` and the exact positions of the database.
- :class:`Consumer`: a named consumer of a stream that reads rows with
  ``streampos.updates`` and acknowledges them in the same transaction.
"""

from .adapt import fetch_type_infos, register, register_types
from .consumer import Batch, Consumer, TableRows
from .id_generator import MultiWriterIdGenerator, NotAWriterError, SyncMultiWriterIdGenerator
from .tokens import (
    InvalidTokenError,
    MultiWriterToken,
    RoomStreamToken,
    TokenArgumentError,
    TokenBinaryError,
    TokenRangeError,
    TokenSyntaxError,
)

__all__ = [
    "Batch",
    "Consumer",
    "InvalidTokenError",
    "MultiWriterIdGenerator",
    "MultiWriterToken",
    "NotAWriterError",
    "RoomStreamToken",
    "SyncMultiWriterIdGenerator",
    "TokenArgumentError",
    "TokenBinaryError",
    "TokenRangeError",
    "TableRows",
    "TokenSyntaxError",
    "fetch_type_infos",
    "register",
    "register_types",
]
