//! Followers sleep on their stream's condition variable, which every
//! transaction that held IDs of the stream broadcasts when it ends.

use pgrx::pg_sys;

use super::shmem::{Locked, Section};
use super::streams::generation;
use crate::error::Error;

/// Sleep until the stream's generation moves past `seen`, or `timeout_ms`
/// passes. Returns false on timeout.
pub fn wait_for_change(stream: usize, seen: u64, timeout_ms: i64) -> Result<bool, Error> {
    let cv = {
        let locked = Locked::acquire(Section::OtherShared)?;
        &mut locked.streams()[stream].cv as *mut pg_sys::ConditionVariable
    };
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_millis(timeout_ms.max(0) as u64);
    // SAFETY: the condition variable lives in shared memory for the life of
    // the server.
    unsafe { pg_sys::ConditionVariablePrepareToSleep(cv) };
    let changed = loop {
        if generation(stream)? != seen {
            break true;
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            break false;
        }
        // Rounded up: a sleep of 0 ms returns at once, and a loop on the
        // last fraction of a millisecond would spin until the deadline.
        let left = (deadline - now)
            .as_micros()
            .div_ceil(1000)
            .clamp(1, i32::MAX as u128) as i64;
        // Wakes on broadcast, timeout, or an interrupt (which is then raised).
        // SAFETY: prepared above on the same condition variable.
        unsafe { pg_sys::ConditionVariableTimedSleep(cv, left, pg_sys::PG_WAIT_EXTENSION) };
    };
    // SAFETY: ends the sleep prepared above (also done by abort cleanup).
    unsafe { pg_sys::ConditionVariableCancelSleep() };
    Ok(changed)
}
