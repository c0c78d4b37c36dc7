"""Helpers for the tests of the streampos Python client: connections,
waiting and server control. Fixtures are in conftest.py.

scripts/test starts a server with the extension preloaded and sets
STREAMPOS_PGHOST, STREAMPOS_PGPORT and STREAMPOS_PGDATA (the data directory,
for the tests that restart the server).
"""

import asyncio
import os
import subprocess
import time

import psycopg
import pytest

import streampos

PGHOST = os.environ.get("STREAMPOS_PGHOST", "127.0.0.1")
PGPORT = int(os.environ.get("STREAMPOS_PGPORT", "54330"))
PGUSER = os.environ.get("STREAMPOS_PGUSER", "postgres")
PGDATA = os.environ.get("STREAMPOS_PGDATA")
PG_BIN = os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin")
DBNAME = "streampos_pyclient"


def conninfo(dbname=DBNAME):
    return f"host={PGHOST} port={PGPORT} user={PGUSER} dbname={dbname} connect_timeout=10"


def connect(dbname=DBNAME, **kwargs):
    """An autocommit connection with the token adapters registered."""
    kwargs.setdefault("autocommit", True)
    conn = psycopg.connect(conninfo(dbname), **kwargs)
    if dbname == DBNAME:
        streampos.register(conn)
    return conn


def run(coro):
    """Run a coroutine to completion (the tests need no asyncio plugin)."""
    return asyncio.run(coro)


def wait_until(predicate, timeout=10.0, interval=0.02, message="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}; last value: {value!r}")
        time.sleep(interval)


# ------------------------------------------------------------------ server control


def pg_ctl(*args):
    if not PGDATA:
        pytest.skip("STREAMPOS_PGDATA is not set: cannot restart the server")
    cmd = [os.path.join(PG_BIN, "pg_ctl"), "-D", PGDATA, *args]
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--"] + cmd
    env = dict(os.environ, RUST_BACKTRACE="0", RUST_LIB_BACKTRACE="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed: {proc.stdout}{proc.stderr}"


def crash_and_restart_server():
    """Stop the server like a crash (-m immediate) and start it again."""
    pg_ctl("-m", "immediate", "-w", "-t", "60", "stop")
    pg_ctl("-l", os.path.join(PGDATA or "", "server.log"), "-w", "-t", "60", "start")

    def ready():
        try:
            with psycopg.connect(conninfo(), autocommit=True) as c:
                return c.execute("SELECT NOT pg_is_in_recovery()").fetchone()[0]
        except psycopg.OperationalError:
            return False

    wait_until(ready, timeout=60, interval=0.1, message="the server to accept connections")
