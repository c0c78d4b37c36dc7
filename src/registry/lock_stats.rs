//! Registry lock statistics, in bench builds only (cargo feature
//! `lock-stats`, off by default: without it none of this is compiled and
//! `Locked` is a bare pointer).
//!
//! For every lock section (`Section`): acquisitions, nanoseconds spent
//! waiting for the lock and nanoseconds holding it. Each process adds to
//! counters of its own (its backend slot's, on cache lines of their own, so
//! that counting adds no contention); `totals` sums them. The clock is read
//! once just before `LWLockAcquire`, once when it returns and once just
//! before `LWLockRelease`: the hold time includes one clock read.
//!
//! One more row counts readers' lock-free copies (`visibility::view`): how
//! many completed without the lock, the time they took (tries included),
//! how many gave up and took the lock shared (counted in `view` too), and
//! how many active backend slots the completed copies visited.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use pgrx::pg_sys;

use super::section::Section;

/// Where the statistics are: the registry's base address, their offset in
/// it, and the number of backend slots (the registry passes it down).
#[derive(Clone, Copy)]
pub(super) struct Area {
    pub base: *mut u8,
    pub offset: usize,
    pub n_slots: usize,
}

/// acquisitions, wait ns, hold ns, fallbacks, slots visited
const FIELDS: usize = 5;
/// The rows: one per section, then the lock-free copies.
const ROWS: usize = Section::ALL.len() + 1;
const LOCK_FREE_ROW: usize = Section::ALL.len();

fn slot_bytes() -> usize {
    (ROWS * FIELDS * size_of::<u64>()).div_ceil(64) * 64
}

/// Bytes for `n_slots` backend slots and one more, shared by processes
/// without a slot.
pub(super) fn bytes(n_slots: usize) -> usize {
    (n_slots + 1) * slot_bytes() + 64
}

/// When the lock was asked for and when it was granted.
pub(super) struct Timing {
    section: Section,
    asked: Instant,
    acquired: Instant,
}

impl Timing {
    pub fn acquired(section: Section, asked: Instant) -> Timing {
        Timing {
            section,
            asked,
            acquired: Instant::now(),
        }
    }

    pub fn held_ns(&self) -> u64 {
        self.acquired.elapsed().as_nanos() as u64
    }
}

pub(super) fn now() -> Instant {
    Instant::now()
}

/// The counters of slot `slot` (the extra one is `n_slots`).
///
/// # Safety
/// `area` is the initialised registry's; `slot <= area.n_slots`.
unsafe fn counters(area: Area, slot: usize) -> *const AtomicU64 {
    // SAFETY: forwarded from the caller; the area is 64-byte aligned (see
    // `bytes`) and zeroed at start-up, a valid bit pattern for atomics.
    unsafe {
        let base = area.base.add(area.offset);
        let aligned = base.add(base.align_offset(64));
        aligned.add(slot * slot_bytes()) as *const AtomicU64
    }
}

/// This process's counters for row `row`.
///
/// # Safety
/// `area` is the initialised registry's.
unsafe fn my_row(area: Area, row: usize) -> *const AtomicU64 {
    // SAFETY: forwarded from the caller; MyProc is checked before use.
    unsafe {
        let n_slots = area.n_slots;
        let procno = if pg_sys::MyProc.is_null() {
            -1
        } else {
            crate::backend::my_proc_number()
        };
        let slot = match procno {
            procno if procno >= 0 && (procno as usize) < n_slots => procno as usize,
            _ => n_slots,
        };
        counters(area, slot).add(row * FIELDS)
    }
}

/// Count one lock section of this process.
///
/// # Safety
/// `area` is the initialised registry's.
pub(super) unsafe fn record(area: Area, t: &Timing, held_ns: u64) {
    // SAFETY: forwarded from the caller.
    unsafe {
        let c = my_row(area, t.section as usize);
        let waited = t.acquired.duration_since(t.asked).as_nanos() as u64;
        (*c).fetch_add(1, Ordering::Relaxed);
        (*c.add(1)).fetch_add(waited, Ordering::Relaxed);
        (*c.add(2)).fetch_add(held_ns, Ordering::Relaxed);
    }
}

/// Count one lock-free copy that started at `started`: completed, or given
/// up for the lock.
pub(super) fn record_lock_free(
    area: Option<Area>,
    started: Instant,
    completed: bool,
    slots_visited: usize,
) {
    let ns = started.elapsed().as_nanos() as u64;
    let Some(area) = area else {
        return;
    };
    // SAFETY: the area is the initialised registry's.
    unsafe {
        let c = my_row(area, LOCK_FREE_ROW);
        if completed {
            (*c).fetch_add(1, Ordering::Relaxed);
            (*c.add(2)).fetch_add(ns, Ordering::Relaxed);
            (*c.add(4)).fetch_add(slots_visited as u64, Ordering::Relaxed);
        } else {
            (*c.add(1)).fetch_add(ns, Ordering::Relaxed);
            (*c.add(3)).fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One section's totals over every process since start-up.
pub struct SectionTotals {
    pub section: &'static str,
    /// "exclusive", "shared", or "none" (lock-free copies).
    pub mode: &'static str,
    pub acquisitions: u64,
    pub wait_ns: u64,
    pub hold_ns: u64,
    pub fallbacks: u64,
    pub slots_visited: u64,
}

pub(super) fn totals(area: Option<Area>) -> Vec<SectionTotals> {
    let Some(area) = area else {
        return Vec::new();
    };
    (0..ROWS)
        .map(|row| {
            let (section, mode) = match Section::ALL.get(row) {
                Some(s) => (s.name(), if s.exclusive() { "exclusive" } else { "shared" }),
                None => ("view (lock-free copy)", "none"),
            };
            let mut t = SectionTotals {
                section,
                mode,
                acquisitions: 0,
                wait_ns: 0,
                hold_ns: 0,
                fallbacks: 0,
                slots_visited: 0,
            };
            for slot in 0..=area.n_slots {
                // SAFETY: the area is the initialised registry's; slot <=
                // n_slots.
                unsafe {
                    let c = counters(area, slot).add(row * FIELDS);
                    t.acquisitions += (*c).load(Ordering::Relaxed);
                    t.wait_ns += (*c.add(1)).load(Ordering::Relaxed);
                    t.hold_ns += (*c.add(2)).load(Ordering::Relaxed);
                    t.fallbacks += (*c.add(3)).load(Ordering::Relaxed);
                    t.slots_visited += (*c.add(4)).load(Ordering::Relaxed);
                }
            }
            t
        })
        .collect()
}
