//! A stream's sequence: handing out IDs, how far its WAL must be durable,
//! what it has handed out so far, and its settings.

use pgrx::pg_sys;

use crate::catalog::StreamMeta;
use crate::{ffi, sql};

/// `nextval` without the SQL call overhead. EXECUTE on next_id() is the
/// permission that matters, so the sequence's own is not checked.
pub fn nextval(seq: pg_sys::Oid) -> i64 {
    // SAFETY: `seq` is a sequence's OID from the stream catalog; errors
    // (e.g. a dropped sequence) are raised as PostgreSQL ERRORs through the
    // guarded boundary.
    unsafe { pg_sys::ffi::pg_guard_ffi_boundary(|| ffi::nextval_internal(seq, false)) }
}

/// The LSN of the sequence's page: the end of the WAL record that made the
/// values just handed out survive a crash (nextval logs 32 values ahead,
/// whichever backend's call wrote it). Until the WAL is flushed that far, a
/// crash could hand these IDs out again.
pub fn page_lsn(seq: pg_sys::Oid) -> u64 {
    // SAFETY: the relation is opened and locked for the duration; block 0 of
    // a sequence always exists; the buffer is pinned and share-locked while
    // its page header is read; errors are raised through the guarded
    // boundary.
    unsafe {
        pg_sys::ffi::pg_guard_ffi_boundary(|| {
            let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
            // nextval already holds a stronger lock: this is a local lookup.
            let rel = pg_sys::relation_open(seq, lock);
            let buffer = pg_sys::ReadBuffer(rel, 0);
            pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as i32);
            let page = if buffer > 0 {
                pg_sys::BufferBlocks.add((buffer as usize - 1) * pg_sys::BLCKSZ as usize)
                    as *const pg_sys::PageHeaderData
            } else {
                *pg_sys::LocalBufferBlockPointers.add((-buffer - 1) as usize)
                    as *const pg_sys::PageHeaderData
            };
            let lsn = ((*page).pd_lsn.xlogid as u64) << 32 | (*page).pd_lsn.xrecoff as u64;
            pg_sys::UnlockReleaseBuffer(buffer);
            pg_sys::relation_close(rel, lock);
            lsn
        })
    }
}

/// The highest value the sequence has handed out (internal numbering).
/// `is_called = false` means `last_value` is not handed out yet.
pub fn max_allocated(meta: &StreamMeta) -> i64 {
    let (last, called) = sql::sequence_state(&meta.seq_name);
    if called {
        last
    } else {
        last.saturating_sub(1)
    }
}

/// (INCREMENT, CACHE), or None when `seq` is not a sequence.
pub fn settings(seq: pg_sys::Oid) -> Option<(i64, i64)> {
    sql::sequence_settings(seq)
}
