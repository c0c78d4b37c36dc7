//! Allocation: `next_id`, `next_ids`, `hold_ids` and a hold's release,
//! from the SQL functions to the registry and the stream's sequence.

use std::rc::Rc;

use pgrx::pg_sys;

use crate::catalog::{self, StreamMeta};
use crate::error::{Error, OrRaise};
use crate::registry;
use crate::{guc, sequence, worker_launch};

use super::index::{in_recovery, with_index};
use super::marks::record_history_mark;

/// Most IDs one call may allocate.
pub const MAX_IDS_PER_CALL: i32 = 1_000_000;

/// Allocate `n` IDs of `stream` for `writer` in the current transaction.
/// `hold`: the IDs are held by the session (`hold_ids`), not by the
/// transaction.
pub fn allocate(stream: &str, writer: &str, n: i32, hold: bool) -> Vec<i64> {
    registry::require_loaded().or_raise();
    if !(1..=MAX_IDS_PER_CALL).contains(&n) {
        Error::InvalidArgument {
            message: format!("cannot allocate {n} IDs"),
            detail: Some(format!("n must be between 1 and {MAX_IDS_PER_CALL}.")),
        }
        .report();
    }
    if in_recovery() {
        Error::ReadOnly("during recovery").report();
    }
    // SAFETY: plain read of the transaction's read-only flag.
    if unsafe { pg_sys::XactReadOnly } {
        Error::ReadOnly("in a read-only transaction").report();
    }
    catalog::validate_instance_name(writer).or_raise();
    let (meta, sequence) = current_stream(stream, writer);
    let instance = catalog::instance_id(writer).or_raise();
    record_history_mark(&meta);
    // Visibility checks compare against this xid.
    // SAFETY: assigns (or returns) this transaction's top xid; may raise an
    // ERROR, which is fine here.
    let xid = unsafe { pg_sys::GetTopTransactionId() };
    let (index, allocation) = with_index(&meta, |index| {
        Ok(registry::begin_allocation(&registry::Request {
            stream: index,
            key: meta.key,
            seq: meta.seq,
            instance,
            instance_name: writer,
            open_stream: meta.writers.is_none(),
            hold,
            xid,
        })?
        .map(|allocation| (index, allocation)))
    });
    // After the entry is published: a position worker that leaves for want
    // of work either sees it first (and stays) or has freed its slot by
    // now (and this starts a new one; see `registry::leave_if_idle`).
    let checked = worker_launch::ensure_running();
    guc::test_pause_in_allocation();
    let (mut ids, lsn) = sequence.next_values(n);
    registry::finish_allocation(index, allocation, &ids, lsn).or_raise();
    if checked {
        registry::prune_if_crowded().or_raise();
    }
    if meta.backwards {
        ids.iter_mut().for_each(|id| *id = -*id);
    }
    ids
}

/// Release the hold of this session that handed out exactly `ids` (as
/// `hold_ids` returned them): at the commit of the calling transaction,
/// for the snapshots that see that commit.
pub fn release(stream: &str, ids: &[i64]) {
    registry::require_loaded().or_raise();
    let meta = catalog::stream_latest(stream).or_raise();
    let internal = |id: i64| {
        if meta.backwards {
            id.saturating_neg()
        } else {
            id
        }
    };
    let (Some(&first), Some(&last)) = (ids.first(), ids.last()) else {
        Error::invalid("no IDs to release").report()
    };
    // SAFETY: assigns (or returns) this transaction's top xid (readers
    // compare against it: the release is seen with its commit), and reads
    // the current subtransaction; may raise an ERROR, which is fine here.
    let (xid, subxact) = unsafe {
        (
            pg_sys::GetTopTransactionId(),
            pg_sys::GetCurrentSubTransactionId(),
        )
    };
    let released = with_index(&meta, |index| {
        registry::release_hold(
            index,
            meta.key,
            meta.seq,
            (internal(first), internal(last), ids.len() as i64),
            xid,
            subxact,
        )
    });
    if !released {
        Error::InvalidArgument {
            message: format!(
                "no hold of this session on stream \"{}\" is the IDs {first} to {last}",
                crate::error::clip(stream)
            ),
            detail: Some(
                "Pass release_ids() the array hold_ids() returned, in the session that called it, once.".into(),
            ),
        }
        .report();
    }
}

/// The stream as it is now, checked for `writer` and the caller, with its
/// sequence held for allocation. Looked up again once the sequence is held:
/// a `drop_stream` that held it first has committed by then, and the
/// stream's new row (or its absence) is what counts.
fn current_stream(stream: &str, writer: &str) -> (Rc<StreamMeta>, sequence::ForAllocation) {
    let mut meta = catalog::stream_latest(stream).or_raise();
    for _ in 0..3 {
        if !meta.allows(writer) {
            Error::NotAWriter {
                stream: stream.into(),
                instance: writer.into(),
            }
            .report();
        }
        // Before anything is created or published: the caller must be
        // allowed to take the sequence's values, and the sequence must be
        // permanent.
        sequence::check_may_allocate(meta.seq, stream);
        // Checked usable and held (see `lock_against_allocation`).
        let held = sequence::open_for_allocation(meta.seq);
        let now = catalog::stream_latest(stream).or_raise();
        let same = now.key == meta.key && now.seq == meta.seq && now.writers == meta.writers;
        match held {
            Some(held) if same => return (now, held),
            Some(held) => held.close(),
            // The sequence is gone but the stream still names it: say so.
            None if same => sequence::check_usable(meta.seq),
            None => {}
        }
        meta = now;
    }
    Error::Retry {
        message: format!(
            "stream \"{}\" changed while IDs were being allocated",
            crate::error::clip(stream)
        ),
    }
    .report()
}
