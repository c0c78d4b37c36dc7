//! Statements prepared once per session and kept (followers' reads, `ack`).

use super::*;

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

/// A relation changed (relcache invalidation; InvalidOid: any): kept
/// statements are dropped at their next use, and names and statement texts
/// made before are not used again. Safe from any callback.
pub fn relations_changed() {
    KEPT_STALE.with(|s| s.set(true));
    RELATIONS_GENERATION.with(|g| g.set(g.get().wrapping_add(1)));
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
pub(super) fn kept_select<T>(
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
pub(super) fn kept_update<T>(
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
pub(super) unsafe fn spi_column<T: FromDatum>(
    tuple: pg_sys::HeapTuple,
    desc: pg_sys::TupleDesc,
    column: i32,
) -> Option<T> {
    let mut null = false;
    // SAFETY: as the caller promises.
    unsafe { T::from_datum(pg_sys::SPI_getbinval(tuple, desc, column, &mut null), null) }
}
