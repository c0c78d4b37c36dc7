//! What a prepared transaction may still commit rows for, across a start.
//!
//! Holds are a session's and end with the server; a prepared transaction
//! outlives every start (crash, clean restart, promotion, recovery to a
//! point in time) and may hold the row of an ID a hold gave out. At
//! `PREPARE TRANSACTION` the transaction records, in
//! `streampos.prepared_holds`, the lowest ID of every hold then given out in
//! its database, per stream and writer (`record`): the rows are its own, so
//! they are WAL-logged with it, replicate, and are gone with its rollback.
//! At a stream's first use after a start that such a transaction outlived,
//! they are read with a dirty snapshot (`read`): uncommitted rows of
//! transactions still prepared, and committed rows a snapshot from before
//! their COMMIT PREPARED may still need. The position worker forgets rows
//! once every snapshot sees them committed (`sql::forget_prepared_holds`).
//! docs/design.md, "What outlives a start".

use pgrx::pg_sys;

use crate::{registry, sql};

/// At `XACT_EVENT_PRE_PREPARE`: record what this transaction may hold rows
/// of. (Whether it wrote any row cannot be told here: PREPARE has given
/// it an xid, and a row of an unlogged table writes no WAL.)
pub fn record() {
    // SAFETY: reads backend-local state.
    let (read_only, wrote_wal) = unsafe { (pg_sys::XactReadOnly, pg_sys::XactLastRecEnd != 0) };
    // Read-only and without WAL of its own: it wrote no row. (A transaction
    // may turn read-only after writing: SET TRANSACTION READ ONLY.)
    if (read_only && !wrote_wal) || !registry::is_loaded() {
        return;
    }
    // SAFETY: MyDatabaseId is set once the backend is connected.
    let db = unsafe { pg_sys::MyDatabaseId };
    let Ok(holds) = registry::holds_for_prepare(db) else {
        return;
    };
    if holds.is_empty() {
        return;
    }
    // The statements of the transaction have ended: the INSERT needs a
    // snapshot of its own (an ERROR pops it with the transaction).
    // A transaction that turned read-only after writing still records (the
    // records are the extension's, as a sequence's nextval would be).
    // SAFETY: pushes and pops a snapshot of this still running transaction,
    // and lifts its read-only flag for the extension's INSERT only (an
    // ERROR aborts the transaction, which ends the flag with it).
    unsafe {
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
        pg_sys::XactReadOnly = false;
    }
    // PREPARE runs without statement_timeout: waiting behind a lock on the
    // table (VACUUM FULL, DROP EXTENSION queued) is bounded (55P03).
    sql::with_lock_wait_bound(|| sql::record_prepared_holds(&holds));
    // SAFETY: the snapshot pushed above is the active one again.
    unsafe {
        pg_sys::XactReadOnly = read_only;
        pg_sys::PopActiveSnapshot();
    }
}

/// The records of stream `key` written by transactions that began before
/// xid `start` (its low 32 bits) and did not abort: (writer or
/// `ALL_WRITERS`, lowest ID), and whether they are complete (false: a
/// transaction of this database still prepared began before the table
/// existed, and recorded nothing, or a snapshot from before its end is
/// still open). The table's first row, written with it (stream key 0),
/// tells when that was: its xmin, which no GRANT, VACUUM FULL or freezing
/// changes. None when the catalog has no `prepared_holds` of the shape
/// and access method 0.4.0 made (not yet updated, or altered).
pub fn read(key: i32, start: u32) -> Option<(Vec<(i32, i64)>, bool)> {
    let relid = sql::catalog_table(c"prepared_holds")?;
    let mut records = Vec::new();
    // The first row's xmin; FROZEN when it was frozen (older than any
    // transaction still there); None when it is gone.
    let mut created_by = None;
    // SAFETY: a sequential heap scan of the extension's own table, opened
    // and closed here under AccessShareLock; tuples are read while the scan
    // holds their page, and every column is NOT NULL and passed by value.
    unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let rel = pg_sys::table_open(relid, lock);
        // Three columns, a heap: anything else is not the table 0.4.0
        // made, and is not read (every writer is held instead).
        if (*(*rel).rd_att).natts != 3 || (*(*rel).rd_rel).relam != pg_sys::HEAP_TABLE_AM_OID {
            pg_sys::table_close(rel, lock);
            return None;
        }
        // A dirty snapshot sees rows of transactions in progress (a
        // prepared one is) and committed rows not deleted.
        let mut dirty: pg_sys::SnapshotData = std::mem::zeroed();
        dirty.snapshot_type = pg_sys::SnapshotType::SNAPSHOT_DIRTY;
        let scan = pg_sys::heap_beginscan(
            rel,
            &mut dirty,
            0,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            pg_sys::ScanOptions::SO_TYPE_SEQSCAN,
        );
        loop {
            let tuple = pg_sys::heap_getnext(scan, pg_sys::ScanDirection::ForwardScanDirection);
            if tuple.is_null() {
                break;
            }
            // HeapTupleHeaderGetXmin (a frozen row's xmin is FROZEN), by
            // hand: pgrx's helper and PostgreSQL 18's binding clash.
            let header = (*tuple).t_data;
            let frozen = (pg_sys::HEAP_XMIN_COMMITTED | pg_sys::HEAP_XMIN_INVALID) as u16;
            let xmin = if (*header).t_infomask & frozen == frozen {
                pg_sys::TransactionId::FROZEN
            } else {
                (*header).t_choice.t_heap.t_xmin
            };
            let mut values = [pg_sys::Datum::from(0); 3];
            let mut nulls = [true; 3];
            pg_sys::heap_deform_tuple(
                tuple,
                (*rel).rd_att,
                values.as_mut_ptr(),
                nulls.as_mut_ptr(),
            );
            if nulls.iter().any(|&n| n) {
                continue;
            }
            if values[0].value() as i32 == FIRST_ROW_KEY {
                created_by = Some(xmin);
                continue;
            }
            if values[0].value() as i32 != key
                || !pg_sys::TransactionIdPrecedes(xmin, pg_sys::TransactionId::from_inner(start))
            {
                continue;
            }
            records.push((values[1].value() as i32, values[2].value() as i64));
        }
        pg_sys::heap_endscan(scan);
        pg_sys::table_close(rel, lock);
    }
    // Not whether such a transaction is still prepared now: a snapshot
    // from before its COMMIT PREPARED must not be passed its row either.
    let complete = created_by.is_some_and(|created_by| {
        created_by == pg_sys::TransactionId::FROZEN || !sql::older_than(created_by.into_inner())
    });
    Some((records, complete))
}

/// The stream key of the table's first row, which only says when the table
/// was created (no stream has key 0).
const FIRST_ROW_KEY: i32 = 0;
