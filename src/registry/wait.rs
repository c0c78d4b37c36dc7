//! Sleeping on a stream's condition variable, which every
//! transaction that held IDs of the stream broadcasts when it ends; and, on
//! a hot standby, on the replay condition variable, which the replay of
//! the primary's "positions stored" records broadcasts.

use pgrx::pg_sys;

use std::sync::atomic::Ordering;

use super::shmem::{Locked, Section, HEADER, REPLAY_BUCKETS};
use super::streams::generation;
use crate::error::Error;

/// Why `wait_for_change` returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Woken {
    /// The stream's generation moved.
    Changed,
    TimedOut,
    /// The client's connection closed (only with `watch_client`).
    ClientGone,
}

/// Can a sleep also watch the client's socket (`WL_SOCKET_CLOSED`,
/// PostgreSQL 15 and later, where the platform reports it)? Otherwise a
/// waiter must wake to ask.
pub fn watches_client() -> bool {
    #[cfg(not(feature = "pg14"))]
    // SAFETY: a constant of the build's wait-event implementation.
    return unsafe { pg_sys::WaitEventSetCanReportClosed() };
    #[cfg(feature = "pg14")]
    false
}

/// Sleep until the stream's generation moves past `seen`, `timeout_ms`
/// passes, or (with `watch_client`, where `watches_client()`) the client's
/// connection closes. Query cancel and termination are raised as usual.
pub fn wait_for_change(
    stream: usize,
    seen: u64,
    timeout_ms: i64,
    watch_client: bool,
) -> Result<Woken, Error> {
    let cv = {
        let locked = Locked::acquire(Section::OtherShared)?;
        &mut locked.streams()[stream].cv as *mut pg_sys::ConditionVariable
    };
    sleep_on(cv, timeout_ms, watch_client, || {
        Ok(generation(stream)? != seen)
    })
}

/// Sleep on condition variable `cv` until `changed` says so, `timeout_ms`
/// passes, or (with `watch_client`, where `watches_client()`) the client's
/// connection closes. Query cancel and termination are raised as usual.
fn sleep_on(
    cv: *mut pg_sys::ConditionVariable,
    timeout_ms: i64,
    watch_client: bool,
    mut changed: impl FnMut() -> Result<bool, Error>,
) -> Result<Woken, Error> {
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_millis(timeout_ms.max(0) as u64);
    let watch_client = watch_client && watches_client();
    let woken = loop {
        // On the list before the condition is read: a broadcast after
        // the read sets our latch.
        // SAFETY: the condition variable lives in shared memory for the
        // life of the server; preparing again replaces the earlier one.
        unsafe { pg_sys::ConditionVariablePrepareToSleep(cv) };
        if changed()? {
            break Woken::Changed;
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            break Woken::TimedOut;
        }
        // Rounded up: a sleep of 0 ms returns at once, and a loop on the
        // last fraction of a millisecond would spin until the deadline.
        let left = (deadline - now)
            .as_micros()
            .div_ceil(1000)
            .clamp(1, i32::MAX as u128) as i64;
        if watch_client {
            if sleep_watching_client(left) {
                break Woken::ClientGone;
            }
            pgrx::check_for_interrupts!();
        } else {
            // Wakes on broadcast, timeout, or an interrupt (then raised).
            // SAFETY: prepared above on the same condition variable.
            unsafe { pg_sys::ConditionVariableTimedSleep(cv, left, pg_sys::PG_WAIT_EXTENSION) };
        }
    };
    // SAFETY: ends the sleep prepared above (also done by abort cleanup).
    unsafe { pg_sys::ConditionVariableCancelSleep() };
    Ok(woken)
}

/// Sleep on the backend's client wait set (its latch, which a broadcast
/// sets, and its socket, for closing) for at most `timeout_ms`; whether
/// the client's connection closed. The latch is reset: the caller looks
/// at what it was set for.
#[cfg(not(feature = "pg14"))]
fn sleep_watching_client(timeout_ms: i64) -> bool {
    use crate::ffi::{FeBeWaitSet, FE_BE_WAIT_SET_SOCKET_POS};
    // SAFETY: FeBeWaitSet is the backend's own (set up at connection, for a
    // backend with a client: the caller checked); every user of its socket
    // position sets the events it waits for first, as pq_check_connection
    // does. The events array outlives the call.
    unsafe {
        pg_sys::ModifyWaitEvent(
            FeBeWaitSet,
            FE_BE_WAIT_SET_SOCKET_POS,
            pg_sys::WL_SOCKET_CLOSED,
            std::ptr::null_mut(),
        );
        let mut events: [pg_sys::WaitEvent; 3] = std::mem::zeroed();
        let n = pg_sys::WaitEventSetWait(
            FeBeWaitSet,
            timeout_ms as std::ffi::c_long,
            events.as_mut_ptr(),
            events.len() as i32,
            pg_sys::PG_WAIT_EXTENSION,
        );
        let mut closed = false;
        for event in &events[..n.max(0) as usize] {
            if event.events & pg_sys::WL_SOCKET_CLOSED != 0 {
                closed = true;
            }
            if event.events & pg_sys::WL_LATCH_SET != 0 {
                pg_sys::ResetLatch(pg_sys::MyLatch);
            }
            if event.events & pg_sys::WL_POSTMASTER_DEATH != 0 {
                // As every wait of a backend with WL_EXIT_ON_PM_DEATH.
                pg_sys::proc_exit(1);
            }
        }
        closed
    }
}

#[cfg(feature = "pg14")]
fn sleep_watching_client(_timeout_ms: i64) -> bool {
    false
}

fn replay_bucket(db: pg_sys::Oid, key: i32) -> usize {
    (db.to_u32().wrapping_mul(0x9E37_79B9) ^ key as u32) as usize % REPLAY_BUCKETS
}

/// Where a hot standby's follower of stream `key` of database `db` stands:
/// (records replayed, its bucket's count). None without the registry.
pub fn replay_seen(db: pg_sys::Oid, key: i32) -> Option<(u64, u64)> {
    // SAFETY: HEADER is set once per process at start-up; the counters are
    // atomics.
    unsafe {
        if HEADER.is_null() {
            return None;
        }
        let r = &(*HEADER).replay;
        Some((
            r.records.load(Ordering::Acquire),
            r.buckets[replay_bucket(db, key)].load(Ordering::Acquire),
        ))
    }
}

/// Records replayed since start-up (None without the registry).
pub fn replay_records() -> Option<u64> {
    // SAFETY: as in `replay_seen`.
    unsafe { (!HEADER.is_null()).then(|| (*HEADER).replay.records.load(Ordering::Acquire)) }
}

/// The replay of a record saying the primary stored positions of streams
/// `keys` of database `db` (committed before the record): wake their
/// followers. Runs in the startup process: no error, no allocation.
#[cfg(not(feature = "pg14"))]
pub fn replayed(db: pg_sys::Oid, keys: &[i32]) {
    // SAFETY: as in `replay_seen`; broadcasting sets the sleepers' latches.
    unsafe {
        if HEADER.is_null() {
            return;
        }
        let r = &mut (*HEADER).replay;
        for &key in keys {
            r.buckets[replay_bucket(db, key)].fetch_add(1, Ordering::AcqRel);
        }
        r.records.fetch_add(1, Ordering::AcqRel);
        pg_sys::ConditionVariableBroadcast(&mut r.cv);
    }
}

/// On a hot standby: sleep until stream `key`'s bucket moves past `seen`
/// (its positions may have been stored and replayed), `timeout_ms` passes,
/// or (with `watch_client`) the client's connection closes.
pub fn wait_for_replay(
    db: pg_sys::Oid,
    key: i32,
    seen: u64,
    timeout_ms: i64,
    watch_client: bool,
) -> Result<Woken, Error> {
    // SAFETY: HEADER is set once per process at start-up.
    let cv = unsafe {
        if HEADER.is_null() {
            return Err(Error::NotLoaded);
        }
        &raw mut (*HEADER).replay.cv
    };
    sleep_on(cv, timeout_ms, watch_client, || {
        Ok(replay_seen(db, key).map(|s| s.1) != Some(seen))
    })
}
