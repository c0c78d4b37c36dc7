"""Fixtures for the concurrent-session tests of streampos.

Every test gets autocommit connections to the database ``streampos_pytest``
(created once per session) and a stream name of its own, so tests never see
each other's state. Helpers live in support.py. Tests marked
``restarts_server`` run after all others (see pytest_collection_modifyitems).
"""

import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

import traps
from support import (
    DBNAME,
    connect_raw,
    conninfo_string,
    create_stream,
    drop_streams,
    scratch_database,
    stored_positions,
    wait_until,
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "restarts_server: the test stops, crashes or restarts the server; such tests run last",
    )
    config.addinivalue_line(
        "markers",
        "fires_traps: the test fires the trap fixture on purpose and checks what it recorded (test_traps.py)",
    )


def pytest_collection_modifyitems(session, config, items):
    """Tests that restart the server run after every other test, in their
    file order, so that no other test sees a restart."""
    items.sort(key=lambda item: item.get_closest_marker("restarts_server") is not None)


# --------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def database():
    """(Re)create the test database with the extension; start the position
    worker early with one allocation, so tests measure catch-up, not start-up."""
    with connect_raw("postgres") as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DBNAME} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {DBNAME}")
    with connect_raw() as c:
        c.execute("CREATE EXTENSION streampos")
        create_stream(c, "warmup")
        c.execute("SELECT streampos.next_id('warmup', 'warmup')")
        wait_until(
            lambda: stored_positions(c, "warmup").get("warmup") == 1,
            timeout=10,
            message="the position worker to start",
        )
    yield DBNAME
    try:
        drop_streams("warmup")
    except psycopg.Error:
        pass


@pytest.fixture(scope="session")
def planted_traps(database):
    """The attacker's objects in the test database (traps.py), planted once
    per session."""
    traps.plant()
    return traps


@pytest.fixture(autouse=True)
def trap_check(request):
    """After each test that used the test database: no trap fired
    (public.trap_log is empty, and the fired count did not move), and no
    session the test still has open carries a setting a trap made. Off with
    STREAMPOS_TRAPS=0."""
    if not traps.ENABLED or "database" not in request.fixturenames:
        yield
        return
    request.getfixturevalue("planted_traps")
    if request.node.get_closest_marker("fires_traps"):
        yield
        traps.take_log()
        return
    # Set up before the test's connections, so that they are still open
    # when this checks them.
    factory = request.getfixturevalue("connect") if "connect" in request.fixturenames else None
    # A test that plants the same names itself (test_security's hijacked
    # public) gets a public without the trapper's functions and views.
    replant = "hijacked_public" in request.fixturenames
    if replant:
        traps.unplant()
    logged, fired_before = traps.take_log()
    assert not logged, (
        "traps fired after the previous test's checks (in its teardown):\n" + traps.format_log(logged)
    )
    yield
    logged, fired = traps.take_log()
    sessions = traps.session_findings(factory.open_connections()) if factory else []
    if replant:
        traps.plant()
    fired = traps.fired_since(fired_before, fired)
    assert not logged and not fired and not sessions, (
        f"traps fired {fired} time(s):\n{traps.format_log(logged)}\n"
        f"sessions with a trap's settings: {sessions}"
    )


class Connections:
    """Connection factory: every connection it makes is closed at teardown,
    then the registered clean-ups run (when no session of the test holds
    anything any more)."""

    def __init__(self):
        self._conns = []
        self._cleanups = []

    def __call__(self, **kwargs):
        conn = connect_raw(**kwargs)
        self._conns.append(conn)
        return conn

    def open_connections(self):
        return [conn for conn in self._conns if not conn.closed]

    def on_teardown(self, fn):
        self._cleanups.append(fn)

    def close_all(self):
        for conn in self._conns:
            try:
                conn.close()
            except Exception:
                pass
        self._conns.clear()
        for fn in reversed(self._cleanups):
            try:
                fn()
            except Exception:
                pass
        self._cleanups.clear()


@pytest.fixture
def connect(database):
    """``connect()`` returns a new autocommit session to the test database."""
    factory = Connections()
    yield factory
    factory.close_all()


@pytest.fixture
def db(connect):
    """An observer session, for reading from outside the writers' transactions."""
    return connect()


_counter = 0


@pytest.fixture
def stream(request, connect):
    """A stream name unique to this test (not yet created). Streams whose
    name starts with it are dropped after the test's sessions are closed."""
    global _counter
    _counter += 1
    base = re.sub(r"[^a-z0-9]+", "_", request.node.name.lower()).strip("_")
    base = base.removeprefix("test_")[:28]
    name = f"{base}_{_counter}_{uuid.uuid4().hex[:6]}"
    connect.on_teardown(lambda: drop_streams(name))
    return name


@pytest.fixture
def pool():
    """Threads, for calls that must block while the test goes on."""
    executor = ThreadPoolExecutor(max_workers=16)
    yield executor
    # Every blocking call in these tests is bounded; do not hang on a failure.
    executor.shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="session")
def synapse_template():
    """A database with Synapse's real schema (made by the pinned Synapse's
    own prepare_database), filled by synapse_db.fill, with the extension
    and no stream: tests copy it (CREATE DATABASE … TEMPLATE) rather than
    build it again."""
    import synapse_db  # Synapse's import takes seconds: only when needed.

    with scratch_database("streampos_synapse_template") as name:
        started = time.monotonic()
        schema_seconds, fill_seconds = synapse_db.create(conninfo_string(name))
        print(
            f"\nSynapse template: schema {schema_seconds:.2f}s, fill {fill_seconds:.2f}s, "
            f"{time.monotonic() - started:.2f}s with imports"
        )
        yield name


@pytest.fixture
def fresh_db(database):
    """A factory of empty databases (their names), dropped at teardown."""
    names = []

    def make():
        name = f"streampos_db_{uuid.uuid4().hex[:8]}"
        with connect_raw("postgres") as admin:
            admin.execute(f"CREATE DATABASE {name}")
        names.append(name)
        return name

    yield make
    with connect_raw("postgres") as admin:
        for name in names:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
