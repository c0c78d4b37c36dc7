//! Consumers: named readers of a stream whose acknowledged position is a
//! row of `streampos.consumer_positions`, written in the caller's
//! transaction (processing rows and acknowledging them commit together).
//! `safe_to_delete` is the greatest lower bound of every consumer's
//! position: what a retention job may delete.

use pgrx::prelude::*;
use streampos_core::token::{Token, TokenKind};

use super::reading::token_of;
use crate::catalog::{self, StreamMeta};
use crate::error::{clip, Error, OrRaise};
use crate::sql;
use crate::types::MultiWriterToken;

/// The stream, which must count forward: a backward stream's token is only
/// its frontier, and consumers follow rows with `updates()`, which refuses
/// backward streams too.
fn forward_stream(stream: &str) -> std::rc::Rc<StreamMeta> {
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
/// position in `token` at most its position in the stream's current token.
/// Acknowledging rows that may not exist yet is how a consumer loses them.
fn refuse_past_frontier(stream: &str, what: &str, token: &Token) {
    let current = token_of(stream);
    if !token.is_before_or_eq(&current) {
        Error::InvalidArgument {
            message: format!(
                "{what} {} is past the frontier of stream \"{}\"",
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

/// The consumer's row, which the caller must be able to act for.
fn owned_consumer(stream: &str, consumer: &str) -> sql::ConsumerRow {
    let Some(row) = sql::consumer(stream, consumer) else {
        Error::UnknownConsumer {
            stream: stream.into(),
            consumer: consumer.into(),
        }
        .report()
    };
    if !sql::caller_acts_as(row.owner) {
        Error::NotConsumerOwner {
            stream: stream.into(),
            consumer: consumer.into(),
            owner: sql::role_display_name(row.owner),
        }
        .report();
    }
    row
}

/// The consumer's acknowledged position, for `updates(…, consumer => …)`.
pub(super) fn consumer_position(stream: &str, consumer: &str) -> Token {
    match sql::consumer(stream, consumer) {
        Some(row) => parse_stored(&row.position),
        None => Error::UnknownConsumer {
            stream: stream.into(),
            consumer: consumer.into(),
        }
        .report(),
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
    let position = match since {
        Some(since) => {
            refuse_past_frontier(stream, "token", &since.0);
            since.0
        }
        None => token_of(stream),
    };
    // SAFETY: reads the current user id, set for every backend.
    let me = unsafe { pg_sys::GetUserId() };
    let text = position.to_text(TokenKind::MultiWriter);
    if let Some(stored) = sql::insert_consumer(stream, consumer, me, &text) {
        return Some(MultiWriterToken(parse_stored(&stored)));
    }
    let Some(existing) = sql::consumer(stream, consumer) else {
        // Taken and gone again since (a concurrent unregister).
        Error::Retry {
            message: format!(
                "consumer \"{}\" of stream \"{}\" was unregistered while registering it",
                clip(consumer),
                clip(stream)
            ),
        }
        .report()
    };
    if !sql::caller_acts_as(existing.owner) {
        Error::ConsumerExists {
            stream: stream.into(),
            consumer: consumer.into(),
            owner: sql::role_display_name(existing.owner),
        }
        .report();
    }
    Some(MultiWriterToken(parse_stored(&existing.position)))
}

/// Forget a consumer (its owner, a member, or a superuser); whether it was
/// registered.
#[pg_extern(volatile, strict, parallel_unsafe)]
fn unregister_consumer(stream: &str, consumer: &str) -> bool {
    catalog::stream(stream).or_raise();
    if sql::consumer(stream, consumer).is_none() {
        return false;
    }
    owned_consumer(stream, consumer);
    sql::delete_consumer(stream, consumer)
}

/// Acknowledge every row up to `token`, in the caller's transaction: the
/// consumer's position becomes its least upper bound with `token` (an
/// older token changes nothing). A token past what the caller's snapshot
/// has seen of the stream is refused (22023). The position after.
#[pg_extern(volatile, strict, parallel_unsafe)]
fn ack(stream: &str, consumer: &str, token: MultiWriterToken) -> MultiWriterToken {
    forward_stream(stream);
    owned_consumer(stream, consumer);
    refuse_past_frontier(stream, "token", &token.0);
    match sql::advance_consumer(stream, consumer, &token.0.to_text(TokenKind::MultiWriter)) {
        Some(position) => MultiWriterToken(parse_stored(&position)),
        // Unregistered by a transaction that committed while we waited
        // for its row lock.
        None => Error::UnknownConsumer {
            stream: stream.into(),
            consumer: consumer.into(),
        }
        .report(),
    }
}

/// The position at or below which every registered consumer of the stream
/// has acknowledged every row (writer by writer, the lowest acknowledged
/// position); NULL when the stream has no consumers.
#[pg_extern(stable, strict, parallel_restricted)]
fn safe_to_delete(stream: &str) -> Option<MultiWriterToken> {
    forward_stream(stream);
    sql::consumer_positions(stream)
        .iter()
        .map(|text| parse_stored(text))
        .reduce(|a, b| a.meet(&b))
        .map(MultiWriterToken)
}
