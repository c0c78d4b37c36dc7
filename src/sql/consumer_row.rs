//! `ack()`'s write of a consumer's row without SQL: the row found through
//! the primary key, locked and updated as an `UPDATE` under the caller's
//! isolation level would, without planning, starting and ending an
//! executor (which cost `ack()` more than Synapse's whole position
//! `UPDATE`).
//!
//! Only the extension's own table is written here, and only as the
//! statement did: `position` becomes its least upper bound with the token
//! (`advance`), `acked_at` the transaction's start. What the statement
//! ran besides is not needed: the table's one trigger,
//! `catalog_rows_stay_local`, returns the row for the extension's own
//! writes, and the foreign key to `streams` is not checked again when its
//! key does not change (PostgreSQL's own rule). The table has no policies;
//! its indexes are the extension's (a primary key), kept by
//! `CatalogTupleUpdate` as PostgreSQL keeps its catalogs'.
//!
//! As an `UPDATE` in a function does (SPI, not read-only): the command
//! counter is advanced and a new snapshot taken (READ COMMITTED: the latest
//! commits); the visible row is locked; under READ COMMITTED a row changed
//! since is followed to its newest version, which must still match (the
//! executor's recheck); under REPEATABLE READ and SERIALIZABLE that is
//! 40001, as PostgreSQL says it. A read-only transaction is refused with
//! PostgreSQL's own error for an `UPDATE` (25006).

use super::*;
use crate::error::OrRaise;
use streampos_core::token::{Token, TokenKind};

/// The consumer's row moved to the least upper bound of its position and
/// `token`: its owner and the position after; None if there is no such row
/// (or, with `only_owner`, none that role owns: then it is neither written
/// nor waited for). The row stays locked until the transaction ends.
pub fn advance_consumer_row(
    stream: &str,
    consumer: &str,
    token: &Token,
    only_owner: Option<pg_sys::Oid>,
) -> Option<(pg_sys::Oid, Token)> {
    // SAFETY: a read-only transaction is refused before anything is
    // opened; the snapshot is registered and released on every path (by
    // the resource owner on an ERROR); the relation and its index are
    // opened with the locks an UPDATE takes (kept to the end of the
    // transaction) and closed on every path.
    unsafe {
        pg_sys::PreventCommandIfReadOnly(c"UPDATE".as_ptr());
        let lock = pg_sys::RowExclusiveLock as pg_sys::LOCKMODE;
        // The kept OID first; looked up again if it is gone (the extension
        // made again in this session).
        let mut rel = match CONSUMER_COLUMNS.with(|k| k.get()) {
            Some((generation, oid, _)) if generation == relations_generation() => {
                pg_sys::try_relation_open(oid, lock)
            }
            _ => std::ptr::null_mut(),
        };
        if rel.is_null() {
            rel = pg_sys::relation_open(consumer_positions_oid()?, lock);
        }
        pg_sys::CommandCounterIncrement();
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetTransactionSnapshot());
        let answer = match ConsumerColumns::kept_or_read(rel) {
            Some(columns) => {
                let index = pg_sys::index_open(columns.key_index, lock);
                let answer = advance_in(
                    rel, index, &columns, snapshot, stream, consumer, token, only_owner,
                );
                pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
                answer
            }
            None => None,
        };
        pg_sys::relation_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        pg_sys::UnregisterSnapshot(snapshot);
        answer
    }
}

/// `streampos.consumer_positions`, or None (the extension is being
/// dropped in this transaction).
fn consumer_positions_oid() -> Option<pg_sys::Oid> {
    // SAFETY: syscache lookups; InvalidOid when missing, no ERROR.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"streampos".as_ptr(), true);
        let oid = pg_sys::get_relname_relid(c"consumer_positions".as_ptr(), nsp);
        (nsp != pg_sys::InvalidOid && oid != pg_sys::InvalidOid).then_some(oid)
    }
}

thread_local! {
    /// `ConsumerColumns` of `streampos.consumer_positions` (its OID), as of a
    /// relations generation: every acknowledgement needs them, and they
    /// change only with the table (a relcache invalidation).
    static CONSUMER_COLUMNS: std::cell::Cell<Option<(u64, pg_sys::Oid, ConsumerColumns)>> =
        const { std::cell::Cell::new(None) };
}

/// The attribute numbers of the columns read and written, and the primary
/// key's index.
#[derive(Clone, Copy)]
struct ConsumerColumns {
    stream: i16,
    consumer: i16,
    owner: i16,
    position: i16,
    acked_at: i16,
    key_index: pg_sys::Oid,
}

impl ConsumerColumns {
    /// The kept columns of `rel` if they are still current, else read and
    /// kept.
    ///
    /// # Safety
    /// `rel` is open and locked.
    unsafe fn kept_or_read(rel: pg_sys::Relation) -> Option<ConsumerColumns> {
        // Opening the relation took in pending invalidations: the
        // generation now says whether anything changed.
        let generation = relations_generation();
        // SAFETY: as the caller promises.
        let oid = unsafe { (*rel).rd_id };
        if let Some((kept_generation, kept_oid, columns)) = CONSUMER_COLUMNS.with(|k| k.get()) {
            if kept_generation == generation && kept_oid == oid {
                return Some(columns);
            }
        }
        // SAFETY: as the caller promises.
        let columns = unsafe { ConsumerColumns::of(rel) }?;
        CONSUMER_COLUMNS.with(|k| k.set(Some((generation, oid, columns))));
        Some(columns)
    }

    /// None if the table is not the extension's layout (a column or the
    /// primary key on (stream_name, consumer_name) missing).
    ///
    /// # Safety
    /// `rel` is open and locked.
    unsafe fn of(rel: pg_sys::Relation) -> Option<ConsumerColumns> {
        // SAFETY: as the caller promises; syscache lookups by name.
        unsafe {
            let oid = (*rel).rd_id;
            let attnum = |name: &CStr| {
                let n = pg_sys::get_attnum(oid, name.as_ptr());
                (n > 0).then_some(n)
            };
            let columns = ConsumerColumns {
                stream: attnum(c"stream_name")?,
                consumer: attnum(c"consumer_name")?,
                owner: attnum(c"owner")?,
                position: attnum(c"position")?,
                acked_at: attnum(c"acked_at")?,
                key_index: {
                    // Sets rd_pkindex as it reads the relation's indexes.
                    pg_sys::list_free(pg_sys::RelationGetIndexList(rel));
                    (*rel).rd_pkindex
                },
            };
            (columns.key_index != pg_sys::InvalidOid).then_some(columns)
        }
    }
}

/// The lookup, lock and write of `advance_consumer_row`.
///
/// # Safety
/// `rel` and `index` are open with RowExclusiveLock, `snapshot` registered.
#[allow(clippy::too_many_arguments)]
unsafe fn advance_in(
    rel: pg_sys::Relation,
    index: pg_sys::Relation,
    columns: &ConsumerColumns,
    snapshot: pg_sys::Snapshot,
    stream: &str,
    consumer: &str,
    token: &Token,
    only_owner: Option<pg_sys::Oid>,
) -> Option<(pg_sys::Oid, Token)> {
    // SAFETY: as the caller promises. The slot holds each version read
    // (pinned) until the next is stored in it or it is dropped; its values
    // are read after slot_getallattrs.
    unsafe {
        let slot = pg_sys::table_slot_create(rel, std::ptr::null_mut());
        let found = find_row(rel, index, snapshot, slot, stream, consumer);
        let answer = found
            .then(|| owner_of(slot, columns))
            .filter(|&owner| only_owner.is_none_or(|only| only == owner))
            .and_then(|_| lock_newest(rel, snapshot, slot))
            .and_then(|()| {
                // The newest version must still be the row asked for.
                let owner = owner_of(slot, columns);
                (text_equals(slot, columns.stream, stream)
                    && text_equals(slot, columns.consumer, consumer)
                    && only_owner.is_none_or(|only| only == owner))
                .then(|| (owner, write(rel, slot, columns, token)))
            });
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        answer
    }
}

/// Store in `slot` the row of (`stream`, `consumer`) that `snapshot`
/// sees, through the primary key; whether there is one.
///
/// # Safety
/// As `advance_in`.
unsafe fn find_row(
    rel: pg_sys::Relation,
    index: pg_sys::Relation,
    snapshot: pg_sys::Snapshot,
    slot: *mut pg_sys::TupleTableSlot,
    stream: &str,
    consumer: &str,
) -> bool {
    // SAFETY: as the caller promises; the keys' texts are palloc'd in the
    // current memory context, which outlives the scan.
    unsafe {
        let mut keys: [pg_sys::ScanKeyData; 2] = std::mem::zeroed();
        for (i, value) in [stream, consumer].into_iter().enumerate() {
            let text = pg_sys::cstring_to_text_with_len(value.as_ptr().cast(), value.len() as i32);
            pg_sys::ScanKeyEntryInitialize(
                &mut keys[i],
                0,
                i as i16 + 1,
                pg_sys::BTEqualStrategyNumber as u16,
                pg_sys::InvalidOid,
                *(*index).rd_indcollation.add(i),
                pg_sys::Oid::from(pg_sys::F_TEXTEQ),
                pg_sys::Datum::from(text),
            );
        }
        let scan = begin_index_scan(rel, index, snapshot, 2);
        pg_sys::index_rescan(scan, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
        let found =
            pg_sys::index_getnext_slot(scan, pg_sys::ScanDirection::ForwardScanDirection, slot);
        pg_sys::index_endscan(scan);
        if found {
            pg_sys::slot_getallattrs(slot);
        }
        found
    }
}

/// Lock the row version in `slot` as an UPDATE does, leaving the version
/// locked in `slot`: under READ COMMITTED the newest one (a row changed
/// since the snapshot is followed); None if the row is gone.
///
/// # Safety
/// As `advance_in`; `slot` holds a version of a row of `rel`.
unsafe fn lock_newest(
    rel: pg_sys::Relation,
    snapshot: pg_sys::Snapshot,
    slot: *mut pg_sys::TupleTableSlot,
) -> Option<()> {
    // SAFETY: as the caller promises.
    unsafe {
        let repeatable = pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32;
        let flags = if repeatable {
            0
        } else {
            pg_sys::TUPLE_LOCK_FLAG_FIND_LAST_VERSION as u8
        };
        let mut tid = (*slot).tts_tid;
        let mut failure: pg_sys::TM_FailureData = std::mem::zeroed();
        let result = pg_sys::table_tuple_lock(
            rel,
            &mut tid,
            snapshot,
            slot,
            pg_sys::GetCurrentCommandId(true),
            pg_sys::LockTupleMode::LockTupleNoKeyExclusive,
            pg_sys::LockWaitPolicy::LockWaitBlock,
            flags,
            &mut failure,
        );
        match result {
            pg_sys::TM_Result::TM_Ok => {
                pg_sys::slot_getallattrs(slot);
                Some(())
            }
            pg_sys::TM_Result::TM_Updated | pg_sys::TM_Result::TM_Deleted if repeatable => {
                let what = if result == pg_sys::TM_Result::TM_Updated {
                    "update"
                } else {
                    "delete"
                };
                // PostgreSQL's words for an UPDATE that meets one.
                Error::Retry {
                    message: format!("could not serialize access due to concurrent {what}"),
                }
                .report()
            }
            pg_sys::TM_Result::TM_Deleted => None,
            // Changed by this very command: nothing of ack's can have.
            _ => Error::Internal(format!(
                "unexpected result {result} locking a consumer's row"
            ))
            .report(),
        }
    }
}

/// The owner column of the row in `slot` (a regrole, never NULL).
///
/// # Safety
/// `slot` holds a row of the table, all attributes valid.
unsafe fn owner_of(slot: *mut pg_sys::TupleTableSlot, columns: &ConsumerColumns) -> pg_sys::Oid {
    // SAFETY: as the caller promises.
    unsafe {
        let i = columns.owner as usize - 1;
        pg_sys::Oid::from((*(*slot).tts_values.add(i)).value() as u32)
    }
}

/// Whether text column `attnum` of the row in `slot` is `value`.
///
/// # Safety
/// As `owner_of`.
unsafe fn text_equals(slot: *mut pg_sys::TupleTableSlot, attnum: i16, value: &str) -> bool {
    // SAFETY: as the caller promises; the detoasted copy is read in place.
    unsafe {
        let i = attnum as usize - 1;
        if *(*slot).tts_isnull.add(i) {
            return false;
        }
        let text = pg_sys::pg_detoast_datum_packed((*(*slot).tts_values.add(i)).cast_mut_ptr());
        let len = pgrx::varlena::varsize_any_exhdr(text);
        std::slice::from_raw_parts(pgrx::varlena::vardata_any(text).cast::<u8>(), len)
            == value.as_bytes()
    }
}

/// Write the new version of the locked row in `slot`: its position
/// advanced by `token`, `acked_at` the transaction's start. The position
/// written.
///
/// # Safety
/// As `advance_in`; `slot` holds the locked newest version.
unsafe fn write(
    rel: pg_sys::Relation,
    slot: *mut pg_sys::TupleTableSlot,
    columns: &ConsumerColumns,
    token: &Token,
) -> Token {
    // SAFETY: as the caller promises; the new tuple and the position's
    // varlena are palloc'd in the current memory context.
    unsafe {
        let p = columns.position as usize - 1;
        let position = crate::token_datum::token_from_datum(
            *(*slot).tts_values.add(p),
            TokenKind::MultiWriter,
        )
        .advance(token)
        .or_raise();
        let natts = (*(*rel).rd_att).natts as usize;
        let mut values = vec![pg_sys::Datum::from(0); natts];
        let mut nulls = vec![false; natts];
        let mut replace = vec![false; natts];
        values[p] = crate::token_datum::token_into_datum(&position);
        replace[p] = true;
        let a = columns.acked_at as usize - 1;
        values[a] = pg_sys::Datum::from(pg_sys::GetCurrentTransactionStartTimestamp());
        nulls[a] = false;
        replace[a] = true;
        let mut should_free = false;
        let old = pg_sys::ExecFetchSlotHeapTuple(slot, false, &mut should_free);
        let new = pg_sys::heap_modify_tuple(
            old,
            (*rel).rd_att,
            values.as_mut_ptr(),
            nulls.as_mut_ptr(),
            replace.as_mut_ptr(),
        );
        pg_sys::CatalogTupleUpdate(rel, &mut (*slot).tts_tid, new);
        pg_sys::heap_freetuple(new);
        position
    }
}
