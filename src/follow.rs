//! Followers: `wait_for` (long-poll on the frontier) and `updates` (the
//! replication feed). Both sleep on the stream's condition variable, which
//! every transaction that held IDs of the stream broadcasts when it ends.

use std::time::{Duration, Instant};

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::JsonB;
use serde_json::Value;
use streampos_core::frontier;
use streampos_core::token::{Token, TokenKind};

use crate::api::{in_recovery, registry_index, with_index, writer_ids};
use crate::catalog::{self, StreamMeta};
use crate::error::{Error, OrRaise};
use crate::registry;
use crate::types::MultiWriterToken;

/// The snapshot a follower answers for. Under REPEATABLE READ and
/// SERIALIZABLE it is the transaction's: nothing newer can ever be visible to
/// the caller. Under READ COMMITTED the statement's snapshot would never see
/// a commit that happens while we wait, so we take the latest one; every
/// later statement of the caller sees at least as much.
fn follower_snapshot() -> pg_sys::Snapshot {
    unsafe {
        if pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32 {
            pg_sys::GetTransactionSnapshot()
        } else {
            pg_sys::GetLatestSnapshot()
        }
    }
}

/// Re-evaluate `ready` each time the stream's generation moves, until it
/// returns Some or the timeout passes (then the last evaluation's value).
fn wait_until<T>(index: usize, timeout_ms: i32, mut ready: impl FnMut() -> (bool, T)) -> T {
    if in_recovery() {
        // Commits arrive by WAL replay, which broadcasts nothing.
        ErrorReport::new(
            PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            "cannot wait for stream positions on a hot standby",
            "streampos",
        )
        .set_hint("Poll streampos.stream_positions, or follow the primary.")
        .report(PgLogLevel::ERROR);
    }
    let deadline = Instant::now() + Duration::from_millis(timeout_ms.max(0) as u64);
    loop {
        let generation = registry::generation(index).or_raise();
        let (done, value) = ready();
        let now = Instant::now();
        if done || now >= deadline {
            return value;
        }
        // Re-check at least every 100 ms: positions also move when the WAL
        // is flushed (IDs become durable), which broadcasts nothing.
        let left = (deadline - now).as_millis().min(100) as i64;
        registry::wait_for_change(index, generation, left).or_raise();
    }
}

fn frontier_now(meta: &StreamMeta) -> i64 {
    let v = with_index(meta, |index| {
        registry::view(index, meta.key, follower_snapshot())
    });
    frontier::frontier(v.max_allocated, &v.holders)
}

#[pg_extern(volatile, strict, parallel_restricted)]
fn wait_for(stream: &str, stream_id: i64, timeout_ms: i32) -> i64 {
    let meta = catalog::stream(stream).or_raise();
    let index = registry_index(&meta);
    // Internal numbering counts up for backward streams too.
    let target = if meta.backwards {
        stream_id.saturating_neg()
    } else {
        stream_id
    };
    let reached = wait_until(index, timeout_ms, || {
        let f = frontier_now(&meta);
        (f >= target, f)
    });
    meta.external(reached)
}

/// The current token for the follower's snapshot.
fn token_now(meta: &StreamMeta) -> Token {
    let v = with_index(meta, |index| {
        registry::view(index, meta.key, follower_snapshot())
    });
    frontier::current_token(v.max_allocated, &v.holders, &writer_ids(meta, &v))
}

struct StreamTable {
    name: String,
    id_column: String,
    instance_column: Option<String>,
    columns: Vec<String>,
}

fn stream_tables(stream: &str) -> Vec<StreamTable> {
    let result = Spi::connect(|client| -> pgrx::spi::SpiResult<Vec<StreamTable>> {
        let mut tables = Vec::new();
        for row in client.select(
            "SELECT tbl::text, quote_ident(id_column), quote_ident(instance_column), \
                    ARRAY(SELECT quote_ident(attname) FROM pg_catalog.pg_attribute \
                          WHERE attrelid = tbl AND attnum > 0 AND NOT attisdropped ORDER BY attnum) \
             FROM streampos.stream_tables WHERE stream_name = $1 ORDER BY tbl::text",
            None,
            &[stream.into()],
        )? {
            tables.push(StreamTable {
                name: row.get::<String>(1)?.unwrap_or_default(),
                id_column: row.get::<String>(2)?.unwrap_or_default(),
                instance_column: row.get::<String>(3)?,
                columns: row.get::<Vec<String>>(4)?.unwrap_or_default(),
            });
        }
        Ok(tables)
    });
    catalog::spi(result)
}

/// Rows of one table with since < position <= until (per writer) and
/// id <= max_id, ordered by ID, at most `limit` (None: all). Each row comes
/// as (id, JSON array).
fn fetch_rows(
    table: &StreamTable,
    since: &Token,
    until: &Token,
    max_id: i64,
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
    let args = [
        since.stream().into(),
        until.max_stream_pos().min(max_id).into(),
        since.to_text(TokenKind::MultiWriter).into(),
        until.to_text(TokenKind::MultiWriter).into(),
    ];
    // A read-write SPI call takes a fresh snapshot (under READ COMMITTED),
    // taken after the token's: it sees every row the token covers.
    let result = Spi::connect_mut(|client| -> pgrx::spi::SpiResult<Vec<(i64, Value)>> {
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
        Err(e) => Error::InvalidState {
            message: format!("reading {} failed: {e}", table.name),
            detail: None,
        }
        .report(),
    }
}

#[pg_extern(volatile, strict, parallel_restricted)]
fn updates(
    stream: &str,
    since: MultiWriterToken,
    max_rows: default!(i32, 100),
    timeout_ms: default!(i32, 0),
) -> JsonB {
    let meta = catalog::stream(stream).or_raise();
    if meta.backwards {
        Error::InvalidState {
            message: format!("stream \"{stream}\" counts backwards"),
            detail: Some(
                "updates() follows forward streams; read a backward stream with frontier().".into(),
            ),
        }
        .report();
    }
    if max_rows < 1 {
        Error::invalid(format!("max_rows must be at least 1, not {max_rows}")).report();
    }
    let index = registry_index(&meta);
    let since = since.0;
    // Wait until some writer moved past `since`.
    let current = wait_until(index, timeout_ms, || {
        let t = token_now(&meta);
        (!t.is_before_or_eq(&since), t)
    });
    // Never hand a follower a token behind the one it gave us.
    let until = since.advance(&current);
    let tables = stream_tables(stream);
    let limit = max_rows as usize;

    // Each table's first limit+1 rows are enough to find the global first
    // limit+1 rows in ID order.
    let mut per_table: Vec<Vec<(i64, Value)>> = tables
        .iter()
        .map(|t| fetch_rows(t, &since, &until, i64::MAX, Some(limit as i64 + 1)))
        .collect();
    let mut ids: Vec<i64> = per_table.iter().flatten().map(|(id, _)| *id).collect();
    ids.sort_unstable();
    let (token, limited) = if ids.len() > limit {
        // Cut at an ID boundary so that no ID is split: rows with id < the
        // first excluded ID. If one ID alone has more rows than the limit,
        // take all of its rows: progress beats the limit.
        let first_excluded = ids[limit];
        let cut = if ids[0] < first_excluded {
            first_excluded - 1
        } else {
            // No row of the range is below first_excluded: all rows up to it
            // are rows with exactly that ID.
            per_table = tables
                .iter()
                .map(|t| fetch_rows(t, &since, &until, first_excluded, None))
                .collect();
            first_excluded
        };
        for rows in per_table.iter_mut() {
            rows.retain(|(id, _)| *id <= cut);
        }
        (since.advance(&until.bound(cut)), true)
    } else {
        (until, false)
    };

    // Rows were fetched with `until`; the cut token admits exactly those with
    // id <= cut, which is what remains.
    let mut data = Vec::new();
    for (table, rows) in tables.iter().zip(per_table) {
        let mut header = vec![
            Value::from(table.name.clone()),
            Value::from(token.max_stream_pos()),
            Value::from(rows.len()),
            Value::from(table.columns.len()),
        ];
        header.extend(
            table
                .columns
                .iter()
                .map(|c| Value::from(c.trim_matches('"').to_string())),
        );
        data.push(Value::Array(header));
        data.extend(rows.into_iter().map(|(_, row)| row));
    }
    JsonB(serde_json::json!({
        "token": token.to_text(TokenKind::MultiWriter),
        "limited": limited,
        "data": data,
    }))
}
