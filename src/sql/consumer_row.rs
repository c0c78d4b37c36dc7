//! `ack()`'s write of a consumer's row without SQL: the row found through
//! the primary key, locked and updated as an `UPDATE` under the caller's
//! isolation level would, without planning, starting and ending an
//! executor (which cost `ack()` more than Synapse's whole position
//! `UPDATE`).
//!
//! Only while the table is exactly as the extension made it
//! (`ConsumerColumns::of`): then the UPDATE would run nothing more than
//! this file does. Its one trigger, `catalog_rows_stay_local`, returns the
//! row for the extension's own writes; its foreign key to `streams` is not
//! deferrable, so the insert of a row was checked when it was made and an
//! update that leaves the key alone needs no check; it has no policies,
//! rules, CHECK constraints or generated columns, and its one index is the
//! primary key, kept by `CatalogTupleUpdate` as PostgreSQL keeps its
//! catalogs' (no expressions, no predicate: `CatalogIndexInsert` evaluates
//! neither). A table a superuser changed (another index, a trigger, a
//! constraint) is written by the UPDATE in `consumers.rs` instead, which
//! runs all of it. A publication's row filter the replica identity does
//! not cover refuses the write as it refuses the UPDATE.
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
    // SAFETY: PostgreSQL's own refusal of an UPDATE in a read-only
    // transaction (25006), before anything is opened.
    unsafe { pg_sys::PreventCommandIfReadOnly(c"UPDATE".as_ptr()) };
    match advance_directly(stream, consumer, token, only_owner) {
        Direct::Done(answer) => answer,
        // The table is not as the extension made it (a superuser's index,
        // trigger, constraint, rule or policy on it): the UPDATE, which
        // runs all of that.
        Direct::NotHere => advance_consumer_statement(
            stream,
            consumer,
            &token.to_text(TokenKind::MultiWriter),
            only_owner,
        )
        .map(|(owner, position)| {
            (
                owner,
                Token::parse(TokenKind::MultiWriter, &position).or_raise(),
            )
        }),
    }
}

/// What the write without SQL did.
enum Direct {
    /// The owner and position written, or None: no such row.
    Done(Option<(pg_sys::Oid, Token)>),
    /// The table is not the extension's layout: the statement writes.
    NotHere,
}

fn advance_directly(
    stream: &str,
    consumer: &str,
    token: &Token,
    only_owner: Option<pg_sys::Oid>,
) -> Direct {
    // SAFETY: the snapshot is registered and released on every path (by
    // the resource owner on an ERROR); the relation and its index are
    // opened with the locks an UPDATE takes (kept to the end of the
    // transaction) and closed on every path.
    unsafe {
        let lock = pg_sys::RowExclusiveLock as pg_sys::LOCKMODE;
        let oid = match CONSUMER_COLUMNS.with(|k| k.get()) {
            Some((generation, oid, _)) if generation == relations_generation() => Some(oid),
            _ => catalog_table(c"consumer_positions"),
        };
        let Some(oid) = oid else {
            return Direct::NotHere;
        };
        let rel = pg_sys::try_relation_open(oid, lock);
        if rel.is_null() {
            // Dropped since the lookup: the statement looks up the name.
            return Direct::NotHere;
        }
        let Some(columns) = ConsumerColumns::kept_or_read(rel) else {
            pg_sys::relation_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
            return Direct::NotHere;
        };
        // A publication's row filter or column list that the replica
        // identity does not cover refuses the UPDATE: the same check.
        pg_sys::CheckCmdReplicaIdentity(rel, pg_sys::CmdType::CMD_UPDATE);
        pg_sys::CommandCounterIncrement();
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetTransactionSnapshot());
        let index = pg_sys::index_open(columns.key_index, lock);
        let answer = advance_in(
            rel, index, &columns, snapshot, stream, consumer, token, only_owner,
        );
        pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
        pg_sys::relation_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        pg_sys::UnregisterSnapshot(snapshot);
        Direct::Done(answer)
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

    /// None if the table is not exactly as the extension made it: then
    /// the statement writes, since an UPDATE would run more than this file
    /// does (an expression or partial index to keep, a trigger, a CHECK
    /// constraint, a generated column, a rule, a policy).
    ///
    /// # Safety
    /// `rel` is open and locked.
    unsafe fn of(rel: pg_sys::Relation) -> Option<ConsumerColumns> {
        // SAFETY: as the caller promises; syscache lookups; the relcache's
        // descriptor, triggers and index list read in place.
        unsafe {
            let form = &*(*rel).rd_rel;
            let nsp = form.relnamespace;
            if CStr::from_ptr(form.relname.data.as_ptr()) != c"consumer_positions"
                || pg_sys::get_namespace_oid(c"streampos".as_ptr(), true) != nsp
                || form.relkind as u8 != pg_sys::RELKIND_RELATION
                || form.relam != pg_sys::HEAP_TABLE_AM_OID
                || form.relhasrules
                || form.relrowsecurity
            {
                return None;
            }
            let constraints = (*(*rel).rd_att).constr;
            if !constraints.is_null() && ((*constraints).num_check > 0 || generated(constraints)) {
                return None;
            }
            if !only_known_triggers((*rel).trigdesc, nsp) {
                return None;
            }
            let oid = (*rel).rd_id;
            let column = |name: &CStr, type_oid: pg_sys::Oid| {
                let n = pg_sys::get_attnum(oid, name.as_ptr());
                (n > 0 && pg_sys::get_atttype(oid, n) == type_oid).then_some(n)
            };
            let token_type = type_in(c"multi_writer_token", nsp)?;
            let columns = ConsumerColumns {
                stream: column(c"stream_name", pg_sys::TEXTOID)?,
                consumer: column(c"consumer_name", pg_sys::TEXTOID)?,
                owner: column(c"owner", pg_sys::REGROLEOID)?,
                position: column(c"position", token_type)?,
                acked_at: column(c"acked_at", pg_sys::TIMESTAMPTZOID)?,
                key_index: pg_sys::InvalidOid,
            };
            let key_index = only_the_primary_key(rel, columns.stream, columns.consumer)?;
            Some(ConsumerColumns {
                key_index,
                ..columns
            })
        }
    }
}

/// Whether the table has generated columns (stored, or on PostgreSQL 18
/// virtual).
///
/// # Safety
/// `constraints` is a relation descriptor's constraints.
unsafe fn generated(constraints: *mut pg_sys::TupleConstr) -> bool {
    // SAFETY: as the caller promises.
    unsafe {
        #[cfg(feature = "pg18")]
        let virtual_columns = (*constraints).has_generated_virtual;
        #[cfg(not(feature = "pg18"))]
        let virtual_columns = false;
        (*constraints).has_generated_stored || virtual_columns
    }
}

/// The OID of type `name` in namespace `nsp`, or None.
fn type_in(name: &CStr, nsp: pg_sys::Oid) -> Option<pg_sys::Oid> {
    // SAFETY: a syscache lookup by name and namespace; InvalidOid if none.
    let oid = unsafe {
        pg_sys::GetSysCacheOid(
            pg_sys::SysCacheIdentifier::TYPENAMENSP as i32,
            pg_sys::Anum_pg_type_oid as pg_sys::AttrNumber,
            pg_sys::Datum::from(name.as_ptr()),
            pg_sys::Datum::from(nsp),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        )
    };
    (oid != pg_sys::InvalidOid).then_some(oid)
}

/// Whether the table's triggers are the extension's own: its
/// `catalog_rows_stay_local` (which returns the row for the extension's
/// writes) and the foreign key's checks, not deferrable (an UPDATE that
/// leaves the key alone checks nothing then; a deferrable one could have
/// a check of a row inserted in this transaction still pending).
///
/// # Safety
/// `triggers` is a relation's trigger descriptor or NULL.
unsafe fn only_known_triggers(triggers: *mut pg_sys::TriggerDesc, nsp: pg_sys::Oid) -> bool {
    if triggers.is_null() {
        return true;
    }
    // SAFETY: as the caller promises; each trigger's function looked up in
    // the syscache (a palloc'd name, or NULL).
    unsafe {
        (0..(*triggers).numtriggers as usize).all(|i| {
            let t = &*(*triggers).triggers.add(i);
            let function = t.tgfoid;
            let foreign_key_check = t.tgisinternal
                && !t.tgdeferrable
                && (function == pg_sys::Oid::from(pg_sys::F_RI_FKEY_CHECK_INS)
                    || function == pg_sys::Oid::from(pg_sys::F_RI_FKEY_CHECK_UPD));
            let name = pg_sys::get_func_name(function);
            let ours = !name.is_null()
                && CStr::from_ptr(name) == c"catalog_rows_stay_local"
                && pg_sys::get_func_namespace(function) == nsp;
            foreign_key_check || ours
        })
    }
}

/// The primary key's index if it is the table's only index and exactly
/// the B-tree on (`stream`, `consumer`), immediate, without expressions or
/// a predicate; else None.
///
/// # Safety
/// `rel` is open and locked.
unsafe fn only_the_primary_key(
    rel: pg_sys::Relation,
    stream: i16,
    consumer: i16,
) -> Option<pg_sys::Oid> {
    // SAFETY: as the caller promises; the index is opened (and closed) to
    // read its relcache entry.
    unsafe {
        // Reading the index list sets rd_pkindex.
        let count = index_oids(rel).len();
        let key = (*rel).rd_pkindex;
        if count != 1 || key == pg_sys::InvalidOid {
            return None;
        }
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let index = pg_sys::index_open(key, lock);
        let form = &*(*index).rd_index;
        let keys = form.indkey.values.as_ptr();
        let plain = (*(*index).rd_rel).relam == pg_sys::BTREE_AM_OID
            && form.indisunique
            && form.indimmediate
            && form.indnatts == 2
            && form.indnkeyatts == 2
            && *keys == stream
            && *keys.add(1) == consumer
            && *(*index).rd_opfamily == pg_sys::TEXT_BTREE_FAM_OID
            && *(*index).rd_opfamily.add(1) == pg_sys::TEXT_BTREE_FAM_OID
            && pg_sys::heap_attisnull(
                (*index).rd_indextuple,
                pg_sys::Anum_pg_index_indexprs as i32,
                std::ptr::null_mut(),
            )
            && pg_sys::heap_attisnull(
                (*index).rd_indextuple,
                pg_sys::Anum_pg_index_indpred as i32,
                std::ptr::null_mut(),
            );
        pg_sys::index_close(index, lock);
        plain.then_some(key)
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
    // SAFETY: as the caller promises (the primary key on (stream_name,
    // consumer_name), checked by `ConsumerColumns::of`); the keys' texts
    // are palloc'd in the current memory context, which outlives the scan.
    unsafe {
        let mut keys = [
            text_equality_key(index, 1, stream.as_bytes()),
            text_equality_key(index, 2, consumer.as_bytes()),
        ];
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
    // SAFETY: as the caller promises.
    unsafe {
        let i = attnum as usize - 1;
        !*(*slot).tts_isnull.add(i)
            && with_text_bytes(*(*slot).tts_values.add(i), |bytes| {
                bytes == value.as_bytes()
            })
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
