//! The stream catalog (`streampos.streams`, `streampos.instances`) with a
//! per-backend cache: writers look their stream up on every allocation, and
//! the catalog changes rarely.
//!
//! Which row a lookup must return depends on who asks. A reader (frontier,
//! tokens, followers) answers for its snapshot, so it reads the row that
//! snapshot sees: a cursor opened before `drop_stream` keeps the old stream
//! on every FETCH. A writer allocates under the stream as it is now (the
//! latest committed catalog plus its own changes), whatever its snapshot.
//!
//! Which snapshots may use the cache: a cached row was read by a snapshot
//! that saw every committed catalog change, at a generation that has not
//! moved since. Another snapshot reads the same row if it too sees every
//! committed change and no commit came in between. The shared state (in the
//! registry's shared memory) has the generation, which moves when a
//! catalog-changing transaction starts committing and again when it has
//! ended; the number of such transactions committing right now (nobody uses
//! the cache meanwhile: a new snapshot may see the change before the
//! generation moves the second time); and the xids of the latest 16 such
//! commits, which a snapshot must all see (and be newer than the ones
//! before). A transaction that changed the catalog itself, and a hot
//! standby (whose changes arrive by replay, which runs no callback), never
//! use it. Instance ids never change once committed: their cache is only
//! dropped after an abort, a rolled-back savepoint (an instance it created
//! is gone), or when the extension was dropped and created again (noticed
//! through the relcache invalidation of the dropped catalog table).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use pgrx::pg_sys;

use crate::error::Error;
use crate::fast_hash::FastMap;
use crate::{registry, sql};

#[derive(Clone, Debug)]
pub struct StreamMeta {
    pub name: String,
    pub key: i32,
    pub seq: pg_sys::Oid,
    pub owns_sequence: bool,
    pub backwards: bool,
    /// None: any instance may write.
    pub writers: Option<Vec<String>>,
}

impl StreamMeta {
    /// Internal (positive) numbering to the API's. Saturating: a value read
    /// from a sequence altered to i64::MIN has no negation.
    pub fn external(&self, id: i64) -> i64 {
        if self.backwards {
            id.checked_neg().unwrap_or(i64::MAX)
        } else {
            id
        }
    }

    pub fn allows(&self, writer: &str) -> bool {
        self.writers
            .as_ref()
            .is_none_or(|w| w.iter().any(|x| x == writer))
    }
}

#[derive(Default)]
struct Cache {
    /// The generation the stream rows were read at.
    generation: u64,
    /// Shared, not copied: every call of every function looks its stream up.
    streams: FastMap<String, Rc<StreamMeta>>,
    /// Each stream's usable tables (`updates` reads them on every call),
    /// under the same rules as `streams`, and also dropped whenever a
    /// relation or a schema changes (a table renamed, altered or dropped).
    tables: FastMap<String, Rc<Vec<sql::StreamTable>>>,
    instance_ids: FastMap<String, i32>,
}

/// The OID of `streampos.streams` when the cache was last filled: its
/// relcache invalidation (the table was dropped, with the extension) clears
/// the cache.
static mut STREAMS_TABLE: pg_sys::Oid = pg_sys::InvalidOid;

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache::default());
    /// Set by callbacks (which must not allocate or free): clear everything,
    /// instance ids too, at the next use.
    static CLEAR_ON_NEXT_USE: Cell<bool> = const { Cell::new(false) };
    /// Set by callbacks: a relation or a schema changed.
    static TABLES_CHANGED: Cell<bool> = const { Cell::new(false) };
    /// This transaction changed the catalog, as top xid (0: it did not).
    static CHANGED_BY: Cell<u32> = const { Cell::new(0) };
    /// This transaction counted itself in `committing` at pre-commit.
    static COMMITTING: Cell<bool> = const { Cell::new(false) };
    /// Streams dropped by this transaction, by the subtransaction that
    /// dropped them: marked dropped in the registry when it commits.
    static PENDING_DROPS: RefCell<Vec<(i32, pg_sys::SubTransactionId)>> =
        const { RefCell::new(Vec::new()) };
    /// Instances this transaction created, with the subtransaction that
    /// created them: a rollback of that subtransaction takes them back.
    static CREATED: RefCell<Vec<(i32, pg_sys::SubTransactionId)>> =
        const { RefCell::new(Vec::new()) };
}

// ------------------------------------------------------- the shared state

/// The generation at which `snapshot` (None: a new latest snapshot) may use
/// the cache, or None when it may not (see the module comment).
fn cache_generation(snapshot: Option<pg_sys::Snapshot>) -> Option<u64> {
    if CHANGED_BY.get() != 0 || crate::backend::in_recovery() {
        return None;
    }
    let state = registry::catalog_sync()?.read();
    if state.committing > 0 {
        return None;
    }
    if let Some(snapshot) = snapshot {
        // Taken on a hot standby: changes replayed then ran no callback, so
        // the shared state says nothing about what it sees.
        // SAFETY: `snapshot` is the caller's valid MVCC snapshot.
        if unsafe { (*snapshot).takenDuringRecovery } {
            return None;
        }
        let n = (state.recent_pushed as usize).min(registry::RECENT_CATALOG_CHANGES);
        // SAFETY: `snapshot` is the caller's valid MVCC snapshot.
        let xmin = unsafe { (*snapshot).xmin };
        for &xid in &state.recent[..n] {
            let xid = pg_sys::TransactionId::from_inner(xid);
            // Before the snapshot's xmin: seen as ended (the first thing
            // XidInMVCCSnapshot checks), without the call.
            if registry::xid_precedes(xid, xmin) {
                continue;
            }
            // SAFETY: `snapshot` is the caller's valid MVCC snapshot; the
            // xid is a committed top-level xid.
            if unsafe { pg_sys::XidInMVCCSnapshot(xid, snapshot) } {
                return None;
            }
        }
        let sees_older = state.evicted == 0
            || registry::xid_precedes(pg_sys::TransactionId::from_inner(state.evicted), xmin);
        if !sees_older {
            return None;
        }
    }
    Some(state.generation)
}

/// The cache as of `generation` (older rows dropped).
fn with_cache<R>(generation: u64, f: impl FnOnce(&mut Cache) -> R) -> R {
    CACHE.with(|c| {
        let mut cache = c.borrow_mut();
        if CLEAR_ON_NEXT_USE.replace(false) {
            cache.streams.clear();
            cache.tables.clear();
            cache.instance_ids.clear();
        }
        if TABLES_CHANGED.replace(false) {
            cache.tables.clear();
        }
        if cache.generation != generation {
            cache.streams.clear();
            cache.tables.clear();
            cache.generation = generation;
        }
        f(&mut cache)
    })
}

/// The instance-id cache (valid whatever the generation).
fn with_instance_cache<R>(f: impl FnOnce(&mut FastMap<String, i32>) -> R) -> R {
    CACHE.with(|c| {
        let mut cache = c.borrow_mut();
        if CLEAR_ON_NEXT_USE.replace(false) {
            cache.streams.clear();
            cache.tables.clear();
            cache.instance_ids.clear();
        }
        f(&mut cache.instance_ids)
    })
}

/// Called once per process from `_PG_init`.
pub fn register_invalidation() {
    // SAFETY: registers a callback for this process's relcache invalidations.
    unsafe {
        pg_sys::CacheRegisterRelcacheCallback(
            Some(on_relcache_invalidation),
            pg_sys::Datum::from(0),
        );
        // A schema renamed changes its tables' names without a relcache
        // invalidation.
        pg_sys::CacheRegisterSyscacheCallback(
            pg_sys::SysCacheIdentifier::NAMESPACEOID as i32,
            Some(on_namespace_invalidation),
            pg_sys::Datum::from(0),
        );
    };
}

/// A schema changed: only sets flags.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_namespace_invalidation(
    _arg: pg_sys::Datum,
    _cache: std::ffi::c_int,
    _hash: u32,
) {
    TABLES_CHANGED.set(true);
    crate::sql::relations_changed();
}

/// A relcache invalidation: `relid` changed (InvalidOid: every relation).
/// Only sets a flag (it may run in the middle of anything).
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_relcache_invalidation(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    // SAFETY: a backend-local OID, read only here and where it is set.
    let ours = unsafe { STREAMS_TABLE };
    crate::sql::relations_changed();
    TABLES_CHANGED.set(true);
    if relid == pg_sys::InvalidOid || (ours != pg_sys::InvalidOid && relid == ours) {
        CLEAR_ON_NEXT_USE.set(true);
        crate::registry::forget_all_indexes();
        // The extension may have been dropped (its worker then left) and
        // created again: the next allocation looks for a worker at once.
        crate::backend::set_worker_checked_at(0);
    }
}

/// Called by every function that changes the catalog, before it does.
pub fn mark_changed() {
    // SAFETY: assigns (or returns) this transaction's top xid.
    let xid = unsafe { pg_sys::GetTopTransactionId() };
    CHANGED_BY.set(xid.into_inner());
    CLEAR_ON_NEXT_USE.set(true);
}

/// `drop_stream`: the registry marks the stream dropped when this
/// transaction commits (a rollback leaves it working).
pub fn drop_at_commit(key: i32) {
    // SAFETY: plain read of the current subtransaction's id.
    let subxact = unsafe { pg_sys::GetCurrentSubTransactionId() };
    PENDING_DROPS.with(|p| p.borrow_mut().push((key, subxact)));
}

/// Transaction callbacks (xact.rs): no allocation, no error.
pub fn pre_commit() {
    if CHANGED_BY.get() == 0 {
        return;
    }
    if let Some(sync) = registry::catalog_sync() {
        sync.with(|s| {
            s.committing += 1;
            s.generation += 1;
        });
        COMMITTING.set(true);
    }
}

pub fn end_transaction(committed: bool) {
    if !committed {
        CLEAR_ON_NEXT_USE.set(true);
    }
    let xid = CHANGED_BY.replace(0);
    if committed {
        PENDING_DROPS.with(|p| {
            // One key at a time: the callback must not allocate.
            for &(key, _) in p.borrow().iter() {
                registry::mark_dropped_at_commit(&[key], pg_sys::TransactionId::from_inner(xid));
            }
        });
    }
    // Truncating keeps the allocation: nothing is freed here.
    PENDING_DROPS.with(|p| p.borrow_mut().truncate(0));
    CREATED.with(|c| c.borrow_mut().truncate(0));
    if xid == 0 {
        return;
    }
    let counted = COMMITTING.replace(false);
    if let Some(sync) = registry::catalog_sync() {
        sync.with(|s| {
            if counted {
                s.committing = s.committing.saturating_sub(1);
            }
            if committed {
                let at = (s.recent_pushed % registry::RECENT_CATALOG_CHANGES as u64) as usize;
                if s.recent_pushed >= registry::RECENT_CATALOG_CHANGES as u64 {
                    s.evicted = s.recent[at];
                }
                s.recent[at] = xid;
                s.recent_pushed += 1;
            }
            s.generation += 1;
        });
    }
}

/// A subtransaction ended: forget what a rolled-back one did (an instance
/// it created, a stream it dropped); a committed one's drops now belong to
/// its parent.
pub fn end_subtransaction(
    committed: bool,
    subxact: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
) {
    PENDING_DROPS.with(|p| {
        let mut drops = p.borrow_mut();
        if committed {
            for d in drops.iter_mut() {
                if d.1 >= subxact {
                    d.1 = parent;
                }
            }
        } else {
            drops.retain(|d| d.1 < subxact);
        }
    });
    CREATED.with(|c| {
        let mut created = c.borrow_mut();
        if committed {
            for e in created.iter_mut() {
                if e.1 >= subxact {
                    e.1 = parent;
                }
            }
        } else {
            // Taken back: one id at a time (the callback must not
            // allocate), then forgotten.
            for &(id, sub) in created.iter() {
                if sub >= subxact {
                    registry::mark_ghosts(&[id]);
                }
            }
            created.retain(|e| e.1 < subxact);
        }
    });
    if !committed && !crate::sql::quiet_rollback(subxact) {
        CLEAR_ON_NEXT_USE.set(true);
    }
}

/// A transaction was prepared: an instance it created is gone if it is
/// rolled back later, by whichever session, and no callback of this backend
/// will know.
pub fn prepared() {
    CLEAR_ON_NEXT_USE.set(true);
}

/// A transaction that changed the catalog cannot be prepared: its commit
/// would happen where no callback of this backend sees it.
pub fn changed_in_this_transaction() -> bool {
    CHANGED_BY.get() != 0
}

// -------------------------------------------------------------------- names

/// Stream names are 1 to 59 bytes: the owned sequence is "<name>_seq".
pub fn validate_stream_name(name: &str) -> Result<(), Error> {
    validate_name("stream", name, 59)
}

pub fn validate_instance_name(name: &str) -> Result<(), Error> {
    validate_name("instance", name, 63)
}

pub fn validate_consumer_name(name: &str) -> Result<(), Error> {
    validate_name("consumer", name, 63)
}

fn validate_name(what: &str, name: &str, max: usize) -> Result<(), Error> {
    if name.is_empty() || name.len() > max {
        return Err(Error::InvalidArgument {
            message: format!("{what} name must be 1 to {max} bytes long"),
            detail: Some(format!("The name given is {} bytes long.", name.len())),
        });
    }
    Ok(())
}

// ------------------------------------------------------------------ streams

/// Which catalog a lookup reads.
#[derive(Clone, Copy, PartialEq)]
enum View {
    /// What the caller's snapshot sees (readers).
    Snapshot,
    /// The latest committed catalog and this transaction's own changes
    /// (writers and catalog changes).
    Latest,
}

fn load_stream(name: &str, view: View) -> Option<StreamMeta> {
    // SAFETY: a backend-local OID, written here, read by the callback.
    unsafe { STREAMS_TABLE = sql::streams_table_oid() };
    let snapshot = match view {
        View::Snapshot => registry::caller_snapshot(),
        // SAFETY: called inside a running transaction, not in parallel
        // mode (every function that writes is PARALLEL UNSAFE). The command
        // counter moves first, as before any SPI statement that writes, so
        // that this transaction's own changes so far are seen.
        View::Latest => unsafe {
            pg_sys::CommandCounterIncrement();
            pg_sys::GetLatestSnapshot()
        },
    };
    sql::stream_row_as_of(name, snapshot).map(|row| StreamMeta {
        name: name.to_string(),
        key: row.key,
        seq: row.seq,
        owns_sequence: row.owns_sequence,
        backwards: row.backwards,
        writers: row.writers,
    })
}

fn lookup(name: &str, view: View) -> Result<Rc<StreamMeta>, Error> {
    let snapshot = match view {
        View::Snapshot => Some(registry::caller_snapshot()),
        View::Latest => None,
    };
    let generation = cache_generation(snapshot);
    if let Some(g) = generation {
        if let Some(meta) = with_cache(g, |c| c.streams.get(name).cloned()) {
            return Ok(meta);
        }
    }
    let meta = Rc::new(load_stream(name, view).ok_or_else(|| Error::UnknownStream(name.into()))?);
    // Cached only if nothing moved while it was read.
    if let Some(g) = generation {
        if cache_generation(snapshot) == Some(g) {
            with_cache(g, |c| c.streams.insert(name.to_string(), meta.clone()));
        }
    }
    Ok(meta)
}

/// The stream's catalog row as the caller's snapshot sees it, or 42704.
pub fn stream(name: &str) -> Result<Rc<StreamMeta>, Error> {
    lookup(name, View::Snapshot)
}

/// The stream's usable tables as the caller's snapshot sees them
/// (`sql::stream_tables`), cached under the rules of `stream`.
pub fn stream_tables(name: &str) -> Rc<Vec<sql::StreamTable>> {
    let snapshot = Some(registry::caller_snapshot());
    let generation = cache_generation(snapshot);
    if let Some(g) = generation {
        if let Some(tables) = with_cache(g, |c| c.tables.get(name).cloned()) {
            return tables;
        }
    }
    let tables = Rc::new(sql::stream_tables(name));
    // Cached only if nothing moved while they were read.
    if let Some(g) = generation {
        if cache_generation(snapshot) == Some(g) && !TABLES_CHANGED.get() {
            with_cache(g, |c| c.tables.insert(name.to_string(), tables.clone()));
        }
    }
    tables
}

/// The stream's catalog row as it is now (for allocation and catalog
/// changes), or 42704.
pub fn stream_latest(name: &str) -> Result<Rc<StreamMeta>, Error> {
    lookup(name, View::Latest)
}

/// Every stream of this database by registry key (the position worker:
/// its own transaction, the latest catalog).
pub fn streams_by_key() -> HashMap<i32, Rc<StreamMeta>> {
    sql::stream_names()
        .iter()
        .filter_map(|n| stream(n).ok())
        .map(|m| (m.key, m))
        .collect()
}

// ---------------------------------------------------------------- instances

pub fn lookup_instance_id(name: &str) -> Option<i32> {
    if let Some(id) = with_instance_cache(|c| c.get(name).copied()) {
        return Some(id);
    }
    let id = sql::instance_id_of(name);
    if let Some(id) = id {
        with_instance_cache(|c| c.insert(name.to_string(), id));
    }
    id
}

/// Get or create. Concurrent callers with the same new name get the same id:
/// the unique index makes the second insert wait for the first and then do
/// nothing, and the following statement sees the committed row.
pub fn instance_id(name: &str) -> Result<i32, Error> {
    if let Some(id) = lookup_instance_id(name) {
        return Ok(id);
    }
    validate_instance_name(name)?;
    let created = sql::insert_instance(name);
    if let Some(id) = created {
        // SAFETY: reads the current subtransaction id.
        let subxact = unsafe { pg_sys::GetCurrentSubTransactionId() };
        CREATED.with(|c| c.borrow_mut().push((id, subxact)));
        // A rolled-back savepoint may have taken the name's earlier id
        // with it while a transaction (or a hold) still has IDs under that
        // id: they are the name's, and hold it back under its new id.
        if crate::registry::is_loaded() {
            crate::registry::rename_entries(name, id)?;
        }
    }
    let id = created.or_else(|| sql::instance_id_of(name));
    match id {
        Some(id) => {
            with_instance_cache(|c| c.insert(name.to_string(), id));
            Ok(id)
        }
        None => Err(Error::Retry {
            message: format!(
                "instance \"{name}\" was created concurrently and is not visible to this transaction"
            ),
        }),
    }
}

pub fn instance_name(id: i32) -> Option<String> {
    sql::instance_name_of(id)
}
