//! Settings. Everything under the `streampos.` prefix is reserved.

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};

/// (database, stream) pairs the registry can track at once.
pub static MAX_STREAMS: GucSetting<i32> = GucSetting::<i32>::new(256);
/// (stream, writer) pairs one transaction can allocate from.
pub static MAX_STREAMS_PER_TRANSACTION: GucSetting<i32> = GucSetting::<i32>::new(8);
/// Recently committed allocations remembered for snapshots that may not see
/// them yet; beyond this they are folded into one summary per stream.
pub static FINISHED_RING_SIZE: GucSetting<i32> = GucSetting::<i32>::new(4096);
/// How often the background worker writes `streampos.stream_positions`.
pub static POSITION_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(200);
/// Test only: sleep between publishing the lower bound and calling nextval,
/// to prove that readers respect the lower bound.
pub static ALLOCATION_DELAY_MS: GucSetting<i32> = GucSetting::<i32>::new(0);

/// `preloading`: PGC_POSTMASTER settings can only be defined while
/// shared_preload_libraries is processed; a later load (for the token types
/// alone) must not define them, or PostgreSQL raises FATAL.
pub fn define(preloading: bool) {
    if preloading {
        define_registry_sizes();
    }
    define_runtime();
    // SAFETY: called from _PG_init with a static C string.
    unsafe { pgrx::pg_sys::MarkGUCPrefixReserved(c"streampos".as_ptr()) };
}

fn define_registry_sizes() {
    GucRegistry::define_int_guc(
        c"streampos.max_streams",
        c"Streams (per database) that the in-flight registry can track.",
        c"Each stream that allocated or was read since start-up takes one slot.",
        &MAX_STREAMS,
        1,
        65536,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"streampos.max_streams_per_transaction",
        c"Distinct (stream, writer) pairs one transaction can allocate IDs from.",
        c"",
        &MAX_STREAMS_PER_TRANSACTION,
        1,
        1024,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"streampos.finished_ring_size",
        c"Recently committed allocations kept for snapshots that do not see them yet.",
        c"When full, older entries are folded into a per-stream summary: old snapshots then lag, but never miss rows.",
        &FINISHED_RING_SIZE,
        16,
        1 << 20,
        GucContext::Postmaster,
        GucFlags::default(),
    );
}

fn define_runtime() {
    GucRegistry::define_int_guc(
        c"streampos.position_interval_ms",
        c"How often the background worker stores writer positions in streampos.stream_positions.",
        c"",
        &POSITION_INTERVAL_MS,
        10,
        60_000,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"streampos.test_allocation_delay_ms",
        c"Testing only: delay between registering an allocation and calling nextval.",
        c"",
        &ALLOCATION_DELAY_MS,
        0,
        60_000,
        GucContext::Suset,
        GucFlags::UNIT_MS | GucFlags::NO_SHOW_ALL,
    );
}
