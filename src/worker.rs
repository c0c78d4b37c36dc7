//! The position worker: one background worker per database that uses
//! streampos, writing `streampos.stream_positions` a few times a second and
//! at shutdown. Writers never touch that table, so their commits take no row
//! lock for it; the worker's rows never run ahead of the truth, because it
//! computes them from commits its own snapshot already sees.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::pg_sys::panic::CaughtError;
use pgrx::prelude::*;

use streampos_core::token::TokenKind;

use crate::{catalog, engine, guc, held_back, registry, sql};

/// How often the worker forgets finished entries every snapshot sees.
const PRUNE_INTERVAL_MS: u64 = 20;

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn streampos_position_worker(arg: pg_sys::Datum) {
    let db = pg_sys::Oid::from(arg.value() as u32);
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // A database dropped between the allocation that asked for this worker
    // and its start: the connection ends the process with a FATAL that
    // asks nothing of an operator (Synapse's tests drop databases that
    // fast hundreds of times a run). Kept out of the server log; the
    // postmaster still logs the worker's exit at LOG.
    // SAFETY: this process's hook, set before and restored after the
    // connection, chaining to whatever was there.
    unsafe {
        PREVIOUS_EMIT_LOG_HOOK = pg_sys::emit_log_hook;
        pg_sys::emit_log_hook = Some(quiet_dropped_database);
    }
    BackgroundWorker::connect_worker_to_spi_by_oid(Some(db), None);
    // SAFETY: as above.
    unsafe { pg_sys::emit_log_hook = PREVIOUS_EMIT_LOG_HOOK };
    if !registry::claim_worker_slot(db).unwrap_or(false) {
        // Another worker serves this database.
        return;
    }
    // However the worker exits (an ERROR, a FATAL, a clean stop), its slot
    // is free for the next worker of any database.
    // SAFETY: registers a callback for this process's exit.
    unsafe { pg_sys::before_shmem_exit(Some(on_worker_exit), arg) };
    let mut state = WorkerState::new();
    let mut last_store: Option<Instant> = None;
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
            last_store = Some(Instant::now());
            // Each pass is a transaction of its own, so it computes fresh
            // positions (answers are kept per transaction, see engine/answers.rs).
            let pass_state = std::panic::AssertUnwindSafe(&mut state);
            let (outcome, dropping) = BackgroundWorker::transaction(move || {
                let pass_state = pass_state;
                let outcome = yielding_locks(|| pass(db, pass_state.0));
                (outcome, database_wanted_exclusively(db))
            });
            match outcome {
                Pass::ExtensionGone => break,
                Pass::Done { quiet, stored } => {
                    if !quiet {
                        state.last_activity = Instant::now();
                    }
                    // Committed: a standby replays the record after the
                    // commit, and wakes the streams' followers there.
                    crate::replay::log_stored(db, &stored);
                }
            }
            let generations = registry::generations_of(db);
            if generations != state.generations {
                state.generations = generations;
                state.last_activity = Instant::now();
            }
            // Nothing to do for a while: leave, so that the database can be
            // dropped (DROP DATABASE waits only 5 s for other sessions, and
            // not for background workers). The next allocation starts a
            // worker again.
            // At once when a DROP DATABASE (or a rename, a move to another
            // tablespace) waits for the database's sessions to end: its
            // wait would otherwise last until this worker's idle time is up.
            if !stopping
                && (dropping
                    || state.last_activity.elapsed() >= Duration::from_millis(IDLE_EXIT_MS))
                && registry::leave_if_idle(db, &state.generations)
            {
                break;
            }
        }
        if stopping {
            break;
        }
    }
    registry::release_worker_slot(db);
}

static mut PREVIOUS_EMIT_LOG_HOOK: pg_sys::emit_log_hook_type = None;

/// SQLSTATE 3D000: PostgreSQL's ERRCODE_UNDEFINED_DATABASE, an alias of
/// ERRCODE_INVALID_CATALOG_NAME (the one pgrx names).
const UNDEFINED_DATABASE: i32 = PgSqlErrorCode::ERRCODE_INVALID_CATALOG_NAME as i32;

/// While the worker connects: "database … does not exist" (3D000, a
/// FATAL) is not written to the server log.
#[pg_guard]
unsafe extern "C-unwind" fn quiet_dropped_database(edata: *mut pg_sys::ErrorData) {
    // SAFETY: PostgreSQL passes the error being reported; the previous
    // hook is called as it would have been.
    unsafe {
        if (*edata).sqlerrcode == UNDEFINED_DATABASE {
            (*edata).output_to_server = false;
        }
        if let Some(previous) = PREVIOUS_EMIT_LOG_HOOK {
            previous(edata);
        }
    }
}

/// Does a command hold or wait for the database's lock exclusively? DROP
/// DATABASE, ALTER DATABASE … RENAME and … SET TABLESPACE take it, then
/// wait up to 5 s for the database's other sessions to end, and fail if
/// one stays. Asked with a conditional lock that the transaction's end
/// releases (in a transaction: it needs its resource owner).
fn database_wanted_exclusively(db: pg_sys::Oid) -> bool {
    let tag = pg_sys::LOCKTAG {
        // A shared object: no database in the tag.
        locktag_field1: 0,
        locktag_field2: pg_sys::DatabaseRelationId.to_u32(),
        locktag_field3: db.to_u32(),
        locktag_field4: 0,
        locktag_type: pg_sys::LockTagType::LOCKTAG_OBJECT as u8,
        locktag_lockmethodid: pg_sys::DEFAULT_LOCKMETHOD as u8,
    };
    // SAFETY: a conditional, transaction-level lock (released when the
    // pass's transaction ends); it raises no error when not granted.
    let result = unsafe {
        pg_sys::LockAcquire(
            &tag,
            pg_sys::AccessShareLock as pg_sys::LOCKMODE,
            false,
            true,
        )
    };
    result == pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
}

#[pg_guard]
unsafe extern "C-unwind" fn on_worker_exit(_code: i32, arg: pg_sys::Datum) {
    registry::release_worker_slot(pg_sys::Oid::from(arg.value() as u32));
}

/// Longest the worker's pass waits for a lock it did not take at its start
/// (a row of `stream_positions`, a system catalog): shorter than
/// `deadlock_timeout`, so that it gives up before anyone waiting for it
/// checks for a deadlock.
const LOCK_TIMEOUT: &std::ffi::CStr = c"100ms";

/// Run the pass `f` with `lock_timeout` at `LOCK_TIMEOUT`: the worker never
/// waits long for a lock, it yields to the operator's command (see
/// docs/design.md, "The position worker's locks"). Restored before the
/// commit, which may queue for NOTIFY's lock behind other databases'
/// commits (no command waits for the worker there) and must not fail.
fn yielding_locks<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: a GUC nest level is opened and closed around `f`; on ERROR,
    // transaction abort unwinds GUC nest levels itself.
    unsafe {
        let level = pg_sys::NewGUCNestLevel();
        pg_sys::set_config_option(
            c"lock_timeout".as_ptr(),
            LOCK_TIMEOUT.as_ptr(),
            pg_sys::GucContext::PGC_SUSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_SAVE,
            true,
            0,
            false,
        );
        let value = f();
        pg_sys::AtEOXact_GUC(false, level);
        value
    }
}

/// The worker leaves after this long with nothing to do (no stream's
/// generation moved, nothing stored, nothing of its database in flight or
/// orphaned).
const IDLE_EXIT_MS: u64 = 2000;

/// What the worker keeps from pass to pass.
struct WorkerState {
    /// The token last stored per stream key.
    written: HashMap<i32, String>,
    /// What the worker last did about each stream key's marks.
    marked: HashMap<i32, LastMark>,
    orphans: Orphans,
    /// Per stream key: the frontier last seen, and since when it is held
    /// back (0: it is not).
    tracks: HashMap<i32, (i64, pg_sys::TimestampTz)>,
    held_back: held_back::Warned,
    /// The generations of the database's stream states at the last pass.
    generations: Vec<(usize, u64)>,
    /// The last time anything happened (a generation moved, a store, a
    /// pass that could not take its locks).
    last_activity: Instant,
    /// When the records of committed prepared transactions were last
    /// forgotten (None: not yet since the worker started).
    prepared_forgotten: Option<Instant>,
}

impl WorkerState {
    fn new() -> WorkerState {
        WorkerState {
            written: HashMap::new(),
            marked: HashMap::new(),
            orphans: Orphans::default(),
            tracks: HashMap::new(),
            held_back: held_back::Warned::default(),
            generations: Vec::new(),
            last_activity: Instant::now(),
            prepared_forgotten: None,
        }
    }
}

enum Pass {
    ExtensionGone,
    /// `quiet`: nothing was stored, nothing failed or was put off;
    /// `stored`: the keys of the streams whose positions were stored.
    Done {
        quiet: bool,
        stored: Vec<i32>,
    },
}

/// Run `f` in a subtransaction; an ERROR rolls it back and returns None.
/// The error is logged with `what`, unless it is a lock the worker did not
/// get at once (SQLSTATE 55P03: it yields, and tries again next pass).
fn in_subtransaction<T>(what: &str, f: impl FnOnce() -> T) -> Option<T> {
    let f = std::panic::AssertUnwindSafe(f);
    // SAFETY: the worker is inside a transaction (BackgroundWorker::
    // transaction); the subtransaction is begun and ended here on every path,
    // and the memory context and resource owner are restored after it.
    unsafe {
        let context = pg_sys::CurrentMemoryContext;
        let owner = pg_sys::CurrentResourceOwner;
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        let outcome = PgTryBuilder::new(move || {
            let f = f;
            Ok((f.0)())
        })
        .catch_others(|e| {
            Err(match e {
                CaughtError::PostgresError(r)
                | CaughtError::ErrorReport(r)
                | CaughtError::RustPanic { ereport: r, .. } => {
                    (r.sql_error_code(), r.message().to_string())
                }
            })
        })
        .execute();
        if outcome.is_ok() {
            pg_sys::ReleaseCurrentSubTransaction();
        } else {
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
        }
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::CurrentResourceOwner = owner;
        match outcome {
            Ok(value) => Some(value),
            Err((code, message)) => {
                // After the rollback: logging allocates.
                if code != PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE {
                    pgrx::log!("streampos position worker: {what} failed: {message}");
                }
                None
            }
        }
    }
}

/// Orphaned holds (of sessions that ended without releasing them) the
/// worker waits to release: per stream state, the epoch it waits for and
/// the transactions that were running after that epoch began.
#[derive(Default)]
struct Orphans {
    waiting: HashMap<usize, (u64, Vec<pg_sys::VirtualTransactionId>)>,
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

/// How often the worker forgets the holds recorded by prepared
/// transactions that have committed since (`sql::forget_prepared_holds`).
const FORGET_PREPARED_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// At the worker's first pass and then every `FORGET_PREPARED_EVERY`: the
/// records every snapshot sees committed go (src/prepared.rs).
fn forget_prepared_holds(state: &mut WorkerState) {
    if state
        .prepared_forgotten
        .is_some_and(|at| at.elapsed() < FORGET_PREPARED_EVERY)
    {
        return;
    }
    state.prepared_forgotten = Some(Instant::now());
    // SAFETY: computes the shared horizon; raises no error.
    let horizon = unsafe { pg_sys::GetOldestNonRemovableTransactionId(std::ptr::null_mut()) };
    in_subtransaction(
        "forgetting the holds of committed prepared transactions",
        || sql::forget_prepared_holds(horizon),
    );
}

/// One pass. First the locks every store of the pass needs, each only if
/// granted at once (else the pass is put off to the next interval, see
/// docs/design.md); then store the positions of streams whose positions
/// differ from what the worker last stored (an allocation ended, or a
/// commit became durable since), each under its stream's row lock, also
/// taken only if granted at once; notify listeners; note what it saw for
/// the statistics and the held-back warnings.
fn pass(db: pg_sys::Oid, state: &mut WorkerState) -> Pass {
    if !sql::extension_present() {
        return Pass::ExtensionGone;
    }
    let Some(tables) = sql::lock_for_pass() else {
        return Pass::Done {
            quiet: false,
            stored: Vec::new(),
        };
    };
    release_orphans(db, &mut state.orphans);
    forget_prepared_holds(state);
    let loaded = registry::streams_of(db);
    let mut quiet = true;
    let streams = if loaded.is_empty() {
        HashMap::new()
    } else {
        catalog::streams_by_key()
    };
    // SAFETY: reads the clock; raises no error.
    let now = unsafe { crate::ffi::unguarded::GetCurrentTimestamp() };
    let mut marks = Vec::with_capacity(loaded.len());
    let mut seen = Vec::with_capacity(loaded.len());
    for (key, index, _) in loaded {
        let Some(meta) = streams.get(&key) else {
            continue;
        };
        // A stream dropped in the middle of the pass must not take the
        // worker down with it: each stream in a subtransaction; the
        // notification in one of its own, so that it never takes the
        // stored positions with it.
        let what = format!("reading the positions of stream \"{}\"", meta.name);
        let Some((frontier, max_allocated, token)) = in_subtransaction(&what, || {
            let answer = engine::answer(meta);
            let token = answer
                .positions
                .token(&engine::writer_ids(meta, &answer))
                .to_text(TokenKind::MultiWriter);
            (answer.frontier(), answer.positions.max_allocated, token)
        }) else {
            quiet = false;
            continue;
        };
        let track = state.tracks.entry(key).or_insert((frontier, 0));
        if frontier >= max_allocated {
            track.1 = 0;
        } else if track.1 == 0 || track.0 != frontier {
            track.1 = now;
        }
        track.0 = frontier;
        let held_since = track.1;
        seen.push(held_back::Seen {
            key,
            meta: meta.clone(),
            frontier,
            max_allocated,
            held_since,
        });
        let mut mark = registry::stats::PassMark {
            index,
            key,
            seq: meta.seq,
            held_since,
            stored: false,
            current: true,
            frontier,
        };
        if state.written.get(&key) != Some(&token) {
            quiet = false;
            let name = meta.name.clone();
            let what = format!("storing the positions of stream \"{name}\"");
            let stored = in_subtransaction(&what, || sql::store_positions(&name, tables.frontiers));
            if stored == Some(false) {
                // Dropped since the pass began.
                continue;
            }
            if stored.is_some() {
                let what = format!("notifying the positions of stream \"{name}\"");
                in_subtransaction(&what, || sql::notify_positions(&name));
                state.written.insert(key, token.clone());
                mark.stored = true;
            } else {
                mark.current = false;
            }
        }
        if tables.marks && !meta.backwards {
            mark_frontier(&mut state.marked, key, &meta.name, &token);
        }
        marks.push(mark);
    }
    state
        .tracks
        .retain(|key, _| seen.iter().any(|s| s.key == *key));
    state
        .marked
        .retain(|key, _| seen.iter().any(|s| s.key == *key));
    if !state.held_back.is_empty() {
        quiet = false;
    }
    held_back::check(db, &seen, &mut state.held_back, now);
    registry::stats::record_pass(db, &marks, now);
    let stored = marks.iter().filter(|m| m.stored).map(|m| m.key).collect();
    Pass::Done { quiet, stored }
}

/// Marks are this far apart at least: a consumer's lag in time is told to
/// within it (and a busy stream adds at most one row a second).
const MARK_INTERVAL: Duration = Duration::from_secs(1);

/// A token not marked because the stream had no consumers is tried again
/// after this long even if it has not moved: a consumer registered since
/// (as the pass saw it, not yet committed) is behind it.
const UNMARKED_RECHECK: Duration = Duration::from_secs(10);

/// What the worker last did about a stream's marks.
struct LastMark {
    token: String,
    at: Instant,
    /// A mark was inserted (false: the stream had no consumers).
    inserted: bool,
}

/// Mark the stream's current token in `frontier_marks` (for its consumers'
/// lag in time) when it moved since the last mark, at most once a
/// `MARK_INTERVAL`.
fn mark_frontier(marked: &mut HashMap<i32, LastMark>, key: i32, name: &str, token: &str) {
    if let Some(last) = marked.get(&key) {
        let wait = if last.token == token {
            if last.inserted {
                return;
            }
            UNMARKED_RECHECK
        } else {
            MARK_INTERVAL
        };
        if last.at.elapsed() < wait {
            return;
        }
    }
    let what = format!("marking the frontier of stream \"{name}\"");
    // A failed or put-off mark is tried again after the interval, not at
    // every pass (nor logged at every pass).
    let last = match in_subtransaction(&what, || sql::mark_frontier(name, token)).flatten() {
        Some(inserted) => LastMark {
            token: token.to_string(),
            at: Instant::now(),
            inserted,
        },
        None => LastMark {
            token: String::new(),
            at: Instant::now(),
            inserted: false,
        },
    };
    marked.insert(key, last);
}
