"""Fixtures for the tests of the streampos Python client.

Every test gets a stream of its own in the database ``streampos_pyclient``
(created once per session on the server that STREAMPOS_PGHOST and
STREAMPOS_PGPORT name). Tests marked ``restarts_server`` run after all
others. Helpers live in client_support.py.
"""

import os
import re
import sys
import uuid

import psycopg
import pytest

from client_support import DBNAME, PGHOST, PGPORT, conninfo, connect

# The trap fixture of the extension's tests (test/python/traps.py): planted
# in this suite's database, checked after each test. STREAMPOS_TRAPS=0
# turns it off.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "test", "python"))
import traps  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "restarts_server: the test restarts the server; such tests run last")


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.get_closest_marker("restarts_server") is not None)


@pytest.fixture(scope="session")
def database():
    try:
        admin = psycopg.connect(conninfo("postgres"), autocommit=True)
    except psycopg.OperationalError as e:
        pytest.skip(f"no server at {PGHOST}:{PGPORT} ({e}); set STREAMPOS_PGHOST/STREAMPOS_PGPORT")
    with admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DBNAME} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {DBNAME}")
    with psycopg.connect(conninfo(), autocommit=True) as c:
        c.execute("CREATE EXTENSION streampos")
    if traps.ENABLED:
        traps.plant(DBNAME, strict=True)
    return DBNAME


@pytest.fixture(autouse=True)
def trap_check(request):
    """After each test that used the database: no trap fired (the log is
    empty and the fired count did not move). A test that restarts the
    server resets the count (unlogged): fired_since copes."""
    if not traps.ENABLED or "database" not in request.fixturenames:
        yield
        return
    logged, fired_before = traps.take_log(DBNAME)
    assert not logged, "traps fired after the previous test's checks:\n" + traps.format_log(logged)
    yield
    logged, fired = traps.take_log(DBNAME)
    fired = traps.fired_since(fired_before, fired)
    assert not logged and not fired, f"traps fired {fired} time(s):\n{traps.format_log(logged)}"


@pytest.fixture
def dsn(database):
    return conninfo()


@pytest.fixture
def db(database):
    """An observer session (autocommit, adapters registered)."""
    with connect() as conn:
        yield conn


_counter = 0


@pytest.fixture
def stream(request, database):
    """A stream name unique to this test (not created). Streams whose name
    starts with it are dropped afterwards, freeing their registry slots."""
    global _counter
    _counter += 1
    base = re.sub(r"[^a-z0-9]+", "_", request.node.name.lower()).strip("_").removeprefix("test_")[:24]
    name = f"{base}_{_counter}_{uuid.uuid4().hex[:6]}"
    yield name
    try:
        with connect() as c:
            c.execute("SET lock_timeout = '2s'")
            for (s,) in c.execute(
                "SELECT stream_name FROM streampos.streams WHERE starts_with(stream_name, %s)", (name,)
            ).fetchall():
                c.execute("SELECT streampos.drop_stream(%s)", (s,))
    except psycopg.Error:
        pass


