//! What another role's code must not do to the caller's session: take or
//! release advisory locks, take or release streampos holds or IDs (and
//! reseed `random()` by `setseed()`).
//!
//! `sql::as_role` runs a table owner's code the way PostgreSQL's
//! maintenance commands do: a security-restricted operation (which already
//! refuses SET ROLE, temporary objects, PREPARE, LISTEN, DISCARD and CLOSE)
//! inside a GUC nest level it discards (no setting survives). Neither covers
//! the functions that change session state directly: `pg_advisory_lock()`
//! takes a lock that outlives the call (and its transaction, and an ERROR),
//! `pg_advisory_unlock_all()` releases the caller's own, and `setseed()`
//! makes the caller's `random()` predictable; streampos's own `hold_ids`
//! and `release_ids` change the session's holds (a hold outlives the
//! subtransaction that took it: a stream's frontier stuck behind the
//! caller's session, its holds table full), `next_id` and `next_ids` put
//! an ID in flight for the caller's transaction. PostgreSQL's VACUUM lets
//! the first kind through; streampos refuses both (42501) while another role's code
//! runs inside one of its functions: an object access hook, which the
//! executor calls for every function it prepares to run (`ExecInitFunc`,
//! aggregates' and window functions' too), the planner's constant folding
//! and PL/pgSQL's expressions included (docs/design.md, "Running another
//! role's code").

use std::cell::Cell;
use std::ffi::CStr;

use pgrx::pg_sys;
use pgrx::prelude::*;

use crate::error::Error;

thread_local! {
    /// How deep this backend is in another role's code (`OwnerCode`).
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// The hook that was installed before ours (chained).
static mut PREVIOUS_HOOK: pg_sys::object_access_hook_type = None;

/// Functions of `pg_catalog` that change the session's state rather than
/// the transaction's: refused while another role's code runs.
const SESSION_FUNCTIONS: &[&str] = &[
    "pg_advisory_lock",
    "pg_advisory_lock_shared",
    "pg_try_advisory_lock",
    "pg_try_advisory_lock_shared",
    "pg_advisory_unlock",
    "pg_advisory_unlock_shared",
    "pg_advisory_unlock_all",
    "pg_advisory_xact_lock",
    "pg_advisory_xact_lock_shared",
    "pg_try_advisory_xact_lock",
    "pg_try_advisory_xact_lock_shared",
    "setseed",
];

/// Functions of the extension's schema that change the caller's session
/// (holds) or its transaction (IDs in flight until it ends).
const STREAM_FUNCTIONS: &[&str] = &["hold_ids", "release_ids", "next_id", "next_ids"];

/// Install the hook. Called once per process from `_PG_init`.
pub fn register() {
    // SAFETY: hooks are process-global and set from _PG_init only.
    unsafe {
        PREVIOUS_HOOK = pg_sys::object_access_hook;
        pg_sys::object_access_hook = Some(on_object_access);
    }
}

/// Another role's code runs while this guard lives (`sql::as_role`, for a
/// role without the caller's privileges). Dropped also when an ERROR
/// unwinds through the caller.
pub struct OwnerCode {
    watched: bool,
}

impl OwnerCode {
    /// `role`'s code is about to run for `caller`: watched unless `role`
    /// has the caller's privileges (its own code, or a member's: it could
    /// change the caller's session anyway).
    pub fn enter(role: pg_sys::Oid, caller: pg_sys::Oid) -> OwnerCode {
        let watched = !crate::roles::role_acts_as(role, caller);
        if watched {
            DEPTH.with(|d| d.set(d.get() + 1));
        }
        OwnerCode { watched }
    }
}

impl Drop for OwnerCode {
    fn drop(&mut self) {
        if self.watched {
            DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        }
    }
}

/// At the end of a top-level transaction nothing of another role runs.
pub fn end_transaction() {
    DEPTH.with(|d| d.set(0));
}

#[pg_guard]
unsafe extern "C-unwind" fn on_object_access(
    access: pg_sys::ObjectAccessType::Type,
    class_id: pg_sys::Oid,
    object_id: pg_sys::Oid,
    sub_id: std::ffi::c_int,
    arg: *mut std::ffi::c_void,
) {
    if access == pg_sys::ObjectAccessType::OAT_FUNCTION_EXECUTE
        && class_id == pg_sys::ProcedureRelationId
        && DEPTH.with(|d| d.get()) > 0
    {
        refuse_session_function(object_id);
    }
    // SAFETY: PREVIOUS_HOOK is written once, from _PG_init; the previous
    // hook, if any, has this signature and is called with our arguments.
    unsafe {
        if let Some(previous) = PREVIOUS_HOOK {
            previous(access, class_id, object_id, sub_id, arg);
        }
    }
}

/// Refuse (42501) a function of `SESSION_FUNCTIONS` or `STREAM_FUNCTIONS`.
fn refuse_session_function(function: pg_sys::Oid) {
    // SAFETY: syscache lookups; a missing function or schema gives NULL
    // or InvalidOid, not an ERROR.
    let (name, refused) = unsafe {
        let namespace = pg_sys::get_func_namespace(function);
        let list = if namespace == pg_sys::Oid::from(pg_sys::PG_CATALOG_NAMESPACE) {
            SESSION_FUNCTIONS
        } else {
            let schema = pg_sys::get_namespace_name(namespace);
            if schema.is_null() || CStr::from_ptr(schema).to_bytes() != b"streampos" {
                return;
            }
            STREAM_FUNCTIONS
        };
        let name = pg_sys::get_func_name(function);
        if name.is_null() {
            return;
        }
        let name = CStr::from_ptr(name).to_string_lossy().into_owned();
        let refused = list.contains(&name.as_str());
        (name, refused)
    };
    if refused {
        Error::SessionFunction {
            function: name,
            role: crate::roles::role_display_name(
                // SAFETY: reads the current user id.
                unsafe { pg_sys::GetUserId() },
            ),
        }
        .report();
    }
}
