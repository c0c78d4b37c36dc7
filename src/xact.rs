//! Transaction callbacks: IDs finish when their transaction ends.

use pgrx::pg_sys;
use pgrx::pg_sys::XactEvent;

use crate::error::Error;
use crate::{catalog, engine, prepared, registry};

pub fn register_callbacks() {
    // SAFETY: registered once per process from _PG_init.
    unsafe {
        pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(on_subxact_event), std::ptr::null_mut());
    }
}

/// Commit runs after the commit is visible in the ProcArray, so clearing the
/// entries there cannot expose an unfinished ID. Nothing on the commit and
/// abort paths raises an ERROR: after commit that would be a PANIC.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_xact_event(event: XactEvent::Type, _arg: *mut std::ffi::c_void) {
    match event {
        XactEvent::XACT_EVENT_COMMIT => {
            crate::session::end_transaction();
            registry::note_start_xid();
            registry::end_transaction(true);
            catalog::end_transaction(true);
            engine::end_transaction_marks(true);
            // Last: nothing before the registry's end of the transaction.
            engine::transaction_ended();
        }
        XactEvent::XACT_EVENT_ABORT => {
            crate::session::end_transaction();
            registry::note_start_xid();
            registry::end_transaction(false);
            catalog::end_transaction(false);
            engine::end_transaction_marks(false);
            engine::transaction_ended();
        }
        XactEvent::XACT_EVENT_PRE_COMMIT => {
            engine::release_answers();
            registry::flush_before_commit();
            catalog::pre_commit();
        }
        XactEvent::XACT_EVENT_PREPARE => {
            engine::transaction_ended();
            catalog::prepared();
        }
        XactEvent::XACT_EVENT_PRE_PREPARE if registry::holding() => Error::Prepare.report(),
        XactEvent::XACT_EVENT_PRE_PREPARE if catalog::changed_in_this_transaction() => {
            Error::PrepareCatalog.report()
        }
        XactEvent::XACT_EVENT_PRE_PREPARE => {
            engine::release_answers();
            prepared::record();
        }
        _ => {}
    }
}

/// A rolled-back savepoint takes back what it did to the catalog, and the
/// holds it released.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_subxact_event(
    event: pg_sys::SubXactEvent::Type,
    subxact: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    match event {
        pg_sys::SubXactEvent::SUBXACT_EVENT_ABORT_SUB => {
            engine::transaction_ended();
            catalog::end_subtransaction(false, subxact, parent);
            registry::end_subtransaction(false, subxact, parent);
            // A read's rollback stored no mark (marks are catalog writes).
            if !crate::sql::quiet_rollback(subxact) {
                engine::forget_marks();
            }
        }
        pg_sys::SubXactEvent::SUBXACT_EVENT_COMMIT_SUB => {
            catalog::end_subtransaction(true, subxact, parent);
            registry::end_subtransaction(true, subxact, parent);
        }
        _ => {}
    }
}
