//! The registry's shared memory: its layout, its creation at server start,
//! and the guard that holds its lock.
//!
//! One `ShmemInitStruct`, sized from settings at start-up:
//! header | stream states | finished ring | backend slot headers | entries.

use std::cell::UnsafeCell;
use std::ffi::CStr;
use std::ptr;
use std::sync::atomic::{fence, AtomicI64, AtomicU32, AtomicU64, Ordering};

use pgrx::pg_sys;
use pgrx::pg_sys::TransactionId;

pub(super) use super::section::Section;
pub(super) use crate::backend::my_proc_number;
use crate::error::Error;
use crate::guc;

const TRANCHE: &CStr = c"streampos";
const SHMEM_NAME: &CStr = c"streampos registry";
/// Writers a stream remembers (since start-up, or with a stored position
/// when it was loaded): tokens list them. The documented limit of writers
/// per stream: an allocation by a writer it would have to forget is
/// refused instead (54000), as a token that drops a writer would send that
/// writer's position back.
pub const SEEN_WRITERS: usize = 1024;
/// Databases with a position worker.
pub const MAX_DATABASES: usize = 64;

#[repr(C)]
pub(super) struct Header {
    pub lock: *mut pg_sys::LWLock,
    /// Where each region starts, computed once at start-up (every lock
    /// section reads several).
    pub offsets: Layout,
    pub n_streams: u32,
    pub ring_cap: u32,
    pub n_slots: u32,
    /// Entries of a transaction per backend slot...
    pub per_slot: u32,
    /// ...followed by the entries of the session's holds (`hold_ids`).
    pub per_session: u32,
    /// The finished ring is a FIFO in push order: `ring_head` is the
    /// oldest entry, `ring_used` the number of entries.
    pub ring_head: u32,
    pub ring_used: u32,
    /// How many backend slots hold entries: the first `n_active` of the
    /// active list. Readers visit only those, so their work does not grow
    /// with `max_connections`.
    pub n_active: u32,
    /// The highest `lsn` ever pushed (for `Finished::lsn_prefix_max`).
    pub ring_lsn_max: u64,
    /// The history this server's IDs belong to (see `history.rs`; 0: never
    /// in doubt), and whether it started recovering and no promotion was
    /// recorded yet.
    pub history_id: u64,
    pub history_recovering: bool,
    /// The most entries the finished ring held at once since start-up or
    /// `stat_reset()` (in the padding after `history_recovering`: the
    /// fields after it keep their places). Written by `ring_push` only
    /// when it grows.
    pub ring_used_max: u32,
    /// The highest durable WAL position ever seen (see
    /// `visibility::durable_lsn`): what was final stays final when
    /// synchronous standbys are configured later.
    pub durable_high_water: AtomicU64,
    /// A sequence counter (seqlock) that lets readers copy what they need
    /// without the lock: odd while an exclusive section that moves or
    /// removes what readers copy runs, and moved by every such section. See
    /// `Raw` and `Section::moves_entries`.
    pub changes: AtomicU64,
    pub catalog: CatalogSync,
    pub workers: [WorkerSlot; MAX_DATABASES],
    /// Statistics of the whole registry (see `stats.rs`).
    pub stats: RegistryStats,
    /// The next full xid when the first transaction of this start ended
    /// (0: none yet), above every xid a transaction that outlived the
    /// start (a prepared one) can have: see `start_xid`.
    pub start_xid: AtomicU64,
    /// A hot standby's followers, woken by replay (`wait.rs`).
    pub replay: ReplayWake,
}

/// Buckets of `ReplayWake` (a follower looks at its stream's only).
pub const REPLAY_BUCKETS: usize = 64;

/// What wakes a hot standby's followers: the position worker of the
/// primary writes a WAL record after each commit that stored positions
/// (`replay.rs`); its replay bumps the bucket of each stream it names and
/// broadcasts. Followers sleep on the one condition variable and read
/// again only when their stream's bucket moved.
#[repr(C)]
pub(super) struct ReplayWake {
    pub cv: pg_sys::ConditionVariable,
    /// Records replayed since start-up (0: none: the primary sends none).
    pub records: AtomicU64,
    pub buckets: [AtomicU64; REPLAY_BUCKETS],
}

/// What the registry counts for `streampos.stat_registry`, beyond what it
/// keeps anyway (`ring_used`, `ring_used_max` in the header): since
/// start-up or `stat_reset()`.
#[repr(C)]
pub(super) struct RegistryStats {
    /// Ring entries folded into their stream's summary (the ring was
    /// full). Written where the fold is, under the lock.
    pub ring_folds: u64,
    /// When `stat_reset()` last ran (0: never since start-up).
    pub reset_at: pg_sys::TimestampTz,
}

/// Catalog-changing transactions remembered by xid (see `CatalogState`).
pub const RECENT_CATALOG_CHANGES: usize = 16;

/// What backends share about the stream catalog (see `catalog.rs`, its only
/// user), behind a spinlock of its own: it is read on every catalog lookup
/// and held for a few dozen instructions, never across a call that can fail.
#[repr(C)]
pub struct CatalogSync {
    lock: AtomicU32,
    /// A seqlock over `state` for `read` (odd while `with` runs): every
    /// catalog lookup reads the state, and readers that only load leave the
    /// cache line shared, where the spinlock would make each of them write it.
    version: AtomicU64,
    state: UnsafeCell<CatalogState>,
}

/// See `catalog.rs`, "Which snapshots may use the cache".
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CatalogState {
    /// Moves when a catalog-changing transaction starts committing and
    /// again when it has ended: cached rows of an older generation are
    /// dropped.
    pub generation: u64,
    /// Catalog-changing transactions between their pre-commit and the end
    /// of their commit (or abort): while any is, nobody uses the cache.
    pub committing: u32,
    /// The top xids of the latest catalog-changing commits, a ring written
    /// at `recent_pushed % RECENT_CATALOG_CHANGES`.
    pub recent: [u32; RECENT_CATALOG_CHANGES],
    pub recent_pushed: u64,
    /// The newest xid that fell out of `recent` (0: none yet).
    pub evicted: u32,
}

// SAFETY: the state is only touched under `lock`, by `with`.
unsafe impl Sync for CatalogSync {}

impl CatalogSync {
    /// Run `f` on the state under the spinlock. `f` must not fail or panic
    /// (it copies or adds a few fields).
    pub fn with<R>(&self, f: impl FnOnce(&mut CatalogState) -> R) -> R {
        while self
            .lock
            .compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
        let version = self.version.load(Ordering::Relaxed);
        self.version.store(version + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        // SAFETY: the spinlock is held; shared memory lives as long as the
        // process.
        let value = f(unsafe { &mut *self.state.get() });
        self.version.store(version + 2, Ordering::Release);
        self.lock.store(0, Ordering::Release);
        value
    }

    /// A copy of the state, without writing anything shared: a seqlock
    /// read, tried until no `with` ran meanwhile (`with` is short and rare:
    /// catalog changes only).
    pub fn read(&self) -> CatalogState {
        loop {
            let before = self.version.load(Ordering::Acquire);
            if before.is_multiple_of(2) {
                // SAFETY: the state holds integers only, any bit pattern
                // is valid; a copy torn by a concurrent `with` is thrown
                // away below.
                let copy = unsafe { std::ptr::read_volatile(self.state.get()) };
                fence(Ordering::Acquire);
                if self.version.load(Ordering::Relaxed) == before {
                    return copy;
                }
            }
            std::hint::spin_loop();
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct WorkerSlot {
    pub db: pg_sys::Oid,
    /// 0: free; -1: being started; otherwise the worker's pid.
    pub pid: i32,
    pub latch: *mut pg_sys::Latch,
    /// When a start was asked for (a start that never claims the slot is
    /// given up after a while).
    pub starting_since: pg_sys::TimestampTz,
}

/// What a stream keeps of the finished entries the ring had to let go
/// (folded, oldest first, when the ring is full).
#[repr(C)]
pub(super) struct Summary {
    pub valid: bool,
    /// The lowest ID of any folded entry: a snapshot that may not see every
    /// folded entry treats the summary as in flight from here, for every
    /// writer.
    pub min_id: i64,
    /// The highest `latest_completed` of any folded entry: a snapshot whose
    /// xmax is past it + 1 was taken after every folded entry was pushed, so
    /// it sees them all (see `visibility.rs`).
    pub latest_completed: TransactionId,
    /// The highest xid folded: once it precedes every snapshot's xmin, the
    /// summary is seen by all and is dropped.
    pub max_xid: TransactionId,
    /// The highest WAL position the folded allocations need durable.
    pub lsn: u64,
}

/// One stream's state. Not `Copy`: it holds a condition variable that other
/// processes may be waiting on, which must never be moved or overwritten.
///
/// Aligned to a cache line, whose first 64 bytes hold what a writer writes
/// on every allocation and commit: the identity, `max_allocated`,
/// `generation`, and the statistics counted beside them (no cache line more
/// for a writer, see docs/design.md, "Statistics").
#[repr(C, align(64))]
pub(super) struct StreamState {
    pub in_use: bool,
    pub loaded: bool,
    pub dropped: bool,
    /// The transaction that dropped the stream (invalid once every
    /// snapshot sees the drop, or when none can miss it): until then a
    /// snapshot may still see the stream and ask about it, so its state is
    /// not given to another stream.
    pub dropped_by: TransactionId,
    pub db: pg_sys::Oid,
    pub key: i32,
    /// The stream's sequence: a state matches a stream only with the same
    /// (database, key, sequence), so a stream key reused after the
    /// extension was dropped and created again starts from a fresh state.
    pub seq: pg_sys::Oid,
    pub max_allocated: i64,
    /// IDs handed out (`finish_allocation`, under the lock, beside
    /// `max_allocated`).
    pub ids_allocated: u64,
    /// Bumped every time an allocation of this stream finishes.
    pub generation: u64,
    /// Transactions that allocated IDs of the stream (or took a hold) and
    /// committed / rolled back (`end_transaction`, beside `generation`).
    pub xact_commit: u64,
    pub xact_rollback: u64,
    /// Broadcast when the generation moves; followers sleep on it.
    pub cv: pg_sys::ConditionVariable,
    pub summary: Summary,
    /// Writers that committed IDs since start-up (or had a stored position
    /// when the stream was loaded): tokens list them. Sorted, the first
    /// `n_seen`.
    pub n_seen: u32,
    pub seen: [i32; SEEN_WRITERS],
    /// Holds of sessions that ended without releasing them.
    pub orphans: Orphans,
    /// What of the stream's IDs another history may have handed out (see
    /// `history.rs`).
    pub lost: Lost,
    /// What the position worker and followers note for the statistics, on
    /// lines no writer touches.
    pub monitor: Monitor,
}

/// A stream's statistics that are not counted on the writers' path: the
/// position worker writes the times at each pass (under the registry lock
/// shared: a state is only reset for another stream under the lock
/// exclusive), followers count themselves around their wait. Since
/// start-up, or since the state was given to the stream.
#[repr(C)]
pub(super) struct Monitor {
    /// Since when the frontier has not moved while IDs above it were
    /// allocated, as the position worker saw it (0: not held back).
    pub held_since: AtomicI64,
    /// The worker's last store of the stream's positions (0: none).
    pub last_store: AtomicI64,
    /// The worker's last pass that left the stored positions equal to the
    /// ones it computed (0: none).
    pub current_at: AtomicI64,
    /// The frontier (internal numbering) of the worker's last pass that
    /// stored the positions or found them current: never above the stored
    /// frontier (the store's later statement may store a higher one).
    /// Meaningful once `last_store` or `current_at` is set; `stat_streams`
    /// shows it while `stream_frontiers` is locked.
    pub stored_frontier: AtomicI64,
    /// Backends sleeping in `wait_for` or `updates` on the stream.
    pub followers: AtomicU32,
    /// When `stat_reset()` last reset the stream's counters (0: never).
    pub reset_at: AtomicI64,
}

/// Lost ranges a stream keeps (see `Lost`).
pub const LOST_RANGES: usize = 8;

/// What of a stream's IDs histories this server lost may have handed out:
/// the ranges (have, ceiling] of the marks of every earlier history in its
/// past (they replicate, so a standby of a promoted standby inherits them),
/// and the current history's mark.
#[repr(C)]
pub(super) struct Lost {
    /// Earlier histories' ranges in use, lowest first. More marks than
    /// `LOST_RANGES`: the lowest ranges are merged (a follower in between
    /// resynchronises needlessly, never wrongly).
    pub n: u32,
    pub ranges: [(i64, i64); LOST_RANGES],
    /// The current history's mark (have, ceiling), when there is a history
    /// in doubt, and whether it is in `streampos.history_marks`. Until it
    /// is, readers never pass `have` (lock-free readers copy these).
    pub mark_valid: bool,
    pub mark_have: i64,
    pub mark_ceiling: i64,
    pub recorded: bool,
}

impl Lost {
    pub fn mark(&self) -> Option<(i64, i64)> {
        self.mark_valid
            .then_some((self.mark_have, self.mark_ceiling))
    }

    pub fn set_mark(&mut self, mark: Option<(i64, i64)>) {
        self.mark_valid = mark.is_some();
        if let Some((have, ceiling)) = mark {
            self.mark_have = have;
            self.mark_ceiling = ceiling;
        }
    }
}

/// Writers an orphan record keeps apart (see `Orphans`).
pub const ORPHAN_WRITERS: usize = 16;

/// The holds of sessions that ended without releasing them, one record per
/// stream: each holds its writer back from its lowest ID (the holds of one
/// writer folded together) until the position worker has seen every
/// transaction that was running when they were orphaned end, and released
/// them in a transaction of its own (a reader sees them finished only once
/// it sees that transaction's commit, which came after every such
/// transaction: it sees their rows). Beyond `ORPHAN_WRITERS` writers, the
/// rest are folded into one part that holds every writer back (later
/// snapshots may then answer less for other writers, never miss a row).
#[repr(C)]
pub(super) struct Orphans {
    pub valid: bool,
    pub n: u32,
    /// (writer, lowest ID, highest WAL position the IDs need durable).
    pub writers: [(i32, i64, u64); ORPHAN_WRITERS],
    pub all_valid: bool,
    pub all_min_id: i64,
    pub all_lsn: u64,
    /// Moves at every orphaning: the worker releases only what it waited
    /// for.
    pub epoch: u64,
}

impl Orphans {
    /// Fold an orphaned hold of `writer` in.
    pub fn fold(&mut self, writer: i32, min_id: i64, lsn: u64) {
        let n = (self.n as usize).min(ORPHAN_WRITERS);
        if let Some(w) = self.writers[..n].iter_mut().find(|w| w.0 == writer) {
            w.1 = w.1.min(min_id);
            w.2 = w.2.max(lsn);
        } else if n < ORPHAN_WRITERS {
            self.writers[n] = (writer, min_id, lsn);
            self.n = n as u32 + 1;
        } else if self.all_valid {
            self.all_min_id = self.all_min_id.min(min_id);
            self.all_lsn = self.all_lsn.max(lsn);
        } else {
            self.all_valid = true;
            self.all_min_id = min_id;
            self.all_lsn = lsn;
        }
        self.valid = true;
        self.epoch += 1;
    }

    pub fn clear(&mut self) {
        self.valid = false;
        self.n = 0;
        self.all_valid = false;
    }

    /// The parts: (writer or ALL_WRITERS, lowest ID, WAL position).
    pub fn parts(&self) -> impl Iterator<Item = (i32, i64, u64)> + '_ {
        let n = (self.n as usize).min(ORPHAN_WRITERS);
        self.writers[..n]
            .iter()
            .copied()
            .chain(
                self.all_valid
                    .then_some((ALL_WRITERS, self.all_min_id, self.all_lsn)),
            )
    }
}

/// A finished allocation kept for snapshots that may not see its end yet.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Finished {
    pub stream: i32,
    pub instance: i32,
    pub xid: TransactionId,
    /// `latestCompletedXid` when the entry was pushed, read under the
    /// registry lock: a snapshot whose xmax is past it + 1 was taken after
    /// the push, so it sees this entry and every older one.
    pub latest_completed: TransactionId,
    pub min_id: i64,
    /// IDs from here on need `lsn` durable; the ones below already were
    /// (see `Active::durable_from`).
    pub durable_from: i64,
    /// The WAL position the IDs from `durable_from` on need durable (see
    /// `Active::lsn`).
    pub lsn: u64,
    /// The highest `lsn` of this entry and every entry pushed before it:
    /// once durable, nothing older needs a durability check.
    pub lsn_prefix_max: u64,
    /// Aborted: kept only until `lsn` is durable.
    pub aborted: bool,
}

/// Longest instance name kept in a slot (names are 1 to 63 bytes).
pub(super) const NAME_BYTES: usize = 64;

/// One backend's allocations in its current transaction, per (stream, writer).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Active {
    /// Index into the stream states; -1 when free.
    pub stream: i32,
    pub instance: i32,
    /// While `pending`, a lower bound published before `nextval` ran.
    pub min_id: i64,
    pub max_id: i64,
    pub count: i64,
    pub xid: TransactionId,
    pub pending: bool,
    pub since: pg_sys::TimestampTz,
    /// The end of the WAL record that made the sequence hand out the IDs
    /// from `durable_from` on. Until it is durable (flushed, and confirmed
    /// by synchronous standbys when there are any), a crash or a failover
    /// could roll the sequence back below these IDs and hand them out again,
    /// to any writer: so until then they hold back every writer, whatever
    /// becomes of the transaction.
    pub lsn: u64,
    /// The IDs below it were durable when a later allocation of the
    /// transaction needed a newer WAL record (`finish_allocation` makes
    /// sure of it first): durability is per allocation, so an allocation
    /// after a CHECKPOINT or past the sequence's logged-ahead values never
    /// makes IDs already durable hold every writer back again.
    pub durable_from: i64,
    /// While a later allocation of the transaction runs `nextval` for this
    /// (complete) entry: that call's lower bound; 0 otherwise. The sequence
    /// records those calls write are recorded nowhere until
    /// `finish_allocation` stores the WAL position, so until then the new
    /// IDs hold every writer back from here, as a pending entry's do
    /// (`visibility::view`).
    pub allocating_from: i64,
    /// This entry holds a place in its stream's `seen` (its writer was not
    /// there when it was created).
    pub reserved_seen: bool,
    /// A hold (session entry) whose taking transaction committed: it now
    /// outlives transactions. Until then, an abort abandons it.
    pub confirmed: bool,
    /// A hold that `release_ids` released in the running transaction: it
    /// goes at that transaction's commit (its shadow entry, with the
    /// transaction's xid, takes over in the finished ring), and stays if
    /// the transaction, or `release_subxact`, aborts.
    pub releasing: bool,
    pub release_subxact: pg_sys::SubTransactionId,
    /// A transaction entry standing in for a hold this transaction
    /// releases: finished at commit like the transaction's own IDs, dropped
    /// at abort (the hold goes on holding).
    pub shadow: bool,
    /// Its instance was created by a savepoint that rolled back: the id is
    /// gone (until the name is created again, `rename_entries`), and is
    /// never remembered among the stream's writers.
    pub ghost: bool,
    /// The instance's name (NUL-padded), for `in_flight()`: a name created
    /// by this still-running transaction is not in any other snapshot.
    pub name: [u8; NAME_BYTES],
}

pub(super) const FREE_ACTIVE: Active = Active {
    stream: -1,
    instance: 0,
    min_id: 0,
    max_id: 0,
    count: 0,
    xid: TransactionId::INVALID,
    pending: false,
    since: 0,
    lsn: 0,
    durable_from: 0,
    allocating_from: 0,
    reserved_seen: false,
    confirmed: false,
    releasing: false,
    release_subxact: 0,
    shadow: false,
    ghost: false,
    name: [0; NAME_BYTES],
};

/// The instance of an entry that holds back every writer (a part of
/// orphaned holds, see `Orphans`): instance ids are positive.
pub const ALL_WRITERS: i32 = 0;

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct SlotHeader {
    pub pid: i32,
    pub db: pg_sys::Oid,
    /// The role the backend allocated as (for `in_flight()`'s privacy).
    pub role: pg_sys::Oid,
    pub used: u32,
    /// Session entries in use (holds), the first `held`.
    pub held: u32,
    /// While `used > 0` or `held > 0`: this slot's place in the active list.
    pub active_at: u32,
    /// Lock-free copies this slot's backends threw away (a writer's section
    /// ran meanwhile), and copies they made under the lock instead after
    /// too many: counted by the slot's own backend, without the lock
    /// (`AtomicU64::from_ptr`), only on those slow paths.
    pub reader_retries: u64,
    pub reader_fallbacks: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Layout {
    pub streams: usize,
    pub ring: usize,
    pub slot_headers: usize,
    pub active: usize,
    pub entries: usize,
    #[cfg(feature = "lock-stats")]
    pub lock_stats: usize,
    pub total: usize,
}

fn align8(n: usize) -> usize {
    (n + 7) & !7
}

fn align64(n: usize) -> usize {
    (n + 63) & !63
}

pub(super) fn layout(
    n_streams: usize,
    ring_cap: usize,
    n_slots: usize,
    per_slot: usize,
    per_session: usize,
) -> Layout {
    // Stream states are aligned to cache lines (the area itself starts on
    // one: PostgreSQL aligns shared memory allocations to
    // PG_CACHE_LINE_SIZE).
    let streams = align64(size_of::<Header>());
    let ring = streams + align8(n_streams * size_of::<StreamState>());
    let slot_headers = ring + align8(ring_cap * size_of::<Finished>());
    let active = slot_headers + align8(n_slots * size_of::<SlotHeader>());
    let entries = active + align8(n_slots * size_of::<u32>());
    let total = entries + align8(n_slots * (per_slot + per_session) * size_of::<Active>());
    #[cfg(feature = "lock-stats")]
    let (lock_stats, total) = (total, total + super::lock_stats::bytes(n_slots));
    Layout {
        streams,
        ring,
        slot_headers,
        active,
        entries,
        #[cfg(feature = "lock-stats")]
        lock_stats,
        total,
    }
}

pub(super) static mut HEADER: *mut Header = ptr::null_mut();

/// Where the lock statistics of the registry at `header` are.
///
/// # Safety
/// `header` is an initialised registry.
#[cfg(feature = "lock-stats")]
unsafe fn lock_stats_area_of(header: *mut Header) -> super::lock_stats::Area {
    // SAFETY: forwarded from the caller.
    unsafe {
        super::lock_stats::Area {
            base: header as *mut u8,
            offset: (*header).offsets.lock_stats,
            n_slots: (*header).n_slots as usize,
        }
    }
}

/// The lock statistics of this process's registry, once it is attached.
#[cfg(feature = "lock-stats")]
pub(super) fn lock_stats_area() -> Option<super::lock_stats::Area> {
    // SAFETY: HEADER is set once per process at start-up, to an
    // initialised registry.
    unsafe { (!HEADER.is_null()).then(|| lock_stats_area_of(HEADER)) }
}
#[cfg(not(feature = "pg14"))]
static mut PREV_SHMEM_REQUEST: pg_sys::shmem_request_hook_type = None;
static mut PREV_SHMEM_STARTUP: pg_sys::shmem_startup_hook_type = None;

/// Which history the start begins or continues (`history::at_start`,
/// passed down by `registry::request_shared_memory`: the layout does not
/// call up into the files built on it).
static mut HISTORY_AT_START: Option<HistoryAtStart> = None;

/// (history id, still recovering), or None: see `history::at_start`.
pub(super) type HistoryAtStart = fn() -> Option<(u64, bool)>;

/// The finished ring holds at least one entry more than every backend can
/// push at its transaction's end together (its entries, or the parts of
/// one orphan record the position worker releases): the summary's rule
/// (see `visibility.rs`) relies on it.
fn ring_capacity(n_slots: usize, per_slot: usize) -> usize {
    (guc::FINISHED_RING_SIZE.get() as usize).max(n_slots * per_slot.max(ORPHAN_WRITERS + 1) + 1)
}

fn slot_count() -> usize {
    // Every regular backend and background worker has a PGPROC below
    // MaxBackends; only they can run SQL.
    // SAFETY: MaxBackends is set by the postmaster before shared memory is
    // sized, and never changes afterwards.
    #[cfg(not(feature = "pg14"))]
    return unsafe { pg_sys::MaxBackends.max(1) as usize };
    // PostgreSQL 14 sets MaxBackends only after loading the preloaded
    // libraries, which request their shared memory while loaded: until
    // then, the sum its InitializeMaxBackends makes of the settings, which
    // are final by then.
    // SAFETY: settings read in the postmaster after the configuration file.
    #[cfg(feature = "pg14")]
    return unsafe {
        if pg_sys::MaxBackends > 0 {
            pg_sys::MaxBackends as usize
        } else {
            (pg_sys::MaxConnections
                + crate::ffi::autovacuum_max_workers
                + 1
                + pg_sys::max_worker_processes
                + pg_sys::max_wal_senders)
                .max(1) as usize
        }
    };
}

/// Called from `_PG_init` while the library is preloaded.
/// Install the hooks that create the registry; `history_at_start` says,
/// when it is created, which history the start begins or continues.
pub(super) fn request_shared_memory(history_at_start: HistoryAtStart) {
    // SAFETY: hooks are installed once, in the postmaster, before any
    // backend exists; the previous hooks are chained.
    unsafe {
        HISTORY_AT_START = Some(history_at_start);
        #[cfg(not(feature = "pg14"))]
        {
            PREV_SHMEM_REQUEST = pg_sys::shmem_request_hook;
            pg_sys::shmem_request_hook = Some(shmem_request);
        }
        PREV_SHMEM_STARTUP = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(shmem_startup);
        // PostgreSQL 14 has no shmem_request_hook: a preloaded library
        // requests while it is loaded.
        #[cfg(feature = "pg14")]
        shmem_request();
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_request() {
    // SAFETY: called by the postmaster in shmem_request_hook (PostgreSQL
    // 14: from _PG_init while preloading), the only place where add-in
    // shared memory and LWLock tranches may be requested.
    unsafe {
        #[cfg(not(feature = "pg14"))]
        if let Some(prev) = PREV_SHMEM_REQUEST {
            prev();
        }
        let per_slot = guc::MAX_STREAMS_PER_TRANSACTION.get() as usize;
        let l = layout(
            guc::MAX_STREAMS.get() as usize,
            ring_capacity(slot_count(), per_slot),
            slot_count(),
            per_slot,
            guc::MAX_HELD_PER_SESSION.get() as usize,
        );
        pg_sys::RequestAddinShmemSpace(l.total);
        pg_sys::RequestNamedLWLockTranche(TRANCHE.as_ptr(), 1);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_startup() {
    // SAFETY: called in every process attaching to shared memory (postmaster
    // and, under EXEC_BACKEND, each backend). The area is initialised once,
    // under AddinShmemInitLock, by whoever creates it; it is zeroed first, so
    // every field starts from a valid bit pattern.
    unsafe {
        if let Some(prev) = PREV_SHMEM_STARTUP {
            prev();
        }
        let n_streams = guc::MAX_STREAMS.get() as usize;
        let n_slots = slot_count();
        let per_slot = guc::MAX_STREAMS_PER_TRANSACTION.get() as usize;
        let per_session = guc::MAX_HELD_PER_SESSION.get() as usize;
        let ring_cap = ring_capacity(n_slots, per_slot);
        let l = layout(n_streams, ring_cap, n_slots, per_slot, per_session);

        // AddinShmemInitLock is MainLWLockArray[21] (lwlocknames.txt).
        let addin_shmem_init_lock = &raw mut (*pg_sys::MainLWLockArray.add(21)).lock;
        pg_sys::LWLockAcquire(addin_shmem_init_lock, pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let base = pg_sys::ShmemInitStruct(SHMEM_NAME.as_ptr(), l.total, &mut found) as *mut u8;
        debug_assert!(
            (base as usize).is_multiple_of(64),
            "shared memory not on a cache line"
        );
        if !found {
            ptr::write_bytes(base, 0, l.total);
            let header = base as *mut Header;
            (*header).lock = &mut (*pg_sys::GetNamedLWLockTranche(TRANCHE.as_ptr())).lock;
            let streams = base.add(l.streams) as *mut StreamState;
            for i in 0..n_streams {
                pg_sys::ConditionVariableInit(&mut (*streams.add(i)).cv);
            }
            pg_sys::ConditionVariableInit(&mut (*header).replay.cv);
            (*header).offsets = l;
            (*header).n_streams = n_streams as u32;
            (*header).ring_cap = ring_cap as u32;
            (*header).n_slots = n_slots as u32;
            (*header).per_slot = per_slot as u32;
            (*header).per_session = per_session as u32;
            let history = HISTORY_AT_START.and_then(|at_start| at_start());
            (*header).history_id = history.map_or(0, |h| h.0);
            (*header).history_recovering = history.is_some_and(|h| h.1);
            let entries = base.add(l.entries) as *mut Active;
            for i in 0..n_slots * (per_slot + per_session) {
                entries.add(i).write(FREE_ACTIVE);
            }
        }
        HEADER = base as *mut Header;
        pg_sys::LWLockRelease(addin_shmem_init_lock);
    }
}

/// A view of the registry while its lock is held. Dropping it releases the
/// lock, so an ERROR raised while it is alive cannot leave the lock held
/// (PostgreSQL also releases LWLocks on abort).
pub(super) struct Locked {
    header: *mut Header,
    /// Moves the seqlock counter (`Section::moves_entries`).
    moves_entries: bool,
    #[cfg(feature = "lock-stats")]
    timing: super::lock_stats::Timing,
}

// The accessors hand out `&mut` views of shared memory from `&self`: the
// memory belongs to no Rust owner, the LWLock this guard holds is what makes
// access exclusive, each accessor covers a disjoint region, and no caller
// keeps two views of the same region alive at once.
#[allow(clippy::mut_from_ref)]
impl Locked {
    pub fn acquire(section: Section) -> Result<Locked, Error> {
        // SAFETY: HEADER is written once per process at shared memory
        // start-up, before any SQL can run.
        let header = unsafe { HEADER };
        if header.is_null() {
            return Err(Error::NotLoaded);
        }
        // SAFETY: a non-null HEADER is the initialised registry.
        Ok(unsafe { Self::acquire_raw(header, section) })
    }

    /// # Safety
    /// `header` must be the initialised registry.
    pub unsafe fn acquire_raw(header: *mut Header, section: Section) -> Locked {
        let mode = if section.exclusive() {
            pg_sys::LWLockMode::LW_EXCLUSIVE
        } else {
            pg_sys::LWLockMode::LW_SHARED
        };
        #[cfg(feature = "lock-stats")]
        let asked = super::lock_stats::now();
        // SAFETY: the caller guarantees `header` is initialised, so its lock
        // points into the named tranche; LWLockAcquire raises no ERROR here
        // (see `ffi::unguarded`).
        unsafe { crate::ffi::unguarded::LWLockAcquire((*header).lock, mode) };
        let moves_entries = section.moves_entries();
        if moves_entries {
            // SAFETY: as above; only the holder of the exclusive lock writes
            // the counter.
            let changes = unsafe { &(*header).changes };
            changes.store(changes.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            // The odd value is visible before anything this section writes.
            fence(Ordering::Release);
        }
        Locked {
            header,
            moves_entries,
            #[cfg(feature = "lock-stats")]
            timing: super::lock_stats::Timing::acquired(section, asked),
        }
    }

    pub fn h(&self) -> &mut Header {
        // SAFETY: the header is initialised and this guard holds its lock.
        unsafe { &mut *self.header }
    }

    fn base(&self) -> *mut u8 {
        self.header as *mut u8
    }

    fn layout(&self) -> &Layout {
        &self.h().offsets
    }

    pub fn streams(&self) -> &mut [StreamState] {
        let n = self.h().n_streams as usize;
        // SAFETY: the layout places `n_streams` initialised stream states at
        // this offset inside the area; the lock is held.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.base().add(self.layout().streams) as *mut StreamState,
                n,
            )
        }
    }

    pub fn ring(&self) -> &mut [Finished] {
        let n = self.h().ring_cap as usize;
        // SAFETY: as for `streams`, for the `ring_cap` ring entries.
        unsafe {
            std::slice::from_raw_parts_mut(self.base().add(self.layout().ring) as *mut Finished, n)
        }
    }

    /// The slots that hold entries (the first `n_active` of the active
    /// list), in no particular order.
    pub fn active_slots(&self) -> &[u32] {
        let n = self.h().n_active as usize;
        // SAFETY: as for `streams`, for the first `n_active` (at most
        // `n_slots`) entries of the active list.
        unsafe {
            std::slice::from_raw_parts(self.base().add(self.layout().active) as *const u32, n)
        }
    }

    /// Add slot `index` to the active list (its first entry was created):
    /// appended, and counted only once written, for lock-free readers.
    pub fn activate_slot(&self, index: usize) {
        let h = self.h();
        let at = h.n_active as usize;
        // SAFETY: at most `n_slots` slots are active, so `at < n_slots`:
        // inside the active list.
        unsafe { *(self.base().add(self.layout().active) as *mut u32).add(at) = index as u32 };
        self.slot_headers()[index].active_at = at as u32;
        publish(&mut h.n_active, at as u32 + 1);
    }

    /// Remove slot `index` from the active list (its entries are gone):
    /// the last active slot takes its place.
    pub fn deactivate_slot(&self, index: usize) {
        let h = self.h();
        let at = self.slot_headers()[index].active_at as usize;
        let last = h.n_active as usize - 1;
        // SAFETY: `at` and `last` are below `n_active`, inside the list.
        unsafe {
            let list = self.base().add(self.layout().active) as *mut u32;
            let moved = *list.add(last);
            *list.add(at) = moved;
            self.slot_headers()[moved as usize].active_at = at as u32;
        }
        h.n_active -= 1;
    }

    pub fn slot_headers(&self) -> &mut [SlotHeader] {
        let n = self.h().n_slots as usize;
        // SAFETY: as for `streams`, for the `n_slots` slot headers.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.base().add(self.layout().slot_headers) as *mut SlotHeader,
                n,
            )
        }
    }

    /// The entries of backend slot `index` that hold something: a
    /// transaction's entries are created one after the other and all freed
    /// at its end, so they are the first `used`.
    pub fn entries_in_use(&self, index: usize) -> &mut [Active] {
        let used = self.slot_headers()[index].used as usize;
        &mut self.slot(index)[..used]
    }

    /// The transaction entries of backend slot `index` (< `n_slots`).
    pub fn slot(&self, index: usize) -> &mut [Active] {
        let (per, session) = (self.h().per_slot as usize, self.h().per_session as usize);
        debug_assert!(index < self.h().n_slots as usize, "slot index out of range");
        // SAFETY: each slot has `per_slot + per_session` initialised
        // `Active`s; callers pass their own or a scanned index, below
        // `n_slots`.
        unsafe {
            let entries = self.base().add(self.layout().entries) as *mut Active;
            std::slice::from_raw_parts_mut(entries.add(index * (per + session)), per)
        }
    }

    /// The session entries (holds) of backend slot `index` (< `n_slots`).
    pub fn session_slot(&self, index: usize) -> &mut [Active] {
        let (per, session) = (self.h().per_slot as usize, self.h().per_session as usize);
        debug_assert!(index < self.h().n_slots as usize, "slot index out of range");
        // SAFETY: as in `slot`, for the entries after the first `per_slot`.
        unsafe {
            let entries = self.base().add(self.layout().entries) as *mut Active;
            std::slice::from_raw_parts_mut(entries.add(index * (per + session) + per), session)
        }
    }

    /// The holds of backend slot `index`: the first `held` session entries.
    pub fn holds_in_use(&self, index: usize) -> &mut [Active] {
        let held = self.slot_headers()[index].held as usize;
        &mut self.session_slot(index)[..held]
    }

    /// Keep slot `index` in the active list exactly while it has entries
    /// or holds (after its counts changed).
    pub fn update_active(&self, index: usize, was_active: bool) {
        let header = &self.slot_headers()[index];
        let active = header.used > 0 || header.held > 0;
        if active && !was_active {
            self.activate_slot(index);
        } else if !active && was_active {
            self.deactivate_slot(index);
        }
    }
}

impl StreamState {
    pub fn has_seen(&self, instance: i32) -> bool {
        self.seen[..(self.n_seen as usize).min(SEEN_WRITERS)]
            .binary_search(&instance)
            .is_ok()
    }

    /// Remember `instance` as a writer of the stream, in order; false when
    /// there is no room.
    pub fn add_seen(&mut self, instance: i32) -> bool {
        let n = (self.n_seen as usize).min(SEEN_WRITERS);
        match self.seen[..n].binary_search(&instance) {
            Ok(_) => true,
            Err(_) if n == SEEN_WRITERS => false,
            Err(at) => {
                self.seen.copy_within(at..n, at + 1);
                self.seen[at] = instance;
                self.n_seen = n as u32 + 1;
                true
            }
        }
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        if self.moves_entries {
            let changes = &self.h().changes;
            // Even again, after everything this section wrote.
            changes.store(changes.load(Ordering::Relaxed) + 1, Ordering::Release);
        }
        #[cfg(feature = "lock-stats")]
        let held = self.timing.held_ns();
        // SAFETY: this guard acquired the lock of an initialised header;
        // LWLockRelease raises no ERROR for a lock held (`ffi::unguarded`).
        unsafe { crate::ffi::unguarded::LWLockRelease((*self.header).lock) };
        #[cfg(feature = "lock-stats")]
        // SAFETY: the layout has the statistics when the feature is on.
        unsafe {
            super::lock_stats::record(lock_stats_area_of(self.header), &self.timing, held)
        };
    }
}

/// Make `value` visible in `field` only after everything written before:
/// how exclusive sections that do not move the seqlock counter publish what
/// lock-free readers may copy (see `Section::moves_entries`).
pub(super) fn publish<T: Copy>(field: &mut T, value: T) {
    fence(Ordering::Release);
    // SAFETY: a valid, exclusive reference.
    unsafe { ptr::write_volatile(field, value) };
}

/// Read-only access to the registry without its lock, for readers (see
/// `visibility::view`): a seqlock. A reader notes `changes` (even: no
/// exclusive section running), copies what it needs with volatile reads,
/// and keeps the copy only if `changes` has not moved meanwhile; otherwise
/// it tries again, and after a few tries takes the lock shared. Nothing
/// here makes a reference into shared memory, and every index read from it
/// is bounded, so a copy torn by a concurrent writer is only ever thrown
/// away.
#[derive(Clone, Copy)]
pub(super) struct Raw {
    header: *mut Header,
}

/// The fields of a backend slot entry that readers use.
#[derive(Clone, Copy)]
pub(super) struct EntryCopy {
    pub stream: i32,
    pub instance: i32,
    pub min_id: i64,
    pub xid: TransactionId,
    pub pending: bool,
    pub allocating_from: i64,
    pub durable_from: i64,
    pub lsn: u64,
    /// Taken under a name a savepoint took back (see `Active::ghost`).
    pub ghost: bool,
}

/// The fields of a stream state that readers use.
#[derive(Clone, Copy)]
pub(super) struct StreamCopy {
    pub in_use: bool,
    pub loaded: bool,
    pub db: pg_sys::Oid,
    pub key: i32,
    pub seq: pg_sys::Oid,
    pub max_allocated: i64,
    pub summary_valid: bool,
    pub summary_min_id: i64,
    pub summary_latest_completed: TransactionId,
    pub summary_lsn: u64,
    pub n_seen: usize,
    pub orphans_valid: bool,
    /// The current history's mark is not stored yet: nothing above its
    /// `have` is finished for any reader.
    pub unrecorded_have: Option<i64>,
}

impl Raw {
    pub fn get() -> Result<Raw, Error> {
        // SAFETY: HEADER is written once per process at start-up.
        let header = unsafe { HEADER };
        if header.is_null() {
            Err(Error::NotLoaded)
        } else {
            Ok(Raw { header })
        }
    }

    fn h(&self) -> *const Header {
        self.header
    }

    /// The seqlock counter at the start of a copy (odd: try again).
    pub fn begin_read(&self) -> u64 {
        // SAFETY: the header is initialised; the counter is an atomic.
        unsafe { (*self.h()).changes.load(Ordering::Acquire) }
    }

    /// Did no exclusive section run since `begin_read` returned `seen`?
    pub fn still(&self, seen: u64) -> bool {
        fence(Ordering::Acquire);
        // SAFETY: as in `begin_read`.
        unsafe { (*self.h()).changes.load(Ordering::Relaxed) == seen }
    }

    /// Volatile read of a field of shared memory.
    ///
    /// # Safety
    /// `p` points into the initialised registry, to a value for which every
    /// bit pattern a writer may leave is valid (plain integers, and bools,
    /// which are written whole).
    unsafe fn read<T: Copy>(p: *const T) -> T {
        // SAFETY: forwarded from the caller.
        unsafe { std::ptr::read_volatile(p) }
    }

    /// Sizes fixed at start-up.
    fn dims(&self) -> (usize, usize, usize, usize) {
        // SAFETY: written once at start-up, before any reader.
        unsafe {
            let h = &*self.h();
            (
                h.n_streams as usize,
                h.n_slots as usize,
                h.per_slot as usize,
                h.ring_cap as usize,
            )
        }
    }

    fn per_session(&self) -> usize {
        // SAFETY: written once at start-up, before any reader.
        unsafe { (*self.h()).per_session as usize }
    }

    pub fn n_streams(&self) -> usize {
        self.dims().0
    }

    fn offsets(&self) -> Layout {
        // SAFETY: written once at start-up, before any reader.
        unsafe { (*self.h()).offsets }
    }

    /// State `index` (< n_streams, checked by the caller). Read before the
    /// slots (see `Section::moves_entries`).
    pub fn stream(&self, index: usize) -> StreamCopy {
        // SAFETY: `index` is below n_streams, so the pointer is inside the
        // stream states; the fields are integers and bools.
        unsafe {
            let s = (self.header as *const u8).add(self.offsets().streams) as *const StreamState;
            let s = s.add(index);
            StreamCopy {
                in_use: Self::read(&raw const (*s).in_use),
                loaded: Self::read(&raw const (*s).loaded),
                db: Self::read(&raw const (*s).db),
                key: Self::read(&raw const (*s).key),
                seq: Self::read(&raw const (*s).seq),
                max_allocated: Self::read(&raw const (*s).max_allocated),
                summary_valid: Self::read(&raw const (*s).summary.valid),
                summary_min_id: Self::read(&raw const (*s).summary.min_id),
                summary_latest_completed: Self::read(&raw const (*s).summary.latest_completed),
                summary_lsn: Self::read(&raw const (*s).summary.lsn),
                n_seen: (Self::read(&raw const (*s).n_seen) as usize).min(SEEN_WRITERS),
                orphans_valid: Self::read(&raw const (*s).orphans.valid),
                unrecorded_have: (Self::read(&raw const (*s).lost.mark_valid)
                    && !Self::read(&raw const (*s).lost.recorded))
                .then(|| Self::read(&raw const (*s).lost.mark_have)),
            }
        }
    }

    /// The orphan parts of state `index` (see `Orphans::parts`), into
    /// `out` (cleared first).
    pub fn orphans(&self, index: usize, out: &mut Vec<(i32, i64)>) {
        out.clear();
        // SAFETY: as in `stream`; the count is bounded by the array.
        unsafe {
            let s = (self.header as *const u8).add(self.offsets().streams) as *const StreamState;
            let o = &raw const (*s.add(index)).orphans;
            let n = (Self::read(&raw const (*o).n) as usize).min(ORPHAN_WRITERS);
            let writers = &raw const (*o).writers as *const (i32, i64, u64);
            for k in 0..n {
                let w = Self::read(writers.add(k));
                out.push((w.0, w.1));
            }
            if Self::read(&raw const (*o).all_valid) {
                out.push((ALL_WRITERS, Self::read(&raw const (*o).all_min_id)));
            }
        }
    }

    /// The first `n` (at most SEEN_WRITERS) writers seen of state `index`,
    /// into `out` (cleared first).
    pub fn seen(&self, index: usize, out: &mut Vec<i32>, n: usize) {
        out.clear();
        // SAFETY: as in `stream`; `n` is bounded by the array.
        unsafe {
            let s = (self.header as *const u8).add(self.offsets().streams) as *const StreamState;
            let seen = &raw const (*s.add(index)).seen;
            out.extend((0..n.min(SEEN_WRITERS)).map(|k| Self::read((seen as *const i32).add(k))));
        }
    }

    /// The active slots: calls `f` with each slot index (< n_slots), the
    /// number of transaction entries in use (<= per slot) and the number
    /// of holds (<= per session).
    pub fn for_each_active(&self, mut f: impl FnMut(usize, usize, usize)) {
        let per_session = self.per_session();
        let (_, n_slots, per_slot, _) = self.dims();
        let l = self.offsets();
        // SAFETY: every index read is checked against n_slots before use;
        // the active list and slot headers hold n_slots entries each.
        unsafe {
            let base = self.header as *const u8;
            // The counts are read after the highest allocated ID the caller
            // read (`stream`): an entry published before that ID was raised
            // is then counted. Without the fence a weakly ordered CPU
            // (ARM64, POWER) may read `n_active` or `used` first, miss the
            // entry, and answer up to the ID that entry holds back.
            fence(Ordering::Acquire);
            // What was published before the counts (`publish`) is read
            // after them.
            let n = (Self::read(&raw const (*self.h()).n_active) as usize).min(n_slots);
            fence(Ordering::Acquire);
            let list = base.add(l.active) as *const u32;
            let headers = base.add(l.slot_headers) as *const SlotHeader;
            for k in 0..n {
                let slot = Self::read(list.add(k)) as usize;
                if slot < n_slots {
                    let used = Self::read(&raw const (*headers.add(slot)).used) as usize;
                    let held = Self::read(&raw const (*headers.add(slot)).held) as usize;
                    fence(Ordering::Acquire);
                    f(slot, used.min(per_slot), held.min(per_session));
                }
            }
        }
    }

    /// Transaction entry `k` of slot `slot` (both bounded by the caller).
    pub fn entry(&self, slot: usize, k: usize) -> EntryCopy {
        self.entry_at(slot, k)
    }

    /// Hold `k` of slot `slot` (both bounded by the caller).
    pub fn hold(&self, slot: usize, k: usize) -> EntryCopy {
        let (_, _, per_slot, _) = self.dims();
        self.entry_at(slot, per_slot + k)
    }

    /// Entry `k` of slot `slot`'s transaction entries followed by its
    /// holds (k < per_slot + per_session, checked by the caller).
    fn entry_at(&self, slot: usize, k: usize) -> EntryCopy {
        let (_, _, per_slot, _) = self.dims();
        let stride = per_slot + self.per_session();
        // SAFETY: slot < n_slots and k < stride (from `for_each_active`):
        // inside the entries; the fields are integers and bools.
        unsafe {
            let a = ((self.header as *const u8).add(self.offsets().entries) as *const Active)
                .add(slot * stride + k);
            // `pending` and `allocating_from` first: once false (0), the
            // first ID and WAL position written before them are read after
            // them (`finish_allocation`).
            let pending = Self::read(&raw const (*a).pending);
            let allocating_from = Self::read(&raw const (*a).allocating_from);
            fence(Ordering::Acquire);
            // `durable_from` before `lsn`: `finish_allocation` writes the
            // new WAL position first, so a new `durable_from` comes with
            // its WAL position, and an old one with a newer WAL position
            // only holds more.
            let durable_from = Self::read(&raw const (*a).durable_from);
            fence(Ordering::Acquire);
            EntryCopy {
                stream: Self::read(&raw const (*a).stream),
                instance: Self::read(&raw const (*a).instance),
                min_id: Self::read(&raw const (*a).min_id),
                xid: Self::read(&raw const (*a).xid),
                pending,
                allocating_from,
                durable_from,
                lsn: Self::read(&raw const (*a).lsn),
                ghost: Self::read(&raw const (*a).ghost),
            }
        }
    }

    /// The finished ring from its newest entry back, while `f` returns true.
    pub fn ring_newest_first(&self, mut f: impl FnMut(Finished) -> bool) {
        let (_, _, _, cap) = self.dims();
        // SAFETY: positions are reduced modulo the ring's capacity and the
        // count bounded by it; a `Finished` holds integers and a bool.
        unsafe {
            let h = self.h();
            let head = Self::read(&raw const (*h).ring_head) as usize % cap;
            let used = (Self::read(&raw const (*h).ring_used) as usize).min(cap);
            let ring = (self.header as *const u8).add(self.offsets().ring) as *const Finished;
            for k in (0..used).rev() {
                if !f(Self::read(ring.add((head + k) % cap))) {
                    break;
                }
            }
        }
    }
}

/// The holds of the calling backend's own slot, read without the lock (see
/// `own_slot_unlocked`).
///
/// # Safety
/// The registry must be initialised and `slot` must be the caller's own.
pub(super) unsafe fn own_holds_unlocked(slot: usize) -> &'static [Active] {
    // SAFETY: as in `own_slot_unlocked`, for the session entries.
    unsafe {
        let h = &*HEADER;
        let per = h.per_slot as usize;
        let session = h.per_session as usize;
        let entries = (HEADER as *const u8).add(h.offsets.entries) as *const Active;
        let used = (*((HEADER as *const u8).add(h.offsets.slot_headers) as *const SlotHeader)
            .add(slot))
        .held as usize;
        std::slice::from_raw_parts(entries.add(slot * (per + session) + per), used.min(session))
    }
}

/// The entries of the calling backend's own slot, read without the lock:
/// only the backend itself writes its slot.
///
/// # Safety
/// The registry must be initialised and `slot` must be the caller's own.
pub(super) unsafe fn own_slot_unlocked(slot: usize) -> &'static [Active] {
    // SAFETY: the caller guarantees an initialised registry and its own slot
    // index; nobody else writes that slot, so reading it without the lock
    // sees this backend's own writes.
    unsafe {
        let h = &*HEADER;
        let l = &h.offsets;
        let per = h.per_slot as usize;
        let stride = per + h.per_session as usize;
        let entries = (HEADER as *const u8).add(l.entries) as *const Active;
        std::slice::from_raw_parts(entries.add(slot * stride), per)
    }
}

/// Record, once per start, the next full xid: called at the end of every
/// transaction until one has (nothing here raises an ERROR). Every
/// transaction that outlived the start (a prepared one recovered) has an
/// xid below it, and so has every snapshot that could not see such a
/// transaction end.
pub fn note_start_xid() {
    // SAFETY: HEADER is set once per process at start-up; the atomic lives
    // as long as shared memory. Reading the next xid takes XidGenLock
    // shared and raises no error.
    unsafe {
        let Some(h) = HEADER.as_ref() else {
            return;
        };
        if h.start_xid.load(Ordering::Relaxed) != 0 {
            return;
        }
        let next = pg_sys::ReadNextFullTransactionId().value;
        let _ = h
            .start_xid
            .compare_exchange(0, next.max(1), Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// The next full xid when the first transaction of this start ended (see
/// `note_start_xid`; recorded now if none has).
pub fn start_xid() -> u64 {
    note_start_xid();
    // SAFETY: as above.
    unsafe { HEADER.as_ref() }.map_or(0, |h| h.start_xid.load(Ordering::Acquire))
}

/// The durable high-water mark, when loaded.
pub(super) fn durable_high_water() -> Option<&'static AtomicU64> {
    // SAFETY: HEADER is set once per process at start-up; the atomic lives
    // as long as shared memory, i.e. as long as the process.
    unsafe { HEADER.as_ref().map(|h| &h.durable_high_water) }
}

/// What backends share about the stream catalog, when loaded.
pub fn catalog_sync() -> Option<&'static CatalogSync> {
    // SAFETY: HEADER is set once per process at start-up; the atomics in it
    // live as long as shared memory, i.e. as long as the process.
    unsafe { HEADER.as_ref().map(|h| &h.catalog) }
}

pub fn is_loaded() -> bool {
    // SAFETY: HEADER is written once per process at start-up.
    unsafe { !HEADER.is_null() }
}

pub fn require_loaded() -> Result<(), Error> {
    if is_loaded() {
        Ok(())
    } else {
        Err(Error::NotLoaded)
    }
}

/// This backend's slot: its PGPROC number.
pub(super) fn my_slot_index() -> Result<usize, Error> {
    // SAFETY: HEADER is initialised (callers checked `require_loaded`).
    let (procno, n) = (my_proc_number(), unsafe { (*HEADER).n_slots as usize });
    if procno < 0 || procno as usize >= n {
        return Err(Error::InvalidState {
            message: "this process cannot allocate stream IDs".into(),
            detail: Some(
                "Only client backends and background workers connected to a database can.".into(),
            ),
        });
    }
    Ok(procno as usize)
}
// What a writer writes on every allocation and commit, and the statistics
// counted beside it, share the state's first cache line.
const _: () = assert!(
    std::mem::offset_of!(StreamState, max_allocated) < 64
        && std::mem::offset_of!(StreamState, xact_rollback) + size_of::<u64>() <= 64
);

/// The registry no longer has `key` at the cached index.
#[derive(Debug)]
pub struct Stale;

/// Is `s` the loaded state of stream (`key`, `seq`) of this database?
pub(super) fn matches(s: &StreamState, key: i32, seq: pg_sys::Oid) -> bool {
    is_state_of(s, key, seq) && s.loaded
}

pub(super) fn is_state_of(s: &StreamState, key: i32, seq: pg_sys::Oid) -> bool {
    // SAFETY: MyDatabaseId is set once the backend is connected.
    s.in_use && s.key == key && s.seq == seq && s.db == unsafe { pg_sys::MyDatabaseId }
}
