//! Consumers: named readers of a stream whose acknowledged position is a
//! row of `streampos.consumer_positions`, written in the caller's
//! transaction (processing rows and acknowledging them commit together).
//! `safe_to_delete` is the greatest lower bound of every consumer's
//! position: what a retention job may delete.

use pgrx::prelude::*;
use streampos_core::token::{Token, TokenKind};

use super::reading::{token_in, token_of};
use crate::catalog::{self, StreamMeta};
use crate::engine;
use crate::error::{clip, Error, OrRaise};
use crate::sql;
use crate::types::MultiWriterToken;

/// The stream, which must count forward: a backward stream's token is only
/// its frontier, and consumers follow rows with `updates()`, which refuses
/// backward streams too.
pub(super) fn forward_stream(stream: &str) -> std::rc::Rc<StreamMeta> {
    let meta = catalog::stream(stream).or_raise();
    if meta.backwards {
        Error::InvalidState {
            message: format!("stream \"{}\" counts backwards", clip(stream)),
            detail: Some("Consumers follow forward streams.".into()),
        }
        .report();
    }
    meta
}

/// A position the caller's snapshot cannot have read past: every writer's
/// position in `token` at most its position in `current`, the stream's
/// current token for that snapshot. Acknowledging rows that may not exist
/// yet is how a consumer loses them.
fn refuse_past_frontier(stream: &str, token: &Token, current: &Token) {
    if !token.is_before_or_eq(current) {
        Error::InvalidArgument {
            message: format!(
                "token {} is past the frontier of stream \"{}\"",
                clip(&token.to_text(TokenKind::MultiWriter)),
                clip(stream)
            ),
            detail: Some(format!(
                "This transaction's snapshot has seen the stream up to {}; a consumer acknowledges only rows it may have read.",
                clip(&current.to_text(TokenKind::MultiWriter))
            )),
        }
        .report();
    }
}

fn parse_stored(text: &str) -> Token {
    Token::parse(TokenKind::MultiWriter, text)
        .map_err(Error::from)
        .or_raise()
}

fn unknown_consumer(stream: &str, consumer: &str) -> ! {
    Error::UnknownConsumer {
        stream: stream.into(),
        consumer: consumer.into(),
    }
    .report()
}

/// The caller must have the privileges of the consumer's owner. Checked
/// again on the row a write changed: the row the caller's snapshot showed
/// may have been unregistered and registered again by another role since
/// (the ERROR undoes the write).
fn check_owner(stream: &str, consumer: &str, owner: pg_sys::Oid) {
    if !sql::caller_acts_as(owner) {
        Error::NotConsumerOwner {
            stream: stream.into(),
            consumer: consumer.into(),
            owner: owner_text(owner),
        }
        .report();
    }
}

/// "role name", or what is left of a dropped role (DROP ROLE does not see
/// consumers: PostgreSQL records no dependency on a row).
fn owner_text(owner: pg_sys::Oid) -> String {
    let name = sql::role_display_name(owner);
    if name.starts_with("role ") {
        format!("a dropped role (OID {})", owner.to_u32())
    } else {
        format!("role {name}")
    }
}

/// Tokens of a forward stream: no position below 0 (its IDs start at 1).
fn refuse_negative(token: &Token) {
    if token.stream() < 0 {
        Error::InvalidArgument {
            message: format!(
                "token {} has a position below 0",
                clip(&token.to_text(TokenKind::MultiWriter))
            ),
            detail: Some(
                "A consumer's position is 0 (nothing read) or an ID of the stream.".into(),
            ),
        }
        .report();
    }
}

/// The consumer's acknowledged position, for `updates(…, consumer => …)`.
pub(super) fn consumer_position(stream: &str, consumer: &str) -> Token {
    match sql::consumer(stream, consumer) {
        Some(row) => parse_stored(&row.position),
        None => unknown_consumer(stream, consumer),
    }
}

/// Register `consumer` on the stream, owned by the current role, at `since`
/// (default: the stream's current token for the caller's snapshot). Its
/// position; registering a name the caller already owns is a no-op that
/// returns the position it has.
///
/// Declared in sql/finalize.sql: a token argument's `DEFAULT NULL` needs
/// the type complete, which the generated functions come before.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn register_consumer(
    stream: Option<&str>,
    consumer: Option<&str>,
    since: default!(Option<MultiWriterToken>, "NULL"),
) -> Option<MultiWriterToken> {
    let (stream, consumer) = (stream?, consumer?);
    forward_stream(stream);
    catalog::validate_consumer_name(consumer).or_raise();
    // A consumer reads the stream's rows with updates(): whoever may not
    // is refused now (and cannot hold retention back on a stream it
    // cannot read).
    sql::check_may_follow(&catalog::stream_tables(stream));
    // A consumer starting again finds its registration without waiting.
    // (Every read here is as last committed: a REPEATABLE READ snapshot
    // may predate registrations, acknowledgements and unregistrations.)
    if let Some(existing) = sql::consumer_state_latest(stream, consumer).own {
        return Some(existing_position(stream, consumer, existing));
    }
    // Until this transaction ends, no other consumer of the stream is
    // registered, acknowledges or goes (sql::lock_consumers).
    let meta = catalog::stream_latest(stream).or_raise();
    sql::lock_consumers(meta.key, true);
    if catalog::stream_latest(stream).or_raise().key != meta.key {
        Error::Retry {
            message: format!(
                "stream \"{}\" was dropped and created again while registering a consumer",
                clip(stream)
            ),
        }
        .report();
    }
    let state = sql::consumer_state_latest(stream, consumer);
    if let Some(existing) = state.own {
        return Some(existing_position(stream, consumer, existing));
    }
    // What every other consumer has acknowledged, and what consumers that
    // have gone had: rows up to it may be deleted by now.
    let others = match (meet_of(state.others), state.floor.map(|f| parse_stored(&f))) {
        (Some(m), Some(f)) => Some(m.advance(&f).or_raise()),
        (m, f) => m.or(f),
    };
    let position = match since {
        Some(since) => {
            refuse_negative(&since.0);
            refuse_past_frontier(stream, &since.0, &token_of(stream));
            if let Some(safe) = &others {
                refuse_below(stream, &since.0, safe);
            }
            since.0
        }
        // The current token, or what every other consumer has acknowledged
        // if that is later (acknowledged by a snapshot newer than the
        // caller's): rows there exist, and may be gone.
        None => {
            let current = token_of(stream);
            match &others {
                Some(safe) => current.advance(safe).or_raise(),
                None => current,
            }
        }
    };
    // SAFETY: reads the current user id, set for every backend.
    let me = unsafe { pg_sys::GetUserId() };
    let text = position.to_text(TokenKind::MultiWriter);
    if let Some(stored) = sql::insert_consumer(stream, consumer, me, &text) {
        // Behind the stream's token as last committed (the caller's
        // snapshot may be older): its lag in time counts from now at the
        // latest. The position worker marks a token only when it moves, and
        // sees this consumer only once this transaction commits.
        let latest = latest_token(&meta);
        if !latest.is_before_or_eq(&position) {
            sql::insert_mark(stream, &latest.to_text(TokenKind::MultiWriter));
        }
        return Some(MultiWriterToken(parse_stored(&stored)));
    }
    // Registered by a transaction that committed while we waited for it.
    match sql::consumer(stream, consumer) {
        Some(existing) => Some(existing_position(stream, consumer, existing)),
        // ... and gone again since (a concurrent unregister).
        None => Error::Retry {
            message: format!(
                "consumer \"{}\" of stream \"{}\" was unregistered while registering it",
                clip(consumer),
                clip(stream)
            ),
        }
        .report(),
    }
}

/// The stream's current token for the latest snapshot.
fn latest_token(meta: &StreamMeta) -> Token {
    // SAFETY: called inside a running transaction.
    let answer = engine::fresh_answer(meta, unsafe { pg_sys::GetLatestSnapshot() });
    answer.positions.token(&engine::writer_ids(meta, &answer))
}

/// Registering a name already registered: its position, if the caller may
/// act for its owner (whatever `since` said); 42710 otherwise.
fn existing_position(stream: &str, consumer: &str, existing: sql::ConsumerRow) -> MultiWriterToken {
    if !sql::caller_acts_as(existing.owner) {
        Error::ConsumerExists {
            stream: stream.into(),
            consumer: consumer.into(),
            owner: owner_text(existing.owner),
        }
        .report();
    }
    MultiWriterToken(parse_stored(&existing.position))
}

/// A new consumer starting below what every other consumer acknowledged
/// would find rows a retention job may already have deleted.
fn refuse_below(stream: &str, since: &Token, safe: &Token) {
    if !safe.is_before_or_eq(since) {
        Error::InvalidArgument {
            message: format!(
                "token {} is below what every consumer of stream \"{}\" has acknowledged",
                clip(&since.to_text(TokenKind::MultiWriter)),
                clip(stream)
            ),
            detail: Some(format!(
                "Rows up to safe_to_delete() = {} may have been deleted; register at it or later.",
                clip(&safe.to_text(TokenKind::MultiWriter))
            )),
        }
        .report();
    }
}

/// The greatest lower bound of stored positions (None: there are none).
fn meet_of(positions: Vec<String>) -> Option<Token> {
    positions
        .iter()
        .map(|text| parse_stored(text))
        .reduce(|a, b| a.meet(&b))
}

/// Forget a consumer (its owner, a member, or a superuser); whether it was
/// registered.
#[pg_extern(volatile, strict, parallel_unsafe)]
fn unregister_consumer(stream: &str, consumer: &str) -> bool {
    let meta = catalog::stream(stream).or_raise();
    match sql::consumer(stream, consumer) {
        None => return false,
        Some(row) => check_owner(stream, consumer, row.owner),
    }
    sql::lock_consumers(meta.key, false);
    let Some((owner, gone_position)) = sql::delete_consumer(stream, consumer) else {
        return false;
    };
    check_owner(stream, consumer, owner);
    // A retention job may have read safe_to_delete with this consumer or
    // without it: what the others have acknowledged, or this one's
    // position when no other is left (as this transaction sees them).
    // Registrations never start below it, even once none is left.
    let others = sql::consumer_state_latest(stream, consumer).others;
    let floor = meet_of(others).unwrap_or_else(|| parse_stored(&gone_position));
    sql::raise_consumer_floor(stream, &floor.to_text(TokenKind::MultiWriter));
    true
}

/// Acknowledge every row up to `token`, in the caller's transaction: the
/// consumer's position becomes its least upper bound with `token` (an
/// older token changes nothing). A token past what the caller's snapshot
/// has seen of the stream is refused (22023). The position after.
#[pg_extern(volatile, strict, parallel_unsafe)]
fn ack(stream: &str, consumer: &str, token: MultiWriterToken) -> MultiWriterToken {
    let meta = forward_stream(stream);
    refuse_negative(&token.0);
    refuse_past_frontier(
        stream,
        &token.0,
        &token_in(&meta, &engine::answer_to_check(&meta)),
    );
    sql::lock_consumers(meta.key, false);
    // The consumer's owner acknowledging (the usual call): only a row it
    // owns is written. Nobody else's call writes a row, or waits for one,
    // before its owner is checked.
    // SAFETY: reads the backend's current user id.
    let caller = unsafe { pg_sys::GetUserId() };
    if let Some((_, position)) = sql::advance_consumer_row(stream, consumer, &token.0, Some(caller))
    {
        return MultiWriterToken(position);
    }
    // A role acting for the owner (a member, a superuser), or a refusal.
    match sql::consumer(stream, consumer) {
        Some(row) => check_owner(stream, consumer, row.owner),
        None => unknown_consumer(stream, consumer),
    }
    // The owner is checked again on the row version written: unregistered
    // and registered again by another role since the lookup, it is that
    // role's (the ERROR's abort undoes the write).
    match sql::advance_consumer_row(stream, consumer, &token.0, None) {
        Some((owner, position)) => {
            check_owner(stream, consumer, owner);
            MultiWriterToken(position)
        }
        // Never registered, or unregistered by a transaction that
        // committed while we waited for its row lock.
        None => unknown_consumer(stream, consumer),
    }
}

thread_local! {
    /// The last answer of `safe_to_delete`: (stream, what its statement
    /// saw, the answer). A retention job's `DELETE … WHERE … <=
    /// safe_to_delete(…)` asks once per row; the consumers' rows it reads
    /// are the same for every row of one statement.
    static LAST_SAFE_TO_DELETE: std::cell::RefCell<Option<(String, engine::SnapshotKey, Option<Token>)>> =
        const { std::cell::RefCell::new(None) };
}

/// The position at or below which every registered consumer of the stream
/// has acknowledged every row (writer by writer, the lowest acknowledged
/// position); NULL when the stream has no consumers.
#[pg_extern(stable, strict, parallel_restricted)]
fn safe_to_delete(stream: &str) -> Option<MultiWriterToken> {
    let snapshot = crate::registry::caller_snapshot();
    let cached = LAST_SAFE_TO_DELETE.with(|last| match &*last.borrow() {
        Some((s, key, answer)) if s == stream && key.matches(snapshot) => Some(answer.clone()),
        _ => None,
    });
    if let Some(answer) = cached {
        return answer.map(MultiWriterToken);
    }
    forward_stream(stream);
    let answer = meet_of(sql::consumer_positions(stream));
    LAST_SAFE_TO_DELETE.with(|last| {
        *last.borrow_mut() = Some((
            stream.to_string(),
            engine::SnapshotKey::of(snapshot),
            answer.clone(),
        ))
    });
    answer.map(MultiWriterToken)
}
