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
//!   them;
//! - a relation another role may own (a stream's table, Synapse's tables)
//!   is read only through `read_as_owner`: checked to be a table the caller
//!   may read, then read as its owner in a security-restricted operation,
//!   as VACUUM and ANALYZE do, so that its policies, index expressions,
//!   constraints and rules run as the role that wrote them, never as the
//!   caller (docs/design.md, "Untrusted objects");
//! - what changes the caller's own objects (`setval` on their sequence) runs
//!   with the caller's privileges.

use std::collections::HashMap;
use std::ffi::{CStr, CString};

use pgrx::datum::DatumWithOid;
use pgrx::prelude::*;
use pgrx::spi::{SpiResult, SpiTupleTable};
use pgrx::{PgBuiltInOids, PgOid};

use crate::error::Error;

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
    with_lock_wait_bound(|| {
        // SAFETY: a transaction-level heavyweight lock (released when the
        // transaction or the subtransaction that took it ends); a failed or
        // timed-out wait is an ERROR.
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

// ------------------------------------------- relations other roles may own

/// Is `type_oid` built in all the way down: itself (looking through
/// domains) and, for an array, its element type? Only the bootstrap
/// superuser's types: no cast, operator or function of theirs is code
/// another role wrote (to_jsonb looks up casts to json only for types that
/// are not built in).
pub fn built_in_type(type_oid: pg_sys::Oid) -> bool {
    // SAFETY: syscache lookups; getBaseType raises an ERROR only for a type
    // that does not exist (a live column's type exists).
    unsafe {
        let base = pg_sys::getBaseType(type_oid);
        // An array's element decides: the array type of a domain over a
        // built-in type is created with the domain (an OID above 16384).
        let element = pg_sys::get_element_type(base);
        if element != pg_sys::InvalidOid {
            return built_in_type(element);
        }
        base.to_u32() < pg_sys::FirstNormalObjectId
    }
}

/// Does a column of `type_oid` compare with the stream's bigint IDs: a
/// built-in integer type, or a domain over one?
pub fn integer_type(type_oid: pg_sys::Oid) -> bool {
    // SAFETY: a syscache lookup; raises an ERROR only for a type that does
    // not exist (a live column's type exists).
    let base = unsafe { pg_sys::getBaseType(type_oid) };
    base == pg_sys::INT8OID || base == pg_sys::INT4OID || base == pg_sys::INT2OID
}

/// A type's name, for messages.
pub fn type_name(type_oid: pg_sys::Oid) -> String {
    // SAFETY: format_type_be returns a palloc'd string; a missing type
    // prints as ??? (it does not raise).
    unsafe {
        CStr::from_ptr(pg_sys::format_type_be(type_oid))
            .to_string_lossy()
            .into_owned()
    }
}

/// Does the calling role have the privileges of `role` (is it `role`, a
/// member of it, or a superuser)?
pub fn caller_acts_as(role: pg_sys::Oid) -> bool {
    // SAFETY: a catalog lookup; raises no error.
    unsafe { pg_sys::has_privs_of_role(pg_sys::GetUserId(), role) }
}

/// Does `member` have the privileges of `role`?
pub fn role_acts_as(member: pg_sys::Oid, role: pg_sys::Oid) -> bool {
    // SAFETY: a catalog lookup; raises no error.
    unsafe { pg_sys::has_privs_of_role(member, role) }
}

/// The owner of relation `oid` (None: it does not exist).
pub fn relation_owner(oid: pg_sys::Oid) -> Option<pg_sys::Oid> {
    select_one(
        "SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) $1",
        &[oid.into()],
    )
}

/// The name of role `oid` as messages show it (unquoted).
pub fn role_display_name(oid: pg_sys::Oid) -> String {
    // SAFETY: with noerr = true a missing role is NULL, not an ERROR.
    unsafe {
        let name = pg_sys::GetUserNameFromId(oid, true);
        if name.is_null() {
            format!("role {}", oid.to_u32())
        } else {
            CStr::from_ptr(name).to_string_lossy().into_owned()
        }
    }
}

/// What a relation kind is, for messages.
pub fn relkind_name(kind: u8) -> &'static str {
    match kind {
        b'v' => "a view",
        b'm' => "a materialized view",
        b'f' => "a foreign table",
        b'S' => "a sequence",
        b'c' => "a composite type",
        b'i' | b'I' => "an index",
        b't' => "a TOAST table",
        _ => "not a table",
    }
}

/// Is `kind` a relation kind the extension reads rows of?
pub fn is_table_kind(kind: u8) -> bool {
    kind == pg_sys::RELKIND_RELATION || kind == pg_sys::RELKIND_PARTITIONED_TABLE
}

/// What the extension needs to know of a relation before it reads it.
struct RelationFacts {
    owner: pg_sys::Oid,
    kind: u8,
    row_security: bool,
}

/// Read relation `rel` as its owner: THE way the extension reads a table
/// that another role may own (a stream's table, Synapse's tables).
///
/// The relation is locked (ACCESS SHARE, as any read takes) and then
/// checked as it is now, at every use (`check_may_read`): a table the
/// caller may read. Then `f` runs, given the relation's quoted name, as the
/// relation's owner in a security-restricted operation with `search_path =
/// pg_catalog, pg_temp`, as VACUUM, ANALYZE and REINDEX run a table's
/// expressions: whatever the planner folds or the executor runs of the
/// table (policies, index expressions and predicates, constraints used for
/// exclusion, the constraints of inheritance children and partitions,
/// rules) runs as the role that wrote it, never with the caller's
/// privileges. `f` must only read `rel` (and the catalog).
///
/// None when the relation no longer exists (dropped concurrently).
pub fn read_as_owner<T>(
    rel: pg_sys::Oid,
    columns: &[&str],
    f: impl FnOnce(&str) -> T,
) -> Option<T> {
    // SAFETY: try_relation_open locks the relation first and returns NULL
    // for one that does not exist; the form's fields are copied before the
    // relation is closed (the lock stays until the transaction ends).
    let facts = unsafe {
        let r = pg_sys::try_relation_open(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        if r.is_null() {
            return None;
        }
        let form = &*(*r).rd_rel;
        let facts = RelationFacts {
            owner: form.relowner,
            kind: form.relkind as u8,
            row_security: form.relrowsecurity,
        };
        pg_sys::relation_close(r, pg_sys::NoLock as pg_sys::LOCKMODE);
        // A lock this transaction already held took in no invalidation:
        // take them now, so that the name below is the current one.
        pg_sys::AcceptInvalidationMessages();
        facts
    };
    let name = relation_name(rel);
    check_may_read(rel, &name, &facts, columns);
    Some(read_as_role(facts.owner, || f(&name)))
}

/// Refuse a read of `rel` by the caller, as `read_as_owner` would, without
/// locking it (a follower checks before it waits, and must not hold its
/// tables' locks while it sleeps). A relation that no longer exists passes
/// (it is skipped when read).
pub fn check_caller_may_read(rel: pg_sys::Oid, columns: &[&str]) {
    // SAFETY: a syscache lookup (NULL for a relation that no longer
    // exists); the fields are copied before the tuple is released.
    let facts = unsafe {
        let tuple = pg_sys::SearchSysCache1(
            pg_sys::SysCacheIdentifier::RELOID as i32,
            pg_sys::Datum::from(rel),
        );
        if tuple.is_null() {
            return;
        }
        let form = &*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_class>(tuple);
        let facts = RelationFacts {
            owner: form.relowner,
            kind: form.relkind as u8,
            row_security: form.relrowsecurity,
        };
        pg_sys::ReleaseSysCache(tuple);
        facts
    };
    check_may_read(rel, &relation_name(rel), &facts, columns);
}

/// The checks before a read of `rel` as its owner: it must be a table or a
/// partitioned table (a table turned into a view in place, same OID, is
/// refused, not read: 42809); the caller must be allowed to SELECT
/// `columns` (42501); and with row-level security enabled, the caller must
/// have the owner's privileges or BYPASSRLS (42501): reading as the owner
/// would show rows its policies hide from the caller.
fn check_may_read(rel: pg_sys::Oid, name: &str, facts: &RelationFacts, columns: &[&str]) {
    if !is_table_kind(facts.kind) {
        Error::NotATable {
            relation: name.into(),
            kind: relkind_name(facts.kind).into(),
        }
        .report();
    }
    check_caller_may_select(rel, name, columns);
    if facts.row_security && !caller_acts_as(facts.owner) {
        // SAFETY: a catalog lookup; raises no error.
        if !unsafe { pg_sys::has_bypassrls_privilege(pg_sys::GetUserId()) } {
            Error::RowSecurity(name.into()).report();
        }
    }
}

/// Refuse (42501) a caller that may not SELECT `columns` of `rel` (a
/// table-level grant, or one on each column). A relation or column dropped
/// meanwhile counts as not granted.
fn check_caller_may_select(rel: pg_sys::Oid, name: &str, columns: &[&str]) {
    // SAFETY: catalog lookups that report a missing relation or column in
    // `missing` instead of raising an error.
    unsafe {
        let me = pg_sys::GetUserId();
        let select = pg_sys::ACL_SELECT as pg_sys::AclMode;
        let mut missing = false;
        if pg_sys::pg_class_aclcheck_ext(rel, me, select, &mut missing)
            == pg_sys::AclResult::ACLCHECK_OK
        {
            return;
        }
        if columns.is_empty() {
            Error::NoSelect(name.into()).report();
        }
        for column in columns {
            let Ok(c) = CString::new(*column) else {
                Error::NoSelect(name.into()).report();
            };
            let attnum = pg_sys::get_attnum(rel, c.as_ptr());
            if attnum == pg_sys::InvalidAttrNumber as i16
                || pg_sys::pg_attribute_aclcheck_ext(rel, attnum, me, select, &mut missing)
                    != pg_sys::AclResult::ACLCHECK_OK
            {
                Error::NoSelect(name.into()).report();
            }
        }
    }
}

// ------------------------------------------------------------------ catalog

/// A row of `streampos.streams`.
pub struct StreamRow {
    pub key: i32,
    pub seq: pg_sys::Oid,
    pub owns_sequence: bool,
    pub backwards: bool,
    pub writers: Option<Vec<String>>,
}

/// The stream's row as the latest snapshot sees it (with this transaction's
/// own changes).
pub fn stream_row(name: &str) -> Option<StreamRow> {
    // SAFETY: called inside a running transaction, never in parallel mode
    // (its callers change the catalog); the command counter moves first so
    // that the transaction's own changes so far are seen.
    let snapshot = unsafe {
        pg_sys::CommandCounterIncrement();
        pg_sys::GetLatestSnapshot()
    };
    stream_row_as_of(name, snapshot)
}

/// The stream's row as `snapshot` sees it. Executed read-only with exactly
/// that snapshot (`SPI_execute_snapshot`): an ordinary SPI query in a
/// transaction that has an xid takes a new snapshot under READ COMMITTED,
/// and a cursor's FETCH would then read another catalog than its snapshot's.
pub fn stream_row_as_of(name: &str, snapshot: pg_sys::Snapshot) -> Option<StreamRow> {
    const QUERY: &CStr =
        c"SELECT s.stream_key, s.seq::pg_catalog.oid, s.owns_sequence, s.backwards, s.writers \
        FROM streampos.streams s WHERE s.stream_name OPERATOR(pg_catalog.=) $1";
    with_safe_path(|| {
        spi(Spi::connect(|_client| -> SpiResult<Option<StreamRow>> {
            let Some(arg) = name.into_datum() else {
                return Ok(None);
            };
            // SAFETY: SPI is connected for the closure; the plan is freed
            // before returning (or with the SPI context on ERROR); the
            // result's tuple and descriptor are valid until SPI finishes,
            // and every value is copied out (owned Rust values) before.
            unsafe {
                let mut types = [pg_sys::TEXTOID];
                let plan = pg_sys::SPI_prepare(QUERY.as_ptr(), 1, types.as_mut_ptr());
                if plan.is_null() {
                    return Err(pgrx::spi::SpiError::SpiError(
                        pgrx::spi::SpiErrorCodes::Unconnected,
                    ));
                }
                let mut values = [arg];
                let nulls = [b' ' as std::ffi::c_char];
                let status = pg_sys::SPI_execute_snapshot(
                    plan,
                    values.as_mut_ptr(),
                    nulls.as_ptr(),
                    snapshot,
                    std::ptr::null_mut(),
                    true,
                    false,
                    1,
                );
                let table = pg_sys::SPI_tuptable;
                let row = if status != pg_sys::SPI_OK_SELECT as i32
                    || pg_sys::SPI_processed == 0
                    || table.is_null()
                {
                    None
                } else {
                    let tuple = *(*table).vals;
                    let desc = (*table).tupdesc;
                    let column = |n: i32| {
                        let mut null = false;
                        let datum = pg_sys::SPI_getbinval(tuple, desc, n, &mut null);
                        (datum, null)
                    };
                    let (d, n) = column(1);
                    let key = i32::from_datum(d, n).unwrap_or_default();
                    let (d, n) = column(2);
                    let seq = pg_sys::Oid::from_datum(d, n).unwrap_or(pg_sys::InvalidOid);
                    let (d, n) = column(3);
                    let owns_sequence = bool::from_datum(d, n).unwrap_or_default();
                    let (d, n) = column(4);
                    let backwards = bool::from_datum(d, n).unwrap_or_default();
                    let (d, n) = column(5);
                    let writers = Vec::<Option<String>>::from_datum(d, n)
                        .map(|w| w.into_iter().flatten().collect());
                    Some(StreamRow {
                        key,
                        seq,
                        owns_sequence,
                        backwards,
                        writers,
                    })
                };
                pg_sys::SPI_freeplan(plan);
                Ok(row)
            }
        }))
    })
}

/// The OID of `streampos.streams`.
pub fn streams_table_oid() -> pg_sys::Oid {
    select_one(
        "SELECT c.oid FROM pg_catalog.pg_class c \
         JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace \
         WHERE n.nspname OPERATOR(pg_catalog.=) 'streampos' \
           AND c.relname OPERATOR(pg_catalog.=) 'streams'",
        &[],
    )
    .unwrap_or(pg_sys::InvalidOid)
}

pub fn stream_names() -> Vec<String> {
    select_all("SELECT s.stream_name FROM streampos.streams s", &[], |r| {
        r.get::<String>(1)
    })
}

/// The stream that already uses sequence `seq`, if any.
pub fn stream_of_sequence(seq: pg_sys::Oid) -> Option<String> {
    select_one(
        "SELECT s.stream_name FROM streampos.streams s \
         WHERE s.seq::pg_catalog.oid OPERATOR(pg_catalog.=) $1",
        &[seq.into()],
    )
}

pub fn instance_id_of(name: &str) -> Option<i32> {
    select_one(
        "SELECT i.instance_id FROM streampos.instances i \
         WHERE i.instance_name OPERATOR(pg_catalog.=) $1",
        &[name.into()],
    )
}

/// Insert a new instance name; None when it exists already. The id
/// sequence is first moved past every id in the table, so that ids given
/// explicitly (imported, restored) are never handed out again.
pub fn insert_instance(name: &str) -> Option<i32> {
    lock_catalog_for_change();
    as_owner(|| {
        update_one::<i64>(
            "SELECT pg_catalog.setval('streampos.instances_instance_id_seq'::pg_catalog.regclass, m.max_id) \
             FROM (SELECT pg_catalog.max(i.instance_id)::pg_catalog.int8 AS max_id FROM streampos.instances i) m \
             WHERE m.max_id OPERATOR(pg_catalog.>) \
                   (SELECT CASE WHEN q.is_called THEN q.last_value \
                                ELSE q.last_value OPERATOR(pg_catalog.-) 1 END \
                    FROM streampos.instances_instance_id_seq q)",
            &[],
        );
        update_one(
            "INSERT INTO streampos.instances (instance_name) VALUES ($1) \
             ON CONFLICT (instance_name) DO NOTHING RETURNING instance_id",
            &[name.into()],
        )
    })
}

pub fn instance_name_of(id: i32) -> Option<String> {
    select_one(
        "SELECT i.instance_name FROM streampos.instances i \
         WHERE i.instance_id OPERATOR(pg_catalog.=) $1",
        &[id.into()],
    )
}

pub fn instance_names() -> HashMap<i32, String> {
    select_all(
        "SELECT i.instance_id, i.instance_name FROM streampos.instances i",
        &[],
        |r| Ok(r.get::<i32>(1)?.zip(r.get::<String>(2)?)),
    )
    .into_iter()
    .collect()
}

/// (instance id, stored position in internal numbering) for the stream.
pub fn stored_positions(stream: &str) -> Vec<(i32, i64)> {
    select_all(
        "SELECT i.instance_id, pg_catalog.abs(p.stream_id) FROM streampos.stream_positions p \
         JOIN streampos.instances i ON i.instance_name OPERATOR(pg_catalog.=) p.instance_name \
         WHERE p.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
        |r| Ok(r.get::<i32>(1)?.zip(r.get::<i64>(2)?)),
    )
}

/// The stored frontier (internal numbering), written with the positions;
/// None before the worker stored one.
pub fn stored_frontier(stream: &str) -> Option<i64> {
    // A database not yet updated from 0.2.0 has no stored frontiers.
    if !catalog_table_exists(c"stream_frontiers") {
        return None;
    }
    select_one(
        "SELECT pg_catalog.abs(f.stream_id) FROM streampos.stream_frontiers f \
         WHERE f.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
    )
}

/// Whether a prepared transaction from before the start whose first xid
/// is `start` (its low 32 bits) is still there, or a session's snapshot
/// from before one's COMMIT PREPARED (docs/design.md, "What outlives a
/// start"). The shared horizon says "maybe" for both, and also for what
/// reads nothing of this server's registry: a standby's
/// `hot_standby_feedback` (its walsender's xmin, sent again after a
/// restart) and replication slots. Read as the extension's owner: another
/// role's sessions show no backend type (counted, as a walsender of such a
/// role would be).
pub fn older_than_start(start: u32) -> bool {
    as_role(extension_owner(), || {
        select_one::<bool>(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_prepared_xacts p \
                 WHERE pg_catalog.age(p.transaction) OPERATOR(pg_catalog.>) \
                       pg_catalog.age($1::pg_catalog.text::pg_catalog.xid)) \
             OR EXISTS (SELECT FROM pg_catalog.pg_stat_activity a \
                 WHERE a.backend_type IS DISTINCT FROM 'walsender' \
                   AND pg_catalog.age(a.backend_xmin) OPERATOR(pg_catalog.>) \
                       pg_catalog.age($1::pg_catalog.text::pg_catalog.xid))",
            &[start.to_string().into()],
        )
    })
    .unwrap_or(true)
}

/// Whether a transaction of this database was prepared before
/// `streampos.prepared_holds` (OID `records`) was created: by a library
/// before 0.4.0, or before `ALTER EXTENSION streampos UPDATE`, so it
/// recorded nothing of the holds it may hold rows of.
pub fn prepared_before_records(records: pg_sys::Oid) -> bool {
    as_role(extension_owner(), || {
        select_one::<bool>(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_prepared_xacts p, pg_catalog.pg_class c \
                 WHERE c.oid OPERATOR(pg_catalog.=) $1 \
                   AND p.database OPERATOR(pg_catalog.=) pg_catalog.current_database() \
                   AND pg_catalog.age(p.transaction) OPERATOR(pg_catalog.>) pg_catalog.age(c.xmin))",
            &[records.into()],
        )
    })
    .unwrap_or(true)
}

/// The highest stored position or frontier at or below `at_most`
/// (internal numbering).
pub fn max_stored_at_most(stream: &str, at_most: i64) -> Option<i64> {
    select_one(
        "SELECT pg_catalog.max(x.p) FROM ( \
           SELECT pg_catalog.abs(p.stream_id) AS p FROM streampos.stream_positions p \
           WHERE p.stream_name OPERATOR(pg_catalog.=) $1 \
           UNION ALL \
           SELECT pg_catalog.abs(f.stream_id) FROM streampos.stream_frontiers f \
           WHERE f.stream_name OPERATOR(pg_catalog.=) $1) x \
         WHERE x.p OPERATOR(pg_catalog.<=) $2",
        &[stream.into(), at_most.into()],
    )
}

/// Does the extension's table `name` exist? (A database not yet updated
/// from 0.2.0 lacks the tables 0.3.0 added.)
fn catalog_table_exists(name: &CStr) -> bool {
    catalog_table(name).is_some()
}

/// The extension's table `name`, if it exists (a database not yet updated
/// lacks the tables later versions added).
pub fn catalog_table(name: &CStr) -> Option<pg_sys::Oid> {
    // SAFETY: catalog lookups that return InvalidOid for what does not
    // exist; they raise no error.
    let relid = unsafe {
        let nsp = pg_sys::get_namespace_oid(c"streampos".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            return None;
        }
        pg_sys::get_relname_relid(name.as_ptr(), nsp)
    };
    (relid != pg_sys::InvalidOid).then_some(relid)
}

/// In the transaction being prepared: what it may hold rows of, (stream
/// key, writer, lowest ID) (`prepared::record`), as the extension's owner.
/// Nothing in a catalog not yet updated to 0.4.0.
pub fn record_prepared_holds(holds: &[(i32, i32, i64)]) {
    if holds.is_empty() || !catalog_table_exists(c"prepared_holds") {
        return;
    }
    let keys: Vec<i32> = holds.iter().map(|h| h.0).collect();
    let writers: Vec<i32> = holds.iter().map(|h| h.1).collect();
    let ids: Vec<i64> = holds.iter().map(|h| h.2).collect();
    as_owner(|| {
        run(
            "INSERT INTO streampos.prepared_holds (stream_key, instance_id, min_id) \
             SELECT u.k, u.w, u.m \
             FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int4[]), \
                             pg_catalog.unnest($2::pg_catalog.int4[]), \
                             pg_catalog.unnest($3::pg_catalog.int8[])) AS u(k, w, m)",
            &[keys.into(), writers.into(), ids.into()],
        )
    });
}

/// Forget the records of prepared transactions that committed before the
/// shared horizon `horizon`: every snapshot sees their rows (a snapshot
/// from before a COMMIT PREPARED holds the horizon at or below its xid, and
/// keeps its records). Run by the position worker, as the extension's
/// owner. The rows of transactions still prepared are not visible to it.
pub fn forget_prepared_holds(horizon: pg_sys::TransactionId) {
    if !catalog_table_exists(c"prepared_holds") {
        return;
    }
    as_owner(|| {
        run(
            "DELETE FROM streampos.prepared_holds h \
             WHERE pg_catalog.age(h.xmin) OPERATOR(pg_catalog.>) \
                   pg_catalog.age($1::pg_catalog.text::pg_catalog.xid)",
            &[horizon.into_inner().to_string().into()],
        )
    });
}

/// The stream's marks, of every history: (history, have, ceiling). None in
/// a database not yet updated from 0.2.0 (no `history_marks`: it keeps
/// working with the new library, as before).
pub fn history_marks(stream: &str) -> Vec<(u64, i64, i64)> {
    if !catalog_table_exists(c"history_marks") {
        return Vec::new();
    }
    select_all(
        "SELECT m.history, m.have, m.ceiling FROM streampos.history_marks m \
         WHERE m.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
        |r| {
            Ok(r.get::<i64>(1)?
                .zip(r.get::<i64>(2)?)
                .zip(r.get::<i64>(3)?)
                .map(|((h, have), ceiling)| (h as u64, have, ceiling)))
        },
    )
}

/// Store a stream's mark in history `history`, as the extension's owner;
/// a mark once stored is kept.
pub fn insert_history_mark(history: u64, stream: &str, have: i64, ceiling: i64) {
    as_owner(|| {
        run(
            "INSERT INTO streampos.history_marks (history, stream_name, have, ceiling) \
             VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
            &[
                (history as i64).into(),
                stream.into(),
                have.into(),
                ceiling.into(),
            ],
        )
    });
}

pub fn max_stored_position(stream: &str) -> Option<i64> {
    select_one(
        "SELECT pg_catalog.max(pg_catalog.abs(p.stream_id)) FROM streampos.stream_positions p \
         WHERE p.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
    )
}

fn text_array(values: Option<Vec<String>>) -> DatumWithOid<'static> {
    match values {
        Some(v) => v.into(),
        None => DatumWithOid::null::<Vec<String>>(),
    }
}

pub fn insert_stream(
    stream: &str,
    seq: pg_sys::Oid,
    owns: bool,
    backwards: bool,
    writers: Option<Vec<String>>,
) {
    let args: [DatumWithOid; 5] = [
        stream.into(),
        DatumWithOid::from(seq),
        owns.into(),
        backwards.into(),
        text_array(writers),
    ];
    lock_catalog_for_change();
    as_owner(|| {
        run(
            "INSERT INTO streampos.streams (stream_name, seq, owns_sequence, backwards, writers) \
             VALUES ($1, $2::pg_catalog.oid::pg_catalog.regclass, $3, $4, $5)",
            &args,
        )
    });
}

pub fn delete_stream(stream: &str) {
    lock_catalog_for_change();
    as_owner(|| {
        run(
            "DELETE FROM streampos.streams s WHERE s.stream_name OPERATOR(pg_catalog.=) $1",
            &[stream.into()],
        )
    });
}

pub fn set_stream_writers(stream: &str, writers: Option<Vec<String>>) {
    let args: [DatumWithOid; 2] = [stream.into(), text_array(writers)];
    lock_catalog_for_change();
    as_owner(|| {
        run(
            "UPDATE streampos.streams s SET writers = $2 \
             WHERE s.stream_name OPERATOR(pg_catalog.=) $1",
            &args,
        )
    });
}

/// A removed writer loses its stored position; a new one starts at `front`.
pub fn reset_positions(stream: &str, writers: Vec<String>, front: i64) {
    as_owner(|| {
        run(
            "DELETE FROM streampos.stream_positions p \
             WHERE p.stream_name OPERATOR(pg_catalog.=) $1 \
               AND p.instance_name OPERATOR(pg_catalog.<>) ALL ($2)",
            &[stream.into(), writers.clone().into()],
        );
        run(
            "INSERT INTO streampos.stream_positions (stream_name, instance_name, stream_id) \
             SELECT $1, w.name, $3 FROM pg_catalog.unnest($2::pg_catalog.text[]) AS w(name) \
             ON CONFLICT DO NOTHING",
            &[stream.into(), writers.into(), front.into()],
        );
    });
}

pub fn upsert_stream_table(
    stream: &str,
    tbl: pg_sys::Oid,
    id_column: &str,
    instance_column: Option<&str>,
) {
    as_owner(|| {
        run(
            "INSERT INTO streampos.stream_tables (stream_name, tbl, id_column, instance_column) \
             VALUES ($1, $2::pg_catalog.oid::pg_catalog.regclass, $3, $4) \
             ON CONFLICT (stream_name, tbl) DO UPDATE \
             SET id_column = EXCLUDED.id_column, instance_column = EXCLUDED.instance_column",
            &[
                stream.into(),
                tbl.into(),
                id_column.into(),
                instance_column.into(),
            ],
        )
    });
}

/// Databases that exist (for reclaiming registry state of dropped ones).
pub fn database_oids() -> Vec<pg_sys::Oid> {
    select_all("SELECT d.oid FROM pg_catalog.pg_database d", &[], |r| {
        r.get::<pg_sys::Oid>(1)
    })
}

// ---------------------------------------------------------------- sequences

/// Create the sequence a stream owns, owned by `owner_role` (the role that
/// created the stream); returns its OID.
pub fn create_sequence(name: &str, owner_role: pg_sys::Oid) -> pg_sys::Oid {
    let qualified = format!("streampos.{}", quote_ident(name));
    as_owner(|| {
        run(
            &format!(
                "CREATE SEQUENCE {qualified} AS pg_catalog.int8 \
                 INCREMENT 1 MINVALUE 1 START 1 CACHE 1 NO CYCLE"
            ),
            &[],
        );
        run(
            &format!(
                "ALTER SEQUENCE {qualified} OWNER TO {}",
                role_name(owner_role)
            ),
            &[],
        );
        select_one(
            "SELECT c.oid FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace \
             WHERE n.nspname OPERATOR(pg_catalog.=) 'streampos' \
               AND c.relname OPERATOR(pg_catalog.=) $1",
            &[name.into()],
        )
        .unwrap_or(pg_sys::InvalidOid)
    })
}

/// Drop a sequence a stream owns, if it is still the one in schema
/// streampos that the stream created, with what depends on it: a view or a
/// column default another role made on it (any role may make one, and one
/// would otherwise make `drop_stream` fail), each named in a NOTICE. Run
/// under `with_lock_wait_bound`: such an object locked by another session
/// makes the drop fail (55P03) instead of waiting while the stream's
/// writers queue behind it.
pub fn drop_owned_sequence(seq: pg_sys::Oid, stream: &str) {
    let in_streampos: Option<bool> = select_one(
        "SELECT true FROM pg_catalog.pg_class c \
         JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace \
         WHERE c.oid OPERATOR(pg_catalog.=) $1 AND c.relkind OPERATOR(pg_catalog.=) 'S' \
           AND n.nspname OPERATOR(pg_catalog.=) 'streampos'",
        &[seq.into()],
    );
    if in_streampos.is_some() {
        let name = relation_name(seq);
        let message = format!(
            "could not drop sequence {name} of stream \"{}\": an object that depends on it is locked by another session",
            crate::error::clip(stream)
        );
        let detail = format!(
            "drop_stream waits at most {} ms for a lock, so that the stream's writers do not queue behind it.",
            lock_wait_bound_ms()
        );
        let statement = format!("DROP SEQUENCE {name} CASCADE");
        pgrx::PgTryBuilder::new(|| as_owner(|| run(&statement, &[])))
            .catch_when(pgrx::PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE, |_| {
                Error::LockTimeout {
                    message: message.clone(),
                    detail: detail.clone(),
                }
                .report()
            })
            .execute();
    }
}

/// (INCREMENT, CACHE) of a sequence; None when `oid` is not a sequence.
pub fn sequence_settings(oid: pg_sys::Oid) -> Option<crate::sequence::Settings> {
    with_safe_path(|| {
        spi(Spi::connect(|client| {
            let table = client.select(
                "SELECT q.seqincrement, q.seqcache, q.seqmin, q.seqcycle FROM pg_catalog.pg_sequence q \
                 WHERE q.seqrelid OPERATOR(pg_catalog.=) $1",
                Some(1),
                &[oid.into()],
            )?;
            if table.is_empty() {
                return Ok(None);
            }
            let row = table.first();
            Ok(Some(crate::sequence::Settings {
                increment: row.get::<i64>(1)?.unwrap_or(0),
                cache: row.get::<i64>(2)?.unwrap_or(0),
                min: row.get::<i64>(3)?.unwrap_or(0),
                cycle: row.get::<bool>(4)?.unwrap_or(false),
            }))
        }))
    })
}

/// A relation's persistence: 'p' permanent, 'u' unlogged, 't' temporary.
pub fn relation_persistence(oid: pg_sys::Oid) -> Option<String> {
    select_one(
        "SELECT c.relpersistence::pg_catalog.text FROM pg_catalog.pg_class c \
         WHERE c.oid OPERATOR(pg_catalog.=) $1",
        &[oid.into()],
    )
}

/// Move a sequence to `value` (is_called), with the caller's privileges.
pub fn setval(seq: pg_sys::Oid, value: i64) {
    update_one::<i64>(
        "SELECT pg_catalog.setval($1::pg_catalog.oid::pg_catalog.regclass, $2, true)",
        &[seq.into(), value.into()],
    );
}

// ------------------------------------------------------------- stream tables

/// A table of a stream, with its columns as they are now.
pub struct StreamTable {
    pub oid: pg_sys::Oid,
    /// Quoted, schema-qualified.
    pub name: String,
    pub id_column: String,
    pub instance_column: Option<String>,
    /// Every live column, in order, unquoted.
    pub columns: Vec<String>,
    /// The columns' types, in the same order.
    pub types: Vec<pg_sys::Oid>,
}

/// A registered table that `updates` skips: its OID, what is wrong, and
/// what fixes it.
pub struct Unusable {
    pub oid: pg_sys::Oid,
    pub problem: String,
    /// It was dropped: a repair forgets it.
    pub dropped: bool,
    pub advice: &'static str,
}

fn unusable(oid: pg_sys::Oid, problem: String, advice: &'static str) -> Unusable {
    Unusable {
        oid,
        problem,
        dropped: false,
        advice,
    }
}

/// Every registered table of a stream as it is now: usable, or what is
/// wrong with it. The registrations are read with the caller's snapshot
/// (the catalog cache's rules cover them); each table's definition (kind,
/// columns, types) from the relcache, the latest catalog, which is what
/// relcache invalidations track (a snapshot's older view of a column
/// renamed back and forth must not be cached as current).
fn registered_stream_tables(stream: &str) -> Vec<Result<StreamTable, Unusable>> {
    let registered = select_all(
        "SELECT t.tbl::pg_catalog.oid, t.id_column::pg_catalog.text, t.instance_column::pg_catalog.text \
         FROM streampos.stream_tables t \
         WHERE t.stream_name OPERATOR(pg_catalog.=) $1 \
         ORDER BY 1",
        &[stream.into()],
        |r| {
            Ok(Some((
                r.get::<pg_sys::Oid>(1)?.unwrap_or(pg_sys::InvalidOid),
                r.get::<String>(2)?.unwrap_or_default(),
                r.get::<String>(3)?,
            )))
        },
    );
    registered
        .into_iter()
        .map(|(oid, id_column, instance_column)| {
            let Some((kind, columns, types)) = relation_definition(oid) else {
                return Err(Unusable {
                    oid,
                    problem: "was dropped".into(),
                    dropped: true,
                    advice: "repair => true forgets it",
                });
            };
            let name = relation_name(oid);
            if !is_table_kind(kind) {
                return Err(unusable(
                    oid,
                    format!("{name} is {} now, not a table", relkind_name(kind)),
                    "streampos reads only tables",
                ));
            }
            for column in std::iter::once(&id_column).chain(&instance_column) {
                match columns.iter().position(|c| c == column) {
                    None => {
                        return Err(unusable(
                            oid,
                            format!("{name} has no column {column}"),
                            "add_table() again with the new column names",
                        ))
                    }
                    // updates() compares and casts these columns: only
                    // built-in types, whose casts and operators nobody but
                    // the bootstrap superuser wrote.
                    Some(i) if !built_in_type(types[i]) => {
                        return Err(unusable(
                            oid,
                            format!(
                                "column {column} of {name} is of type {}, not a built-in type",
                                type_name(types[i])
                            ),
                            "streampos compares and casts ID and instance columns only of built-in types",
                        ))
                    }
                    // One table whose ID column no longer compares with
                    // bigint (altered to text) must not stop the stream.
                    Some(i) if *column == id_column && !integer_type(types[i]) => {
                        return Err(unusable(
                            oid,
                            format!(
                                "column {column} of {name} is of type {}, not an integer type",
                                type_name(types[i])
                            ),
                            crate::error::ID_COLUMN_TYPES,
                        ))
                    }
                    Some(_) => {}
                }
            }
            Ok(StreamTable {
                oid,
                name,
                id_column,
                instance_column,
                columns,
                types,
            })
        })
        .collect()
}

/// A relation's kind and live columns (names, types) from the relcache,
/// or None when it does not exist.
fn relation_definition(oid: pg_sys::Oid) -> Option<(u8, Vec<String>, Vec<pg_sys::Oid>)> {
    // SAFETY: RelationIdGetRelation returns NULL for a relation that does
    // not exist (no lock: the definition is read here and copied; the
    // reads that follow lock the table and check it again); the entry is
    // closed before returning.
    unsafe {
        let rel = pg_sys::RelationIdGetRelation(oid);
        if rel.is_null() {
            return None;
        }
        let kind = (*(*rel).rd_rel).relkind as u8;
        let mut columns = Vec::new();
        let mut types = Vec::new();
        // pgrx reads the attributes as each PostgreSQL version lays them out.
        for att in pgrx::PgTupleDesc::from_pg_unchecked((*rel).rd_att).iter() {
            if att.attisdropped {
                continue;
            }
            columns.push(
                CStr::from_ptr(att.attname.data.as_ptr())
                    .to_string_lossy()
                    .into_owned(),
            );
            types.push(att.atttypid);
        }
        pg_sys::RelationClose(rel);
        Some((kind, columns, types))
    }
}

/// The stream's usable tables, by table name.
pub fn stream_tables(stream: &str) -> Vec<StreamTable> {
    let mut tables: Vec<StreamTable> = registered_stream_tables(stream)
        .into_iter()
        .filter_map(Result::ok)
        .collect();
    tables.sort_by(|a, b| a.name.cmp(&b.name));
    tables
}

/// Registered tables of a stream that `stream_tables` skips: dropped,
/// without a registered column, not a table any more, or with an ID or
/// instance column of a type that is not built in.
pub fn unusable_stream_tables(stream: &str) -> Vec<Unusable> {
    registered_stream_tables(stream)
        .into_iter()
        .filter_map(Result::err)
        .collect()
}

/// `check_stream(…, repair => true)`: forget a registered table that was
/// dropped (only one whose OID no longer names a relation).
pub fn forget_dropped_stream_table(stream: &str, tbl: pg_sys::Oid) {
    as_owner(|| {
        run(
            "DELETE FROM streampos.stream_tables t \
             WHERE t.stream_name OPERATOR(pg_catalog.=) $1 \
               AND t.tbl::pg_catalog.oid OPERATOR(pg_catalog.=) $2 \
               AND NOT EXISTS (SELECT FROM pg_catalog.pg_class c \
                               WHERE c.oid OPERATOR(pg_catalog.=) $2)",
            &[stream.into(), tbl.into()],
        )
    });
}

/// The highest ID (internal numbering) in one table of a stream, with the
/// caller's snapshot, read as the table's owner (`read_as_owner`).
pub fn table_max_id(table: &StreamTable, backwards: bool) -> Option<i64> {
    let id = quote_ident(&table.id_column);
    let agg = if backwards {
        format!("OPERATOR(pg_catalog.-) pg_catalog.min(t.{id})::pg_catalog.int8")
    } else {
        format!("pg_catalog.max(t.{id})::pg_catalog.int8")
    };
    read_as_owner(table.oid, &[&table.id_column], |name| {
        select_one(&format!("SELECT {agg} FROM {name} t"), &[])
    })
    .flatten()
}

/// The highest ID at most `ceiling` in one table of a forward stream, with
/// the caller's snapshot, read as the table's owner (`read_as_owner`).
pub fn table_max_id_at_most(table: &StreamTable, ceiling: i64, backwards: bool) -> Option<i64> {
    let id = quote_ident(&table.id_column);
    // Internal numbering counts up for backward streams too: their rows
    // carry -1, -2, ...
    let query = |name: &str| {
        if backwards {
            format!(
                "SELECT (OPERATOR(pg_catalog.-) pg_catalog.min(t.{id}))::pg_catalog.int8 FROM {name} t \
                 WHERE t.{id} OPERATOR(pg_catalog.>=) OPERATOR(pg_catalog.-) $1"
            )
        } else {
            format!(
                "SELECT pg_catalog.max(t.{id})::pg_catalog.int8 FROM {name} t \
                 WHERE t.{id} OPERATOR(pg_catalog.<=) $1"
            )
        }
    };
    read_as_owner_for_extension(table.oid, |name| {
        select_one(&query(name), &[ceiling.into()])
    })
    .flatten()
}

/// A read of `rel` the extension needs for itself, whoever calls (the
/// highest ID a promoted server has, when a stream is first used in a
/// history that may lack another's): as the owner in a security-restricted
/// operation, like `read_as_owner`, but without the caller's privileges
/// (the caller gets nothing of the rows; a reader must not fail because it
/// happened to be the first to use the stream). A relation that is gone,
/// or no longer a table, is not read.
fn read_as_owner_for_extension<T>(rel: pg_sys::Oid, f: impl FnOnce(&str) -> T) -> Option<T> {
    // SAFETY: as in `read_as_owner`.
    let (owner, kind) = unsafe {
        let r = pg_sys::try_relation_open(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        if r.is_null() {
            return None;
        }
        let form = &*(*r).rd_rel;
        let facts = (form.relowner, form.relkind as u8);
        pg_sys::relation_close(r, pg_sys::NoLock as pg_sys::LOCKMODE);
        facts
    };
    if !is_table_kind(kind) {
        return None;
    }
    let name = relation_name(rel);
    Some(read_as_role(owner, || f(&name)))
}

/// Refuse (before a follower waits) a caller that `updates` would refuse
/// when it reads the stream's tables (see `read_as_owner`); without taking
/// their locks, which a sleeping follower would otherwise hold.
pub fn check_may_follow(tables: &[StreamTable]) {
    for table in tables {
        let columns: Vec<&str> = table.columns.iter().map(String::as_str).collect();
        check_caller_may_read(table.oid, &columns);
    }
}

/// The FROM and WHERE of `updates`' reads of one table: rows with
/// $1 < id <= $2 whose writer (the instance column) is in range between the
/// multi-writer tokens $3 (exclusive) and $4 (inclusive). Rows with
/// $6 < id <= $7 are in range whoever wrote them: for those neither the
/// writer's id is looked up nor the tokens compared (an OR's arms run in
/// order), and the tokens are read from text once per statement (initplans).
fn rows_in_range(table: &StreamTable, name: &str) -> String {
    let id = quote_ident(&table.id_column);
    let instance = match &table.instance_column {
        Some(column) => format!(
            "(SELECT i.instance_id FROM streampos.instances i \
              WHERE i.instance_name OPERATOR(pg_catalog.=) t.{}::pg_catalog.text)",
            quote_ident(column)
        ),
        None => "NULL::pg_catalog.int4".to_string(),
    };
    format!(
        "FROM {tbl} t \
         WHERE t.{id} OPERATOR(pg_catalog.>) $1 AND t.{id} OPERATOR(pg_catalog.<=) $2 \
           AND ((t.{id} OPERATOR(pg_catalog.>) $6 AND t.{id} OPERATOR(pg_catalog.<=) $7) \
                OR streampos.in_range((SELECT $3::streampos.multi_writer_token), \
                                      (SELECT $4::streampos.multi_writer_token), \
                                      {instance}, t.{id}::pg_catalog.int8))",
        tbl = name,
    )
}

/// The rows `updates` reads: low < id <= high, and each row's writer in
/// range between the multi-writer tokens `since` (exclusive) and `until`.
pub struct RowRange<'a> {
    pub low: i64,
    pub high: i64,
    pub since: &'a str,
    pub until: &'a str,
    pub every_writer_above: i64,
    pub every_writer_up_to: i64,
}

impl RowRange<'_> {
    /// The arguments $1 to $4 of `rows_in_range` ($5 is the limit; $6 and
    /// $7 follow it).
    fn args(&self) -> Vec<DatumWithOid<'static>> {
        vec![
            self.low.into(),
            self.high.into(),
            self.since.to_string().into(),
            self.until.to_string().into(),
        ]
    }
}

// Statements prepared once and kept (a follower calls `updates` again and
// again, a consumer `ack`: parsing and planning were most of a call's
// cost), by their text, which names the relation and its columns, and by
// the relation's OID (a schema renamed leaves the text of another relation
// the same; InvalidOid for the extension's own statements, whose text is
// fixed). PostgreSQL replans a kept statement when what it depends on
// changes, analysing it again with the search path current when it runs
// (always the pinned one: they run inside `with_safe_path`); a relcache
// invalidation drops the statements of stream tables (`relations_changed`),
// as a relation renamed, altered or given to another owner changes the
// text or the role it is run as.
thread_local! {
    static KEPT: std::cell::RefCell<crate::fast_hash::FastMap<(pg_sys::Oid, String), std::rc::Rc<KeptPlan>>> =
        std::cell::RefCell::new(crate::fast_hash::FastMap::default());
    /// Set by the relcache callback, which must not free anything itself.
    static KEPT_STALE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// At most this many statements are kept per session.
const MAX_KEPT: usize = 256;

/// A relation changed (relcache invalidation; InvalidOid: any): kept
/// statements are dropped at their next use, and names and statement texts
/// made before are not used again. Safe from any callback.
pub fn relations_changed() {
    KEPT_STALE.with(|s| s.set(true));
    RELATIONS_GENERATION.with(|g| g.set(g.get().wrapping_add(1)));
}

thread_local! {
    /// Moves at every relcache invalidation and schema change (see
    /// `relations_changed`): what was derived from a relation's name or
    /// columns under an earlier value is derived again.
    static RELATIONS_GENERATION: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// `relation_name` of each relation, as of a generation.
    static RELATION_NAMES: std::cell::RefCell<crate::fast_hash::FastMap<pg_sys::Oid, (u64, std::rc::Rc<str>)>> =
        std::cell::RefCell::new(crate::fast_hash::FastMap::default());
    /// `update_rows`' statement text per (table, simple form, bigint as
    /// text), as of a generation and for the columns it was built from.
    static ROW_STATEMENTS: std::cell::RefCell<crate::fast_hash::FastMap<(pg_sys::Oid, bool, bool), RowStatement>> =
        std::cell::RefCell::new(crate::fast_hash::FastMap::default());
}

/// A statement text of `update_rows` and what it was built from.
struct RowStatement {
    generation: u64,
    name: std::rc::Rc<str>,
    id_column: String,
    instance_column: Option<String>,
    columns: Vec<String>,
    types: Vec<pg_sys::Oid>,
    query: std::rc::Rc<str>,
}

fn relations_generation() -> u64 {
    RELATIONS_GENERATION.with(|g| g.get())
}

/// The statement kept for (`rel`, `query`) (see `KEPT`), prepared in this
/// SPI connection the first time.
fn kept_plan(rel: pg_sys::Oid, query: &str, types: &[PgOid]) -> std::rc::Rc<KeptPlan> {
    if KEPT_STALE.with(|s| s.replace(false)) {
        KEPT.with(|k| {
            k.borrow_mut()
                .retain(|(rel, _), _| *rel == pg_sys::InvalidOid)
        });
    }
    let key = (rel, query.to_string());
    if let Some(plan) = KEPT.with(|k| k.borrow().get(&key).cloned()) {
        return plan;
    }
    let plan = std::rc::Rc::new(KeptPlan::prepare(query, types));
    KEPT.with(|k| {
        let mut kept = k.borrow_mut();
        // Bounded: a session following many tables (or tables renamed
        // again and again) starts over.
        if kept.len() >= MAX_KEPT {
            kept.clear();
        }
        kept.insert(key, plan.clone())
    });
    plan
}

/// A statement prepared with a generic plan (CURSOR_OPT_GENERIC_PLAN):
/// PostgreSQL's plan cache otherwise keeps choosing a custom plan for a
/// follower's parameters, planning the statement again on almost every call
/// (51 plans in 50 calls of `updates()`), which was most of a call's cost;
/// the option, unlike `plan_cache_mode`, costs nothing per call. The
/// statements are range and key lookups whose plan does not depend on the
/// values. Kept (SPI_keepplan) until dropped.
struct KeptPlan(std::ptr::NonNull<pg_sys::_SPI_plan>);

impl KeptPlan {
    /// Prepare in the current SPI connection; a statement PostgreSQL
    /// refuses is its ERROR.
    fn prepare(query: &str, types: &[PgOid]) -> KeptPlan {
        let Ok(text) = CString::new(query) else {
            Error::Internal("a statement with a NUL byte".into()).report()
        };
        let mut oids: Vec<pg_sys::Oid> = types.iter().map(|t| t.value()).collect();
        // SAFETY: inside an SPI connection; the text and the types outlive
        // the call; a parse or analysis error is raised as an ERROR, and a
        // NULL plan (an SPI misuse) is reported below.
        let plan = unsafe {
            let plan = pg_sys::SPI_prepare_cursor(
                text.as_ptr(),
                oids.len() as i32,
                oids.as_mut_ptr(),
                pg_sys::CURSOR_OPT_GENERIC_PLAN as i32,
            );
            if !plan.is_null() {
                pg_sys::SPI_keepplan(plan);
            }
            plan
        };
        match std::ptr::NonNull::new(plan) {
            Some(plan) => KeptPlan(plan),
            // SAFETY: reads SPI's result code of the failed call.
            None => Error::Internal(format!("SPI_prepare_cursor failed: {}", unsafe {
                pg_sys::SPI_result
            }))
            .report(),
        }
    }

    /// Run in the current SPI connection; the number of rows it returned
    /// (in SPI_tuptable). Read-only as pgrx runs a prepared statement: a
    /// statement that writes, or one in a transaction that has written,
    /// takes a new snapshot.
    fn run(&self, args: &[DatumWithOid], mutating: bool) -> usize {
        let (mut values, nulls): (Vec<pg_sys::Datum>, Vec<std::ffi::c_char>) = args
            .iter()
            .map(|a| match a.datum() {
                Some(d) => (d.sans_lifetime(), b' ' as std::ffi::c_char),
                None => (pg_sys::Datum::from(0usize), b'n' as std::ffi::c_char),
            })
            .unzip();
        // SAFETY: the plan is kept (valid until dropped) and takes exactly
        // these arguments (its callers pass the types it was prepared
        // with); errors are raised as ERRORs.
        unsafe {
            let read_only =
                !mutating && pg_sys::GetCurrentTransactionIdIfAny() == pg_sys::InvalidTransactionId;
            pg_sys::SPI_tuptable = std::ptr::null_mut();
            let status = pg_sys::SPI_execute_plan(
                self.0.as_ptr(),
                values.as_mut_ptr(),
                nulls.as_ptr(),
                read_only,
                0,
            );
            if status < 0 {
                Error::Internal(format!("SPI_execute_plan failed: {status}")).report()
            }
            pg_sys::SPI_processed as usize
        }
    }
}

impl Drop for KeptPlan {
    fn drop(&mut self) {
        // SAFETY: a plan SPI_keepplan kept, freed once.
        unsafe { pg_sys::SPI_freeplan(self.0.as_ptr()) };
    }
}

/// The rows the statement just run in this SPI connection returned, each
/// converted by `row` from its tuple and the result's descriptor.
fn collect_rows<T>(
    count: usize,
    mut row: impl FnMut(pg_sys::HeapTuple, pg_sys::TupleDesc) -> Option<T>,
) -> Vec<T> {
    let mut out = Vec::with_capacity(count);
    // SAFETY: the statement just ran in this SPI connection: its tuple
    // table has `count` tuples and a descriptor, valid until SPI finishes;
    // `row` copies out what it keeps.
    unsafe {
        let table = pg_sys::SPI_tuptable;
        if !table.is_null() {
            for k in 0..count {
                if let Some(v) = row(*(*table).vals.add(k), (*table).tupdesc) {
                    out.push(v);
                }
            }
        }
    }
    out
}

/// Every row of a read-only statement kept for later calls (see `KEPT`),
/// each converted by `row` from the result's tuple and descriptor.
fn kept_select<T>(
    rel: pg_sys::Oid,
    query: &str,
    types: &[PgOid],
    args: &[DatumWithOid],
    row: impl FnMut(pg_sys::HeapTuple, pg_sys::TupleDesc) -> Option<T>,
) -> Vec<T> {
    // Run with the pinned search path too: a kept statement is analysed
    // again with the path current when it runs.
    with_safe_path(|| {
        spi(Spi::connect(|_client| {
            let count = kept_plan(rel, query, types).run(args, false);
            Ok(collect_rows(count, row))
        }))
    })
}

/// As `kept_select`, for a statement that writes (with RETURNING).
fn kept_update<T>(
    query: &str,
    types: &[PgOid],
    args: &[DatumWithOid],
    row: impl FnMut(pg_sys::HeapTuple, pg_sys::TupleDesc) -> Option<T>,
) -> Vec<T> {
    with_safe_path(|| {
        spi(Spi::connect_mut(|_client| {
            let count = kept_plan(pg_sys::InvalidOid, query, types).run(args, true);
            Ok(collect_rows(count, row))
        }))
    })
}

/// Column `column` (from 1) of an SPI result's tuple.
///
/// # Safety
/// `tuple` and `desc` are a row of the current SPI result and its
/// descriptor, and the column's type is `T`'s.
unsafe fn column<T: FromDatum>(
    tuple: pg_sys::HeapTuple,
    desc: pg_sys::TupleDesc,
    column: i32,
) -> Option<T> {
    let mut null = false;
    // SAFETY: as the caller promises.
    unsafe { T::from_datum(pg_sys::SPI_getbinval(tuple, desc, column, &mut null), null) }
}

/// One row of `updates`' answer: its ID and the row as a jsonb datum in
/// the caller's memory context.
pub struct UpdateRow {
    pub id: i64,
    json: pg_sys::Datum,
}

/// The first `limit` (None: all) rows of one table that `updates` returns,
/// in ID order, read with the active snapshot as the table's owner
/// (`read_as_owner`); None for a table dropped since the list was read.
pub fn update_rows(
    table: &StreamTable,
    range: &RowRange,
    limit: Option<i64>,
) -> Option<Vec<UpdateRow>> {
    // Every writer at one position in `since`, and in `until`: the rows in
    // range are those with low < id <= high, whoever wrote them (no token
    // in the statement). Else each row's writer is looked up and compared.
    let simple = range.low == range.every_writer_above && range.high == range.every_writer_up_to;
    let limit = match limit {
        Some(n) => n.into(),
        None => DatumWithOid::null::<i64>(),
    };
    const INT8: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT8OID);
    let (args, types) = if simple {
        (
            vec![range.low.into(), range.high.into(), limit],
            vec![INT8, INT8, INT8],
        )
    } else {
        let mut args = range.args();
        args.extend([
            limit,
            range.every_writer_above.into(),
            range.every_writer_up_to.into(),
        ]);
        (args, vec![INT8, INT8, TEXT, TEXT, INT8, INT8, INT8])
    };
    let columns: Vec<&str> = table.columns.iter().map(String::as_str).collect();
    // Every relation the statement reads is locked before the table's name
    // is looked up (read_as_owner locks the table, then takes in pending
    // invalidations): a kept statement checked again while it runs then
    // takes no new lock, so no invalidation (a schema renamed) is taken in
    // between, and its text, if analysed again, names the table checked.
    if !simple {
        lock_instances_table();
    }
    read_as_owner(table.oid, &columns, |name| {
        let query = row_statement(table, name, simple);
        kept_select(table.oid, &query, &types, &args, |tuple, desc| {
            // SAFETY: a tuple of this statement's result, of two columns
            // (int8, jsonb); the jsonb value is copied into the upper (the
            // function's) memory context before SPI frees its own.
            unsafe {
                let mut null = false;
                let id = pg_sys::SPI_getbinval(tuple, desc, 1, &mut null);
                if null {
                    return None;
                }
                let json = pg_sys::SPI_getbinval(tuple, desc, 2, &mut null);
                (!null).then(|| UpdateRow {
                    id: id.value() as i64,
                    json: pg_sys::SPI_datumTransfer(json, false, -1),
                })
            }
        })
    })
}

/// `update_rows`' statement for `table` named `name` (`simple`: without
/// the writers' positions; see there), built once per table until a
/// relation or a schema changes (`relations_changed`) or its columns do.
fn row_statement(table: &StreamTable, name: &str, simple: bool) -> std::rc::Rc<str> {
    let generation = relations_generation();
    let as_text = crate::guc::JSON_BIGINT_AS_STRING.get();
    let key = (table.oid, simple, as_text);
    let kept = ROW_STATEMENTS.with(|r| {
        r.borrow().get(&key).and_then(|s| {
            (s.generation == generation
                && &*s.name == name
                && s.id_column == table.id_column
                && s.instance_column == table.instance_column
                && s.columns == table.columns
                && s.types == table.types)
                .then(|| s.query.clone())
        })
    });
    if let Some(query) = kept {
        return query;
    }
    let id = quote_ident(&table.id_column);
    let row = row_json(table);
    let query: std::rc::Rc<str> = if simple {
        format!(
            "SELECT t.{id}::pg_catalog.int8, {row} FROM {name} t \
             WHERE t.{id} OPERATOR(pg_catalog.>) $1 AND t.{id} OPERATOR(pg_catalog.<=) $2 \
             ORDER BY t.{id} LIMIT $3"
        )
    } else {
        format!(
            "SELECT t.{id}::pg_catalog.int8, {row} {} ORDER BY t.{id} LIMIT $5",
            rows_in_range(table, name)
        )
    }
    .into();
    ROW_STATEMENTS.with(|r| {
        let mut statements = r.borrow_mut();
        if statements.len() >= MAX_KEPT {
            statements.clear();
        }
        statements.insert(
            key,
            RowStatement {
                generation,
                name: name.into(),
                id_column: table.id_column.clone(),
                instance_column: table.instance_column.clone(),
                columns: table.columns.clone(),
                types: table.types.clone(),
                query: query.clone(),
            },
        );
    });
    query
}

/// Lock `streampos.instances` for reading (what `update_rows`' statements
/// join), for the rest of the transaction.
fn lock_instances_table() {
    // SAFETY: syscache lookups (InvalidOid when missing), then a lock as
    // any read takes.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"streampos".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            return;
        }
        let rel = pg_sys::get_relname_relid(c"instances".as_ptr(), nsp);
        if rel != pg_sys::InvalidOid {
            pg_sys::LockRelationOid(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        }
    }
}

/// A table's row as the JSON array `updates` returns (see `json_column`).
fn row_json(table: &StreamTable) -> String {
    // jsonb_build_array takes at most 100 arguments (a table may have up
    // to 1600 columns): concatenate arrays of 100.
    let columns: Vec<(&String, &pg_sys::Oid)> = table.columns.iter().zip(&table.types).collect();
    columns
        .chunks(100)
        .map(|chunk| {
            let values = chunk
                .iter()
                .map(|(c, t)| json_column(c, **t))
                .collect::<Vec<_>>()
                .join(", ");
            format!("pg_catalog.jsonb_build_array({values})")
        })
        .collect::<Vec<_>>()
        .join(" OPERATOR(pg_catalog.||) ")
}

/// Is `type_oid` bigint (Some(false)) or an array of bigint (Some(true)),
/// looking through domains?
fn bigint_kind(type_oid: pg_sys::Oid) -> Option<bool> {
    // SAFETY: syscache lookups; a missing type is InvalidOid, no error.
    unsafe {
        let base = pg_sys::getBaseType(type_oid);
        if base == pg_sys::INT8OID {
            return Some(false);
        }
        let element = pg_sys::get_element_type(base);
        (element != pg_sys::InvalidOid && pg_sys::getBaseType(element) == pg_sys::INT8OID)
            .then_some(true)
    }
}

/// One column of a row of `updates`' answer as a JSON value. A column of a
/// built-in type (`built_in_type`) is what `jsonb_build_array` makes of it;
/// any other is the text of the type's output function (through `format`,
/// which calls it directly: a cast to text is code the type's owner may
/// have written, and so is a cast to json, which to_jsonb would look up), or
/// null. A bigint is a JSON string with `streampos.json_bigint_as_string`.
fn json_column(column: &str, type_oid: pg_sys::Oid) -> String {
    let c = quote_ident(column);
    let as_string = crate::guc::JSON_BIGINT_AS_STRING.get();
    if as_string && bigint_kind(type_oid) == Some(false) {
        // Exact for clients whose numbers are doubles (the statement's text
        // differs: a statement kept of its own). A domain's cast is its base
        // type's: PostgreSQL looks up no cast of a domain.
        format!("t.{c}::pg_catalog.text")
    } else if as_string && bigint_kind(type_oid) == Some(true) {
        // An array of them: an array of strings, dimensions kept.
        format!("t.{c}::pg_catalog.text[]")
    } else if built_in_type(type_oid) {
        format!("t.{c}")
    } else {
        format!(
            "CASE WHEN pg_catalog.num_nulls(t.{c}) OPERATOR(pg_catalog.=) 1 THEN NULL::pg_catalog.text \
             ELSE pg_catalog.format('%s'::pg_catalog.text, t.{c}) END"
        )
    }
}

/// The `updates` answer:
/// `{"token": …, "limited": …, "data": [[header], row, …, [header], row, …]}`
/// with, for each table (skipped when `None`: dropped), `[table_name,
/// position, row_count, column_count, column_name, …]` and then its rows,
/// oldest first. Built as jsonb directly in PostgreSQL's memory (rows can
/// be large: an answer beyond what PostgreSQL can hold is its ERROR, never
/// an abort), each row's jsonb copied in by jsonb's own iterator: no text
/// printed and parsed again.
pub fn updates_answer(
    tables: &[StreamTable],
    rows: &[Option<Vec<UpdateRow>>],
    token: &str,
    position: i64,
    limited: bool,
) -> pg_sys::Datum {
    let mut answer = JsonbBuilder::new();
    answer.push(pg_sys::JsonbIteratorToken::WJB_BEGIN_OBJECT, None);
    answer.key("token");
    answer.string(pg_sys::JsonbIteratorToken::WJB_VALUE, token);
    answer.key("limited");
    answer.boolean(limited);
    answer.key("data");
    answer.push(pg_sys::JsonbIteratorToken::WJB_BEGIN_ARRAY, None);
    let elem = pg_sys::JsonbIteratorToken::WJB_ELEM;
    for (table, rows) in tables.iter().zip(rows) {
        let Some(rows) = rows else { continue };
        answer.push(pg_sys::JsonbIteratorToken::WJB_BEGIN_ARRAY, None);
        answer.string(elem, &table.name);
        if crate::guc::JSON_BIGINT_AS_STRING.get() {
            answer.string(elem, &position.to_string());
        } else {
            answer.number(position);
        }
        answer.number(rows.len() as i64);
        answer.number(table.columns.len() as i64);
        for column in &table.columns {
            answer.string(elem, column);
        }
        answer.push(pg_sys::JsonbIteratorToken::WJB_END_ARRAY, None);
        for row in rows {
            answer.jsonb(row.json);
        }
    }
    answer.push(pg_sys::JsonbIteratorToken::WJB_END_ARRAY, None);
    answer.finish()
}

/// A jsonb value built with PostgreSQL's `pushJsonbValue`, in the current
/// memory context (as `jsonb_build_object` and `jsonb_agg` build theirs).
struct JsonbBuilder {
    state: *mut pg_sys::JsonbParseState,
    last: *mut pg_sys::JsonbValue,
}

impl JsonbBuilder {
    fn new() -> Self {
        JsonbBuilder {
            state: std::ptr::null_mut(),
            last: std::ptr::null_mut(),
        }
    }

    fn push(
        &mut self,
        token: pg_sys::JsonbIteratorToken::Type,
        value: Option<&mut pg_sys::JsonbValue>,
    ) {
        let value = value.map_or(std::ptr::null_mut(), |v| v as *mut _);
        // SAFETY: the parse state is PostgreSQL's, started by the first
        // push (BEGIN_OBJECT) and used only through pushJsonbValue; every
        // value pushed is valid for the call (scalars are copied, binary
        // containers unpacked).
        self.last = unsafe { pg_sys::pushJsonbValue(&mut self.state, token, value) };
    }

    fn scalar(&mut self, token: pg_sys::JsonbIteratorToken::Type, mut value: pg_sys::JsonbValue) {
        self.push(token, Some(&mut value));
    }

    fn string(&mut self, token: pg_sys::JsonbIteratorToken::Type, text: &str) {
        // SAFETY: a zeroed JsonbValue is a valid bit pattern (plain data);
        // the string is copied into PostgreSQL's memory (pnstrdup) since
        // the value must outlive this call (pushJsonbValue keeps the
        // pointer until the jsonb is serialised).
        let value = unsafe {
            let mut v: pg_sys::JsonbValue = std::mem::zeroed();
            v.type_ = pg_sys::jbvType::jbvString;
            v.val.string.len = text.len() as i32;
            v.val.string.val = pg_sys::pnstrdup(text.as_ptr().cast(), text.len());
            v
        };
        self.scalar(token, value);
    }

    fn key(&mut self, key: &str) {
        self.string(pg_sys::JsonbIteratorToken::WJB_KEY, key);
    }

    fn number(&mut self, n: i64) {
        // SAFETY: as in `string`; int64_to_numeric returns a palloc'd
        // numeric.
        let value = unsafe {
            let mut v: pg_sys::JsonbValue = std::mem::zeroed();
            v.type_ = pg_sys::jbvType::jbvNumeric;
            v.val.numeric = pg_sys::int64_to_numeric(n);
            v
        };
        self.scalar(pg_sys::JsonbIteratorToken::WJB_ELEM, value);
    }

    fn boolean(&mut self, b: bool) {
        // SAFETY: as in `string`.
        let value = unsafe {
            let mut v: pg_sys::JsonbValue = std::mem::zeroed();
            v.type_ = pg_sys::jbvType::jbvBool;
            v.val.boolean = b;
            v
        };
        self.scalar(pg_sys::JsonbIteratorToken::WJB_VALUE, value);
    }

    /// An element that is a jsonb datum (an array: a row).
    fn jsonb(&mut self, datum: pg_sys::Datum) {
        // SAFETY: `datum` is a jsonb varlena in this memory context;
        // detoasting gives its 4-byte-header form, whose root container
        // pushJsonbValue unpacks with jsonb's iterator.
        let value = unsafe {
            let jb = pg_sys::pg_detoast_datum(datum.cast_mut_ptr()) as *mut pg_sys::Jsonb;
            let mut v: pg_sys::JsonbValue = std::mem::zeroed();
            v.type_ = pg_sys::jbvType::jbvBinary;
            v.val.binary.data = &mut (*jb).root;
            v.val.binary.len =
                (pgrx::varsize(jb as *const pg_sys::varlena) - pg_sys::VARHDRSZ) as i32;
            v
        };
        self.scalar(pg_sys::JsonbIteratorToken::WJB_ELEM, value);
    }

    /// The jsonb datum (after the outermost END_OBJECT).
    fn finish(mut self) -> pg_sys::Datum {
        self.push(pg_sys::JsonbIteratorToken::WJB_END_OBJECT, None);
        // SAFETY: `last` is the complete value pushJsonbValue returned for
        // the closing token.
        unsafe { pg_sys::Datum::from(pg_sys::JsonbValueToJsonb(self.last)) }
    }
}

// ------------------------------------------------------------ position worker

pub fn extension_present() -> bool {
    select_one::<bool>(
        "SELECT true FROM pg_catalog.pg_extension e \
         WHERE e.extname OPERATOR(pg_catalog.=) 'streampos'",
        &[],
    )
    .is_some()
}

/// The catalog tables a pass of the position worker reads or writes,
/// locked at its start in this order, each only if granted at once
/// (`ConditionalLockRelationOid`, the lock `LOCK TABLE … NOWAIT` takes):
/// `streams` ROW SHARE (its rows are share-locked), `instances` ACCESS
/// SHARE, `stream_positions`, `stream_frontiers` and `frontier_marks` ROW
/// EXCLUSIVE. None
/// when one is not granted (an operator's command holds or waits for it:
/// the pass is put off) or is gone (the extension is being dropped). The
/// worker then never waits for an operator's command while holding a lock
/// that command needs (see docs/design.md, "The position worker's locks").
pub struct PassTables {
    /// `stream_frontiers` exists (a database not yet updated from 0.2.0
    /// has none).
    pub frontiers: bool,
    /// `frontier_marks` (and consumers) exist: 0.3.0's catalog.
    pub marks: bool,
}

pub fn lock_for_pass() -> Option<PassTables> {
    const TABLES: [(&CStr, u32, bool); 5] = [
        (c"streams", pg_sys::RowShareLock, true),
        (c"instances", pg_sys::AccessShareLock, true),
        (c"stream_positions", pg_sys::RowExclusiveLock, true),
        (c"stream_frontiers", pg_sys::RowExclusiveLock, false),
        (c"frontier_marks", pg_sys::RowExclusiveLock, false),
    ];
    // SAFETY: catalog lookups that return InvalidOid for what does not
    // exist; a conditional lock raises no error (it returns false); the
    // locks are released at the end of the pass's transaction.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"streampos".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            return None;
        }
        let mut present = [false; TABLES.len()];
        for (k, (name, mode, required)) in TABLES.into_iter().enumerate() {
            let oid = pg_sys::get_relname_relid(name.as_ptr(), nsp);
            if oid == pg_sys::InvalidOid {
                if required {
                    return None;
                }
                continue;
            }
            if !pg_sys::ConditionalLockRelationOid(oid, mode as pg_sys::LOCKMODE) {
                return None;
            }
            // Dropped between the lookup and the lock (the lock took in
            // the invalidations of the drop's commit).
            if pg_sys::get_rel_name(oid).is_null() {
                return None;
            }
            present[k] = true;
        }
        Some(PassTables {
            frontiers: present[3],
            marks: present[4],
        })
    }
}

/// Store one stream's positions and, with `frontier`, its frontier (the
/// same a reader in this snapshot gets: one statement, one snapshot, so
/// the frontier is never above a position stored with it). Run by the
/// position worker, its tables locked (`lock_for_pass`). The stream's row
/// is share-locked first, NOWAIT (55P03: the worker tries again next pass):
/// a `set_writers` in progress (which deletes removed writers' positions)
/// is not overtaken, and the positions, read by the next statement's
/// snapshot, follow its writer list (never bringing a removed writer
/// back). Neither ever moves back. False when the stream is gone (dropped
/// since the pass began).
pub fn store_positions(stream: &str, frontier: bool) -> bool {
    let locked = update_one::<bool>(
        "SELECT true FROM streampos.streams s WHERE s.stream_name OPERATOR(pg_catalog.=) $1 \
         FOR SHARE NOWAIT",
        &[stream.into()],
    );
    if locked.is_none() {
        return false;
    }
    const POSITIONS: &str =
        "INSERT INTO streampos.stream_positions (stream_name, instance_name, stream_id) \
           SELECT $1, w.instance_name, w.stream_id FROM streampos.writer_positions($1) w \
           ON CONFLICT (stream_name, instance_name) DO UPDATE \
           SET stream_id = EXCLUDED.stream_id \
           WHERE pg_catalog.abs(EXCLUDED.stream_id) OPERATOR(pg_catalog.>) \
                 pg_catalog.abs(streampos.stream_positions.stream_id)";
    if !frontier {
        // 0.2.0's catalog, until ALTER EXTENSION streampos UPDATE.
        run(POSITIONS, &[stream.into()]);
        return true;
    }
    run(
        &format!(
            "WITH p AS ({POSITIONS}) \
             INSERT INTO streampos.stream_frontiers (stream_name, stream_id) \
             VALUES ($1, streampos.frontier($1)) \
             ON CONFLICT (stream_name) DO UPDATE SET stream_id = EXCLUDED.stream_id \
             WHERE pg_catalog.abs(EXCLUDED.stream_id) OPERATOR(pg_catalog.>) \
                   pg_catalog.abs(streampos.stream_frontiers.stream_id)"
        ),
        &[stream.into()],
    );
    true
}

/// Mark the stream's current token `token` (as the position worker's pass
/// computed it) as passed now, if the stream has consumers (their lag in
/// time, the view `consumers`); and let go of marks no consumer needs:
/// every mark once the stream has no consumers, marks every consumer has
/// acknowledged, and, past an hour's age, all but the latest mark of each
/// minute (past a day's, of each hour). A consumer's lag is counted from
/// its first mark not acknowledged; keeping the latest of a bucket keeps
/// that an underestimate by less than the bucket. Run by the position
/// worker, `frontier_marks` locked (`lock_for_pass`). Whether it marked
/// (false: the stream has no consumers); None, doing nothing, when
/// `consumer_positions` is not granted to it at once (an operator's
/// command holds it: the worker marks a second later).
pub fn mark_frontier(stream: &str, token: &str) -> Option<bool> {
    // SAFETY: catalog lookups that return InvalidOid for what does not
    // exist; a conditional lock raises no error; it is released at the
    // end of the pass's transaction.
    let locked = unsafe {
        let nsp = pg_sys::get_namespace_oid(c"streampos".as_ptr(), true);
        let rel = if nsp == pg_sys::InvalidOid {
            pg_sys::InvalidOid
        } else {
            pg_sys::get_relname_relid(c"consumer_positions".as_ptr(), nsp)
        };
        rel != pg_sys::InvalidOid
            && pg_sys::ConditionalLockRelationOid(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE)
    };
    if !locked {
        return None;
    }
    // `safe` once for the statement (MATERIALIZED): as a joined subquery
    // the planner called safe_to_delete() for every mark. Only for a
    // stream this statement sees (NULL for one dropped since the pass
    // began: safe_to_delete() would raise 42704).
    let marked = update_one::<i64>(
        "WITH safe AS MATERIALIZED ( \
           SELECT (SELECT streampos.safe_to_delete(s.stream_name) FROM streampos.streams s \
                   WHERE s.stream_name OPERATOR(pg_catalog.=) $1) AS safe), \
         marked AS ( \
           INSERT INTO streampos.frontier_marks (stream_name, marked_at, position) \
           SELECT $1, pg_catalog.clock_timestamp(), \
                  $2::pg_catalog.text::streampos.multi_writer_token \
           WHERE EXISTS (SELECT FROM streampos.consumer_positions c \
                         WHERE c.stream_name OPERATOR(pg_catalog.=) $1) \
           ON CONFLICT DO NOTHING \
           RETURNING true), \
         pruned AS ( \
           DELETE FROM streampos.frontier_marks m USING safe k \
           WHERE m.stream_name OPERATOR(pg_catalog.=) $1 \
             AND (k.safe IS NULL \
                  OR streampos.is_before_or_eq(m.position, k.safe) \
                  OR EXISTS ( \
                    SELECT FROM (SELECT CASE \
                        WHEN m.marked_at OPERATOR(pg_catalog.<) \
                             (pg_catalog.now() OPERATOR(pg_catalog.-) '1 day'::pg_catalog.interval) \
                          THEN 'hour' \
                        WHEN m.marked_at OPERATOR(pg_catalog.<) \
                             (pg_catalog.now() OPERATOR(pg_catalog.-) '1 hour'::pg_catalog.interval) \
                          THEN 'minute' END AS unit) b, \
                      streampos.frontier_marks n \
                    WHERE n.stream_name OPERATOR(pg_catalog.=) m.stream_name \
                      AND n.marked_at OPERATOR(pg_catalog.>) m.marked_at \
                      AND n.marked_at OPERATOR(pg_catalog.<) \
                          (pg_catalog.date_trunc(b.unit, m.marked_at) OPERATOR(pg_catalog.+) \
                           ('1 ' OPERATOR(pg_catalog.||) b.unit)::pg_catalog.interval))) \
           RETURNING true) \
         SELECT pg_catalog.count(*) FROM marked",
        &[stream.into(), token.into()],
    );
    Some(marked.unwrap_or(0) > 0)
}

/// Mark `token` (token text) of the stream as passed now, in the caller's
/// transaction: a consumer registered below the current token has rows
/// to catch up on from now at least, while the position worker marks only
/// tokens that move (see `mark_frontier`). Not when a mark at or past
/// `token` exists already: the token has been past the consumer's position
/// since that mark at least (so the lag stays within the truth), and
/// registering and unregistering in a loop adds no row (marks are bounded
/// by the worker's once a second and its thinning, not by registrations).
pub fn insert_mark(stream: &str, token: &str) {
    as_owner(|| {
        run(
            "INSERT INTO streampos.frontier_marks (stream_name, marked_at, position) \
             SELECT $1, pg_catalog.clock_timestamp(), t.token \
             FROM (SELECT $2::pg_catalog.text::streampos.multi_writer_token AS token) t \
             WHERE NOT EXISTS (SELECT FROM streampos.frontier_marks m \
                               WHERE m.stream_name OPERATOR(pg_catalog.=) $1 \
                                 AND streampos.is_before_or_eq(t.token, m.position)) \
             ON CONFLICT DO NOTHING",
            &[stream.into(), token.into()],
        )
    });
}

/// Longest token a notification carries: NOTIFY payloads must stay under
/// 8000 bytes, and a stream with hundreds of writers ahead of its frontier
/// has a longer token. Beyond it the payload carries the frontier alone
/// (a token never ahead of the truth).
const NOTIFY_TOKEN_BYTES: i32 = 7000;

/// Followers that prefer LISTEN to long-polling: one notification per
/// advance, from the position worker, never from the writers' commits
/// (NOTIFY takes a lock that would serialise them).
pub fn notify_positions(stream: &str) {
    run(
        "SELECT pg_catalog.pg_notify('streampos', \
                $1 OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||) \
                CASE WHEN pg_catalog.octet_length(x.t) OPERATOR(pg_catalog.<=) $2 THEN x.t \
                     ELSE 'm' OPERATOR(pg_catalog.||) streampos.frontier($1)::pg_catalog.text END) \
         FROM (SELECT streampos.current_token($1)::pg_catalog.text AS t) x",
        &[stream.into(), NOTIFY_TOKEN_BYTES.into()],
    );
}

// ---- Synapse adoption
//
// What `adopt_synapse` reads in Synapse's schema and writes into the
// catalog. Synapse's relations are looked up by (schema OID, name) in the
// catalog, with the names as parameters, then used by OID; SQL text names
// them only through `relation_name` at the moment of use. They are read as
// their owner (`read_as_owner`); the catalog is written as the extension's
// owner.

/// `schema.name`, each part quoted when it needs it (for messages about
/// objects that do not exist, so have no OID).
pub fn qualified_name(schema: &str, name: &str) -> String {
    format!("{}.{}", quote_ident(schema), quote_ident(name))
}

/// The OID of schema `name`.
pub fn namespace_oid(name: &str) -> Option<pg_sys::Oid> {
    select_one(
        "SELECT n.oid FROM pg_catalog.pg_namespace n WHERE n.nspname OPERATOR(pg_catalog.=) $1",
        &[name.into()],
    )
}

/// The relation called `name` in schema `nsp`: its OID and relkind.
pub fn relation_in(nsp: pg_sys::Oid, name: &str) -> Option<(pg_sys::Oid, String)> {
    select_all(
        "SELECT c.oid, c.relkind::pg_catalog.text FROM pg_catalog.pg_class c \
         WHERE c.relnamespace OPERATOR(pg_catalog.=) $1 AND c.relname OPERATOR(pg_catalog.=) $2",
        &[nsp.into(), name.into()],
        |r| Ok(r.get::<pg_sys::Oid>(1)?.zip(r.get::<String>(2)?)),
    )
    .into_iter()
    .next()
}

/// The type of the live column `column` of `tbl`.
pub fn column_type(tbl: pg_sys::Oid, column: &str) -> Option<pg_sys::Oid> {
    select_one(
        "SELECT a.atttypid FROM pg_catalog.pg_attribute a \
         WHERE a.attrelid OPERATOR(pg_catalog.=) $1 AND a.attname OPERATOR(pg_catalog.=) $2 \
           AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped",
        &[tbl.into(), column.into()],
    )
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
fn lock_catalog_for_change() {
    lock_catalog(pg_sys::ShareLock);
}

/// The highest version in Synapse's `schema_version` table `tbl`, read as
/// its owner (`read_as_owner`).
pub fn synapse_schema_version(tbl: pg_sys::Oid) -> Option<i64> {
    read_as_owner(tbl, &["version"], |name| {
        select_one(
            &format!("SELECT pg_catalog.max(t.version)::pg_catalog.int8 FROM {name} t"),
            &[],
        )
    })
    .flatten()
}

/// Synapse's `instance_map` rows (instance_id, instance_name), by id, read
/// as its owner (`read_as_owner`).
pub fn synapse_instances(tbl: pg_sys::Oid) -> Vec<(i64, String)> {
    read_as_owner(tbl, &["instance_id", "instance_name"], |name| {
        select_all(
            &format!(
                "SELECT t.instance_id::pg_catalog.int8, t.instance_name::pg_catalog.text FROM {name} t \
                 WHERE t.instance_id IS NOT NULL AND t.instance_name IS NOT NULL ORDER BY 1"
            ),
            &[],
            |r| Ok(r.get::<i64>(1)?.zip(r.get::<String>(2)?)),
        )
    })
    .unwrap_or_default()
}

/// The sequence that feeds column `column` of `tbl`: the one it owns
/// (serial, `OWNED BY`, identity) or the one its default reads.
pub fn column_sequence(tbl: pg_sys::Oid, column: &str) -> Option<pg_sys::Oid> {
    select_one(
        "SELECT d.objid FROM pg_catalog.pg_depend d \
         JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) d.refobjid \
          AND a.attnum OPERATOR(pg_catalog.=) d.refobjsubid \
         JOIN pg_catalog.pg_class s ON s.oid OPERATOR(pg_catalog.=) d.objid \
         WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass \
           AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass \
           AND d.refobjid OPERATOR(pg_catalog.=) $1 AND a.attname OPERATOR(pg_catalog.=) $2 \
           AND d.deptype OPERATOR(pg_catalog.=) ANY ('{a,i}'::pg_catalog.\"char\"[]) \
           AND s.relkind OPERATOR(pg_catalog.=) 'S' \
         UNION ALL \
         SELECT d.refobjid FROM pg_catalog.pg_attrdef ad \
         JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) ad.adrelid \
          AND a.attnum OPERATOR(pg_catalog.=) ad.adnum \
         JOIN pg_catalog.pg_depend d \
           ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_attrdef'::pg_catalog.regclass \
          AND d.objid OPERATOR(pg_catalog.=) ad.oid \
         JOIN pg_catalog.pg_class s ON s.oid OPERATOR(pg_catalog.=) d.refobjid \
         WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass \
           AND ad.adrelid OPERATOR(pg_catalog.=) $1 AND a.attname OPERATOR(pg_catalog.=) $2 \
           AND s.relkind OPERATOR(pg_catalog.=) 'S' \
         LIMIT 1",
        &[tbl.into(), column.into()],
    )
}

/// Synapse's `stream_positions` rows of one stream (instance_name,
/// stream_id, signed), read as its owner (`read_as_owner`).
pub fn synapse_positions(tbl: pg_sys::Oid, stream: &str) -> Vec<(String, i64)> {
    read_as_owner(tbl, &["stream_name", "instance_name", "stream_id"], |name| {
        select_all(
            &format!(
                "SELECT t.instance_name::pg_catalog.text, t.stream_id::pg_catalog.int8 FROM {name} t \
                 WHERE t.stream_name::pg_catalog.text OPERATOR(pg_catalog.=) $1 \
                   AND t.instance_name IS NOT NULL AND t.stream_id IS NOT NULL \
                 ORDER BY 1"
            ),
            &[stream.into()],
            |r| Ok(r.get::<String>(1)?.zip(r.get::<i64>(2)?)),
        )
    })
    .unwrap_or_default()
}

/// A stream's registered tables: (table, id column, instance column).
pub fn registered_tables(stream: &str) -> Vec<(pg_sys::Oid, String, Option<String>)> {
    select_all(
        "SELECT t.tbl::pg_catalog.oid, t.id_column::pg_catalog.text, t.instance_column::pg_catalog.text \
         FROM streampos.stream_tables t WHERE t.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
        |r| {
            let instance = r.get::<String>(3)?;
            Ok(r
                .get::<pg_sys::Oid>(1)?
                .zip(r.get::<String>(2)?)
                .map(|(tbl, id)| (tbl, id, instance)))
        },
    )
}

/// Insert instances with the ids they have elsewhere (Synapse's), then move
/// the id sequence past every id in the table and past `floor` (ids the
/// other system handed out, or burnt), so that a name added later never
/// gets one of them. Run under `lock_catalog_for_adoption`.
pub fn import_instances(instances: &[(i32, String)], floor: i64) {
    let ids: Vec<i32> = instances.iter().map(|(id, _)| *id).collect();
    let names: Vec<String> = instances.iter().map(|(_, name)| name.clone()).collect();
    as_owner(|| {
        if !instances.is_empty() {
            run(
                "INSERT INTO streampos.instances (instance_id, instance_name) \
                 SELECT u.id, u.name \
                 FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int4[]), \
                                 pg_catalog.unnest($2::pg_catalog.text[])) AS u(id, name)",
                &[ids.into(), names.into()],
            );
        }
        // The last value handed out is last_value, or one less before the
        // first nextval (is_called false).
        update_one::<i64>(
            "SELECT pg_catalog.setval('streampos.instances_instance_id_seq'::pg_catalog.regclass, m.target, true) \
             FROM (SELECT GREATEST($1::pg_catalog.int8, \
                                   (SELECT pg_catalog.max(i.instance_id) FROM streampos.instances i)::pg_catalog.int8) \
                          AS target) m, \
                  streampos.instances_instance_id_seq q \
             WHERE m.target OPERATOR(pg_catalog.>) \
                   CASE WHEN q.is_called THEN q.last_value ELSE q.last_value OPERATOR(pg_catalog.-) 1 END",
            &[floor.into()],
        );
    });
}

/// Store positions for a stream, signed as the stream numbers them, never
/// lowering a position already stored (compared by magnitude, as backward
/// streams store negative positions). Returns the rows inserted or raised.
pub fn import_positions(stream: &str, positions: &[(String, i64)]) -> Vec<(String, i64)> {
    let names: Vec<String> = positions.iter().map(|(name, _)| name.clone()).collect();
    let ids: Vec<i64> = positions.iter().map(|(_, id)| *id).collect();
    let args: [DatumWithOid; 3] = [stream.into(), names.into(), ids.into()];
    as_owner(|| {
        with_safe_path(|| {
            spi(Spi::connect_mut(|client| {
                let mut out = Vec::new();
                let changed = client.update(
                    "INSERT INTO streampos.stream_positions AS p (stream_name, instance_name, stream_id) \
                     SELECT $1, u.name, u.id \
                     FROM ROWS FROM (pg_catalog.unnest($2::pg_catalog.text[]), \
                                     pg_catalog.unnest($3::pg_catalog.int8[])) AS u(name, id) \
                     ON CONFLICT (stream_name, instance_name) DO UPDATE SET stream_id = EXCLUDED.stream_id \
                     WHERE pg_catalog.abs(EXCLUDED.stream_id) OPERATOR(pg_catalog.>) pg_catalog.abs(p.stream_id) \
                     RETURNING p.instance_name, p.stream_id",
                    None,
                    &args,
                )?;
                for row in changed {
                    if let Some(v) = row.get::<String>(1)?.zip(row.get::<i64>(2)?) {
                        out.push(v);
                    }
                }
                out.sort();
                Ok(out)
            }))
        })
    })
}

/// A consumer's row: its owner and acknowledged position (token text).
pub struct ConsumerRow {
    pub owner: pg_sys::Oid,
    pub position: String,
}

/// The consumer's row as the caller's snapshot sees it.
pub fn consumer(stream: &str, consumer: &str) -> Option<ConsumerRow> {
    // Kept: a consumer acknowledges again and again.
    kept_select(
        pg_sys::InvalidOid,
        "SELECT c.owner::pg_catalog.oid, c.position::pg_catalog.text \
         FROM streampos.consumer_positions c \
         WHERE c.stream_name OPERATOR(pg_catalog.=) $1 \
           AND c.consumer_name OPERATOR(pg_catalog.=) $2",
        &[TEXT, TEXT],
        &[stream.into(), consumer.into()],
        owner_and_position,
    )
    .pop()
    .map(|(owner, position)| ConsumerRow { owner, position })
}

const TEXT: PgOid = PgOid::BuiltIn(PgBuiltInOids::TEXTOID);

/// (owner, position text) of a row of `consumer_positions` a statement
/// returned as its first two columns.
fn owner_and_position(
    tuple: pg_sys::HeapTuple,
    desc: pg_sys::TupleDesc,
) -> Option<(pg_sys::Oid, String)> {
    // SAFETY: a row of the statement's result, whose columns 1 and 2 are
    // an oid and a text.
    unsafe { column::<pg_sys::Oid>(tuple, desc, 1).zip(column::<String>(tuple, desc, 2)) }
}

/// Register a consumer owned by `owner` at `position` (token text); None if
/// the name is taken on the stream (a concurrent registration waits for the
/// other to end, as any insert of a unique key does).
pub fn insert_consumer(
    stream: &str,
    consumer: &str,
    owner: pg_sys::Oid,
    position: &str,
) -> Option<String> {
    let args: [DatumWithOid; 4] = [
        stream.into(),
        consumer.into(),
        DatumWithOid::from(owner),
        position.into(),
    ];
    as_owner(|| {
        update_one::<String>(
            "INSERT INTO streampos.consumer_positions AS c \
               (stream_name, consumer_name, owner, position, registered_at) \
             VALUES ($1, $2, $3::pg_catalog.oid::pg_catalog.regrole, \
                     $4::pg_catalog.text::streampos.multi_writer_token, pg_catalog.now()) \
             ON CONFLICT (stream_name, consumer_name) DO NOTHING \
             RETURNING c.position::pg_catalog.text",
            &args,
        )
    })
}

/// Move the consumer's position to its least upper bound with `token`
/// (token text): never backwards. The row is locked until the caller's
/// transaction ends, and a concurrent acknowledgement that committed first
/// is joined, not overwritten (READ COMMITTED re-evaluates the new value on
/// the newest row version). The owner of the row version written (the
/// caller checks it: a consumer unregistered and registered again by
/// another role since the caller's check is that role's) and the position
/// after; None if the consumer no longer exists.
pub fn advance_consumer(
    stream: &str,
    consumer: &str,
    token: &str,
) -> Option<(pg_sys::Oid, String)> {
    consumer_write(
        "UPDATE streampos.consumer_positions c \
         SET position = streampos.advance(c.position, \
               $3::pg_catalog.text::streampos.multi_writer_token), \
             acked_at = pg_catalog.now() \
         WHERE c.stream_name OPERATOR(pg_catalog.=) $1 \
           AND c.consumer_name OPERATOR(pg_catalog.=) $2 \
         RETURNING c.owner::pg_catalog.oid, c.position::pg_catalog.text",
        &[TEXT, TEXT, TEXT],
        &[stream.into(), consumer.into(), token.into()],
    )
}

/// As `advance_consumer`, only if `owner` owns the consumer: None
/// otherwise, without writing or waiting for its row (a row another role
/// owns does not match, so its lock is never waited for).
pub fn advance_own_consumer(
    stream: &str,
    consumer: &str,
    token: &str,
    owner: pg_sys::Oid,
) -> Option<(pg_sys::Oid, String)> {
    consumer_write(
        "UPDATE streampos.consumer_positions c \
         SET position = streampos.advance(c.position, \
               $3::pg_catalog.text::streampos.multi_writer_token), \
             acked_at = pg_catalog.now() \
         WHERE c.stream_name OPERATOR(pg_catalog.=) $1 \
           AND c.consumer_name OPERATOR(pg_catalog.=) $2 \
           AND c.owner::pg_catalog.oid OPERATOR(pg_catalog.=) $4 \
         RETURNING c.owner::pg_catalog.oid, c.position::pg_catalog.text",
        &[TEXT, TEXT, TEXT, PgOid::BuiltIn(PgBuiltInOids::OIDOID)],
        &[
            stream.into(),
            consumer.into(),
            token.into(),
            DatumWithOid::from(owner),
        ],
    )
}

/// A write of one consumer's row (by its primary key) as the extension's
/// owner, kept for later calls, returning the row's (owner, position
/// text); None if there was no row.
fn consumer_write(
    query: &str,
    types: &[PgOid],
    args: &[DatumWithOid],
) -> Option<(pg_sys::Oid, String)> {
    as_owner(|| kept_update(query, types, args, owner_and_position).pop())
}

/// Forget a consumer; the owner (the caller checks it) and position of the
/// row deleted, None if there was none.
pub fn delete_consumer(stream: &str, consumer: &str) -> Option<(pg_sys::Oid, String)> {
    consumer_write(
        "DELETE FROM streampos.consumer_positions c \
         WHERE c.stream_name OPERATOR(pg_catalog.=) $1 \
           AND c.consumer_name OPERATOR(pg_catalog.=) $2 \
         RETURNING c.owner::pg_catalog.oid, c.position::pg_catalog.text",
        &[TEXT, TEXT],
        &[stream.into(), consumer.into()],
    )
}

/// Forget every consumer of the stream (`drop_stream`, before it holds the
/// sequence: a consumer's open transaction holds its row).
pub fn delete_consumers(stream: &str) {
    if !catalog_table_exists(c"consumer_positions") {
        return;
    }
    as_owner(|| {
        run(
            "DELETE FROM streampos.consumer_positions c \
             WHERE c.stream_name OPERATOR(pg_catalog.=) $1",
            &[stream.into()],
        )
    });
}

/// A stream's consumers and floor as last committed: the latest snapshot,
/// whatever the caller's isolation (a REPEATABLE READ transaction's
/// snapshot may predate positions a retention job has acted on).
pub struct ConsumerState {
    /// The named consumer's own row, if registered.
    pub own: Option<ConsumerRow>,
    /// Every other consumer's position (token text).
    pub others: Vec<String>,
    /// What consumers that have gone had acknowledged (token text).
    pub floor: Option<String>,
}

/// `ConsumerState` of `consumer` on `stream`, read with the latest
/// snapshot through `SPI_execute_snapshot` (an ordinary SPI query of a
/// transaction that has an xid reads with its own snapshot, whatever
/// snapshot is active).
pub fn consumer_state_latest(stream: &str, consumer: &str) -> ConsumerState {
    const QUERY: &CStr = c"SELECT 0, c.owner::pg_catalog.oid, c.position::pg_catalog.text \
        FROM streampos.consumer_positions c \
        WHERE c.stream_name OPERATOR(pg_catalog.=) $1 \
          AND c.consumer_name OPERATOR(pg_catalog.=) $2 \
        UNION ALL \
        SELECT 1, c.owner::pg_catalog.oid, c.position::pg_catalog.text \
        FROM streampos.consumer_positions c \
        WHERE c.stream_name OPERATOR(pg_catalog.=) $1 \
          AND c.consumer_name OPERATOR(pg_catalog.<>) $2 \
        UNION ALL \
        SELECT 2, 0::pg_catalog.oid, f.position::pg_catalog.text \
        FROM streampos.consumer_floors f WHERE f.stream_name OPERATOR(pg_catalog.=) $1";
    let mut state = ConsumerState {
        own: None,
        others: Vec::new(),
        floor: None,
    };
    with_safe_path(|| {
        spi(Spi::connect(|_client| -> SpiResult<()> {
            let (Some(s), Some(c)) = (stream.into_datum(), consumer.into_datum()) else {
                return Ok(());
            };
            // SAFETY: SPI is connected for the closure; the plan is freed
            // before returning (or with the SPI context on ERROR); the
            // result's tuples and descriptor are valid until SPI finishes,
            // and every value is copied out (owned Rust values) before.
            unsafe {
                let mut types = [pg_sys::TEXTOID, pg_sys::TEXTOID];
                let plan = pg_sys::SPI_prepare(QUERY.as_ptr(), 2, types.as_mut_ptr());
                if plan.is_null() {
                    return Err(pgrx::spi::SpiError::SpiError(
                        pgrx::spi::SpiErrorCodes::Unconnected,
                    ));
                }
                let mut values = [s, c];
                let nulls = [b' ' as std::ffi::c_char; 2];
                let status = pg_sys::SPI_execute_snapshot(
                    plan,
                    values.as_mut_ptr(),
                    nulls.as_ptr(),
                    pg_sys::GetLatestSnapshot(),
                    std::ptr::null_mut(),
                    true,
                    false,
                    0,
                );
                let table = pg_sys::SPI_tuptable;
                if status == pg_sys::SPI_OK_SELECT as i32 && !table.is_null() {
                    let desc = (*table).tupdesc;
                    for k in 0..pg_sys::SPI_processed as usize {
                        let tuple = *(*table).vals.add(k);
                        let mut null = false;
                        let kind =
                            i32::from_datum(pg_sys::SPI_getbinval(tuple, desc, 1, &mut null), null);
                        let owner = pg_sys::Oid::from_datum(
                            pg_sys::SPI_getbinval(tuple, desc, 2, &mut null),
                            null,
                        );
                        let position = String::from_datum(
                            pg_sys::SPI_getbinval(tuple, desc, 3, &mut null),
                            null,
                        );
                        match (kind, owner, position) {
                            (Some(0), Some(owner), Some(position)) => {
                                state.own = Some(ConsumerRow { owner, position })
                            }
                            (Some(1), _, Some(position)) => state.others.push(position),
                            (Some(2), _, Some(position)) => state.floor = Some(position),
                            _ => {}
                        }
                    }
                }
                pg_sys::SPI_freeplan(plan);
                Ok(())
            }
        }))
    });
    state
}

/// Raise the stream's consumer floor to at least `token` (token text): what
/// a retention job may have deleted up to while consumers that have gone
/// were registered. Never lowered.
pub fn raise_consumer_floor(stream: &str, token: &str) {
    as_owner(|| {
        run(
            "INSERT INTO streampos.consumer_floors AS f (stream_name, position) \
             VALUES ($1, $2::pg_catalog.text::streampos.multi_writer_token) \
             ON CONFLICT (stream_name) DO UPDATE \
             SET position = streampos.advance(f.position, EXCLUDED.position)",
            &[stream.into(), token.into()],
        )
    });
}

/// Every consumer's position (token text) on the stream, as the caller's
/// snapshot sees them.
pub fn consumer_positions(stream: &str) -> Vec<String> {
    select_all(
        "SELECT c.position::pg_catalog.text FROM streampos.consumer_positions c \
         WHERE c.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
        |r| r.get::<String>(1),
    )
}
