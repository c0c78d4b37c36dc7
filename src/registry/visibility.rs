//! How a reader decides what is in flight for its snapshot.
//!
//! An allocation holds a stream back for snapshot S while S does not see
//! its transaction's end, or while its IDs are not durable. The reader
//! decides from S's own contents and from facts that only ever grow; it
//! never asks whether a transaction has committed *now* (that would let a
//! later commit change what an old snapshot is told).
//!
//! Three places hold finished-or-not allocations:
//!
//! - the backend slots: transactions that have not run their commit or abort
//!   callback. An entry whose xid S sees as finished ended before S was
//!   taken; otherwise it holds S back.
//! - the finished ring: entries moved there by the callbacks, in push order,
//!   each stamped with `latestCompletedXid` at its push (read under the
//!   registry lock). S sees an entry when `XidInMVCCSnapshot` says so. If
//!   `S.xmax - 1` is past an entry's stamp, S was taken after that push: S
//!   sees it and every older entry, so the scan (newest first) stops there.
//!   A reader's work is what its own snapshot cannot see, not the ring's
//!   length.
//! - the summary of each stream: when the ring is full, its oldest entry is
//!   folded into it (lowest ID, highest stamp, highest xid, highest LSN). S
//!   sees the summary when `S.xmax - 1` is past the highest stamp; otherwise
//!   it holds every writer back from its lowest ID. Because the ring holds
//!   more entries than all backend slots together, the stamp has moved on
//!   by the time an entry is folded, so every snapshot taken after a fold
//!   sees the summary. Only snapshots older than the ring pay (they lag;
//!   they never miss a row).
//!
//! Pruning forgets ring entries (and summaries) whose xids precede every
//! snapshot's xmin, once durable.

use std::ptr;
use std::sync::atomic::Ordering;

use pgrx::pg_sys;
use pgrx::pg_sys::TransactionId;
use streampos_core::frontier::{HeldBy, Holder};

use super::shmem::{Finished, Locked, Summary};
use super::streams::{matches, Stale};
use crate::error::Error;

impl Locked {
    /// The finished entries, oldest first.
    pub(super) fn ring_entries(&self) -> impl DoubleEndedIterator<Item = &Finished> + '_ {
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
    pub(super) fn ring_push(&self, mut entry: Finished) -> Option<Finished> {
        let h = self.h();
        h.ring_lsn_max = h.ring_lsn_max.max(entry.lsn);
        entry.lsn_prefix_max = h.ring_lsn_max;
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

fn precedes(a: TransactionId, b: TransactionId) -> bool {
    // SAFETY: a pure comparison of two xids.
    unsafe { pg_sys::TransactionIdPrecedes(a, b) }
}

/// The xid after `xid`, as `TransactionIdAdvance` computes it (skipping the
/// special xids on wraparound).
fn next_xid(xid: TransactionId) -> TransactionId {
    let next = xid.into_inner().wrapping_add(1);
    TransactionId::from_inner(next.max(pg_sys::FirstNormalTransactionId.into_inner()))
}

/// Was `snapshot` taken after `latestCompletedXid` moved past `stamp`? Then
/// it was taken after the moment `stamp` was read.
fn taken_after(stamp: TransactionId, snapshot: &pg_sys::SnapshotData) -> bool {
    !snapshot.takenDuringRecovery && precedes(next_xid(stamp), snapshot.xmax)
}

/// `latestCompletedXid` now. Callers read it under the registry lock, after
/// their own transaction's end: see `Finished::latest_completed`.
pub(super) fn latest_completed() -> TransactionId {
    // SAFETY: ShmemVariableCache is set up before any backend runs; the
    // 64-bit field is read atomically on the platforms PostgreSQL supports.
    let full =
        unsafe { ptr::read_volatile(&raw const (*pg_sys::ShmemVariableCache).latestCompletedXid) };
    TransactionId::from_inner(full.value as u32)
}

/// How far allocations are durable: flushed locally and, while synchronous
/// standbys are configured, confirmed flushed by them (what a commit waits
/// for). IDs beyond it could be handed out again after a crash or a
/// failover. Never goes back: WAL that was final when no synchronous
/// standby was configured stays final when one is configured later.
pub fn durable_lsn() -> u64 {
    // SAFETY: GetFlushRecPtr reads a shared LSN under its own spinlock;
    // WalSndCtl is shared memory set up at start; its fields are read with
    // single (atomic on supported platforms) loads.
    let now = unsafe {
        let flushed = pg_sys::GetFlushRecPtr(ptr::null_mut());
        let ctl = pg_sys::WalSndCtl;
        let sync_defined = !ctl.is_null()
            && u32::from(ptr::read_volatile(&raw const (*ctl).sync_standbys_status))
                & pg_sys::SYNC_STANDBY_DEFINED
                != 0;
        if sync_defined {
            let confirmed =
                ptr::read_volatile(&raw const (*ctl).lsn[pg_sys::SYNC_REP_WAIT_FLUSH as usize]);
            flushed.min(confirmed)
        } else {
            flushed
        }
    };
    match super::shmem::durable_high_water() {
        Some(high) => high.fetch_max(now, Ordering::AcqRel).max(now),
        None => now,
    }
}

/// Fold an entry evicted from the ring into its stream's summary.
pub(super) fn fold_into_summary(summary: &mut Summary, evicted: &Finished) {
    if !summary.valid {
        *summary = Summary {
            valid: true,
            min_id: evicted.min_id,
            latest_completed: evicted.latest_completed,
            max_xid: evicted.xid,
            lsn: evicted.lsn,
        };
        return;
    }
    summary.min_id = summary.min_id.min(evicted.min_id);
    if precedes(summary.latest_completed, evicted.latest_completed) {
        summary.latest_completed = evicted.latest_completed;
    }
    if precedes(summary.max_xid, evicted.xid) {
        summary.max_xid = evicted.xid;
    }
    summary.lsn = summary.lsn.max(evicted.lsn);
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

/// Forget finished entries that every snapshot, now and later, sees, once
/// their IDs are durable.
pub fn prune() -> Result<(), Error> {
    super::require_loaded()?;
    // Every existing or future snapshot has an xmin at or past this.
    // SAFETY: computes the shared horizon; raises no error.
    let horizon = unsafe { pg_sys::GetOldestNonRemovableTransactionId(ptr::null_mut()) };
    let durable = durable_lsn();
    let locked = Locked::acquire(true)?;
    // From the head only (FIFO): an entry still needed keeps the younger
    // ones, which readers skip with their stop rule.
    locked.ring_pop_while(|f| f.lsn <= durable && (f.aborted || precedes(f.xid, horizon)));
    for s in locked.streams().iter_mut() {
        if s.summary.valid && s.summary.lsn <= durable && precedes(s.summary.max_xid, horizon) {
            s.summary.valid = false;
        }
    }
    Ok(())
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

/// The holders of stream `stream` (key `key`, sequence `seq`) for
/// `snapshot`.
pub fn view(
    stream: usize,
    key: i32,
    seq: pg_sys::Oid,
    snapshot: pg_sys::Snapshot,
) -> Result<Result<StreamView, Stale>, Error> {
    // Read before the scan: anything made durable later only makes us more
    // conservative.
    let durable = durable_lsn();
    // SAFETY: the caller passes its valid MVCC snapshot.
    let snap = unsafe { &*snapshot };
    let sees_end = |xid: TransactionId| {
        // SAFETY: as above.
        !unsafe { pg_sys::XidInMVCCSnapshot(xid, snapshot) }
    };
    let locked = Locked::acquire(false)?;
    let s = &locked.streams()[stream];
    if !matches(s, key, seq) {
        return Ok(Err(Stale));
    }
    let stream_i32 = stream as i32;
    let mut holders = Vec::new();
    let hold = |holders: &mut Vec<Holder>, instance: i32, min_id: i64, durable: bool| {
        holders.push(Holder {
            // IDs not yet durable hold back every writer: after a crash or
            // failover they could be handed out again, to anyone.
            held_by: if durable {
                HeldBy::Writer(instance)
            } else {
                HeldBy::AllWriters
            },
            min_id,
        });
    };
    // The caller's own transaction is running whatever its snapshot says
    // (a snapshot never lists its own xid as in progress).
    let own_slot = super::shmem::my_slot_index().ok();
    for (slot_index, header) in locked.slot_headers().iter().enumerate() {
        if header.used == 0 {
            continue;
        }
        let own = own_slot == Some(slot_index);
        for a in locked.slot(slot_index).iter() {
            if a.stream != stream_i32 {
                continue;
            }
            let ended = !own && sees_end(a.xid);
            // A pending entry has not recorded its WAL position: while its
            // transaction runs, its IDs are in flight like any other; once it
            // has ended (an allocation that failed, its callback not run
            // yet), nothing says its IDs are durable.
            let is_durable = if a.pending { !ended } else { a.lsn <= durable };
            if !ended || !is_durable {
                hold(&mut holders, a.instance, a.min_id, is_durable);
            }
        }
    }
    for f in locked.ring_entries().rev() {
        if taken_after(f.latest_completed, snap) && f.lsn_prefix_max <= durable {
            // This entry and every older one: seen and durable.
            break;
        }
        if f.stream != stream_i32 {
            continue;
        }
        let is_durable = f.lsn <= durable;
        let unseen = !f.aborted && !sees_end(f.xid);
        if unseen || !is_durable {
            hold(&mut holders, f.instance, f.min_id, is_durable);
        }
    }
    let summary = &s.summary;
    if summary.valid && (summary.lsn > durable || !taken_after(summary.latest_completed, snap)) {
        holders.push(Holder {
            held_by: HeldBy::AllWriters,
            min_id: summary.min_id,
        });
    }
    Ok(Ok(StreamView {
        max_allocated: s.max_allocated,
        holders,
        seen: s.seen[..s.n_seen as usize].to_vec(),
    }))
}
