//! Positions for the caller's snapshot: frontier, writer positions, tokens,
//! and who holds the frontier back.

use pgrx::prelude::*;
use streampos_core::token::Token;

use crate::catalog::{self, StreamMeta};
use crate::engine::{self, writer_ids};
use crate::error::{Error, OrRaise};
use crate::{registry, sql};

#[pg_extern(stable, strict, parallel_restricted)]
fn frontier(stream: &str) -> i64 {
    let meta = catalog::stream(stream).or_raise();
    meta.external(engine::answer(&meta).frontier())
}

#[pg_extern(stable, strict, parallel_restricted)]
fn max_allocated(stream: &str) -> i64 {
    let meta = catalog::stream(stream).or_raise();
    meta.external(engine::answer(&meta).positions.max_allocated)
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
    let a = engine::answer(&meta);
    let id = catalog::lookup_instance_id(writer);
    let position = match id {
        // On a standby, only stored positions are known.
        _ if a.stored_only && !id.is_some_and(|id| a.seen.contains(&id)) => a.frontier(),
        Some(id) => a.positions.writer_position(id),
        // A name this snapshot cannot resolve may belong to a writer whose
        // first transaction (which created the name) is still running: the
        // frontier is the only safe answer.
        None => a.frontier(),
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
    let a = engine::answer(&meta);
    let names = sql::instance_names();
    let rows: Vec<(String, i32, i64)> = writer_ids(&meta, &a)
        .into_iter()
        // An instance whose name this snapshot cannot see yet (created by a
        // transaction still running) is left out, as it would be from a
        // token's reader: it reads as the frontier.
        .filter_map(|id| {
            let name = names.get(&id)?.clone();
            let position = a.positions.writer_position(id);
            Some((name, id, meta.external(position)))
        })
        .collect();
    TableIterator::new(rows)
}

pub(super) fn token_of(stream: &str) -> Token {
    let meta = catalog::stream(stream).or_raise();
    token_in(&meta, &engine::answer(&meta))
}

/// The stream's token in answer `a`.
pub(super) fn token_in(meta: &StreamMeta, a: &engine::Answer) -> Token {
    if meta.backwards {
        // Per-writer entries cannot be expressed once negated (they would be
        // below the minimum): a backward stream's token is its frontier.
        return Token::live(meta.external(a.frontier()));
    }
    a.positions.token(&writer_ids(meta, a))
}

#[pg_extern(stable, strict, parallel_restricted)]
fn current_token(stream: &str) -> crate::types::MultiWriterToken {
    crate::types::MultiWriterToken(token_of(stream))
}

#[pg_extern(stable, strict, parallel_restricted)]
fn current_room_token(stream: default!(&str, "'events'")) -> crate::types::RoomToken {
    crate::types::RoomToken(token_of(stream))
}

/// May the current role see another backend's details? As
/// `pg_stat_activity` decides: a member of pg_read_all_stats, or a role
/// with the privileges of the backend's role.
pub(super) fn may_see_backend_of(role: pg_sys::Oid) -> bool {
    // SAFETY: catalog lookups of role membership; raise no error for
    // existing roles.
    unsafe {
        let me = pg_sys::GetUserId();
        pg_sys::has_privs_of_role(me, role)
            || pg_sys::has_privs_of_role(me, pg_sys::Oid::from(pg_sys::ROLE_PG_READ_ALL_STATS))
    }
}

#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_restricted)]
fn in_flight(
    stream: default!(Option<&str>, "NULL"),
) -> TableIterator<
    'static,
    (
        name!(stream_name, String),
        name!(instance_name, Option<String>),
        name!(pid, Option<i32>),
        name!(xid, Option<pg_sys::TransactionId>),
        name!(min_id, i64),
        name!(max_id, i64),
        name!(ids, i64),
        name!(since, Option<TimestampWithTimeZone>),
    ),
> {
    registry::require_loaded().or_raise();
    // A monitoring read: never waits for a lock (sql/monitoring.rs).
    sql::lock_catalog_at_once("streampos.in_flight()", sql::CATALOG_TABLES).or_raise();
    if let Some(name) = stream {
        catalog::stream(name).or_raise();
    }
    // SAFETY: MyDatabaseId is set once the backend is connected.
    let db = unsafe { pg_sys::MyDatabaseId };
    let streams = catalog::streams_by_key();
    let mut rows = Vec::new();
    let in_flight = registry::in_flight().or_raise();
    // The names of orphaned holds' writers (their sessions are gone).
    let names = if in_flight.iter().any(|r| r.orphan_of.is_some()) {
        sql::instance_names()
    } else {
        Default::default()
    };
    for r in in_flight {
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
        // Another role's backend: its pid, xid and start time only where
        // pg_stat_activity would show its activity. Orphaned holds (no
        // backend) show none of them.
        let visible = r.pid.is_some() && may_see_backend_of(r.role);
        let since = TimestampWithTimeZone::try_from(r.since)
            .unwrap_or_else(|_| TimestampWithTimeZone::negative_infinity());
        let instance_name = r
            .instance_name
            .or_else(|| r.orphan_of.and_then(|id| names.get(&id).cloned()));
        rows.push((
            meta.name.clone(),
            instance_name,
            r.pid.filter(|_| visible),
            r.xid.filter(|_| visible),
            lo,
            hi,
            r.ids,
            visible.then_some(since),
        ));
    }
    rows.sort_by(|a, b| (a.0.as_str(), a.4).cmp(&(b.0.as_str(), b.4)));
    TableIterator::new(rows)
}
