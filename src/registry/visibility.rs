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

use super::shmem::{EntryCopy, Finished, Locked, Raw, Section, Stale, Summary, ALL_WRITERS};
use crate::error::Error;
use crate::ffi::unguarded;

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
            // On the header's line this push writes anyway; written only
            // when it grows.
            #[cfg(feature = "stats")]
            if h.ring_used > h.ring_used_max {
                h.ring_used_max = h.ring_used;
            }
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

/// `TransactionIdPrecedes` (transam.c), inlined: it is called for every
/// entry a reader examines.
pub fn precedes(a: TransactionId, b: TransactionId) -> bool {
    let (a, b) = (a.into_inner(), b.into_inner());
    let first_normal = pg_sys::FirstNormalTransactionId.into_inner();
    if a < first_normal || b < first_normal {
        return a < b;
    }
    (a.wrapping_sub(b) as i32) < 0
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
    // PostgreSQL 17 renamed ShmemVariableCache to TransamVariables.
    #[cfg(any(feature = "pg14", feature = "pg15", feature = "pg16"))]
    let variables = &raw const pg_sys::ShmemVariableCache;
    #[cfg(not(any(feature = "pg14", feature = "pg15", feature = "pg16")))]
    let variables = &raw const pg_sys::TransamVariables;
    // SAFETY: the variables are set up before any backend runs; the 64-bit
    // field is read atomically on the platforms PostgreSQL supports.
    let full = unsafe { ptr::read_volatile(&raw const (**variables).latestCompletedXid) };
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
        let flushed = unguarded::GetFlushRecPtr(ptr::null_mut());
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
        // A plain load first: the shared cache line is written only when
        // the durable point moved.
        Some(high) => {
            let seen = high.load(Ordering::Acquire);
            if now > seen {
                high.fetch_max(now, Ordering::AcqRel).max(now)
            } else {
                seen
            }
        }
        None => now,
    }
}

/// Wait until `lsn` is durable (`durable_lsn`): flush the WAL up to it,
/// then, while synchronous standbys are configured, wait for their
/// confirmation as a commit would (the wait answers query cancel and
/// `statement_timeout`). Only on the rare path where a transaction's
/// allocation needs a newer sequence record than its earlier IDs had.
pub fn wait_until_durable(lsn: u64) {
    if durable_lsn_seen() >= lsn || durable_lsn() >= lsn {
        return;
    }
    // SAFETY: XLogFlush raises no ERROR for a position already inserted (a
    // write failure is a PANIC anywhere); the latch wait is the usual
    // interruptible sleep of a backend.
    unsafe {
        if unguarded::GetFlushRecPtr(ptr::null_mut()) < lsn {
            pg_sys::XLogFlush(lsn);
        }
        while durable_lsn() < lsn {
            pgrx::check_for_interrupts!();
            pg_sys::WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                5,
                pg_sys::PG_WAIT_EXTENSION,
            );
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
    }
}

/// Is every WAL record inserted so far durable? Then no position can move
/// by the WAL's flush alone, only by an allocation's end, which broadcasts:
/// a follower waiting for the stream need not look again before it is
/// woken. (At a page boundary the insert position is past the page's
/// header: "no" then, which only makes the follower look sooner.)
pub fn wal_settled() -> bool {
    // SAFETY: reads the WAL insert position under PostgreSQL's own lock.
    let inserted = unsafe { pg_sys::GetXLogInsertRecPtr() };
    durable_lsn() >= inserted
}

/// The durable point as last seen by anyone (a lower bound of
/// `durable_lsn()`), without reading the WAL position.
fn durable_lsn_seen() -> u64 {
    super::shmem::durable_high_water().map_or(0, |high| high.load(Ordering::Acquire))
}

/// Is `lsn` durable? Asks `durable_lsn()` only when the last value seen is
/// not enough, at most once per reader: the answer is the same as with a
/// fresh `durable_lsn()` read at the first question that needed it.
struct Durability {
    known: u64,
    fresh: bool,
}

impl Durability {
    fn new() -> Durability {
        Durability {
            known: durable_lsn_seen(),
            fresh: false,
        }
    }

    fn covers(&mut self, lsn: u64) -> bool {
        if lsn > self.known && !self.fresh {
            self.known = durable_lsn();
            self.fresh = true;
        }
        lsn <= self.known
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
        let locked = Locked::acquire(Section::OtherShared)?;
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
    let locked = Locked::acquire(Section::Prune)?;
    // From the head only (FIFO): an entry still needed keeps the younger
    // ones, which readers skip with their stop rule.
    locked.ring_pop_while(|f| f.lsn <= durable && (f.aborted || precedes(f.xid, horizon)));
    for s in locked.streams().iter_mut() {
        if s.summary.valid && s.summary.lsn <= durable && precedes(s.summary.max_xid, horizon) {
            s.summary.valid = false;
        }
        // Every snapshot sees the drop now: forget its xid before xid
        // wraparound could make it look recent again.
        if s.dropped_by != pg_sys::InvalidTransactionId && precedes(s.dropped_by, horizon) {
            s.dropped_by = pg_sys::InvalidTransactionId;
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
    /// The stream has orphaned holds (the position worker releases them).
    pub orphans: bool,
}

/// The snapshot this statement reads with.
pub fn caller_snapshot() -> pg_sys::Snapshot {
    // SAFETY: called while a transaction is running SQL.
    unsafe {
        if unguarded::ActiveSnapshotSet() {
            unguarded::GetActiveSnapshot()
        } else {
            pg_sys::GetTransactionSnapshot()
        }
    }
}

/// What a reader copies of one stream (phase 1 of `view`), consistent as of
/// one instant: the stream's state, its entries in the active backend
/// slots, and its ring entries from the newest back to where the snapshot
/// sees everything.
#[derive(Default)]
struct Copied {
    max_allocated: i64,
    n_seen: usize,
    /// (entry, is it the caller's own?, is it a hold?)
    slot_entries: Vec<(EntryCopy, bool, bool)>,
    /// The stream's orphaned holds: (writer or ALL_WRITERS, lowest ID).
    orphans: Vec<(i32, i64)>,
    /// See `StreamCopy::unrecorded_have`.
    unrecorded_have: Option<i64>,
    ring_entries: Vec<Finished>,
    /// (lowest ID, highest stamp, highest LSN) of a valid summary.
    summary: Option<(i64, TransactionId, u64)>,
    /// Active backend slots scanned (lock statistics).
    #[cfg(feature = "lock-stats")]
    slots_visited: usize,
}

/// Exclusive sections seen by a lock-free reader before it takes the lock
/// shared instead (so that a stream of writers cannot starve it). A try
/// costs the reader a copy; falling back costs writers a wait.
const LOCK_FREE_TRIES: usize = 8;
/// How long a reader spins for an exclusive section to end (they last well
/// under a microsecond) before it takes the lock, which sleeps if the
/// writer was preempted.
const SPINS: usize = 256;

/// Phase 1 of `view`: copy what the snapshot may have to treat as in flight.
/// Reads only (volatile, bounded; see `Raw`); decides nothing that needs a
/// consistent copy, apart from where the ring scan stops, which a torn copy
/// can only get wrong in a copy that is thrown away.
#[allow(clippy::too_many_arguments)]
fn copy_stream(
    raw: Raw,
    stream: usize,
    key: i32,
    seq: pg_sys::Oid,
    snap: &pg_sys::SnapshotData,
    own_slot: Option<usize>,
    durable: &mut Durability,
    out: &mut Copied,
) -> Result<(), Stale> {
    out.slot_entries.clear();
    out.ring_entries.clear();
    let s = raw.stream(stream);
    // SAFETY: MyDatabaseId is set once the backend is connected.
    let db = unsafe { pg_sys::MyDatabaseId };
    if !(s.in_use && s.loaded && s.key == key && s.seq == seq && s.db == db) {
        return Err(Stale);
    }
    out.max_allocated = s.max_allocated;
    out.n_seen = s.n_seen;
    let stream_i32 = stream as i32;
    #[cfg(feature = "lock-stats")]
    {
        out.slots_visited = 0;
    }
    raw.for_each_active(|slot, used, held| {
        #[cfg(feature = "lock-stats")]
        {
            out.slots_visited += 1;
        }
        let own = own_slot == Some(slot);
        for k in 0..used {
            let a = raw.entry(slot, k);
            if a.stream == stream_i32 {
                out.slot_entries.push((a, own, false));
            }
        }
        for k in 0..held {
            let a = raw.hold(slot, k);
            if a.stream == stream_i32 {
                out.slot_entries.push((a, own, true));
            }
        }
    });
    raw.ring_newest_first(|f| {
        if taken_after(f.latest_completed, snap) && durable.covers(f.lsn_prefix_max) {
            // This entry and every older one: seen and durable.
            return false;
        }
        if f.stream == stream_i32 {
            out.ring_entries.push(f);
        }
        true
    });
    out.summary =
        s.summary_valid
            .then_some((s.summary_min_id, s.summary_latest_completed, s.summary_lsn));
    out.orphans.clear();
    if s.orphans_valid {
        raw.orphans(stream, &mut out.orphans);
    }
    out.unrecorded_have = s.unrecorded_have;
    Ok(())
}

/// The holders of stream `stream` (key `key`, sequence `seq`) for
/// `snapshot`.
///
/// Two phases: copy what the snapshot may have to treat as in flight, as
/// of one instant (without the lock, as a seqlock reader, or after a few
/// tries under the lock shared), then decide from the copy. Deciding takes
/// the snapshot's `XidInMVCCSnapshot`, which may read pg_subtrans; it runs on
/// the stable copy, outside any lock. Readers thus never hold the lock
/// writers need, unless writers keep changing the registry under them.
pub fn view(
    stream: usize,
    key: i32,
    seq: pg_sys::Oid,
    snapshot: pg_sys::Snapshot,
) -> Result<Result<StreamView, Stale>, Error> {
    // SAFETY: the caller passes its valid MVCC snapshot.
    let snap = unsafe { &*snapshot };
    let sees_end = |xid: TransactionId| {
        // SAFETY: as above.
        !unsafe { pg_sys::XidInMVCCSnapshot(xid, snapshot) }
    };
    let raw = Raw::get()?;
    if stream >= raw.n_streams() {
        return Ok(Err(Stale));
    }
    // The caller's own transaction is running whatever its snapshot says
    // (a snapshot never lists its own xid as in progress).
    let own_slot = super::shmem::my_slot_index().ok();
    // A durable point read later than the entries only makes more of them
    // durable, which is the truth.
    let mut durable = Durability::new();
    let mut copied = Copied {
        slot_entries: Vec::with_capacity(8),
        ring_entries: Vec::with_capacity(8),
        ..Copied::default()
    };
    let mut seen = Vec::new();
    let copy = |durable: &mut Durability, copied: &mut Copied, seen: &mut Vec<i32>| {
        let r = copy_stream(raw, stream, key, seq, snap, own_slot, durable, copied);
        raw.seen(stream, seen, copied.n_seen);
        r
    };
    let mut result = None;
    #[cfg(feature = "lock-stats")]
    let started = super::lock_stats::now();
    // Copies thrown away (statistics: counted once, after the loop).
    #[cfg(feature = "stats")]
    let mut retries = 0u64;
    'tries: for _ in 0..LOCK_FREE_TRIES {
        let mut before = raw.begin_read();
        let mut spins = 0;
        while !before.is_multiple_of(2) {
            if spins == SPINS {
                break 'tries;
            }
            std::hint::spin_loop();
            spins += 1;
            before = raw.begin_read();
        }
        let r = copy(&mut durable, &mut copied, &mut seen);
        if raw.still(before) {
            result = Some(r);
            break;
        }
        #[cfg(feature = "stats")]
        {
            retries += 1;
        }
    }
    #[cfg(feature = "lock-stats")]
    super::lock_stats::record_lock_free(
        super::shmem::lock_stats_area(),
        started,
        result.is_some(),
        copied.slots_visited,
    );
    #[cfg(feature = "stats")]
    if retries > 0 || result.is_none() {
        super::stats::count_reader_slow_path(own_slot, retries, result.is_none());
    }
    let result = match result {
        Some(r) => r,
        None => {
            // Writers kept moving: copy under the lock, shared.
            let _locked = Locked::acquire(Section::View)?;
            copy(&mut durable, &mut copied, &mut seen)
        }
    };
    if result.is_err() {
        return Ok(Err(Stale));
    }
    // Phase 2: decide, from the copy.
    let mut holders = Vec::new();
    // An allocation in flight for the snapshot holds its writer back from
    // its first ID; IDs not yet durable hold back every writer (after a
    // crash or failover they could be handed out again, to anyone), from
    // the first of them: the IDs below `durable_from` were durable before.
    let mut hold = |instance: i32, min_id: i64, in_flight: bool, not_durable_from: Option<i64>| {
        if in_flight {
            holders.push(Holder {
                held_by: if instance == ALL_WRITERS {
                    HeldBy::AllWriters
                } else {
                    HeldBy::Writer(instance)
                },
                min_id,
            });
        }
        if let Some(from) = not_durable_from {
            holders.push(Holder {
                held_by: HeldBy::AllWriters,
                min_id: from.max(min_id),
            });
        }
    };
    for &(a, own, is_hold) in &copied.slot_entries {
        // A hold is in flight until it is released (its shadow entry in the
        // releasing transaction, then in the ring, takes over).
        let ended = !own && !is_hold && sees_end(a.xid);
        // Committed and seen so by the snapshot, but its commit callback,
        // which makes its writer seen, has not run yet (it runs after the
        // commit is visible): the writer is seen for this answer too.
        if ended && a.instance != ALL_WRITERS && !a.ghost && !seen.contains(&a.instance) {
            // SAFETY: asks the commit log about the xid of a transaction
            // that ended; raises no error.
            if unsafe { pg_sys::TransactionIdDidCommit(a.xid) } {
                seen.push(a.instance);
            }
        }
        // A pending entry has not recorded its WAL position, and neither
        // has an allocation running into a complete entry
        // (`allocating_from`): the sequence records its `nextval` calls
        // wrote may not be durable, and nothing says which IDs they cover,
        // so its IDs hold every writer back from its lower bound, whether
        // its transaction runs or has ended (an allocation that failed, its
        // callback not run yet). Held for its own writer only, a reader
        // answered past the IDs it had taken below another writer's for
        // every other writer, and a later reader, once the allocation
        // recorded a WAL position not yet flushed, answered less: positions
        // went back for later snapshots. Its recorded WAL position then
        // holds from `durable_from`, at or above the lower bound.
        let not_durable_from = if a.pending {
            Some(a.min_id)
        } else {
            let recorded = (!durable.covers(a.lsn)).then_some(a.durable_from);
            match a.allocating_from {
                0 => recorded,
                lower => Some(recorded.map_or(lower, |from| from.min(lower))),
            }
        };
        hold(a.instance, a.min_id, !ended, not_durable_from);
    }
    for f in &copied.ring_entries {
        let unseen = !f.aborted && !sees_end(f.xid);
        let not_durable_from = (!durable.covers(f.lsn)).then_some(f.durable_from);
        hold(f.instance, f.min_id, unseen, not_durable_from);
    }
    // A history whose mark is not stored yet: its first allocating
    // transaction may still abort, and a restart would then find its range
    // again from the sequence, up to its new value: nothing of the history
    // is finished before its mark is stored (registry/history.rs).
    if let Some(have) = copied.unrecorded_have {
        holders.push(Holder {
            held_by: HeldBy::AllWriters,
            min_id: have.saturating_add(1),
        });
    }
    let orphans = !copied.orphans.is_empty();
    for &(writer, min_id) in &copied.orphans {
        holders.push(Holder {
            held_by: if writer == ALL_WRITERS {
                HeldBy::AllWriters
            } else {
                HeldBy::Writer(writer)
            },
            min_id,
        });
    }
    if let Some((min_id, stamp, lsn)) = copied.summary {
        if !durable.covers(lsn) || !taken_after(stamp, snap) {
            holders.push(Holder {
                held_by: HeldBy::AllWriters,
                min_id,
            });
        }
    }
    Ok(Ok(StreamView {
        max_allocated: copied.max_allocated,
        holders,
        seen,
        orphans,
    }))
}
