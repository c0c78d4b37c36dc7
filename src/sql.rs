//! Every SQL statement the extension runs internally, and the one way it
//! runs them (SPI). Nothing else in the crate builds or executes SQL, so the
//! rules that make internal SQL safe for any caller hold here:
//!
//! - every statement runs with `search_path = pg_catalog, pg_temp` (nothing
//!   in the caller's path can stand in for a function, operator, type or
//!   relation), and still schema-qualifies every function, operator and type
//!   it names;
//! - relations are referred to by OID; when SQL text must name one (a table
//!   to read, a sequence to drop), the name is taken from the catalog for
//!   that OID at the moment of use, never remembered;
//! - the catalog tables are written only here, as the extension's owner
//!   (`as_owner`), never with the caller's privileges: nobody else may write
//!   them;
//! - what reads or changes the caller's own objects (their tables in
//!   `updates` and `check_stream`, `setval` on their sequence) runs with the
//!   caller's privileges.

use std::collections::HashMap;
use std::ffi::{CStr, CString};

use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiResult, SpiTupleTable};

use crate::error::Error;

/// The value of an SPI call; an SPI-level failure (not an SQL error, which
/// PostgreSQL raises itself) is an internal error.
fn spi<T>(result: SpiResult<T>) -> T {
    match result {
        Ok(v) => v,
        Err(e) => Error::Internal(format!("internal query failed: {e}")).report(),
    }
}

/// Run `f` with `search_path = pg_catalog, pg_temp`. The setting is
/// restored afterwards, or by the abort of the (sub)transaction when `f`
/// raises an ERROR.
fn with_safe_path<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: a GUC nest level is opened and closed around `f`; on ERROR,
    // transaction abort unwinds GUC nest levels itself.
    unsafe {
        let level = pg_sys::NewGUCNestLevel();
        pg_sys::set_config_option(
            c"search_path".as_ptr(),
            c"pg_catalog, pg_temp".as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_SAVE,
            true,
            0,
            false,
        );
        let value = f();
        pg_sys::AtEOXact_GUC(true, level);
        value
    }
}

/// The role that owns the extension (and its catalog tables).
fn extension_owner() -> pg_sys::Oid {
    select_one::<pg_sys::Oid>(
        "SELECT e.extowner FROM pg_catalog.pg_extension e \
         WHERE e.extname OPERATOR(pg_catalog.=) 'streampos'",
        &[],
    )
    .unwrap_or_else(|| Error::Internal("extension streampos is not installed".into()).report())
}

/// Run `f` as the extension's owner, in a security-restricted operation,
/// for writes to the catalog tables. The caller's identity is restored
/// afterwards, or by the abort of the (sub)transaction on ERROR.
fn as_owner<T>(f: impl FnOnce() -> T) -> T {
    let owner = extension_owner();
    // SAFETY: the user id and security context are saved and restored
    // around `f`; on ERROR, (sub)transaction abort restores them itself.
    unsafe {
        let mut saved_user = pg_sys::InvalidOid;
        let mut saved_context = 0;
        pg_sys::GetUserIdAndSecContext(&mut saved_user, &mut saved_context);
        pg_sys::SetUserIdAndSecContext(
            owner,
            saved_context
                | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32
                | pg_sys::SECURITY_RESTRICTED_OPERATION as i32,
        );
        let value = f();
        pg_sys::SetUserIdAndSecContext(saved_user, saved_context);
        value
    }
}

/// The first column of the first row, or None for no rows (pgrx's `first()`
/// errors on an empty table).
fn first_one<T: FromDatum + IntoDatum>(table: SpiTupleTable) -> SpiResult<Option<T>> {
    if table.is_empty() {
        Ok(None)
    } else {
        table.first().get_one::<T>()
    }
}

/// Run a statement that changes something.
fn run(query: &str, args: &[DatumWithOid]) {
    with_safe_path(|| {
        spi(Spi::connect_mut(|client| {
            client.update(query, None, args).map(|_| ())
        }))
    });
}

/// The first column of the first row of a read-only query.
fn select_one<T: FromDatum + IntoDatum>(query: &str, args: &[DatumWithOid]) -> Option<T> {
    with_safe_path(|| {
        spi(Spi::connect(|client| {
            first_one::<T>(client.select(query, Some(1), args)?)
        }))
    })
}

/// The first column of the first row of a statement that changes something.
/// (A read-write SPI call assigns the transaction an xid; reads use
/// `select_one`, which reads with the active snapshot and assigns none.)
fn update_one<T: FromDatum + IntoDatum>(query: &str, args: &[DatumWithOid]) -> Option<T> {
    with_safe_path(|| {
        spi(Spi::connect_mut(|client| {
            first_one::<T>(client.update(query, Some(1), args)?)
        }))
    })
}

/// Every row of a read-only query, each converted by `row`.
fn select_all<T>(
    query: &str,
    args: &[DatumWithOid],
    mut row: impl FnMut(pgrx::spi::SpiHeapTupleData) -> SpiResult<Option<T>>,
) -> Vec<T> {
    with_safe_path(|| {
        spi(Spi::connect(|client| {
            let mut out = Vec::new();
            for r in client.select(query, None, args)? {
                if let Some(v) = row(r)? {
                    out.push(v);
                }
            }
            Ok(out)
        }))
    })
}

/// `ident` quoted for SQL text when it needs quoting (PostgreSQL's own rule).
fn quote_ident(ident: &str) -> String {
    let Ok(c) = CString::new(ident) else {
        // Identifiers come from the catalog and never contain NUL.
        return format!("\"{}\"", ident.replace('"', "\"\""));
    };
    // SAFETY: quote_identifier returns its argument or a palloc'd copy,
    // both valid NUL-terminated strings for the duration of this call.
    unsafe {
        CStr::from_ptr(pg_sys::quote_identifier(c.as_ptr()))
            .to_string_lossy()
            .into_owned()
    }
}

/// The schema-qualified, quoted name of relation `oid` now, for SQL text
/// and messages; `oid <n>` if it no longer exists.
pub fn relation_name(oid: pg_sys::Oid) -> String {
    // SAFETY: syscache lookups that return NULL (not an ERROR) for a missing
    // relation or schema; the strings are palloc'd and NUL-terminated.
    unsafe {
        let rel = pg_sys::get_rel_name(oid);
        let nsp = pg_sys::get_namespace_name(pg_sys::get_rel_namespace(oid));
        if rel.is_null() || nsp.is_null() {
            return format!("oid {}", oid.to_u32());
        }
        let rel = CStr::from_ptr(rel).to_string_lossy();
        let nsp = CStr::from_ptr(nsp).to_string_lossy();
        format!("{}.{}", quote_ident(&nsp), quote_ident(&rel))
    }
}

/// The name of role `oid`, quoted for SQL text.
fn role_name(oid: pg_sys::Oid) -> String {
    // SAFETY: with noerr = false a missing role is an ERROR; the result is a
    // palloc'd NUL-terminated string.
    let name = unsafe { CStr::from_ptr(pg_sys::GetUserNameFromId(oid, false)) };
    quote_ident(&name.to_string_lossy())
}

// ------------------------------------------------------------------ catalog

/// A row of `streampos.streams`.
pub struct StreamRow {
    pub key: i32,
    pub seq: pg_sys::Oid,
    pub owns_sequence: bool,
    pub backwards: bool,
    pub writers: Option<Vec<String>>,
}

/// The stream's row as the latest snapshot sees it (with this transaction's
/// own changes).
pub fn stream_row(name: &str) -> Option<StreamRow> {
    // SAFETY: called inside a running transaction, never in parallel mode
    // (its callers change the catalog); the command counter moves first so
    // that the transaction's own changes so far are seen.
    let snapshot = unsafe {
        pg_sys::CommandCounterIncrement();
        pg_sys::GetLatestSnapshot()
    };
    stream_row_as_of(name, snapshot)
}

/// The stream's row as `snapshot` sees it. Executed read-only with exactly
/// that snapshot (`SPI_execute_snapshot`): an ordinary SPI query in a
/// transaction that has an xid takes a new snapshot under READ COMMITTED,
/// and a cursor's FETCH would then read another catalog than its snapshot's.
pub fn stream_row_as_of(name: &str, snapshot: pg_sys::Snapshot) -> Option<StreamRow> {
    const QUERY: &CStr =
        c"SELECT s.stream_key, s.seq::pg_catalog.oid, s.owns_sequence, s.backwards, s.writers \
        FROM streampos.streams s WHERE s.stream_name OPERATOR(pg_catalog.=) $1";
    with_safe_path(|| {
        spi(Spi::connect(|_client| -> SpiResult<Option<StreamRow>> {
            let Some(arg) = name.into_datum() else {
                return Ok(None);
            };
            // SAFETY: SPI is connected for the closure; the plan is freed
            // before returning (or with the SPI context on ERROR); the
            // result's tuple and descriptor are valid until SPI finishes,
            // and every value is copied out (owned Rust values) before.
            unsafe {
                let mut types = [pg_sys::TEXTOID];
                let plan = pg_sys::SPI_prepare(QUERY.as_ptr(), 1, types.as_mut_ptr());
                if plan.is_null() {
                    return Err(pgrx::spi::SpiError::SpiError(
                        pgrx::spi::SpiErrorCodes::Unconnected,
                    ));
                }
                let mut values = [arg];
                let nulls = [b' ' as std::ffi::c_char];
                let status = pg_sys::SPI_execute_snapshot(
                    plan,
                    values.as_mut_ptr(),
                    nulls.as_ptr(),
                    snapshot,
                    std::ptr::null_mut(),
                    true,
                    false,
                    1,
                );
                let table = pg_sys::SPI_tuptable;
                let row = if status != pg_sys::SPI_OK_SELECT as i32
                    || pg_sys::SPI_processed == 0
                    || table.is_null()
                {
                    None
                } else {
                    let tuple = *(*table).vals;
                    let desc = (*table).tupdesc;
                    let column = |n: i32| {
                        let mut null = false;
                        let datum = pg_sys::SPI_getbinval(tuple, desc, n, &mut null);
                        (datum, null)
                    };
                    let (d, n) = column(1);
                    let key = i32::from_datum(d, n).unwrap_or_default();
                    let (d, n) = column(2);
                    let seq = pg_sys::Oid::from_datum(d, n).unwrap_or(pg_sys::InvalidOid);
                    let (d, n) = column(3);
                    let owns_sequence = bool::from_datum(d, n).unwrap_or_default();
                    let (d, n) = column(4);
                    let backwards = bool::from_datum(d, n).unwrap_or_default();
                    let (d, n) = column(5);
                    let writers = Vec::<Option<String>>::from_datum(d, n)
                        .map(|w| w.into_iter().flatten().collect());
                    Some(StreamRow {
                        key,
                        seq,
                        owns_sequence,
                        backwards,
                        writers,
                    })
                };
                pg_sys::SPI_freeplan(plan);
                Ok(row)
            }
        }))
    })
}

/// The OID of `streampos.streams`.
pub fn streams_table_oid() -> pg_sys::Oid {
    select_one(
        "SELECT c.oid FROM pg_catalog.pg_class c \
         JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace \
         WHERE n.nspname OPERATOR(pg_catalog.=) 'streampos' \
           AND c.relname OPERATOR(pg_catalog.=) 'streams'",
        &[],
    )
    .unwrap_or(pg_sys::InvalidOid)
}

pub fn stream_names() -> Vec<String> {
    select_all("SELECT s.stream_name FROM streampos.streams s", &[], |r| {
        r.get::<String>(1)
    })
}

/// The stream that already uses sequence `seq`, if any.
pub fn stream_of_sequence(seq: pg_sys::Oid) -> Option<String> {
    select_one(
        "SELECT s.stream_name FROM streampos.streams s \
         WHERE s.seq::pg_catalog.oid OPERATOR(pg_catalog.=) $1",
        &[seq.into()],
    )
}

pub fn instance_id_of(name: &str) -> Option<i32> {
    select_one(
        "SELECT i.instance_id FROM streampos.instances i \
         WHERE i.instance_name OPERATOR(pg_catalog.=) $1",
        &[name.into()],
    )
}

/// Insert a new instance name; None when it exists already. The id
/// sequence is first moved past every id in the table, so that ids given
/// explicitly (imported, restored) are never handed out again.
pub fn insert_instance(name: &str) -> Option<i32> {
    as_owner(|| {
        update_one::<i64>(
            "SELECT pg_catalog.setval('streampos.instances_instance_id_seq'::pg_catalog.regclass, m.max_id) \
             FROM (SELECT pg_catalog.max(i.instance_id)::pg_catalog.int8 AS max_id FROM streampos.instances i) m \
             WHERE m.max_id OPERATOR(pg_catalog.>) \
                   (SELECT CASE WHEN q.is_called THEN q.last_value \
                                ELSE q.last_value OPERATOR(pg_catalog.-) 1 END \
                    FROM streampos.instances_instance_id_seq q)",
            &[],
        );
        update_one(
            "INSERT INTO streampos.instances (instance_name) VALUES ($1) \
             ON CONFLICT (instance_name) DO NOTHING RETURNING instance_id",
            &[name.into()],
        )
    })
}

pub fn instance_name_of(id: i32) -> Option<String> {
    select_one(
        "SELECT i.instance_name FROM streampos.instances i \
         WHERE i.instance_id OPERATOR(pg_catalog.=) $1",
        &[id.into()],
    )
}

pub fn instance_names() -> HashMap<i32, String> {
    select_all(
        "SELECT i.instance_id, i.instance_name FROM streampos.instances i",
        &[],
        |r| Ok(r.get::<i32>(1)?.zip(r.get::<String>(2)?)),
    )
    .into_iter()
    .collect()
}

/// (instance id, stored position in internal numbering) for the stream.
pub fn stored_positions(stream: &str) -> Vec<(i32, i64)> {
    select_all(
        "SELECT i.instance_id, pg_catalog.abs(p.stream_id) FROM streampos.stream_positions p \
         JOIN streampos.instances i ON i.instance_name OPERATOR(pg_catalog.=) p.instance_name \
         WHERE p.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
        |r| Ok(r.get::<i32>(1)?.zip(r.get::<i64>(2)?)),
    )
}

/// The stored frontier (internal numbering), written with the positions.
pub fn stored_frontier(stream: &str) -> Option<i64> {
    select_one(
        "SELECT pg_catalog.abs(f.stream_id) FROM streampos.stream_frontiers f \
         WHERE f.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
    )
}

/// The highest stored position or frontier at or below `at_most`
/// (internal numbering).
pub fn max_stored_at_most(stream: &str, at_most: i64) -> Option<i64> {
    select_one(
        "SELECT pg_catalog.max(x.p) FROM ( \
           SELECT pg_catalog.abs(p.stream_id) AS p FROM streampos.stream_positions p \
           WHERE p.stream_name OPERATOR(pg_catalog.=) $1 \
           UNION ALL \
           SELECT pg_catalog.abs(f.stream_id) FROM streampos.stream_frontiers f \
           WHERE f.stream_name OPERATOR(pg_catalog.=) $1) x \
         WHERE x.p OPERATOR(pg_catalog.<=) $2",
        &[stream.into(), at_most.into()],
    )
}

/// The stream's mark in history `history`: (have, ceiling).
pub fn history_mark(history: u64, stream: &str) -> Option<(i64, i64)> {
    select_all(
        "SELECT m.have, m.ceiling FROM streampos.history_marks m \
         WHERE m.history OPERATOR(pg_catalog.=) $1 AND m.stream_name OPERATOR(pg_catalog.=) $2",
        &[(history as i64).into(), stream.into()],
        |r| Ok(r.get::<i64>(1)?.zip(r.get::<i64>(2)?)),
    )
    .into_iter()
    .next()
}

/// Store a stream's mark in history `history`, as the extension's owner;
/// a mark once stored is kept.
pub fn insert_history_mark(history: u64, stream: &str, have: i64, ceiling: i64) {
    as_owner(|| {
        run(
            "INSERT INTO streampos.history_marks (history, stream_name, have, ceiling) \
             VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
            &[
                (history as i64).into(),
                stream.into(),
                have.into(),
                ceiling.into(),
            ],
        )
    });
}

pub fn max_stored_position(stream: &str) -> Option<i64> {
    select_one(
        "SELECT pg_catalog.max(pg_catalog.abs(p.stream_id)) FROM streampos.stream_positions p \
         WHERE p.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
    )
}

fn text_array(values: Option<Vec<String>>) -> DatumWithOid<'static> {
    match values {
        Some(v) => v.into(),
        None => DatumWithOid::null::<Vec<String>>(),
    }
}

pub fn insert_stream(
    stream: &str,
    seq: pg_sys::Oid,
    owns: bool,
    backwards: bool,
    writers: Option<Vec<String>>,
) {
    let args: [DatumWithOid; 5] = [
        stream.into(),
        DatumWithOid::from(seq),
        owns.into(),
        backwards.into(),
        text_array(writers),
    ];
    as_owner(|| {
        run(
            "INSERT INTO streampos.streams (stream_name, seq, owns_sequence, backwards, writers) \
             VALUES ($1, $2::pg_catalog.oid::pg_catalog.regclass, $3, $4, $5)",
            &args,
        )
    });
}

pub fn delete_stream(stream: &str) {
    as_owner(|| {
        run(
            "DELETE FROM streampos.streams s WHERE s.stream_name OPERATOR(pg_catalog.=) $1",
            &[stream.into()],
        )
    });
}

pub fn set_stream_writers(stream: &str, writers: Option<Vec<String>>) {
    let args: [DatumWithOid; 2] = [stream.into(), text_array(writers)];
    as_owner(|| {
        run(
            "UPDATE streampos.streams s SET writers = $2 \
             WHERE s.stream_name OPERATOR(pg_catalog.=) $1",
            &args,
        )
    });
}

/// A removed writer loses its stored position; a new one starts at `front`.
pub fn reset_positions(stream: &str, writers: Vec<String>, front: i64) {
    as_owner(|| {
        run(
            "DELETE FROM streampos.stream_positions p \
             WHERE p.stream_name OPERATOR(pg_catalog.=) $1 \
               AND p.instance_name OPERATOR(pg_catalog.<>) ALL ($2)",
            &[stream.into(), writers.clone().into()],
        );
        run(
            "INSERT INTO streampos.stream_positions (stream_name, instance_name, stream_id) \
             SELECT $1, w.name, $3 FROM pg_catalog.unnest($2::pg_catalog.text[]) AS w(name) \
             ON CONFLICT DO NOTHING",
            &[stream.into(), writers.into(), front.into()],
        );
    });
}

/// The attribute number of a live column of `tbl` called `column`.
pub fn column_number(tbl: pg_sys::Oid, column: &str) -> Option<i16> {
    select_one(
        "SELECT a.attnum FROM pg_catalog.pg_attribute a \
         WHERE a.attrelid OPERATOR(pg_catalog.=) $1 AND a.attname OPERATOR(pg_catalog.=) $2 \
           AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped",
        &[tbl.into(), column.into()],
    )
}

pub fn upsert_stream_table(
    stream: &str,
    tbl: pg_sys::Oid,
    id_column: &str,
    instance_column: Option<&str>,
) {
    as_owner(|| {
        run(
            "INSERT INTO streampos.stream_tables (stream_name, tbl, id_column, instance_column) \
             VALUES ($1, $2::pg_catalog.oid::pg_catalog.regclass, $3, $4) \
             ON CONFLICT (stream_name, tbl) DO UPDATE \
             SET id_column = EXCLUDED.id_column, instance_column = EXCLUDED.instance_column",
            &[
                stream.into(),
                tbl.into(),
                id_column.into(),
                instance_column.into(),
            ],
        )
    });
}

/// Databases that exist (for reclaiming registry state of dropped ones).
pub fn database_oids() -> Vec<pg_sys::Oid> {
    select_all("SELECT d.oid FROM pg_catalog.pg_database d", &[], |r| {
        r.get::<pg_sys::Oid>(1)
    })
}

// ---------------------------------------------------------------- sequences

/// Create the sequence a stream owns, owned by `owner_role` (the role that
/// created the stream); returns its OID.
pub fn create_sequence(name: &str, owner_role: pg_sys::Oid) -> pg_sys::Oid {
    let qualified = format!("streampos.{}", quote_ident(name));
    as_owner(|| {
        run(
            &format!(
                "CREATE SEQUENCE {qualified} AS pg_catalog.int8 \
                 INCREMENT 1 MINVALUE 1 START 1 CACHE 1 NO CYCLE"
            ),
            &[],
        );
        run(
            &format!(
                "ALTER SEQUENCE {qualified} OWNER TO {}",
                role_name(owner_role)
            ),
            &[],
        );
        select_one(
            "SELECT c.oid FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace \
             WHERE n.nspname OPERATOR(pg_catalog.=) 'streampos' \
               AND c.relname OPERATOR(pg_catalog.=) $1",
            &[name.into()],
        )
        .unwrap_or(pg_sys::InvalidOid)
    })
}

/// Drop a sequence a stream owns, if it is still the one in schema
/// streampos that the stream created.
pub fn drop_owned_sequence(seq: pg_sys::Oid) {
    let in_streampos: Option<bool> = select_one(
        "SELECT true FROM pg_catalog.pg_class c \
         JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace \
         WHERE c.oid OPERATOR(pg_catalog.=) $1 AND c.relkind OPERATOR(pg_catalog.=) 'S' \
           AND n.nspname OPERATOR(pg_catalog.=) 'streampos'",
        &[seq.into()],
    );
    if in_streampos.is_some() {
        let name = relation_name(seq);
        as_owner(|| run(&format!("DROP SEQUENCE {name}"), &[]));
    }
}

/// (INCREMENT, CACHE) of a sequence; None when `oid` is not a sequence.
pub fn sequence_settings(oid: pg_sys::Oid) -> Option<crate::sequence::Settings> {
    with_safe_path(|| {
        spi(Spi::connect(|client| {
            let table = client.select(
                "SELECT q.seqincrement, q.seqcache, q.seqmin, q.seqcycle FROM pg_catalog.pg_sequence q \
                 WHERE q.seqrelid OPERATOR(pg_catalog.=) $1",
                Some(1),
                &[oid.into()],
            )?;
            if table.is_empty() {
                return Ok(None);
            }
            let row = table.first();
            Ok(Some(crate::sequence::Settings {
                increment: row.get::<i64>(1)?.unwrap_or(0),
                cache: row.get::<i64>(2)?.unwrap_or(0),
                min: row.get::<i64>(3)?.unwrap_or(0),
                cycle: row.get::<bool>(4)?.unwrap_or(false),
            }))
        }))
    })
}

/// A relation's persistence: 'p' permanent, 'u' unlogged, 't' temporary.
pub fn relation_persistence(oid: pg_sys::Oid) -> Option<String> {
    select_one(
        "SELECT c.relpersistence::pg_catalog.text FROM pg_catalog.pg_class c \
         WHERE c.oid OPERATOR(pg_catalog.=) $1",
        &[oid.into()],
    )
}

/// Move a sequence to `value` (is_called), with the caller's privileges.
pub fn setval(seq: pg_sys::Oid, value: i64) {
    update_one::<i64>(
        "SELECT pg_catalog.setval($1::pg_catalog.oid::pg_catalog.regclass, $2, true)",
        &[seq.into(), value.into()],
    );
}

// ------------------------------------------------------------- stream tables

/// A table of a stream, with its columns as they are now.
pub struct StreamTable {
    /// Quoted, schema-qualified.
    pub name: String,
    pub id_column: String,
    pub instance_column: Option<String>,
    /// Every live column, in order, unquoted.
    pub columns: Vec<String>,
}

/// The stream's tables, by table name.
pub fn stream_tables(stream: &str) -> Vec<StreamTable> {
    let mut tables = select_all(
        "SELECT t.tbl::pg_catalog.oid, t.id_column::pg_catalog.text, t.instance_column::pg_catalog.text, \
                ARRAY(SELECT a.attname::pg_catalog.text FROM pg_catalog.pg_attribute a \
                      WHERE a.attrelid OPERATOR(pg_catalog.=) t.tbl::pg_catalog.oid \
                        AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped \
                      ORDER BY a.attnum) \
         FROM streampos.stream_tables t WHERE t.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
        |r| {
            let oid = r.get::<pg_sys::Oid>(1)?.unwrap_or(pg_sys::InvalidOid);
            let id_column = r.get::<String>(2)?.unwrap_or_default();
            let instance_column = r.get::<String>(3)?;
            let columns = r.get::<Vec<String>>(4)?.unwrap_or_default();
            // A table dropped (its regclass has no dependency) or that lost
            // a registered column: skipped, reported by check_stream.
            let usable = !columns.is_empty()
                && columns.contains(&id_column)
                && instance_column.as_ref().is_none_or(|c| columns.contains(c));
            Ok(usable.then(|| StreamTable {
                name: relation_name(oid),
                id_column,
                instance_column,
                columns,
            }))
        },
    );
    tables.sort_by(|a, b| a.name.cmp(&b.name));
    tables
}

/// Registered tables of a stream that `stream_tables` skips: dropped, or
/// without a registered column. (OID, what is wrong.)
pub fn unusable_stream_tables(stream: &str) -> Vec<(pg_sys::Oid, String)> {
    select_all(
        "SELECT t.tbl::pg_catalog.oid, \
                CASE WHEN c.oid IS NULL THEN 'was dropped' \
                     ELSE pg_catalog.format('%s has no column %s', c.oid::pg_catalog.regclass, \
                          CASE WHEN NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a \
                                                WHERE a.attrelid OPERATOR(pg_catalog.=) c.oid \
                                                  AND a.attname OPERATOR(pg_catalog.=) t.id_column \
                                                  AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped) \
                               THEN t.id_column ELSE t.instance_column END) END \
         FROM streampos.stream_tables t \
         LEFT JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) t.tbl::pg_catalog.oid \
         WHERE t.stream_name OPERATOR(pg_catalog.=) $1 \
           AND (c.oid IS NULL \
                OR NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a \
                               WHERE a.attrelid OPERATOR(pg_catalog.=) c.oid \
                                 AND a.attname OPERATOR(pg_catalog.=) t.id_column \
                                 AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped) \
                OR (t.instance_column IS NOT NULL AND NOT EXISTS ( \
                               SELECT FROM pg_catalog.pg_attribute a \
                               WHERE a.attrelid OPERATOR(pg_catalog.=) c.oid \
                                 AND a.attname OPERATOR(pg_catalog.=) t.instance_column \
                                 AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped))) \
         ORDER BY 1",
        &[stream.into()],
        |r| {
            Ok(r.get::<pg_sys::Oid>(1)?
                .zip(r.get::<String>(2)?))
        },
    )
}

/// `check_stream(…, repair => true)`: forget a registered table that was
/// dropped (only one whose OID no longer names a relation).
pub fn forget_dropped_stream_table(stream: &str, tbl: pg_sys::Oid) {
    as_owner(|| {
        run(
            "DELETE FROM streampos.stream_tables t \
             WHERE t.stream_name OPERATOR(pg_catalog.=) $1 \
               AND t.tbl::pg_catalog.oid OPERATOR(pg_catalog.=) $2 \
               AND NOT EXISTS (SELECT FROM pg_catalog.pg_class c \
                               WHERE c.oid OPERATOR(pg_catalog.=) $2)",
            &[stream.into(), tbl.into()],
        )
    });
}

/// The highest ID (internal numbering) in one table of a stream, read with
/// the caller's privileges and snapshot.
pub fn table_max_id(table: &StreamTable, backwards: bool) -> Option<i64> {
    let id = quote_ident(&table.id_column);
    let agg = if backwards {
        format!("OPERATOR(pg_catalog.-) pg_catalog.min(t.{id})::pg_catalog.int8")
    } else {
        format!("pg_catalog.max(t.{id})::pg_catalog.int8")
    };
    select_one(&format!("SELECT {agg} FROM {} t", table.name), &[])
}

/// The highest ID at most `ceiling` in one table of a forward stream, read
/// with the caller's privileges and snapshot.
pub fn table_max_id_at_most(table: &StreamTable, ceiling: i64) -> Option<i64> {
    let id = quote_ident(&table.id_column);
    select_one(
        &format!(
            "SELECT pg_catalog.max(t.{id})::pg_catalog.int8 FROM {} t \
             WHERE t.{id} OPERATOR(pg_catalog.<=) $1",
            table.name
        ),
        &[ceiling.into()],
    )
}

/// The FROM and WHERE of `updates`' reads of one table: rows with
/// $1 < id <= $2 whose writer (the instance column) is in range between the
/// multi-writer tokens $3 (exclusive) and $4 (inclusive).
fn rows_in_range(table: &StreamTable) -> String {
    let id = quote_ident(&table.id_column);
    let (join, instance) = match &table.instance_column {
        Some(column) => (
            format!(
                "LEFT JOIN streampos.instances i \
                 ON i.instance_name OPERATOR(pg_catalog.=) t.{}::pg_catalog.text",
                quote_ident(column)
            ),
            "i.instance_id",
        ),
        None => (String::new(), "NULL::pg_catalog.int4"),
    };
    format!(
        "FROM {tbl} t {join} \
         WHERE t.{id} OPERATOR(pg_catalog.>) $1 AND t.{id} OPERATOR(pg_catalog.<=) $2 \
           AND streampos.in_range($3::streampos.multi_writer_token, $4::streampos.multi_writer_token, \
                                  {instance}, t.{id}::pg_catalog.int8)",
        tbl = table.name,
    )
}

/// The rows `updates` reads: low < id <= high, and each row's writer in
/// range between the multi-writer tokens `since` (exclusive) and `until`.
pub struct RowRange<'a> {
    pub low: i64,
    pub high: i64,
    pub since: &'a str,
    pub until: &'a str,
}

impl RowRange<'_> {
    /// The arguments $1 to $4 of `rows_in_range`.
    fn args(&self) -> Vec<DatumWithOid<'static>> {
        vec![
            self.low.into(),
            self.high.into(),
            self.since.to_string().into(),
            self.until.to_string().into(),
        ]
    }
}

/// The IDs of the first `limit` rows of one table that `updates` would
/// return, in ID order, read with the active snapshot.
pub fn row_ids(table: &StreamTable, range: &RowRange, limit: i64) -> Vec<i64> {
    let id = quote_ident(&table.id_column);
    let query = format!(
        "SELECT t.{id}::pg_catalog.int8 {} ORDER BY t.{id} LIMIT $5",
        rows_in_range(table)
    );
    let mut args = range.args();
    args.push(limit.into());
    select_all(&query, &args, |row| row.get::<i64>(1))
}

/// The `updates` answer, built by PostgreSQL in its own memory and read
/// with the active snapshot:
/// `{"token": …, "limited": …, "data": [[header], row, …, [header], row, …]}`
/// with, for each table, `[table_name, position, row_count, column_count,
/// column_name, …]` and then its rows with $1 < id <= $2 (and in range
/// between the tokens) as JSON arrays, oldest first.
pub fn updates_answer(
    tables: &[StreamTable],
    range: &RowRange,
    token: &str,
    position: i64,
    limited: bool,
) -> pg_sys::Datum {
    let mut parts = Vec::new();
    let mut headers = Vec::new();
    let mut args = range.args();
    args.push(token.to_string().into());
    args.push(limited.into());
    args.push(position.into());
    for (n, table) in tables.iter().enumerate() {
        let id = quote_ident(&table.id_column);
        // jsonb_build_array takes at most 100 arguments (a table may have
        // up to 1600 columns): concatenate arrays of 100.
        let row = table
            .columns
            .chunks(100)
            .map(|chunk| {
                let columns = chunk
                    .iter()
                    .map(|c| format!("t.{}", quote_ident(c)))
                    .collect::<Vec<_>>()
                    .join(", ");
                format!("pg_catalog.jsonb_build_array({columns})")
            })
            .collect::<Vec<_>>()
            .join(" OPERATOR(pg_catalog.||) ");
        parts.push(format!(
            "SELECT {n} AS n, t.{id}::pg_catalog.int8 AS id, {row} AS j {}",
            rows_in_range(table)
        ));
        let (name_arg, columns_arg) = (args.len() + 1, args.len() + 2);
        args.push(table.name.clone().into());
        args.push(table.columns.clone().into());
        headers.push(format!(
            "({n}, ${name_arg}::pg_catalog.text, ${columns_arg}::pg_catalog.text[])"
        ));
    }
    if tables.is_empty() {
        parts.push("SELECT 0, 0::pg_catalog.int8, NULL::pg_catalog.jsonb WHERE false".into());
        headers.push("(0, NULL::pg_catalog.text, NULL::pg_catalog.text[])".into());
    }
    let query = format!(
        "WITH r(n, id, j) AS ({rows}), \
              h(n, name, cols) AS (VALUES {headers}), \
              x(n, k, id, j) AS ( \
                SELECT h.n, 0, 0::pg_catalog.int8, \
                       pg_catalog.jsonb_build_array(h.name, $7, \
                           (SELECT pg_catalog.count(*) FROM r WHERE r.n OPERATOR(pg_catalog.=) h.n), \
                           pg_catalog.cardinality(h.cols)) \
                       OPERATOR(pg_catalog.||) pg_catalog.to_jsonb(h.cols) \
                FROM h WHERE h.name IS NOT NULL \
                UNION ALL SELECT r.n, 1, r.id, r.j FROM r) \
         SELECT pg_catalog.jsonb_build_object('token', $5::pg_catalog.text, 'limited', $6::pg_catalog.bool, \
                'data', COALESCE((SELECT pg_catalog.jsonb_agg(x.j ORDER BY x.n, x.k, x.id) FROM x), \
                                 '[]'::pg_catalog.jsonb))",
        rows = parts.join(" UNION ALL "),
        headers = headers.join(", "),
    );
    with_safe_path(|| {
        spi(Spi::connect(|client| {
            let table = client.select(query.as_str(), Some(1), &args)?;
            let datum = table.first().get_datum_by_ordinal(1)?;
            // SAFETY: a jsonb (varlena) result of this SPI call, copied into
            // the function's memory context before SPI frees its own.
            Ok(datum.map(|d| unsafe { pg_sys::SPI_datumTransfer(d, false, -1) }))
        }))
    })
    .unwrap_or_else(|| Error::Internal("updates() built no answer".into()).report())
}

// ------------------------------------------------------------ position worker

pub fn extension_present() -> bool {
    select_one::<bool>(
        "SELECT true FROM pg_catalog.pg_extension e \
         WHERE e.extname OPERATOR(pg_catalog.=) 'streampos'",
        &[],
    )
    .is_some()
}

/// Store one stream's positions and frontier (the same a reader in this
/// snapshot gets: one statement, one snapshot, so the frontier is never
/// above a position stored with it). Run by the position worker. The
/// stream's row is share-locked first: a `set_writers` in progress (which
/// deletes removed writers' positions) is waited for, and the positions,
/// read by the next statement's snapshot, follow its writer list (never
/// bringing a removed writer back). Neither ever moves back.
pub fn store_positions(stream: &str) {
    run(
        "SELECT FROM streampos.streams s WHERE s.stream_name OPERATOR(pg_catalog.=) $1 FOR SHARE",
        &[stream.into()],
    );
    run(
        "WITH p AS ( \
           INSERT INTO streampos.stream_positions (stream_name, instance_name, stream_id) \
           SELECT $1, w.instance_name, w.stream_id FROM streampos.writer_positions($1) w \
           ON CONFLICT (stream_name, instance_name) DO UPDATE \
           SET stream_id = EXCLUDED.stream_id \
           WHERE pg_catalog.abs(EXCLUDED.stream_id) OPERATOR(pg_catalog.>) \
                 pg_catalog.abs(streampos.stream_positions.stream_id)) \
         INSERT INTO streampos.stream_frontiers (stream_name, stream_id) \
         VALUES ($1, streampos.frontier($1)) \
         ON CONFLICT (stream_name) DO UPDATE SET stream_id = EXCLUDED.stream_id \
         WHERE pg_catalog.abs(EXCLUDED.stream_id) OPERATOR(pg_catalog.>) \
               pg_catalog.abs(streampos.stream_frontiers.stream_id)",
        &[stream.into()],
    );
}

/// Longest token a notification carries: NOTIFY payloads must stay under
/// 8000 bytes, and a stream with hundreds of writers ahead of its frontier
/// has a longer token. Beyond it the payload carries the frontier alone
/// (a token never ahead of the truth).
const NOTIFY_TOKEN_BYTES: i32 = 7000;

/// Followers that prefer LISTEN to long-polling: one notification per
/// advance, from the position worker, never from the writers' commits
/// (NOTIFY takes a lock that would serialise them).
pub fn notify_positions(stream: &str) {
    run(
        "SELECT pg_catalog.pg_notify('streampos', \
                $1 OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||) \
                CASE WHEN pg_catalog.octet_length(x.t) OPERATOR(pg_catalog.<=) $2 THEN x.t \
                     ELSE 'm' OPERATOR(pg_catalog.||) streampos.frontier($1)::pg_catalog.text END) \
         FROM (SELECT streampos.current_token($1)::pg_catalog.text AS t) x",
        &[stream.into(), NOTIFY_TOKEN_BYTES.into()],
    );
}

// ---- Synapse adoption
//
// What `adopt_synapse` reads in Synapse's schema and writes into the
// catalog. Synapse's relations are looked up by (schema OID, name) in the
// catalog, with the names as parameters, then used by OID; SQL text names
// them only through `relation_name` at the moment of use. They are read
// with the caller's privileges; the catalog is written as the owner.

/// `schema.name`, each part quoted when it needs it (for messages about
/// objects that do not exist, so have no OID).
pub fn qualified_name(schema: &str, name: &str) -> String {
    format!("{}.{}", quote_ident(schema), quote_ident(name))
}

/// The OID of schema `name`.
pub fn namespace_oid(name: &str) -> Option<pg_sys::Oid> {
    select_one(
        "SELECT n.oid FROM pg_catalog.pg_namespace n WHERE n.nspname OPERATOR(pg_catalog.=) $1",
        &[name.into()],
    )
}

/// The relation called `name` in schema `nsp`: its OID and relkind.
pub fn relation_in(nsp: pg_sys::Oid, name: &str) -> Option<(pg_sys::Oid, String)> {
    select_all(
        "SELECT c.oid, c.relkind::pg_catalog.text FROM pg_catalog.pg_class c \
         WHERE c.relnamespace OPERATOR(pg_catalog.=) $1 AND c.relname OPERATOR(pg_catalog.=) $2",
        &[nsp.into(), name.into()],
        |r| Ok(r.get::<pg_sys::Oid>(1)?.zip(r.get::<String>(2)?)),
    )
    .into_iter()
    .next()
}

/// The type of the live column `column` of `tbl`.
pub fn column_type(tbl: pg_sys::Oid, column: &str) -> Option<pg_sys::Oid> {
    select_one(
        "SELECT a.atttypid FROM pg_catalog.pg_attribute a \
         WHERE a.attrelid OPERATOR(pg_catalog.=) $1 AND a.attname OPERATOR(pg_catalog.=) $2 \
           AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped",
        &[tbl.into(), column.into()],
    )
}

/// Serialise adoption with every other catalog change until the end of the
/// transaction: concurrent adoptions, new streams and new instance names
/// wait (readers, allocations and the position worker do not).
pub fn lock_catalog_for_adoption() {
    as_owner(|| {
        run(
            "LOCK TABLE streampos.instances, streampos.streams IN SHARE ROW EXCLUSIVE MODE",
            &[],
        )
    });
}

/// The highest version in Synapse's `schema_version` table `tbl`, read with
/// the caller's privileges.
pub fn synapse_schema_version(tbl: pg_sys::Oid) -> Option<i64> {
    select_one(
        &format!(
            "SELECT pg_catalog.max(t.version)::pg_catalog.int8 FROM {} t",
            relation_name(tbl)
        ),
        &[],
    )
}

/// Synapse's `instance_map` rows (instance_id, instance_name), by id, read
/// with the caller's privileges.
pub fn synapse_instances(tbl: pg_sys::Oid) -> Vec<(i64, String)> {
    select_all(
        &format!(
            "SELECT t.instance_id::pg_catalog.int8, t.instance_name::pg_catalog.text FROM {} t \
             WHERE t.instance_id IS NOT NULL AND t.instance_name IS NOT NULL ORDER BY 1",
            relation_name(tbl)
        ),
        &[],
        |r| Ok(r.get::<i64>(1)?.zip(r.get::<String>(2)?)),
    )
}

/// The sequence that feeds column `column` of `tbl`: the one it owns
/// (serial, `OWNED BY`, identity) or the one its default reads.
pub fn column_sequence(tbl: pg_sys::Oid, column: &str) -> Option<pg_sys::Oid> {
    select_one(
        "SELECT d.objid FROM pg_catalog.pg_depend d \
         JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) d.refobjid \
          AND a.attnum OPERATOR(pg_catalog.=) d.refobjsubid \
         JOIN pg_catalog.pg_class s ON s.oid OPERATOR(pg_catalog.=) d.objid \
         WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass \
           AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass \
           AND d.refobjid OPERATOR(pg_catalog.=) $1 AND a.attname OPERATOR(pg_catalog.=) $2 \
           AND d.deptype OPERATOR(pg_catalog.=) ANY ('{a,i}'::pg_catalog.\"char\"[]) \
           AND s.relkind OPERATOR(pg_catalog.=) 'S' \
         UNION ALL \
         SELECT d.refobjid FROM pg_catalog.pg_attrdef ad \
         JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) ad.adrelid \
          AND a.attnum OPERATOR(pg_catalog.=) ad.adnum \
         JOIN pg_catalog.pg_depend d \
           ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_attrdef'::pg_catalog.regclass \
          AND d.objid OPERATOR(pg_catalog.=) ad.oid \
         JOIN pg_catalog.pg_class s ON s.oid OPERATOR(pg_catalog.=) d.refobjid \
         WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass \
           AND ad.adrelid OPERATOR(pg_catalog.=) $1 AND a.attname OPERATOR(pg_catalog.=) $2 \
           AND s.relkind OPERATOR(pg_catalog.=) 'S' \
         LIMIT 1",
        &[tbl.into(), column.into()],
    )
}

/// Synapse's `stream_positions` rows of one stream (instance_name,
/// stream_id, signed), read with the caller's privileges.
pub fn synapse_positions(tbl: pg_sys::Oid, stream: &str) -> Vec<(String, i64)> {
    select_all(
        &format!(
            "SELECT t.instance_name::pg_catalog.text, t.stream_id::pg_catalog.int8 FROM {} t \
             WHERE t.stream_name::pg_catalog.text OPERATOR(pg_catalog.=) $1 \
               AND t.instance_name IS NOT NULL AND t.stream_id IS NOT NULL \
             ORDER BY 1",
            relation_name(tbl)
        ),
        &[stream.into()],
        |r| Ok(r.get::<String>(1)?.zip(r.get::<i64>(2)?)),
    )
}

/// A stream's registered tables: (table, id column, instance column).
pub fn registered_tables(stream: &str) -> Vec<(pg_sys::Oid, String, Option<String>)> {
    select_all(
        "SELECT t.tbl::pg_catalog.oid, t.id_column::pg_catalog.text, t.instance_column::pg_catalog.text \
         FROM streampos.stream_tables t WHERE t.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
        |r| {
            let instance = r.get::<String>(3)?;
            Ok(r
                .get::<pg_sys::Oid>(1)?
                .zip(r.get::<String>(2)?)
                .map(|(tbl, id)| (tbl, id, instance)))
        },
    )
}

/// Insert instances with the ids they have elsewhere (Synapse's), then move
/// the id sequence past every id in the table and past `floor` (ids the
/// other system handed out, or burnt), so that a name added later never
/// gets one of them. Run under `lock_catalog_for_adoption`.
pub fn import_instances(instances: &[(i32, String)], floor: i64) {
    let ids: Vec<i32> = instances.iter().map(|(id, _)| *id).collect();
    let names: Vec<String> = instances.iter().map(|(_, name)| name.clone()).collect();
    as_owner(|| {
        if !instances.is_empty() {
            run(
                "INSERT INTO streampos.instances (instance_id, instance_name) \
                 SELECT u.id, u.name \
                 FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int4[]), \
                                 pg_catalog.unnest($2::pg_catalog.text[])) AS u(id, name)",
                &[ids.into(), names.into()],
            );
        }
        // The last value handed out is last_value, or one less before the
        // first nextval (is_called false).
        update_one::<i64>(
            "SELECT pg_catalog.setval('streampos.instances_instance_id_seq'::pg_catalog.regclass, m.target, true) \
             FROM (SELECT GREATEST($1::pg_catalog.int8, \
                                   (SELECT pg_catalog.max(i.instance_id) FROM streampos.instances i)::pg_catalog.int8) \
                          AS target) m, \
                  streampos.instances_instance_id_seq q \
             WHERE m.target OPERATOR(pg_catalog.>) \
                   CASE WHEN q.is_called THEN q.last_value ELSE q.last_value OPERATOR(pg_catalog.-) 1 END",
            &[floor.into()],
        );
    });
}

/// Store positions for a stream, signed as the stream numbers them, never
/// lowering a position already stored (compared by magnitude, as backward
/// streams store negative positions). Returns the rows inserted or raised.
pub fn import_positions(stream: &str, positions: &[(String, i64)]) -> Vec<(String, i64)> {
    let names: Vec<String> = positions.iter().map(|(name, _)| name.clone()).collect();
    let ids: Vec<i64> = positions.iter().map(|(_, id)| *id).collect();
    let args: [DatumWithOid; 3] = [stream.into(), names.into(), ids.into()];
    as_owner(|| {
        with_safe_path(|| {
            spi(Spi::connect_mut(|client| {
                let mut out = Vec::new();
                let changed = client.update(
                    "INSERT INTO streampos.stream_positions AS p (stream_name, instance_name, stream_id) \
                     SELECT $1, u.name, u.id \
                     FROM ROWS FROM (pg_catalog.unnest($2::pg_catalog.text[]), \
                                     pg_catalog.unnest($3::pg_catalog.int8[])) AS u(name, id) \
                     ON CONFLICT (stream_name, instance_name) DO UPDATE SET stream_id = EXCLUDED.stream_id \
                     WHERE pg_catalog.abs(EXCLUDED.stream_id) OPERATOR(pg_catalog.>) pg_catalog.abs(p.stream_id) \
                     RETURNING p.instance_name, p.stream_id",
                    None,
                    &args,
                )?;
                for row in changed {
                    if let Some(v) = row.get::<String>(1)?.zip(row.get::<i64>(2)?) {
                        out.push(v);
                    }
                }
                out.sort();
                Ok(out)
            }))
        })
    })
}
