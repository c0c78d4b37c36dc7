# Shared helpers for scripts/: a throwaway PostgreSQL 15 cluster with
# streampos preloaded, owned by the postgres user (initdb refuses root).
# shellcheck shell=bash

PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
PG_CONFIG=${PG_CONFIG:-$PG_BIN/pg_config}

as_postgres() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

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
