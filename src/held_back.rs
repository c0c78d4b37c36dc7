//! Held-back warnings: the position worker, at each pass, names what has
//! held a stream's frontier back for longer than
//! `streampos.log_held_back_after` (a transaction, a session's hold, the
//! holds of a session that ended, or IDs not yet durable) in one WARNING,
//! and says in one LOG line when it ended. The line an operator greps for
//! when messages are late.

use std::collections::HashMap;
use std::rc::Rc;

use pgrx::prelude::*;

use crate::catalog::StreamMeta;
use crate::error::clip;
use crate::{guc, registry};

/// What the worker saw of a stream in a pass (internal numbering).
pub struct Seen {
    pub key: i32,
    pub meta: Rc<StreamMeta>,
    pub frontier: i64,
    pub max_allocated: i64,
    /// Since when the frontier has not moved while IDs above it were
    /// allocated (0: it is not held back).
    pub held_since: pg_sys::TimestampTz,
}

/// Who holds a stream back: an entry of `in_flight()`, or IDs that no
/// running transaction holds (they wait to be durable).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct Holder {
    key: i32,
    pid: Option<i32>,
    /// A transaction's entry (with an xid), not a session's hold.
    transaction: bool,
    min_id: i64,
    since: pg_sys::TimestampTz,
}

/// A holder warned about, with what its end message says.
struct Warning {
    stream: String,
    who: String,
    id: i64,
    held_since: pg_sys::TimestampTz,
}

/// The holders warned about and not yet ended.
#[derive(Default)]
pub struct Warned {
    warned: HashMap<Holder, Warning>,
}

impl Warned {
    pub fn is_empty(&self) -> bool {
        self.warned.is_empty()
    }
}

fn seconds(from: pg_sys::TimestampTz, to: pg_sys::TimestampTz) -> f64 {
    (to - from).max(0) as f64 / 1_000_000.0
}

/// Warn about each stream held back longer than the setting (once per
/// holder), and say when a holder warned about has ended.
pub fn check(db: pg_sys::Oid, seen: &[Seen], warned: &mut Warned, now: pg_sys::TimestampTz) {
    let after_us = i64::from(guc::LOG_HELD_BACK_AFTER_MS.get()) * 1000;
    let late: Vec<&Seen> = seen
        .iter()
        .filter(|s| after_us > 0 && s.held_since != 0 && now - s.held_since >= after_us)
        .collect();
    if late.is_empty() && warned.is_empty() {
        return;
    }
    let rows: Vec<registry::InFlight> = registry::in_flight()
        .unwrap_or_default()
        .into_iter()
        .filter(|r| r.db == db)
        .collect();
    let holder_of = |r: &registry::InFlight| Holder {
        key: r.key,
        pid: r.pid,
        transaction: r.xid.is_some(),
        min_id: r.min_id,
        since: r.since,
    };
    // Ended: no longer in flight (or, for IDs waiting to be durable, the
    // frontier moved past them).
    warned.warned.retain(|holder, w| {
        let still = if holder.pid.is_none() && holder.since == 0 && !holder.transaction {
            let orphaned = rows
                .iter()
                .any(|r| r.key == holder.key && r.pid.is_none() && r.min_id == holder.min_id);
            let undurable = seen
                .iter()
                .any(|s| s.key == holder.key && s.held_since != 0 && s.frontier + 1 == holder.min_id);
            orphaned || undurable
        } else {
            rows.iter().any(|r| holder_of(r) == *holder)
        };
        if !still {
            pgrx::log!(
                "streampos: stream \"{}\" is no longer held back by ID {} {}: it held the stream back for {:.1} s",
                w.stream,
                w.id,
                w.who,
                seconds(w.held_since, now)
            );
        }
        still
    });
    for s in late {
        let meta = &s.meta;
        let of_stream: Vec<&registry::InFlight> = rows.iter().filter(|r| r.key == s.key).collect();
        let in_flight_ids: i64 = of_stream.iter().map(|r| r.ids).sum();
        let finished_above = (s.max_allocated - s.frontier - in_flight_ids).max(0);
        // The entry with the lowest ID is the one the frontier waits for.
        let lowest = of_stream.iter().min_by_key(|r| r.min_id);
        let (holder, who) = match lowest {
            Some(r) if r.min_id <= s.frontier + 1 => {
                let who = match (&r.instance_name, r.pid) {
                    (Some(name), Some(pid)) if r.xid.is_some() => format!(
                        "of instance \"{}\" (pid {pid}, its transaction started {:.1} s ago)",
                        clip(name),
                        seconds(r.since, now)
                    ),
                    (Some(name), Some(pid)) => format!(
                        "held by instance \"{}\" (pid {pid}, a hold of its session, taken {:.1} s ago)",
                        clip(name),
                        seconds(r.since, now)
                    ),
                    _ => "held by a session that ended (released once every transaction running then has ended)"
                        .to_string(),
                };
                (holder_of(r), who)
            }
            // Nothing in flight below: the IDs wait to be durable (flushed,
            // and confirmed by synchronous standbys when there are any).
            _ => (
                Holder {
                    key: s.key,
                    pid: None,
                    transaction: false,
                    min_id: s.frontier + 1,
                    since: 0,
                },
                "that is not durable yet (is a synchronous standby away?)".to_string(),
            ),
        };
        if warned.warned.contains_key(&holder) {
            continue;
        }
        let id = meta.external(holder.min_id);
        let stream = clip(&meta.name);
        ereport!(
            PgLogLevel::WARNING,
            PgSqlErrorCode::ERRCODE_WARNING,
            format!(
                "streampos: stream \"{stream}\" held back for {:.1} s by ID {id} {who}; {finished_above} IDs above it are finished and wait for it",
                seconds(s.held_since, now)
            )
        );
        warned.warned.insert(
            holder,
            Warning {
                stream: stream.to_string(),
                who: who_for_end(&who),
                id,
                held_since: s.held_since,
            },
        );
    }
}

/// The holder's description for the end message, without what only held
/// when it was warned about (its age then).
fn who_for_end(who: &str) -> String {
    match who.find(", its transaction started") {
        Some(at) => format!("{})", &who[..at]),
        None => match who.find(", a hold of its session") {
            Some(at) => format!("{}, a hold of its session)", &who[..at]),
            None => who.to_string(),
        },
    }
}
