//! Facts about roles from the syscache, raising no error: whether one has
//! another's privileges, a role's name for messages. Below `sql/` and
//! `session.rs`, which both ask.

use std::ffi::CStr;

use pgrx::pg_sys;

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
