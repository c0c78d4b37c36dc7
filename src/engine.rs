//! The stream engine between the SQL functions and the registry: allocation,
//! the view a reader's snapshot gets (computed once per statement), the hot
//! standby's view, and which writers a token lists.

use pgrx::pg_sys;
use streampos_core::frontier;

use crate::catalog::{self, StreamMeta};
use crate::error::{Error, OrRaise};
use crate::registry::{self, StreamView};
use crate::{guc, sequence, worker};

/// Most IDs one call may allocate.
pub const MAX_IDS_PER_CALL: i32 = 1_000_000;

pub fn in_recovery() -> bool {
    // SAFETY: reads shared recovery state; raises no error.
    unsafe { pg_sys::RecoveryInProgress() }
}

/// The registry slot of a stream, loading its maximum allocated ID from the
/// sequence the first time after start-up.
pub fn registry_index(meta: &StreamMeta) -> usize {
    registry::require_loaded().or_raise();
    let (index, loaded) = registry::stream_index(meta.key).or_raise();
    if !loaded {
        let max = sequence::max_allocated(meta);
        let stored: Vec<i32> = catalog::stored_positions(&meta.name)
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        registry::set_loaded(index, max, &stored).or_raise();
    }
    index
}

/// Run `f` with the stream's registry index. The index is cached per
/// backend and validated by `f` under the registry lock; if it went stale
/// (the stream was dropped and its state reused), look it up again.
pub fn with_index<T>(
    meta: &StreamMeta,
    f: impl Fn(usize) -> Result<Result<T, registry::Stale>, Error>,
) -> T {
    for _ in 0..2 {
        let index = registry_index(meta);
        match f(index).or_raise() {
            Ok(value) => return value,
            Err(registry::Stale) => registry::forget_index(meta.key),
        }
    }
    Error::Retry {
        message: format!("stream \"{}\" was dropped concurrently", meta.name),
    }
    .report()
}

// --------------------------------------------------------------- allocation

/// Allocate `n` IDs of `stream` for `writer` in the current transaction.
pub fn allocate(stream: &str, writer: &str, n: i32) -> Vec<i64> {
    registry::require_loaded().or_raise();
    if !(1..=MAX_IDS_PER_CALL).contains(&n) {
        Error::InvalidArgument {
            message: format!("cannot allocate {n} IDs"),
            detail: Some(format!("n must be between 1 and {MAX_IDS_PER_CALL}.")),
        }
        .report();
    }
    if in_recovery() {
        Error::ReadOnly("during recovery").report();
    }
    // SAFETY: plain read of the transaction's read-only flag.
    if unsafe { pg_sys::XactReadOnly } {
        Error::ReadOnly("in a read-only transaction").report();
    }
    let meta = catalog::stream(stream).or_raise();
    catalog::validate_instance_name(writer).or_raise();
    if !meta.allows(writer) {
        Error::NotAWriter {
            stream: stream.into(),
            instance: writer.into(),
        }
        .report();
    }
    let instance = catalog::instance_id(writer).or_raise();
    if worker::ensure_running() {
        registry::prune_if_crowded().or_raise();
    }
    // Visibility checks compare against this xid.
    // SAFETY: assigns (or returns) this transaction's top xid; may raise an
    // ERROR, which is fine here.
    let xid = unsafe { pg_sys::GetTopTransactionId() };
    let (index, entry) = with_index(&meta, |index| {
        Ok(registry::begin_allocation(index, meta.key, instance, xid)?.map(|entry| (index, entry)))
    });
    let delay = guc::ALLOCATION_DELAY_MS.get();
    if delay > 0 {
        // SAFETY: sleeps this backend; interrupts are checked afterwards.
        unsafe { pg_sys::pg_usleep(delay as i64 * 1000) };
    }
    let mut ids = Vec::with_capacity(n as usize);
    for _ in 0..n {
        ids.push(sequence::nextval(meta.seq));
    }
    let first = ids.first().copied().unwrap_or(0);
    let last = ids.last().copied().unwrap_or(0);
    let lsn = sequence::page_lsn(meta.seq);
    registry::finish_allocation(index, entry, instance, first, last, n as i64, lsn).or_raise();
    if meta.backwards {
        ids.iter_mut().for_each(|id| *id = -*id);
    }
    ids
}

// ------------------------------------------------------------------ reading

/// What the caller's statement must treat as in flight for `meta`'s stream.
pub fn view(meta: &StreamMeta) -> StreamView {
    if in_recovery() {
        return standby_view(meta);
    }
    let snapshot = registry::caller_snapshot();
    let key = ViewKey::of(meta.key, snapshot);
    let cached = VIEW_CACHE.with(|c| {
        c.borrow()
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.clone())
    });
    if let Some(v) = cached {
        return v;
    }
    let v = with_index(meta, |index| registry::view(index, meta.key, snapshot));
    VIEW_CACHE.with(|c| {
        let mut cache = c.borrow_mut();
        cache.retain(|(k, _)| k.statement == key.statement);
        if cache.len() >= 16 {
            cache.remove(0);
        }
        cache.push((key, v.clone()));
    });
    v
}

/// The view for an explicitly chosen snapshot (followers), not cached.
pub fn view_for(meta: &StreamMeta, snapshot: pg_sys::Snapshot) -> StreamView {
    with_index(meta, |index| registry::view(index, meta.key, snapshot))
}

/// One statement's snapshot, as far as positions are concerned.
#[derive(Clone, Copy, PartialEq, Eq)]
struct ViewKey {
    stream: i32,
    snapshot: usize,
    xmin: u32,
    xmax: u32,
    completion_count: u64,
    statement: pg_sys::TimestampTz,
}

impl ViewKey {
    fn of(stream: i32, snapshot: pg_sys::Snapshot) -> ViewKey {
        // SAFETY: `snapshot` is the caller's valid snapshot.
        unsafe {
            ViewKey {
                stream,
                snapshot: snapshot as usize,
                xmin: (*snapshot).xmin.into_inner(),
                xmax: (*snapshot).xmax.into_inner(),
                completion_count: (*snapshot).snapXactCompletionCount,
                statement: pg_sys::GetCurrentStatementStartTimestamp(),
            }
        }
    }
}

thread_local! {
    /// Answers already given in this statement. `frontier()` is STABLE: the
    /// same statement must get the same answer, or `WHERE id <= frontier(s)`
    /// could filter early rows with one value and report a later, higher
    /// one (an abort or a WAL flush moves the answer for the same
    /// snapshot). A cached answer stays correct for the snapshot: IDs
    /// allocated since are above it.
    static VIEW_CACHE: std::cell::RefCell<Vec<(ViewKey, StreamView)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// A hot standby cannot see what is in flight on the primary (and its
/// sequences may be up to 32 ahead of what was handed out), so it answers
/// from the durable positions, which replicate in commit order and are never
/// ahead of the truth. Writers without a stored position read as the
/// frontier (see writer_position).
fn standby_view(meta: &StreamMeta) -> StreamView {
    let stored = catalog::stored_positions(&meta.name);
    let max_allocated = stored.iter().map(|(_, p)| *p).max().unwrap_or(0);
    let holders = stored
        .iter()
        .filter(|(_, p)| *p < max_allocated)
        .map(|(w, p)| frontier::Holder {
            held_by: frontier::HeldBy::Writer(*w),
            min_id: p + 1,
        })
        .collect();
    StreamView {
        max_allocated,
        holders,
        seen: stored.iter().map(|(w, _)| *w).collect(),
    }
}

/// The writers a token or `writer_positions` reports: the configured ones,
/// or for an open stream every instance seen writing since start-up (or
/// with a stored position when the stream was first used) or holding IDs now.
pub fn writer_ids(meta: &StreamMeta, v: &StreamView) -> Vec<i32> {
    let mut ids: Vec<i32> = match &meta.writers {
        Some(names) => names
            .iter()
            .filter_map(|n| catalog::lookup_instance_id(n))
            .collect(),
        None => {
            let mut ids = v.seen.clone();
            ids.extend(v.holders.iter().filter_map(|h| match h.held_by {
                frontier::HeldBy::Writer(w) => Some(w),
                frontier::HeldBy::AllWriters => None,
            }));
            ids
        }
    };
    ids.sort_unstable();
    ids.dedup();
    ids
}
