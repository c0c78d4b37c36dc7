//! Every SQL statement the extension runs internally, and the one way it
//! runs them (SPI). Nothing else in the crate builds or executes SQL, so the
//! rules that make internal SQL safe for any caller hold here:
//!
//! - every statement runs with `search_path = pg_catalog, pg_temp` (nothing
//!   in the caller's path can stand in for a function, operator, type or
//!   relation), and still schema-qualifies every function, operator and type
//!   it names;
//! - relations are referred to by OID; when SQL text must name one (a table
//!   to read, a sequence to drop), the name is taken from the catalog for
//!   that OID at the moment of use, never remembered;
//! - the catalog tables are written only here, as the extension's owner
//!   (`as_owner`), never with the caller's privileges: nobody else may write
//!   them; `ack()`'s write of a consumer's row (`consumer_row.rs`) needs no
//!   privileges at all: it is not SQL, and touches that row alone;
//! - a relation another role may own (a stream's table, Synapse's tables)
//!   is read only through `read_as_owner`: checked to be a table the caller
//!   may read, then read as its owner in a security-restricted operation,
//!   as VACUUM and ANALYZE do, so that its policies, index expressions,
//!   constraints and rules run as the role that wrote them, never as the
//!   caller (docs/design.md, "Untrusted objects"); the one exception is
//!   `index_read`, which reads only where no code but PostgreSQL's own can
//!   run (no policy, no inheritance, built-in types, a plain ID index) and
//!   checks the caller with `read_as_owner`'s checks;
//! - what changes the caller's own objects (`setval` on their sequence) runs
//!   with the caller's privileges.
//!
//! This file keeps those rules and the one way to run a statement (the
//! safe path, the switch to another role, the runners); each concern's
//! statements are beside each other:
//!
//! | file | statements |
//! |---|---|
//! | `privileges.rs` | relations other roles may own: the one door that reads them, the caller's privilege checks, types and roles |
//! | `catalog.rs` | the extension's catalog: streams, instances, stored positions and frontiers, history marks, prepared transactions' holds |
//! | `sequences.rs` | a stream's sequence: create, drop, settings, `setval` |
//! | `stream_tables.rs` | a stream's registered tables as they are now, the ones that cannot be read, their highest IDs |
//! | `kept.rs` | statements prepared once per session and kept |
//! | `followers.rs` | what `updates` reads, as JSON |
//! | `index_read.rs` | `updates`' rows read through the ID index, without SQL, where no other role's code can run |
//! | `json_text.rs` | JSON text in PostgreSQL's memory, as `jsonb_out` prints it: `updates_json`'s answer |
//! | `monitoring.rs` | monitoring reads' locks, each taken only if granted at once; the consumers view's rows |
//! | `worker.rs` | the position worker's locks, stored positions, frontier marks, notifications |
//! | `adoption.rs` | `adopt_synapse`: Synapse's schema read, the catalog written |
//! | `consumer_row.rs` | `ack`'s write of a consumer's row, without SQL: found by its key, locked and updated as an `UPDATE` would |
//! | `consumers.rs` | consumers' rows: registration, acknowledgement, state, floors |

use std::collections::HashMap;
use std::ffi::{CStr, CString};

use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiResult, SpiTupleTable};
use pgrx::{PgBuiltInOids, PgOid};

use crate::error::Error;

mod adoption;
mod catalog;
mod consumer_row;
mod consumers;
mod followers;
mod index_read;
mod json_text;
mod kept;
mod monitoring;
mod privileges;
mod sequences;
mod stream_tables;
mod worker;

pub use adoption::*;
pub use catalog::*;
pub use consumer_row::*;
pub use consumers::*;
pub use followers::*;
pub use index_read::*;
pub use kept::*;
pub use monitoring::*;
pub use privileges::*;
pub use sequences::*;
pub use stream_tables::*;
pub use worker::*;

/// The value of an SPI call; an SPI-level failure (not an SQL error, which
/// PostgreSQL raises itself) is an internal error.
fn spi<T>(result: SpiResult<T>) -> T {
    match result {
        Ok(v) => v,
        Err(e) => Error::Internal(format!("internal query failed: {e}")).report(),
    }
}

/// Run `f` with `search_path = pg_catalog, pg_temp`, in a GUC nest level
/// that is discarded afterwards: whatever `f` runs (an internal statement,
/// and through it any function it calls) leaves no setting behind, not even
/// one made with a plain `SET` or `set_config(…, false)`, as PostgreSQL's
/// maintenance commands discard theirs. On ERROR the (sub)transaction's
/// abort discards the level itself.
fn with_safe_path<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: a GUC nest level is opened and closed around `f`; on ERROR,
    // transaction abort unwinds GUC nest levels itself.
    unsafe {
        let level = pg_sys::NewGUCNestLevel();
        restrict_search_path();
        let value = f();
        pg_sys::AtEOXact_GUC(false, level);
        value
    }
}

/// `search_path = pg_catalog, pg_temp` in the current GUC nest level, as
/// PostgreSQL 17's `RestrictSearchPath()` sets it for maintenance commands
/// (the same value and source, on every supported version); nothing when
/// it is that already.
///
/// # Safety
/// The caller opened a GUC nest level that it closes.
unsafe fn restrict_search_path() {
    // Already so (a statement inside `as_role`, which set it): setting it
    // again would only make PostgreSQL recompute the path, twice.
    let current = pg_sys::namespace_search_path;
    if !current.is_null() && CStr::from_ptr(current) == RESTRICTED_SEARCH_PATH {
        return;
    }
    set_in_nest_level(c"search_path", RESTRICTED_SEARCH_PATH);
}

const RESTRICTED_SEARCH_PATH: &CStr = c"pg_catalog, pg_temp";

/// Set `name` to `value` in the current GUC nest level (a session-level
/// SET, saved: undone when the level closes).
///
/// # Safety
/// The caller opened a GUC nest level that it closes.
unsafe fn set_in_nest_level(name: &CStr, value: &CStr) {
    pg_sys::set_config_option(
        name.as_ptr(),
        value.as_ptr(),
        pg_sys::GucContext::PGC_USERSET,
        pg_sys::GucSource::PGC_S_SESSION,
        pg_sys::GucAction::GUC_ACTION_SAVE,
        true,
        0,
        false,
    );
}

/// Longest a catalog change waits for a lock that other sessions queue
/// behind (`drop_stream` and a repair hold the stream's sequence against
/// allocation; while one of them waits, the stream's writers wait behind
/// it): the session's lock_timeout if it is shorter.
const LOCK_WAIT_BOUND_MS: i32 = 5000;

/// Run `f` with `lock_timeout` at most `LOCK_WAIT_BOUND_MS`. The setting
/// is restored afterwards, or by the abort of the (sub)transaction when `f`
/// raises an ERROR.
pub fn with_lock_wait_bound<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: reads a GUC variable; a GUC nest level is opened and closed
    // around `f`, and on ERROR transaction abort unwinds it.
    unsafe {
        let current = pg_sys::LockTimeout;
        if current > 0 && current <= LOCK_WAIT_BOUND_MS {
            return f();
        }
        let Ok(value) = CString::new(LOCK_WAIT_BOUND_MS.to_string()) else {
            return f();
        };
        let level = pg_sys::NewGUCNestLevel();
        set_in_nest_level(c"lock_timeout", &value);
        let result = f();
        pg_sys::AtEOXact_GUC(false, level);
        result
    }
}

/// The lock wait bound in force (for messages), in milliseconds.
pub fn lock_wait_bound_ms() -> i32 {
    // SAFETY: reads a GUC variable.
    let current = unsafe { pg_sys::LockTimeout };
    if current > 0 && current <= LOCK_WAIT_BOUND_MS {
        current
    } else {
        LOCK_WAIT_BOUND_MS
    }
}

/// The extension's own lock on its catalog: an advisory lock tag whose
/// fourth field no SQL function can produce (pg_advisory_lock and its
/// siblings use 1 and 2), so that no role can hold it but the extension's
/// functions. Adoption takes it EXCLUSIVE, every other change of
/// `streampos.instances` and `streampos.streams` SHARE, until the
/// transaction ends. (A table lock would not do: parse analysis of a
/// statement PUBLIC may PREPARE, an INSERT into the catalog, takes ROW
/// EXCLUSIVE before its privilege check and keeps it.)
fn lock_catalog(mode: u32) {
    let tag = pg_sys::LOCKTAG {
        // SAFETY: reads the backend's database, set at connection.
        locktag_field1: unsafe { pg_sys::MyDatabaseId }.to_u32(),
        locktag_field2: u32::from_be_bytes(*b"strm"),
        locktag_field3: u32::from_be_bytes(*b"posc"),
        locktag_field4: CATALOG_LOCK_CLASS,
        locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
        locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
    };
    // SAFETY: a transaction-level heavyweight lock (released when the
    // transaction or the subtransaction that took it ends); a failed wait
    // is an ERROR.
    unsafe {
        pg_sys::LockAcquire(&tag, mode as pg_sys::LOCKMODE, false, false);
    }
}

/// Serialise adoption with every other catalog change until the end of the
/// transaction: concurrent adoptions, new streams and new instance names
/// wait (readers, allocations and the position worker do not). See
/// `lock_catalog`.
pub fn lock_catalog_for_adoption() {
    lock_catalog(pg_sys::ExclusiveLock);
}

/// A change of `streampos.instances` or `streampos.streams` other than
/// adoption (see `lock_catalog`).
pub(super) fn lock_catalog_for_change() {
    lock_catalog(pg_sys::ShareLock);
}

/// The fourth field of the catalog lock's tag ("SP"); pg_locks shows it as
/// the objsubid of an advisory lock.
const CATALOG_LOCK_CLASS: u16 = 0x5350;

/// The fourth field of a stream's consumers lock ("SC"), another class no
/// SQL function can produce.
const CONSUMERS_LOCK_CLASS: u16 = 0x5343;

/// A stream's consumers lock (by its registry key, never reused), until
/// the transaction ends: a registration takes it EXCLUSIVE, an
/// acknowledgement or an unregistration SHARE. A registration checks its
/// position against every other consumer's and then inserts its own, and
/// no position may move or vanish in between, or a retention job that
/// does not see the registration yet could delete rows below the others'
/// positions that the new consumer needs (README, "Consumers"). The wait
/// is bounded like a catalog change's (55P03).
pub fn lock_consumers(stream_key: i32, exclusive: bool) {
    let tag = pg_sys::LOCKTAG {
        // SAFETY: reads the backend's database, set at connection.
        locktag_field1: unsafe { pg_sys::MyDatabaseId }.to_u32(),
        locktag_field2: u32::from_be_bytes(*b"strm"),
        locktag_field3: stream_key as u32,
        locktag_field4: CONSUMERS_LOCK_CLASS,
        locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
        locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
    };
    let mode = if exclusive {
        pg_sys::ExclusiveLock
    } else {
        pg_sys::ShareLock
    };
    // Granted at once (every acknowledgement but one meeting a
    // registration): no wait to bound, so no `lock_timeout` to set and
    // restore, which cost an acknowledgement more than the lock.
    // SAFETY: a transaction-level heavyweight lock (released when the
    // transaction or the subtransaction that took it ends), not waited for.
    let granted = unsafe { pg_sys::LockAcquire(&tag, mode as pg_sys::LOCKMODE, false, true) };
    if granted != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL {
        return;
    }
    with_lock_wait_bound(|| {
        // SAFETY: as above; a failed or timed-out wait is an ERROR.
        unsafe {
            pg_sys::LockAcquire(&tag, mode as pg_sys::LOCKMODE, false, false);
        }
    });
}

/// The role that owns the extension: the owner of its catalog tables,
/// which its script created (and `REASSIGN OWNED` moves with it). Read from
/// the catalog caches, not queried: every catalog write asks (an
/// acknowledgement each time), and a change of owner invalidates them.
fn extension_owner() -> pg_sys::Oid {
    // SAFETY: syscache lookups (InvalidOid or NULL when missing); the
    // owner is copied before the tuple is released.
    let owner = unsafe {
        let nsp = pg_sys::get_namespace_oid(c"streampos".as_ptr(), true);
        let rel = if nsp == pg_sys::InvalidOid {
            pg_sys::InvalidOid
        } else {
            pg_sys::get_relname_relid(c"streams".as_ptr(), nsp)
        };
        let tuple = pg_sys::SearchSysCache1(
            pg_sys::SysCacheIdentifier::RELOID as i32,
            pg_sys::Datum::from(rel),
        );
        if tuple.is_null() {
            pg_sys::InvalidOid
        } else {
            let form = &*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_class>(tuple);
            let owner = form.relowner;
            pg_sys::ReleaseSysCache(tuple);
            owner
        }
    };
    if owner == pg_sys::InvalidOid {
        Error::Internal("extension streampos is not installed".into()).report()
    }
    owner
}

/// Run `f` as `role` exactly as PostgreSQL's maintenance commands run a
/// table owner's code (`vacuum_rel`, `do_analyze_rel`, `DefineIndex`,
/// amcheck; docs/design.md, "Running another role's code"): the user id
/// switched in a security-restricted operation (no SET ROLE, no temporary
/// objects, no PREPARE, LISTEN or DISCARD), a GUC nest level opened with
/// the restricted search path and discarded at the end (no setting the
/// role's code makes survives, whatever its kind), and the functions that
/// change the session directly (advisory locks, `setseed`) refused while
/// it runs (`session::OwnerCode`). The caller's identity is restored
/// afterwards, or by the abort of the (sub)transaction on ERROR, which
/// also discards the nest level.
fn as_role<T>(role: pg_sys::Oid, f: impl FnOnce() -> T) -> T {
    // SAFETY: the user id and security context are saved and restored
    // around `f`, the GUC nest level opened and closed inside them, as
    // vacuum_rel does; on ERROR, (sub)transaction abort restores both.
    unsafe {
        let mut saved_user = pg_sys::InvalidOid;
        let mut saved_context = 0;
        pg_sys::GetUserIdAndSecContext(&mut saved_user, &mut saved_context);
        let _owner_code = crate::session::OwnerCode::enter(role, saved_user);
        pg_sys::SetUserIdAndSecContext(
            role,
            saved_context
                | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32
                | pg_sys::SECURITY_RESTRICTED_OPERATION as i32,
        );
        let level = pg_sys::NewGUCNestLevel();
        restrict_search_path();
        let value = f();
        pg_sys::AtEOXact_GUC(false, level);
        pg_sys::SetUserIdAndSecContext(saved_user, saved_context);
        value
    }
}

/// A read of another role's relation as that role (`as_role`), with two
/// more walls, since it runs inside the caller's transaction where VACUUM
/// would run in its own:
///
/// - in a subtransaction that is rolled back afterwards (what `f` returns
///   is copied out first: it lives in the caller's memory context or is
///   Rust's): whatever the role's code did to the caller's transaction —
///   `SET CONSTRAINTS`, a cursor declared or opened, a notification, a
///   lock — goes with it (not in parallel mode, where PostgreSQL refuses
///   those anyway and allows no subtransaction);
/// - with `row_security = off`, as pg_dump reads: a read that a policy
///   would filter (a table with FORCE ROW LEVEL SECURITY, whose owner is
///   subject to its own policies) is an ERROR (42501), never a read that
///   silently lacks rows.
fn read_as_role<T>(role: pg_sys::Oid, f: impl FnOnce() -> T) -> T {
    as_role(role, || {
        // SAFETY: inside the GUC nest level `as_role` opened.
        unsafe { set_in_nest_level(c"row_security", c"off") };
        in_discarded_subtransaction(f)
    })
}

/// Run `f` in a subtransaction that is rolled back afterwards, also when
/// `f` raises an ERROR (which is then raised again): the rollback of the
/// caller's own subtransaction finds no level of ours left open.
fn in_discarded_subtransaction<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: reads the backend's parallel-mode flag.
    if unsafe { pg_sys::IsInParallelMode() } {
        return f();
    }
    // SAFETY: the subtransaction is begun and rolled back here on every
    // path, and the memory context and resource owner are restored after
    // it, as PL/pgSQL's exception blocks do.
    unsafe {
        let context = pg_sys::CurrentMemoryContext;
        let owner = pg_sys::CurrentResourceOwner;
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(context);
        let subxact = pg_sys::GetCurrentSubTransactionId();
        let writes_before = CATALOG_WRITES_BEGUN.with(|w| w.get());
        let f = std::panic::AssertUnwindSafe(f);
        let outcome = pgrx::PgTryBuilder::new(move || {
            let f = f;
            Ok((f.0)())
        })
        .catch_others(|error| Err(Box::new(error)))
        .execute();
        // The catalog's caches are dropped at a rollback (it may take back
        // what they hold), which would make every read cost a catalog
        // reload: not when nothing wrote the catalog in between.
        if outcome.is_ok() && CATALOG_WRITES_BEGUN.with(|w| w.get()) == writes_before {
            QUIET_ROLLBACK.with(|q| q.set(subxact));
        }
        pg_sys::RollbackAndReleaseCurrentSubTransaction();
        QUIET_ROLLBACK.with(|q| q.set(0));
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::CurrentResourceOwner = owner;
        match outcome {
            Ok(value) => value,
            Err(error) => (*error).rethrow(),
        }
    }
}

/// Run `f` as the extension's owner, in a security-restricted operation,
/// for writes to the catalog tables.
fn as_owner<T>(f: impl FnOnce() -> T) -> T {
    let _writing = ExtensionWrite::begin();
    as_role(extension_owner(), f)
}

thread_local! {
    static EXTENSION_WRITES: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// Catalog writes begun in this backend, ever (`as_owner`).
    static CATALOG_WRITES_BEGUN: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The subtransaction `in_discarded_subtransaction` is rolling back
    /// with no catalog write in it (0: none).
    static QUIET_ROLLBACK: std::cell::Cell<pg_sys::SubTransactionId> = const { std::cell::Cell::new(0) };
}

/// Is the subtransaction being rolled back one of a read's, in which
/// nothing wrote the extension's catalog? Then nothing the catalog caches
/// hold was taken back with it.
pub fn quiet_rollback(subxact: pg_sys::SubTransactionId) -> bool {
    QUIET_ROLLBACK.with(|q| q.get()) == subxact
}

/// The extension itself is writing its catalog (as its owner), whatever
/// process runs it: its own writes are never taken for rows a logical
/// replication subscription brings (see `catalog_rows_stay_local`).
struct ExtensionWrite;

impl ExtensionWrite {
    fn begin() -> ExtensionWrite {
        EXTENSION_WRITES.with(|w| w.set(w.get() + 1));
        CATALOG_WRITES_BEGUN.with(|w| w.set(w.get().wrapping_add(1)));
        ExtensionWrite
    }
}

impl Drop for ExtensionWrite {
    // Also on an ERROR, which unwinds through here.
    fn drop(&mut self) {
        EXTENSION_WRITES.with(|w| w.set(w.get().saturating_sub(1)));
    }
}

/// Is the extension writing its catalog right now (`as_owner`)?
pub fn extension_writing() -> bool {
    EXTENSION_WRITES.with(|w| w.get() > 0)
}

/// The type of a text argument of a kept statement.
pub(super) const TEXT: PgOid = PgOid::BuiltIn(PgBuiltInOids::TEXTOID);

/// At most this many statements (and relation names) are kept per session.
pub(super) const MAX_KEPT: usize = 256;

/// The first column of the first row, or None for no rows (pgrx's `first()`
/// errors on an empty table).
fn first_one<T: FromDatum + IntoDatum>(table: SpiTupleTable) -> SpiResult<Option<T>> {
    if table.is_empty() {
        Ok(None)
    } else {
        table.first().get_one::<T>()
    }
}

/// Run a statement that changes something.
fn run(query: &str, args: &[DatumWithOid]) {
    with_safe_path(|| {
        spi(Spi::connect_mut(|client| {
            client.update(query, None, args).map(|_| ())
        }))
    });
}

/// The first column of the first row of a read-only query.
fn select_one<T: FromDatum + IntoDatum>(query: &str, args: &[DatumWithOid]) -> Option<T> {
    with_safe_path(|| {
        spi(Spi::connect(|client| {
            first_one::<T>(client.select(query, Some(1), args)?)
        }))
    })
}

/// The first column of the first row of a statement that changes something.
/// (A read-write SPI call assigns the transaction an xid; reads use
/// `select_one`, which reads with the active snapshot and assigns none.)
fn update_one<T: FromDatum + IntoDatum>(query: &str, args: &[DatumWithOid]) -> Option<T> {
    with_safe_path(|| {
        spi(Spi::connect_mut(|client| {
            first_one::<T>(client.update(query, Some(1), args)?)
        }))
    })
}

/// Every row of a read-only query, each converted by `row`.
fn select_all<T>(
    query: &str,
    args: &[DatumWithOid],
    mut row: impl FnMut(pgrx::spi::SpiHeapTupleData) -> SpiResult<Option<T>>,
) -> Vec<T> {
    with_safe_path(|| {
        spi(Spi::connect(|client| {
            let mut out = Vec::new();
            for r in client.select(query, None, args)? {
                if let Some(v) = row(r)? {
                    out.push(v);
                }
            }
            Ok(out)
        }))
    })
}

/// `index_beginscan` for `nkeys` keys (PostgreSQL 18 added the
/// instrumentation argument).
///
/// # Safety
/// `rel` and `index` are open and locked; `snapshot` is registered or active.
pub(super) unsafe fn begin_index_scan(
    rel: pg_sys::Relation,
    index: pg_sys::Relation,
    snapshot: pg_sys::Snapshot,
    nkeys: i32,
) -> pg_sys::IndexScanDesc {
    // SAFETY: as the caller promises.
    unsafe {
        #[cfg(feature = "pg18")]
        let scan = pg_sys::index_beginscan(rel, index, snapshot, std::ptr::null_mut(), nkeys, 0);
        #[cfg(not(feature = "pg18"))]
        let scan = pg_sys::index_beginscan(rel, index, snapshot, nkeys, 0);
        scan
    }
}

/// The OIDs of `rel`'s indexes (the relcache's list, copied and freed).
///
/// # Safety
/// `rel` is open and locked.
pub(super) unsafe fn index_oids(rel: pg_sys::Relation) -> Vec<pg_sys::Oid> {
    // SAFETY: as the caller promises; the list is a copy the caller owns.
    unsafe {
        let list = pg_sys::RelationGetIndexList(rel);
        if list.is_null() {
            return Vec::new();
        }
        let oids = (0..(*list).length as usize)
            .map(|i| (*(*list).elements.add(i)).oid_value)
            .collect();
        pg_sys::list_free(list);
        oids
    }
}

/// An equality scan key on text key column `attno` of B-tree `index`
/// (its collation) for `value`, a text value made in the current memory
/// context.
///
/// # Safety
/// `index` is open; `attno` is one of its key columns, of text_ops.
pub(super) unsafe fn text_equality_key(
    index: pg_sys::Relation,
    attno: i16,
    value: &[u8],
) -> pg_sys::ScanKeyData {
    // SAFETY: as the caller promises; a zeroed ScanKeyData is plain data,
    // filled by ScanKeyEntryInitialize.
    unsafe {
        let text = pg_sys::cstring_to_text_with_len(value.as_ptr().cast(), value.len() as i32);
        let mut key: pg_sys::ScanKeyData = std::mem::zeroed();
        pg_sys::ScanKeyEntryInitialize(
            &mut key,
            0,
            attno,
            pg_sys::BTEqualStrategyNumber as u16,
            pg_sys::InvalidOid,
            *(*index).rd_indcollation.add(attno as usize - 1),
            pg_sys::Oid::from(pg_sys::F_TEXTEQ),
            pg_sys::Datum::from(text),
        );
        key
    }
}

/// `f` of the bytes of text or varchar value `datum`, detoasted if it must
/// be; a detoasted copy is freed once `f` returns.
///
/// # Safety
/// `datum` is a non-null text or varchar value, valid for the call.
pub(super) unsafe fn with_text_bytes<T>(datum: pg_sys::Datum, f: impl FnOnce(&[u8]) -> T) -> T {
    // SAFETY: as the caller promises; the detoasted value is read in place
    // while `f` runs, then freed if it is a copy. A value neither
    // compressed nor stored apart is read where it is, as
    // pg_detoast_datum_packed would return it.
    unsafe {
        let given: *mut pg_sys::varlena = datum.cast_mut_ptr();
        let in_place =
            !pgrx::varlena::varatt_is_1b_e(given) && !pgrx::varlena::varatt_is_4b_c(given);
        let text = if in_place {
            given
        } else {
            pg_sys::pg_detoast_datum_packed(given)
        };
        let len = pgrx::varlena::varsize_any_exhdr(text);
        let value = f(std::slice::from_raw_parts(
            pgrx::varlena::vardata_any(text).cast::<u8>(),
            len,
        ));
        if text.cast() != datum.cast_mut_ptr::<std::ffi::c_void>() {
            pg_sys::pfree(text.cast());
        }
        value
    }
}

/// `ident` quoted for SQL text when it needs quoting (PostgreSQL's own rule).
fn quote_ident(ident: &str) -> String {
    let Ok(c) = CString::new(ident) else {
        // Identifiers come from the catalog and never contain NUL.
        return format!("\"{}\"", ident.replace('"', "\"\""));
    };
    // SAFETY: quote_identifier returns its argument or a palloc'd copy,
    // both valid NUL-terminated strings for the duration of this call.
    unsafe {
        CStr::from_ptr(pg_sys::quote_identifier(c.as_ptr()))
            .to_string_lossy()
            .into_owned()
    }
}

thread_local! {
    /// Moves at every relcache invalidation and schema change (see
    /// `relations_changed`): what was derived from a relation's name or
    /// columns under an earlier value is derived again.
    static RELATIONS_GENERATION: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// `relation_name` of each relation, as of a generation.
    static RELATION_NAMES: std::cell::RefCell<crate::fast_hash::FastMap<pg_sys::Oid, (u64, std::rc::Rc<str>)>> =
        std::cell::RefCell::new(crate::fast_hash::FastMap::default());
}

pub(super) fn relations_generation() -> u64 {
    RELATIONS_GENERATION.with(|g| g.get())
}

/// The schema-qualified, quoted name of relation `oid` now, for SQL text
/// and messages; `oid <n>` if it no longer exists.
pub fn relation_name(oid: pg_sys::Oid) -> String {
    relation_name_rc(oid).to_string()
}

/// `relation_name`, kept until a relation or a schema changes (a follower
/// asks on every call; a rename of either invalidates it).
fn relation_name_rc(oid: pg_sys::Oid) -> std::rc::Rc<str> {
    let generation = relations_generation();
    if let Some(name) = RELATION_NAMES.with(|n| {
        n.borrow()
            .get(&oid)
            .filter(|(g, _)| *g == generation)
            .map(|(_, name)| name.clone())
    }) {
        return name;
    }
    let name: std::rc::Rc<str> = look_up_relation_name(oid).into();
    RELATION_NAMES.with(|n| {
        let mut names = n.borrow_mut();
        if names.len() >= MAX_KEPT {
            names.clear();
        }
        names.insert(oid, (generation, name.clone()));
    });
    name
}

fn look_up_relation_name(oid: pg_sys::Oid) -> String {
    // SAFETY: syscache lookups that return NULL (not an ERROR) for a missing
    // relation or schema; the strings are palloc'd and NUL-terminated.
    unsafe {
        let rel = pg_sys::get_rel_name(oid);
        let nsp = pg_sys::get_namespace_name(pg_sys::get_rel_namespace(oid));
        if rel.is_null() || nsp.is_null() {
            return format!("oid {}", oid.to_u32());
        }
        let rel = CStr::from_ptr(rel).to_string_lossy();
        let nsp = CStr::from_ptr(nsp).to_string_lossy();
        format!("{}.{}", quote_ident(&nsp), quote_ident(&rel))
    }
}

/// The name of role `oid`, quoted for SQL text.
fn role_name(oid: pg_sys::Oid) -> String {
    // SAFETY: with noerr = false a missing role is an ERROR; the result is a
    // palloc'd NUL-terminated string.
    let name = unsafe { CStr::from_ptr(pg_sys::GetUserNameFromId(oid, false)) };
    quote_ident(&name.to_string_lossy())
}
