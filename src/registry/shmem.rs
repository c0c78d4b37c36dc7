//! The registry's shared memory: its layout, its creation at server start,
//! and the guard that holds its lock.
//!
//! One `ShmemInitStruct`, sized from settings at start-up:
//! header | stream states | finished ring | backend slot headers | entries.

use std::cell::UnsafeCell;
use std::ffi::CStr;
use std::ptr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use pgrx::pg_sys;
use pgrx::pg_sys::TransactionId;

use crate::error::Error;
use crate::guc;

const TRANCHE: &CStr = c"streampos";
const SHMEM_NAME: &CStr = c"streampos registry";
/// Writers remembered per stream since start-up (for streams that allow any
/// writer); more still work, they just do not appear in tokens until the
/// background worker has stored their position.
pub const SEEN_WRITERS: usize = 64;
/// Databases with a position worker.
pub const MAX_DATABASES: usize = 64;

#[repr(C)]
pub(super) struct Header {
    pub lock: *mut pg_sys::LWLock,
    pub n_streams: u32,
    pub ring_cap: u32,
    pub n_slots: u32,
    pub per_slot: u32,
    /// The finished ring is a FIFO in push order: `ring_head` is the
    /// oldest entry, `ring_used` the number of entries.
    pub ring_head: u32,
    pub ring_used: u32,
    /// The highest `lsn` ever pushed (for `Finished::lsn_prefix_max`).
    pub ring_lsn_max: u64,
    /// The server started as a standby or for a point-in-time recovery: once
    /// promoted it may lack commits another server acknowledged, and its
    /// sequences stand where the last replayed record put them, up to 32
    /// values past what that history handed out (see
    /// `StreamState::replayed_ceiling`). Not after a crash restart of a
    /// primary: every ID its frontiers passed was durable here.
    pub may_lack_history: bool,
    /// The highest durable WAL position ever seen (see
    /// `visibility::durable_lsn`): what was final stays final when
    /// synchronous standbys are configured later.
    pub durable_high_water: AtomicU64,
    pub catalog: CatalogSync,
    pub workers: [WorkerSlot; MAX_DATABASES],
}

/// Catalog-changing transactions remembered by xid (see `CatalogState`).
pub const RECENT_CATALOG_CHANGES: usize = 16;

/// What backends share about the stream catalog (see `catalog.rs`, its only
/// user), behind a spinlock of its own: it is read on every catalog lookup
/// and held for a few dozen instructions, never across a call that can fail.
#[repr(C)]
pub struct CatalogSync {
    lock: AtomicU32,
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
        // SAFETY: the spinlock is held; shared memory lives as long as the
        // process.
        let value = f(unsafe { &mut *self.state.get() });
        self.lock.store(0, Ordering::Release);
        value
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
#[repr(C)]
pub(super) struct StreamState {
    pub in_use: bool,
    pub loaded: bool,
    pub dropped: bool,
    pub db: pg_sys::Oid,
    pub key: i32,
    /// The stream's sequence: a state matches a stream only with the same
    /// (database, key, sequence), so a stream key reused after the
    /// extension was dropped and created again starts from a fresh state.
    pub seq: pg_sys::Oid,
    pub max_allocated: i64,
    /// Bumped every time an allocation of this stream finishes.
    pub generation: u64,
    /// Broadcast when the generation moves; followers sleep on it.
    pub cv: pg_sys::ConditionVariable,
    pub summary: Summary,
    /// Writers that committed IDs since start-up (or had a stored position
    /// when the stream was loaded): tokens list them.
    pub n_seen: u32,
    pub seen: [i32; SEEN_WRITERS],
    /// When the server may lack history: the maximum allocated ID loaded
    /// from the sequence. IDs below it that no row here has may have been
    /// handed out by a history this server lost (a follower holding one
    /// must resynchronise); 0 otherwise.
    pub replayed_ceiling: i64,
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
    /// The WAL position the IDs need durable (see `Active::lsn`).
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
    /// The end of the WAL record that made the sequence hand these IDs out.
    /// Until it is durable (flushed, and confirmed by synchronous standbys
    /// when there are any), a crash or a failover could roll the sequence
    /// back below these IDs and hand them out again, to any writer: so until
    /// then they hold back every writer, whatever becomes of the transaction.
    pub lsn: u64,
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
    name: [0; NAME_BYTES],
};

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct SlotHeader {
    pub pid: i32,
    pub db: pg_sys::Oid,
    /// The role the backend allocated as (for `in_flight()`'s privacy).
    pub role: pg_sys::Oid,
    pub used: u32,
}

pub(super) struct Layout {
    pub streams: usize,
    pub ring: usize,
    pub slot_headers: usize,
    pub entries: usize,
    pub total: usize,
}

fn align8(n: usize) -> usize {
    (n + 7) & !7
}

pub(super) fn layout(n_streams: usize, ring_cap: usize, n_slots: usize, per_slot: usize) -> Layout {
    let streams = align8(size_of::<Header>());
    let ring = streams + align8(n_streams * size_of::<StreamState>());
    let slot_headers = ring + align8(ring_cap * size_of::<Finished>());
    let entries = slot_headers + align8(n_slots * size_of::<SlotHeader>());
    let total = entries + align8(n_slots * per_slot * size_of::<Active>());
    Layout {
        streams,
        ring,
        slot_headers,
        entries,
        total,
    }
}

pub(super) static mut HEADER: *mut Header = ptr::null_mut();
static mut PREV_SHMEM_REQUEST: pg_sys::shmem_request_hook_type = None;
static mut PREV_SHMEM_STARTUP: pg_sys::shmem_startup_hook_type = None;

/// The finished ring holds at least one entry more than every backend
/// slot together: the summary's rule (see `visibility.rs`) relies on it.
fn ring_capacity(n_slots: usize, per_slot: usize) -> usize {
    (guc::FINISHED_RING_SIZE.get() as usize).max(n_slots * per_slot + 1)
}

fn slot_count() -> usize {
    // Every regular backend and background worker has a PGPROC below
    // MaxBackends; only they can run SQL.
    // SAFETY: MaxBackends is set by the postmaster before shared memory is
    // sized, and never changes afterwards.
    unsafe { pg_sys::MaxBackends.max(1) as usize }
}

/// Called from `_PG_init` while the library is preloaded.
pub fn request_shared_memory() {
    // SAFETY: hooks are installed once, in the postmaster, before any
    // backend exists; the previous hooks are chained.
    unsafe {
        PREV_SHMEM_REQUEST = pg_sys::shmem_request_hook;
        pg_sys::shmem_request_hook = Some(shmem_request);
        PREV_SHMEM_STARTUP = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(shmem_startup);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_request() {
    // SAFETY: called by the postmaster in shmem_request_hook, the only place
    // where add-in shared memory and LWLock tranches may be requested.
    unsafe {
        if let Some(prev) = PREV_SHMEM_REQUEST {
            prev();
        }
        let per_slot = guc::MAX_STREAMS_PER_TRANSACTION.get() as usize;
        let l = layout(
            guc::MAX_STREAMS.get() as usize,
            ring_capacity(slot_count(), per_slot),
            slot_count(),
            per_slot,
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
        let ring_cap = ring_capacity(n_slots, per_slot);
        let l = layout(n_streams, ring_cap, n_slots, per_slot);

        // AddinShmemInitLock is MainLWLockArray[21] (lwlocknames.txt).
        let addin_shmem_init_lock = &raw mut (*pg_sys::MainLWLockArray.add(21)).lock;
        pg_sys::LWLockAcquire(addin_shmem_init_lock, pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let base = pg_sys::ShmemInitStruct(SHMEM_NAME.as_ptr(), l.total, &mut found) as *mut u8;
        if !found {
            ptr::write_bytes(base, 0, l.total);
            let header = base as *mut Header;
            (*header).lock = &mut (*pg_sys::GetNamedLWLockTranche(TRANCHE.as_ptr())).lock;
            let streams = base.add(l.streams) as *mut StreamState;
            for i in 0..n_streams {
                pg_sys::ConditionVariableInit(&mut (*streams.add(i)).cv);
            }
            (*header).n_streams = n_streams as u32;
            (*header).ring_cap = ring_cap as u32;
            (*header).n_slots = n_slots as u32;
            (*header).per_slot = per_slot as u32;
            (*header).may_lack_history = may_lack_history();
            let entries = base.add(l.entries) as *mut Active;
            for i in 0..n_slots * per_slot {
                entries.add(i).write(FREE_ACTIVE);
            }
        }
        HEADER = base as *mut Header;
        pg_sys::LWLockRelease(addin_shmem_init_lock);
    }
}

/// Does the server start as a standby or for a point-in-time recovery? In
/// the postmaster, before the startup process runs (which removes the
/// signal file when it promotes or finishes recovery), in the data
/// directory.
fn may_lack_history() -> bool {
    std::path::Path::new("standby.signal").exists()
        || std::path::Path::new("recovery.signal").exists()
}

/// A view of the registry while its lock is held. Dropping it releases the
/// lock, so an ERROR raised while it is alive cannot leave the lock held
/// (PostgreSQL also releases LWLocks on abort).
pub(super) struct Locked {
    header: *mut Header,
}

// The accessors hand out `&mut` views of shared memory from `&self`: the
// memory belongs to no Rust owner, the LWLock this guard holds is what makes
// access exclusive, each accessor covers a disjoint region, and no caller
// keeps two views of the same region alive at once.
#[allow(clippy::mut_from_ref)]
impl Locked {
    pub fn acquire(exclusive: bool) -> Result<Locked, Error> {
        // SAFETY: HEADER is written once per process at shared memory
        // start-up, before any SQL can run.
        let header = unsafe { HEADER };
        if header.is_null() {
            return Err(Error::NotLoaded);
        }
        // SAFETY: a non-null HEADER is the initialised registry.
        Ok(unsafe { Self::acquire_raw(header, exclusive) })
    }

    /// # Safety
    /// `header` must be the initialised registry.
    pub unsafe fn acquire_raw(header: *mut Header, exclusive: bool) -> Locked {
        let mode = if exclusive {
            pg_sys::LWLockMode::LW_EXCLUSIVE
        } else {
            pg_sys::LWLockMode::LW_SHARED
        };
        // SAFETY: the caller guarantees `header` is initialised, so its lock
        // points into the named tranche.
        unsafe { pg_sys::LWLockAcquire((*header).lock, mode) };
        Locked { header }
    }

    pub fn h(&self) -> &mut Header {
        // SAFETY: the header is initialised and this guard holds its lock.
        unsafe { &mut *self.header }
    }

    fn base(&self) -> *mut u8 {
        self.header as *mut u8
    }

    fn layout(&self) -> Layout {
        let h = self.h();
        layout(
            h.n_streams as usize,
            h.ring_cap as usize,
            h.n_slots as usize,
            h.per_slot as usize,
        )
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

    /// The entries of backend slot `index` (< `n_slots`).
    pub fn slot(&self, index: usize) -> &mut [Active] {
        let per = self.h().per_slot as usize;
        debug_assert!(index < self.h().n_slots as usize, "slot index out of range");
        // SAFETY: the entries are `n_slots * per_slot` initialised `Active`s;
        // callers pass their own or a scanned index, below `n_slots`.
        unsafe {
            let entries = self.base().add(self.layout().entries) as *mut Active;
            std::slice::from_raw_parts_mut(entries.add(index * per), per)
        }
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        // SAFETY: this guard acquired the lock of an initialised header.
        unsafe { pg_sys::LWLockRelease((*self.header).lock) };
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
        let l = layout(
            h.n_streams as usize,
            h.ring_cap as usize,
            h.n_slots as usize,
            h.per_slot as usize,
        );
        let per = h.per_slot as usize;
        let entries = (HEADER as *const u8).add(l.entries) as *const Active;
        std::slice::from_raw_parts(entries.add(slot * per), per)
    }
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
    // SAFETY: MyProc is set for every backend that runs SQL; HEADER is
    // initialised (callers checked `require_loaded`).
    let (procno, n) = unsafe { ((*pg_sys::MyProc).pgprocno, (*HEADER).n_slots as usize) };
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
