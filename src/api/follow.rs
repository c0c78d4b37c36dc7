//! Followers: `wait_for` (long-poll on the frontier) and `updates` (the
//! replication feed). Both sleep on the stream's condition variable, which
//! every transaction that held IDs of the stream broadcasts when it ends.

use std::time::{Duration, Instant};

use pgrx::pgrx_sql_entity_graph::metadata::{
    ArgumentError, ReturnsError, ReturnsRef, SqlMappingRef, SqlTranslatable, TypeOrigin,
};
use pgrx::prelude::*;
use streampos_core::token::{clip_lossy, Token, TokenKind, MAX_QUOTED_TEXT};

use crate::catalog::{self, StreamMeta};
use crate::engine::{self, in_recovery, registry_index, writer_ids};
use crate::error::{clip, Error, OrRaise};
use crate::registry::history;
use crate::types::MultiWriterToken;
use crate::{registry, sql};

/// Most rows one `updates` call may return.
const MAX_ROWS: i32 = 10_000;

/// Under REPEATABLE READ and SERIALIZABLE a follower answers for the
/// transaction's snapshot, like every reading function (and with the same
/// answer, fixed for the transaction): nothing newer can ever be visible to
/// it. Under READ COMMITTED the statement's snapshot would never see a
/// commit that happens while we wait, so each check takes the latest
/// snapshot and computes afresh; every later statement of the caller sees at
/// least as much.
fn answer_now(meta: &StreamMeta, waiter: Waiter) -> std::rc::Rc<engine::Answer> {
    // A standby's follower reads the stored positions for the whole call,
    // also if the server is promoted meanwhile (`engine::stored_answer`).
    if let Waiter::Standby { .. } = waiter {
        return std::rc::Rc::new(engine::stored_answer(meta, follower_snapshot()));
    }
    // SAFETY: called inside a running transaction.
    unsafe {
        if pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32 {
            engine::answer_for(meta, pg_sys::GetTransactionSnapshot())
        } else {
            std::rc::Rc::new(engine::fresh_answer(meta, pg_sys::GetLatestSnapshot()))
        }
    }
}

/// The snapshot a follower's look reads with: the transaction's under
/// REPEATABLE READ and SERIALIZABLE, else the latest.
fn follower_snapshot() -> pg_sys::Snapshot {
    // SAFETY: called inside a running transaction.
    unsafe {
        if pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32 {
            pg_sys::GetTransactionSnapshot()
        } else {
            pg_sys::GetLatestSnapshot()
        }
    }
}

/// Run `f` (the reads of a stream's rows) with a snapshot that sees every
/// row the token covers: under READ COMMITTED a new latest snapshot, taken
/// after the one the token was computed for; otherwise the transaction's.
fn with_row_snapshot<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: called inside a running transaction; the pushed snapshot is
    // popped afterwards, or by the transaction's abort on ERROR.
    unsafe {
        if pg_sys::XactIsoLevel >= pg_sys::XACT_REPEATABLE_READ as i32 {
            return f();
        }
        pg_sys::PushActiveSnapshot(pg_sys::GetLatestSnapshot());
        let value = f();
        pg_sys::PopActiveSnapshot();
        value
    }
}

/// A follower must not wait for, or read from, a position this server never
/// reached: after an asynchronous failover or a point-in-time recovery its
/// history differs from the one the follower saw. `shown` (what the error
/// quotes, clipped) is only built for the error.
fn refuse_ahead(
    meta: &StreamMeta,
    what: &'static str,
    position: i64,
    shown: impl FnOnce() -> (String, Option<i64>),
) {
    // What the server allocated, not what the caller's snapshot saw of it:
    // a REPEATABLE READ follower's transaction snapshot may predate IDs
    // allocated since, which are no reason to resynchronise.
    let allocated = engine::with_index(meta, |index| {
        registry::highest_allocated(index, meta.key, meta.seq)
    });
    if position > allocated {
        let (shown, highest) = shown();
        Error::AheadOfServer {
            what,
            stream: meta.name.as_str().into(),
            position: clip_lossy(shown.as_bytes(), MAX_QUOTED_TEXT),
            highest,
            max_allocated: meta.external(allocated),
        }
        .report();
    }
}

/// A follower's position in the stream's lost range (registry/history.rs)
/// comes from a history this server does not have: the follower holds
/// rows that do not exist here (or, after a lossless failover, a gap of
/// aborted IDs or rows deleted since: it resynchronises needlessly, never
/// wrongly). Checked for every position a token carries (its minimum and
/// each writer's) and for a `wait_for` target.
fn refuse_lost_history(
    meta: &StreamMeta,
    waiter: Waiter,
    positions: impl IntoIterator<Item = i64>,
) {
    // A hot standby has no registry to load the ranges into: it reads the
    // marks (they replicate), every one of which is a range of its past.
    // By the waiter, not by `in_recovery()`: a promotion since the call
    // chose it must not load the registry mid-statement.
    let lost = match waiter {
        Waiter::Standby { .. } => standby_lost_ranges(meta),
        Waiter::Primary(_) => engine::with_index(meta, |index| {
            history::lost_ranges(index, meta.key, meta.seq)
        }),
    };
    for position in positions {
        if let Some(range) = lost.range_of(position) {
            Error::LostHistory {
                stream: meta.name.as_str().into(),
                position,
                have: range.have,
                ceiling: range.ceiling,
            }
            .report();
        }
    }
}

/// A standby's lost ranges: every replicated history mark, as the
/// follower's snapshot sees them (a mark replicated while it waits counts
/// at its next look).
fn standby_lost_ranges(meta: &StreamMeta) -> history::LostRanges {
    history::LostRanges {
        ranges: engine::with_active_snapshot(follower_snapshot(), || {
            sql::history_marks(&meta.name)
        })
        .into_iter()
        .map(|(_, have, ceiling)| history::LostRange { have, ceiling })
        .collect(),
        current: None,
    }
}

/// On a standby, at each look: the follower's positions must not lie in a
/// lost range that replicated (or was made by a promotion) since the call
/// began (72000, as at its start).
fn recheck_on_standby(meta: &StreamMeta, waiter: Waiter, positions: &[i64]) {
    if let Waiter::Standby { .. } = waiter {
        refuse_lost_history(meta, waiter, positions.iter().copied());
    }
}

/// Where a follower waits for its answer to change.
#[derive(Clone, Copy)]
enum Waiter {
    /// On the primary: the stream's registry state, whose condition
    /// variable every transaction that held IDs of the stream broadcasts
    /// when it ends.
    Primary(usize),
    /// On a hot standby, which answers from the stored positions: woken
    /// when replay names the stream (`replay.rs`), and besides every
    /// `STANDBY_RECHECK_MS` (`STANDBY_POLL_MS` while no record has been
    /// replayed since start-up: the primary may log none). The registry
    /// is not loaded before promotion.
    Standby { db: pg_sys::Oid, key: i32 },
}

/// A standby's follower looks again this often although no record woke
/// it (records are being replayed: a safety net)...
const STANDBY_RECHECK_MS: i64 = 1000;
/// ...or this often while none has been (the primary logs none: PostgreSQL
/// 14, `streampos.standby_wakeup_rmgr_id` = 0), or after a promotion.
const STANDBY_POLL_MS: i64 = 100;

fn waiter(meta: &StreamMeta) -> Waiter {
    if in_recovery() {
        Waiter::Standby {
            // SAFETY: MyDatabaseId is set once the backend is connected.
            db: unsafe { pg_sys::MyDatabaseId },
            key: meta.key,
        }
    } else {
        Waiter::Primary(registry_index(meta))
    }
}

/// Re-evaluate `ready` each time the stream's answer may have moved, until
/// it returns true or the timeout passes (then the last evaluation's
/// value).
fn wait_until<T>(
    waiter: Waiter,
    timeout_ms: i32,
    not_before: Option<Instant>,
    ready: impl FnMut() -> (bool, T),
) -> T {
    match waiter {
        Waiter::Primary(index) => wait_on_primary(index, timeout_ms, not_before, ready),
        Waiter::Standby { db, key } => wait_on_standby(db, key, timeout_ms, not_before, ready),
    }
}

/// Ready, but sooner than `not_before` (the batch window after the
/// session's previous answer): sleep a little (at most 10 ms) and say to
/// look again; else whether to answer now.
fn answer_now_or_gather(not_before: Option<Instant>, now: Instant, deadline: Instant) -> bool {
    match not_before {
        Some(at) if now < at => {
            let until = at.min(deadline).min(now + Duration::from_millis(10));
            pgrx::check_for_interrupts!();
            // SAFETY: sleeps this process for at most 10 ms; interrupts (a
            // cancel) are checked around it.
            unsafe { pg_sys::pg_usleep((until - now).as_micros() as std::ffi::c_long) };
            pgrx::check_for_interrupts!();
            false
        }
        _ => true,
    }
}

/// The longest a standby's follower waits in one call: with
/// `hot_standby_feedback` off, the statement's snapshot conflicts with
/// replay of the primary's pruning (the worker's own updates of the stored
/// positions among it), and replay waits for it up to
/// `max_standby_streaming_delay`: the wait would hold back the very
/// replay that would wake it, and every reader of the standby. Then half
/// that delay (at least 100 ms; 1 s when replay waits forever), or the
/// caller's timeout if shorter; an early return is an answer with nothing
/// new, as a timeout. With feedback on, the caller's timeout.
fn standby_wait_cap() -> Duration {
    // SAFETY: reads this process's copies of two settings.
    let (feedback, delay) = unsafe {
        (
            pg_sys::hot_standby_feedback,
            pg_sys::max_standby_streaming_delay,
        )
    };
    if feedback {
        Duration::MAX
    } else if delay < 0 {
        Duration::from_millis(1000)
    } else {
        Duration::from_millis((delay as u64 / 2).max(100))
    }
}

/// `wait_until` on a hot standby (`Waiter::Standby`).
fn wait_on_standby<T>(
    db: pg_sys::Oid,
    key: i32,
    timeout_ms: i32,
    not_before: Option<Instant>,
    mut ready: impl FnMut() -> (bool, T),
) -> T {
    let deadline =
        Instant::now() + Duration::from_millis(timeout_ms.max(0) as u64).min(standby_wait_cap());
    let client = ClientWatch::new();
    let mut last = None;
    loop {
        // Promoted since the call began: it ends with its last answer (read
        // as a standby's, exact), and the next call runs on the new
        // primary, with a primary's checks of the follower's token.
        if !in_recovery() {
            if let Some(value) = last.take() {
                return value;
            }
        }
        // Read before the answer: a record replayed after it moves it.
        let replay = registry::replay_seen(db, key);
        let (records, seen) = replay.unwrap_or((0, 0));
        let (done, value) = ready();
        let now = Instant::now();
        if now >= deadline {
            return value;
        }
        if done {
            if answer_now_or_gather(not_before, now, deadline) {
                return value;
            }
            last = Some(value);
            continue;
        }
        last = Some(value);
        let mut bound = if records > 0 {
            STANDBY_RECHECK_MS
        } else {
            STANDBY_POLL_MS
        };
        if client.watch && !client.in_sleep {
            bound = bound.min(500);
        }
        let left = ((deadline - now).as_micros().div_ceil(1000) as i64).clamp(1, bound);
        if replay.is_none() {
            // Not preloaded here: nothing can wake us; look again soon.
            pgrx::check_for_interrupts!();
            // SAFETY: sleeps this process for at most STANDBY_POLL_MS;
            // interrupts are checked around it.
            unsafe { pg_sys::pg_usleep(left.min(STANDBY_POLL_MS) as std::ffi::c_long * 1000) };
            pgrx::check_for_interrupts!();
            client.check_now();
            continue;
        }
        let woken = registry::wait_for_replay(db, key, seen, left, client.watch).or_raise();
        client.after_sleep(woken);
    }
}

/// `wait_until` on the primary (`Waiter::Primary`).
fn wait_on_primary<T>(
    index: usize,
    timeout_ms: i32,
    not_before: Option<Instant>,
    mut ready: impl FnMut() -> (bool, T),
) -> T {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms.max(0) as u64);
    // Counted among the stream's waiting followers (stat_streams) from the
    // first sleep to the return (or an error, or the backend's exit).
    let mut following = None;
    let client = ClientWatch::new();
    loop {
        let generation = registry::generation(index).or_raise();
        // Read before the answer: if every WAL record inserted by then was
        // durable, every allocation that ended by then counts in it as
        // durable, and any later one broadcasts.
        let settled = registry::wal_settled();
        let (done, value) = ready();
        let now = Instant::now();
        if now >= deadline {
            return value;
        }
        if done {
            // Too soon after the previous answer: let the burst gather,
            // then answer for all of it.
            if answer_now_or_gather(not_before, now, deadline) {
                return value;
            }
            continue;
        }
        if following.is_none() {
            following = registry::stats::Following::enter(index);
        }
        // Positions also move when the WAL is flushed (IDs become
        // durable), which broadcasts nothing: re-check every 100 ms while
        // some WAL is not durable yet. Otherwise only a broadcast moves
        // them: sleep until one, the deadline, or the client going away
        // (PostgreSQL 14 cannot watch the socket while it sleeps: it wakes
        // every 500 ms to ask).
        // Rounded up: a wait of 0 ms would return at once (a spin).
        let bound = match (settled, client.in_sleep) {
            (false, _) => 100,
            (true, true) => u128::from(u32::MAX),
            (true, false) => 500,
        };
        let left = (deadline - now).as_micros().div_ceil(1000).clamp(1, bound) as i64;
        let woken = registry::wait_for_change(index, generation, left, client.watch).or_raise();
        client.after_sleep(woken);
    }
}

/// Whether a follower's waits notice its client going away: `watch`, it
/// has one (never a background worker); `in_sleep`, its sleep watches the
/// socket too (PostgreSQL 15 and later), else it asks after each sleep.
#[derive(Clone, Copy)]
struct ClientWatch {
    watch: bool,
    in_sleep: bool,
}

impl ClientWatch {
    fn new() -> ClientWatch {
        let watch = has_client();
        ClientWatch {
            watch,
            in_sleep: watch && registry::watches_client(),
        }
    }

    /// End the call if the client is gone.
    fn check_now(self) {
        if self.watch && !client_connected() {
            end_for_lost_client();
        }
    }

    /// After a sleep that ended as `woken`.
    fn after_sleep(self, woken: registry::Woken) {
        if woken == registry::Woken::ClientGone || !self.in_sleep {
            self.check_now();
        }
    }
}

/// Does this backend have a client whose connection can be watched
/// (never a background worker's)?
fn has_client() -> bool {
    // SAFETY: reads the backend's own globals.
    unsafe {
        !pg_sys::MyProcPort.is_null()
            && pg_sys::whereToSendOutput == pg_sys::CommandDest::DestRemote
    }
}

/// Is the client still connected? A poll of its socket (guarded: it may
/// raise an ERROR on a failed wait).
fn client_connected() -> bool {
    // SAFETY: only for a backend with a client (`has_client`).
    unsafe { pg_sys::ffi::pg_guard_ffi_boundary(|| crate::ffi::pq_check_connection()) }
}

/// A follower whose client is gone (killed, its connection cut) ends its
/// wait at once as PostgreSQL ends any command whose client it finds gone
/// (FATAL "connection to client lost"), rather than waiting out its
/// timeout while holding its transaction (a consumer's lock among what it
/// holds).
fn end_for_lost_client() {
    // SAFETY: PostgreSQL's own interrupt flags, processed by the interrupt
    // check that follows.
    unsafe {
        pg_sys::ClientConnectionLost = 1;
        pg_sys::InterruptPending = 1;
    }
    pgrx::check_for_interrupts!();
}

thread_local! {
    /// When this session's latest `updates()` of each stream (by registry
    /// key) returned: a session following several streams in turn is not
    /// held back on one by its answer on another.
    static LAST_UPDATES: std::cell::RefCell<crate::fast_hash::FastMap<i32, Instant>> =
        std::cell::RefCell::new(crate::fast_hash::FastMap::default());
}

/// The end of the batch window (`streampos.follower_batch_ms`) after this
/// session's previous `updates()` of the stream, if any.
fn batch_window_end(key: i32) -> Option<Instant> {
    let window = crate::guc::FOLLOWER_BATCH_MS.get();
    if window <= 0 {
        return None;
    }
    LAST_UPDATES
        .with(|l| l.borrow().get(&key).copied())
        .map(|at| at + Duration::from_millis(window as u64))
}

fn answered_updates(key: i32) {
    LAST_UPDATES.with(|l| {
        let mut last = l.borrow_mut();
        // Bounded by the streams a session follows; start over past that.
        if last.len() >= 1024 {
            last.clear();
        }
        last.insert(key, Instant::now());
    });
}

// PARALLEL UNSAFE: under READ COMMITTED it takes the latest snapshot,
// which PostgreSQL refuses while a parallel plan runs in the query.
#[pg_extern(volatile, strict, parallel_unsafe)]
fn wait_for(stream: &str, stream_id: i64, timeout_ms: i32) -> i64 {
    let meta = catalog::stream(stream).or_raise();
    let waiter = waiter(&meta);
    // Internal numbering counts up for backward streams too.
    let target = if meta.backwards {
        stream_id.saturating_neg()
    } else {
        stream_id
    };
    // One past the highest allocated ID is "anything new": a follower at
    // position p waits for p + 1 (a timeout answers p: nothing yet). Only a
    // target further out is beyond this server (72000: resynchronise).
    // (A hot standby cannot tell a target it has not replayed yet from
    // one beyond its primary: it waits.)
    if let Waiter::Primary(_) = waiter {
        refuse_ahead(&meta, "target", target.saturating_sub(1), || {
            (stream_id.to_string(), None)
        });
    }
    // The follower's position (one below "anything new") must be of this
    // history too.
    refuse_lost_history(&meta, waiter, [target, target.saturating_sub(1)]);
    let reached = wait_until(waiter, timeout_ms, None, || {
        recheck_on_standby(&meta, waiter, &[target, target.saturating_sub(1)]);
        let f = answer_now(&meta, waiter).frontier();
        (f >= target, f)
    });
    meta.external(reached)
}

/// The current token for the follower's snapshot.
fn token_now(meta: &StreamMeta, waiter: Waiter) -> Token {
    let a = answer_now(meta, waiter);
    a.positions.token(&writer_ids(meta, &a))
}

/// A follower's token must come from this server's history (72000
/// otherwise, as for a `since` token: see `refuse_ahead`,
/// `refuse_lost_history`).
fn refuse_foreign_token(meta: &StreamMeta, waiter: Waiter, token: &Token) {
    // A token at the cap prints to hundreds of kilobytes: the error quotes
    // it clipped and names its highest position. A hot standby cannot tell
    // a token it has not replayed yet from one beyond its primary: the
    // follower waits there.
    if let Waiter::Primary(_) = waiter {
        refuse_ahead(meta, "token", token.max_stream_pos(), || {
            (
                token.to_text(TokenKind::MultiWriter),
                Some(token.max_stream_pos()),
            )
        });
    }
    refuse_lost_history(meta, waiter, token_positions(token));
}

/// Every position a token carries: its minimum and each writer's.
fn token_positions(token: &Token) -> Vec<i64> {
    std::iter::once(token.stream())
        .chain(token.instances().iter().map(|&(_, p)| p))
        .collect()
}

/// A consumer's `wait_for`: sleep until the stream's current token is past
/// the consumer's acknowledged position (as this call reads it), or the
/// timeout passes; the current token (at or before the position on a
/// timeout). For consumers that read the stream's rows themselves rather
/// than through `updates()`.
// PARALLEL UNSAFE: under READ COMMITTED it takes the latest snapshot,
// which PostgreSQL refuses while a parallel plan runs in the query.
#[pg_extern(volatile, strict, parallel_unsafe)]
fn wait_for_consumer(stream: &str, consumer: &str, timeout_ms: i32) -> MultiWriterToken {
    let meta = super::consumers::forward_stream(stream);
    let position = super::consumers::consumer_position(stream, consumer);
    let waiter = waiter(&meta);
    refuse_foreign_token(&meta, waiter, &position);
    let positions = token_positions(&position);
    MultiWriterToken(wait_until(waiter, timeout_ms, None, || {
        recheck_on_standby(&meta, waiter, &positions);
        let t = token_now(&meta, waiter);
        (!t.is_before_or_eq(&position), t)
    }))
}

// PARALLEL UNSAFE: under READ COMMITTED it takes the latest snapshot,
// which PostgreSQL refuses while a parallel plan runs in the query.
// Not STRICT: `since` or `consumer` is given, the other NULL (neither is
// 22023). Any other NULL argument answers NULL as a STRICT function would.
// Declared in sql/finalize.sql: a token argument's `DEFAULT NULL` needs the type complete, which the generated functions come before. Its
// C symbol is new (`updates_v3_wrapper`): 0.2.0's declaration of the
// four-argument function names `updates_wrapper`, below.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn updates_v3(
    stream: Option<&str>,
    since: default!(Option<MultiWriterToken>, "NULL"),
    max_rows: default!(Option<i32>, 100),
    timeout_ms: default!(Option<i32>, 0),
    consumer: default!(Option<&str>, "NULL"),
) -> Option<JsonbDatum> {
    updates_call(stream, since, max_rows, timeout_ms, consumer, Form::JSONB).map(JsonbDatum)
}

/// `updates()`' answer as json: the text `jsonb_out` prints for it, written
/// once by the call instead of printed from jsonb when it is sent (the
/// cheaper answer for a client that parses the text anyway). With
/// `ordered`, only rows up to the stream's frontier (see `follow`).
/// Declared in sql/finalize.sql, as `updates`.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn updates_json(
    stream: Option<&str>,
    since: default!(Option<MultiWriterToken>, "NULL"),
    max_rows: default!(Option<i32>, 100),
    timeout_ms: default!(Option<i32>, 0),
    consumer: default!(Option<&str>, "NULL"),
    ordered: default!(Option<bool>, false),
) -> Option<JsonDatum> {
    let form = Form {
        as_json_text: true,
        ordered: ordered?,
    };
    updates_call(stream, since, max_rows, timeout_ms, consumer, form).map(JsonDatum)
}

/// What an `updates` answer is: jsonb or json text, and whether it goes
/// only as far as the frontier (every row in global ID order across calls)
/// or as far as each writer has finished.
#[derive(Clone, Copy)]
struct Form {
    as_json_text: bool,
    ordered: bool,
}

impl Form {
    /// `updates()`' form: jsonb, per writer.
    const JSONB: Form = Form {
        as_json_text: false,
        ordered: false,
    };
}

/// `updates` or `updates_json`: from `since` or from the consumer's
/// acknowledged position (one of the two).
fn updates_call(
    stream: Option<&str>,
    since: Option<MultiWriterToken>,
    max_rows: Option<i32>,
    timeout_ms: Option<i32>,
    consumer: Option<&str>,
    form: Form,
) -> Option<pg_sys::Datum> {
    let (stream, max_rows, timeout_ms) = (stream?, max_rows?, timeout_ms?);
    let since = match (since, consumer) {
        (Some(_), Some(_)) => Error::InvalidArgument {
            message: "updates() takes since or consumer, not both".into(),
            detail: Some(
                "A consumer's rows start after its acknowledged position; pass since => NULL."
                    .into(),
            ),
        }
        .report(),
        (Some(since), None) => since.0,
        (None, Some(consumer)) => {
            // The stream first: an unknown stream is reported as such.
            catalog::stream(stream).or_raise();
            super::consumers::consumer_position(stream, consumer)
        }
        (None, None) => Error::InvalidArgument {
            message: "updates() needs since or consumer".into(),
            detail: Some(
                "Pass since => '0' to follow the stream from its beginning, a token updates() returned to go on, or consumer => the consumer's name."
                    .into(),
            ),
        }
        .report(),
    };
    Some(follow(stream, since, max_rows, timeout_ms, form))
}

/// 0.2.0's `updates(stream, since, max_rows, timeout_ms)`, STRICT: what a
/// database not yet updated to 0.3.0 calls with this library.
#[pg_extern(volatile, strict, parallel_unsafe, sql = false)]
fn updates(stream: &str, since: MultiWriterToken, max_rows: i32, timeout_ms: i32) -> JsonbDatum {
    JsonbDatum(follow(stream, since.0, max_rows, timeout_ms, Form::JSONB))
}

/// One `updates()` answer: rows after `since`, at most `max_rows`, waiting
/// at most `timeout_ms` for some; jsonb, or json with `as_json_text`.
/// Ordered (`form.ordered`): the token aimed at is the frontier alone, not
/// each writer's position; every ID up to the frontier is finished, so no
/// later answer has a row below one this answer gives (the per-writer form
/// gives a writer's rows as soon as that writer finished them, and a
/// slower writer's lower IDs come later).
fn follow(stream: &str, since: Token, max_rows: i32, timeout_ms: i32, form: Form) -> pg_sys::Datum {
    let as_json_text = form.as_json_text;
    let meta = catalog::stream(stream).or_raise();
    if meta.backwards {
        Error::InvalidState {
            message: format!("stream \"{}\" counts backwards", clip(stream)),
            detail: Some(
                "updates() follows forward streams; read a backward stream with frontier().".into(),
            ),
        }
        .report();
    }
    if max_rows < 1 {
        Error::invalid(format!("max_rows must be at least 1, not {max_rows}")).report();
    }
    if max_rows > MAX_ROWS {
        Error::TooLarge {
            what: format!("max_rows {max_rows}"),
            limit: format!(
                "updates() returns at most {MAX_ROWS} rows a call; continue from its token."
            ),
        }
        .report();
    }
    // Whoever may not read the stream's tables (sql::read_as_owner) is
    // refused now, not after waiting.
    sql::check_may_follow(&catalog::stream_tables(stream));
    let waiter = waiter(&meta);
    refuse_foreign_token(&meta, waiter, &since);
    // Wait until some writer moved past `since`.
    let not_before = if timeout_ms > 0 {
        batch_window_end(meta.key)
    } else {
        None
    };
    let positions = token_positions(&since);
    let current = wait_until(waiter, timeout_ms, not_before, || {
        recheck_on_standby(&meta, waiter, &positions);
        let t = token_now(&meta, waiter);
        let t = if form.ordered { t.bound(t.stream()) } else { t };
        (!t.is_before_or_eq(&since), t)
    });
    // Never hand a follower a token behind the one it gave us.
    // A `since` listing other instances up to the cap can join the stream's
    // writers to more than the cap: 54000, as for any token.
    let until = since.advance(&current).or_raise();
    if until.is_before_or_eq(&since) {
        // Nothing past `since` (a caught-up follower, the most frequent
        // call): no row can be in range, and no table is read.
        let answer = with_row_snapshot(|| {
            let tables = catalog::stream_tables(stream);
            let rows: Vec<Option<Vec<sql::UpdateRow>>> =
                tables.iter().map(|_| Some(Vec::new())).collect();
            sql::updates_answer(
                &tables,
                &rows,
                &since.to_text(TokenKind::MultiWriter),
                since.max_stream_pos(),
                false,
                as_json_text,
            )
        });
        answered_updates(meta.key);
        return answer;
    }
    let limit = max_rows as usize;
    let since_text = since.to_text(TokenKind::MultiWriter);
    let until_text = until.to_text(TokenKind::MultiWriter);
    let low = since.stream();
    let high = until.max_stream_pos();

    let range = sql::RowRange {
        low,
        high,
        since: &since_text,
        until: &until_text,
        since_token: &since,
        until_token: &until,
        // Every writer's rows in here are in range: above each writer's
        // position in `since`, at or below each one's in `until`.
        every_writer_above: since.max_stream_pos(),
        every_writer_up_to: until.stream(),
        as_json_text,
    };
    // One snapshot for every read (any snapshot that sees the token's
    // commits sees the same rows below it).
    let answer = with_row_snapshot(|| {
        // The stream's tables as this snapshot sees them: a table added
        // while the follower waited is read too (its rows below the new
        // token would otherwise be passed for good).
        let tables = catalog::stream_tables(stream);
        // Each table's first limit+1 rows are enough to find the global
        // first limit+1 rows in ID order.
        let mut rows: Vec<Option<Vec<sql::UpdateRow>>> = tables
            .iter()
            .map(|t| sql::update_rows(t, &range, Some(limit as i64 + 1)))
            .collect();
        let mut ids: Vec<i64> = rows.iter().flatten().flatten().map(|r| r.id).collect();
        ids.sort_unstable();
        let (token, limited) = if ids.len() > limit {
            // Cut at an ID boundary so that no ID is split: rows with id <
            // the first excluded ID. If one ID alone has more rows than the
            // limit, take all of its rows: progress beats the limit.
            let first_excluded = ids[limit];
            let cut = if ids[0] < first_excluded {
                first_excluded - 1
            } else {
                first_excluded
            };
            for (table, rows) in tables.iter().zip(rows.iter_mut()) {
                let Some(rows) = rows else { continue };
                // Complete up to the cut unless this table's read stopped at
                // its limit on an ID at or below the cut (several rows of
                // one ID): then read its rows up to the cut again.
                let complete = rows.len() <= limit || rows.last().is_some_and(|r| r.id > cut);
                if complete {
                    rows.retain(|r| r.id <= cut);
                } else if let Some(all) =
                    sql::update_rows(table, &sql::RowRange { high: cut, ..range }, None)
                {
                    *rows = all;
                }
            }
            // The cut token admits exactly the rows with id <= cut of the
            // range.
            (since.advance(&until.bound(cut)).or_raise(), true)
        } else {
            (until.clone(), false)
        };
        sql::updates_answer(
            &tables,
            &rows,
            &token.to_text(TokenKind::MultiWriter),
            token.max_stream_pos(),
            limited,
            as_json_text,
        )
    });
    answered_updates(meta.key);
    answer
}

/// A jsonb value built by PostgreSQL, returned as it is.
pub struct JsonbDatum(pg_sys::Datum);

/// A json value (its text) built here, returned as it is.
pub struct JsonDatum(pg_sys::Datum);

/// A datum returned as it is, of the SQL type its wrapper names.
macro_rules! datum_as_is {
    ($wrapper:ident, $type_oid:expr, $sql:literal) => {
        impl pgrx::IntoDatum for $wrapper {
            fn into_datum(self) -> Option<pg_sys::Datum> {
                Some(self.0)
            }
            fn type_oid() -> pg_sys::Oid {
                $type_oid
            }
        }

        // SAFETY: the datum is a value of that type in the function's
        // memory context.
        unsafe impl pgrx::callconv::BoxRet for $wrapper {
            unsafe fn box_into<'fcx>(
                self,
                fcinfo: &mut pgrx::callconv::FcInfo<'fcx>,
            ) -> pgrx::datum::Datum<'fcx> {
                // SAFETY: as above.
                unsafe { fcinfo.return_raw_datum(self.0) }
            }
        }

        // SAFETY: maps to the SQL type the datum is.
        unsafe impl SqlTranslatable for $wrapper {
            const TYPE_IDENT: &'static str = pgrx::pgrx_resolved_type!($wrapper);
            const TYPE_ORIGIN: TypeOrigin = TypeOrigin::External;
            const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> =
                Ok(SqlMappingRef::literal($sql));
            const RETURN_SQL: Result<ReturnsRef, ReturnsError> =
                Ok(ReturnsRef::One(SqlMappingRef::literal($sql)));
        }
    };
}

datum_as_is!(JsonbDatum, pg_sys::JSONBOID, "jsonb");
datum_as_is!(JsonDatum, pg_sys::JSONOID, "json");
