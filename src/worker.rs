//! The position worker: one background worker per database that uses
//! streampos, writing `streampos.stream_positions` a few times a second and
//! at shutdown. Writers never touch that table, so their commits take no row
//! lock for it; the worker's rows never run ahead of the truth, because it
//! computes them from commits its own snapshot already sees.

use std::time::Duration;

use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, SignalWakeFlags};
use pgrx::pg_sys::panic::CaughtError;
use pgrx::prelude::*;
use pgrx::IntoDatum;

use streampos_core::token::TokenKind;

use crate::{catalog, engine, guc, registry, sql};

/// How often the worker forgets finished entries every snapshot sees.
const PRUNE_INTERVAL_MS: u64 = 20;

thread_local! {
    static LAST_CHECK: std::cell::Cell<pg_sys::TimestampTz> = const { std::cell::Cell::new(0) };
}

/// Start this database's worker unless it runs. Checked at most once a
/// second per backend, as this is on every allocation's path; returns
/// whether it checked (callers piggyback other once-a-second work on it).
pub fn ensure_running() -> bool {
    // SAFETY: reads the clock; raises no error.
    let now = unsafe { crate::ffi::unguarded::GetCurrentTimestamp() };
    if now - LAST_CHECK.with(|c| c.get()) < 1_000_000 {
        return false;
    }
    LAST_CHECK.with(|c| c.set(now));
    // A single-user backend (postgres --single) has no postmaster to start
    // a worker: say nothing, and let writers prune (`prune_if_crowded`).
    // SAFETY: a flag set once at process start.
    if unsafe { !pg_sys::IsUnderPostmaster } {
        return true;
    }
    // SAFETY: MyDatabaseId is set once the backend is connected.
    let db = unsafe { pg_sys::MyDatabaseId };
    if !registry::worker_needed(db) {
        return true;
    }
    let started = BackgroundWorkerBuilder::new("streampos position worker")
        .set_type("streampos position worker")
        .set_library("streampos")
        .set_function("streampos_position_worker")
        .set_argument(db.into_datum())
        .enable_spi_access()
        // Not restarted by the postmaster: the next allocation in the
        // database starts it again (within a second), and a database that
        // was dropped is never retried.
        .set_restart_time(None)
        .load_dynamic();
    if started.is_err() {
        registry::worker_start_failed(db);
        ereport!(
            WARNING,
            PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            "could not start the streampos position worker",
            "Writer positions are not stored until it starts; raise max_worker_processes."
        );
    }
    true
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn streampos_position_worker(arg: pg_sys::Datum) {
    let db = pg_sys::Oid::from(arg.value() as u32);
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(db), None);
    if !registry::claim_worker_slot(db).unwrap_or(false) {
        // Another worker serves this database.
        return;
    }
    // However the worker exits (an ERROR, a FATAL, a clean stop), its slot
    // is free for the next worker of any database.
    // SAFETY: registers a callback for this process's exit.
    unsafe { pg_sys::before_shmem_exit(Some(on_worker_exit), arg) };
    let mut written: std::collections::HashMap<i32, String> = std::collections::HashMap::new();
    let mut orphans = Orphans::default();
    let mut last_store: Option<std::time::Instant> = None;
    loop {
        // Prune often: the finished ring is what readers scan.
        let running = BackgroundWorker::wait_latch(Some(Duration::from_millis(PRUNE_INTERVAL_MS)));
        if BackgroundWorker::sighup_received() {
            // streampos.position_interval_ms may have changed.
            // SAFETY: re-reads the configuration file, as every process does
            // on SIGHUP, outside any transaction.
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
        let _ = registry::prune();
        let interval = Duration::from_millis(guc::POSITION_INTERVAL_MS.get().max(10) as u64);
        let stopping = !running || BackgroundWorker::sigterm_received();
        if stopping || last_store.is_none_or(|t| t.elapsed() >= interval) {
            last_store = Some(std::time::Instant::now());
            // Each pass is a transaction of its own, so it computes fresh
            // positions (answers are kept per transaction, see engine.rs).
            let pass = std::panic::AssertUnwindSafe((&mut written, &mut orphans));
            let keep_going = BackgroundWorker::transaction(move || {
                let pass = pass;
                let (written, orphans) = pass.0;
                release_orphans(db, orphans);
                store_positions(written)
            });
            if !keep_going {
                break;
            }
        }
        if stopping {
            break;
        }
    }
    registry::release_worker_slot(db);
}

#[pg_guard]
unsafe extern "C-unwind" fn on_worker_exit(_code: i32, arg: pg_sys::Datum) {
    registry::release_worker_slot(pg_sys::Oid::from(arg.value() as u32));
}

/// Run `f` in a subtransaction; an ERROR rolls it back, is logged with
/// `what`, and returns false.
fn in_subtransaction(
    what: &str,
    f: impl FnOnce() + std::panic::UnwindSafe + std::panic::RefUnwindSafe,
) -> bool {
    // SAFETY: the worker is inside a transaction (BackgroundWorker::
    // transaction); the subtransaction is begun and ended here on every path,
    // and the memory context and resource owner are restored after it.
    unsafe {
        let context = pg_sys::CurrentMemoryContext;
        let owner = pg_sys::CurrentResourceOwner;
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        let failure = PgTryBuilder::new(move || {
            f();
            None
        })
        .catch_others(|e| {
            Some(match e {
                CaughtError::PostgresError(r) | CaughtError::ErrorReport(r) => {
                    r.message().to_string()
                }
                CaughtError::RustPanic { ereport, .. } => ereport.message().to_string(),
            })
        })
        .execute();
        if failure.is_none() {
            pg_sys::ReleaseCurrentSubTransaction();
        } else {
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
        }
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::CurrentResourceOwner = owner;
        if let Some(message) = &failure {
            // After the rollback: logging allocates.
            pgrx::log!("streampos position worker: {what} failed: {message}");
        }
        failure.is_none()
    }
}

/// Orphaned holds (of sessions that ended without releasing them) the
/// worker waits to release: per stream state, the epoch it waits for and
/// the transactions that were running after that epoch began.
#[derive(Default)]
struct Orphans {
    waiting: std::collections::HashMap<usize, (u64, Vec<pg_sys::VirtualTransactionId>)>,
}

/// Release orphaned holds once every transaction that may still write
/// their rows has ended: those running (in this database) when the
/// worker first saw the orphans, which came after the session ended. The
/// release is a shadow entry of this pass's transaction: a reader sees the
/// IDs finished only in a snapshot that sees this commit, taken after all
/// those transactions ended, so it sees their rows.
fn release_orphans(db: pg_sys::Oid, orphans: &mut Orphans) {
    let current = registry::orphans_of(db);
    orphans
        .waiting
        .retain(|index, _| current.iter().any(|(i, _, _)| i == index));
    for (index, _key, epoch) in current {
        let entry = orphans.waiting.get(&index);
        if entry.is_none_or(|(e, _)| *e != epoch) {
            // SAFETY: lists the virtual xids of this database's running
            // transactions (a palloc'd array, copied out at once).
            let vxids = unsafe {
                let mut n = 0;
                let list = pg_sys::GetCurrentVirtualXIDs(
                    pg_sys::InvalidTransactionId,
                    false,
                    false,
                    0,
                    &mut n,
                );
                let copied = if list.is_null() || n <= 0 {
                    Vec::new()
                } else {
                    std::slice::from_raw_parts(list, n as usize).to_vec()
                };
                if !list.is_null() {
                    pg_sys::pfree(list.cast());
                }
                copied
            };
            orphans.waiting.insert(index, (epoch, vxids));
            continue;
        }
        let Some((_, vxids)) = orphans.waiting.get_mut(&index) else {
            continue;
        };
        // SAFETY: without waiting, VirtualXactLock only asks whether the
        // transaction still runs (true: it ended).
        vxids.retain(|&v| unsafe { !pg_sys::VirtualXactLock(v, false) });
        if !vxids.is_empty() {
            continue;
        }
        // SAFETY: assigns this pass's transaction an xid (readers compare
        // against it).
        unsafe { pg_sys::GetTopTransactionId() };
        if registry::release_orphans(index, epoch).unwrap_or(false) {
            orphans.waiting.remove(&index);
        }
    }
}

/// One pass: store the positions of streams whose positions differ from
/// what the worker last stored (an allocation ended, or a commit became
/// durable since), then notify listeners. Returns false when the extension
/// is gone from the database.
fn store_positions(written: &mut std::collections::HashMap<i32, String>) -> bool {
    if !sql::extension_present() {
        return false;
    }
    // SAFETY: MyDatabaseId is set once the worker is connected.
    let db = unsafe { pg_sys::MyDatabaseId };
    let loaded = registry::streams_of(db);
    if loaded.is_empty() {
        return true;
    }
    let streams = catalog::streams_by_key();
    for (key, _, _) in loaded {
        let Some(meta) = streams.get(&key) else {
            continue;
        };
        let answer = engine::answer(meta);
        let now = answer
            .positions
            .token(&engine::writer_ids(meta, &answer))
            .to_text(TokenKind::MultiWriter);
        if written.get(&key) == Some(&now) {
            continue;
        }
        // A stream dropped in the middle of the pass must not take the
        // worker down with it: each stream in a subtransaction; the
        // notification in one of its own, so that it never takes the
        // stored positions with it.
        let name = meta.name.clone();
        let what = format!("storing the positions of stream \"{name}\"");
        if !in_subtransaction(&what, move || sql::store_positions(&name)) {
            continue;
        }
        let name = meta.name.clone();
        let what = format!("notifying the positions of stream \"{name}\"");
        in_subtransaction(&what, move || sql::notify_positions(&name));
        written.insert(key, now);
    }
    true
}
