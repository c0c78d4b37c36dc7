//! `check_stream`: the sequence against the stream's tables, its stored
//! positions and what this server handed out; repair moves the sequence
//! forward, never backward. On a hot standby the checks run read-only.

use pgrx::prelude::*;

use crate::catalog;
use crate::engine::{self, in_recovery};
use crate::error::{Error, OrRaise};
use crate::{registry, sequence, sql};

#[pg_extern(volatile, parallel_unsafe)]
pub(super) fn check_stream(
    stream: &str,
    repair: default!(bool, false),
) -> TableIterator<
    'static,
    (
        name!(check_name, String),
        name!(ok, bool),
        name!(detail, String),
    ),
> {
    // The stream as it is now (a repair acts on it; adopt_synapse checks
    // streams it registered in the same statement).
    let meta = catalog::stream_latest(stream).or_raise();
    if repair && in_recovery() {
        Error::Recovery("repair a stream").report();
    }
    // Dropped with the table of its bigserial: nothing else can be checked,
    // and nothing repaired (the stream's IDs are gone with it).
    if !sequence::exists(meta.seq) {
        return TableIterator::new(vec![(
            "sequence".to_string(),
            false,
            "the stream's sequence was dropped; streampos.drop_stream() forgets the stream"
                .to_string(),
        )]);
    }
    let mut checked = checks(&meta);
    // What was read may be a moment old: a writer can have taken values and
    // committed rows since the sequence was read, and moving the sequence
    // to such a value would move it back (and hand those IDs out again). So
    // a repair holds the sequence against allocation (EXCLUSIVE, as
    // drop_stream: it waits for the transactions allocating from it and
    // blocks new ones until this transaction ends) and checks again: now
    // nothing else moves it. Only a caller that may move it (UPDATE, as
    // setval needs) may hold it.
    if repair && checked.needed > checked.seq_max {
        sequence::check_may_repair(meta.seq, stream);
        sequence::lock_against_allocation(
            meta.seq,
            pg_sys::ExclusiveLock as pg_sys::LOCKMODE,
            stream,
            "a repair",
        );
        // A drop_stream that held the sequence first has committed by now.
        let now = catalog::stream_latest(stream).or_raise();
        if now.key != meta.key || now.seq != meta.seq {
            engine::dropped_concurrently(&meta);
        }
        checked = checks(&meta);
    }
    let Checked {
        mut rows,
        seq_max,
        needed,
        forget,
    } = checked;
    if repair && !forget.is_empty() {
        for oid in &forget {
            sql::forget_dropped_stream_table(stream, *oid);
        }
        catalog::mark_changed();
        rows.push((
            "repair".to_string(),
            true,
            format!("forgot {} dropped table(s)", forget.len()),
        ));
    }
    if needed > seq_max {
        if repair {
            // Move the sequence forward (with the caller's privileges, as
            // setval() needs them); never delete positions or rows.
            sql::setval(meta.seq, needed);
            if registry::is_loaded() {
                let index = engine::registry_index(&meta);
                registry::raise_max_allocated(index, needed).or_raise();
            }
            rows.push((
                "repair".to_string(),
                true,
                format!("sequence moved forward to {}", meta.external(needed)),
            ));
        } else {
            rows.push((
                "repair".to_string(),
                false,
                "run streampos.check_stream(…, repair => true) to move the sequence forward"
                    .to_string(),
            ));
        }
    }
    TableIterator::new(rows)
}

struct Checked {
    rows: Vec<(String, bool, String)>,
    /// The highest value the sequence has handed out.
    seq_max: i64,
    /// The highest ID or position anything holds: the sequence must be at
    /// least there.
    needed: i64,
    /// Registered tables that were dropped (a repair forgets them).
    forget: Vec<pg_sys::Oid>,
}

fn checks(meta: &catalog::StreamMeta) -> Checked {
    let stream = meta.name.as_str();
    let mut rows = Vec::new();
    let seq_name = sql::relation_name(meta.seq);

    let settings = sequence::settings(meta.seq);
    let (increment, cache) = settings.map_or((0, 0), |s| (s.increment, s.cache));
    // An UNLOGGED sequence resets at crash recovery (allocation refuses it).
    let persistence = match sql::relation_persistence(meta.seq).as_deref() {
        Some("p") => "",
        Some("u") => " and is UNLOGGED (it must be permanent)",
        _ => " and is not permanent (it must be)",
    };
    // A MINVALUE below 1 or CYCLE (set after the stream was registered):
    // allocation refuses the IDs it would give.
    let range = match settings {
        Some(s) if s.min < 1 || s.cycle => format!(
            "; it has MINVALUE {}{} (it must be 1 or more, NO CYCLE)",
            s.min,
            if s.cycle { " and CYCLE" } else { "" }
        ),
        _ => String::new(),
    };
    rows.push((
        "sequence".to_string(),
        increment == 1 && cache == 1 && persistence.is_empty() && range.is_empty(),
        format!(
            "{seq_name} has INCREMENT {increment} and CACHE {cache} (both must be 1){persistence}{range}"
        ),
    ));

    // What anything holds first, the sequence last: every ID read above
    // was handed out before the sequence is read, so with writers running
    // nothing looks ahead of it unless it really lags (and a repair takes
    // the lock only then).
    let tables: Vec<(String, i64)> = sql::stream_tables(stream)
        .into_iter()
        .map(|table| {
            let highest = sql::table_max_id(&table, meta.backwards).unwrap_or(0);
            (table.name, highest)
        })
        .collect();
    let unusable = sql::unusable_stream_tables(stream);
    let stored = sql::max_stored_position(stream).unwrap_or(0);
    // What this server handed out since start-up: a sequence moved back
    // below it (setval) would hand those IDs out again.
    let allocated = (registry::is_loaded() && !in_recovery())
        .then(|| engine::answer(meta).positions.max_allocated);
    let seq_max = sequence::max_allocated(meta.seq);

    let mut needed = seq_max;
    for (name, highest) in tables {
        let ok = highest <= seq_max;
        needed = needed.max(highest);
        rows.push((
            format!("table {name}"),
            ok,
            if ok {
                format!(
                    "highest ID {} is not above the sequence ({})",
                    meta.external(highest),
                    meta.external(seq_max)
                )
            } else {
                format!(
                    "row with ID {} is above the sequence ({})",
                    meta.external(highest),
                    meta.external(seq_max)
                )
            },
        ));
    }
    // Registered tables that updates() skips: dropped ones are forgotten by
    // a repair; the others need fixing (add_table() again after a rename).
    let mut forget = Vec::new();
    for table in unusable {
        if table.dropped {
            forget.push(table.oid);
        }
        rows.push((
            format!("table oid {}", table.oid.to_u32()),
            false,
            format!("{}; updates() skips it ({})", table.problem, table.advice),
        ));
    }
    let ok = stored <= seq_max;
    needed = needed.max(stored);
    rows.push((
        "positions".to_string(),
        ok,
        if ok {
            format!(
                "stored positions are not ahead of the sequence ({})",
                meta.external(seq_max)
            )
        } else {
            format!(
                "a stored position ({}) is ahead of the sequence ({})",
                meta.external(stored),
                meta.external(seq_max)
            )
        },
    ));
    if let Some(allocated) = allocated {
        let ok = allocated <= seq_max;
        needed = needed.max(allocated);
        rows.push((
            "allocated".to_string(),
            ok,
            if ok {
                format!(
                    "IDs handed out since start-up ({}) are not above the sequence ({})",
                    meta.external(allocated),
                    meta.external(seq_max)
                )
            } else {
                format!(
                    "the sequence ({}) was moved back below IDs already handed out ({})",
                    meta.external(seq_max),
                    meta.external(allocated)
                )
            },
        ));
    }
    Checked {
        rows,
        seq_max,
        needed,
        forget,
    }
}
