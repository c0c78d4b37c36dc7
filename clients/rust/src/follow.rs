//! A follower of the replication feed that survives reconnects.

use std::time::Duration;

use tokio_postgres::{Client, NoTls, Statement};

use crate::api::millis;
use crate::{Error, MultiWriterToken, Updates};

/// The follower's call, prepared once per connection: planned once, not on
/// every poll.
const UPDATES: &str = "SELECT streampos.updates_json($1, $2, $3, $4)::text";

/// After a call a standby's replay cancelled: a short pause, growing while
/// calls keep being cancelled, so that a standby replaying a burst of
/// conflicting records is not asked in a loop.
const CONFLICT_PAUSE: Duration = Duration::from_millis(10);

/// The follower's connection, its call prepared on it.
struct Connection {
    client: Client,
    statement: Statement,
    /// Whether the server was in recovery (a hot standby) when connected.
    in_recovery: bool,
}

/// Long-polls `streampos.updates` from a token, on a connection of its own.
///
/// Each [`Follower::next`] returns the rows after the current token and
/// moves the token to the end of the answer. When the connection is lost,
/// it reconnects (with a growing pause, at most `max_backoff`) and asks again
/// from the same token: `updates` is a pure function of the token and the
/// committed data, so nothing is skipped or repeated. Store
/// [`Follower::token`] with what you did with the rows to resume after a
/// restart of your own.
pub struct Follower {
    conninfo: String,
    stream: String,
    token: MultiWriterToken,
    client: Option<Connection>,
    /// Rows per answer (cut at an ID boundary).
    pub max_rows: i32,
    /// How long one poll waits on the server for a writer to move.
    pub poll_timeout: Duration,
    /// The longest pause between reconnection attempts.
    pub max_backoff: Duration,
    connections: u64,
}

impl Follower {
    /// A follower of `stream` after `since`; connects on first use.
    pub fn new(
        conninfo: impl Into<String>,
        stream: impl Into<String>,
        since: MultiWriterToken,
    ) -> Follower {
        Follower {
            conninfo: conninfo.into(),
            stream: stream.into(),
            token: since,
            client: None,
            max_rows: 100,
            poll_timeout: Duration::from_secs(10),
            max_backoff: Duration::from_secs(5),
            connections: 0,
        }
    }

    /// The token after everything returned so far.
    pub fn token(&self) -> &MultiWriterToken {
        &self.token
    }

    /// How many times the connection was re-established.
    pub fn reconnects(&self) -> u64 {
        self.connections.saturating_sub(1)
    }

    /// The next answer: rows after the token (possibly none, when the poll
    /// timed out or only positions moved). Connection failures are retried,
    /// and so is a call a hot standby's replay cancelled (40001 on a server
    /// in recovery, "conflict with recovery": the same question again, on
    /// the same connection), each with a growing pause (at most
    /// `max_backoff`); other errors (an unknown stream, say) are returned,
    /// and the next call connects afresh (its statement prepared again:
    /// the extension may have been dropped and created since).
    pub async fn next(&mut self) -> Result<Updates, Error> {
        let mut backoff = Duration::from_millis(50);
        let mut conflict_pause = CONFLICT_PAUSE;
        loop {
            match self.poll().await {
                Ok(answer) => {
                    self.token = answer.token.clone();
                    return Ok(answer);
                }
                Err(e) if is_connection_error(&e) => {
                    self.client = None;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(self.max_backoff);
                }
                Err(e) if self.is_recovery_conflict(&e) => {
                    tokio::time::sleep(conflict_pause).await;
                    conflict_pause = (conflict_pause * 2).min(self.max_backoff);
                }
                Err(e) => {
                    self.client = None;
                    return Err(e);
                }
            }
        }
    }

    /// A call replay cancelled: 40001 from a server that was in recovery
    /// when this connection was made, or whose message says so (a
    /// serialization failure on a primary, a stream dropped concurrently
    /// say, is the caller's to see).
    fn is_recovery_conflict(&self, e: &Error) -> bool {
        if e.sqlstate() != Some("40001") {
            return false;
        }
        let standby = self.client.as_ref().is_some_and(|c| c.in_recovery);
        let said = match e {
            Error::Db(db) => db
                .as_db_error()
                .is_some_and(|d| d.message().contains("conflict with recovery")),
            _ => false,
        };
        standby || said
    }

    async fn poll(&mut self) -> Result<Updates, Error> {
        if self.client.as_ref().is_none_or(|c| c.client.is_closed()) {
            let (client, connection) = tokio_postgres::connect(&self.conninfo, NoTls).await?;
            tokio::spawn(connection);
            self.connections += 1;
            let statement = client.prepare(UPDATES).await?;
            let in_recovery: bool = client
                .query_one("SELECT pg_catalog.pg_is_in_recovery()", &[])
                .await?
                .try_get(0)?;
            self.client = Some(Connection {
                client,
                statement,
                in_recovery,
            });
        }
        let Connection {
            client, statement, ..
        } = self
            .client
            .as_ref()
            .ok_or_else(|| Error::Protocol("no connection".into()))?;
        let ms = millis(self.poll_timeout);
        let row = client
            .query_one(statement, &[&self.stream, &self.token, &self.max_rows, &ms])
            .await?;
        Updates::from_json(row.try_get(0)?)
    }
}

fn is_connection_error(e: &Error) -> bool {
    let Error::Db(e) = e else { return false };
    if e.is_closed() {
        return true;
    }
    match e.as_db_error() {
        // The server is going away or refused us: a restart, a terminated
        // backend, a connection failure.
        Some(db) => {
            let code = db.code().code();
            code.starts_with("08") || code.starts_with("57P")
        }
        // Not a server error: an I/O failure underneath means the connection.
        None => std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>()),
    }
}
