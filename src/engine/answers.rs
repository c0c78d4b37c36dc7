//! The answer a reader's snapshot gets (one per snapshot and transaction),
//! the hot standby's answer, and which writers a token lists.

use std::cell::RefCell;
use std::rc::Rc;

use pgrx::pg_sys;
use streampos_core::frontier::Positions;

use crate::catalog::{self, StreamMeta};
use crate::fast_hash::FastMap;
use crate::registry;
use crate::{sql, worker_launch};

use super::index::{in_recovery, with_index};

/// What every reading function answers from, for one stream and snapshot.
#[derive(Clone)]
pub struct Answer {
    pub positions: Positions,
    /// Writers that committed IDs since start-up or have a stored position.
    pub seen: Vec<i32>,
    /// From stored positions only (a hot standby's snapshot).
    pub stored_only: bool,
}

impl Answer {
    fn resolve(view: registry::StreamView) -> Answer {
        Answer {
            positions: Positions::resolve(view.max_allocated, &view.holders),
            seen: view.seen,
            stored_only: false,
        }
    }

    pub fn frontier(&self) -> i64 {
        self.positions.frontier()
    }
}

/// A snapshot's identity is its contents, not its address (a statement's
/// snapshot is a copy, and copies come and go): two snapshots with the same
/// xmin, xmax and in-progress xids see the same transactions as ended.
struct SnapshotContents {
    xmin: u32,
    xmax: u32,
    during_recovery: bool,
    suboverflowed: bool,
    xip: Vec<u32>,
    subxip: Vec<u32>,
}

/// The in-progress xids of a snapshot (a copy of the array is never made
/// unless the snapshot is new to the cache).
fn xid_slices(s: &pg_sys::SnapshotData) -> (&[pg_sys::TransactionId], &[pg_sys::TransactionId]) {
    // SAFETY: xip has xcnt entries and subxip subxcnt entries (or the
    // pointers are unused when the counts are 0).
    unsafe {
        let xip = if s.xcnt == 0 || s.xip.is_null() {
            &[][..]
        } else {
            std::slice::from_raw_parts(s.xip, s.xcnt as usize)
        };
        let subxip = if s.subxcnt <= 0 || s.subxip.is_null() {
            &[][..]
        } else {
            std::slice::from_raw_parts(s.subxip, s.subxcnt as usize)
        };
        (xip, subxip)
    }
}

/// An order-independent hash of a snapshot's contents.
fn contents_hash(s: &pg_sys::SnapshotData) -> u64 {
    fn mix(x: u64) -> u64 {
        // splitmix64's finaliser: a cheap, well-spread mixing function.
        let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    let (xip, subxip) = xid_slices(s);
    let xip_sum = xip.iter().fold(0u64, |acc, x| {
        acc.wrapping_add(mix(u64::from(x.into_inner())))
    });
    let subxip_sum = subxip.iter().fold(0u64, |acc, x| {
        acc.wrapping_add(mix(u64::from(x.into_inner()) | 1 << 40))
    });
    mix(u64::from(s.xmin.into_inner()))
        ^ mix(u64::from(s.xmax.into_inner()) << 1)
        ^ mix(u64::from(s.takenDuringRecovery) << 33 | u64::from(s.suboverflowed) << 34)
        ^ xip_sum.rotate_left(17)
        ^ subxip_sum.rotate_left(41)
}

impl SnapshotContents {
    fn of(s: &pg_sys::SnapshotData) -> SnapshotContents {
        let (xip, subxip) = xid_slices(s);
        let mut xip: Vec<u32> = xip.iter().map(|x| x.into_inner()).collect();
        let mut subxip: Vec<u32> = subxip.iter().map(|x| x.into_inner()).collect();
        xip.sort_unstable();
        subxip.sort_unstable();
        SnapshotContents {
            xmin: s.xmin.into_inner(),
            xmax: s.xmax.into_inner(),
            during_recovery: s.takenDuringRecovery,
            suboverflowed: s.suboverflowed,
            xip,
            subxip,
        }
    }

    fn same_as(&self, s: &pg_sys::SnapshotData) -> bool {
        let (xip, subxip) = xid_slices(s);
        self.xmin == s.xmin.into_inner()
            && self.xmax == s.xmax.into_inner()
            && self.during_recovery == s.takenDuringRecovery
            && self.suboverflowed == s.suboverflowed
            && self.xip.len() == xip.len()
            && self.subxip.len() == subxip.len()
            && xip
                .iter()
                .all(|x| self.xip.binary_search(&x.into_inner()).is_ok())
            && subxip
                .iter()
                .all(|x| self.subxip.binary_search(&x.into_inner()).is_ok())
    }
}

thread_local! {
    /// Moves at every end of a (sub)transaction of this backend: a change
    /// of its own that was rolled back moves neither the snapshot nor the
    /// command (`ROLLBACK TO` a savepoint), and an xid of its own that
    /// ended need not move a later snapshot's xmax.
    static TRANSACTION_ENDS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// At every end of a transaction or subtransaction (xact.rs): values kept
/// per `SnapshotKey` are not used again.
pub fn transaction_ended() {
    TRANSACTION_ENDS.with(|n| n.set(n.get().wrapping_add(1)));
}

/// What a statement can see, for a value cached per statement: the
/// snapshot's contents and command, within one run of this backend's
/// transactions between (sub)transaction ends. Two snapshots with equal
/// keys see the same rows.
pub struct SnapshotKey {
    contents: SnapshotContents,
    command: u32,
    ends: u64,
}

impl SnapshotKey {
    pub fn of(snapshot: pg_sys::Snapshot) -> SnapshotKey {
        // SAFETY: `snapshot` is a valid snapshot of this transaction.
        let s = unsafe { &*snapshot };
        SnapshotKey {
            contents: SnapshotContents::of(s),
            command: s.curcid,
            ends: TRANSACTION_ENDS.with(|n| n.get()),
        }
    }

    pub fn matches(&self, snapshot: pg_sys::Snapshot) -> bool {
        // SAFETY: as in `of`.
        let s = unsafe { &*snapshot };
        self.command == s.curcid
            && self.ends == TRANSACTION_ENDS.with(|n| n.get())
            && self.contents.same_as(s)
    }
}

/// Answers already given in this transaction, per snapshot contents and
/// stream. See `docs/design.md`, "One answer per snapshot".
///
/// An answer is kept exactly as long as a snapshot that may ask for it
/// again lives: each snapshot that asked is registered here (on the
/// transaction's resource owner), which keeps its memory valid, and an
/// entry goes once nobody but us holds any of its snapshots (registered
/// nowhere else and not active) and its contents are not the
/// transaction's own snapshot (REPEATABLE READ, SERIALIZABLE). Memory is
/// what PostgreSQL keeps alive, never a number of answers: a cursor or an
/// outer statement keeps its answer whatever ran in between.
struct AnswerCache {
    /// The local transaction id the answers belong to.
    lxid: u32,
    /// By contents hash; collisions are told apart by the full contents.
    entries: FastMap<u64, Vec<CacheEntry>>,
    len: usize,
    /// Dead entries are swept when `len` reaches this.
    sweep_at: usize,
    /// The transaction is committing or preparing: everything was
    /// released, and nothing more may be registered (a snapshot still
    /// registered then is a leak PostgreSQL warns about).
    closed: bool,
}

struct CacheEntry {
    contents: SnapshotContents,
    /// (stream key, sequence) and the answer: a snapshot is asked about a
    /// few streams at most, so a list is quicker than a map.
    answers: Vec<((i32, pg_sys::Oid), Rc<Answer>)>,
    /// The snapshots with these contents that asked, each registered here
    /// once.
    holds: Vec<pg_sys::Snapshot>,
    /// Asked with a snapshot that cannot be registered (not a copy, e.g.
    /// the static one of a function called without an active snapshot):
    /// kept to the end of the transaction.
    pinned: bool,
    /// `holds` is swept when it reaches this: every statement of a
    /// REPEATABLE READ transaction (or of READ COMMITTED while nothing
    /// commits) asks with a new copy of the same contents.
    sweep_holds_at: usize,
}

/// Sweeps start at this many entries; afterwards at twice what survived.
const FIRST_SWEEP: usize = 8;
/// The same for an entry's snapshots.
const FIRST_HOLDS_SWEEP: usize = 4;

thread_local! {
    static ANSWERS: RefCell<AnswerCache> = RefCell::new(AnswerCache {
        lxid: 0,
        entries: FastMap::default(),
        len: 0,
        sweep_at: FIRST_SWEEP,
        closed: false,
    });
}

fn current_lxid() -> u32 {
    // SAFETY: MyProc is this backend's PGPROC. PostgreSQL 17 moved the
    // local transaction id into the PGPROC's virtual transaction id.
    unsafe {
        #[cfg(any(feature = "pg14", feature = "pg15", feature = "pg16"))]
        return (*pg_sys::MyProc).lxid;
        #[cfg(not(any(feature = "pg14", feature = "pg15", feature = "pg16")))]
        return (*pg_sys::MyProc).vxid.lxid;
    }
}

/// Does anyone but the cache still hold `s` (registered elsewhere, or on
/// the active snapshot stack)?
///
/// # Safety
/// `s` is registered by the cache, so its memory is valid.
unsafe fn held_elsewhere(s: pg_sys::Snapshot) -> bool {
    // SAFETY: forwarded from the caller.
    unsafe { (*s).regd_count > 1 || (*s).active_count > 0 }
}

impl AnswerCache {
    /// Start over when a new transaction asks (the previous one's
    /// snapshots are gone, and so are our registrations: commit released
    /// them in `release_all`, abort with the transaction's resource owner).
    fn for_this_transaction(&mut self) {
        let lxid = current_lxid();
        if self.lxid != lxid {
            self.entries.clear();
            self.len = 0;
            self.sweep_at = FIRST_SWEEP;
            self.closed = false;
            self.lxid = lxid;
        }
    }

    fn find(&mut self, hash: u64, s: &pg_sys::SnapshotData) -> Option<&mut CacheEntry> {
        self.entries
            .get_mut(&hash)?
            .iter_mut()
            .find(|e| e.contents.same_as(s))
    }

    /// Make `snapshot` keep `entry` alive.
    fn hold(closed: bool, entry: &mut CacheEntry, snapshot: pg_sys::Snapshot) {
        if entry.holds.contains(&snapshot) {
            return;
        }
        // SAFETY: a valid snapshot of this transaction.
        if closed || unsafe { !(*snapshot).copied } {
            entry.pinned = true;
            return;
        }
        if entry.holds.len() >= entry.sweep_holds_at {
            // Copies nobody else holds can no longer ask: let them go (the
            // entry itself stays; `sweep` decides about it).
            entry.holds.retain(|&s| {
                // SAFETY: registered by us, so valid until unregistered.
                let live = unsafe { held_elsewhere(s) };
                if !live {
                    // SAFETY: registered on this owner by `hold`.
                    unsafe {
                        pg_sys::UnregisterSnapshotFromOwner(s, pg_sys::TopTransactionResourceOwner)
                    };
                }
                live
            });
            entry.sweep_holds_at = FIRST_HOLDS_SWEEP.max(2 * entry.holds.len());
        }
        // SAFETY: a copied snapshot is registered as it is (no copy is
        // made), on the transaction's resource owner, which exists while
        // the transaction runs SQL; it is unregistered by `sweep` or
        // `release_all`, or by the transaction's abort.
        unsafe {
            pg_sys::RegisterSnapshotOnOwner(snapshot, pg_sys::TopTransactionResourceOwner);
        }
        entry.holds.push(snapshot);
    }

    /// The entry for `snapshot`'s contents and its answer for `stream`.
    fn find_answer(
        &mut self,
        hash: u64,
        snapshot: pg_sys::Snapshot,
        stream: (i32, pg_sys::Oid),
    ) -> Option<(&mut CacheEntry, Rc<Answer>)> {
        self.for_this_transaction();
        // SAFETY: a valid snapshot of this transaction.
        let entry = self.find(hash, unsafe { &*snapshot })?;
        let answer = entry
            .answers
            .iter()
            .find(|(s, _)| *s == stream)
            .map(|(_, a)| a.clone())?;
        Some((entry, answer))
    }

    fn get(
        &mut self,
        hash: u64,
        snapshot: pg_sys::Snapshot,
        stream: (i32, pg_sys::Oid),
    ) -> Option<Rc<Answer>> {
        let closed = self.closed;
        let (entry, answer) = self.find_answer(hash, snapshot, stream)?;
        // Another snapshot with the same contents: it keeps the answer too.
        Self::hold(closed, entry, snapshot);
        Some(answer)
    }

    /// The answer already given for these contents and stream, without
    /// making `snapshot` keep it.
    fn peek(
        &mut self,
        hash: u64,
        snapshot: pg_sys::Snapshot,
        stream: (i32, pg_sys::Oid),
    ) -> Option<Rc<Answer>> {
        self.find_answer(hash, snapshot, stream).map(|(_, a)| a)
    }

    /// Keep `answer` for `snapshot`'s contents and `stream`. With `hold`,
    /// `snapshot` keeps it alive (registered); without (`answer_to_check`),
    /// the entry lives until a sweep finds no snapshot holding it, which in
    /// REPEATABLE READ and SERIALIZABLE is never before the transaction
    /// ends (its contents are the transaction snapshot's).
    fn put(
        &mut self,
        hash: u64,
        snapshot: pg_sys::Snapshot,
        stream: (i32, pg_sys::Oid),
        answer: Rc<Answer>,
        hold: bool,
    ) {
        let closed = self.closed;
        // SAFETY: a valid snapshot of this transaction.
        let s = unsafe { &*snapshot };
        if let Some(entry) = self.find(hash, s) {
            // Only called after `get` or `peek` found no answer for this
            // stream.
            entry.answers.push((stream, answer));
            if hold {
                Self::hold(closed, entry, snapshot);
            }
            return;
        }
        if self.len >= self.sweep_at {
            self.sweep();
            self.sweep_at = FIRST_SWEEP.max(2 * self.len);
        }
        let mut entry = CacheEntry {
            contents: SnapshotContents::of(s),
            answers: vec![(stream, answer)],
            holds: Vec::new(),
            pinned: false,
            sweep_holds_at: FIRST_HOLDS_SWEEP,
        };
        if hold {
            Self::hold(closed, &mut entry, snapshot);
        }
        self.entries.entry(hash).or_default().push(entry);
        self.len += 1;
    }

    /// Forget the answers no snapshot can ask for again, and let their
    /// snapshots go.
    fn sweep(&mut self) {
        // In REPEATABLE READ and SERIALIZABLE every statement's snapshot is
        // a copy of the transaction's, which lives to the end.
        // SAFETY: reads backend-local snapshot state; in these isolation
        // levels, once the first snapshot is set, GetTransactionSnapshot
        // returns it without side effects.
        let transaction_snapshot = unsafe {
            (pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32
                && pg_sys::FirstSnapshotSet)
                .then(|| pg_sys::GetTransactionSnapshot())
        };
        let mut len = 0;
        self.entries.retain(|_, list| {
            list.retain_mut(|entry| {
                let mut live = entry.pinned
                    // SAFETY: the transaction snapshot is valid.
                    || transaction_snapshot.is_some_and(|t| entry.contents.same_as(unsafe { &*t }));
                entry.holds.retain(|&s| {
                    // SAFETY: registered by us, so valid until unregistered.
                    if unsafe { held_elsewhere(s) } {
                        live = true;
                        return true;
                    }
                    // Nobody else holds it: it can no longer ask.
                    // SAFETY: registered on this owner by `hold`.
                    unsafe {
                        pg_sys::UnregisterSnapshotFromOwner(s, pg_sys::TopTransactionResourceOwner)
                    };
                    false
                });
                live
            });
            len += list.len();
            !list.is_empty()
        });
        self.len = len;
    }

    /// The transaction is about to commit or prepare: let every snapshot
    /// go (no reading function can run any more).
    fn release_all(&mut self) {
        if self.lxid != current_lxid() {
            return;
        }
        for entry in self.entries.values().flatten() {
            for &s in &entry.holds {
                // SAFETY: registered on this owner by `hold`, still valid.
                unsafe {
                    pg_sys::UnregisterSnapshotFromOwner(s, pg_sys::TopTransactionResourceOwner)
                };
            }
        }
        self.entries.clear();
        self.len = 0;
        self.closed = true;
    }
}

/// Before commit or prepare: the cache's snapshots are let go (see
/// `AnswerCache`).
pub fn release_answers() {
    ANSWERS.with(|c| c.borrow_mut().release_all());
}

/// The answer for the caller's statement: for its snapshot, the first one
/// computed in this transaction, so that every call with that snapshot
/// (in one statement, across a cursor's fetches, in later statements of a
/// REPEATABLE READ transaction) answers the same.
pub fn answer(meta: &StreamMeta) -> Rc<Answer> {
    answer_for(meta, registry::caller_snapshot())
}

/// As `answer`, for an explicitly chosen snapshot.
pub fn answer_for(meta: &StreamMeta, snapshot: pg_sys::Snapshot) -> Rc<Answer> {
    // SAFETY: `snapshot` is a valid snapshot of this transaction.
    let hash = contents_hash(unsafe { &*snapshot });
    let stream = (meta.key, meta.seq);
    if let Some(a) = ANSWERS.with(|c| c.borrow_mut().get(hash, snapshot, stream)) {
        return a;
    }
    let a = Rc::new(fresh_answer(meta, snapshot));
    ANSWERS.with(|c| c.borrow_mut().put(hash, snapshot, stream, a.clone(), true));
    a
}

/// The answer a check of a caller's value is made against (`ack` refusing
/// a token past the caller's frontier): the one already given for the
/// caller's snapshot in this transaction, else one computed now and kept
/// for that snapshot's contents without registering the snapshot, which
/// cost an acknowledgement more than computing the answer. Later asks
/// with the same contents find it (one answer per snapshot: a repeated
/// `ack` of a token it accepted, or `current_token()` after it, is never
/// told less); it lives until a sweep finds no snapshot holding it, so in
/// REPEATABLE READ and SERIALIZABLE to the end of the transaction, and in
/// READ COMMITTED, where only the same statement or a cursor can ask with
/// these contents again, at least until eight other snapshots have asked
/// in the transaction.
pub fn answer_to_check(meta: &StreamMeta) -> Rc<Answer> {
    let snapshot = registry::caller_snapshot();
    // SAFETY: `snapshot` is a valid snapshot of this transaction.
    let hash = contents_hash(unsafe { &*snapshot });
    let stream = (meta.key, meta.seq);
    if let Some(a) = ANSWERS.with(|c| c.borrow_mut().peek(hash, snapshot, stream)) {
        return a;
    }
    let a = Rc::new(fresh_answer(meta, snapshot));
    ANSWERS.with(|c| c.borrow_mut().put(hash, snapshot, stream, a.clone(), false));
    a
}

/// The answer for `snapshot` computed now, not remembered (followers that
/// wait use a new latest snapshot each time).
pub fn fresh_answer(meta: &StreamMeta, snapshot: pg_sys::Snapshot) -> Answer {
    // A snapshot taken on a hot standby keeps the standby's answer after a
    // promotion: the registry, loaded after it, cannot know what it saw.
    // SAFETY: `snapshot` is a valid snapshot of this transaction.
    if in_recovery() || unsafe { (*snapshot).takenDuringRecovery } {
        return stored_answer(meta, snapshot);
    }
    let view = with_index(meta, |index| {
        registry::view(index, meta.key, meta.seq, snapshot)
    });
    if view.orphans {
        // Only the position worker releases orphaned holds; it may have
        // left (idle, or gone) with no allocation since to start it again.
        worker_launch::ensure_running();
    }
    Answer::resolve(view)
}

/// The hot standby's answer (`standby_answer`) as `snapshot` sees the
/// stored positions: SPI reads with the active snapshot, and a follower's
/// wait passes a newer one each time it looks again. Never the registry:
/// a standby's follower keeps to it even once the server was promoted
/// during its call (the registry, loaded mid-statement, would read the
/// rows through the statement's older snapshot).
pub fn stored_answer(meta: &StreamMeta, snapshot: pg_sys::Snapshot) -> Answer {
    with_active_snapshot(snapshot, || standby_answer(meta))
}

/// Run `f` with `snapshot` as the active snapshot (what SPI reads with).
pub fn with_active_snapshot<T>(snapshot: pg_sys::Snapshot, f: impl FnOnce() -> T) -> T {
    // SAFETY: `snapshot` is a valid snapshot of this transaction; pushed
    // and popped around `f` (an ERROR's abort pops it).
    unsafe { pg_sys::PushActiveSnapshot(snapshot) };
    let value = f();
    // SAFETY: pops the snapshot pushed above.
    unsafe { pg_sys::PopActiveSnapshot() };
    value
}

/// A hot standby cannot see what is in flight on the primary (and its
/// sequences may be up to 32 ahead of what was handed out), so it answers
/// from what the position worker stored, which replicates in commit order
/// and is never ahead of the truth: the stored frontier, and each stored
/// writer position (never below it). Writers without a stored position read
/// as the frontier (see writer_position). Before the worker first stored a
/// frontier (a database just updated from 0.2.0), the lowest stored
/// position stands in for it.
fn standby_answer(meta: &StreamMeta) -> Answer {
    let stored = sql::stored_positions(&meta.name);
    let frontier = sql::stored_frontier(&meta.name)
        .unwrap_or_else(|| stored.iter().map(|(_, p)| *p).min().unwrap_or(0));
    Answer {
        positions: Positions::stored(frontier, &stored),
        seen: stored.iter().map(|(w, _)| *w).collect(),
        stored_only: true,
    }
}

/// The writers a token or `writer_positions` reports: the configured ones,
/// or for an open stream every instance seen committing since start-up (or
/// with a stored position when the stream was first used). A writer whose
/// first transaction still holds IDs is not listed yet (it reads as the
/// token's minimum): were it listed, and its transaction aborted, a later
/// token would no longer list it, and its position would go back.
pub fn writer_ids(meta: &StreamMeta, a: &Answer) -> Vec<i32> {
    let mut ids: Vec<i32> = match &meta.writers {
        Some(names) => names
            .iter()
            .filter_map(|n| catalog::lookup_instance_id(n))
            .collect(),
        None => a.seen.clone(),
    };
    ids.sort_unstable();
    ids.dedup();
    ids
}
