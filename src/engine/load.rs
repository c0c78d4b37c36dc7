//! The cold path: a stream's first use after a start (its maximum
//! allocated ID from the sequence, its stored writers, its lost ranges and
//! what prepared transactions may still commit), and the error for a
//! stream dropped while it was being used.

use pgrx::pg_sys;

use crate::catalog::StreamMeta;
use crate::error::{Error, OrRaise};
use crate::registry;
use crate::registry::history::{self, LostRange, LostRanges};
use crate::{prepared, sequence, sql};

/// Load stream `meta` into registry slot `index` (see
/// `index::registry_index`, which found it not loaded).
pub(super) fn load_stream(meta: &StreamMeta, index: usize) {
    sequence::require_exists(meta.seq, &meta.name);
    // IDs are positive: a sequence altered below 1 has handed out none.
    let max = sequence::max_allocated(meta.seq).max(0);
    let mut stored: Vec<i32> = sql::stored_positions(&meta.name)
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let lost = lost_ranges_at_load(meta, max);
    // While nothing was allocated in this history, the highest ID it has
    // is `have`: no position of this server ever falls in the lost range.
    let highest = match lost.current {
        Some((range, _)) if max <= range.ceiling => range.have.min(max),
        _ => max,
    };
    let orphaned: Vec<(i32, i64)> = prepared_floors(meta)
        .into_iter()
        .filter(|&(_, floor)| floor <= highest)
        .collect();
    if !orphaned.is_empty() {
        // The frontier is held back: a writer ahead of it that the worker
        // had not stored before the stop (a crash within its interval) was
        // listed in tokens then, and must be now, or tokens go back. Every
        // instance that may write the stream is listed from now on (seen
        // writers stay seen; an idle one stands at the highest ID).
        let mut others: Vec<i32> = sql::instance_names()
            .into_iter()
            .filter(|(id, name)| {
                !stored.contains(id) && meta.writers.as_ref().is_none_or(|w| w.contains(name))
            })
            .map(|(id, _)| id)
            .collect();
        others.sort_unstable();
        stored.extend(others);
    }
    // False: the state went to another stream meanwhile, which only
    // happens to a dropped stream's state (looking again would take a
    // state for a stream that is gone).
    if !registry::set_loaded(
        index, meta.key, meta.seq, highest, &stored, &lost, &orphaned,
    )
    .or_raise()
    {
        dropped_concurrently(meta)
    }
}

/// What a start leaves that may still commit rows for an ID: a prepared
/// transaction survives every start (a crash, a clean restart, a promotion,
/// recovery to a point in time) and may hold the row of an ID that a hold
/// gave out before, in a session that is gone (docs/design.md, "What
/// outlives a start"). Such a transaction, and every snapshot that cannot
/// see it end, has an xid or xmin below the first xid of this start
/// (`registry::start_xid`): while the oldest of them (the horizon, which
/// counts prepared transactions) is below it, the holds such transactions
/// recorded when they were prepared (`prepared::read`) are in flight as
/// orphaned holds of their writers, until the transactions running then
/// have ended. Decided from what cannot change back: whether the prepared
/// transaction is still there when the stream is first used is no answer
/// for a snapshot taken before its COMMIT PREPARED. Each writer is held
/// from above what was stored as finished for it (its stored position, the
/// stored frontier: never ahead of the truth), so that nothing stored goes
/// back. Empty: nothing is in flight after the start.
fn prepared_floors(meta: &StreamMeta) -> Vec<(i32, i64)> {
    let start = registry::start_xid();
    // SAFETY: reads the next xid and computes the shared horizon; neither
    // raises an error.
    let (next, horizon) = unsafe {
        (
            pg_sys::ReadNextFullTransactionId().value,
            pg_sys::GetOldestNonRemovableTransactionId(std::ptr::null_mut()),
        )
    };
    // The horizon is at most 2^31 xids behind the next one.
    let behind = u64::from((next as u32).wrapping_sub(horizon.into_inner()));
    if start == 0 || next.saturating_sub(behind) >= start {
        return Vec::new();
    }
    // The horizon also counts a standby's feedback and replication slots.
    if !sql::older_than_start(start as u32) {
        return Vec::new();
    }
    let stored = sql::stored_positions(&meta.name);
    let finished = sql::stored_frontier(&meta.name)
        .or_else(|| stored.iter().map(|&(_, p)| p).min())
        .unwrap_or(0)
        .max(0);
    let every_writer = (registry::ALL_WRITERS, finished.saturating_add(1));
    let Some((records, complete)) = prepared::read(meta.key, start as u32) else {
        // A catalog from before 0.4.0 has no records: every writer.
        return vec![every_writer];
    };
    // A transaction prepared before the records existed recorded nothing.
    let unrecorded = (!complete).then_some(every_writer);
    records
        .into_iter()
        .map(|(writer, min_id)| {
            let own = stored
                .iter()
                .filter(|&&(w, _)| w == writer && writer != registry::ALL_WRITERS)
                .map(|&(_, p)| p)
                .max()
                .unwrap_or(finished);
            (writer, min_id.max(own.max(finished).saturating_add(1)))
        })
        .chain(unrecorded)
        .collect()
}

/// The stream's lost ranges (registry/history.rs): the marks of every
/// history in this server's past (they replicate), and the current
/// history's, from its mark or (first use in this history) from the
/// sequence's value `max` and the highest ID this server has at or below
/// it: a row, a stored position or a stored frontier.
fn lost_ranges_at_load(meta: &StreamMeta, max: i64) -> LostRanges {
    let history = history::current().or_raise();
    let mut lost = LostRanges::default();
    for (h, have, ceiling) in sql::history_marks(&meta.name) {
        if h == history && history != 0 {
            lost.current = Some((LostRange { have, ceiling }, true));
        } else {
            lost.ranges.push(LostRange { have, ceiling });
        }
    }
    if history != 0 && lost.current.is_none() {
        lost.current = Some((
            LostRange {
                have: have_at_most(meta, max),
                ceiling: max,
            },
            false,
        ));
    }
    lost
}

/// Whether loading `meta` now would read its tables (`have_at_most`): in a
/// history other than the first, before the stream's mark in it is
/// stored. Monitoring reads lock only what a load reads (an unreadable
/// history counts as reading them).
pub fn loading_reads_tables(meta: &StreamMeta) -> bool {
    match history::current() {
        Ok(0) => false,
        Ok(history) => !sql::history_marks(&meta.name)
            .iter()
            .any(|&(h, _, _)| h == history),
        Err(_) => true,
    }
}

/// The highest ID at or below `at_most` that this server has for the
/// stream: a row of its tables (read as their owners) or a stored position
/// or frontier.
pub(super) fn have_at_most(meta: &StreamMeta, at_most: i64) -> i64 {
    sql::stream_tables(&meta.name)
        .iter()
        .filter_map(|t| sql::table_max_id_at_most(t, at_most, meta.backwards))
        .chain(sql::max_stored_at_most(&meta.name, at_most))
        .max()
        .unwrap_or(0)
        .clamp(0, at_most)
}

/// 40001: the stream was dropped (or dropped and created again) while this
/// call was using it.
pub fn dropped_concurrently(meta: &StreamMeta) -> ! {
    Error::Retry {
        message: format!(
            "stream \"{}\" was dropped concurrently",
            crate::error::clip(&meta.name)
        ),
    }
    .report()
}
