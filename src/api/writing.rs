//! Allocation: `next_id` and `next_ids`, inside the transaction that persists
//! the rows; `hold_ids` and `release_ids`, for rows that other transactions
//! write.

use pgrx::prelude::*;

use crate::engine;

#[pg_extern(volatile, strict, parallel_unsafe)]
fn next_id(stream: &str, writer: &str) -> i64 {
    engine::allocate(stream, writer, 1, false)
        .first()
        .copied()
        .unwrap_or(0)
}

#[pg_extern(volatile, strict, parallel_unsafe)]
fn next_ids(stream: &str, writer: &str, n: i32) -> Vec<i64> {
    engine::allocate(stream, writer, n, false)
}

/// IDs held by the session rather than its transaction: in flight until
/// `release_ids` (or the end of the session), for rows that other
/// transactions write. If the calling transaction aborts, they are
/// abandoned with it.
#[pg_extern(volatile, strict, parallel_unsafe)]
fn hold_ids(stream: &str, writer: &str, n: default!(i32, 1)) -> Vec<i64> {
    engine::allocate(stream, writer, n, true)
}

/// Release a hold of this session: its IDs are finished with the commit of
/// the calling transaction (a reader passes them only in a snapshot that
/// sees that commit); if it aborts, the hold goes on.
#[pg_extern(volatile, strict, parallel_unsafe)]
fn release_ids(stream: &str, ids: Array<'_, i64>) {
    // A hold has at most as many IDs as one call allocates: anything longer
    // is no hold, and is not copied.
    if ids.len() > engine::MAX_IDS_PER_CALL as usize {
        crate::error::Error::invalid("no hold has that many IDs").report()
    }
    let Some(ids) = ids.iter().collect::<Option<Vec<i64>>>() else {
        crate::error::Error::invalid("the IDs to release must not contain NULL").report()
    };
    engine::release(stream, &ids)
}
