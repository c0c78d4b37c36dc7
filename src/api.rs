//! The SQL API of the stream engine: streams and writers, allocation, and
//! positions for the caller's snapshot.

use pgrx::datum::DatumWithOid;
use pgrx::pgrx_sql_entity_graph::metadata::{
    ArgumentError, ReturnsError, ReturnsRef, SqlMappingRef, SqlTranslatable, TypeOrigin,
};
use pgrx::prelude::*;
use pgrx::{IntoDatum, PgRelation};
use streampos_core::frontier;
use streampos_core::token::Token;

use crate::catalog::{self, StreamMeta};
use crate::error::{Error, OrRaise};
use crate::registry::{self, StreamView};
use crate::types::{MultiWriterToken, RoomToken};
use crate::{guc, worker};

extern "C-unwind" {
    fn nextval_internal(relid: pg_sys::Oid, check_permissions: bool) -> i64;
}

/// The LSN of the sequence's page: the end of the WAL record that made the
/// values just handed out survive a crash (nextval logs 32 values ahead,
/// whichever backend's call wrote it). Until the WAL is flushed that far, a
/// crash could hand these IDs out again.
fn sequence_page_lsn(seq: pg_sys::Oid) -> u64 {
    unsafe {
        pg_sys::ffi::pg_guard_ffi_boundary(|| {
            let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
            // nextval already holds a stronger lock: this is a local lookup.
            let rel = pg_sys::relation_open(seq, lock);
            let buffer = pg_sys::ReadBuffer(rel, 0);
            pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as i32);
            let page = if buffer > 0 {
                pg_sys::BufferBlocks.add((buffer as usize - 1) * pg_sys::BLCKSZ as usize)
                    as *const pg_sys::PageHeaderData
            } else {
                *pg_sys::LocalBufferBlockPointers.add((-buffer - 1) as usize)
                    as *const pg_sys::PageHeaderData
            };
            let lsn = ((*page).pd_lsn.xlogid as u64) << 32 | (*page).pd_lsn.xrecoff as u64;
            pg_sys::UnlockReleaseBuffer(buffer);
            pg_sys::relation_close(rel, lock);
            lsn
        })
    }
}

/// `nextval` without the SQL call overhead. EXECUTE on next_id() is the
/// permission that matters, so the sequence's own is not checked.
fn nextval(seq: pg_sys::Oid) -> i64 {
    unsafe { pg_sys::ffi::pg_guard_ffi_boundary(|| nextval_internal(seq, false)) }
}

/// Most IDs one call may allocate.
const MAX_IDS_PER_CALL: i32 = 1_000_000;

/// A `regclass` return value.
pub struct RegClass(pub pg_sys::Oid);

impl IntoDatum for RegClass {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        self.0.into_datum()
    }
    fn type_oid() -> pg_sys::Oid {
        pg_sys::REGCLASSOID
    }
}

unsafe impl pgrx::callconv::BoxRet for RegClass {
    unsafe fn box_into<'fcx>(
        self,
        fcinfo: &mut pgrx::callconv::FcInfo<'fcx>,
    ) -> pgrx::datum::Datum<'fcx> {
        unsafe { fcinfo.return_raw_datum(pg_sys::Datum::from(self.0)) }
    }
}

unsafe impl SqlTranslatable for RegClass {
    const TYPE_IDENT: &'static str = pgrx::pgrx_resolved_type!(RegClass);
    const TYPE_ORIGIN: TypeOrigin = TypeOrigin::External;
    const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> =
        Ok(SqlMappingRef::literal("regclass"));
    const RETURN_SQL: Result<ReturnsRef, ReturnsError> =
        Ok(ReturnsRef::One(SqlMappingRef::literal("regclass")));
}

// ---------------------------------------------------------------- streams

fn ensure_writer_instances(writers: &Option<Vec<Option<String>>>) -> Option<Vec<String>> {
    let writers = writers.as_ref()?;
    let mut names = Vec::with_capacity(writers.len());
    for w in writers {
        let Some(w) = w else {
            Error::invalid("writers must not contain NULL").report();
        };
        catalog::instance_id(w).or_raise();
        if !names.contains(w) {
            names.push(w.clone());
        }
    }
    Some(names)
}

fn check_new_stream(stream: &str) {
    catalog::validate_stream_name(stream).or_raise();
    if catalog::stream(stream).is_ok() {
        Error::StreamExists(stream.into()).report();
    }
}

#[pg_extern(volatile, parallel_unsafe)]
fn create_stream(
    stream: &str,
    backwards: default!(bool, false),
    writers: default!(Option<Vec<Option<String>>>, "NULL"),
) -> RegClass {
    check_new_stream(stream);
    let writers = ensure_writer_instances(&writers);
    catalog::run(
        &format!(
            "CREATE SEQUENCE streampos.{} AS bigint INCREMENT 1 MINVALUE 1 START 1 CACHE 1 NO CYCLE",
            quote_ident(&format!("{stream}_seq"))
        ),
        &[],
    );
    let seq: pg_sys::Oid = catalog::query_one(
        "SELECT format('streampos.%I', $1::text)::regclass::oid",
        &[format!("{stream}_seq").into()],
    )
    .unwrap_or(pg_sys::InvalidOid);
    // Readers load the sequence's value once after start-up.
    catalog::run(
        &format!(
            "GRANT SELECT ON SEQUENCE streampos.{} TO PUBLIC",
            quote_ident(&format!("{stream}_seq"))
        ),
        &[],
    );
    insert_stream(stream, seq, true, backwards, writers);
    RegClass(seq)
}

fn insert_stream(
    stream: &str,
    seq: pg_sys::Oid,
    owns: bool,
    backwards: bool,
    writers: Option<Vec<String>>,
) {
    let args: [DatumWithOid; 5] = [
        stream.into(),
        DatumWithOid::from(RegClass(seq).0),
        owns.into(),
        backwards.into(),
        match writers {
            Some(w) => w.into(),
            None => DatumWithOid::null::<Vec<String>>(),
        },
    ];
    catalog::run(
        "INSERT INTO streampos.streams (stream_name, seq, owns_sequence, backwards, writers) \
         VALUES ($1, $2::oid::regclass, $3, $4, $5)",
        &args,
    );
    catalog::mark_changed();
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

#[pg_extern(volatile, parallel_unsafe)]
fn adopt_stream(
    stream: &str,
    seq: PgRelation,
    backwards: default!(bool, false),
    writers: default!(Option<Vec<Option<String>>>, "NULL"),
) {
    check_new_stream(stream);
    let oid = seq.oid();
    let (increment, cache): (Option<i64>, Option<i64>) = spi_two(
        "SELECT seqincrement, seqcache FROM pg_catalog.pg_sequence WHERE seqrelid = $1",
        &[oid.into()],
    );
    match (increment, cache) {
        (Some(1), Some(1)) => {}
        (None, _) => Error::InvalidArgument {
            message: format!("\"{}\" is not a sequence", seq.name()),
            detail: None,
        }
        .report(),
        (increment, cache) => Error::InvalidArgument {
            message: format!("sequence \"{}\" must have INCREMENT 1 and CACHE 1", seq.name()),
            detail: Some(format!(
                "It has INCREMENT {} and CACHE {}. With a cache, backends hand out IDs out of order, which no registry can see.",
                increment.unwrap_or(0),
                cache.unwrap_or(0)
            )),
        }
        .report(),
    }
    let writers = ensure_writer_instances(&writers);
    insert_stream(stream, oid, false, backwards, writers);
}

fn spi_two<A: FromDatum + IntoDatum, B: FromDatum + IntoDatum>(
    query: &str,
    args: &[DatumWithOid],
) -> (Option<A>, Option<B>) {
    catalog::spi(Spi::connect(|client| {
        let table = client.select(query, Some(1), args)?;
        if table.is_empty() {
            Ok((None, None))
        } else {
            table.first().get_two::<A, B>()
        }
    }))
}

#[pg_extern(volatile, parallel_unsafe)]
fn add_table(
    stream: &str,
    tbl: PgRelation,
    id_column: &str,
    instance_column: default!(Option<&str>, "NULL"),
) {
    catalog::stream(stream).or_raise();
    let oid = tbl.oid();
    for column in std::iter::once(id_column).chain(instance_column) {
        let exists: Option<bool> = catalog::query_one(
            "SELECT true FROM pg_catalog.pg_attribute WHERE attrelid = $1 AND attname = $2 AND attnum > 0 AND NOT attisdropped",
            &[oid.into(), column.into()],
        );
        if exists.is_none() {
            ErrorReport::new(
                PgSqlErrorCode::ERRCODE_UNDEFINED_COLUMN,
                format!(
                    "column \"{column}\" of relation \"{}\" does not exist",
                    tbl.name()
                ),
                "streampos",
            )
            .report(PgLogLevel::ERROR);
        }
    }
    catalog::run(
        "INSERT INTO streampos.stream_tables (stream_name, tbl, id_column, instance_column) \
         VALUES ($1, $2::oid::regclass, $3, $4) \
         ON CONFLICT (stream_name, tbl) DO UPDATE SET id_column = EXCLUDED.id_column, instance_column = EXCLUDED.instance_column",
        &[stream.into(), oid.into(), id_column.into(), instance_column.into()],
    );
    catalog::mark_changed();
}

use pgrx::pg_sys::panic::ErrorReport;

#[pg_extern(volatile, parallel_unsafe)]
fn set_writers(stream: &str, writers: Option<Vec<Option<String>>>) {
    let meta = catalog::stream(stream).or_raise();
    let writers = ensure_writer_instances(&writers);
    let args: [DatumWithOid; 2] = [
        stream.into(),
        match writers.clone() {
            Some(w) => w.into(),
            None => DatumWithOid::null::<Vec<String>>(),
        },
    ];
    catalog::run(
        "UPDATE streampos.streams SET writers = $2 WHERE stream_name = $1",
        &args,
    );
    if let Some(writers) = writers {
        // A removed writer loses its stored position; a new one starts at the
        // frontier (never ahead of the truth).
        catalog::run(
            "DELETE FROM streampos.stream_positions WHERE stream_name = $1 AND instance_name <> ALL ($2)",
            &[stream.into(), writers.clone().into()],
        );
        let v = view(&meta);
        let front = meta.external(frontier::frontier(v.max_allocated, &v.holders));
        catalog::run(
            "INSERT INTO streampos.stream_positions (stream_name, instance_name, stream_id) \
             SELECT $1, w, $3 FROM unnest($2::text[]) w ON CONFLICT DO NOTHING",
            &[stream.into(), writers.into(), front.into()],
        );
    }
    catalog::mark_changed();
}

#[pg_extern(volatile, parallel_unsafe)]
fn drop_stream(stream: &str) {
    let meta = catalog::stream(stream).or_raise();
    catalog::run(
        "DELETE FROM streampos.streams WHERE stream_name = $1",
        &[stream.into()],
    );
    if meta.owns_sequence {
        catalog::run(&format!("DROP SEQUENCE IF EXISTS {}", meta.seq_name), &[]);
    }
    if registry::is_loaded() {
        registry::mark_dropped(meta.key).or_raise();
    }
    catalog::mark_changed();
}

#[pg_extern(volatile, strict, parallel_unsafe)]
fn instance_id(instance_name: &str) -> i32 {
    catalog::instance_id(instance_name).or_raise()
}

#[pg_extern(stable, strict, parallel_restricted)]
fn instance_name(instance_id: i32) -> String {
    catalog::instance_name(instance_id)
        .unwrap_or_else(|| Error::UnknownInstanceId(instance_id).report())
}

// ---------------------------------------------------------------- writing

/// The registry slot of a stream, loading its maximum allocated ID from the
/// sequence the first time after start-up.
pub(crate) fn registry_index(meta: &StreamMeta) -> usize {
    registry::require_loaded().or_raise();
    let (index, loaded) = registry::stream_index(meta.key).or_raise();
    if !loaded {
        let max = catalog::sequence_max_allocated(meta);
        let stored: Vec<i32> = catalog::stored_positions(&meta.name)
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        registry::set_loaded(index, max, &stored).or_raise();
    }
    index
}

fn allocate(stream: &str, writer: &str, n: i32) -> Vec<i64> {
    registry::require_loaded().or_raise();
    if !(1..=MAX_IDS_PER_CALL).contains(&n) {
        Error::InvalidArgument {
            message: format!("cannot allocate {n} IDs"),
            detail: Some(format!("n must be between 1 and {MAX_IDS_PER_CALL}.")),
        }
        .report();
    }
    if unsafe { pg_sys::RecoveryInProgress() } {
        Error::ReadOnly("during recovery").report();
    }
    if unsafe { pg_sys::XactReadOnly } {
        Error::ReadOnly("in a read-only transaction").report();
    }
    let meta = catalog::stream(stream).or_raise();
    catalog::validate_instance_name(writer).or_raise();
    if !meta.allows(writer) {
        Error::NotAWriter {
            stream: stream.into(),
            instance: writer.into(),
        }
        .report();
    }
    let instance = catalog::instance_id(writer).or_raise();
    if worker::ensure_running() {
        registry::prune_if_crowded().or_raise();
    }
    // Visibility checks compare against this xid.
    let xid = unsafe { pg_sys::GetTopTransactionId() };
    let (index, entry) = with_index(&meta, |index| {
        Ok(registry::begin_allocation(index, meta.key, instance, xid)?.map(|entry| (index, entry)))
    });
    let delay = guc::ALLOCATION_DELAY_MS.get();
    if delay > 0 {
        unsafe { pg_sys::pg_usleep(delay as i64 * 1000) };
    }
    let mut ids = Vec::with_capacity(n as usize);
    for _ in 0..n {
        ids.push(nextval(meta.seq));
    }
    let first = ids.first().copied().unwrap_or(0);
    let last = ids.last().copied().unwrap_or(0);
    let lsn = sequence_page_lsn(meta.seq);
    registry::finish_allocation(index, entry, instance, first, last, n as i64, lsn).or_raise();
    if meta.backwards {
        ids.iter_mut().for_each(|id| *id = -*id);
    }
    ids
}

#[pg_extern(volatile, strict, parallel_unsafe)]
fn next_id(stream: &str, writer: &str) -> i64 {
    allocate(stream, writer, 1).first().copied().unwrap_or(0)
}

#[pg_extern(volatile, strict, parallel_unsafe)]
fn next_ids(stream: &str, writer: &str, n: i32) -> Vec<i64> {
    allocate(stream, writer, n)
}

// ---------------------------------------------------------------- reading

fn view(meta: &StreamMeta) -> StreamView {
    if in_recovery() {
        return standby_view(meta);
    }
    let snapshot = registry::caller_snapshot();
    let key = ViewKey::of(meta.key, snapshot);
    let cached = VIEW_CACHE.with(|c| {
        c.borrow()
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.clone())
    });
    if let Some(v) = cached {
        return v;
    }
    let v = with_index(meta, |index| registry::view(index, meta.key, snapshot));
    VIEW_CACHE.with(|c| {
        let mut cache = c.borrow_mut();
        cache.retain(|(k, _)| k.statement == key.statement);
        if cache.len() >= 16 {
            cache.remove(0);
        }
        cache.push((key, v.clone()));
    });
    v
}

/// One statement's snapshot, as far as positions are concerned.
#[derive(Clone, Copy, PartialEq, Eq)]
struct ViewKey {
    stream: i32,
    snapshot: usize,
    xmin: u32,
    xmax: u32,
    completion_count: u64,
    statement: pg_sys::TimestampTz,
}

impl ViewKey {
    fn of(stream: i32, snapshot: pg_sys::Snapshot) -> ViewKey {
        unsafe {
            ViewKey {
                stream,
                snapshot: snapshot as usize,
                xmin: (*snapshot).xmin.into_inner(),
                xmax: (*snapshot).xmax.into_inner(),
                completion_count: (*snapshot).snapXactCompletionCount,
                statement: pg_sys::GetCurrentStatementStartTimestamp(),
            }
        }
    }
}

thread_local! {
    /// Answers already given in this statement. `frontier()` is STABLE: the
    /// same statement must get the same answer, or `WHERE id <= frontier(s)`
    /// could filter early rows with one value and report a later, higher
    /// one (an abort or a WAL flush moves the answer for the same
    /// snapshot). A cached answer stays correct for the snapshot: IDs
    /// allocated since are above it.
    static VIEW_CACHE: std::cell::RefCell<Vec<(ViewKey, StreamView)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Run `f` with the stream's registry index. The index is cached per
/// backend and validated by `f` under the registry lock; if it went stale
/// (the stream was dropped and its state reused), look it up again.
pub(crate) fn with_index<T>(
    meta: &StreamMeta,
    f: impl Fn(usize) -> Result<Result<T, registry::Stale>, Error>,
) -> T {
    for _ in 0..2 {
        let index = registry_index(meta);
        match f(index).or_raise() {
            Ok(value) => return value,
            Err(registry::Stale) => registry::forget_index(meta.key),
        }
    }
    Error::InvalidState {
        message: format!("stream \"{}\" was dropped concurrently", meta.name),
        detail: None,
    }
    .report()
}

pub(crate) fn in_recovery() -> bool {
    unsafe { pg_sys::RecoveryInProgress() }
}

/// A hot standby cannot see what is in flight on the primary (and its
/// sequences may be up to 32 ahead of what was handed out), so it answers
/// from the durable positions, which replicate in commit order and are never
/// ahead of the truth. Writers without a stored position read as the
/// frontier (see writer_position).
fn standby_view(meta: &StreamMeta) -> StreamView {
    let stored = catalog::stored_positions(&meta.name);
    let max_allocated = stored.iter().map(|(_, p)| *p).max().unwrap_or(0);
    let holders = stored
        .iter()
        .filter(|(_, p)| *p < max_allocated)
        .map(|(w, p)| frontier::Holder {
            held_by: frontier::HeldBy::Writer(*w),
            min_id: p + 1,
        })
        .collect();
    StreamView {
        max_allocated,
        holders,
        seen: stored.iter().map(|(w, _)| *w).collect(),
    }
}

/// The writers a token or `writer_positions` reports: the configured ones,
/// or for an open stream every instance seen writing since start-up (or
/// with a stored position when the stream was first used) or holding IDs now.
pub(crate) fn writer_ids(meta: &StreamMeta, v: &StreamView) -> Vec<i32> {
    let mut ids: Vec<i32> = match &meta.writers {
        Some(names) => names
            .iter()
            .filter_map(|n| catalog::lookup_instance_id(n))
            .collect(),
        None => {
            let mut ids = v.seen.clone();
            ids.extend(v.holders.iter().filter_map(|h| match h.held_by {
                frontier::HeldBy::Writer(w) => Some(w),
                frontier::HeldBy::AllWriters => None,
            }));
            ids
        }
    };
    ids.sort_unstable();
    ids.dedup();
    ids
}

#[pg_extern(stable, strict, parallel_restricted)]
fn frontier(stream: &str) -> i64 {
    let meta = catalog::stream(stream).or_raise();
    let v = view(&meta);
    meta.external(frontier::frontier(v.max_allocated, &v.holders))
}

#[pg_extern(stable, strict, parallel_restricted)]
fn max_allocated(stream: &str) -> i64 {
    let meta = catalog::stream(stream).or_raise();
    meta.external(view(&meta).max_allocated)
}

#[pg_extern(stable, strict, parallel_restricted)]
fn writer_position(stream: &str, writer: &str) -> i64 {
    let meta = catalog::stream(stream).or_raise();
    if !meta.allows(writer) {
        Error::NotAWriter {
            stream: stream.into(),
            instance: writer.into(),
        }
        .report();
    }
    let v = view(&meta);
    let id = catalog::lookup_instance_id(writer);
    let position = match id {
        // On a standby, only stored positions are known.
        _ if in_recovery() && !id.is_some_and(|id| v.seen.contains(&id)) => {
            frontier::frontier(v.max_allocated, &v.holders)
        }
        Some(id) => frontier::writer_position(v.max_allocated, &v.holders, id),
        // A name this snapshot cannot resolve may belong to a writer whose
        // first transaction (which created the name) is still running: the
        // frontier is the only safe answer.
        None => frontier::frontier(v.max_allocated, &v.holders),
    };
    meta.external(position)
}

#[pg_extern(stable, strict, parallel_restricted)]
fn writer_positions(
    stream: &str,
) -> TableIterator<
    'static,
    (
        name!(instance_name, String),
        name!(instance_id, i32),
        name!(stream_id, i64),
    ),
> {
    let meta = catalog::stream(stream).or_raise();
    let v = view(&meta);
    let names = catalog::instance_names();
    let rows: Vec<(String, i32, i64)> = writer_ids(&meta, &v)
        .into_iter()
        // An instance whose name this snapshot cannot see yet (created by a
        // transaction still running) is left out, as it would be from a
        // token's reader: it reads as the frontier.
        .filter_map(|id| {
            let name = names.get(&id)?.clone();
            let position = frontier::writer_position(v.max_allocated, &v.holders, id);
            Some((name, id, meta.external(position)))
        })
        .collect();
    TableIterator::new(rows)
}

fn token_of(stream: &str) -> Token {
    let meta = catalog::stream(stream).or_raise();
    let v = view(&meta);
    if meta.backwards {
        // Per-writer entries cannot be expressed once negated (they would be
        // below the minimum): a backward stream's token is its frontier.
        return Token::live(meta.external(frontier::frontier(v.max_allocated, &v.holders)));
    }
    frontier::current_token(v.max_allocated, &v.holders, &writer_ids(&meta, &v))
}

#[pg_extern(stable, strict, parallel_restricted)]
fn current_token(stream: &str) -> MultiWriterToken {
    MultiWriterToken(token_of(stream))
}

#[pg_extern(stable, strict, parallel_restricted)]
fn current_room_token(stream: default!(&str, "'events'")) -> RoomToken {
    RoomToken(token_of(stream))
}

#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_restricted)]
fn in_flight(
    stream: default!(Option<&str>, "NULL"),
) -> TableIterator<
    'static,
    (
        name!(stream_name, String),
        name!(instance_name, String),
        name!(pid, i32),
        name!(xid, pg_sys::TransactionId),
        name!(min_id, i64),
        name!(max_id, i64),
        name!(ids, i64),
        name!(since, TimestampWithTimeZone),
    ),
> {
    registry::require_loaded().or_raise();
    if let Some(name) = stream {
        catalog::stream(name).or_raise();
    }
    let db = unsafe { pg_sys::MyDatabaseId };
    let streams = catalog::streams_by_key();
    let names = catalog::instance_names();
    let mut rows = Vec::new();
    for r in registry::in_flight().or_raise() {
        if r.db != db {
            continue;
        }
        let Some(meta) = streams.get(&r.key) else {
            continue;
        };
        if stream.is_some_and(|s| s != meta.name) {
            continue;
        }
        let (lo, hi) = if meta.backwards {
            (-r.max_id, -r.min_id)
        } else {
            (r.min_id, r.max_id)
        };
        let since = TimestampWithTimeZone::try_from(r.since)
            .unwrap_or_else(|_| TimestampWithTimeZone::negative_infinity());
        rows.push((
            meta.name.clone(),
            names.get(&r.instance).cloned().unwrap_or_default(),
            r.pid,
            r.xid,
            lo,
            hi,
            r.ids,
            since,
        ));
    }
    rows.sort_by(|a, b| (a.0.as_str(), a.4).cmp(&(b.0.as_str(), b.4)));
    TableIterator::new(rows)
}

// ---------------------------------------------------------------- checking

#[pg_extern(volatile, parallel_unsafe)]
fn check_stream(
    stream: &str,
    repair: default!(bool, false),
) -> TableIterator<
    'static,
    (
        name!(check_name, String),
        name!(ok, bool),
        name!(detail, String),
    ),
> {
    let meta = catalog::stream(stream).or_raise();
    let mut rows = Vec::new();

    let (increment, cache): (Option<i64>, Option<i64>) = spi_two(
        "SELECT seqincrement, seqcache FROM pg_catalog.pg_sequence WHERE seqrelid = $1",
        &[meta.seq.into()],
    );
    let seq_ok = increment == Some(1) && cache == Some(1);
    rows.push((
        "sequence".to_string(),
        seq_ok,
        format!(
            "{} has INCREMENT {} and CACHE {} (both must be 1)",
            meta.seq_name,
            increment.unwrap_or(0),
            cache.unwrap_or(0)
        ),
    ));

    let seq_max = catalog::sequence_max_allocated(&meta);
    // Highest ID (internal numbering) found in the stream's tables.
    let tables: Vec<(String, String)> = catalog::spi(Spi::connect(
        |client| -> pgrx::spi::SpiResult<Vec<(String, String)>> {
            let mut v = Vec::new();
            for row in client.select(
                "SELECT tbl::text, quote_ident(id_column) FROM streampos.stream_tables \
                 WHERE stream_name = $1 ORDER BY tbl::text",
                None,
                &[stream.into()],
            )? {
                v.push((
                    row.get::<String>(1)?.unwrap_or_default(),
                    row.get::<String>(2)?.unwrap_or_default(),
                ));
            }
            Ok(v)
        },
    ));
    let mut needed = seq_max;
    for (table, column) in &tables {
        let agg = if meta.backwards {
            format!("-min({column})")
        } else {
            format!("max({column})")
        };
        let highest: Option<i64> =
            catalog::query_one(&format!("SELECT {agg}::bigint FROM {table}"), &[]);
        let highest = highest.unwrap_or(0);
        let ok = highest <= seq_max;
        needed = needed.max(highest);
        rows.push((
            format!("table {table}"),
            ok,
            if ok {
                format!(
                    "highest ID {} is not above the sequence ({})",
                    meta.external(highest),
                    meta.external(seq_max)
                )
            } else {
                format!(
                    "row with ID {} is above the sequence ({})",
                    meta.external(highest),
                    meta.external(seq_max)
                )
            },
        ));
    }
    let stored: Option<i64> = catalog::query_one(
        "SELECT max(abs(stream_id)) FROM streampos.stream_positions WHERE stream_name = $1",
        &[stream.into()],
    );
    let stored = stored.unwrap_or(0);
    let ok = stored <= seq_max;
    needed = needed.max(stored);
    rows.push((
        "positions".to_string(),
        ok,
        if ok {
            format!(
                "stored positions are not ahead of the sequence ({})",
                meta.external(seq_max)
            )
        } else {
            format!(
                "a stored position ({}) is ahead of the sequence ({})",
                meta.external(stored),
                meta.external(seq_max)
            )
        },
    ));
    if needed > seq_max {
        if repair {
            // Move the sequence forward; never delete positions or rows.
            catalog::query_one::<i64>(
                "SELECT pg_catalog.setval($1::oid::regclass, $2, true)",
                &[meta.seq.into(), needed.into()],
            );
            if registry::is_loaded() {
                let index = registry_index(&meta);
                registry::raise_max_allocated(index, needed).or_raise();
            }
            rows.push((
                "repair".to_string(),
                true,
                format!("sequence moved forward to {}", meta.external(needed)),
            ));
        } else {
            rows.push((
                "repair".to_string(),
                false,
                "run streampos.check_stream(…, repair => true) to move the sequence forward"
                    .to_string(),
            ));
        }
    }
    TableIterator::new(rows)
}
