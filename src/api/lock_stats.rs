//! `lock_stats()`: the registry lock's statistics, in bench builds only
//! (cargo feature `lock-stats`; see `registry/lock_stats.rs`). For the
//! lock-free row, `wait_ns` is the time spent before giving up for the lock,
//! `fallbacks` how often that happened, and `slots_visited` the active
//! backend slots the completed copies scanned.

use pgrx::prelude::*;

#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_safe)]
fn lock_stats() -> TableIterator<
    'static,
    (
        name!(section, String),
        name!(mode, String),
        name!(acquisitions, i64),
        name!(wait_ns, i64),
        name!(hold_ns, i64),
        name!(fallbacks, i64),
        name!(slots_visited, i64),
    ),
> {
    let rows: Vec<_> = crate::registry::lock_totals()
        .into_iter()
        .map(|t| {
            (
                t.section.to_string(),
                t.mode.to_string(),
                t.acquisitions as i64,
                t.wait_ns as i64,
                t.hold_ns as i64,
                t.fallbacks as i64,
                t.slots_visited as i64,
            )
        })
        .collect();
    TableIterator::new(rows)
}
