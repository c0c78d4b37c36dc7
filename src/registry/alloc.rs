//! Allocation and transaction end: a backend publishes what its transaction
//! holds in its own slot, and moves it to the finished ring when the
//! transaction ends.

use std::ptr;

use pgrx::pg_sys;
use pgrx::pg_sys::TransactionId;

use super::shmem::{
    self, matches, Active, Finished, Locked, Section, Stale, StreamState, ALL_WRITERS, FREE_ACTIVE,
    HEADER, NAME_BYTES, ORPHAN_WRITERS, SEEN_WRITERS,
};
use super::visibility::{durable_lsn, fold_into_summary, latest_completed, wait_until_durable};
use crate::error::Error;
use crate::ffi::unguarded;

/// True while this backend's current transaction holds entries: the commit
/// and abort callbacks return at once otherwise.
static mut HOLDING: bool = false;
static mut EXIT_CALLBACK_REGISTERED: bool = false;

/// Does this backend's transaction hold IDs?
pub fn holding() -> bool {
    // SAFETY: backend-local flag, only touched by this process.
    unsafe { HOLDING }
}

/// Where a call's IDs must start: above every ID allocated when the call
/// began (returned by `begin_allocation`, checked by `finish_allocation`).
#[derive(Clone, Copy)]
pub struct Allocation {
    pub entry: usize,
    /// A hold (a session entry), not a transaction entry.
    pub hold: bool,
    lower_bound: i64,
}

/// What an allocation is for.
pub struct Request<'a> {
    /// The stream's state, and the stream it must still be.
    pub stream: usize,
    pub key: i32,
    pub seq: pg_sys::Oid,
    pub instance: i32,
    pub instance_name: &'a str,
    /// Any instance may write (a configured stream's tokens list its
    /// configured writers).
    pub open_stream: bool,
    /// Held by the session (`hold_ids`), not by the transaction.
    pub hold: bool,
    pub xid: TransactionId,
}

/// Step 1 of an allocation: publish, before `nextval` runs, a lower bound
/// for the IDs this transaction is about to take. Without it a reader could
/// see a later ID registered by another writer and report a frontier past
/// ours.
pub fn begin_allocation(request: &Request) -> Result<Result<Allocation, Stale>, Error> {
    let &Request {
        stream,
        key,
        seq,
        instance,
        instance_name,
        open_stream,
        hold,
        xid,
    } = request;
    let slot_index = shmem::my_slot_index()?;
    register_exit_callback();
    let stream_i32 = stream as i32;
    // Everything but the lower bound is known before the lock.
    let mut entry = Active {
        stream: stream_i32,
        instance,
        min_id: 0,
        max_id: 0,
        count: 0,
        xid,
        pending: true,
        // SAFETY: plain read of the transaction's start time.
        since: unsafe { unguarded::GetCurrentTransactionStartTimestamp() },
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
    let len = instance_name.len().min(NAME_BYTES - 1);
    entry.name[..len].copy_from_slice(&instance_name.as_bytes()[..len]);
    // SAFETY: process identity globals, set at backend start.
    let (pid, db, role) = unsafe {
        (
            pg_sys::MyProcPid,
            pg_sys::MyDatabaseId,
            unguarded::GetUserId(),
        )
    };
    let locked = Locked::acquire(Section::BeginAllocation)?;
    if !matches(&locked.streams()[stream], key, seq) {
        return Ok(Err(Stale));
    }
    let lower_bound = locked.streams()[stream].max_allocated.saturating_add(1);
    // A transaction reuses its entry for the stream and writer; each hold
    // is an entry of its own.
    if !hold {
        if let Some(i) = locked
            .entries_in_use(slot_index)
            .iter()
            // The newest one (an allocation may have split it, see
            // `finish_allocation`).
            .rposition(|a| a.stream == stream_i32 && a.instance == instance && !a.shadow)
        {
            // The existing entry's minimum is already below anything new,
            // as long as the new IDs are above what was allocated by now.
            // Until `finish_allocation` records their WAL position, the new
            // IDs hold every writer back from the lower bound, as a pending
            // entry's do: the sequence records the coming `nextval` calls
            // write may not be durable, and the entry still shows its
            // earlier, durable one. (Without the mark a reader answered past
            // them for the other writers, and a later reader, once the new
            // WAL position was recorded and not yet flushed, answered less.)
            // A mark left by a call that failed (its savepoint rolled back)
            // is lower: it stays.
            let a = &mut locked.entries_in_use(slot_index)[i];
            if !a.pending && a.allocating_from == 0 {
                shmem::publish(&mut a.allocating_from, lower_bound);
            }
            return Ok(Ok(Allocation {
                entry: i,
                hold,
                lower_bound,
            }));
        }
    }
    let header = &locked.slot_headers()[slot_index];
    let was_active = header.used > 0 || header.held > 0;
    let (i, room) = if hold {
        (header.held as usize, locked.session_slot(slot_index).len())
    } else {
        (header.used as usize, locked.slot(slot_index).len())
    };
    if i >= room {
        return Err(if hold {
            Error::RegistryFull {
                what: "hold for this session",
                guc: "streampos.max_held_per_session",
            }
        } else {
            Error::RegistryFull {
                what: "entry for this transaction",
                guc: "streampos.max_streams_per_transaction",
            }
        });
    }
    // A writer the stream does not remember yet needs a place among the
    // writers its tokens list; on a stream open to any writer, one it
    // would have to forget is refused (a configured stream's tokens list
    // its configured writers instead).
    let s = &locked.streams()[stream];
    if !s.has_seen(instance) {
        let (reserved, mine) = reserved_writers(&locked, stream_i32, instance);
        if mine || (s.n_seen as usize) + reserved < SEEN_WRITERS {
            entry.reserved_seen = true;
        } else if open_stream {
            return Err(Error::TooManyWriters {
                limit: SEEN_WRITERS,
            });
        }
    }
    entry.min_id = lower_bound;
    entry.max_id = lower_bound;
    entry.durable_from = lower_bound;
    let header = &mut locked.slot_headers()[slot_index];
    header.pid = pid;
    header.db = db;
    header.role = role;
    // SAFETY: backend-local flag.
    unsafe { HOLDING = true };
    // Counted once written: lock-free readers copy entries below `used`
    // and `held` (this section does not move the seqlock counter).
    if hold {
        locked.session_slot(slot_index)[i] = entry;
        shmem::publish(&mut header.held, i as u32 + 1);
    } else {
        locked.slot(slot_index)[i] = entry;
        shmem::publish(&mut header.used, i as u32 + 1);
    }
    locked.update_active(slot_index, was_active);
    Ok(Ok(Allocation {
        entry: i,
        hold,
        lower_bound,
    }))
}

/// The writers that entries in flight (transactions' and holds) have
/// reserved a place for among `stream`'s, counted once each: their commit
/// always finds room. With whether `instance` is one of them. (A new
/// writer's allocation is rare: the scan of the active slots is too.)
fn reserved_writers(locked: &Locked, stream: i32, instance: i32) -> (usize, bool) {
    let mut writers: Vec<i32> = Vec::new();
    for &slot in locked.active_slots() {
        let slot = slot as usize;
        for a in locked
            .entries_in_use(slot)
            .iter()
            .chain(locked.holds_in_use(slot).iter())
        {
            if a.stream == stream && a.reserved_seen && !writers.contains(&a.instance) {
                writers.push(a.instance);
            }
        }
    }
    let mine = writers.contains(&instance);
    (writers.len(), mine)
}

/// Remember `ids` among `stream`'s writers (a stream opened to any writer
/// keeps listing the writers it listed); 54000 when they do not all fit.
pub fn remember_writers(
    stream: usize,
    key: i32,
    seq: pg_sys::Oid,
    ids: &[i32],
) -> Result<Result<(), Stale>, Error> {
    let locked = Locked::acquire(Section::OtherExclusive)?;
    if !matches(&locked.streams()[stream], key, seq) {
        return Ok(Err(Stale));
    }
    let s = &locked.streams()[stream];
    let new: Vec<i32> = ids.iter().copied().filter(|&w| !s.has_seen(w)).collect();
    let (reserved, _) = reserved_writers(&locked, stream as i32, 0);
    if s.n_seen as usize + reserved + new.len() > SEEN_WRITERS {
        return Err(Error::TooManyWriters {
            limit: SEEN_WRITERS,
        });
    }
    let s = &mut locked.streams()[stream];
    for w in new {
        s.add_seen(w);
    }
    Ok(Ok(()))
}

/// Step 2: the sequence handed out `ids` (internal, positive numbering).
/// Each must be above every ID allocated when the call began, and above the
/// one before it: a sequence moved back (setval, RESTART), wrapped (CYCLE)
/// or read through a cache could otherwise hand out an ID a reader has
/// already passed.
pub fn finish_allocation(
    stream: usize,
    allocation: Allocation,
    ids: &[i64],
    lsn: u64,
) -> Result<(), Error> {
    let (Some(&first), Some(&last)) = (ids.first(), ids.last()) else {
        return Ok(());
    };
    let mut floor = allocation.lower_bound;
    for &id in ids {
        if id < floor {
            return Err(Error::InvalidState {
                message: "the stream's sequence returned an ID below one already allocated".into(),
                detail: Some(format!(
                    "The sequence returned {id}, but {} was allocated before. Was it reset with setval(), \
                     restarted, or did it cycle?",
                    floor - 1
                )),
            });
        }
        floor = id.saturating_add(1);
    }
    let slot_index = shmem::my_slot_index()?;
    // A newer sequence record than the entry's earlier IDs needed: those
    // must be durable before the entry's WAL position moves on, or they
    // would hold every writer back again (positions would go back).
    // SAFETY: the registry is loaded (`my_slot_index` succeeded) and the
    // slot is this backend's own.
    let earlier = unsafe {
        if allocation.hold {
            shmem::own_holds_unlocked(slot_index)[allocation.entry]
        } else {
            shmem::own_slot_unlocked(slot_index)[allocation.entry]
        }
    };
    let newer_record = !earlier.pending && lsn > earlier.lsn;
    // A newer record while the earlier one is not durable yet (a
    // synchronous standby that has not confirmed it, say): the new IDs go
    // into an entry of their own, so that neither waits for the other,
    // while the transaction has entries left (then it waits, as a commit
    // would). Holds always move on (they are one allocation each).
    let split = newer_record
        && !allocation.hold
        && durable_lsn() < earlier.lsn
        // SAFETY: the slot is this backend's own.
        && unsafe { shmem::own_slot_unlocked(slot_index) }
            .iter()
            .any(|a| a.stream < 0);
    let shift = newer_record && !split;
    if shift {
        wait_until_durable(earlier.lsn);
    }
    // Moving the entry's WAL position on: a reader copying the new
    // position with the old `durable_from` would hold every writer back
    // from IDs durable for a while, and answer less than a reader before
    // it (the seqlock counter moves: such a copy is thrown away). A split
    // adds an entry (written whole, then counted) and takes the mark
    // `allocating_from` off the earlier one: a reader that counted the
    // entries before the new one and read the mark after it went would
    // hold neither, so the counter moves for it too.
    let locked = Locked::acquire(if shift || split {
        Section::FinishAllocationShift
    } else {
        Section::FinishAllocation
    })?;
    if split {
        let i = locked.slot_headers()[slot_index].used as usize;
        let earlier = locked.slot(slot_index)[allocation.entry];
        locked.slot(slot_index)[i] = Active {
            min_id: first,
            max_id: last,
            count: ids.len() as i64,
            lsn,
            durable_from: first,
            allocating_from: 0,
            reserved_seen: false,
            ..earlier
        };
        let header = &mut locked.slot_headers()[slot_index];
        shmem::publish(&mut header.used, i as u32 + 1);
        let earlier = &mut locked.slot(slot_index)[allocation.entry];
        shmem::publish(&mut earlier.allocating_from, 0);
    } else {
        let a = if allocation.hold {
            &mut locked.session_slot(slot_index)[allocation.entry]
        } else {
            &mut locked.slot(slot_index)[allocation.entry]
        };
        // In this order, for lock-free readers: the WAL position, then
        // where it starts to count, then the first ID and `pending`, then
        // the highest allocated ID. A reader that sees the new highest ID
        // sees the rest; one that does not, stops below these IDs.
        a.max_id = a.max_id.max(last);
        a.count += ids.len() as i64;
        if a.pending {
            shmem::publish(&mut a.lsn, lsn);
            shmem::publish(&mut a.durable_from, first);
            a.min_id = first;
            shmem::publish(&mut a.pending, false);
        } else if lsn > a.lsn {
            shmem::publish(&mut a.lsn, lsn);
            shmem::publish(&mut a.durable_from, first);
        }
        // Last: a reader that sees the mark gone sees the WAL position and
        // `durable_from` written above (it reads the mark first). The new
        // IDs then hold every writer back from `durable_from` (at or above
        // the mark) until that position is durable, or, under the entry's
        // earlier WAL position (no newer sequence record), as the earlier
        // IDs do: never from lower than the mark did.
        if a.allocating_from != 0 {
            shmem::publish(&mut a.allocating_from, 0);
        }
    }
    let s = &mut locked.streams()[stream];
    let highest = s.max_allocated.max(last);
    shmem::publish(&mut s.max_allocated, highest);
    // On the cache line just written (see `StreamState`).
    #[cfg(feature = "stats")]
    {
        s.ids_allocated = s.ids_allocated.wrapping_add(ids.len() as u64);
    }
    Ok(())
}

/// Put the hold of this session on `stream` that handed out `(first, last,
/// count)` in the running transaction's hands: a shadow entry with its xid
/// (finished at its commit), the hold marked releasing (gone at that
/// commit). False when this session has no such hold.
pub fn release_hold(
    stream: usize,
    key: i32,
    seq: pg_sys::Oid,
    ids: (i64, i64, i64),
    xid: TransactionId,
    subxact: pg_sys::SubTransactionId,
) -> Result<Result<bool, Stale>, Error> {
    let slot_index = shmem::my_slot_index()?;
    let (first, last, count) = ids;
    let is_it = |a: &Active| {
        a.stream == stream as i32
            && !a.pending
            && !a.releasing
            && a.min_id == first
            && a.max_id == last
            && a.count == count
    };
    // Its IDs durable first (already so but for a hold taken a moment
    // ago): the shadow then needs no WAL position, and one shadow per
    // (stream, writer) stands for every hold the transaction releases.
    // SAFETY: the registry is loaded and the slot is this backend's own.
    let Some(lsn) = (unsafe { shmem::own_holds_unlocked(slot_index) })
        .iter()
        .find(|a| is_it(a))
        .map(|a| a.lsn)
    else {
        return Ok(Ok(false));
    };
    wait_until_durable(lsn);
    // Only adds an entry or lowers a shadow's first ID, while the hold it
    // stands for still holds as much (see `Section::moves_entries`).
    let locked = Locked::acquire(Section::BeginAllocation)?;
    if !matches(&locked.streams()[stream], key, seq) {
        return Ok(Err(Stale));
    }
    let Some(k) = locked.holds_in_use(slot_index).iter().position(is_it) else {
        return Ok(Ok(false));
    };
    let hold = locked.holds_in_use(slot_index)[k];
    let used = locked.slot_headers()[slot_index].used as usize;
    let existing = locked.slot(slot_index)[..used]
        .iter()
        .position(|a| a.shadow && a.stream == hold.stream && a.instance == hold.instance);
    match existing {
        Some(i) => {
            let shadow = &mut locked.slot(slot_index)[i];
            let lowest = shadow.min_id.min(hold.min_id);
            shmem::publish(&mut shadow.min_id, lowest);
            shadow.max_id = shadow.max_id.max(hold.max_id);
            shadow.count += hold.count;
        }
        None => {
            if used >= locked.slot(slot_index).len() {
                return Err(Error::RegistryFull {
                    what: "entry for this transaction",
                    guc: "streampos.max_streams_per_transaction",
                });
            }
            locked.slot(slot_index)[used] = Active {
                xid,
                shadow: true,
                reserved_seen: false,
                releasing: false,
                confirmed: false,
                lsn: 0,
                durable_from: i64::MAX,
                ..hold
            };
            let header = &mut locked.slot_headers()[slot_index];
            shmem::publish(&mut header.used, used as u32 + 1);
        }
    }
    let hold = &mut locked.holds_in_use(slot_index)[k];
    hold.releasing = true;
    hold.release_subxact = subxact;
    // SAFETY: backend-local flag.
    unsafe { HOLDING = true };
    // The slot is active already: it has the hold.
    Ok(Ok(true))
}

/// The instance `name` was just created with id `id` (by this transaction,
/// not yet committed). Entries and holds of any session that still carry
/// an earlier id of the name, which a rolled-back savepoint took back, are
/// the name's, and hold it back under `id`: the name has no other id (its
/// earlier one is gone, and while a transaction that created it runs,
/// nobody else can create it). Readers see one id or the other; `id` was
/// reported by nobody before (its name is not committed, and it had no
/// entry). Rare: only when a new name is created.
pub fn rename_entries(name: &str, id: i32) -> Result<(), Error> {
    super::require_loaded()?;
    let len = name.len().min(NAME_BYTES - 1);
    let named = |a: &Active| {
        a.instance != id
            && a.instance != ALL_WRITERS
            && a.name[..len] == name.as_bytes()[..len]
            && a.name[len] == 0
    };
    // Rewrites a field readers read whole: no entry moves.
    let locked = Locked::acquire(Section::BeginAllocation)?;
    for &slot in locked.active_slots() {
        let slot = slot as usize;
        for a in locked
            .entries_in_use(slot)
            .iter_mut()
            .chain(locked.holds_in_use(slot).iter_mut())
        {
            if named(a) {
                shmem::publish(&mut a.instance, id);
                a.ghost = false;
            }
        }
    }
    Ok(())
}

/// A rolled-back savepoint took back the instances `ids` it created: this
/// backend's entries and holds under them are under dead ids (see
/// `Active::ghost`). From the subtransaction abort callback: no error.
pub fn mark_ghosts(ids: &[i32]) {
    // SAFETY: HEADER checked non-null; the slot is this backend's own; a
    // flag readers never read is set under the lock.
    unsafe {
        if ids.is_empty() || !HOLDING || HEADER.is_null() {
            return;
        }
        let procno = super::shmem::my_proc_number();
        if procno < 0 || procno as u32 >= (*HEADER).n_slots {
            return;
        }
        let slot = procno as usize;
        let locked = Locked::acquire_raw(HEADER, Section::BeginAllocation);
        for a in locked
            .entries_in_use(slot)
            .iter_mut()
            .chain(locked.holds_in_use(slot).iter_mut())
        {
            if ids.contains(&a.instance) {
                a.ghost = true;
            }
        }
    }
}

/// A subtransaction ended: releases made in it go with an abort, or belong
/// to its parent after a commit. (Its shadow entries stay: the hold holds
/// as much, and they finish nothing the hold does not.)
pub fn end_subtransaction(
    committed: bool,
    subxact: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
) {
    // SAFETY: HEADER checked non-null; the slot is this backend's own.
    unsafe {
        if !HOLDING || HEADER.is_null() {
            return;
        }
        let procno = super::shmem::my_proc_number();
        if procno < 0 || procno as u32 >= (*HEADER).n_slots {
            return;
        }
        let slot = procno as usize;
        if !shmem::own_holds_unlocked(slot)
            .iter()
            .any(|a| a.releasing && a.release_subxact == subxact)
        {
            return;
        }
        // Flags readers never read: no entry moves.
        let locked = Locked::acquire_raw(HEADER, Section::BeginAllocation);
        for a in locked.holds_in_use(slot).iter_mut() {
            if a.releasing && a.release_subxact == subxact {
                if committed {
                    a.release_subxact = parent;
                } else {
                    a.releasing = false;
                }
            }
        }
    }
}

/// The orphaned holds of every stream of database `db`: (state index,
/// key, epoch).
pub fn orphans_of(db: pg_sys::Oid) -> Vec<(usize, i32, u64)> {
    let Ok(locked) = Locked::acquire(Section::OtherShared) else {
        return Vec::new();
    };
    locked
        .streams()
        .iter()
        .enumerate()
        .filter(|(_, s)| s.in_use && s.db == db && s.orphans.valid)
        .map(|(i, s)| (i, s.key, s.orphans.epoch))
        .collect()
}

thread_local! {
    /// The orphan record (state index, epoch) the running transaction of
    /// the position worker releases at its commit: one a transaction, so
    /// that its end pushes at most ORPHAN_WRITERS + 1 entries to the ring
    /// (see `ring_capacity`). Reserved ahead: the commit callback must not
    /// allocate.
    static RELEASING_ORPHANS: std::cell::RefCell<Vec<(usize, u64)>> =
        std::cell::RefCell::new(Vec::with_capacity(1));
}

/// The position worker releases a stream's orphaned holds (as of `epoch`)
/// in its running transaction, whose xid is `xid`: at its commit, each
/// part goes to the finished ring with that xid (seen finished only by
/// snapshots that see the commit), and the record is cleared if nothing
/// was orphaned since. False when there is nothing (left) to release.
pub fn release_orphans(stream: usize, epoch: u64) -> Result<bool, Error> {
    shmem::my_slot_index()?;
    register_exit_callback();
    {
        let locked = Locked::acquire(Section::OtherShared)?;
        let o = &locked.streams()[stream].orphans;
        if !o.valid || o.epoch != epoch {
            return Ok(false);
        }
    }
    let full = RELEASING_ORPHANS.with(|r| {
        let mut r = r.borrow_mut();
        if r.len() == r.capacity() {
            return true;
        }
        r.push((stream, epoch));
        false
    });
    if full {
        return Ok(false);
    }
    // SAFETY: backend-local flag.
    unsafe { HOLDING = true };
    Ok(true)
}

/// At the commit (or abort) of the worker's transaction: the orphan
/// records it released (see `release_orphans`), under the lock the
/// transaction's end already holds.
fn end_orphan_releases(
    locked: &Locked,
    committed: bool,
    xid: TransactionId,
    stamp: TransactionId,
    woken: &mut Woken,
) {
    RELEASING_ORPHANS.with(|r| {
        let mut releasing = r.borrow_mut();
        if committed {
            for &(stream, epoch) in releasing.iter() {
                let s = &mut locked.streams()[stream];
                if !s.orphans.valid || s.orphans.epoch != epoch {
                    continue;
                }
                let mut parts = [(0, 0, 0); ORPHAN_WRITERS + 1];
                let mut n = 0;
                for part in s.orphans.parts() {
                    parts[n] = part;
                    n += 1;
                }
                s.orphans.clear();
                s.generation += 1;
                woken.add(stream);
                for &(instance, min_id, lsn) in &parts[..n] {
                    let entry = Active {
                        stream: stream as i32,
                        instance,
                        min_id,
                        max_id: min_id,
                        xid,
                        lsn,
                        durable_from: min_id,
                        ..FREE_ACTIVE
                    };
                    push_finished(locked, &entry, true, stamp, 0);
                }
            }
        }
        releasing.truncate(0);
    });
}

/// Streams to wake after a lock section, without allocating.
struct Woken {
    streams: [usize; 16],
    n: usize,
    all: bool,
}

impl Woken {
    fn new() -> Woken {
        Woken {
            streams: [usize::MAX; 16],
            n: 0,
            all: false,
        }
    }

    fn add(&mut self, stream: usize) {
        if self.streams[..self.n].contains(&stream) {
            return;
        }
        if self.n < self.streams.len() {
            self.streams[self.n] = stream;
            self.n += 1;
        } else {
            self.all = true;
        }
    }

    /// Broadcast outside the lock; a condition variable with no sleepers
    /// costs one spinlock.
    ///
    /// # Safety
    /// `streams` points at the registry's `n_streams` stream states.
    unsafe fn broadcast(&self, streams: *mut StreamState, n_streams: usize) {
        // SAFETY: forwarded from the caller; ConditionVariableBroadcast
        // raises no error.
        unsafe {
            if self.all {
                for i in 0..n_streams {
                    unguarded::ConditionVariableBroadcast(&mut (*streams.add(i)).cv);
                }
            } else {
                for &i in &self.streams[..self.n] {
                    unguarded::ConditionVariableBroadcast(&mut (*streams.add(i)).cv);
                }
            }
        }
    }
}

/// Move an ended allocation `a` to the finished ring: a commit stays there
/// for snapshots that do not see it yet, an abort only while its IDs are
/// not durable (`durable`).
fn push_finished(locked: &Locked, a: &Active, committed: bool, stamp: TransactionId, durable: u64) {
    // An allocation that failed before recording its WAL position is held
    // until everything inserted so far is durable: from its lower bound
    // (pending), or, for a call that failed into a complete entry, from its
    // mark, and from the entry's earlier IDs too while their WAL position is
    // not durable (read afresh: a reader that found it durable held from
    // the mark only, and must not be answered less now).
    let (lsn, durable_from) = if a.pending {
        // SAFETY: reads the insert pointer under its spinlock; no error.
        (unsafe { unguarded::GetXLogInsertRecPtr() }, a.min_id)
    } else if a.allocating_from != 0 {
        // SAFETY: reads the insert pointer under its spinlock; no error.
        let inserted = unsafe { unguarded::GetXLogInsertRecPtr() };
        let from = if a.lsn <= durable_lsn() {
            a.allocating_from
        } else {
            a.durable_from.min(a.allocating_from)
        };
        (inserted.max(a.lsn), from)
    } else {
        (a.lsn, a.durable_from)
    };
    if !committed && lsn <= durable {
        return;
    }
    let entry = Finished {
        stream: a.stream,
        instance: a.instance,
        xid: a.xid,
        latest_completed: stamp,
        min_id: a.min_id,
        durable_from,
        lsn,
        lsn_prefix_max: 0,
        aborted: !committed,
    };
    // Full: the oldest entry makes room and is folded into its stream's
    // summary.
    if let Some(evicted) = locked.ring_push(entry) {
        fold_into_summary(
            &mut locked.streams()[evicted.stream as usize].summary,
            &evicted,
        );
        #[cfg(feature = "stats")]
        {
            let stats = &mut locked.h().stats;
            stats.ring_folds = stats.ring_folds.wrapping_add(1);
        }
    }
}

/// The streams a transaction's end has counted (`xact_commit`,
/// `xact_rollback`): once per stream, however many of its writers or holds
/// the transaction used. Without allocating.
#[cfg(feature = "stats")]
struct Counted {
    streams: [i32; 16],
    n: usize,
}

#[cfg(feature = "stats")]
impl Counted {
    fn new() -> Counted {
        Counted {
            streams: [-1; 16],
            n: 0,
        }
    }

    /// Count the transaction's end for `s` (state `stream`) unless it was
    /// counted already. Beyond 16 streams in one transaction, a stream may
    /// be counted once per entry.
    fn count(&mut self, s: &mut StreamState, stream: i32, committed: bool) {
        if self.streams[..self.n].contains(&stream) {
            return;
        }
        if self.n < self.streams.len() {
            self.streams[self.n] = stream;
            self.n += 1;
        }
        // Beside `generation`, on the line this end writes anyway.
        if committed {
            s.xact_commit = s.xact_commit.wrapping_add(1);
        } else {
            s.xact_rollback = s.xact_rollback.wrapping_add(1);
        }
    }
}

/// The entry (a transaction's or a hold) no longer holds a place among its
/// stream's writers; with `committed`, its writer is remembered (the place
/// was reserved when the entry was created, or the writer was remembered
/// then, and stays so).
fn settle_seen(s: &mut StreamState, a: &Active, committed: bool) {
    if committed && a.instance != ALL_WRITERS && !a.ghost {
        s.add_seen(a.instance);
    }
}

/// The IDs handed out by this backend's transaction are finished, and its
/// holds taken, released or given back. Called from the commit and abort
/// callbacks: nothing here may raise an ERROR or panic, allocate, or run SQL.
pub fn end_transaction(committed: bool) {
    // SAFETY: runs in this backend only; HEADER is checked non-null; the
    // slot index is this backend's own and checked against n_slots; the
    // shared structures are touched under the registry lock; XLogFlush and
    // ConditionVariableBroadcast raise no ERROR (a WAL write failure is a
    // PANIC anywhere).
    unsafe {
        if !HOLDING || HEADER.is_null() {
            return;
        }
        HOLDING = false;
        let procno = super::shmem::my_proc_number();
        if procno < 0 || procno as u32 >= (*HEADER).n_slots {
            return;
        }
        let slot = procno as usize;
        crate::guc::test_pause_before_release();
        if !committed {
            // An abort releases its IDs, so the sequence record that covers
            // them should be on disk first, or a crash could hand them out
            // again (until it is, they stay in the ring, held). Rare: nextval
            // logs once per 32 values and after a checkpoint. An allocation
            // that failed before recording its WAL position is covered by
            // flushing everything inserted so far.
            let needed = own_slot_lsn_needed(slot, true);
            if needed > unguarded::GetFlushRecPtr(ptr::null_mut()) {
                pg_sys::XLogFlush(needed);
            }
        }
        // Only an abort's entries are kept or dropped by durability.
        let durable = if committed { 0 } else { durable_lsn() };
        let locked = Locked::acquire_raw(HEADER, Section::EndTransaction);
        let h = locked.h();
        // Read under the lock, after our own end: every snapshot whose xmax
        // is past it + 1 was taken after this push (see visibility.rs).
        let stamp = latest_completed();
        let mut woken = Woken::new();
        #[cfg(feature = "stats")]
        let mut counted = Counted::new();
        let header = &locked.slot_headers()[slot];
        let was_active = header.used > 0 || header.held > 0;
        for a in locked.entries_in_use(slot).iter_mut() {
            let stream = a.stream as usize;
            woken.add(stream);
            #[cfg(feature = "stats")]
            if !a.shadow {
                counted.count(&mut locked.streams()[stream], a.stream, committed);
            }
            if a.shadow {
                // A released hold: finished with this commit (the hold
                // itself goes below); after an abort the hold goes on.
                if committed {
                    push_finished(&locked, a, true, stamp, durable);
                }
            } else {
                push_finished(&locked, a, committed, stamp, durable);
                settle_seen(&mut locked.streams()[stream], a, committed);
            }
            locked.streams()[stream].generation += 1;
            *a = FREE_ACTIVE;
        }
        locked.slot_headers()[slot].used = 0;
        // The worker's releases of orphaned holds, with its xid.
        end_orphan_releases(
            &locked,
            committed,
            unguarded::GetTopTransactionIdIfAny(),
            stamp,
            &mut woken,
        );
        // Holds: taken in this transaction (confirmed by its commit,
        // abandoned by its abort, like its own IDs; failed half-way:
        // abandoned), or released in it (gone with its commit).
        let holds = locked.session_slot(slot);
        let mut held = locked.slot_headers()[slot].held as usize;
        let mut k = 0;
        while k < held {
            let a = holds[k];
            let stream = a.stream as usize;
            // A hold taken in this transaction is one of its allocations.
            #[cfg(feature = "stats")]
            if !a.confirmed {
                counted.count(&mut locked.streams()[stream], a.stream, committed);
            }
            let abandoned = a.pending || (!a.confirmed && !committed);
            let released = committed && a.releasing;
            if abandoned || released {
                if abandoned {
                    push_finished(&locked, &a, false, stamp, durable);
                }
                settle_seen(&mut locked.streams()[stream], &a, released);
                locked.streams()[stream].generation += 1;
                woken.add(stream);
                held -= 1;
                holds[k] = holds[held];
                holds[held] = FREE_ACTIVE;
                continue;
            }
            let a = &mut holds[k];
            a.confirmed = true;
            a.releasing = false;
            k += 1;
        }
        locked.slot_headers()[slot].held = held as u32;
        locked.update_active(slot, was_active);
        let streams = locked.streams().as_mut_ptr();
        let n_streams = h.n_streams as usize;
        drop(locked);
        woken.broadcast(streams, n_streams);
    }
}

/// A session that ends with holds leaves them to the position worker
/// (`Orphans`): folded into their streams' records, which hold every
/// writer back from their lowest ID. Called at backend exit, after the
/// open transaction was given up; nothing here may raise an ERROR.
fn orphan_holds() {
    // SAFETY: as in `end_transaction`.
    unsafe {
        if HEADER.is_null() {
            return;
        }
        let procno = super::shmem::my_proc_number();
        if procno < 0 || procno as u32 >= (*HEADER).n_slots {
            return;
        }
        let slot = procno as usize;
        if shmem::own_holds_unlocked(slot).is_empty() {
            return;
        }
        let locked = Locked::acquire_raw(HEADER, Section::EndTransaction);
        let header = &locked.slot_headers()[slot];
        let was_active = header.used > 0 || header.held > 0;
        let mut woken = Woken::new();
        for a in locked.holds_in_use(slot).iter_mut() {
            let stream = a.stream as usize;
            let s = &mut locked.streams()[stream];
            // The writer's rows are other transactions': it stays listed.
            settle_seen(s, a, true);
            // A hold taken under a name a savepoint took back holds every
            // writer: its id is gone.
            let writer = if a.ghost { ALL_WRITERS } else { a.instance };
            s.orphans.fold(writer, a.min_id, a.lsn);
            s.generation += 1;
            woken.add(stream);
            *a = FREE_ACTIVE;
        }
        locked.slot_headers()[slot].held = 0;
        locked.update_active(slot, was_active);
        let streams = locked.streams().as_mut_ptr();
        let n_streams = locked.h().n_streams as usize;
        drop(locked);
        woken.broadcast(streams, n_streams);
    }
}

/// Before commit: a transaction that wrote no WAL of its own (it only
/// allocated) commits without flushing the WAL, so its IDs would be held
/// until the WAL writer flushes their sequence record. Flush it now instead,
/// when it is not on disk yet (after a checkpoint, or once per 32 values).
/// Under synchronous_commit = off the IDs wait for the WAL writer, like the
/// commit itself.
pub fn flush_before_commit() {
    // SAFETY: runs in this backend before commit; HEADER checked non-null;
    // the slot is this backend's own and checked against n_slots.
    unsafe {
        if !HOLDING || HEADER.is_null() || pg_sys::XactLastRecEnd != 0 {
            return;
        }
        if pg_sys::synchronous_commit <= pg_sys::SyncCommitLevel::SYNCHRONOUS_COMMIT_OFF as i32 {
            return;
        }
        let procno = super::shmem::my_proc_number();
        if procno < 0 || procno as u32 >= (*HEADER).n_slots {
            return;
        }
        let needed = own_slot_lsn_needed(procno as usize, false);
        if needed > unguarded::GetFlushRecPtr(ptr::null_mut()) {
            pg_sys::XLogFlush(needed);
        }
    }
}

/// The highest WAL position this backend's entries need durable (with
/// `aborting`, also the holds the abort gives up); for an allocation that
/// failed before recording it, everything inserted so far.
///
/// # Safety
/// The registry must be initialised and `slot` must be the caller's.
unsafe fn own_slot_lsn_needed(slot: usize, aborting: bool) -> u64 {
    let needed = |a: &Active| {
        if a.pending || a.allocating_from != 0 {
            // SAFETY: GetXLogInsertRecPtr raises no error.
            unsafe { unguarded::GetXLogInsertRecPtr() }
        } else {
            a.lsn
        }
    };
    // SAFETY: forwarded from the caller.
    unsafe {
        let own = shmem::own_slot_unlocked(slot)
            .iter()
            .filter(|a| a.stream >= 0)
            .map(needed)
            .max()
            .unwrap_or(0);
        let holds = shmem::own_holds_unlocked(slot)
            .iter()
            .filter(|a| a.pending || (aborting && !a.confirmed))
            .map(needed)
            .max()
            .unwrap_or(0);
        own.max(holds)
    }
}

fn register_exit_callback() {
    // SAFETY: backend-local flag; before_shmem_exit is called once.
    unsafe {
        if !EXIT_CALLBACK_REGISTERED {
            pg_sys::before_shmem_exit(Some(on_exit), pg_sys::Datum::from(0));
            EXIT_CALLBACK_REGISTERED = true;
        }
    }
}

/// A backend that exits in the middle of a transaction releases its IDs here.
/// before_shmem_exit callbacks run in reverse order of registration, and ours
/// is registered after the one that aborts the open transaction
/// (ShutdownPostgres), so this runs first, while the transaction still shows
/// as running: that is safe, as an exiting backend's transaction can no
/// longer commit.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_exit(_code: i32, _arg: pg_sys::Datum) {
    end_transaction(false);
    orphan_holds();
}

/// One row of `streampos.in_flight()`.
pub struct InFlight {
    pub db: pg_sys::Oid,
    pub key: i32,
    /// None for orphaned holds (of sessions that ended): `orphan_of`.
    pub instance_name: Option<String>,
    /// The writer of orphaned holds, when known (None: folded with others).
    pub orphan_of: Option<i32>,
    pub role: pg_sys::Oid,
    /// None for orphaned holds.
    pub pid: Option<i32>,
    /// None for holds: a session holds them, not a transaction.
    pub xid: Option<TransactionId>,
    pub min_id: i64,
    pub max_id: i64,
    pub ids: i64,
    pub since: pg_sys::TimestampTz,
}

/// What a transaction being prepared may hold rows of: every hold given
/// out in database `db` (by any session; a transaction that holds cannot
/// be prepared) and its streams' orphaned holds, as (stream key, writer or
/// `ALL_WRITERS`, lowest ID), one per writer. Recorded with the prepared
/// transaction, since holds do not outlive a start and it does
/// (docs/design.md, "What outlives a start").
pub fn holds_for_prepare(db: pg_sys::Oid) -> Result<Vec<(i32, i32, i64)>, Error> {
    let locked = Locked::acquire(Section::OtherShared)?;
    let streams = locked.streams();
    let mut lowest: Vec<(i32, i32, i64)> = Vec::new();
    let mut fold = |key: i32, writer: i32, min_id: i64| match lowest
        .iter_mut()
        .find(|l| l.0 == key && l.1 == writer)
    {
        Some(l) => l.2 = l.2.min(min_id),
        None => lowest.push((key, writer, min_id)),
    };
    for &slot_index in locked.active_slots() {
        for a in locked.holds_in_use(slot_index as usize) {
            let s = &streams[a.stream as usize];
            if s.in_use && s.db == db {
                // A hold under a name a savepoint took back holds every
                // writer (as when it is orphaned).
                fold(
                    s.key,
                    if a.ghost { ALL_WRITERS } else { a.instance },
                    a.min_id,
                );
            }
        }
    }
    for s in streams
        .iter()
        .filter(|s| s.in_use && s.db == db && s.orphans.valid)
    {
        for (writer, min_id, _) in s.orphans.parts() {
            fold(s.key, writer, min_id);
        }
    }
    Ok(lowest)
}

/// Every allocation of a transaction that has not ended, every hold, and
/// every stream's orphaned holds, in any database.
pub fn in_flight() -> Result<Vec<InFlight>, Error> {
    let locked = Locked::acquire(Section::OtherShared)?;
    let streams = locked.streams();
    let mut rows = Vec::new();
    for &slot_index in locked.active_slots() {
        let slot_index = slot_index as usize;
        let header = &locked.slot_headers()[slot_index];
        let entries = locked
            .entries_in_use(slot_index)
            .iter()
            .filter(|a| !a.shadow);
        let holds = locked.holds_in_use(slot_index).iter();
        for (a, is_hold) in entries.map(|a| (a, false)).chain(holds.map(|a| (a, true))) {
            let s = &streams[a.stream as usize];
            rows.push(InFlight {
                db: s.db,
                key: s.key,
                instance_name: Some(
                    String::from_utf8_lossy(a.name.split(|&b| b == 0).next().unwrap_or_default())
                        .into_owned(),
                ),
                orphan_of: None,
                role: header.role,
                pid: Some(header.pid),
                xid: (!is_hold).then_some(a.xid),
                min_id: a.min_id,
                max_id: a.max_id,
                ids: a.count,
                since: a.since,
            });
        }
    }
    for s in streams.iter().filter(|s| s.in_use && s.orphans.valid) {
        for (instance, min_id, _) in s.orphans.parts() {
            rows.push(InFlight {
                db: s.db,
                key: s.key,
                instance_name: None,
                orphan_of: (instance != ALL_WRITERS).then_some(instance),
                role: pg_sys::InvalidOid,
                pid: None,
                xid: None,
                min_id,
                max_id: s.max_allocated.max(min_id),
                ids: 0,
                since: 0,
            });
        }
    }
    Ok(rows)
}
