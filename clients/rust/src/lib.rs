//! A Rust client for the streampos PostgreSQL extension, on tokio-postgres.
//!
//! - [`RoomStreamToken`] and [`MultiWriterToken`]: the SQL types
//!   `streampos.room_stream_token` and `streampos.multi_writer_token`, with
//!   `ToSql`/`FromSql` in the binary wire format. The format is implemented
//!   once, in `streampos-core` ([`Token::send`], [`Token::recv`]), and shared
//!   with the server.
//! - Typed calls: allocation inside the caller's transaction ([`next_id`],
//!   [`next_ids`]), positions ([`frontier`], [`writer_position`],
//!   [`writer_positions`], [`current_token`], [`current_room_token`],
//!   [`max_allocated`]), and following ([`wait_for`], [`updates`], parsed into
//!   [`Updates`]).
//! - [`Follower`]: long-polls `updates` and resumes from its token after a
//!   reconnect.
//! - [`Consumer`]: a named position on a stream, acknowledged in the
//!   transaction that processes the rows; [`safe_to_delete`].
//!
//! ```no_run
//! # async fn demo(client: &mut tokio_postgres::Client) -> Result<(), streampos_client::Error> {
//! use streampos_client as sp;
//! let txn = client.transaction().await?;
//! let id = sp::next_id(&txn, "events", "event_persister1").await?;
//! txn.execute("INSERT INTO events (stream_ordering) VALUES ($1)", &[&id]).await?;
//! txn.commit().await?;
//! let token: sp::RoomStreamToken = sp::current_room_token(&*client, "events").await?;
//! # Ok(()) }
//! ```

mod api;
mod consume;
mod follow;
mod tokens;

pub use api::{
    current_room_token, current_token, frontier, instance_id, max_allocated, next_id, next_ids,
    updates, wait_for, writer_position, writer_positions, Queryable, TableUpdates, Updates,
    WriterPosition,
};
pub use consume::{safe_to_delete, Consumer};
pub use follow::Follower;
pub use streampos_core::token::{Token, TokenError, TokenKind};
pub use tokens::{MultiWriterToken, RoomStreamToken};

/// Errors of this crate: the database's, or an answer that does not parse.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Db(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error("unexpected answer from streampos: {0}")]
    Protocol(String),
}

impl Error {
    /// The SQLSTATE of a database error (e.g. `42704` for an unknown stream).
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Db(e) => e.code().map(|c| c.code()),
            _ => None,
        }
    }
}
