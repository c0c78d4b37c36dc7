//! Thin typed calls of the SQL API. Reading functions take a [`Queryable`]
//! (a client, or a transaction when the answer must be for its snapshot);
//! allocation takes a transaction, because an ID is in flight until the
//! transaction that allocated it ends.

use std::future::Future;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row, Transaction};

use crate::{Error, MultiWriterToken, RoomStreamToken};

/// Something that runs a statement: a [`Client`] or a [`Transaction`]. (The
/// returned futures are `Send`, so calls can be spawned.)
pub trait Queryable: Sync {
    fn query_rows(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> impl Future<Output = Result<Vec<Row>, tokio_postgres::Error>> + Send;
}

impl Queryable for Client {
    fn query_rows(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> impl Future<Output = Result<Vec<Row>, tokio_postgres::Error>> + Send {
        self.query(sql, params)
    }
}

impl Queryable for Transaction<'_> {
    fn query_rows(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> impl Future<Output = Result<Vec<Row>, tokio_postgres::Error>> + Send {
        self.query(sql, params)
    }
}

pub(crate) async fn one<Q: Queryable + ?Sized>(
    q: &Q,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Row, Error> {
    q.query_rows(sql, params)
        .await?
        .into_iter()
        .next()
        .ok_or_else(|| Error::Protocol(format!("no row from {sql}")))
}

pub(crate) fn millis(timeout: Duration) -> i32 {
    i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX)
}

// ---------------------------------------------------------------- writing

/// `streampos.next_id`: one ID, in flight until `txn` ends. Write the rows
/// that carry it in the same transaction.
pub async fn next_id(txn: &Transaction<'_>, stream: &str, writer: &str) -> Result<i64, Error> {
    Ok(
        one(txn, "SELECT streampos.next_id($1, $2)", &[&stream, &writer])
            .await?
            .try_get(0)?,
    )
}

/// `streampos.next_ids`: `n` IDs in allocation order (ascending; −1, −2, …
/// on a backward stream), in flight until `txn` ends.
pub async fn next_ids(
    txn: &Transaction<'_>,
    stream: &str,
    writer: &str,
    n: i32,
) -> Result<Vec<i64>, Error> {
    Ok(one(
        txn,
        "SELECT streampos.next_ids($1, $2, $3)",
        &[&stream, &writer, &n],
    )
    .await?
    .try_get(0)?)
}

/// `streampos.instance_id`: the id of an instance name (created if new).
pub async fn instance_id<Q: Queryable + ?Sized>(q: &Q, instance_name: &str) -> Result<i32, Error> {
    Ok(
        one(q, "SELECT streampos.instance_id($1)", &[&instance_name])
            .await?
            .try_get(0)?,
    )
}

// ---------------------------------------------------------------- reading

/// `streampos.frontier`: the largest F with every ID ≤ F finished, for the
/// statement's snapshot.
pub async fn frontier<Q: Queryable + ?Sized>(q: &Q, stream: &str) -> Result<i64, Error> {
    Ok(one(q, "SELECT streampos.frontier($1)", &[&stream])
        .await?
        .try_get(0)?)
}

/// `streampos.max_allocated`: the largest ID handed out.
pub async fn max_allocated<Q: Queryable + ?Sized>(q: &Q, stream: &str) -> Result<i64, Error> {
    Ok(one(q, "SELECT streampos.max_allocated($1)", &[&stream])
        .await?
        .try_get(0)?)
}

/// `streampos.writer_position`: the largest p with every ID ≤ p of that
/// writer finished.
pub async fn writer_position<Q: Queryable + ?Sized>(
    q: &Q,
    stream: &str,
    writer: &str,
) -> Result<i64, Error> {
    Ok(one(
        q,
        "SELECT streampos.writer_position($1, $2)",
        &[&stream, &writer],
    )
    .await?
    .try_get(0)?)
}

/// One row of `streampos.writer_positions`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriterPosition {
    pub instance_name: String,
    pub instance_id: i32,
    pub stream_id: i64,
}

/// `streampos.writer_positions`, ordered by instance id.
pub async fn writer_positions<Q: Queryable + ?Sized>(
    q: &Q,
    stream: &str,
) -> Result<Vec<WriterPosition>, Error> {
    let rows = q
        .query_rows(
            "SELECT instance_name, instance_id, stream_id FROM streampos.writer_positions($1) ORDER BY instance_id",
            &[&stream],
        )
        .await?;
    rows.iter()
        .map(|r| {
            Ok(WriterPosition {
                instance_name: r.try_get(0)?,
                instance_id: r.try_get(1)?,
                stream_id: r.try_get(2)?,
            })
        })
        .collect()
}

/// `streampos.current_token`: the frontier plus every writer ahead of it.
pub async fn current_token<Q: Queryable + ?Sized>(
    q: &Q,
    stream: &str,
) -> Result<MultiWriterToken, Error> {
    Ok(one(q, "SELECT streampos.current_token($1)", &[&stream])
        .await?
        .try_get(0)?)
}

/// `streampos.current_room_token`.
pub async fn current_room_token<Q: Queryable + ?Sized>(
    q: &Q,
    stream: &str,
) -> Result<RoomStreamToken, Error> {
    Ok(
        one(q, "SELECT streampos.current_room_token($1)", &[&stream])
            .await?
            .try_get(0)?,
    )
}

// ---------------------------------------------------------------- following

/// `streampos.wait_for`: sleeps until the frontier reaches `stream_id` or the
/// timeout passes; returns the frontier. Under READ COMMITTED it answers for
/// the latest snapshot: read the rows in a later statement.
pub async fn wait_for<Q: Queryable + ?Sized>(
    q: &Q,
    stream: &str,
    stream_id: i64,
    timeout: Duration,
) -> Result<i64, Error> {
    let ms = millis(timeout);
    Ok(one(
        q,
        "SELECT streampos.wait_for($1, $2, $3)",
        &[&stream, &stream_id, &ms],
    )
    .await?
    .try_get(0)?)
}

/// One table's part of an [`Updates`] answer.
#[derive(Clone, Debug, PartialEq)]
pub struct TableUpdates {
    /// The table's name as `regclass` text.
    pub table: String,
    /// The highest ID the answer covers.
    pub position: i64,
    pub columns: Vec<String>,
    /// The rows, oldest first, one JSON value per column.
    pub rows: Vec<Vec<Value>>,
}

impl TableUpdates {
    /// The rows deserialized as `T` (a tuple, or a struct deriving
    /// `Deserialize`, whose fields are read in column order).
    pub fn rows_as<T: DeserializeOwned>(&self) -> Result<Vec<T>, Error> {
        self.rows
            .iter()
            .map(|row| {
                serde_json::from_value(Value::Array(row.clone()))
                    .map_err(|e| Error::Protocol(format!("row of {}: {e}", self.table)))
            })
            .collect()
    }

    /// The index of a column by name.
    pub fn column(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c == name)
    }
}

/// The answer of `streampos.updates`.
#[derive(Clone, Debug, PartialEq)]
pub struct Updates {
    /// Where the answer stops: pass it as `since` next time.
    pub token: MultiWriterToken,
    /// Whether rows were left out by `max_rows` (then call again at once).
    pub limited: bool,
    /// Each table of the stream, by name, with its rows.
    pub tables: Vec<TableUpdates>,
}

impl Updates {
    /// Parses the JSON `streampos.updates` returns.
    pub fn from_json(text: &str) -> Result<Updates, Error> {
        let bad = |what: &str| Error::Protocol(format!("updates answer: {what}"));
        let value: Value = serde_json::from_str(text).map_err(|e| bad(&e.to_string()))?;
        let token = value
            .get("token")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("no token"))?;
        let token = MultiWriterToken::parse(token)?;
        let limited = value
            .get("limited")
            .and_then(Value::as_bool)
            .ok_or_else(|| bad("no limited"))?;
        let data = value
            .get("data")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no data"))?;
        let mut tables = Vec::new();
        let mut items = data.iter();
        while let Some(header) = items.next() {
            // [table_name, position, row_count, column_count, column_name, …]
            let header = header
                .as_array()
                .ok_or_else(|| bad("header is not an array"))?;
            let field = |k: usize| header.get(k).ok_or_else(|| bad("short header"));
            let table = field(0)?
                .as_str()
                .ok_or_else(|| bad("table name"))?
                .to_owned();
            let position = field(1)?.as_i64().ok_or_else(|| bad("position"))?;
            let row_count = field(2)?.as_u64().ok_or_else(|| bad("row count"))?;
            let column_count = field(3)?.as_u64().ok_or_else(|| bad("column count"))?;
            let columns = header
                .iter()
                .skip(4)
                .map(|c| {
                    c.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| bad("column name"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            if columns.len() as u64 != column_count {
                return Err(bad("column count does not match the names"));
            }
            let mut rows = Vec::new();
            for _ in 0..row_count {
                let row = items
                    .next()
                    .and_then(Value::as_array)
                    .ok_or_else(|| bad("missing row"))?;
                rows.push(row.clone());
            }
            tables.push(TableUpdates {
                table,
                position,
                columns,
                rows,
            });
        }
        Ok(Updates {
            token,
            limited,
            tables,
        })
    }

    /// Every row of every table.
    pub fn row_count(&self) -> usize {
        self.tables.iter().map(|t| t.rows.len()).sum()
    }

    /// One table's part, by name.
    pub fn table(&self, name: &str) -> Option<&TableUpdates> {
        self.tables.iter().find(|t| t.table == name)
    }
}

/// `streampos.updates`: the rows after `since`, at most `max_rows` (cut at
/// an ID boundary), waiting up to `timeout` for some writer to move. Read
/// as `updates_json`, the same answer's text without jsonb's printing.
pub async fn updates<Q: Queryable + ?Sized>(
    q: &Q,
    stream: &str,
    since: &MultiWriterToken,
    max_rows: i32,
    timeout: Duration,
) -> Result<Updates, Error> {
    let ms = millis(timeout);
    let row = one(
        q,
        "SELECT streampos.updates_json($1, $2, $3, $4)::text",
        &[&stream, since, &max_rows, &ms],
    )
    .await?;
    Updates::from_json(row.try_get(0)?)
}
