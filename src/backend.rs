//! What this server and backend are now, read from the server's globals
//! without raising an error: whether the server is in recovery, this
//! backend's PGPROC number, when it last looked for its database's
//! position worker. The lowest layer: the registry, the catalog, the
//! engine and the worker all ask it.

use pgrx::pg_sys;

/// Is the server in recovery (a hot standby, or a start replaying WAL)?
pub fn in_recovery() -> bool {
    // SAFETY: reads shared recovery state; raises no error.
    unsafe { crate::ffi::unguarded::RecoveryInProgress() }
}

/// This backend's PGPROC number.
pub fn my_proc_number() -> i32 {
    // SAFETY: MyProc is this backend's PGPROC, set at start-up;
    // MyProcNumber (PostgreSQL 17, which dropped `pgprocno` from the
    // PGPROC) likewise.
    unsafe {
        #[cfg(any(feature = "pg14", feature = "pg15", feature = "pg16"))]
        return (*pg_sys::MyProc).pgprocno;
        #[cfg(not(any(feature = "pg14", feature = "pg15", feature = "pg16")))]
        return pg_sys::MyProcNumber;
    }
}

thread_local! {
    static WORKER_CHECKED_AT: std::cell::Cell<pg_sys::TimestampTz> = const { std::cell::Cell::new(0) };
}

/// When this backend last checked that its database's position worker runs
/// (`worker_launch::ensure_running`, at most once a second); 0: never.
pub fn worker_checked_at() -> pg_sys::TimestampTz {
    WORKER_CHECKED_AT.with(|c| c.get())
}

/// Set 0 by the catalog when the extension may have been dropped (its
/// worker then left) and created again: the next allocation checks at
/// once. Safe from any callback.
pub fn set_worker_checked_at(at: pg_sys::TimestampTz) {
    WORKER_CHECKED_AT.with(|c| c.set(at));
}
