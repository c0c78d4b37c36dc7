//! The in-flight registry: shared memory that knows, for every stream, which
//! IDs are allocated by transactions that have not ended, and which recently
//! committed transactions some snapshot may still not see.
//!
//! Layout (one `ShmemInitStruct`, sized from GUCs at start-up):
//! header | stream states | finished ring | backend slots (entries).
//!
//! One LWLock guards it all. Writers hold it exclusively for a few hundred
//! nanoseconds twice per allocation and once per commit; readers hold it
//! shared while scanning. The sequence's own lock, not ours, orders IDs.

use std::ffi::CStr;
use std::ptr;

use pgrx::pg_sys;
use pgrx::pg_sys::TransactionId;
use streampos_core::frontier::{HeldBy, Holder};

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
struct Header {
    lock: *mut pg_sys::LWLock,
    n_streams: u32,
    ring_cap: u32,
    n_slots: u32,
    per_slot: u32,
    /// The finished ring is a FIFO in commit order: `ring_head` is the
    /// oldest entry, `ring_used` the number of entries.
    ring_head: u32,
    ring_used: u32,
    /// Bumped by every change to the stream catalog; backends drop their
    /// cached catalog rows when it moves.
    catalog_generation: std::sync::atomic::AtomicU64,
    /// The top xid of the latest catalog-changing transaction. A backend
    /// caches a catalog row only if its snapshot saw that transaction.
    last_catalog_xid: std::sync::atomic::AtomicU32,
    workers: [WorkerSlot; MAX_DATABASES],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct WorkerSlot {
    pub db: pg_sys::Oid,
    pub pid: i32,
    pub latch: *mut pg_sys::Latch,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Summary {
    valid: bool,
    min_xid: TransactionId,
    max_xid: TransactionId,
    min_id: i64,
    /// The transaction completion count after the last fold: a snapshot
    /// whose own count is at least this was taken after every folded
    /// transaction completed, so it sees them all.
    completion_count: u64,
    /// The highest WAL position the folded allocations need flushed.
    lsn: u64,
    /// `latestCompletedXid` at the last fold: a snapshot whose xmax is past
    /// it + 1 saw a later completion, so it was taken after the fold.
    latest_completed: TransactionId,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct StreamState {
    in_use: bool,
    loaded: bool,
    dropped: bool,
    db: pg_sys::Oid,
    key: i32,
    max_allocated: i64,
    /// Bumped every time an allocation of this stream finishes.
    generation: u64,
    /// Broadcast when the generation moves; followers sleep on it.
    cv: pg_sys::ConditionVariable,
    summary: Summary,
    n_seen: u32,
    seen: [i32; SEEN_WRITERS],
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Finished {
    stream: i32,
    instance: i32,
    min_id: i64,
    max_id: i64,
    xid: TransactionId,
    /// Aborted: kept only until `lsn` is flushed (see `Active::lsn`).
    aborted: bool,
    lsn: u64,
}

/// One backend's allocations in its current transaction, per (stream, writer).
#[repr(C)]
#[derive(Clone, Copy)]
struct Active {
    /// Index into the stream states; -1 when free.
    stream: i32,
    instance: i32,
    /// While `pending`, a lower bound published before `nextval` ran.
    min_id: i64,
    max_id: i64,
    count: i64,
    xid: TransactionId,
    pending: bool,
    since: pg_sys::TimestampTz,
    /// The WAL insert position right after `nextval` returned. Until the
    /// WAL is flushed that far, a crash could roll the sequence back below
    /// these IDs and hand them out again, to any writer: so until then they
    /// hold back every writer, whatever becomes of the transaction.
    lsn: u64,
}

const FREE_ACTIVE: Active = Active {
    stream: -1,
    instance: 0,
    min_id: 0,
    max_id: 0,
    count: 0,
    xid: TransactionId::INVALID,
    pending: false,
    since: 0,
    lsn: 0,
};

#[repr(C)]
#[derive(Clone, Copy)]
struct SlotHeader {
    pid: i32,
    db: pg_sys::Oid,
    used: u32,
}

struct Layout {
    streams: usize,
    ring: usize,
    slot_headers: usize,
    entries: usize,
    total: usize,
}

fn align8(n: usize) -> usize {
    (n + 7) & !7
}

fn layout(n_streams: usize, ring_cap: usize, n_slots: usize, per_slot: usize) -> Layout {
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

static mut HEADER: *mut Header = ptr::null_mut();
static mut PREV_SHMEM_REQUEST: pg_sys::shmem_request_hook_type = None;
static mut PREV_SHMEM_STARTUP: pg_sys::shmem_startup_hook_type = None;

/// True while this backend's current transaction holds entries: the commit
/// and abort callbacks return at once otherwise.
static mut HOLDING: bool = false;
static mut EXIT_CALLBACK_REGISTERED: bool = false;

fn slot_count() -> usize {
    // Every regular backend and background worker has a PGPROC below
    // MaxBackends; only they can run SQL.
    unsafe { pg_sys::MaxBackends.max(1) as usize }
}

pub fn request_shared_memory() {
    unsafe {
        PREV_SHMEM_REQUEST = pg_sys::shmem_request_hook;
        pg_sys::shmem_request_hook = Some(shmem_request);
        PREV_SHMEM_STARTUP = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(shmem_startup);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_request() {
    unsafe {
        if let Some(prev) = PREV_SHMEM_REQUEST {
            prev();
        }
        let l = layout(
            guc::MAX_STREAMS.get() as usize,
            guc::FINISHED_RING_SIZE.get() as usize,
            slot_count(),
            guc::MAX_STREAMS_PER_TRANSACTION.get() as usize,
        );
        pg_sys::RequestAddinShmemSpace(l.total);
        pg_sys::RequestNamedLWLockTranche(TRANCHE.as_ptr(), 1);
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_startup() {
    unsafe {
        if let Some(prev) = PREV_SHMEM_STARTUP {
            prev();
        }
        let n_streams = guc::MAX_STREAMS.get() as usize;
        let ring_cap = guc::FINISHED_RING_SIZE.get() as usize;
        let n_slots = slot_count();
        let per_slot = guc::MAX_STREAMS_PER_TRANSACTION.get() as usize;
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
            let entries = base.add(l.entries) as *mut Active;
            for i in 0..n_slots * per_slot {
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
struct Locked {
    header: *mut Header,
}

// The accessors hand out `&mut` views of shared memory from `&self`: the
// memory belongs to no Rust owner, the LWLock this guard holds is what makes
// access exclusive, each accessor covers a disjoint region, and no caller
// keeps two views of the same region alive at once.
#[allow(clippy::mut_from_ref)]
impl Locked {
    fn acquire(exclusive: bool) -> Result<Locked, Error> {
        let header = unsafe { HEADER };
        if header.is_null() {
            return Err(Error::NotLoaded);
        }
        Ok(unsafe { Self::acquire_raw(header, exclusive) })
    }

    /// # Safety
    /// `header` must be the initialised registry.
    unsafe fn acquire_raw(header: *mut Header, exclusive: bool) -> Locked {
        let mode = if exclusive {
            pg_sys::LWLockMode::LW_EXCLUSIVE
        } else {
            pg_sys::LWLockMode::LW_SHARED
        };
        unsafe { pg_sys::LWLockAcquire((*header).lock, mode) };
        Locked { header }
    }

    fn h(&self) -> &mut Header {
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

    fn streams(&self) -> &mut [StreamState] {
        let n = self.h().n_streams as usize;
        unsafe {
            std::slice::from_raw_parts_mut(
                self.base().add(self.layout().streams) as *mut StreamState,
                n,
            )
        }
    }

    fn ring(&self) -> &mut [Finished] {
        let n = self.h().ring_cap as usize;
        unsafe {
            std::slice::from_raw_parts_mut(self.base().add(self.layout().ring) as *mut Finished, n)
        }
    }

    /// The finished entries, oldest first.
    fn ring_entries(&self) -> impl Iterator<Item = &Finished> + '_ {
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
    fn ring_push(&self, entry: Finished) -> Option<Finished> {
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

    fn slot_headers(&self) -> &mut [SlotHeader] {
        let n = self.h().n_slots as usize;
        unsafe {
            std::slice::from_raw_parts_mut(
                self.base().add(self.layout().slot_headers) as *mut SlotHeader,
                n,
            )
        }
    }

    fn slot(&self, index: usize) -> &mut [Active] {
        let per = self.h().per_slot as usize;
        unsafe {
            let entries = self.base().add(self.layout().entries) as *mut Active;
            std::slice::from_raw_parts_mut(entries.add(index * per), per)
        }
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        unsafe { pg_sys::LWLockRelease((*self.header).lock) };
    }
}

pub fn is_loaded() -> bool {
    unsafe { !HEADER.is_null() }
}

pub fn require_loaded() -> Result<(), Error> {
    if is_loaded() {
        Ok(())
    } else {
        Err(Error::NotLoaded)
    }
}

fn my_slot_index() -> Result<usize, Error> {
    let procno = unsafe { (*pg_sys::MyProc).pgprocno };
    let n = unsafe { (*HEADER).n_slots } as usize;
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

thread_local! {
    /// Stream key -> state index, for streams known to be loaded. Validated
    /// under the lock by every user (`matches`), so a stale entry costs a
    /// retry, never a wrong answer.
    static INDEX_CACHE: std::cell::RefCell<std::collections::HashMap<i32, usize>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// The registry no longer has `key` at the cached index.
#[derive(Debug)]
pub struct Stale;

fn matches(s: &StreamState, key: i32) -> bool {
    s.in_use && s.loaded && s.key == key && s.db == unsafe { pg_sys::MyDatabaseId }
}

pub fn forget_index(key: i32) {
    INDEX_CACHE.with(|c| c.borrow_mut().remove(&key));
}

/// Find the state of (current database, stream key), creating it if needed.
/// Returns its index and whether its maximum allocated ID is known yet.
pub fn stream_index(key: i32) -> Result<(usize, bool), Error> {
    require_loaded()?;
    if let Some(i) = INDEX_CACHE.with(|c| c.borrow().get(&key).copied()) {
        return Ok((i, true));
    }
    let (index, loaded) = lookup_stream_index(key)?;
    if loaded {
        INDEX_CACHE.with(|c| c.borrow_mut().insert(key, index));
    }
    Ok((index, loaded))
}

fn lookup_stream_index(key: i32) -> Result<(usize, bool), Error> {
    let db = unsafe { pg_sys::MyDatabaseId };
    {
        let locked = Locked::acquire(false)?;
        if let Some(i) = locked
            .streams()
            .iter()
            .position(|s| s.in_use && s.db == db && s.key == key)
        {
            return Ok((i, locked.streams()[i].loaded));
        }
    }
    let full = Locked::acquire(false)?.streams().iter().all(|s| s.in_use);
    if full {
        forget_dropped_databases()?;
    }
    let locked = Locked::acquire(true)?;
    let streams = locked.streams();
    if let Some(i) = streams
        .iter()
        .position(|s| s.in_use && s.db == db && s.key == key)
    {
        return Ok((i, streams[i].loaded));
    }
    let free = match streams.iter().position(|s| !s.in_use) {
        Some(i) => Some(i),
        None => reclaim_dropped(&locked),
    };
    let Some(i) = free else {
        return Err(Error::RegistryFull {
            what: "stream slot",
            guc: "streampos.max_streams",
        });
    };
    let s = &mut locked.streams()[i];
    // Keep the condition variable: a follower may still be registered on it.
    let cv = s.cv;
    *s = unsafe { std::mem::zeroed() };
    s.cv = cv;
    s.in_use = true;
    s.db = db;
    s.key = key;
    Ok((i, false))
}

/// States of databases that no longer exist count as dropped streams. Only
/// when the registry is full: it reads pg_database.
fn forget_dropped_databases() -> Result<(), Error> {
    let existing: Vec<pg_sys::Oid> = pgrx::spi::Spi::connect(|client| {
        let mut oids = Vec::new();
        for row in client.select("SELECT oid FROM pg_catalog.pg_database", None, &[])? {
            if let Some(oid) = row.get::<pg_sys::Oid>(1)? {
                oids.push(oid);
            }
        }
        Ok::<_, pgrx::spi::SpiError>(oids)
    })
    .unwrap_or_default();
    if existing.is_empty() {
        return Ok(());
    }
    let locked = Locked::acquire(true)?;
    for s in locked.streams().iter_mut() {
        if s.in_use && !existing.contains(&s.db) {
            s.dropped = true;
        }
    }
    Ok(())
}

/// A dropped stream's state can be reused once nothing refers to it.
fn reclaim_dropped(locked: &Locked) -> Option<usize> {
    let candidates: Vec<usize> = locked
        .streams()
        .iter()
        .enumerate()
        .filter(|(_, s)| s.in_use && s.dropped)
        .map(|(i, _)| i)
        .collect();
    let h = locked.h();
    'next: for i in candidates {
        let i32_index = i as i32;
        if locked.ring_entries().any(|f| f.stream == i32_index) {
            continue;
        }
        for slot in 0..h.n_slots as usize {
            if locked.slot(slot).iter().any(|a| a.stream == i32_index) {
                continue 'next;
            }
        }
        locked.streams()[i].in_use = false;
        return Some(i);
    }
    None
}

/// Record the maximum allocated ID read from the sequence, unless another
/// backend did first. Allocations only start once it is known, so a value
/// read before any allocation since start-up is exact.
/// `stored_writers`: instances with a stored position, remembered as seen
/// so that tokens list them without reading the table on every call.
pub fn set_loaded(index: usize, max_allocated: i64, stored_writers: &[i32]) -> Result<(), Error> {
    let locked = Locked::acquire(true)?;
    let s = &mut locked.streams()[index];
    if !s.loaded {
        s.loaded = true;
        s.max_allocated = max_allocated;
        for &w in stored_writers.iter().take(SEEN_WRITERS) {
            if !s.seen[..s.n_seen as usize].contains(&w) {
                s.seen[s.n_seen as usize] = w;
                s.n_seen += 1;
            }
        }
    }
    Ok(())
}

/// Mark a stream dropped (its key is never reused).
pub fn mark_dropped(key: i32) -> Result<(), Error> {
    let db = unsafe { pg_sys::MyDatabaseId };
    let locked = Locked::acquire(true)?;
    for s in locked.streams().iter_mut() {
        if s.in_use && s.db == db && s.key == key {
            s.dropped = true;
        }
    }
    Ok(())
}

/// Step 1 of an allocation: publish, before `nextval` runs, a lower bound
/// for the IDs this transaction is about to take. Without it a reader could
/// see a later ID registered by another writer and report a frontier past
/// ours.
pub fn begin_allocation(
    stream: usize,
    key: i32,
    instance: i32,
    xid: TransactionId,
) -> Result<Result<usize, Stale>, Error> {
    let slot_index = my_slot_index()?;
    register_exit_callback();
    let locked = Locked::acquire(true)?;
    if !matches(&locked.streams()[stream], key) {
        return Ok(Err(Stale));
    }
    let lower_bound = locked.streams()[stream].max_allocated.saturating_add(1);
    let stream_i32 = stream as i32;
    let slot = locked.slot(slot_index);
    if let Some(i) = slot
        .iter()
        .position(|a| a.stream == stream_i32 && a.instance == instance)
    {
        // The existing entry's minimum is already below anything new.
        return Ok(Ok(i));
    }
    let Some(i) = slot.iter().position(|a| a.stream < 0) else {
        return Err(Error::RegistryFull {
            what: "entry for this transaction",
            guc: "streampos.max_streams_per_transaction",
        });
    };
    slot[i] = Active {
        stream: stream_i32,
        instance,
        min_id: lower_bound,
        max_id: lower_bound,
        count: 0,
        xid,
        pending: true,
        since: unsafe { pg_sys::GetCurrentTransactionStartTimestamp() },
        lsn: 0,
    };
    let header = &mut locked.slot_headers()[slot_index];
    header.pid = unsafe { pg_sys::MyProcPid };
    header.db = unsafe { pg_sys::MyDatabaseId };
    header.used += 1;
    unsafe { HOLDING = true };
    Ok(Ok(i))
}

/// Step 2: the IDs `first..=last` (in internal, positive numbering) were
/// handed out by the sequence.
pub fn finish_allocation(
    stream: usize,
    entry: usize,
    instance: i32,
    first: i64,
    last: i64,
    count: i64,
    lsn: u64,
) -> Result<(), Error> {
    let slot_index = my_slot_index()?;
    let locked = Locked::acquire(true)?;
    let a = &mut locked.slot(slot_index)[entry];
    if a.pending && first < a.min_id {
        // The sequence went backwards (setval, or a cache > 1): a reader may
        // already have reported a frontier past this ID.
        return Err(Error::InvalidState {
            message: "the stream's sequence returned an ID below one already allocated".into(),
            detail: Some(format!(
                "The sequence returned {first}, but {} was allocated before. Was it reset with setval()?",
                a.min_id - 1
            )),
        });
    }
    if a.pending {
        a.min_id = first;
        a.pending = false;
    }
    a.max_id = a.max_id.max(last);
    a.count += count;
    a.lsn = a.lsn.max(lsn);
    let s = &mut locked.streams()[stream];
    s.max_allocated = s.max_allocated.max(last);
    if !s.seen[..s.n_seen as usize].contains(&instance) && (s.n_seen as usize) < SEEN_WRITERS {
        s.seen[s.n_seen as usize] = instance;
        s.n_seen += 1;
    }
    Ok(())
}

/// The IDs handed out by this backend's transaction are finished. Called from
/// the commit and abort callbacks: nothing here may raise an ERROR or panic,
/// allocate, or run SQL.
pub fn end_transaction(committed: bool) {
    unsafe {
        if !HOLDING || HEADER.is_null() {
            return;
        }
        HOLDING = false;
        let procno = (*pg_sys::MyProc).pgprocno;
        if procno < 0 || procno as u32 >= (*HEADER).n_slots {
            return;
        }
        let mut flushed = pg_sys::GetFlushRecPtr(ptr::null_mut());
        if !committed {
            // An abort releases its IDs at once, so the sequence record that
            // covers them must be on disk first, or a crash could hand them
            // out again. Rare: nextval logs once per 32 values and after a
            // checkpoint. XLogFlush raises no ERROR (a WAL write failure is a
            // PANIC anywhere). Our own slot: nobody else writes it.
            let needed = own_slot_lsn_max(procno as usize);
            if needed > flushed {
                pg_sys::XLogFlush(needed);
                flushed = pg_sys::GetFlushRecPtr(ptr::null_mut());
            }
        }
        // Read without our lock; cannot raise an error. Our own completion
        // is already counted (ProcArrayEndTransaction ran).
        let completion_count = (*pg_sys::ShmemVariableCache).xactCompletionCount;
        let latest_completed = TransactionId::from_inner(
            (*pg_sys::ShmemVariableCache).latestCompletedXid.value as u32,
        );
        let locked = Locked::acquire_raw(HEADER, true);
        let h = locked.h();
        // Streams to wake, without allocating.
        let mut woken = [usize::MAX; 16];
        let mut n_woken = 0;
        let mut wake_all = false;
        for a in locked.slot(procno as usize).iter_mut() {
            if a.stream < 0 {
                continue;
            }
            let stream = a.stream as usize;
            if !woken[..n_woken].contains(&stream) {
                if n_woken < woken.len() {
                    woken[n_woken] = stream;
                    n_woken += 1;
                } else {
                    wake_all = true;
                }
            }
            // A synchronous commit flushed past the IDs' sequence record;
            // an abort or an asynchronous commit may not have.
            let lsn = if a.lsn > flushed { a.lsn } else { 0 };
            if committed || lsn != 0 {
                let entry = Finished {
                    stream: a.stream,
                    instance: a.instance,
                    min_id: a.min_id,
                    max_id: a.max_id,
                    xid: a.xid,
                    aborted: !committed,
                    lsn,
                };
                // Full: the oldest entry (first committed) makes room and is
                // folded into its stream's summary. Fresh snapshots surely
                // see the oldest commits, so only old snapshots pay for it.
                if let Some(evicted) = locked.ring_push(entry) {
                    fold_into_summary(
                        &mut locked.streams()[evicted.stream as usize].summary,
                        evicted.xid,
                        evicted.min_id,
                        completion_count,
                        evicted.lsn,
                        latest_completed,
                    );
                }
            }
            locked.streams()[stream].generation += 1;
            *a = FREE_ACTIVE;
        }
        locked.slot_headers()[procno as usize].used = 0;
        let streams = locked.streams().as_mut_ptr();
        let n_streams = h.n_streams as usize;
        drop(locked);
        // Broadcasting outside the lock; a condition variable with no
        // sleepers costs one spinlock.
        if wake_all {
            for i in 0..n_streams {
                pg_sys::ConditionVariableBroadcast(&mut (*streams.add(i)).cv);
            }
        } else {
            for &i in &woken[..n_woken] {
                pg_sys::ConditionVariableBroadcast(&mut (*streams.add(i)).cv);
            }
        }
    }
}

/// The highest WAL position this backend's entries need durable. Reads
/// only the caller's own slot, which only the caller writes: no lock.
///
/// # Safety
/// The registry must be initialised and `slot` must be the caller's.
unsafe fn own_slot_lsn_max(slot: usize) -> u64 {
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
            .iter()
            .filter(|a| a.stream >= 0)
            .map(|a| a.lsn)
            .max()
            .unwrap_or(0)
    }
}

fn fold_into_summary(
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
    if unsafe { pg_sys::TransactionIdPrecedes(summary.latest_completed, latest_completed) } {
        summary.latest_completed = latest_completed;
    }
    summary.completion_count = summary.completion_count.max(completion_count);
    summary.lsn = summary.lsn.max(lsn);
    unsafe {
        if pg_sys::TransactionIdPrecedes(xid, summary.min_xid) {
            summary.min_xid = xid;
        }
        if pg_sys::TransactionIdPrecedes(summary.max_xid, xid) {
            summary.max_xid = xid;
        }
    }
    summary.min_id = summary.min_id.min(min_id);
}

fn register_exit_callback() {
    unsafe {
        if !EXIT_CALLBACK_REGISTERED {
            pg_sys::before_shmem_exit(Some(on_exit), pg_sys::Datum::from(0));
            EXIT_CALLBACK_REGISTERED = true;
        }
    }
}

/// Backend exit normally runs the abort path first; this covers any exit
/// that does not.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_exit(_code: i32, _arg: pg_sys::Datum) {
    end_transaction(false);
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
    require_loaded()?;
    let horizon = unsafe { pg_sys::GetOldestNonRemovableTransactionId(ptr::null_mut()) };
    let flushed = flushed_lsn();
    let locked = Locked::acquire(true)?;
    // From the head only (FIFO): an entry still needed keeps the younger
    // ones for a while, which costs readers a little scanning, nothing else.
    locked.ring_pop_while(|f| {
        let durable = f.lsn <= flushed;
        let seen_by_all = f.aborted || unsafe { pg_sys::TransactionIdPrecedes(f.xid, horizon) };
        durable && seen_by_all
    });
    for s in locked.streams().iter_mut() {
        if s.summary.valid
            && s.summary.lsn <= flushed
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
    unsafe { pg_sys::GetFlushRecPtr(ptr::null_mut()) }
}

/// Does `snapshot` possibly not see transaction `xid` as finished?
unsafe fn invisible(xid: TransactionId, snapshot: pg_sys::Snapshot) -> bool {
    unsafe { pg_sys::XidInMVCCSnapshot(xid, snapshot) }
}

/// Does `snapshot` see every transaction folded into the summary? All of
/// them committed, within [min_xid, max_xid], before the last fold.
/// Conservative: a transaction the snapshot saw running, inside the range and
/// committed since, may be one of them.
unsafe fn sees_all(summary: &Summary, snapshot: pg_sys::Snapshot) -> bool {
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
    unsafe {
        if pg_sys::ActiveSnapshotSet() {
            pg_sys::GetActiveSnapshot()
        } else {
            pg_sys::GetTransactionSnapshot()
        }
    }
}

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
        let unseen = !f.aborted && unsafe { invisible(f.xid, snapshot) };
        if not_durable || unseen {
            holders.push(Holder {
                held_by: held_by(f.instance, f.lsn),
                min_id: f.min_id,
            });
        }
    }
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

/// The stream's generation: it moves whenever an allocation finishes.
pub fn generation(stream: usize) -> Result<u64, Error> {
    let locked = Locked::acquire(false)?;
    Ok(locked.streams()[stream].generation)
}

/// One row of `streampos.in_flight()`.
pub struct InFlight {
    pub db: pg_sys::Oid,
    pub key: i32,
    pub instance: i32,
    pub pid: i32,
    pub xid: TransactionId,
    pub min_id: i64,
    pub max_id: i64,
    pub ids: i64,
    pub since: pg_sys::TimestampTz,
}

pub fn in_flight() -> Result<Vec<InFlight>, Error> {
    let locked = Locked::acquire(false)?;
    let streams = locked.streams();
    let mut rows = Vec::new();
    for (slot_index, header) in locked.slot_headers().iter().enumerate() {
        if header.used == 0 {
            continue;
        }
        for a in locked.slot(slot_index).iter().filter(|a| a.stream >= 0) {
            let s = &streams[a.stream as usize];
            rows.push(InFlight {
                db: s.db,
                key: s.key,
                instance: a.instance,
                pid: header.pid,
                xid: a.xid,
                min_id: a.min_id,
                max_id: a.max_id,
                ids: a.count,
                since: a.since,
            });
        }
    }
    Ok(rows)
}

/// Read on every catalog lookup, so without the lock.
pub fn catalog_generation() -> Option<u64> {
    let header = unsafe { HEADER };
    if header.is_null() {
        return None;
    }
    Some(unsafe {
        (*header)
            .catalog_generation
            .load(std::sync::atomic::Ordering::Acquire)
    })
}

/// Record that transaction `xid` changes the catalog.
pub fn set_last_catalog_xid(xid: TransactionId) {
    let header = unsafe { HEADER };
    if !header.is_null() {
        unsafe {
            (*header)
                .last_catalog_xid
                .store(xid.into_inner(), std::sync::atomic::Ordering::Release)
        };
    }
}

/// Does `snapshot` see the latest catalog change as finished? Rows it read
/// may then be cached (they stay valid until the generation moves).
pub fn snapshot_sees_catalog(snapshot: pg_sys::Snapshot) -> bool {
    let header = unsafe { HEADER };
    if header.is_null() {
        return false;
    }
    let xid = unsafe {
        (*header)
            .last_catalog_xid
            .load(std::sync::atomic::Ordering::Acquire)
    };
    let xid = TransactionId::from_inner(xid);
    xid == TransactionId::INVALID || !unsafe { pg_sys::XidInMVCCSnapshot(xid, snapshot) }
}

pub fn bump_catalog_generation() {
    let header = unsafe { HEADER };
    if !header.is_null() {
        unsafe {
            (*header)
                .catalog_generation
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel)
        };
    }
}

/// Sleep until the stream's generation moves past `seen`, or `timeout_ms`
/// passes. Returns false on timeout.
pub fn wait_for_change(stream: usize, seen: u64, timeout_ms: i64) -> Result<bool, Error> {
    let cv = {
        let locked = Locked::acquire(false)?;
        &mut locked.streams()[stream].cv as *mut pg_sys::ConditionVariable
    };
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_millis(timeout_ms.max(0) as u64);
    unsafe { pg_sys::ConditionVariablePrepareToSleep(cv) };
    let changed = loop {
        if generation(stream)? != seen {
            break true;
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            break false;
        }
        let left = (deadline - now).as_millis().min(i32::MAX as u128) as i64;
        // Wakes on broadcast, timeout, or an interrupt (which is then raised).
        unsafe { pg_sys::ConditionVariableTimedSleep(cv, left, pg_sys::PG_WAIT_EXTENSION) };
    };
    unsafe { pg_sys::ConditionVariableCancelSleep() };
    Ok(changed)
}

/// Position worker bookkeeping.
pub fn claim_worker_slot(db: pg_sys::Oid) -> Result<bool, Error> {
    let locked = Locked::acquire(true)?;
    let workers = &mut locked.h().workers;
    let me = unsafe { pg_sys::MyProcPid };
    if let Some(w) = workers.iter_mut().find(|w| w.db == db) {
        if w.pid > 0 && w.pid != me && unsafe { libc_kill_alive(w.pid) } {
            return Ok(false);
        }
        w.pid = me;
        w.latch = unsafe { pg_sys::MyLatch };
        return Ok(true);
    }
    match workers.iter_mut().find(|w| w.db == pg_sys::InvalidOid) {
        Some(w) => {
            *w = WorkerSlot {
                db,
                pid: me,
                latch: unsafe { pg_sys::MyLatch },
            };
            Ok(true)
        }
        None => Ok(false),
    }
}

pub fn release_worker_slot(db: pg_sys::Oid) {
    if let Ok(locked) = Locked::acquire(true) {
        let me = unsafe { pg_sys::MyProcPid };
        for w in locked.h().workers.iter_mut() {
            if w.db == db && w.pid == me {
                w.pid = 0;
                w.latch = ptr::null_mut();
            }
        }
    }
}

/// Is a position worker registered (or starting) for this database? Marks it
/// as starting when not, so that only one backend starts it.
pub fn worker_needed(db: pg_sys::Oid) -> bool {
    {
        let Ok(locked) = Locked::acquire(false) else {
            return false;
        };
        let running = locked.h().workers.iter().any(|w| w.db == db && w.pid != 0);
        if running {
            return false;
        }
    }
    let Ok(locked) = Locked::acquire(true) else {
        return false;
    };
    let workers = &mut locked.h().workers;
    if let Some(w) = workers.iter_mut().find(|w| w.db == db) {
        if w.pid == -1 || (w.pid > 0 && unsafe { libc_kill_alive(w.pid) }) {
            return false;
        }
        w.pid = -1;
        return true;
    }
    match workers.iter_mut().find(|w| w.db == pg_sys::InvalidOid) {
        Some(w) => {
            *w = WorkerSlot {
                db,
                pid: -1,
                latch: ptr::null_mut(),
            };
            true
        }
        None => false,
    }
}

/// Forget a failed start so that a later allocation tries again.
pub fn worker_start_failed(db: pg_sys::Oid) {
    if let Ok(locked) = Locked::acquire(true) {
        for w in locked.h().workers.iter_mut() {
            if w.db == db && w.pid == -1 {
                w.pid = 0;
            }
        }
    }
}

extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}

unsafe fn libc_kill_alive(pid: i32) -> bool {
    unsafe { kill(pid, 0) == 0 }
}

/// Streams of one database with their generation, for the position worker.
pub fn streams_of(db: pg_sys::Oid) -> Vec<(i32, usize, u64)> {
    let Ok(locked) = Locked::acquire(false) else {
        return Vec::new();
    };
    locked
        .streams()
        .iter()
        .enumerate()
        .filter(|(_, s)| s.in_use && s.loaded && !s.dropped && s.db == db)
        .map(|(i, s)| (s.key, i, s.generation))
        .collect()
}

/// Before commit: a transaction that wrote no WAL of its own (it only
/// allocated) commits without flushing the WAL, so its IDs would be held
/// until the WAL writer flushes their sequence record. Flush it now instead,
/// when it is not on disk yet (after a checkpoint, or once per 32 values).
/// Under synchronous_commit = off the IDs wait for the WAL writer, like the
/// commit itself.
pub fn flush_before_commit() {
    unsafe {
        if !HOLDING || HEADER.is_null() || pg_sys::XactLastRecEnd != 0 {
            return;
        }
        if pg_sys::synchronous_commit <= pg_sys::SyncCommitLevel::SYNCHRONOUS_COMMIT_OFF as i32 {
            return;
        }
        let procno = (*pg_sys::MyProc).pgprocno;
        if procno < 0 || procno as u32 >= (*HEADER).n_slots {
            return;
        }
        let needed = own_slot_lsn_max(procno as usize);
        if needed > pg_sys::GetFlushRecPtr(ptr::null_mut()) {
            pg_sys::XLogFlush(needed);
        }
    }
}

/// Does this backend's transaction hold IDs?
pub fn holding() -> bool {
    unsafe { HOLDING }
}

/// After `check_stream(…, repair => true)` moved the sequence forward, the
/// skipped values will never be handed out: nothing holds them back.
pub fn raise_max_allocated(stream: usize, value: i64) -> Result<(), Error> {
    let locked = Locked::acquire(true)?;
    let s = &mut locked.streams()[stream];
    if s.loaded && s.max_allocated < value {
        s.max_allocated = value;
        s.generation += 1;
    }
    let cv = &mut s.cv as *mut pg_sys::ConditionVariable;
    drop(locked);
    unsafe { pg_sys::ConditionVariableBroadcast(cv) };
    Ok(())
}
