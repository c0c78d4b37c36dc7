//! How a reader decides what is in flight for its snapshot: the running
//! allocations in the backend slots, the finished ring of recent commits a
//! snapshot may not see yet, the per-stream summary of entries the ring had
//! to let go, and the pruning that forgets what every snapshot sees.

use std::ptr;

use pgrx::pg_sys;
use pgrx::pg_sys::TransactionId;
use streampos_core::frontier::{HeldBy, Holder};

use super::shmem::{Finished, Locked, Summary};
use super::streams::{matches, Stale};
use crate::error::Error;

impl Locked {
    /// The finished entries, oldest first.
    pub(super) fn ring_entries(&self) -> impl Iterator<Item = &Finished> + '_ {
        let h = self.h();
        let (head, used, cap) = (
            h.ring_head as usize,
            h.ring_used as usize,
            h.ring_cap as usize,
        );
        let ring: &[Finished] = self.ring();
        (0..used).map(move |k| &ring[(head + k) % cap])
    }

    /// Append at the tail; when full, the oldest entry makes room and is
    /// returned.
    pub(super) fn ring_push(&self, entry: Finished) -> Option<Finished> {
        let h = self.h();
        let cap = h.ring_cap as usize;
        let ring = self.ring();
        if (h.ring_used as usize) < cap {
            ring[(h.ring_head as usize + h.ring_used as usize) % cap] = entry;
            h.ring_used += 1;
            None
        } else {
            let evicted = ring[h.ring_head as usize];
            ring[h.ring_head as usize] = entry;
            h.ring_head = ((h.ring_head as usize + 1) % cap) as u32;
            Some(evicted)
        }
    }

    /// Drop entries from the head while `done` says they are no longer needed.
    fn ring_pop_while(&self, done: impl Fn(&Finished) -> bool) {
        let h = self.h();
        let cap = h.ring_cap as usize;
        let ring = self.ring();
        while h.ring_used > 0 && done(&ring[h.ring_head as usize]) {
            h.ring_head = ((h.ring_head as usize + 1) % cap) as u32;
            h.ring_used -= 1;
        }
    }
}

/// Fold an entry evicted from the ring into its stream's summary.
pub(super) fn fold_into_summary(
    summary: &mut Summary,
    xid: TransactionId,
    min_id: i64,
    completion_count: u64,
    lsn: u64,
    latest_completed: TransactionId,
) {
    if !summary.valid {
        *summary = Summary {
            valid: true,
            min_xid: xid,
            max_xid: xid,
            min_id,
            completion_count,
            lsn,
            latest_completed,
        };
        return;
    }
    // SAFETY: TransactionIdPrecedes is a pure comparison.
    unsafe {
        if pg_sys::TransactionIdPrecedes(summary.latest_completed, latest_completed) {
            summary.latest_completed = latest_completed;
        }
        if pg_sys::TransactionIdPrecedes(xid, summary.min_xid) {
            summary.min_xid = xid;
        }
        if pg_sys::TransactionIdPrecedes(summary.max_xid, xid) {
            summary.max_xid = xid;
        }
    }
    summary.completion_count = summary.completion_count.max(completion_count);
    summary.lsn = summary.lsn.max(lsn);
    summary.min_id = summary.min_id.min(min_id);
}

/// Prune from a writer when the ring is more than half full: the position
/// worker normally keeps it near empty, but may not be running.
pub fn prune_if_crowded() -> Result<(), Error> {
    let crowded = {
        let locked = Locked::acquire(false)?;
        let h = locked.h();
        h.ring_used > h.ring_cap / 2
    };
    if crowded {
        prune()?;
    }
    Ok(())
}

/// Forget finished entries that every snapshot, now and later, sees.
pub fn prune() -> Result<(), Error> {
    super::require_loaded()?;
    // SAFETY: reads the shared transaction horizon; raises no error.
    let horizon = unsafe { pg_sys::GetOldestNonRemovableTransactionId(ptr::null_mut()) };
    let flushed = flushed_lsn();
    let locked = Locked::acquire(true)?;
    // From the head only (FIFO): an entry still needed keeps the younger
    // ones for a while, which costs readers a little scanning, nothing else.
    locked.ring_pop_while(|f| {
        let durable = f.lsn <= flushed;
        // SAFETY: pure xid comparison.
        let seen_by_all = f.aborted || unsafe { pg_sys::TransactionIdPrecedes(f.xid, horizon) };
        durable && seen_by_all
    });
    for s in locked.streams().iter_mut() {
        if s.summary.valid
            && s.summary.lsn <= flushed
            // SAFETY: pure xid comparison.
            && unsafe { pg_sys::TransactionIdPrecedes(s.summary.max_xid, horizon) }
        {
            s.summary.valid = false;
        }
    }
    Ok(())
}

/// How far the WAL is durable. Allocations beyond it could be handed out
/// again after a crash.
fn flushed_lsn() -> u64 {
    // SAFETY: reads a shared LSN under its own spinlock.
    unsafe { pg_sys::GetFlushRecPtr(ptr::null_mut()) }
}

/// Does `snapshot` possibly not see transaction `xid` as finished?
///
/// # Safety
/// `snapshot` must be a valid MVCC snapshot.
unsafe fn invisible(xid: TransactionId, snapshot: pg_sys::Snapshot) -> bool {
    // SAFETY: forwarded from the caller.
    unsafe { pg_sys::XidInMVCCSnapshot(xid, snapshot) }
}

/// Does `snapshot` see every transaction folded into the summary? All of
/// them committed, within [min_xid, max_xid], before the last fold.
/// Conservative: a transaction the snapshot saw running, inside the range and
/// committed since, may be one of them.
///
/// # Safety
/// `snapshot` must be a valid MVCC snapshot.
unsafe fn sees_all(summary: &Summary, snapshot: pg_sys::Snapshot) -> bool {
    // SAFETY: the caller passes a valid snapshot; its xip array has xcnt
    // entries.
    unsafe {
        let snap = &*snapshot;
        // Taken after the last folded transaction completed.
        if snap.snapXactCompletionCount != 0
            && snap.snapXactCompletionCount >= summary.completion_count
        {
            return true;
        }
        if pg_sys::TransactionIdPrecedes(summary.max_xid, snap.xmin) {
            return true;
        }
        // xmax - 1 is the latest completed xid when the snapshot was taken:
        // past the one recorded at the last fold means taken after it.
        let after_fold =
            TransactionId::from_inner(summary.latest_completed.into_inner().wrapping_add(1));
        if pg_sys::TransactionIdPrecedes(after_fold, snap.xmax) {
            return true;
        }
        if snap.takenDuringRecovery || !pg_sys::TransactionIdPrecedes(summary.max_xid, snap.xmax) {
            return false;
        }
        // A running xid of the snapshot inside the range may be a folded
        // transaction, unless it has not committed (folded ones all have):
        // typically a long transaction that is still running.
        let xip = std::slice::from_raw_parts(snap.xip, snap.xcnt as usize);
        !xip.iter().any(|&x| {
            !pg_sys::TransactionIdPrecedes(x, summary.min_xid)
                && !pg_sys::TransactionIdPrecedes(summary.max_xid, x)
                && pg_sys::TransactionIdDidCommit(x)
        })
    }
}

/// What the caller's snapshot must treat as in flight for one stream.
#[derive(Clone)]
pub struct StreamView {
    pub max_allocated: i64,
    pub holders: Vec<Holder>,
    pub seen: Vec<i32>,
}

/// The snapshot this statement reads with.
pub fn caller_snapshot() -> pg_sys::Snapshot {
    // SAFETY: called while a transaction is running SQL.
    unsafe {
        if pg_sys::ActiveSnapshotSet() {
            pg_sys::GetActiveSnapshot()
        } else {
            pg_sys::GetTransactionSnapshot()
        }
    }
}

/// The holders of stream `stream` (key `key`) for `snapshot`.
pub fn view(
    stream: usize,
    key: i32,
    snapshot: pg_sys::Snapshot,
) -> Result<Result<StreamView, Stale>, Error> {
    // Read before the scan: anything flushed later only makes us more
    // conservative.
    let flushed = flushed_lsn();
    let locked = Locked::acquire(false)?;
    let s = locked.streams()[stream];
    if !matches(&s, key) {
        return Ok(Err(Stale));
    }
    let stream_i32 = stream as i32;
    let mut holders = Vec::new();
    // IDs not yet durable hold back every writer: a crash could hand them
    // out again to anyone.
    let held_by = |instance: i32, lsn: u64| {
        if lsn > flushed {
            HeldBy::AllWriters
        } else {
            HeldBy::Writer(instance)
        }
    };
    for (slot_index, header) in locked.slot_headers().iter().enumerate() {
        if header.used == 0 {
            continue;
        }
        for a in locked.slot(slot_index).iter() {
            if a.stream == stream_i32 {
                holders.push(Holder {
                    held_by: held_by(a.instance, a.lsn),
                    min_id: a.min_id,
                });
            }
        }
    }
    for f in locked.ring_entries() {
        if f.stream != stream_i32 {
            continue;
        }
        let not_durable = f.lsn > flushed;
        // SAFETY: `snapshot` is the caller's valid MVCC snapshot.
        let unseen = !f.aborted && unsafe { invisible(f.xid, snapshot) };
        if not_durable || unseen {
            holders.push(Holder {
                held_by: held_by(f.instance, f.lsn),
                min_id: f.min_id,
            });
        }
    }
    // SAFETY: as above.
    if s.summary.valid && (s.summary.lsn > flushed || !unsafe { sees_all(&s.summary, snapshot) }) {
        holders.push(Holder {
            held_by: HeldBy::AllWriters,
            min_id: s.summary.min_id,
        });
    }
    Ok(Ok(StreamView {
        max_allocated: s.max_allocated,
        holders,
        seen: s.seen[..s.n_seen as usize].to_vec(),
    }))
}
