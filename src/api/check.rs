//! `check_stream`: the sequence against the stream's tables and stored
//! positions; repair moves the sequence forward, never backward.

use pgrx::prelude::*;

use crate::catalog;
use crate::engine;
use crate::error::OrRaise;
use crate::{registry, sequence, sql};

#[pg_extern(volatile, parallel_unsafe)]
fn check_stream(
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
    let meta = catalog::stream(stream).or_raise();
    let mut rows = Vec::new();

    let (increment, cache) = sequence::settings(meta.seq).unwrap_or((0, 0));
    rows.push((
        "sequence".to_string(),
        increment == 1 && cache == 1,
        format!(
            "{} has INCREMENT {increment} and CACHE {cache} (both must be 1)",
            meta.seq_name
        ),
    ));

    let seq_max = sequence::max_allocated(&meta);
    // Highest ID (internal numbering) found in the stream's tables.
    let mut needed = seq_max;
    for (table, column) in sql::stream_tables_for_check(stream) {
        let highest = sql::table_max_id(&table, &column, meta.backwards).unwrap_or(0);
        let ok = highest <= seq_max;
        needed = needed.max(highest);
        rows.push((
            format!("table {table}"),
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
    let stored = sql::max_stored_position(stream).unwrap_or(0);
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
    if needed > seq_max {
        if repair {
            // Move the sequence forward; never delete positions or rows.
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
