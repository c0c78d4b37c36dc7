//! streampos: stream positions for chat homeservers, inside PostgreSQL.
//!
//! Pure logic (tokens, the frontier algorithm) lives in the `streampos-core`
//! crate and is tested without a server. The modules here are glue, one per
//! PostgreSQL mechanism:
//!
//! | module | mechanism |
//! |---|---|
//! | `registry/` | shared memory: the in-flight registry (see its `mod.rs`) |
//! | `xact.rs` | transaction callbacks |
//! | `worker.rs`, `held_back.rs`, `worker_launch.rs` | the background position worker; its held-back warnings; its start by the backends that allocate |
//! | `engine/` | between the SQL API and the registry: allocation (the hot path), a stream's first use (the cold path), the answer per snapshot |
//! | `api/` | the SQL functions of streams, writing, reading, followers, checks |
//! | `types.rs` | the token types (varlena I/O, operators' functions) |
//! | `token_datum.rs` | a token as a varlena datum and back (the types' and the extension's own writes) |
//! | `catalog.rs` | the stream catalog with a per-backend cache |
//! | `prepared.rs` | what a prepared transaction may commit rows for, recorded at PREPARE, read after a start |
//! | `sequence.rs` | a stream's sequence: nextval, its WAL position, its value |
//! | `sql/` | every internal SQL statement (the one SPI boundary), and the switch to another role (see its `mod.rs`) |
//! | `roles.rs` | whether a role has another's privileges, a role's name for messages |
//! | `session.rs` | an object access hook: another role's code may not take advisory locks or holds in the caller's session |
//! | `backend.rs` | whether the server is in recovery, this backend's PGPROC number, when it last looked for its worker (the lowest layer) |
//! | `ffi.rs` | C functions declared by hand |
//! | `fast_hash.rs` | the hasher of the per-backend caches |
//! | `guc.rs`, `error.rs` | settings; every user-facing error with its SQLSTATE |

#![warn(clippy::undocumented_unsafe_blocks)]

use pgrx::prelude::*;

mod api;
mod backend;
mod catalog;
mod engine;
mod error;
mod fast_hash;
mod ffi;
mod guc;
mod held_back;
mod prepared;
mod registry;
mod replay;
mod roles;
mod sequence;
mod session;
mod sql;
mod token_datum;
mod types;
mod worker;
mod worker_launch;
mod xact;

pgrx::pg_module_magic!();

// Shell types first, so that the generated I/O functions can name them; the
// full type definitions, operators, classes and comments come last.
pgrx::extension_sql_file!("../sql/bootstrap.sql", name = "bootstrap", bootstrap);
pgrx::extension_sql_file!("../sql/finalize.sql", name = "finalize", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // No Rust backtrace ever reaches a client: pgrx puts the one captured
    // at a panic (or at a PostgreSQL ERROR crossing Rust frames) into the
    // error's DETAIL when the standard library's capture is enabled, which
    // RUST_BACKTRACE in the server's environment does. RUST_LIB_BACKTRACE
    // takes precedence over it; the first capture reads the setting and
    // the standard library keeps its answer for the process (and for the
    // processes the postmaster forks after preloading us).
    std::env::set_var("RUST_LIB_BACKTRACE", "0");
    let _ = std::backtrace::Backtrace::capture();
    // The registry exists only when the library is preloaded: shared memory
    // can be requested nowhere else. Token types work either way.
    // SAFETY: a flag the postmaster sets while it loads preloaded libraries.
    let preloading = unsafe { pg_sys::process_shared_preload_libraries_in_progress };
    // SAFETY: a flag set while an extension's script runs.
    let in_extension_script = unsafe { pg_sys::creating_extension };
    guc::define(preloading);
    if preloading {
        registry::request_shared_memory();
        replay::register(preloading);
    } else if in_extension_script {
        // Loaded first by CREATE (or ALTER) EXTENSION without the preload:
        // say so now, not at the first next_id.
        pgrx::pg_sys::panic::ErrorReport::new(
            PgSqlErrorCode::ERRCODE_WARNING,
            "streampos is not in shared_preload_libraries",
            "_PG_init",
        )
        .set_detail(
            "Its streams cannot allocate IDs or report positions until it is: those functions fail with SQLSTATE 55000. The token types work without it.",
        )
        .set_hint("Add streampos to shared_preload_libraries in postgresql.conf and restart the server.")
        .report(PgLogLevel::WARNING);
    }
    xact::register_callbacks();
    catalog::register_invalidation();
    session::register();
}

/// Tests that need a backend but not concurrency (those are in tests/, driven
/// from Python with real sessions).
#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    use pgrx::prelude::*;

    #[pg_test]
    fn token_text_round_trip_is_canonical() {
        let out =
            Spi::get_one::<String>("SELECT 'm56~3.59~2.58'::streampos.room_stream_token::text");
        assert_eq!(out, Ok(Some("m56~2.58~3.59".to_string())));
    }

    #[pg_test(error = "invalid input syntax for type multi_writer_token: \"s5\"")]
    fn multi_writer_token_rejects_live_room_syntax() {
        let _ = Spi::get_one::<String>("SELECT 's5'::streampos.multi_writer_token::text");
    }

    #[pg_test]
    fn own_allocation_holds_the_frontier_back() {
        Spi::run("SELECT streampos.create_stream('pg_test_stream')").unwrap();
        let id = Spi::get_one::<i64>("SELECT streampos.next_id('pg_test_stream', 'w1')");
        assert_eq!(id, Ok(Some(1)));
        // The allocating transaction is this one: still in flight.
        let frontier = Spi::get_one::<i64>("SELECT streampos.frontier('pg_test_stream')");
        assert_eq!(frontier, Ok(Some(0)));
        let held =
            Spi::get_one::<i64>("SELECT count(*) FROM streampos.in_flight('pg_test_stream')");
        assert_eq!(held, Ok(Some(1)));
        let token =
            Spi::get_one::<String>("SELECT streampos.current_room_token('pg_test_stream')::text");
        assert_eq!(token, Ok(Some("s0".to_string())));
    }

    #[pg_test(error = "stream \"missing\" does not exist")]
    fn unknown_stream_is_an_error() {
        let _ = Spi::get_one::<i64>("SELECT streampos.frontier('missing')");
    }
}

/// This module is required by `cargo pgrx test` invocations.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec!["shared_preload_libraries = 'streampos'"]
    }
}
