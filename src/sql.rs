//! Every SQL statement the extension runs internally, and the one way it
//! runs them (SPI). Nothing else in the crate builds or executes SQL: the
//! rules that make internal SQL safe to run for any caller hold here.

use std::collections::HashMap;

use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiResult, SpiTupleTable};
use serde_json::Value;

use crate::error::Error;

/// The value of an SPI call; an SPI-level failure (not an SQL error, which
/// PostgreSQL raises itself) is an internal error.
fn spi<T>(result: SpiResult<T>) -> T {
    match result {
        Ok(v) => v,
        Err(e) => Error::Internal(format!("internal query failed: {e}")).report(),
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
    spi(Spi::connect_mut(|client| {
        client.update(query, None, args).map(|_| ())
    }));
}

/// The first column of the first row of a read-only query.
fn select_one<T: FromDatum + IntoDatum>(query: &str, args: &[DatumWithOid]) -> Option<T> {
    spi(Spi::connect(|client| {
        first_one::<T>(client.select(query, Some(1), args)?)
    }))
}

/// The first column of the first row of a statement that changes something.
fn update_one<T: FromDatum + IntoDatum>(query: &str, args: &[DatumWithOid]) -> Option<T> {
    spi(Spi::connect_mut(|client| {
        first_one::<T>(client.update(query, Some(1), args)?)
    }))
}

/// Every row of a read-only query, each converted by `row`.
fn select_all<T>(
    query: &str,
    args: &[DatumWithOid],
    mut row: impl FnMut(pgrx::spi::SpiHeapTupleData) -> SpiResult<Option<T>>,
) -> Vec<T> {
    spi(Spi::connect(|client| {
        let mut out = Vec::new();
        for r in client.select(query, None, args)? {
            if let Some(v) = row(r)? {
                out.push(v);
            }
        }
        Ok(out)
    }))
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

// ------------------------------------------------------------------ catalog

/// A row of `streampos.streams`.
pub struct StreamRow {
    pub key: i32,
    pub seq: pg_sys::Oid,
    pub seq_name: String,
    pub owns_sequence: bool,
    pub backwards: bool,
    pub writers: Option<Vec<String>>,
}

pub fn stream_row(name: &str) -> Option<StreamRow> {
    spi(Spi::connect(|client| -> SpiResult<Option<StreamRow>> {
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
        Ok(Some(StreamRow {
            key: row.get(1)?.unwrap_or_default(),
            seq: row.get(2)?.unwrap_or(pg_sys::InvalidOid),
            seq_name: row.get(3)?.unwrap_or_default(),
            owns_sequence: row.get(4)?.unwrap_or_default(),
            backwards: row.get(5)?.unwrap_or_default(),
            writers: writers.map(|w| w.into_iter().flatten().collect()),
        }))
    }))
}

pub fn stream_names() -> Vec<String> {
    select_all("SELECT stream_name FROM streampos.streams", &[], |r| {
        r.get::<String>(1)
    })
}

pub fn instance_id_of(name: &str) -> Option<i32> {
    select_one(
        "SELECT instance_id FROM streampos.instances WHERE instance_name = $1",
        &[name.into()],
    )
}

/// Insert a new instance name; None when it exists already.
pub fn insert_instance(name: &str) -> Option<i32> {
    update_one(
        "INSERT INTO streampos.instances (instance_name) VALUES ($1) \
         ON CONFLICT (instance_name) DO NOTHING RETURNING instance_id",
        &[name.into()],
    )
}

pub fn instance_name_of(id: i32) -> Option<String> {
    select_one(
        "SELECT instance_name FROM streampos.instances WHERE instance_id = $1",
        &[id.into()],
    )
}

pub fn instance_names() -> HashMap<i32, String> {
    select_all(
        "SELECT instance_id, instance_name FROM streampos.instances",
        &[],
        |r| Ok(r.get::<i32>(1)?.zip(r.get::<String>(2)?)),
    )
    .into_iter()
    .collect()
}

/// (instance id, stored position in internal numbering) for the stream.
pub fn stored_positions(stream: &str) -> Vec<(i32, i64)> {
    select_all(
        "SELECT i.instance_id, abs(p.stream_id) FROM streampos.stream_positions p \
         JOIN streampos.instances i USING (instance_name) WHERE p.stream_name = $1",
        &[stream.into()],
        |r| Ok(r.get::<i32>(1)?.zip(r.get::<i64>(2)?)),
    )
}

pub fn max_stored_position(stream: &str) -> Option<i64> {
    select_one(
        "SELECT max(abs(stream_id)) FROM streampos.stream_positions WHERE stream_name = $1",
        &[stream.into()],
    )
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
        match writers {
            Some(w) => w.into(),
            None => DatumWithOid::null::<Vec<String>>(),
        },
    ];
    run(
        "INSERT INTO streampos.streams (stream_name, seq, owns_sequence, backwards, writers) \
         VALUES ($1, $2::oid::regclass, $3, $4, $5)",
        &args,
    );
}

pub fn delete_stream(stream: &str) {
    run(
        "DELETE FROM streampos.streams WHERE stream_name = $1",
        &[stream.into()],
    );
}

pub fn set_stream_writers(stream: &str, writers: Option<Vec<String>>) {
    let args: [DatumWithOid; 2] = [
        stream.into(),
        match writers {
            Some(w) => w.into(),
            None => DatumWithOid::null::<Vec<String>>(),
        },
    ];
    run(
        "UPDATE streampos.streams SET writers = $2 WHERE stream_name = $1",
        &args,
    );
}

/// A removed writer loses its stored position; a new one starts at `front`.
pub fn reset_positions(stream: &str, writers: Vec<String>, front: i64) {
    run(
        "DELETE FROM streampos.stream_positions WHERE stream_name = $1 AND instance_name <> ALL ($2)",
        &[stream.into(), writers.clone().into()],
    );
    run(
        "INSERT INTO streampos.stream_positions (stream_name, instance_name, stream_id) \
         SELECT $1, w, $3 FROM unnest($2::text[]) w ON CONFLICT DO NOTHING",
        &[stream.into(), writers.into(), front.into()],
    );
}

pub fn column_exists(tbl: pg_sys::Oid, column: &str) -> bool {
    select_one::<bool>(
        "SELECT true FROM pg_catalog.pg_attribute WHERE attrelid = $1 AND attname = $2 AND attnum > 0 AND NOT attisdropped",
        &[tbl.into(), column.into()],
    )
    .is_some()
}

pub fn upsert_stream_table(
    stream: &str,
    tbl: pg_sys::Oid,
    id_column: &str,
    instance_column: Option<&str>,
) {
    run(
        "INSERT INTO streampos.stream_tables (stream_name, tbl, id_column, instance_column) \
         VALUES ($1, $2::oid::regclass, $3, $4) \
         ON CONFLICT (stream_name, tbl) DO UPDATE SET id_column = EXCLUDED.id_column, instance_column = EXCLUDED.instance_column",
        &[stream.into(), tbl.into(), id_column.into(), instance_column.into()],
    );
}

/// Databases that exist (for reclaiming registry state of dropped ones).
pub fn database_oids() -> Vec<pg_sys::Oid> {
    select_all("SELECT oid FROM pg_catalog.pg_database", &[], |r| {
        r.get::<pg_sys::Oid>(1)
    })
}

// ---------------------------------------------------------------- sequences

/// Create the sequence a stream owns; returns its OID.
pub fn create_sequence(name: &str) -> pg_sys::Oid {
    run(
        &format!(
            "CREATE SEQUENCE streampos.{} AS bigint INCREMENT 1 MINVALUE 1 START 1 CACHE 1 NO CYCLE",
            quote_ident(name)
        ),
        &[],
    );
    let seq: pg_sys::Oid = update_one(
        "SELECT format('streampos.%I', $1::text)::regclass::oid",
        &[name.into()],
    )
    .unwrap_or(pg_sys::InvalidOid);
    // Readers load the sequence's value once after start-up.
    run(
        &format!(
            "GRANT SELECT ON SEQUENCE streampos.{} TO PUBLIC",
            quote_ident(name)
        ),
        &[],
    );
    seq
}

pub fn drop_sequence(qualified_name: &str) {
    run(&format!("DROP SEQUENCE IF EXISTS {qualified_name}"), &[]);
}

/// (INCREMENT, CACHE) of a sequence; None when `oid` is not a sequence.
pub fn sequence_settings(oid: pg_sys::Oid) -> Option<(i64, i64)> {
    spi(Spi::connect(|client| {
        let table = client.select(
            "SELECT seqincrement, seqcache FROM pg_catalog.pg_sequence WHERE seqrelid = $1",
            Some(1),
            &[oid.into()],
        )?;
        if table.is_empty() {
            Ok(None)
        } else {
            let (inc, cache) = table.first().get_two::<i64, i64>()?;
            Ok(Some((inc.unwrap_or(0), cache.unwrap_or(0))))
        }
    }))
}

/// (last_value, is_called) of a sequence.
pub fn sequence_state(qualified_name: &str) -> (i64, bool) {
    let query = format!("SELECT last_value, is_called FROM {qualified_name}");
    let (last, called) = spi(Spi::connect(|client| {
        client
            .select(query.as_str(), Some(1), &[])?
            .first()
            .get_two::<i64, bool>()
    }));
    (last.unwrap_or(0), called.unwrap_or(false))
}

pub fn setval(seq: pg_sys::Oid, value: i64) {
    update_one::<i64>(
        "SELECT pg_catalog.setval($1::oid::regclass, $2, true)",
        &[seq.into(), value.into()],
    );
}

// ------------------------------------------------------------- stream tables

/// (table, quoted id column) of every table of the stream, by table name.
pub fn stream_tables_for_check(stream: &str) -> Vec<(String, String)> {
    select_all(
        "SELECT tbl::text, quote_ident(id_column) FROM streampos.stream_tables \
         WHERE stream_name = $1 ORDER BY tbl::text",
        &[stream.into()],
        |r| {
            Ok(Some((
                r.get::<String>(1)?.unwrap_or_default(),
                r.get::<String>(2)?.unwrap_or_default(),
            )))
        },
    )
}

/// The highest ID (internal numbering) in one table of a stream.
pub fn table_max_id(table: &str, quoted_column: &str, backwards: bool) -> Option<i64> {
    let agg = if backwards {
        format!("-min({quoted_column})")
    } else {
        format!("max({quoted_column})")
    };
    update_one(&format!("SELECT {agg}::bigint FROM {table}"), &[])
}

/// A table of a stream as `updates` reads it: quoted names.
pub struct StreamTable {
    pub name: String,
    pub id_column: String,
    pub instance_column: Option<String>,
    pub columns: Vec<String>,
}

pub fn stream_tables(stream: &str) -> Vec<StreamTable> {
    select_all(
        "SELECT tbl::text, quote_ident(id_column), quote_ident(instance_column), \
                ARRAY(SELECT quote_ident(attname) FROM pg_catalog.pg_attribute \
                      WHERE attrelid = tbl AND attnum > 0 AND NOT attisdropped ORDER BY attnum) \
         FROM streampos.stream_tables WHERE stream_name = $1 ORDER BY tbl::text",
        &[stream.into()],
        |r| {
            Ok(Some(StreamTable {
                name: r.get::<String>(1)?.unwrap_or_default(),
                id_column: r.get::<String>(2)?.unwrap_or_default(),
                instance_column: r.get::<String>(3)?,
                columns: r.get::<Vec<String>>(4)?.unwrap_or_default(),
            }))
        },
    )
}

/// Rows of one table with since < position <= until (per writer, given as
/// multi-writer token texts) and low < id <= high, ordered by ID, at most
/// `limit` (None: all). Each row comes as (id, JSON array).
pub fn fetch_rows(
    table: &StreamTable,
    low: i64,
    high: i64,
    since: &str,
    until: &str,
    limit: Option<i64>,
) -> Vec<(i64, Value)> {
    let row_array = format!(
        "jsonb_build_array({})",
        table
            .columns
            .iter()
            .map(|c| format!("t.{c}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let (join, instance) = match &table.instance_column {
        Some(column) => (
            format!("LEFT JOIN streampos.instances i ON i.instance_name = t.{column}::text"),
            "i.instance_id",
        ),
        None => (String::new(), "NULL::integer"),
    };
    let id = &table.id_column;
    let query = format!(
        "SELECT t.{id}::bigint, {row_array}::text FROM {tbl} t {join} \
         WHERE t.{id} > $1 AND t.{id} <= $2 \
           AND streampos.in_range($3::streampos.multi_writer_token, $4::streampos.multi_writer_token, {instance}, t.{id}::bigint) \
         ORDER BY t.{id} {limit}",
        tbl = table.name,
        limit = limit.map(|n| format!("LIMIT {n}")).unwrap_or_default(),
    );
    let args = [low.into(), high.into(), since.into(), until.into()];
    // A read-write SPI call takes a fresh snapshot (under READ COMMITTED),
    // taken after the token's: it sees every row the token covers.
    let result = Spi::connect_mut(|client| -> SpiResult<Vec<(i64, Value)>> {
        let mut rows = Vec::new();
        for row in client.update(query.as_str(), None, &args)? {
            let id = row.get::<i64>(1)?.unwrap_or_default();
            let text = row.get::<String>(2)?.unwrap_or_default();
            rows.push((id, serde_json::from_str(&text).unwrap_or(Value::Null)));
        }
        Ok(rows)
    });
    match result {
        Ok(rows) => rows,
        Err(e) => Error::Internal(format!("reading {} failed: {e}", table.name)).report(),
    }
}

// ------------------------------------------------------------ position worker

pub fn extension_present() -> bool {
    Spi::get_one::<bool>("SELECT true FROM pg_catalog.pg_extension WHERE extname = 'streampos'")
        .unwrap_or(None)
        .is_some()
}

/// Store one stream's positions (the same a reader in this snapshot gets)
/// and notify listeners.
pub fn store_positions(stream: &str) {
    run(
        "INSERT INTO streampos.stream_positions (stream_name, instance_name, stream_id) \
         SELECT $1, instance_name, stream_id FROM streampos.writer_positions($1) \
         ON CONFLICT (stream_name, instance_name) DO UPDATE \
         SET stream_id = EXCLUDED.stream_id \
         WHERE abs(EXCLUDED.stream_id) > abs(stream_positions.stream_id)",
        &[stream.into()],
    );
    // Followers that prefer LISTEN to long-polling: one notification per
    // advance, from here, never from the writers' commits (NOTIFY takes a
    // lock that would serialise them).
    run(
        "SELECT pg_catalog.pg_notify('streampos', $1 || ' ' || streampos.current_token($1)::text)",
        &[stream.into()],
    );
}
