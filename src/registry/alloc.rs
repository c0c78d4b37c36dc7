//! Allocation and transaction end: a backend publishes what its transaction
//! holds in its own slot, and moves it to the finished ring when the
//! transaction ends.

use std::ptr;

use pgrx::pg_sys;
use pgrx::pg_sys::TransactionId;

use super::shmem::{
    self, Active, Finished, Locked, Section, FREE_ACTIVE, HEADER, NAME_BYTES, SEEN_WRITERS,
};
use super::streams::{matches, Stale};
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
    lower_bound: i64,
}

/// Step 1 of an allocation: publish, before `nextval` runs, a lower bound
/// for the IDs this transaction is about to take. Without it a reader could
/// see a later ID registered by another writer and report a frontier past
/// ours.
pub fn begin_allocation(
    stream: usize,
    key: i32,
    seq: pg_sys::Oid,
    instance: i32,
    instance_name: &str,
    open_stream: bool,
    xid: TransactionId,
) -> Result<Result<Allocation, Stale>, Error> {
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
        reserved_seen: false,
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
    if let Some(i) = locked
        .entries_in_use(slot_index)
        .iter()
        .position(|a| a.stream == stream_i32 && a.instance == instance)
    {
        // The existing entry's minimum is already below anything new, as
        // long as the new IDs are above what was allocated by now.
        return Ok(Ok(Allocation {
            entry: i,
            lower_bound,
        }));
    }
    let header = &mut locked.slot_headers()[slot_index];
    let i = header.used as usize;
    let slot = locked.slot(slot_index);
    if i >= slot.len() {
        return Err(Error::RegistryFull {
            what: "entry for this transaction",
            guc: "streampos.max_streams_per_transaction",
        });
    }
    // A writer the stream does not remember yet needs a place among the
    // writers its tokens list; on a stream open to any writer, one it
    // would have to forget is refused (a configured stream's tokens list
    // its configured writers instead).
    let s = &mut locked.streams()[stream];
    if !s.has_seen(instance) {
        if (s.n_seen + s.seen_reserved) as usize >= SEEN_WRITERS {
            if open_stream {
                return Err(Error::TooManyWriters {
                    limit: SEEN_WRITERS,
                });
            }
        } else {
            s.seen_reserved += 1;
            entry.reserved_seen = true;
        }
    }
    entry.min_id = lower_bound;
    entry.max_id = lower_bound;
    entry.durable_from = lower_bound;
    slot[i] = entry;
    header.pid = pid;
    header.db = db;
    header.role = role;
    // SAFETY: backend-local flag.
    unsafe { HOLDING = true };
    // Counted once written: lock-free readers copy entries below `used`
    // (this section does not move the seqlock counter).
    shmem::publish(&mut header.used, i as u32 + 1);
    if i == 0 {
        locked.activate_slot(slot_index);
    }
    Ok(Ok(Allocation {
        entry: i,
        lower_bound,
    }))
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
    let earlier = unsafe { shmem::own_slot_unlocked(slot_index)[allocation.entry] };
    if !earlier.pending && lsn > earlier.lsn {
        wait_until_durable(earlier.lsn);
    }
    let locked = Locked::acquire(Section::FinishAllocation)?;
    let a = &mut locked.slot(slot_index)[allocation.entry];
    // In this order, for lock-free readers (this section does not move the
    // seqlock counter): the WAL position, then where it starts to count,
    // then the first ID and `pending`, then the highest allocated ID. A
    // reader that sees the new highest ID sees the rest; one that does
    // not, stops below these IDs; one that sees the new WAL position with
    // the old `durable_from` holds more, never less.
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
    let s = &mut locked.streams()[stream];
    let highest = s.max_allocated.max(last);
    shmem::publish(&mut s.max_allocated, highest);
    Ok(())
}

/// The IDs handed out by this backend's transaction are finished. Called from
/// the commit and abort callbacks: nothing here may raise an ERROR or panic,
/// allocate, or run SQL.
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
        let procno = (*pg_sys::MyProc).pgprocno;
        if procno < 0 || procno as u32 >= (*HEADER).n_slots {
            return;
        }
        crate::guc::test_pause_before_release();
        if !committed {
            // An abort releases its IDs, so the sequence record that covers
            // them should be on disk first, or a crash could hand them out
            // again (until it is, they stay in the ring, held). Rare: nextval
            // logs once per 32 values and after a checkpoint. An allocation
            // that failed before recording its WAL position is covered by
            // flushing everything inserted so far.
            let needed = own_slot_lsn_needed(procno as usize);
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
        // Streams to wake, without allocating.
        let mut woken = [usize::MAX; 16];
        let mut n_woken = 0;
        let mut wake_all = false;
        for a in locked.entries_in_use(procno as usize).iter_mut() {
            let stream = a.stream as usize;
            if !woken[..n_woken].contains(&stream) {
                if n_woken < woken.len() {
                    woken[n_woken] = stream;
                    n_woken += 1;
                } else {
                    wake_all = true;
                }
            }
            // An allocation that failed before recording its WAL position
            // is held until everything inserted so far is durable.
            let (lsn, durable_from) = if a.pending {
                (unguarded::GetXLogInsertRecPtr(), a.min_id)
            } else {
                (a.lsn, a.durable_from)
            };
            // A commit stays in the ring for snapshots that do not see it
            // yet; an abort only while its IDs are not durable.
            if committed || lsn > durable {
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
                // Full: the oldest entry makes room and is folded into its
                // stream's summary.
                if let Some(evicted) = locked.ring_push(entry) {
                    fold_into_summary(
                        &mut locked.streams()[evicted.stream as usize].summary,
                        &evicted,
                    );
                }
            }
            let s = &mut locked.streams()[stream];
            if a.reserved_seen {
                s.seen_reserved = s.seen_reserved.saturating_sub(1);
            }
            // Room was reserved when the entry was created (or the writer
            // was remembered then, and stays so).
            if committed {
                s.add_seen(a.instance);
            }
            s.generation += 1;
            *a = FREE_ACTIVE;
        }
        let header = &mut locked.slot_headers()[procno as usize];
        let was_active = header.used > 0;
        header.used = 0;
        if was_active {
            locked.deactivate_slot(procno as usize);
        }
        let streams = locked.streams().as_mut_ptr();
        let n_streams = h.n_streams as usize;
        drop(locked);
        // Broadcasting outside the lock; a condition variable with no
        // sleepers costs one spinlock.
        if wake_all {
            for i in 0..n_streams {
                unguarded::ConditionVariableBroadcast(&mut (*streams.add(i)).cv);
            }
        } else {
            for &i in &woken[..n_woken] {
                unguarded::ConditionVariableBroadcast(&mut (*streams.add(i)).cv);
            }
        }
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
        let procno = (*pg_sys::MyProc).pgprocno;
        if procno < 0 || procno as u32 >= (*HEADER).n_slots {
            return;
        }
        let needed = own_slot_lsn_needed(procno as usize);
        if needed > unguarded::GetFlushRecPtr(ptr::null_mut()) {
            pg_sys::XLogFlush(needed);
        }
    }
}

/// The highest WAL position this backend's entries need durable; for an
/// allocation that failed before recording it, everything inserted so far.
///
/// # Safety
/// The registry must be initialised and `slot` must be the caller's.
unsafe fn own_slot_lsn_needed(slot: usize) -> u64 {
    // SAFETY: forwarded from the caller; GetXLogInsertRecPtr raises no error.
    unsafe {
        shmem::own_slot_unlocked(slot)
            .iter()
            .filter(|a| a.stream >= 0)
            .map(|a| {
                if a.pending {
                    unguarded::GetXLogInsertRecPtr()
                } else {
                    a.lsn
                }
            })
            .max()
            .unwrap_or(0)
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
}

/// One row of `streampos.in_flight()`.
pub struct InFlight {
    pub db: pg_sys::Oid,
    pub key: i32,
    pub instance_name: String,
    pub role: pg_sys::Oid,
    pub pid: i32,
    pub xid: TransactionId,
    pub min_id: i64,
    pub max_id: i64,
    pub ids: i64,
    pub since: pg_sys::TimestampTz,
}

/// Every allocation of a transaction that has not ended, in any database.
pub fn in_flight() -> Result<Vec<InFlight>, Error> {
    let locked = Locked::acquire(Section::OtherShared)?;
    let streams = locked.streams();
    let mut rows = Vec::new();
    for &slot_index in locked.active_slots() {
        let slot_index = slot_index as usize;
        let header = &locked.slot_headers()[slot_index];
        for a in locked.entries_in_use(slot_index).iter() {
            let s = &streams[a.stream as usize];
            rows.push(InFlight {
                db: s.db,
                key: s.key,
                instance_name: String::from_utf8_lossy(
                    a.name.split(|&b| b == 0).next().unwrap_or_default(),
                )
                .into_owned(),
                role: header.role,
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
