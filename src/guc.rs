//! Settings. Everything under the `streampos.` prefix is reserved.

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};

/// (database, stream) pairs the registry can track at once, in the whole
/// cluster.
pub static MAX_STREAMS: GucSetting<i32> = GucSetting::<i32>::new(256);
/// (stream, writer) pairs one transaction can allocate from.
pub static MAX_STREAMS_PER_TRANSACTION: GucSetting<i32> = GucSetting::<i32>::new(8);
/// Holds (`hold_ids`) one session can have at once.
pub static MAX_HELD_PER_SESSION: GucSetting<i32> = GucSetting::<i32>::new(64);
/// Recently committed allocations remembered for snapshots that may not see
/// them yet; beyond this they are folded into one summary per stream.
pub static FINISHED_RING_SIZE: GucSetting<i32> = GucSetting::<i32>::new(65536);
/// How often the background worker writes `streampos.stream_positions`.
pub static POSITION_INTERVAL_MS: GucSetting<i32> = GucSetting::<i32>::new(200);
/// The position worker logs a WARNING about a transaction (or hold) that
/// has held a stream's frontier back this long, and a LOG line when it
/// ends; 0: never.
pub static LOG_HELD_BACK_AFTER_MS: GucSetting<i32> = GucSetting::<i32>::new(30_000);
/// A long-polling `updates()` (timeout > 0) returns no sooner than this
/// after the session's previous `updates()` of the stream returned: a busy
/// stream takes a burst of commits in one call instead of one call per
/// commit; an idle follower is woken at once. 0: at once, always.
pub static FOLLOWER_BATCH_MS: GucSetting<i32> = GucSetting::<i32>::new(5);
/// `next_id` and `next_ids` in a bare `SELECT` outside a transaction block
/// warn that their IDs are finished when the statement ends.
pub static WARN_FINISHED_AT_ONCE: GucSetting<bool> = GucSetting::<bool>::new(true);
/// `updates()` writes bigint values (positions, bigint columns) as JSON
/// strings: JavaScript's numbers round integers above 2^53.
pub static JSON_BIGINT_AS_STRING: GucSetting<bool> = GucSetting::<bool>::new(false);
/// The custom WAL resource manager id of the record that wakes a hot
/// standby's followers (`replay.rs`; PostgreSQL 15 and later); 0: off.
/// The same on every server that replays the primary's WAL.
pub static STANDBY_WAKEUP_RMGR_ID: GucSetting<i32> = GucSetting::<i32>::new(0);
/// Test builds only (feature `test-hooks`): sleep between publishing the
/// lower bound and calling nextval, to prove that readers respect the lower
/// bound.
#[cfg(feature = "test-hooks")]
static ALLOCATION_DELAY_MS: GucSetting<i32> = GucSetting::<i32>::new(0);
/// Test builds only: sleep in the commit or abort callback before the
/// transaction's IDs are released, to prove that readers are right while a
/// transaction is visible as ended but still registered.
#[cfg(feature = "test-hooks")]
static RELEASE_DELAY_MS: GucSetting<i32> = GucSetting::<i32>::new(0);

/// Test builds: the allocation pause point. Release builds: nothing.
pub fn test_pause_in_allocation() {
    #[cfg(feature = "test-hooks")]
    pause(ALLOCATION_DELAY_MS.get());
}

/// Test builds: the release pause point (called from the commit and abort
/// callbacks: it only sleeps). Release builds: nothing.
pub fn test_pause_before_release() {
    #[cfg(feature = "test-hooks")]
    pause(RELEASE_DELAY_MS.get());
}

#[cfg(feature = "test-hooks")]
fn pause(ms: i32) {
    if ms > 0 {
        // SAFETY: sleeps this process; raises no error.
        unsafe { pgrx::pg_sys::pg_usleep(i64::from(ms) * 1000) };
    }
}

/// `preloading`: PGC_POSTMASTER settings can only be defined while
/// shared_preload_libraries is processed; a later load (for the token types
/// alone) must not define them, or PostgreSQL raises FATAL.
pub fn define(preloading: bool) {
    if preloading {
        define_registry_sizes();
    }
    define_runtime();
    // SAFETY: called from _PG_init with a static C string. PostgreSQL 14
    // only warns about unknown settings under the prefix (15 removes them).
    unsafe {
        #[cfg(feature = "pg14")]
        pgrx::pg_sys::EmitWarningsOnPlaceholders(c"streampos".as_ptr());
        #[cfg(not(feature = "pg14"))]
        pgrx::pg_sys::MarkGUCPrefixReserved(c"streampos".as_ptr());
    }
}

fn define_registry_sizes() {
    GucRegistry::define_int_guc(
        c"streampos.max_streams",
        c"Streams (of all databases together) that the in-flight registry can track.",
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
        c"streampos.max_held_per_session",
        c"Holds of IDs (streampos.hold_ids) one session can have at once.",
        c"",
        &MAX_HELD_PER_SESSION,
        0,
        4096,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"streampos.standby_wakeup_rmgr_id",
        c"Custom WAL resource manager id of the records that wake followers on hot standbys (0: none).",
        c"128 to 255, free among the server's extensions, the same on the primary and every server replaying its WAL (standbys, point-in-time recovery): each must preload streampos with it before the primary does.",
        &STANDBY_WAKEUP_RMGR_ID,
        0,
        255,
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
        c"streampos.log_held_back_after",
        c"Logs a warning about a transaction or hold that has held a stream's frontier back this long (0: never).",
        c"The position worker logs it once, and once more when it ends.",
        &LOG_HELD_BACK_AFTER_MS,
        0,
        i32::MAX,
        GucContext::Sighup,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_int_guc(
        c"streampos.follower_batch_ms",
        c"A long-polling updates() returns no sooner than this after the session's previous updates() of the stream returned (0: at once).",
        c"Followers of a busy stream take a burst of commits in one call; an idle follower is woken at once.",
        &FOLLOWER_BATCH_MS,
        0,
        1000,
        GucContext::Userset,
        GucFlags::UNIT_MS,
    );
    GucRegistry::define_bool_guc(
        c"streampos.warn_finished_at_once",
        c"next_id() and next_ids() in a bare SELECT outside a transaction block warn that their IDs are finished when it ends.",
        c"A row written with such an ID by a later statement can be passed by followers.",
        &WARN_FINISHED_AT_ONCE,
        GucContext::Userset,
        GucFlags::default(),
    );
    GucRegistry::define_bool_guc(
        c"streampos.json_bigint_as_string",
        c"updates() writes bigint values (the position, bigint columns) as JSON strings.",
        c"For clients whose JSON numbers are doubles (JavaScript): integers above 2^53 would be rounded.",
        &JSON_BIGINT_AS_STRING,
        GucContext::Userset,
        GucFlags::default(),
    );
    #[cfg(feature = "test-hooks")]
    define_test_hooks();
}

#[cfg(feature = "test-hooks")]
fn define_test_hooks() {
    GucRegistry::define_int_guc(
        c"streampos.test_allocation_delay_ms",
        c"Test builds only: delay between registering an allocation and calling nextval.",
        c"",
        &ALLOCATION_DELAY_MS,
        0,
        60_000,
        GucContext::Suset,
        GucFlags::UNIT_MS | GucFlags::NO_SHOW_ALL,
    );
    GucRegistry::define_int_guc(
        c"streampos.test_release_delay_ms",
        c"Test builds only: delay in the commit and abort callbacks before IDs are released.",
        c"",
        &RELEASE_DELAY_MS,
        0,
        60_000,
        GucContext::Suset,
        GucFlags::UNIT_MS | GucFlags::NO_SHOW_ALL,
    );
}
