//! Relations other roles may own: the one door through which they are read
//! (`read_as_owner`: checked for the caller, read as the owner in a
//! security-restricted operation), the caller's privilege checks, and
//! facts about types and roles.

use super::*;
pub use crate::roles::{caller_acts_as, role_acts_as, role_display_name};

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

/// Is `type_oid` bigint (Some(false)) or an array of bigint (Some(true)),
/// looking through domains?
pub fn bigint_kind(type_oid: pg_sys::Oid) -> Option<bool> {
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

/// The owner of relation `oid` (None: it does not exist).
pub fn relation_owner(oid: pg_sys::Oid) -> Option<pg_sys::Oid> {
    select_one(
        "SELECT c.relowner FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) $1",
        &[oid.into()],
    )
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
pub(super) struct RelationFacts {
    pub(super) owner: pg_sys::Oid,
    pub(super) kind: u8,
    pub(super) row_security: bool,
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
pub(super) fn check_may_read(
    rel: pg_sys::Oid,
    name: &str,
    facts: &RelationFacts,
    columns: &[&str],
) {
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

/// A read of `rel` the extension needs for itself, whoever calls (the
/// highest ID a promoted server has, when a stream is first used in a
/// history that may lack another's): as the owner in a security-restricted
/// operation, like `read_as_owner`, but without the caller's privileges
/// (the caller gets nothing of the rows; a reader must not fail because it
/// happened to be the first to use the stream). A relation that is gone,
/// or no longer a table, is not read.
pub(super) fn read_as_owner_for_extension<T>(
    rel: pg_sys::Oid,
    f: impl FnOnce(&str) -> T,
) -> Option<T> {
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
