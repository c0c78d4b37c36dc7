//! Followers: `wait_for` (long-poll on the frontier) and `updates` (the
//! replication feed). Both sleep on the stream's condition variable, which
//! every transaction that held IDs of the stream broadcasts when it ends.

use std::time::{Duration, Instant};

use pgrx::prelude::*;
use pgrx::JsonB;
use serde_json::Value;
use streampos_core::frontier;
use streampos_core::token::{Token, TokenKind};

use crate::catalog::{self, StreamMeta};
use crate::engine::{self, in_recovery, registry_index, writer_ids};
use crate::error::{Error, OrRaise};
use crate::registry;
use crate::sql::{self, StreamTable};
use crate::types::MultiWriterToken;

/// The snapshot a follower answers for. Under REPEATABLE READ and
/// SERIALIZABLE it is the transaction's: nothing newer can ever be visible to
/// the caller. Under READ COMMITTED the statement's snapshot would never see
/// a commit that happens while we wait, so we take the latest one; every
/// later statement of the caller sees at least as much.
fn follower_snapshot() -> pg_sys::Snapshot {
    // SAFETY: called inside a running transaction.
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
        Error::StandbyWait.report();
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
    let v = engine::view_for(meta, follower_snapshot());
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
    let v = engine::view_for(meta, follower_snapshot());
    frontier::current_token(v.max_allocated, &v.holders, &writer_ids(meta, &v))
}

/// Rows of one table with since < position <= until (per writer) and
/// id <= max_id, ordered by ID, at most `limit` (None: all).
fn fetch_rows(
    table: &StreamTable,
    since: &Token,
    until: &Token,
    max_id: i64,
    limit: Option<i64>,
) -> Vec<(i64, Value)> {
    sql::fetch_rows(
        table,
        since.stream(),
        until.max_stream_pos().min(max_id),
        &since.to_text(TokenKind::MultiWriter),
        &until.to_text(TokenKind::MultiWriter),
        limit,
    )
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
    let tables = sql::stream_tables(stream);
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
