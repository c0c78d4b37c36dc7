//! Which database has a position worker: one slot per database, claimed by
//! the worker itself, marked "starting" by the backend that launches it.

use std::ptr;

use pgrx::pg_sys;

use super::shmem::{Locked, WorkerSlot};
use crate::error::Error;
use crate::ffi;

/// Is process `pid` alive? (A worker slot whose process died is free.)
fn alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence.
    unsafe { ffi::kill(pid, 0) == 0 }
}

/// Called by the worker: take this database's slot, unless another live
/// worker has it.
pub fn claim_worker_slot(db: pg_sys::Oid) -> Result<bool, Error> {
    let locked = Locked::acquire(true)?;
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
            *w = WorkerSlot { db, pid: me, latch };
            Ok(true)
        }
        None => Ok(false),
    }
}

pub fn release_worker_slot(db: pg_sys::Oid) {
    if let Ok(locked) = Locked::acquire(true) {
        // SAFETY: process identity global.
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
        if w.pid == -1 || (w.pid > 0 && alive(w.pid)) {
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
