//! The stream catalog (`streampos.streams`, `streampos.instances`) read through
//! SPI, with a per-backend cache: writers look their stream up on every
//! allocation, and the catalog changes rarely.
//!
//! The cache is dropped when the shared catalog generation moves (any
//! backend's DDL, bumped at the call and again when its transaction ends) and
//! after any abort in this backend (an instance created by an aborted
//! transaction does not exist).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiResult, SpiTupleTable};

use crate::error::Error;
use crate::registry;

#[derive(Clone, Debug)]
pub struct StreamMeta {
    pub name: String,
    pub key: i32,
    pub seq: pg_sys::Oid,
    pub seq_name: String,
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
    streams: HashMap<String, StreamMeta>,
    instance_ids: HashMap<String, i32>,
}

thread_local! {
    static CACHE: RefCell<Cache> = RefCell::new(Cache::default());
    /// Set by the abort callback (which must not allocate or free).
    static CLEAR_ON_NEXT_USE: Cell<bool> = const { Cell::new(false) };
    /// This transaction changed the catalog: bump the generation at its end.
    static CHANGED: Cell<bool> = const { Cell::new(false) };
}

fn with_cache<R>(f: impl FnOnce(&mut Cache) -> R) -> R {
    CACHE.with(|c| {
        let mut cache = c.borrow_mut();
        let generation = registry::catalog_generation();
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

pub fn end_transaction(committed: bool) {
    if !committed {
        CLEAR_ON_NEXT_USE.with(|x| x.set(true));
    }
    if CHANGED.with(|x| x.replace(false)) {
        registry::bump_catalog_generation();
    }
}

/// Called by every function that changes the catalog.
pub fn mark_changed() {
    registry::set_last_catalog_xid(unsafe { pg_sys::GetTopTransactionId() });
    CHANGED.with(|x| x.set(true));
    registry::bump_catalog_generation();
    CLEAR_ON_NEXT_USE.with(|x| x.set(true));
}

/// The first column of the first row, or None for no rows (pgrx's `first()`
/// errors on an empty table).
pub fn first_one<T: FromDatum + IntoDatum>(table: SpiTupleTable) -> SpiResult<Option<T>> {
    if table.is_empty() {
        Ok(None)
    } else {
        table.first().get_one::<T>()
    }
}

/// The value of an SPI call; an SPI-level failure (not an SQL error, which
/// PostgreSQL raises itself) becomes an ERROR.
pub fn spi<T>(result: SpiResult<T>) -> T {
    match result {
        Ok(v) => v,
        Err(e) => Error::InvalidState {
            message: format!("catalog query failed: {e}"),
            detail: None,
        }
        .report(),
    }
}

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

fn load_stream(name: &str) -> Option<StreamMeta> {
    let row = Spi::connect(|client| -> SpiResult<Option<StreamMeta>> {
        let table = client.select(
            "SELECT stream_key, seq::oid, seq::text, owns_sequence, backwards, writers \
             FROM streampos.streams WHERE stream_name = $1",
            Some(1),
            &[name.into()],
        )?;
        if table.is_empty() {
            return Ok(None);
        }
        let row = table.first();
        let writers: Option<Vec<Option<String>>> = row.get(6)?;
        Ok(Some(StreamMeta {
            name: name.to_string(),
            key: row.get(1)?.unwrap_or_default(),
            seq: row.get(2)?.unwrap_or(pg_sys::InvalidOid),
            seq_name: row.get(3)?.unwrap_or_default(),
            owns_sequence: row.get(4)?.unwrap_or_default(),
            backwards: row.get(5)?.unwrap_or_default(),
            writers: writers.map(|w| w.into_iter().flatten().collect()),
        }))
    });
    spi(row)
}

/// The stream's catalog row, or 42704.
pub fn stream(name: &str) -> Result<StreamMeta, Error> {
    if let Some(meta) = with_cache(|c| c.streams.get(name).cloned()) {
        return Ok(meta);
    }
    let meta = load_stream(name).ok_or_else(|| Error::UnknownStream(name.to_string()))?;
    // A snapshot older than the latest catalog change may have read a row
    // that is gone already: use it for this call only.
    if registry::snapshot_sees_catalog(registry::caller_snapshot()) {
        with_cache(|c| c.streams.insert(name.to_string(), meta.clone()));
    }
    Ok(meta)
}

/// Every stream of this database by registry key.
pub fn streams_by_key() -> HashMap<i32, StreamMeta> {
    let names: Vec<String> = spi(Spi::connect(|client| -> SpiResult<Vec<String>> {
        let table = client.select("SELECT stream_name FROM streampos.streams", None, &[])?;
        let mut names = Vec::new();
        for row in table {
            if let Some(n) = row.get::<String>(1)? {
                names.push(n);
            }
        }
        Ok(names)
    }));
    names
        .iter()
        .filter_map(|n| stream(n).ok())
        .map(|m| (m.key, m))
        .collect()
}

pub fn lookup_instance_id(name: &str) -> Option<i32> {
    if let Some(id) = with_cache(|c| c.instance_ids.get(name).copied()) {
        return Some(id);
    }
    let id: Option<i32> = spi(Spi::connect(|client| {
        first_one::<i32>(client.select(
            "SELECT instance_id FROM streampos.instances WHERE instance_name = $1",
            Some(1),
            &[name.into()],
        )?)
    }));
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
    let inserted: Option<i32> = spi(Spi::connect_mut(|client| {
        let args: [DatumWithOid; 1] = [name.into()];
        first_one::<i32>(client.update(
            "INSERT INTO streampos.instances (instance_name) VALUES ($1) \
                 ON CONFLICT (instance_name) DO NOTHING RETURNING instance_id",
            Some(1),
            &args,
        )?)
    }));
    let id = match inserted {
        Some(id) => Some(id),
        None => lookup_instance_id(name),
    };
    match id {
        Some(id) => {
            with_cache(|c| c.instance_ids.insert(name.to_string(), id));
            Ok(id)
        }
        None => Err(Error::InvalidState {
            message: format!("instance \"{name}\" was created concurrently and is not visible to this transaction"),
            detail: Some("Retry the transaction.".into()),
        }),
    }
}

pub fn instance_name(id: i32) -> Option<String> {
    spi(Spi::connect(|client| {
        first_one::<String>(client.select(
            "SELECT instance_name FROM streampos.instances WHERE instance_id = $1",
            Some(1),
            &[id.into()],
        )?)
    }))
}

pub fn instance_names() -> HashMap<i32, String> {
    spi(Spi::connect(|client| -> SpiResult<HashMap<i32, String>> {
        let mut map = HashMap::new();
        for row in client.select(
            "SELECT instance_id, instance_name FROM streampos.instances",
            None,
            &[],
        )? {
            if let (Some(id), Some(name)) = (row.get::<i32>(1)?, row.get::<String>(2)?) {
                map.insert(id, name);
            }
        }
        Ok(map)
    }))
}

/// The highest value the sequence has handed out (internal numbering).
/// `is_called = false` means `last_value` is not handed out yet.
pub fn sequence_max_allocated(meta: &StreamMeta) -> i64 {
    let query = format!("SELECT last_value, is_called FROM {}", meta.seq_name);
    let (last, called) = spi(Spi::connect(|client| {
        client
            .select(query.as_str(), Some(1), &[])?
            .first()
            .get_two::<i64, bool>()
    }));
    let last = last.unwrap_or(0);
    if called.unwrap_or(false) {
        last
    } else {
        last.saturating_sub(1)
    }
}

/// (instance id, stored position in internal numbering) for the stream.
pub fn stored_positions(stream: &str) -> Vec<(i32, i64)> {
    spi(Spi::connect(|client| -> SpiResult<Vec<(i32, i64)>> {
        let mut out = Vec::new();
        for row in client.select(
            "SELECT i.instance_id, abs(p.stream_id) FROM streampos.stream_positions p \
             JOIN streampos.instances i USING (instance_name) WHERE p.stream_name = $1",
            None,
            &[stream.into()],
        )? {
            if let (Some(id), Some(pos)) = (row.get::<i32>(1)?, row.get::<i64>(2)?) {
                out.push((id, pos));
            }
        }
        Ok(out)
    }))
}

/// Run a statement that changes the catalog.
pub fn run(query: &str, args: &[DatumWithOid]) {
    spi(Spi::connect_mut(|client| {
        client.update(query, None, args).map(|_| ())
    }));
}

pub fn query_one<T: FromDatum + IntoDatum>(query: &str, args: &[DatumWithOid]) -> Option<T> {
    spi(Spi::connect_mut(|client| {
        first_one::<T>(client.update(query, Some(1), args)?)
    }))
}
