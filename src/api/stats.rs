//! Statistics: `stat_get_streams()` and `stat_get_registry()` (under the
//! views `streampos.stat_streams` and `streampos.stat_registry`) and
//! `stat_reset()`. Counters live in shared memory since start-up (see
//! `registry/stats.rs`).

use std::collections::HashMap;
use std::rc::Rc;

use pgrx::prelude::*;

use crate::catalog;
use crate::engine;
use crate::error::OrRaise;
use crate::{registry, sql};

fn now() -> pg_sys::TimestampTz {
    // SAFETY: reads the clock; raises no error.
    unsafe { crate::ffi::unguarded::GetCurrentTimestamp() }
}

fn seconds(from: pg_sys::TimestampTz, to: pg_sys::TimestampTz) -> f64 {
    (to - from).max(0) as f64 / 1_000_000.0
}

/// A timestamp of the statistics, NULL for 0 (never).
fn timestamp(t: pg_sys::TimestampTz) -> Option<TimestampWithTimeZone> {
    (t != 0)
        .then(|| TimestampWithTimeZone::try_from(t).ok())
        .flatten()
}

const STAT_STREAMS: &str = "streampos.stat_streams";

/// A monitoring read never waits for a lock (`sql/monitoring.rs`): lock
/// what `view` may read in database `db` (with `consumers`: the consumers'
/// tables too), each only if granted at once, or 55P03 naming what is
/// locked. Whether `stream_frontiers` is readable (false: it is locked,
/// and nothing but the stored frontier `stat_streams` shows needs it), and
/// the database's streams (read once the catalog is locked).
fn monitoring_locks(
    view: &str,
    db: pg_sys::Oid,
    consumers: bool,
) -> (bool, HashMap<i32, Rc<catalog::StreamMeta>>) {
    sql::lock_catalog_at_once(view, sql::CATALOG_TABLES).or_raise();
    if consumers {
        sql::lock_catalog_at_once(view, sql::CONSUMER_TABLES).or_raise();
    }
    let frontiers = sql::frontiers_at_once();
    let standby = crate::backend::in_recovery();
    if standby {
        sql::lock_catalog_at_once(view, sql::STANDBY_TABLES).or_raise();
    }
    // A stream nothing used since start-up is loaded by the read (not on
    // a standby, which answers from the stored positions).
    let streams = catalog::streams_by_key();
    let loaded = registry::stats::streams(db).or_raise();
    let to_load: Vec<_> = streams
        .values()
        .filter(|m| !standby && !loaded.iter().any(|s| s.key == m.key && s.seq == m.seq))
        .collect();
    if !to_load.is_empty() {
        sql::lock_catalog_at_once(view, sql::LOADING_TABLES).or_raise();
        for meta in &to_load {
            sql::lock_stream_at_once(
                view,
                &meta.name,
                meta.seq,
                engine::loading_reads_tables(meta),
            )
            .or_raise();
        }
    }
    if !frontiers && (!to_load.is_empty() || standby) {
        sql::frontiers_locked(view).report();
    }
    // Loaded here, as the caller (the view `consumers` reads its rows as
    // the extension's owner, as the view did).
    for meta in to_load {
        engine::answer(meta);
    }
    (frontiers, streams)
}

#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_restricted)]
fn stat_get_streams() -> TableIterator<
    'static,
    (
        name!(stream_name, String),
        name!(ids_allocated, i64),
        name!(xact_commit, i64),
        name!(xact_rollback, i64),
        name!(max_allocated, i64),
        name!(frontier, i64),
        name!(frontier_lag_ids, i64),
        name!(frontier_lag_seconds, f64),
        name!(ids_in_flight, i64),
        name!(oldest_in_flight_seconds, Option<f64>),
        name!(oldest_in_flight_pid, Option<i32>),
        name!(oldest_in_flight_instance, Option<String>),
        name!(followers_waiting, i32),
        name!(last_store, Option<TimestampWithTimeZone>),
        name!(stored_frontier, Option<i64>),
        name!(store_lag_ids, Option<i64>),
        name!(store_lag_seconds, Option<f64>),
        name!(stats_reset, Option<TimestampWithTimeZone>),
    ),
> {
    registry::require_loaded().or_raise();
    // SAFETY: MyDatabaseId is set once the backend is connected.
    let db = unsafe { pg_sys::MyDatabaseId };
    let (frontiers_readable, streams) = monitoring_locks(STAT_STREAMS, db, false);
    let mut streams: Vec<_> = streams.into_values().collect();
    streams.sort_by(|a, b| a.name.cmp(&b.name));
    // Positions first: they load a stream's state if nothing used it
    // since start-up.
    let answers: Vec<_> = streams.iter().map(|m| engine::answer(m)).collect();
    let stats = registry::stats::streams(db).or_raise();
    let in_flight: Vec<_> = registry::in_flight()
        .or_raise()
        .into_iter()
        .filter(|r| r.db == db)
        .collect();
    let requested = registry::stats::worker_requested_at(db).unwrap_or(0);
    let now = now();
    let mut rows = Vec::with_capacity(streams.len());
    for (meta, answer) in streams.iter().zip(&answers) {
        let s = stats
            .iter()
            .find(|s| s.key == meta.key && s.seq == meta.seq);
        let frontier = answer.frontier();
        let max_allocated = answer.positions.max_allocated;
        let lag_ids = (max_allocated - frontier).max(0);
        let lag_seconds = match s {
            Some(s) if lag_ids > 0 && s.held_since != 0 => seconds(s.held_since, now),
            _ => 0.0,
        };
        let mine: Vec<_> = in_flight.iter().filter(|r| r.key == meta.key).collect();
        let ids_in_flight = mine.iter().map(|r| r.ids).sum();
        // The oldest transaction or hold (orphaned holds have no age).
        let oldest = mine
            .iter()
            .filter(|r| r.pid.is_some() && r.since != 0)
            .min_by_key(|r| r.since);
        // While `stream_frontiers` is locked: the frontier of the worker's
        // last pass that stored it (never above what it stored).
        let stored = if frontiers_readable {
            sql::stored_frontier(&meta.name)
        } else {
            s.and_then(|s| s.stored_frontier)
        };
        let store_lag_ids = stored.map(|f| (frontier - f).max(0));
        // Since the worker last found the stored positions current, or was
        // last asked to start (after it left for want of work).
        let reference = s.map_or(0, |s| s.current_at).max(requested);
        let store_lag_seconds = match store_lag_ids {
            None => None,
            Some(0) => Some(0.0),
            Some(_) if reference == 0 => None,
            Some(_) => Some(seconds(reference, now)),
        };
        rows.push((
            meta.name.clone(),
            s.map_or(0, |s| s.ids_allocated as i64),
            s.map_or(0, |s| s.xact_commit as i64),
            s.map_or(0, |s| s.xact_rollback as i64),
            meta.external(max_allocated),
            meta.external(frontier),
            lag_ids,
            lag_seconds,
            ids_in_flight,
            oldest.map(|r| seconds(r.since, now)),
            // Another role's backend: its pid only where in_flight()
            // shows it.
            oldest
                .filter(|r| super::reading::may_see_backend_of(r.role))
                .and_then(|r| r.pid),
            oldest.and_then(|r| r.instance_name.clone()),
            s.map_or(0, |s| s.followers as i32),
            s.and_then(|s| timestamp(s.last_store)),
            stored.map(|f| meta.external(f)),
            store_lag_ids,
            store_lag_seconds,
            s.and_then(|s| timestamp(s.reset_at)),
        ));
    }
    TableIterator::new(rows)
}

#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_restricted)]
fn stat_get_registry() -> TableIterator<
    'static,
    (
        name!(streams_loaded, i32),
        name!(streams_used, i32),
        name!(streams_dropped, i32),
        name!(streams_max, i32),
        name!(ring_used, i64),
        name!(ring_used_max, i64),
        name!(ring_size, i64),
        name!(ring_folds, i64),
        name!(reader_retries, i64),
        name!(reader_lock_fallbacks, i64),
        name!(position_workers, i32),
        name!(stats_reset, Option<TimestampWithTimeZone>),
    ),
> {
    let r = registry::stats::registry().or_raise();
    TableIterator::once((
        r.streams_loaded as i32,
        r.streams_used as i32,
        r.streams_dropped as i32,
        r.streams_max as i32,
        i64::from(r.ring_used),
        i64::from(r.ring_used_max),
        i64::from(r.ring_size),
        r.ring_folds as i64,
        r.reader_retries as i64,
        r.reader_fallbacks as i64,
        r.position_workers as i32,
        timestamp(r.reset_at),
    ))
}

/// The rows of the view `consumers`: each consumer's position and lag,
/// read without waiting for a lock (`monitoring_locks`).
#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_restricted)]
fn stat_get_consumers() -> TableIterator<
    'static,
    (
        name!(stream_name, String),
        name!(consumer_name, String),
        name!(owner, pg_sys::Oid),
        name!(position, Option<String>),
        name!(lag_ids, Option<i64>),
        name!(lag_time, Option<Interval>),
        name!(registered_at, Option<TimestampWithTimeZone>),
        name!(acked_at, Option<TimestampWithTimeZone>),
        name!(since_ack, Option<Interval>),
    ),
> {
    registry::require_loaded().or_raise();
    // SAFETY: MyDatabaseId is set once the backend is connected.
    let db = unsafe { pg_sys::MyDatabaseId };
    monitoring_locks("streampos.consumers", db, true);
    TableIterator::new(sql::consumer_rows().into_iter().map(|r| {
        (
            r.stream_name,
            r.consumer_name,
            r.owner,
            r.position,
            r.lag_ids,
            r.lag_time,
            r.registered_at,
            r.acked_at,
            r.since_ack,
        )
    }))
}

/// Records of the primary's position worker (`replay.rs`) this server
/// replayed since start-up: each woke the followers of the streams it
/// names. 0 on a primary, and on a standby whose primary logs none.
#[pg_extern(volatile, parallel_safe)]
fn standby_wakeups_replayed() -> i64 {
    registry::replay_records().unwrap_or(0) as i64
}

/// Start the counters of this database's streams, and the registry's, from
/// zero. Not for PUBLIC (as pg_stat_reset).
#[pg_extern(volatile, parallel_unsafe)]
fn stat_reset() {
    registry::require_loaded().or_raise();
    // SAFETY: MyDatabaseId is set once the backend is connected.
    let db = unsafe { pg_sys::MyDatabaseId };
    registry::stats::reset(db, now()).or_raise();
}
