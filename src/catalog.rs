//! The stream catalog (`streampos.streams`, `streampos.instances`) with a
//! per-backend cache: writers look their stream up on every allocation, and
//! the catalog changes rarely.
//!
//! The cache is dropped when the shared catalog generation moves (any
//! backend's catalog change, bumped at the call and again when its
//! transaction ends) and after any abort in this backend (an instance created
//! by an aborted transaction does not exist). A stream row is cached only if
//! it was read by a snapshot that sees the latest catalog-changing
//! transaction, whose xid is kept in shared memory. Dropping and creating
//! the extension again (which restarts stream keys) is noticed through the
//! relcache invalidation of the dropped catalog table.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::Ordering;

use pgrx::pg_sys;
use pgrx::pg_sys::TransactionId;

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
    /// Internal (positive) numbering to the API's.
    pub fn external(&self, id: i64) -> i64 {
        if self.backwards {
            -id
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
    generation: Option<u64>,
    /// Shared, not copied: every call of every function looks its stream up.
    streams: FastMap<String, Rc<StreamMeta>>,
    instance_ids: FastMap<String, i32>,
}

/// The OID of `streampos.streams` when the cache was last filled: its
/// relcache invalidation (the table was dropped, with the extension) clears
/// the cache.
static mut STREAMS_TABLE: pg_sys::Oid = pg_sys::InvalidOid;

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache::default());
    /// Set by the abort callback (which must not allocate or free).
    static CLEAR_ON_NEXT_USE: Cell<bool> = const { Cell::new(false) };
    /// This transaction changed the catalog: bump the generation at its end.
    static CHANGED: Cell<bool> = const { Cell::new(false) };
}

// --------------------------------------------------------------- generation

fn generation() -> Option<u64> {
    registry::catalog_sync().map(|c| c.generation.load(Ordering::Acquire))
}

fn bump_generation() {
    if let Some(c) = registry::catalog_sync() {
        c.generation.fetch_add(1, Ordering::AcqRel);
    }
}

/// Does `snapshot` see the latest catalog change as finished? Rows it read
/// may then be cached (they stay valid until the generation moves).
fn snapshot_sees_catalog(snapshot: pg_sys::Snapshot) -> bool {
    let Some(c) = registry::catalog_sync() else {
        return false;
    };
    let xid = TransactionId::from_inner(c.last_xid.load(Ordering::Acquire));
    // SAFETY: `snapshot` is the caller's valid MVCC snapshot.
    xid == TransactionId::INVALID || !unsafe { pg_sys::XidInMVCCSnapshot(xid, snapshot) }
}

fn with_cache<R>(f: impl FnOnce(&mut Cache) -> R) -> R {
    CACHE.with(|c| {
        let mut cache = c.borrow_mut();
        let generation = generation();
        if CLEAR_ON_NEXT_USE.with(|x| x.replace(false))
            || generation.is_none()
            || cache.generation != generation
        {
            cache.streams.clear();
            cache.instance_ids.clear();
            cache.generation = generation;
        }
        f(&mut cache)
    })
}

/// Called once per process from `_PG_init`.
pub fn register_invalidation() {
    // SAFETY: registers a callback for this process's relcache invalidations.
    unsafe {
        pg_sys::CacheRegisterRelcacheCallback(
            Some(on_relcache_invalidation),
            pg_sys::Datum::from(0),
        )
    };
}

/// A relcache invalidation: `relid` changed (InvalidOid: every relation).
/// Only sets a flag (it may run in the middle of anything).
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_relcache_invalidation(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    // SAFETY: a backend-local OID, read only here and where it is set.
    let ours = unsafe { STREAMS_TABLE };
    if relid == pg_sys::InvalidOid || (ours != pg_sys::InvalidOid && relid == ours) {
        CLEAR_ON_NEXT_USE.with(|x| x.set(true));
        crate::registry::forget_all_indexes();
    }
}

/// From the commit and abort callbacks: no allocation, no error.
pub fn end_transaction(committed: bool) {
    if !committed {
        CLEAR_ON_NEXT_USE.with(|x| x.set(true));
    }
    if CHANGED.with(|x| x.replace(false)) {
        bump_generation();
    }
}

/// Called by every function that changes the catalog.
pub fn mark_changed() {
    if let Some(c) = registry::catalog_sync() {
        // SAFETY: assigns (or returns) this transaction's top xid.
        let xid = unsafe { pg_sys::GetTopTransactionId() };
        c.last_xid.store(xid.into_inner(), Ordering::Release);
    }
    CHANGED.with(|x| x.set(true));
    bump_generation();
    CLEAR_ON_NEXT_USE.with(|x| x.set(true));
}

// -------------------------------------------------------------------- names

/// Stream names are 1 to 59 bytes: the owned sequence is "<name>_seq".
pub fn validate_stream_name(name: &str) -> Result<(), Error> {
    validate_name("stream", name, 59)
}

pub fn validate_instance_name(name: &str) -> Result<(), Error> {
    validate_name("instance", name, 63)
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

fn load_stream(name: &str) -> Option<StreamMeta> {
    // SAFETY: a backend-local OID, written here, read by the callback.
    unsafe { STREAMS_TABLE = sql::streams_table_oid() };
    sql::stream_row(name).map(|row| StreamMeta {
        name: name.to_string(),
        key: row.key,
        seq: row.seq,
        owns_sequence: row.owns_sequence,
        backwards: row.backwards,
        writers: row.writers,
    })
}

/// The stream's catalog row, or 42704.
pub fn stream(name: &str) -> Result<Rc<StreamMeta>, Error> {
    if let Some(meta) = with_cache(|c| c.streams.get(name).cloned()) {
        return Ok(meta);
    }
    let meta = Rc::new(load_stream(name).ok_or_else(|| Error::UnknownStream(name.into()))?);
    // A snapshot older than the latest catalog change may have read a row
    // that is gone already: use it for this call only.
    if snapshot_sees_catalog(registry::caller_snapshot()) {
        with_cache(|c| c.streams.insert(name.to_string(), meta.clone()));
    }
    Ok(meta)
}

/// Every stream of this database by registry key.
pub fn streams_by_key() -> HashMap<i32, Rc<StreamMeta>> {
    sql::stream_names()
        .iter()
        .filter_map(|n| stream(n).ok())
        .map(|m| (m.key, m))
        .collect()
}

// ---------------------------------------------------------------- instances

pub fn lookup_instance_id(name: &str) -> Option<i32> {
    if let Some(id) = with_cache(|c| c.instance_ids.get(name).copied()) {
        return Some(id);
    }
    let id = sql::instance_id_of(name);
    if let Some(id) = id {
        with_cache(|c| c.instance_ids.insert(name.to_string(), id));
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
    let id = sql::insert_instance(name).or_else(|| sql::instance_id_of(name));
    match id {
        Some(id) => {
            with_cache(|c| c.instance_ids.insert(name.to_string(), id));
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
