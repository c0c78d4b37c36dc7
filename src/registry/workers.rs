//! Which database has a position worker: one slot per database, claimed by
//! the worker itself, marked "starting" by the backend that launches it.

use std::ptr;

use pgrx::pg_sys;

use super::shmem::{Locked, Section, WorkerSlot};
use crate::error::Error;
use crate::ffi;

/// A worker asked for that has not claimed its slot after this long (it
/// failed to start or died at once) no longer counts as starting.
const START_TIMEOUT_US: i64 = 10_000_000;

fn now() -> pg_sys::TimestampTz {
    // SAFETY: reads the clock; raises no error.
    unsafe { ffi::unguarded::GetCurrentTimestamp() }
}

/// A slot whose worker is gone: never started within the timeout, or its
/// process died.
fn abandoned(w: &WorkerSlot) -> bool {
    match w.pid {
        0 => true,
        -1 => now() - w.starting_since > START_TIMEOUT_US,
        pid => !alive(pid),
    }
}

/// Is process `pid` alive? (A worker slot whose process died is free.)
fn alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence.
    unsafe { ffi::kill(pid, 0) == 0 }
}

/// Called by the worker: take this database's slot, unless another live
/// worker has it.
pub fn claim_worker_slot(db: pg_sys::Oid) -> Result<bool, Error> {
    let locked = Locked::acquire(Section::OtherExclusive)?;
    let workers = &mut locked.h().workers;
    // SAFETY: process identity globals, set at process start.
    let (me, latch) = unsafe { (pg_sys::MyProcPid, pg_sys::MyLatch) };
    if let Some(w) = workers.iter_mut().find(|w| w.db == db) {
        if w.pid > 0 && w.pid != me && alive(w.pid) {
            return Ok(false);
        }
        w.pid = me;
        w.latch = latch;
        return Ok(true);
    }
    match workers.iter_mut().find(|w| w.db == pg_sys::InvalidOid) {
        Some(w) => {
            *w = WorkerSlot {
                db,
                pid: me,
                latch,
                starting_since: 0,
            };
            Ok(true)
        }
        None => Ok(false),
    }
}

/// Free this worker's slot (any database may use it next). Called on the
/// worker's exit: raises no error.
pub fn release_worker_slot(db: pg_sys::Oid) {
    if let Ok(locked) = Locked::acquire(Section::OtherExclusive) {
        // SAFETY: process identity global.
        let me = unsafe { pg_sys::MyProcPid };
        for w in locked.h().workers.iter_mut() {
            if w.db == db && w.pid == me {
                *w = WorkerSlot {
                    db: pg_sys::InvalidOid,
                    pid: 0,
                    latch: ptr::null_mut(),
                    starting_since: 0,
                };
            }
        }
    }
}

/// Is a position worker registered (or starting) for this database? Marks it
/// as starting when not, so that only one backend starts it.
pub fn worker_needed(db: pg_sys::Oid) -> bool {
    {
        let Ok(locked) = Locked::acquire(Section::OtherShared) else {
            return false;
        };
        let running = locked.h().workers.iter().any(|w| w.db == db && w.pid != 0);
        if running {
            return false;
        }
    }
    let Ok(locked) = Locked::acquire(Section::OtherExclusive) else {
        return false;
    };
    let workers = &mut locked.h().workers;
    if let Some(w) = workers.iter_mut().find(|w| w.db == db) {
        if !abandoned(w) {
            return false;
        }
        w.pid = -1;
        w.starting_since = now();
        return true;
    }
    // A free slot, or one whose worker is gone (it died without releasing
    // it, or its database was dropped).
    let free = workers
        .iter_mut()
        .find(|w| w.db == pg_sys::InvalidOid || abandoned(w));
    match free {
        Some(w) => {
            *w = WorkerSlot {
                db,
                pid: -1,
                latch: ptr::null_mut(),
                starting_since: now(),
            };
            true
        }
        None => {
            drop(locked);
            pgrx::warning!(
                "streampos: every position worker slot is taken ({} databases); writer positions of this database are not stored until one is free",
                super::shmem::MAX_DATABASES
            );
            false
        }
    }
}

/// Forget a failed start so that a later allocation tries again.
pub fn worker_start_failed(db: pg_sys::Oid) {
    if let Ok(locked) = Locked::acquire(Section::OtherExclusive) {
        for w in locked.h().workers.iter_mut() {
            if w.db == db && w.pid == -1 {
                w.pid = 0;
            }
        }
    }
}

/// The generation of every stream state of database `db` (loaded or not,
/// dropped or not): the position worker is idle while none moves.
pub fn generations_of(db: pg_sys::Oid) -> Vec<(usize, u64)> {
    let Ok(locked) = Locked::acquire(Section::OtherShared) else {
        return Vec::new();
    };
    locked
        .streams()
        .iter()
        .enumerate()
        .filter(|(_, s)| s.in_use && s.db == db)
        .map(|(i, s)| (i, s.generation))
        .collect()
}

/// The position worker of database `db` leaves if it has nothing to do:
/// nothing of the database in flight (a transaction's IDs, a hold, orphaned
/// holds), no finished IDs of it waiting to be durable (they move positions
/// when the WAL is flushed, which moves no generation: an asynchronous
/// commit, a synchronous standby behind), and no stream's generation moved
/// since `generations`. In one
/// section with freeing its slot, so that an allocation either registers
/// first (and the worker stays) or finds the slot free afterwards (and
/// starts a new worker: `worker_launch::ensure_running` runs after the
/// allocation's entry is published). True when it left.
pub fn leave_if_idle(db: pg_sys::Oid, generations: &[(usize, u64)]) -> bool {
    // Read before the lock: a durable point read earlier is lower, which
    // only keeps the worker.
    let durable = super::visibility::durable_lsn();
    let Ok(locked) = Locked::acquire(Section::OtherExclusive) else {
        return false;
    };
    let streams = locked.streams();
    let mine = |stream: i32| {
        streams
            .get(stream as usize)
            .is_some_and(|s| s.in_use && s.db == db)
    };
    for &slot in locked.active_slots() {
        let slot = slot as usize;
        if locked
            .entries_in_use(slot)
            .iter()
            .chain(locked.holds_in_use(slot).iter())
            .any(|a| mine(a.stream))
        {
            return false;
        }
    }
    let now: Vec<(usize, u64)> = streams
        .iter()
        .enumerate()
        .filter(|(_, s)| s.in_use && s.db == db)
        .map(|(i, s)| (i, s.generation))
        .collect();
    if now != generations
        || streams.iter().any(|s| {
            s.in_use
                && s.db == db
                && (s.orphans.valid || (s.summary.valid && s.summary.lsn > durable))
        })
    {
        return false;
    }
    if locked.h().ring_lsn_max > durable
        && locked
            .ring_entries()
            .any(|f| f.lsn > durable && mine(f.stream))
    {
        return false;
    }
    // SAFETY: process identity global.
    let me = unsafe { pg_sys::MyProcPid };
    for w in locked.h().workers.iter_mut() {
        if w.db == db && w.pid == me {
            *w = WorkerSlot {
                db: pg_sys::InvalidOid,
                pid: 0,
                latch: ptr::null_mut(),
                starting_since: 0,
            };
        }
    }
    true
}
