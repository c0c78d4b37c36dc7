//! History marks: before a stream's first allocation in a history that may
//! lack another's, its lost range is stored in the allocating transaction
//! (docs/design.md, "Failover").

use std::cell::RefCell;

use pgrx::pg_sys;

use crate::catalog::StreamMeta;
use crate::error::OrRaise;
use crate::registry::history;
use crate::sql;

use super::index::with_index;
use super::load::have_at_most;

thread_local! {
    /// Streams (keys) whose history mark this transaction stored.
    static MARKED: RefCell<Vec<i32>> = const { RefCell::new(Vec::new()) };
    /// Streams (key, sequence) whose mark this backend saw stored.
    static KNOWN_MARKED: RefCell<std::collections::HashSet<(i32, pg_sys::Oid)>> =
        RefCell::new(std::collections::HashSet::new());
}

/// Before the first allocation of a stream in a history that may lack
/// another's: store its mark, in the allocating transaction (an ID of the
/// history is then never durable without it), so that a restart finds the
/// range when the sequence has moved on.
pub(super) fn record_history_mark(meta: &StreamMeta) {
    let history = history::current().or_raise();
    if history == 0 || KNOWN_MARKED.with(|k| k.borrow().contains(&(meta.key, meta.seq))) {
        return;
    }
    let lost = with_index(meta, |index| {
        history::lost_ranges(index, meta.key, meta.seq)
    });
    let Some((range, recorded)) = lost.current else {
        return;
    };
    if !recorded {
        sql::insert_history_mark(history, &meta.name, range.have, range.ceiling);
        MARKED.with(|m| m.borrow_mut().push(meta.key));
    } else {
        // Stored for good (marks are never deleted while the stream
        // lives): later allocations of this backend need not ask.
        KNOWN_MARKED.with(|k| k.borrow_mut().insert((meta.key, meta.seq)));
    }
}

/// A table was added to a stream: if the stream's mark in the current
/// history is not stored yet (nothing was allocated in it), what this
/// server has may now reach further (an adopted stream's tables are
/// registered after its first use).
pub fn table_added(meta: &StreamMeta) {
    if history::current().unwrap_or(0) == 0 {
        return;
    }
    let lost = with_index(meta, |index| {
        history::lost_ranges(index, meta.key, meta.seq)
    });
    if let Some((range, false)) = lost.current {
        let have = have_at_most(meta, range.ceiling);
        with_index(meta, |index| {
            history::raise_have(index, meta.key, meta.seq, have)
        });
    }
}

/// The commit (or abort) callback: marks stored by the transaction are now
/// there for every later load (or are not).
pub fn end_transaction_marks(committed: bool) {
    let keys = MARKED.with(|m| std::mem::take(&mut *m.borrow_mut()));
    if committed {
        history::marks_recorded(&keys);
    }
}

/// A rolled-back savepoint may have taken a stored mark back: store it
/// again at the next allocation (it is stored once, whatever happens).
pub fn forget_marks() {
    MARKED.with(|m| m.borrow_mut().clear());
}
