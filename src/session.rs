//! What another role's code may leave behind in the caller's session, and
//! its removal.
//!
//! `sql::as_role` runs a table owner's code the way PostgreSQL's
//! maintenance commands do: a security-restricted operation (which already
//! refuses SET ROLE, temporary objects, PREPARE, LISTEN, DISCARD and CLOSE)
//! inside a GUC nest level it discards (no setting survives). One thing of
//! the session is left that neither covers: a session-level advisory lock,
//! which `pg_advisory_lock()` takes from any code, restricted or not, and
//! which outlives the call (and the transaction). `Guard` notes the
//! advisory locks the backend holds before such code runs, and afterwards
//! releases the session-level holds of any tag and mode that was not held
//! before (docs/design.md, "Running another role's code").
//!
//! Limits, stated in the design: a lock the caller already held in the
//! same mode and that the code took once more is not told apart (the lock
//! manager's per-backend counts are private to it), and when the code
//! raises an ERROR its session-level locks are not released (the lock
//! manager may not be entered again before the abort; PostgreSQL's VACUUM
//! leaves them the same way).

use pgrx::pg_sys;

use crate::sql;

/// SQL-level advisory locks carry 1 (one bigint key) or 2 (two integer
/// keys) in the tag's fourth field; the extension's own locks use other
/// classes and are transaction-level.
const SQL_ADVISORY_CLASSES: [u16; 2] = [1, 2];

/// An advisory lock this backend holds: its tag and the modes held.
#[derive(Clone, Copy)]
struct Held {
    tag: pg_sys::LOCKTAG,
    modes: pg_sys::LOCKMASK,
}

fn same_tag(a: &pg_sys::LOCKTAG, b: &pg_sys::LOCKTAG) -> bool {
    a.locktag_field1 == b.locktag_field1
        && a.locktag_field2 == b.locktag_field2
        && a.locktag_field3 == b.locktag_field3
        && a.locktag_field4 == b.locktag_field4
        && a.locktag_lockmethodid == b.locktag_lockmethodid
}

/// The SQL-level advisory locks this backend holds now, in any mode.
fn advisory_holds() -> Vec<Held> {
    let mut held = Vec::new();
    // SAFETY: GetLockStatusData returns a palloc'd copy of the lock
    // table's state, read under the lock manager's partition locks; only
    // this backend's entries are kept, copied by value.
    unsafe {
        let data = pg_sys::GetLockStatusData();
        if data.is_null() {
            return held;
        }
        let count = usize::try_from((*data).nelements).unwrap_or(0);
        let me = pg_sys::MyProcPid;
        for i in 0..count {
            let lock = &*(*data).locks.add(i);
            if lock.pid != me
                || lock.holdMask == 0
                || lock.locktag.locktag_type != pg_sys::LockTagType::LOCKTAG_ADVISORY as u8
                || !SQL_ADVISORY_CLASSES.contains(&lock.locktag.locktag_field4)
            {
                continue;
            }
            held.push(Held {
                tag: lock.locktag,
                modes: lock.holdMask,
            });
        }
    }
    held
}

/// Release every session-level hold of `tag` in `mode`, without a
/// WARNING for a mode held only by the transaction (the lock manager's
/// answer to a session release of it: then there is nothing to release).
fn release_session_holds(tag: &pg_sys::LOCKTAG, mode: pg_sys::LOCKMODE) {
    // SAFETY: message levels are plain integers, restored below; the lock
    // manager's release of a session lock returns false (with a WARNING
    // the levels silence) once this backend holds none in that mode.
    unsafe {
        let client = pg_sys::client_min_messages;
        let log = pg_sys::log_min_messages;
        pg_sys::client_min_messages = pgrx::PgLogLevel::ERROR as i32;
        pg_sys::log_min_messages = pgrx::PgLogLevel::ERROR as i32;
        // A session lock is counted per acquisition; each release takes one.
        while pg_sys::LockRelease(tag, mode, true) {}
        pg_sys::client_min_messages = client;
        pg_sys::log_min_messages = log;
    }
}

/// The advisory locks held before another role's code ran, when that code
/// needs watching.
pub struct Guard {
    before: Option<Vec<Held>>,
}

impl Guard {
    /// Before `role`'s code runs for `caller`: watched unless `role` has
    /// the caller's privileges already (the caller's own code, or its
    /// member's: it could change the caller's session anyway).
    pub fn begin(role: pg_sys::Oid, caller: pg_sys::Oid) -> Guard {
        if sql::role_acts_as(role, caller) {
            return Guard { before: None };
        }
        Guard {
            before: Some(advisory_holds()),
        }
    }

    /// After the code returned: release what it took for the session.
    pub fn end(self) {
        let Some(before) = self.before else {
            return;
        };
        for now in advisory_holds() {
            let had = before
                .iter()
                .find(|b| same_tag(&b.tag, &now.tag))
                .map_or(0, |b| b.modes);
            let new_modes = now.modes & !had;
            if new_modes == 0 {
                continue;
            }
            for mode in 1..=pg_sys::MaxLockMode as pg_sys::LOCKMODE {
                if new_modes & (1 << mode) != 0 {
                    release_session_holds(&now.tag, mode);
                }
            }
        }
    }
}
