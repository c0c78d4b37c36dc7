//! For followers that LISTEN: telling the position worker's notifications
//! from anybody else's. Any role may `NOTIFY streampos, '…'`; a payload is
//! a hint to read positions again, and the sender's pid says whether the
//! worker sent it (pg_stat_activity hides other roles' backend types from
//! roles without pg_read_all_stats).

use std::ffi::CStr;

use pgrx::prelude::*;

/// The background worker type the position worker registers (worker.rs).
const WORKER_TYPE: &[u8] = b"streampos position worker";

/// Is `pid` this database's position worker? (A notification's sender pid:
/// `pg_notify` and `NOTIFY` cannot forge it.)
#[pg_extern(volatile, strict, parallel_restricted)]
fn is_position_worker(pid: i32) -> bool {
    // SAFETY: BackendPidGetProc reads the proc array under its lock and
    // returns a pointer into shared memory (or NULL), read once here;
    // GetBackgroundWorkerTypeByPid copies the type into a static buffer
    // under its lock (or returns NULL for a pid that is no worker).
    unsafe {
        let proc_ = pg_sys::BackendPidGetProc(pid);
        if proc_.is_null() || (*proc_).databaseId != pg_sys::MyDatabaseId {
            return false;
        }
        let kind = pg_sys::GetBackgroundWorkerTypeByPid(pid);
        !kind.is_null() && CStr::from_ptr(kind).to_bytes() == WORKER_TYPE
    }
}
