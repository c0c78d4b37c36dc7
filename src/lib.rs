//! streampos: stream positions for chat homeservers, inside PostgreSQL.
//!
//! Pure logic (tokens, the frontier algorithm) lives in the `streampos-core`
//! crate and is tested without a server. The modules here are thin glue, one
//! per PostgreSQL mechanism.

use pgrx::prelude::*;

mod api;
mod catalog;
mod error;
mod guc;
mod registry;
mod types;
mod worker;
mod xact;

pgrx::pg_module_magic!();

// Shell types first, so that the generated I/O functions can name them; the
// full type definitions, operators, classes and comments come last.
pgrx::extension_sql_file!("../sql/bootstrap.sql", name = "bootstrap", bootstrap);
pgrx::extension_sql_file!("../sql/finalize.sql", name = "finalize", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    guc::define();
    // The registry exists only when the library is preloaded: shared memory
    // can be requested nowhere else. Token types work either way.
    if unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        registry::request_shared_memory();
    }
    xact::register_callbacks();
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {}

/// This module is required by `cargo pgrx test` invocations.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec!["shared_preload_libraries = 'streampos'"]
    }
}
