//! Which history this server's IDs belong to, and what of a stream's IDs
//! another history may have handed out (docs/design.md, "Lost history").
//!
//! A server that started as a standby, for a point-in-time recovery, from
//! a base backup, or as a standby whose `standby.signal` was removed, may
//! lack commits another server acknowledged: its sequences stand where
//! their last replayed WAL record put them (up to 32 values past what that
//! history handed out), and followers may hold rows it never had. Such a
//! start begins a new *history*, named by an id kept in the data directory
//! (`streampos.history`, written by the postmaster before recovery runs),
//! so that it outlives restarts and promotions. Each stream then has a
//! *mark* for the history (`streampos.history_marks`): `have`, the highest
//! ID this server had, and `ceiling`, the sequence's value when the
//! history began. IDs in (have, ceiling] may exist elsewhere and never
//! here: this server never reports a position in that range (its frontier
//! starts at `have`, then jumps past `ceiling` with its first new ID), and
//! a follower's position in it is refused (72000). The mark is stored with
//! the stream's first allocation in the history (or its creation or
//! adoption), so that a restart finds it when the sequence has moved on.

use std::io::Write;

use pgrx::pg_sys;

use super::shmem::{matches, Locked, Lost, Section, Stale, HEADER, LOST_RANGES};
use crate::error::Error;

const FILE: &str = "streampos.history";

/// The history a start begins or continues: (id, still recovering), or
/// None for a server whose history was never in doubt. Runs in the
/// postmaster, before the startup process (which removes the signal
/// files), in the data directory.
pub(super) fn at_start() -> Option<(u64, bool)> {
    let exists = |name: &str| std::path::Path::new(name).exists();
    let previous = std::fs::read_to_string(FILE).ok().and_then(|text| {
        let mut parts = text.split_whitespace();
        let id = u64::from_str_radix(parts.next()?, 16).ok()?;
        Some((id, parts.next()? == "recovering"))
    });
    let (id, recovering) = if exists("standby.signal") || exists("recovery.signal") {
        (new_id(), true)
    } else if exists("backup_label") {
        // A base backup started as a primary: it has what the backup had.
        (new_id(), false)
    } else {
        match previous {
            // The last start was a standby's, and no promotion was seen
            // (none happened, or standby.signal was removed): this start
            // is the history's first as a primary.
            Some((id, true)) => (id, false),
            Some(kept) => return Some(kept),
            None => return None,
        }
    };
    // Without the file a later start cannot tell the history apart: say
    // so. Marks stored meanwhile (a stream's first allocation in the
    // history stores its mark) are honoured whatever the file says.
    if let Err(e) = write(id, recovering) {
        pgrx::warning!(
            "streampos could not record the server's history in {FILE}: {e}; lost ranges \
             not yet stored in streampos.history_marks are forgotten at the next restart"
        );
    }
    Some((id, recovering))
}

fn new_id() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    (now << 16 ^ u64::from(std::process::id())).max(1)
}

/// Replace the file atomically and durably.
fn write(id: u64, recovering: bool) -> std::io::Result<()> {
    let tmp = format!("{FILE}.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    let state = if recovering { "recovering" } else { "primary" };
    writeln!(f, "{id:016x} {state}")?;
    f.sync_all()?;
    std::fs::rename(&tmp, FILE)?;
    std::fs::File::open(".")?.sync_all()
}

/// The history this server's registry works in (0: never in doubt). The
/// first call after a promotion records it in the file: a later start
/// without a signal file is then not taken for a new history.
pub fn current() -> Result<u64, Error> {
    // SAFETY: HEADER is set once at start-up; the fields read are written
    // at start-up or under the lock.
    let (id, recovering) = unsafe {
        if HEADER.is_null() {
            return Err(Error::NotLoaded);
        }
        ((*HEADER).history_id, (*HEADER).history_recovering)
    };
    if id != 0 && recovering {
        let locked = Locked::acquire(Section::OtherExclusive)?;
        let h = locked.h();
        if h.history_recovering {
            // Best effort, as at start: the worst a lost write costs is a
            // needless resynchronisation after the next start.
            let _ = write(id, false);
            h.history_recovering = false;
        }
    }
    Ok(id)
}

/// One lost range: IDs in (have, ceiling].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LostRange {
    pub have: i64,
    pub ceiling: i64,
}

impl LostRange {
    pub fn contains(&self, position: i64) -> bool {
        position > self.have && position <= self.ceiling
    }
}

/// A stream's lost ranges: the marks of earlier histories in its past, and
/// the current history's (see `Lost`).
#[derive(Clone, Debug, Default)]
pub struct LostRanges {
    /// Earlier histories' (or, loaded back, every range).
    pub ranges: Vec<LostRange>,
    /// The current history's range, and whether its mark is stored.
    pub current: Option<(LostRange, bool)>,
}

impl LostRanges {
    /// The range a follower's `position` lies in, where this server has
    /// nothing.
    pub fn range_of(&self, position: i64) -> Option<LostRange> {
        self.ranges
            .iter()
            .chain(self.current.iter().map(|(r, _)| r))
            .find(|r| r.contains(position))
            .copied()
    }

    /// Into shared memory: lowest first, merged down to `LOST_RANGES`.
    pub(super) fn store(&self, lost: &mut Lost) {
        let mut ranges: Vec<(i64, i64)> = self
            .ranges
            .iter()
            .filter(|r| r.ceiling > r.have)
            .map(|r| (r.have, r.ceiling))
            .collect();
        ranges.sort_unstable();
        ranges.dedup();
        while ranges.len() > LOST_RANGES {
            let (a, b) = (ranges[0], ranges[1]);
            ranges[1] = (a.0.min(b.0), a.1.max(b.1));
            ranges.remove(0);
        }
        lost.n = ranges.len() as u32;
        lost.ranges[..ranges.len()].copy_from_slice(&ranges);
        lost.set_mark(self.current.map(|(r, _)| (r.have, r.ceiling)));
        lost.recorded = self.current.is_none_or(|(_, recorded)| recorded);
    }

    fn load(lost: &Lost) -> LostRanges {
        let n = (lost.n as usize).min(LOST_RANGES);
        LostRanges {
            ranges: lost.ranges[..n]
                .iter()
                .map(|&(have, ceiling)| LostRange { have, ceiling })
                .collect(),
            current: lost
                .mark()
                .map(|(have, ceiling)| (LostRange { have, ceiling }, lost.recorded)),
        }
    }
}

/// The stream's lost ranges (with the current history's mark, and whether
/// it is stored).
pub fn lost_ranges(
    stream: usize,
    key: i32,
    seq: pg_sys::Oid,
) -> Result<Result<LostRanges, Stale>, Error> {
    let locked = Locked::acquire(Section::OtherShared)?;
    let s = &locked.streams()[stream];
    if !matches(s, key, seq) {
        return Ok(Err(Stale));
    }
    Ok(Ok(LostRanges::load(&s.lost)))
}

/// A table added to a stream whose current mark is not stored yet: the
/// stream may have rows this server has after all (it was adopted after
/// the history began, its tables registered after its first use): raise
/// the mark's `have` to `have`, and the highest ID reported with it.
pub fn raise_have(
    stream: usize,
    key: i32,
    seq: pg_sys::Oid,
    have: i64,
) -> Result<Result<(), Stale>, Error> {
    let locked = Locked::acquire(Section::OtherExclusive)?;
    let s = &mut locked.streams()[stream];
    if !matches(s, key, seq) {
        return Ok(Err(Stale));
    }
    if let (Some((old, ceiling)), false) = (s.lost.mark(), s.lost.recorded) {
        let new = have.min(ceiling);
        if new > old {
            s.lost.set_mark(Some((new, ceiling)));
            if s.max_allocated == old {
                s.max_allocated = new;
                s.generation += 1;
            }
        }
    }
    Ok(Ok(()))
}

/// The marks of these streams (keys) are stored: called from the commit
/// callback of the transaction that stored them; raises no ERROR.
pub fn marks_recorded(keys: &[i32]) {
    // SAFETY: HEADER checked non-null; the states are touched under the
    // registry lock; MyDatabaseId is set once connected.
    unsafe {
        if keys.is_empty() || HEADER.is_null() {
            return;
        }
        let db = pg_sys::MyDatabaseId;
        let locked = Locked::acquire_raw(HEADER, Section::OtherExclusive);
        for s in locked.streams().iter_mut() {
            if s.in_use && s.db == db && keys.contains(&s.key) {
                s.lost.recorded = true;
            }
        }
    }
}
