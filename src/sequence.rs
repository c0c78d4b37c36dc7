//! A stream's sequence, always by OID, never by name: handing out IDs, the
//! WAL position that makes them durable, what it has handed out so far, and
//! its settings. Reading its state needs no privilege on it and runs no SQL
//! (nothing in the caller's search_path can stand in for it).

use pgrx::pg_sys;

use crate::error::Error;
use crate::fast_hash::FastMap;
use crate::ffi::{self, in_boundary};
use crate::sql;

/// The sequence's tuple (`FormData_pg_sequence_data`, commands/sequence.h).
#[repr(C)]
struct SequenceData {
    last_value: i64,
    log_cnt: i64,
    is_called: bool,
}

/// What a sequence must be for `with_page`.
#[derive(Clone, Copy, PartialEq)]
enum Need {
    /// To hand out IDs: permanent (an UNLOGGED one resets at crash recovery).
    Permanent,
    /// To read its state: in shared buffers (not another session's TEMP).
    Readable,
}

/// Open `seq`, check that it is a sequence as `need` says, and run `f` on
/// its first page with the buffer share-locked. Errors are PostgreSQL
/// ERRORs (a dropped relation) or ours (not a sequence, not permanent).
fn with_page<T>(
    seq: pg_sys::Oid,
    need: Need,
    f: impl FnOnce(*const pg_sys::PageHeaderData) -> T,
) -> T {
    // SAFETY: the relation is opened and locked for the duration; block 0
    // of a sequence always exists; the buffer is pinned and share-locked
    // while `f` reads its page. pgrx's bindings turn a PostgreSQL ERROR
    // (a dropped relation, an I/O error) into a Rust panic that becomes the
    // ERROR again at our function's boundary; a second guard around them
    // would make that panic abort the process.
    let (kind, persistence, value) = unsafe {
        let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
        let rel = pg_sys::try_relation_open(seq, lock);
        if rel.is_null() {
            Error::SequenceOidDropped(seq.to_u32()).report();
        }
        let kind = (*(*rel).rd_rel).relkind as u8;
        let persistence = (*(*rel).rd_rel).relpersistence as u8;
        let usable = match need {
            Need::Permanent => persistence == pg_sys::RELPERSISTENCE_PERMANENT,
            Need::Readable => persistence != pg_sys::RELPERSISTENCE_TEMP,
        };
        if kind != pg_sys::RELKIND_SEQUENCE || !usable {
            pg_sys::relation_close(rel, lock);
            (kind, persistence, None)
        } else {
            let buffer = pg_sys::ReadBuffer(rel, 0);
            pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as i32);
            let page = pg_sys::BufferBlocks.add((buffer as usize - 1) * pg_sys::BLCKSZ as usize)
                as *const pg_sys::PageHeaderData;
            let value = f(page);
            pg_sys::UnlockReleaseBuffer(buffer);
            pg_sys::relation_close(rel, lock);
            (kind, persistence, Some(value))
        }
    };
    match value {
        Some(value) => value,
        None if kind != pg_sys::RELKIND_SEQUENCE => {
            Error::NotASequence(sql::relation_name(seq)).report()
        }
        None => Error::NotPermanent {
            seq: sql::relation_name(seq),
            unlogged: persistence == pg_sys::RELPERSISTENCE_UNLOGGED,
        }
        .report(),
    }
}

/// Allocation holds the sequence (ROW EXCLUSIVE, as `nextval` takes it,
/// until the transaction ends) before it registers anything
/// (`open_for_allocation`); `drop_stream` and a repair take EXCLUSIVE (or
/// ACCESS EXCLUSIVE, a drop of the sequence) on it, so they wait for every
/// transaction allocating from it, and every later allocation waits for
/// them and then sees their change.
///
/// The wait is bounded (`sql::with_lock_wait_bound`): allocations queue
/// behind a lock request that waits, and any role may hold a lock that
/// conflicts with it (parse analysis of a statement it may PREPARE locks
/// before checking privileges). Past the bound: 55P03, naming the sequence.
pub fn lock_against_allocation(
    seq: pg_sys::Oid,
    mode: pg_sys::LOCKMODE,
    stream: &str,
    action: &'static str,
) {
    // SAFETY: takes a heavyweight lock held to the end of the transaction,
    // if it is free now.
    if unsafe { pg_sys::ConditionalLockRelationOid(seq, mode) } {
        return;
    }
    let message = format!(
        "could not lock sequence {} of stream \"{}\" for {action}",
        sql::relation_name(seq),
        crate::error::clip(stream)
    );
    sql::with_lock_wait_bound(|| {
        let detail = format!(
            "Another session holds a lock on it: it allocates from the stream, or holds a lock any role may take. {action} waits at most {} ms, so that the stream's writers do not queue behind it.",
            sql::lock_wait_bound_ms()
        );
        // SAFETY: as above, waiting at most lock_timeout; a failed wait (a
        // timeout, a cancel, a deadlock) is an ERROR that pgrx's binding
        // carries to the catch (no second guard: see `with_page`).
        pgrx::PgTryBuilder::new(|| unsafe { pg_sys::LockRelationOid(seq, mode) })
            .catch_when(pgrx::PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE, |_| {
                Error::LockTimeout {
                    message: message.clone(),
                    detail: detail.clone(),
                }
                .report()
            })
            .execute()
    })
}

/// Refuse a sequence a stream cannot use: not a sequence, or not permanent
/// (an UNLOGGED sequence resets at crash recovery and would hand out its IDs
/// again; a TEMP one is another session's).
pub fn check_usable(seq: pg_sys::Oid) {
    with_page(seq, Need::Permanent, |_| ());
}

/// Does relation `seq` exist (a stream's sequence goes with the table of
/// its bigserial when that is dropped)?
pub fn exists(seq: pg_sys::Oid) -> bool {
    // SAFETY: a syscache lookup; raises no error.
    unsafe {
        pg_sys::SearchSysCacheExists(
            pg_sys::SysCacheIdentifier::RELOID as i32,
            pg_sys::Datum::from(seq),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
            pg_sys::Datum::from(0),
        )
    }
}

/// Refuse (55000) a stream whose sequence no longer exists.
pub fn require_exists(seq: pg_sys::Oid, stream: &str) {
    if !exists(seq) {
        Error::SequenceDropped(stream.into()).report();
    }
}

/// Refuse an allocation the caller may not make: `nextval` needs USAGE or
/// UPDATE on the sequence, and so does `next_id`.
pub fn check_may_allocate(seq: pg_sys::Oid, stream: &str) {
    require_exists(seq, stream);
    // SAFETY: a catalog lookup for the current role; raises an ERROR itself
    // only for a missing relation.
    let result = unsafe {
        pg_sys::pg_class_aclcheck(
            seq,
            ffi::unguarded::GetUserId(),
            (pg_sys::ACL_USAGE | pg_sys::ACL_UPDATE) as pg_sys::AclMode,
        )
    };
    if result != pg_sys::AclResult::ACLCHECK_OK {
        Error::MayNotAllocate {
            stream: stream.into(),
            seq: sql::relation_name(seq),
        }
        .report();
    }
}

/// Does `role` own the sequence (or a role whose privileges it has)?
pub fn is_owner(seq: pg_sys::Oid, role: pg_sys::Oid) -> bool {
    // SAFETY: a catalog lookup; raises no error for an existing relation.
    // PostgreSQL 16 replaced the per-kind ownership checks with one.
    unsafe {
        #[cfg(any(feature = "pg14", feature = "pg15"))]
        return pg_sys::pg_class_ownercheck(seq, role);
        #[cfg(not(any(feature = "pg14", feature = "pg15")))]
        return pg_sys::object_ownercheck(pg_sys::RelationRelationId, seq, role);
    }
}

/// Refuse a repair the caller may not make, before it holds the sequence
/// against allocation: `setval` needs UPDATE, and a caller without it must
/// not be able to block the stream's writers.
pub fn check_may_repair(seq: pg_sys::Oid, stream: &str) {
    require_exists(seq, stream);
    // SAFETY: as in `check_may_allocate`.
    let result = unsafe {
        pg_sys::pg_class_aclcheck(
            seq,
            ffi::unguarded::GetUserId(),
            pg_sys::ACL_UPDATE as pg_sys::AclMode,
        )
    };
    if result != pg_sys::AclResult::ACLCHECK_OK {
        Error::MayNotRepair {
            stream: stream.into(),
            seq: sql::relation_name(seq),
        }
        .report();
    }
}

/// A stream's sequence opened for one allocation: checked usable (a
/// sequence, permanent), and held (RowExclusiveLock, as `nextval` takes it,
/// until the transaction ends; `nextval`'s own lock request then finds it
/// held; see `lock_against_allocation`). One open serves the check, the
/// lock and the WAL position read after `nextval`.
pub struct ForAllocation {
    rel: pg_sys::Relation,
}

thread_local! {
    /// The buffer that held each sequence's page when this backend last
    /// read its WAL position: `ReadRecentBuffer` pins it again without a
    /// buffer mapping lookup when it still does (it checks).
    static RECENT_PAGE: std::cell::RefCell<FastMap<pg_sys::Oid, pg_sys::Buffer>> =
        std::cell::RefCell::new(FastMap::default());
}

/// Open `seq` to allocate from it (waiting for a `drop_stream` that holds
/// it), or raise the error `check_usable` raises; None when the sequence
/// was dropped meanwhile. Privileges are checked by `check_may_allocate`
/// first.
pub fn open_for_allocation(seq: pg_sys::Oid) -> Option<ForAllocation> {
    // SAFETY: opens and locks the relation (a failed lock wait is a
    // PostgreSQL ERROR crossing the guarded boundary; the closure owns
    // nothing to drop); a relation that is not usable is closed again before
    // the error is raised.
    let (kind, persistence, rel) = unsafe {
        pg_sys::ffi::pg_guard_ffi_boundary(|| {
            let rel =
                in_boundary::try_relation_open(seq, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE);
            if rel.is_null() {
                return (0, 0, Ok(None));
            }
            let kind = (*(*rel).rd_rel).relkind as u8;
            let persistence = (*(*rel).rd_rel).relpersistence as u8;
            if kind != pg_sys::RELKIND_SEQUENCE || persistence != pg_sys::RELPERSISTENCE_PERMANENT {
                in_boundary::relation_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
                return (kind, persistence, Err(()));
            }
            (kind, persistence, Ok(Some(rel)))
        })
    };
    match rel {
        Ok(rel) => rel.map(|rel| ForAllocation { rel }),
        Err(()) if kind != pg_sys::RELKIND_SEQUENCE => {
            Error::NotASequence(sql::relation_name(seq)).report()
        }
        Err(()) => Error::NotPermanent {
            seq: sql::relation_name(seq),
            unlogged: persistence == pg_sys::RELPERSISTENCE_UNLOGGED,
        }
        .report(),
    }
}

impl ForAllocation {
    /// Not allocating after all (the stream changed meanwhile): close the
    /// relation; the lock stays until the transaction ends.
    pub fn close(self) {
        // SAFETY: the relation is open (by `open_for_allocation`).
        unsafe {
            pg_sys::relation_close(self.rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        }
    }

    /// `n` values of the sequence, and the end of the WAL record that makes
    /// them survive a crash: the LSN of the sequence's page after the last
    /// `nextval` (nextval logs 32 values ahead, whichever backend's call
    /// wrote it). Closes the relation (the lock stays until the transaction
    /// ends). On an ERROR the relation is closed by the abort.
    pub fn next_values(self, n: i32) -> (Vec<i64>, u64) {
        let mut ids = Vec::with_capacity(n.max(0) as usize);
        let ids_out = &mut ids;
        // SAFETY: `rel` is a usable sequence (checked), open and locked.
        let relid = unsafe { (*self.rel).rd_id };
        let recent = RECENT_PAGE.with(|r| r.borrow().get(&relid).copied());
        // SAFETY: nextval's ERRORs (reaching MAXVALUE) and the buffer
        // manager's cross the guarded boundary, and the closure owns nothing
        // to drop (the IDs go to the caller's vector); block 0 of a sequence
        // always exists, and its page is read while the buffer is pinned and
        // share-locked.
        let (lsn, buffer) = unsafe {
            pg_sys::ffi::pg_guard_ffi_boundary(|| {
                for _ in 0..n {
                    ids_out.push(ffi::nextval_internal(relid, false));
                }
                let buffer = match recent {
                    Some(b)
                        if in_boundary::ReadRecentBuffer(
                            file_of(self.rel),
                            pg_sys::ForkNumber::MAIN_FORKNUM,
                            0,
                            b,
                        ) =>
                    {
                        b
                    }
                    _ => in_boundary::ReadBuffer(self.rel, 0),
                };
                in_boundary::LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as i32);
                let page = pg_sys::BufferBlocks.add((buffer as usize - 1) * pg_sys::BLCKSZ as usize)
                    as *const pg_sys::PageHeaderData;
                let lsn = (*page).pd_lsn;
                in_boundary::UnlockReleaseBuffer(buffer);
                in_boundary::relation_close(self.rel, pg_sys::NoLock as pg_sys::LOCKMODE);
                ((lsn.xlogid as u64) << 32 | lsn.xrecoff as u64, buffer)
            })
        };
        if recent != Some(buffer) {
            RECENT_PAGE.with(|r| r.borrow_mut().insert(relid, buffer));
        }
        (ids, lsn)
    }
}

/// The file of an open relation (PostgreSQL 16 renamed `rd_node` to
/// `rd_locator`, with its type).
///
/// # Safety
/// `rel` is an open relation.
unsafe fn file_of(rel: pg_sys::Relation) -> in_boundary::RelFileLocator {
    // SAFETY: forwarded from the caller.
    #[cfg(any(feature = "pg14", feature = "pg15"))]
    return unsafe { (*rel).rd_node };
    // SAFETY: forwarded from the caller.
    #[cfg(not(any(feature = "pg14", feature = "pg15")))]
    return unsafe { (*rel).rd_locator };
}

/// The highest value the sequence has handed out (internal numbering):
/// `last_value`, or one less while `is_called` is false (not handed out).
pub fn max_allocated(seq: pg_sys::Oid) -> i64 {
    let (last, called) = with_page(seq, Need::Readable, |page| {
        // SAFETY: a sequence page holds exactly one tuple, at the first line
        // pointer; its data starts at t_hoff and is a SequenceData. The page
        // is share-locked while it is read.
        unsafe {
            let item = &*(*page).pd_linp.as_ptr();
            let tuple = (page as *const u8).add(item.lp_off() as usize)
                as *const pg_sys::HeapTupleHeaderData;
            let data = (tuple as *const u8).add((*tuple).t_hoff as usize) as *const SequenceData;
            let data = std::ptr::read_unaligned(data);
            (data.last_value, data.is_called)
        }
    });
    if called {
        last
    } else {
        last.saturating_sub(1)
    }
}

/// The settings a stream's sequence must have.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    pub increment: i64,
    pub cache: i64,
    pub min: i64,
    pub cycle: bool,
}

impl Settings {
    /// What is wrong with them, as (message, detail), for `sequence_name`.
    /// INCREMENT and CACHE 1: with a cache, backends hand out IDs out of
    /// order. MINVALUE 1 or more and NO CYCLE: IDs are positive and never
    /// handed out twice.
    pub fn problem(&self, sequence_name: &str) -> Option<(String, String)> {
        if self.increment != 1 || self.cache != 1 {
            return Some((
                format!("sequence {sequence_name} must have INCREMENT 1 and CACHE 1"),
                format!(
                    "It has INCREMENT {} and CACHE {}. With a cache, backends hand out IDs out of order, which no registry can see.",
                    self.increment, self.cache
                ),
            ));
        }
        if self.min < 1 || self.cycle {
            return Some((
                format!("sequence {sequence_name} must have MINVALUE 1 or more and NO CYCLE"),
                format!(
                    "It has MINVALUE {}{}. Stream IDs are positive and never handed out twice.",
                    self.min,
                    if self.cycle {
                        " and CYCLE"
                    } else {
                        " and NO CYCLE"
                    }
                ),
            ));
        }
        None
    }
}

/// The sequence's settings, or None when `seq` is not a sequence.
pub fn settings(seq: pg_sys::Oid) -> Option<Settings> {
    sql::sequence_settings(seq).map(|(increment, cache, min, cycle)| Settings {
        increment,
        cache,
        min,
        cycle,
    })
}
