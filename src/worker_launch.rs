//! Starting a database's position worker (`worker.rs`) from the backends
//! that allocate: at most one check a second per backend, on the
//! allocation's path. Apart from the worker itself, which reads the
//! engine's answers: the engine calls down here, never up into it.

use pgrx::bgworkers::BackgroundWorkerBuilder;
use pgrx::prelude::*;
use pgrx::IntoDatum;

use crate::{backend, registry};

/// Start this database's worker unless it runs. Checked at most once a
/// second per backend, as this is on every allocation's path; returns
/// whether it checked (callers piggyback other once-a-second work on it).
pub fn ensure_running() -> bool {
    // SAFETY: reads the clock; raises no error.
    let now = unsafe { crate::ffi::unguarded::GetCurrentTimestamp() };
    if now - backend::worker_checked_at() < 1_000_000 {
        return false;
    }
    backend::set_worker_checked_at(now);
    // A single-user backend (postgres --single) has no postmaster to start
    // a worker: say nothing, and let writers prune (`prune_if_crowded`).
    // SAFETY: a flag set once at process start.
    if unsafe { !pg_sys::IsUnderPostmaster } {
        return true;
    }
    // SAFETY: MyDatabaseId is set once the backend is connected.
    let db = unsafe { pg_sys::MyDatabaseId };
    if !registry::worker_needed(db) {
        return true;
    }
    let started = BackgroundWorkerBuilder::new("streampos position worker")
        .set_type("streampos position worker")
        .set_library("streampos")
        .set_function("streampos_position_worker")
        .set_argument(db.into_datum())
        .enable_spi_access()
        // Not restarted by the postmaster: the next allocation in the
        // database starts it again (within a second), and a database that
        // was dropped is never retried.
        .set_restart_time(None)
        .load_dynamic();
    if started.is_err() {
        registry::worker_start_failed(db);
        ereport!(
            WARNING,
            PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            "could not start the streampos position worker",
            "Writer positions are not stored until it starts; raise max_worker_processes."
        );
    }
    true
}
