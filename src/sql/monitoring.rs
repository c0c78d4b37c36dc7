//! Monitoring reads (`stat_streams`, `consumers`, `in_flight`) never wait
//! for a lock. Every relation such a read may touch is locked first, each
//! only if granted at once (the lock `LOCK TABLE … NOWAIT` takes): the
//! extension's tables and their indexes, and, for a stream not used since
//! start-up (reading it loads it), its sequence, and its registered tables
//! when the load reads them (a promoted server's new history). A
//! relation that an operator's command holds or waits for (VACUUM FULL,
//! REINDEX, CLUSTER, ALTER TABLE, LOCK TABLE, ALTER EXTENSION UPDATE, or
//! another role's lock on its own table) makes the read answer at once:
//! without that part where it has a stand-in (the stored frontier), or
//! refused with 55P03 naming the relation. A scrape that sat behind such a
//! lock for as long as it was held (issue 35) now fails fast, and the
//! exporter's other queries still answer. The locks are held to the end of
//! the transaction, as the statements that follow would hold them.

use super::*;

/// The extension's tables every monitoring read reads: the streams, their
/// tables' registrations, the writers' names.
pub const CATALOG_TABLES: &[&CStr] = &[c"streams", c"stream_tables", c"instances"];

/// What loading a stream reads of the catalog (besides its sequence and
/// tables, `lock_stream_at_once`, and `stream_frontiers`).
pub const LOADING_TABLES: &[&CStr] = &[c"stream_positions", c"history_marks", c"prepared_holds"];

/// What a hot standby's answer reads (besides `stream_frontiers`).
pub const STANDBY_TABLES: &[&CStr] = &[c"stream_positions"];

/// What the view `consumers` reads besides.
pub const CONSUMER_TABLES: &[&CStr] = &[c"consumer_positions", c"frontier_marks"];

/// Lock `rel` and each of its indexes ACCESS SHARE, each only if granted
/// at once. False when one is not (what was granted stays locked to the
/// end of the transaction). A relation that is gone counts as locked:
/// whoever reads it next finds it gone, as before.
fn lock_at_once(rel: pg_sys::Oid) -> bool {
    let mode = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    // SAFETY: a conditional lock raises no error (it returns false);
    // try_relation_open returns NULL for a relation that is gone, and the
    // relation is open (locked) while its index list is copied.
    unsafe {
        if !pg_sys::ConditionalLockRelationOid(rel, mode) {
            return false;
        }
        let opened = pg_sys::try_relation_open(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        if opened.is_null() {
            return true;
        }
        let indexes = index_oids(opened);
        pg_sys::relation_close(opened, pg_sys::NoLock as pg_sys::LOCKMODE);
        indexes
            .into_iter()
            .all(|index| pg_sys::ConditionalLockRelationOid(index, mode))
    }
}

fn locked_now(view: &str, relation: &str) -> Error {
    Error::LockTimeout {
        message: format!("{view} cannot be read now: {relation} is locked"),
        detail: format!(
            "A command holds or waits for a lock on {relation} or one of its indexes that conflicts with reading it (VACUUM FULL, REINDEX, CLUSTER, ALTER TABLE, LOCK TABLE, ALTER EXTENSION UPDATE); monitoring reads do not wait for it."
        ),
    }
}

/// Lock the extension's tables `names` (those a catalog not yet updated
/// lacks are skipped) for `view`, each only if granted at once; 55P03
/// naming the first that is not.
pub fn lock_catalog_at_once(view: &str, names: &[&CStr]) -> Result<(), Error> {
    for name in names {
        if let Some(rel) = catalog_table(name) {
            if !lock_at_once(rel) {
                let name = name.to_string_lossy();
                return Err(locked_now(view, &format!("relation \"streampos.{name}\"")));
            }
        }
    }
    Ok(())
}

/// Lock `stream_frontiers` if granted at once: false when it is not
/// (`stat_streams` then shows the position worker's last stored frontier
/// from shared memory). True also for a catalog that has none.
pub fn frontiers_at_once() -> bool {
    catalog_table(c"stream_frontiers").is_none_or(lock_at_once)
}

/// 55P03 for `view`: `stream_frontiers` is locked, and the read needs it.
pub fn frontiers_locked(view: &str) -> Error {
    locked_now(view, "relation \"streampos.stream_frontiers\"")
}

/// Lock what loading `stream` reads besides the catalog (its sequence, and
/// its registered tables when `reads_tables`: only in a promoted server's
/// new history, `engine::loading_reads_tables`), each only if granted at
/// once: for a stream not used since start-up, which a monitoring read
/// would load. A table the load does not read is not locked: a migration's
/// lock on it refuses nothing, and a role that may not read it holds no
/// lock on it.
pub fn lock_stream_at_once(
    view: &str,
    stream: &str,
    seq: pg_sys::Oid,
    reads_tables: bool,
) -> Result<(), Error> {
    if !lock_at_once(seq) {
        return Err(Error::LockTimeout {
            message: format!("{view} cannot be read now: the sequence of stream \"{stream}\" is locked"),
            detail: "A command holds or waits for a lock on the stream's sequence that conflicts with reading it (ALTER SEQUENCE, DROP SEQUENCE, streampos.drop_stream or a repair); monitoring reads do not wait for it.".into(),
        });
    }
    if !reads_tables {
        return Ok(());
    }
    for (table, _, _) in registered_tables(stream) {
        if !lock_at_once(table) {
            return Err(locked_now(view, &format!("table {}", relation_name(table))));
        }
    }
    Ok(())
}

/// One row of the view `consumers` (the columns are NOT NULL where the
/// table's are; None stands for what SQL would show as NULL).
pub struct ConsumerView {
    pub stream_name: String,
    pub consumer_name: String,
    pub owner: pg_sys::Oid,
    /// As text: the token type is the API layer's.
    pub position: Option<String>,
    pub lag_ids: Option<i64>,
    pub lag_time: Option<pgrx::datum::Interval>,
    pub registered_at: Option<pgrx::datum::TimestampWithTimeZone>,
    pub acked_at: Option<pgrx::datum::TimestampWithTimeZone>,
    pub since_ack: Option<pgrx::datum::Interval>,
}

/// The view `consumers`' rows (0.3.0's view, as a statement): read as the
/// extension's owner, as the view read them; the tables locked first
/// (`lock_catalog_at_once`).
pub fn consumer_rows() -> Vec<ConsumerView> {
    const ROWS: &str = "SELECT c.stream_name, c.consumer_name, c.owner::pg_catalog.oid, c.position::pg_catalog.text, \
           CASE WHEN streampos.is_before_or_eq(t.current, c.position) THEN 0 \
                ELSE GREATEST(0, \
                    streampos.max_stream_pos(t.current) OPERATOR(pg_catalog.-) \
                    streampos.stream_pos(c.position)) \
           END, \
           CASE WHEN streampos.is_before_or_eq(t.current, c.position) THEN '0'::pg_catalog.interval \
                ELSE GREATEST('0'::pg_catalog.interval, \
                    pg_catalog.statement_timestamp() OPERATOR(pg_catalog.-) \
                        (SELECT m.marked_at FROM streampos.frontier_marks m \
                         WHERE m.stream_name OPERATOR(pg_catalog.=) c.stream_name \
                           AND NOT streampos.is_before_or_eq(m.position, c.position) \
                         ORDER BY m.marked_at LIMIT 1)) \
           END, \
           c.registered_at, c.acked_at, \
           GREATEST('0'::pg_catalog.interval, \
               pg_catalog.statement_timestamp() OPERATOR(pg_catalog.-) \
               COALESCE(c.acked_at, c.registered_at)) \
         FROM streampos.consumer_positions c, \
              LATERAL (SELECT streampos.current_token(c.stream_name) AS current) t \
         ORDER BY c.stream_name, c.consumer_name";
    as_role(extension_owner(), || {
        select_all(ROWS, &[], |r| {
            Ok(Some(ConsumerView {
                stream_name: r.get::<String>(1)?.unwrap_or_default(),
                consumer_name: r.get::<String>(2)?.unwrap_or_default(),
                owner: r.get::<pg_sys::Oid>(3)?.unwrap_or(pg_sys::InvalidOid),
                position: r.get(4)?,
                lag_ids: r.get(5)?,
                lag_time: r.get(6)?,
                registered_at: r.get(7)?,
                acked_at: r.get(8)?,
                since_ack: r.get(9)?,
            }))
        })
    })
}
