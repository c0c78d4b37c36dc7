//! What this server and backend are now, read from the server's globals
//! without raising an error: whether the server is in recovery, this
//! backend's PGPROC number. The lowest layer: the registry, the catalog
//! and the engine all ask it.

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
