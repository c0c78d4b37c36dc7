//! Whether a row (writer, stream ID) lies between two tokens.
//!
//! A row's writer is an instance id, or `None` for a row without one. What
//! `None` means is the caller's to decide: Synapse's room helpers
//! (`_filter_results`, `_filter_results_by_stream`) read such a row as
//! written by the instance named [`UNNAMED_WRITER`], and its multi-writer
//! helpers (`is_stream_position_in_range`,
//! `make_multiwriter_sharded_token_bounds_sql`) compare it against each
//! token's minimum. These functions take `None` as the minimum; a caller
//! that follows the room helpers passes the id of [`UNNAMED_WRITER`] instead
//! (and `None` only when no instance has that name: then no token can be
//! ahead for it, so its position is every token's minimum anyway).

use super::Token;

/// The instance Synapse's room range helpers take a row without an
/// instance name to be written by (`instance_name = "master"` when `None`).
pub const UNNAMED_WRITER: &str = "master";

/// Whether `stream_id`, written by `instance_id`, lies in `low < position <=
/// high` for that writer. A `None` bound is unbounded; a `None` instance uses
/// each token's stream position (its minimum). A historical bound counts as
/// its live view `s{stream}` (Synapse's `_filter_results_by_stream`, the
/// room form of this test, refuses one).
pub fn in_range(
    low: Option<&Token>,
    high: Option<&Token>,
    instance_id: Option<i32>,
    stream_id: i64,
) -> bool {
    let pos = |t: &Token| match instance_id {
        Some(i) => t.instance_pos(i),
        None => t.stream,
    };
    if let Some(l) = low {
        if stream_id <= pos(l) {
            return false;
        }
    }
    if let Some(h) = high {
        if stream_id > pos(h) {
            return false;
        }
    }
    true
}

/// Synapse's `_filter_results` for paginating a room (for `_filter_results_by_stream`,
/// the same without a topological part, use [`in_range`]): for each non-`None`
/// bound, a historical bound compares `(topological, stream_id)` tuples — the
/// event is excluded if `(topo, sid) <= (low.topo, low.stream)`, or if
/// `(high.topo, high.stream) < (topo, sid)`; a live bound compares
/// `stream_id` against the writer's position (instance `None` → the token's
/// stream) as [`in_range`] does.
pub fn in_range_room(
    low: Option<&Token>,
    high: Option<&Token>,
    instance_id: Option<i32>,
    topological: i64,
    stream_id: i64,
) -> bool {
    let pos = |t: &Token| match instance_id {
        Some(i) => t.instance_pos(i),
        None => t.stream,
    };
    let event = (topological, stream_id);
    if let Some(l) = low {
        match l.topological {
            Some(lt) => {
                if event <= (lt, l.stream) {
                    return false;
                }
            }
            None => {
                if stream_id <= pos(l) {
                    return false;
                }
            }
        }
    }
    if let Some(h) = high {
        match h.topological {
            Some(ht) => {
                if (ht, h.stream) < event {
                    return false;
                }
            }
            None => {
                if pos(h) < stream_id {
                    return false;
                }
            }
        }
    }
    true
}
