//! Statistics for `streampos.stat_streams` and `streampos.stat_registry`,
//! in shared memory: since start-up (a restart, or a crash, starts them
//! again from zero) or `streampos.stat_reset()`.
//!
//! Nothing here adds a lock or a cache line to the writers' path. What
//! writers count (IDs allocated, commits and rollbacks per stream, ring
//! folds and the ring's peak) is added in `alloc.rs` and `visibility.rs`
//! beside fields the same lock section writes anyway, and only with the
//! cargo feature `stats` (on by default; the benchmark builds without it
//! too, to compare). Readers count their lock-free copies thrown away, and
//! their copies under the lock, in their own backend slot, only on those
//! slow paths. Everything else is written off the writers' path: by the
//! position worker at each pass (`record_pass`), and by followers around
//! their wait (`Following`).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use pgrx::pg_sys;

use super::shmem::{Locked, Section, StreamState, HEADER};
use crate::error::Error;

/// One stream's statistics, as kept in shared memory.
pub struct StreamStats {
    pub key: i32,
    pub seq: pg_sys::Oid,
    pub ids_allocated: u64,
    pub xact_commit: u64,
    pub xact_rollback: u64,
    pub followers: u32,
    /// Since when the position worker has seen the frontier held back
    /// (0: it has not).
    pub held_since: pg_sys::TimestampTz,
    pub last_store: pg_sys::TimestampTz,
    pub current_at: pg_sys::TimestampTz,
    pub reset_at: pg_sys::TimestampTz,
    /// The frontier of the worker's last pass that stored the positions or
    /// found them current (None: no such pass since start-up).
    pub stored_frontier: Option<i64>,
}

/// The statistics of the streams of database `db` that have a state in
/// the registry (used since start-up).
pub fn streams(db: pg_sys::Oid) -> Result<Vec<StreamStats>, Error> {
    let locked = Locked::acquire(Section::OtherShared)?;
    Ok(locked
        .streams()
        .iter()
        .filter(|s| s.in_use && s.loaded && s.db == db)
        .map(|s| StreamStats {
            key: s.key,
            seq: s.seq,
            ids_allocated: s.ids_allocated,
            xact_commit: s.xact_commit,
            xact_rollback: s.xact_rollback,
            followers: s.monitor.followers.load(Ordering::Relaxed),
            held_since: s.monitor.held_since.load(Ordering::Relaxed),
            last_store: s.monitor.last_store.load(Ordering::Relaxed),
            current_at: s.monitor.current_at.load(Ordering::Relaxed),
            reset_at: s.monitor.reset_at.load(Ordering::Relaxed),
            stored_frontier: (s.monitor.last_store.load(Ordering::Acquire) != 0
                || s.monitor.current_at.load(Ordering::Acquire) != 0)
                .then(|| s.monitor.stored_frontier.load(Ordering::Relaxed)),
        })
        .collect())
}

/// The registry's statistics (of every database).
pub struct RegistryStats {
    pub streams_max: u32,
    /// States given to a stream, loaded or not, dropped or not: what
    /// `streampos.max_streams` limits.
    pub streams_used: u32,
    pub streams_loaded: u32,
    /// States of dropped streams not reused yet (they are reused when the
    /// registry is full and nothing refers to them).
    pub streams_dropped: u32,
    pub ring_size: u32,
    pub ring_used: u32,
    pub ring_used_max: u32,
    pub ring_folds: u64,
    pub reader_retries: u64,
    pub reader_fallbacks: u64,
    pub position_workers: u32,
    pub reset_at: pg_sys::TimestampTz,
}

pub fn registry() -> Result<RegistryStats, Error> {
    let locked = Locked::acquire(Section::OtherShared)?;
    let h = locked.h();
    let streams = locked.streams();
    let (mut reader_retries, mut reader_fallbacks) = (0u64, 0u64);
    for header in locked.slot_headers().iter_mut() {
        // SAFETY: the fields are aligned u64s that their backend updates
        // atomically (`count_reader_slow_path`).
        unsafe {
            reader_retries +=
                AtomicU64::from_ptr(&mut header.reader_retries).load(Ordering::Relaxed);
            reader_fallbacks +=
                AtomicU64::from_ptr(&mut header.reader_fallbacks).load(Ordering::Relaxed);
        }
    }
    Ok(RegistryStats {
        streams_max: h.n_streams,
        streams_used: streams.iter().filter(|s| s.in_use).count() as u32,
        streams_loaded: streams
            .iter()
            .filter(|s| s.in_use && s.loaded && !s.dropped)
            .count() as u32,
        streams_dropped: streams.iter().filter(|s| s.in_use && s.dropped).count() as u32,
        ring_size: h.ring_cap,
        ring_used: h.ring_used,
        ring_used_max: h.ring_used_max.max(h.ring_used),
        ring_folds: h.stats.ring_folds,
        reader_retries,
        reader_fallbacks,
        position_workers: h.workers.iter().filter(|w| w.pid > 0).count() as u32,
        reset_at: h.stats.reset_at,
    })
}

/// `streampos.stat_reset()`: the counters of the streams of database `db`,
/// and the registry's (shared by every database), start again from zero.
pub fn reset(db: pg_sys::Oid, now: pg_sys::TimestampTz) -> Result<(), Error> {
    let locked = Locked::acquire(Section::OtherExclusive)?;
    for s in locked
        .streams()
        .iter_mut()
        .filter(|s| s.in_use && s.db == db)
    {
        s.ids_allocated = 0;
        s.xact_commit = 0;
        s.xact_rollback = 0;
        s.monitor.reset_at.store(now, Ordering::Relaxed);
    }
    let h = locked.h();
    h.ring_used_max = h.ring_used;
    h.stats.ring_folds = 0;
    h.stats.reset_at = now;
    for header in locked.slot_headers().iter_mut() {
        // SAFETY: as in `registry`; the swap cannot lose a count its
        // backend adds meanwhile.
        unsafe {
            AtomicU64::from_ptr(&mut header.reader_retries).swap(0, Ordering::Relaxed);
            AtomicU64::from_ptr(&mut header.reader_fallbacks).swap(0, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// A state given to another stream starts its statistics again (under the
/// lock exclusive). The followers' count stays: followers of the state's
/// previous stream may still be waiting on it, and count themselves out.
pub(super) fn reset_stream(s: &mut StreamState) {
    s.ids_allocated = 0;
    s.xact_commit = 0;
    s.xact_rollback = 0;
    let m = &s.monitor;
    for t in [
        &m.held_since,
        &m.last_store,
        &m.current_at,
        &m.reset_at,
        &m.stored_frontier,
    ] {
        t.store(0, Ordering::Relaxed);
    }
}

/// A reader threw `retries` lock-free copies away, and with `fallback`
/// copied under the lock: counted in its own slot (nobody else writes
/// there but `reset`, which swaps).
#[cfg(feature = "stats")]
pub(super) fn count_reader_slow_path(own_slot: Option<usize>, retries: u64, fallback: bool) {
    let Some(slot) = own_slot else {
        return;
    };
    // SAFETY: the registry is initialised (the caller read it) and `slot`
    // is below n_slots (`my_slot_index`); the fields are aligned u64s.
    unsafe {
        let h = &*HEADER;
        let header = ((HEADER as *mut u8).add(h.offsets.slot_headers)
            as *mut super::shmem::SlotHeader)
            .add(slot);
        if retries > 0 {
            AtomicU64::from_ptr(&raw mut (*header).reader_retries)
                .fetch_add(retries, Ordering::Relaxed);
        }
        if fallback {
            AtomicU64::from_ptr(&raw mut (*header).reader_fallbacks)
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What the position worker saw of one stream in a pass.
pub struct PassMark {
    pub index: usize,
    pub key: i32,
    pub seq: pg_sys::Oid,
    /// Since when the frontier is held back (0: it is not).
    pub held_since: pg_sys::TimestampTz,
    /// The pass stored the stream's positions.
    pub stored: bool,
    /// The stored positions are what the pass computed (stored now, or
    /// already).
    pub current: bool,
    /// The frontier the pass computed (internal numbering).
    pub frontier: i64,
}

/// The position worker notes a pass (at `now`), under the lock shared: a
/// state is given to another stream only under the lock exclusive, so a
/// mark never lands on another stream's state.
pub fn record_pass(db: pg_sys::Oid, marks: &[PassMark], now: pg_sys::TimestampTz) {
    let Ok(locked) = Locked::acquire(Section::OtherShared) else {
        return;
    };
    let streams = locked.streams();
    for m in marks {
        let Some(s) = streams.get(m.index) else {
            continue;
        };
        if !(s.in_use && s.db == db && s.key == m.key && s.seq == m.seq) {
            continue;
        }
        let monitor = &s.monitor;
        monitor.held_since.store(m.held_since, Ordering::Relaxed);
        if m.stored || m.current {
            // Before the times (released by their stores): a reader that
            // sees a time sees this pass's frontier or a later one.
            monitor.stored_frontier.store(m.frontier, Ordering::Relaxed);
        }
        if m.stored {
            monitor.last_store.store(now, Ordering::Release);
        }
        if m.current {
            monitor.current_at.store(now, Ordering::Release);
        }
    }
}

thread_local! {
    /// The state whose followers' count this backend is in (for its exit).
    static FOLLOWING: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}
static mut FOLLOWER_EXIT_REGISTERED: bool = false;

/// A follower waiting on a stream (`wait_for`, `updates`): counted in from
/// `enter` until dropped, or until the backend exits (a FATAL, such as
/// `pg_terminate_backend`, runs no destructor).
pub struct Following {
    index: usize,
}

impl Following {
    pub fn enter(index: usize) -> Option<Following> {
        let counter = followers_of(index)?;
        // SAFETY: backend-local flag; before_shmem_exit registers once.
        unsafe {
            if !FOLLOWER_EXIT_REGISTERED {
                pg_sys::before_shmem_exit(Some(follower_exit), pg_sys::Datum::from(0));
                FOLLOWER_EXIT_REGISTERED = true;
            }
        }
        counter.fetch_add(1, Ordering::Relaxed);
        FOLLOWING.with(|f| f.set(Some(index)));
        Some(Following { index })
    }
}

impl Drop for Following {
    fn drop(&mut self) {
        leave(self.index);
    }
}

fn leave(index: usize) {
    if FOLLOWING.with(|f| f.take()).is_none() {
        return;
    }
    if let Some(counter) = followers_of(index) {
        // Never below zero, whatever happened to the state meanwhile.
        let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn follower_exit(_code: i32, _arg: pg_sys::Datum) {
    if let Some(index) = FOLLOWING.with(|f| f.get()) {
        leave(index);
    }
}

/// The followers' counter of state `index`, an atomic in shared memory.
fn followers_of(index: usize) -> Option<&'static AtomicU32> {
    // SAFETY: HEADER is set once at start-up; the index is checked against
    // the number of states; the counter is an atomic that lives as long
    // as shared memory.
    unsafe {
        if HEADER.is_null() || index >= (*HEADER).n_streams as usize {
            return None;
        }
        let states = (HEADER as *mut u8).add((*HEADER).offsets.streams) as *mut StreamState;
        Some(&(*states.add(index)).monitor.followers)
    }
}

/// When this database's position worker was last asked for (by an
/// allocation that found none running), if one runs or is starting.
pub fn worker_requested_at(db: pg_sys::Oid) -> Option<pg_sys::TimestampTz> {
    let locked = Locked::acquire(Section::OtherShared).ok()?;
    locked
        .h()
        .workers
        .iter()
        .find(|w| w.db == db && w.pid != 0)
        .map(|w| w.starting_since)
}
