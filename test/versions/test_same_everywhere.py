"""What must not depend on the server's version: the catalog the
extension creates, and the binary format of the tokens (a binary COPY, or
a client's binary parameters, written against one version read back on
another)."""

import re

import pytest

from conftest import bin_dir
from test_upgrade import catalog

VERSIONS = [14, 15, 16, 17, 18]

# Every kind of token form, edge values included.
TOKENS = """
    SELECT i,
           (CASE i % 4 WHEN 0 THEN 's' || i
                       WHEN 1 THEN 't' || (i % 50) || '-' || i
                       WHEN 2 THEN 'm' || i || '~1.' || (i + 1) || '~' || (i % 9 + 2) || '.' || (i * 3 + 7)
                       ELSE 'm' || i || '~' END)::streampos.room_stream_token,
           (CASE i % 3 WHEN 0 THEN i::text
                       WHEN 1 THEN 'm' || i || '~1.' || (i + 5)
                       ELSE 'm' || i || '~' || (i % 7 + 1) || '.' || (i + 2) || '~9.' || (i + 11) END
           )::streampos.multi_writer_token
    FROM generate_series(0, 2000) AS i
    UNION ALL
    VALUES (-1, 's9223372036854775807'::streampos.room_stream_token, '9223372036854775807'::streampos.multi_writer_token),
           (-2, 't9223372036854775807-9223372036854775807', 'm0~2147483647.9223372036854775807'),
           (-3, 'm56~2.58~3.59', 'm5~2.9'),
           (-4, 's0', '0')
"""

TABLE = "CREATE TABLE tok (id int PRIMARY KEY, r streampos.room_stream_token, m streampos.multi_writer_token)"
TEXT = "SELECT id, r::text, m::text FROM tok ORDER BY id"


def copy_out(conn):
    data = bytearray()
    with conn.cursor().copy("COPY tok TO STDOUT (FORMAT binary)") as copy:
        for chunk in copy:
            data += chunk
    return bytes(data)


def copy_in(conn, data):
    with conn.cursor().copy("COPY tok FROM STDIN (FORMAT binary)") as copy:
        copy.write(data)


def test_tokens_in_binary_written_on_14_read_back_on_18(servers):
    old = servers(14, "binary-14").start()
    new = servers(18, "binary-18").start()
    with old.connect() as a, new.connect() as b:
        for conn in (a, b):
            conn.execute("CREATE EXTENSION streampos")
            conn.execute(TABLE)
        a.execute(f"INSERT INTO tok {TOKENS}")
        written = copy_out(a)
        copy_in(b, written)
        want = a.execute(TEXT).fetchall()
        assert len(want) == 2005
        assert b.execute(TEXT).fetchall() == want
        # The same bytes both ways: 18 sends what 14 sent, and 14 reads it.
        assert copy_out(b) == written
        a.execute("TRUNCATE tok")
        copy_in(a, copy_out(b))
        assert a.execute(TEXT).fetchall() == want
        # A client's binary results: the same bytes from both versions.
        binary = [
            conn.cursor(binary=True).execute("SELECT r, m FROM tok ORDER BY id").fetchall() for conn in (a, b)
        ]
        assert all(isinstance(v, bytes) for v in binary[0][0]), binary[0][0]
        assert binary[0] == binary[1]


def same_on_every_version(described):
    """The catalog without what PostgreSQL itself records differently for
    the same statements: 17 lists the row and array types of an
    extension's tables (and the array types of its types) among its
    members, and grants a table's owner MAINTAIN (m) with the others; 18
    records NOT NULL as constraints too (the columns say "not null" on
    every version)."""
    tables = {t[0] for t in described["tables"]}
    out = dict(described)
    # A relation's row type: PostgreSQL 17 and later list a view's as an
    # extension member of its own.
    relations = tables | {
        o.split(".", 1)[1] for o in described["objects"] if o.startswith(("view streampos.", "table streampos."))
    }
    out["objects"] = [
        o for o in described["objects"]
        if not (o.endswith("[]") or (o.startswith("type streampos.") and o.split(".", 1)[1] in relations))
    ]
    out["tables"] = [
        (name, kind, re.sub(r"=([a-zA-Z*]*)/", lambda m: "=" + m.group(1).replace("m", "") + "/", acl), comment,
         columns, [c for c in constraints if not re.fullmatch(r"\S+ NOT NULL \S+", c)], triggers, indexes)
        for name, kind, acl, comment, columns, constraints, triggers, indexes in described["tables"]
    ]
    return out


def test_the_catalog_is_the_same_on_every_version(servers):
    described = {}
    for version in VERSIONS:
        bin_dir(version)
        server = servers(version, f"catalog-{version}").start()
        assert server.server_version() == version
        with server.connect() as conn:
            conn.execute("CREATE EXTENSION streampos")
            described[version] = same_on_every_version(catalog(conn))
        server.stop()
    first = described[VERSIONS[0]]
    assert first["functions"] and first["types"] and first["operators"]
    for version in VERSIONS[1:]:
        for part in first:
            assert described[version][part] == first[part], f"{part} differs between 14 and {version}"
