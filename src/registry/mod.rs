//! The in-flight registry: shared memory that knows, for every stream, which
//! IDs are allocated by transactions that have not ended, and which recently
//! finished transactions some snapshot may still not see.
//!
//! | file | concern |
//! |---|---|
//! | `section.rs` | what the lock is taken for: each section's mode (and its statistics row) |
//! | `shmem.rs` | layout, creation at server start, the lock guard |
//! | `streams.rs` | per-stream state: find, create, load, drop, reclaim |
//! | `alloc.rs` | allocation (register before you allocate) and transaction end |
//! | `visibility.rs` | what a snapshot must treat as in flight: slots, finished ring, summary, pruning |
//! | `wait.rs` | followers' condition variables and their sleep; a standby's, woken by replay |
//! | `history.rs` | which history this server's IDs belong to, and the lost ranges of other histories |
//! | `workers.rs` | position-worker slots, and when a worker may leave |
//! | `stats.rs` | statistics (`stat_streams`, `stat_registry`) |
//! | `lock_stats.rs` | lock hold and wait times per section (feature `lock-stats`, bench builds only) |
//!
//! One LWLock guards every change. Writers hold it exclusively for a few
//! hundred nanoseconds twice per allocation and once per commit; readers
//! take no lock: they copy the active slots and the newest ring entries as
//! a seqlock read, and take the lock shared only after 8 tries that a
//! writer kept moving (docs/design.md, "Reading without the lock"). The
//! sequence's own lock, not ours, orders IDs. Measured hold times and what
//! they mean on many cores: docs/performance.md.

mod alloc;
pub mod history;
#[cfg(feature = "lock-stats")]
mod lock_stats;
mod section;
mod shmem;
pub mod stats;
mod streams;
mod visibility;
mod wait;
mod workers;

pub use alloc::{
    begin_allocation, end_subtransaction, end_transaction, finish_allocation, flush_before_commit,
    holding, holds_for_prepare, in_flight, mark_ghosts, orphans_of, release_hold, release_orphans,
    remember_writers, rename_entries, InFlight, Request,
};
pub use shmem::{
    catalog_sync, is_loaded, note_start_xid, require_loaded, start_xid, ALL_WRITERS,
    RECENT_CATALOG_CHANGES,
};
pub use streams::{
    forget_all_indexes, forget_index, generation, highest_allocated, mark_dropped_at_commit,
    raise_max_allocated, set_loaded, stream_index, streams_of, Stale,
};
pub use visibility::{
    caller_snapshot, precedes as xid_precedes, prune, prune_if_crowded, view, wal_settled,
    StreamView,
};
#[cfg(not(feature = "pg14"))]
pub use wait::replayed;
pub use wait::{
    replay_records, replay_seen, wait_for_change, wait_for_replay, watches_client, Woken,
};
pub use workers::{
    claim_worker_slot, generations_of, leave_if_idle, release_worker_slot, worker_needed,
    worker_start_failed,
};

/// The registry lock's statistics (bench builds: feature `lock-stats`).
#[cfg(feature = "lock-stats")]
pub fn lock_totals() -> Vec<lock_stats::SectionTotals> {
    lock_stats::totals(shmem::lock_stats_area())
}

/// At `_PG_init` in the postmaster: ask for the registry's shared memory;
/// when it is created, it learns the start's history from `history.rs`.
pub fn request_shared_memory() {
    shmem::request_shared_memory(history::at_start)
}
