//! Consumers: a named position on a stream, acknowledged in the
//! transaction that processes the rows (`streampos.register_consumer`,
//! `streampos.ack`, `updates(…, consumer => …)`).

use std::time::Duration;

use tokio_postgres::Transaction;

use crate::api::{millis, one, Queryable, Updates};
use crate::{Error, MultiWriterToken};

/// A consumer `name` of `stream`. Read a batch and acknowledge it in one
/// transaction: what the transaction does with the rows commits with the
/// acknowledgement, so after a crash the consumer resumes where it left off
/// and processes each row exactly once.
///
/// ```no_run
/// # async fn demo(client: &mut tokio_postgres::Client) -> Result<(), streampos_client::Error> {
/// let consumer = streampos_client::Consumer::new("events", "federation_sender");
/// consumer.register(&*client, None).await?;
/// let txn = client.transaction().await?;
/// let batch = consumer.batch(&txn).await?;
/// // … write what the rows cause with `txn` …
/// consumer.ack(&txn, &batch.token).await?;
/// txn.commit().await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Consumer {
    stream: String,
    name: String,
    max_rows: i32,
    timeout: Duration,
}

impl Consumer {
    /// At most 100 rows a batch, waiting up to 30 seconds for some.
    pub fn new(stream: &str, name: &str) -> Consumer {
        Consumer {
            stream: stream.into(),
            name: name.into(),
            max_rows: 100,
            timeout: Duration::from_secs(30),
        }
    }

    pub fn with_max_rows(mut self, max_rows: i32) -> Consumer {
        self.max_rows = max_rows;
        self
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Consumer {
        self.timeout = timeout;
        self
    }

    /// `streampos.register_consumer`: registers the consumer at `since`
    /// (None: the stream's current token); a consumer the role already
    /// registered keeps its position. Returns the position.
    pub async fn register<Q: Queryable + ?Sized>(
        &self,
        q: &Q,
        since: Option<&MultiWriterToken>,
    ) -> Result<MultiWriterToken, Error> {
        Ok(one(
            q,
            "SELECT streampos.register_consumer($1, $2, $3)",
            &[&self.stream, &self.name, &since],
        )
        .await?
        .try_get(0)?)
    }

    /// `streampos.unregister_consumer`: whether it was registered.
    pub async fn unregister<Q: Queryable + ?Sized>(&self, q: &Q) -> Result<bool, Error> {
        Ok(one(
            q,
            "SELECT streampos.unregister_consumer($1, $2)",
            &[&self.stream, &self.name],
        )
        .await?
        .try_get(0)?)
    }

    /// The rows after the acknowledged position, waiting up to the timeout
    /// for some; read in `txn`, which then processes and acknowledges them.
    pub async fn batch(&self, txn: &Transaction<'_>) -> Result<Updates, Error> {
        let ms = millis(self.timeout);
        let row = one(
            txn,
            "SELECT streampos.updates_json($1, consumer => $2, max_rows => $3, timeout_ms => $4)::text",
            &[&self.stream, &self.name, &self.max_rows, &ms],
        )
        .await?;
        Updates::from_json(row.try_get(0)?)
    }

    /// The acknowledged position, as `q` sees it (None: not registered).
    pub async fn position<Q: Queryable + ?Sized>(
        &self,
        q: &Q,
    ) -> Result<Option<MultiWriterToken>, Error> {
        let rows = q
            .query_rows(
                "SELECT position FROM streampos.consumer_positions \
                 WHERE stream_name OPERATOR(pg_catalog.=) $1 \
                   AND consumer_name OPERATOR(pg_catalog.=) $2",
                &[&self.stream, &self.name],
            )
            .await?;
        match rows.first() {
            Some(row) => Ok(Some(row.try_get(0)?)),
            None => Ok(None),
        }
    }

    /// The rows after `since`, read on `replica` (a hot standby of the
    /// primary the consumer acknowledges on), waiting up to the timeout
    /// for some. The pattern: `since` starts at [`Consumer::position`]
    /// read on the primary; each batch is processed and acknowledged
    /// ([`Consumer::ack`]) in a transaction on the primary, and its token
    /// is the next `since` once that transaction committed (after a
    /// rollback, ask again from the same `since`). Never the standby's copy
    /// of the position: it lags the primary's acknowledgements, and a batch
    /// read from it could repeat rows already processed.
    pub async fn batch_after<Q: Queryable + ?Sized>(
        &self,
        replica: &Q,
        since: &MultiWriterToken,
    ) -> Result<Updates, Error> {
        let ms = millis(self.timeout);
        let row = one(
            replica,
            "SELECT streampos.updates_json($1, $2, $3, $4)::text",
            &[&self.stream, since, &self.max_rows, &ms],
        )
        .await?;
        Updates::from_json(row.try_get(0)?)
    }

    /// `streampos.wait_for_consumer`: sleeps until the stream is past the
    /// acknowledged position or the timeout passes; returns the stream's
    /// current token. For a consumer that reads its rows with a query of
    /// its own, then acknowledges the token in the transaction that
    /// processed them (also when no rows came: an idle writer's position
    /// moves the token too).
    pub async fn wait<Q: Queryable + ?Sized>(&self, q: &Q) -> Result<MultiWriterToken, Error> {
        let ms = millis(self.timeout);
        Ok(one(
            q,
            "SELECT streampos.wait_for_consumer($1, $2, $3)",
            &[&self.stream, &self.name, &ms],
        )
        .await?
        .try_get(0)?)
    }

    /// `streampos.ack`: every row up to `token` is processed, with `txn`.
    /// Never moves the position back. Returns the position after.
    pub async fn ack(
        &self,
        txn: &Transaction<'_>,
        token: &MultiWriterToken,
    ) -> Result<MultiWriterToken, Error> {
        Ok(one(
            txn,
            "SELECT streampos.ack($1, $2, $3)",
            &[&self.stream, &self.name, token],
        )
        .await?
        .try_get(0)?)
    }
}

/// `streampos.safe_to_delete`: the position up to which every consumer of
/// the stream has acknowledged every row (None: no consumers).
pub async fn safe_to_delete<Q: Queryable + ?Sized>(
    q: &Q,
    stream: &str,
) -> Result<Option<MultiWriterToken>, Error> {
    Ok(one(q, "SELECT streampos.safe_to_delete($1)", &[&stream])
        .await?
        .try_get(0)?)
}
