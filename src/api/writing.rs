//! Allocation: `next_id` and `next_ids`, inside the transaction that persists
//! the rows; `hold_ids` and `release_ids`, for rows that other transactions
//! write.

use pgrx::prelude::*;

use crate::engine;

#[pg_extern(volatile, strict, parallel_unsafe)]
fn next_id(stream: &str, writer: &str) -> i64 {
    let id = engine::allocate(stream, writer, 1, false)
        .first()
        .copied()
        .unwrap_or(0);
    warn_if_finished_at_once("next_id", stream);
    id
}

#[pg_extern(volatile, strict, parallel_unsafe)]
fn next_ids(stream: &str, writer: &str, n: i32) -> Vec<i64> {
    let ids = engine::allocate(stream, writer, n, false);
    warn_if_finished_at_once("next_ids", stream);
    ids
}

/// A bare `SELECT` outside a transaction block (a driver's autocommit, or a
/// pool that sent `BEGIN` to another connection) is a transaction of its
/// own: its IDs are finished when it returns, before any later statement
/// can write their rows, and followers pass them. PostgreSQL's own WARNING
/// for a transaction command outside a block has the same SQLSTATE. An
/// `INSERT … next_id(…)` in autocommit writes its row in the same
/// transaction and is not warned about; neither is a `CALL`.
fn warn_if_finished_at_once(function: &'static str, stream: &str) {
    // SAFETY: reads the transaction state and the running portal (NULL
    // outside one) and its statement, all the backend's own.
    let bare_select = unsafe {
        !pg_sys::IsTransactionBlock()
            && !pg_sys::ActivePortal.is_null()
            && (*pg_sys::ActivePortal).commandTag == pg_sys::CommandTag::CMDTAG_SELECT
            && {
                // A SELECT that writes (SELECT … INTO, a data-modifying
                // WITH) may write the row itself.
                let statement = pg_sys::PortalGetPrimaryStmt(pg_sys::ActivePortal);
                !statement.is_null()
                    && (*statement).commandType == pg_sys::CmdType::CMD_SELECT
                    && (*statement).utilityStmt.is_null()
                    && !(*statement).hasModifyingCTE
            }
    };
    if !bare_select || !crate::guc::WARN_FINISHED_AT_ONCE.get() {
        return;
    }
    pgrx::pg_sys::panic::ErrorReport::new(
        PgSqlErrorCode::ERRCODE_NO_ACTIVE_SQL_TRANSACTION,
        format!(
            "{function}() outside a transaction block finishes its IDs of stream \"{}\" when this statement ends",
            crate::error::clip(stream)
        ),
        function,
    )
    .set_detail("A row written with them by a later statement can be passed by followers, and is never delivered.")
    .set_hint("Allocate in the transaction that writes the row (BEGIN … COMMIT, or in the INSERT itself); hold_ids() is for IDs that outlive the statement. streampos.warn_finished_at_once = off silences this.")
    .report(PgLogLevel::WARNING);
}

/// IDs held by the session rather than its transaction: in flight until
/// `release_ids` (or the end of the session), for rows that other
/// transactions write. If the calling transaction aborts, they are
/// abandoned with it.
#[pg_extern(volatile, strict, parallel_unsafe)]
fn hold_ids(stream: &str, writer: &str, n: default!(i32, 1)) -> Vec<i64> {
    engine::allocate(stream, writer, n, true)
}

/// Release a hold of this session: its IDs are finished with the commit of
/// the calling transaction (a reader passes them only in a snapshot that
/// sees that commit); if it aborts, the hold goes on.
#[pg_extern(volatile, strict, parallel_unsafe)]
fn release_ids(stream: &str, ids: Array<'_, i64>) {
    // A hold has at most as many IDs as one call allocates: anything longer
    // is no hold, and is not copied.
    if ids.len() > engine::MAX_IDS_PER_CALL as usize {
        crate::error::Error::invalid("no hold has that many IDs").report()
    }
    let Some(ids) = ids.iter().collect::<Option<Vec<i64>>>() else {
        crate::error::Error::invalid("the IDs to release must not contain NULL").report()
    };
    engine::release(stream, &ids)
}
