//! The position worker's statements: its locks, stored positions,
//! frontier marks, notifications.

use super::*;

pub fn extension_present() -> bool {
    select_one::<bool>(
        "SELECT true FROM pg_catalog.pg_extension e \
         WHERE e.extname OPERATOR(pg_catalog.=) 'streampos'",
        &[],
    )
    .is_some()
}

/// The catalog tables a pass of the position worker reads or writes,
/// locked at its start in this order, each only if granted at once
/// (`ConditionalLockRelationOid`, the lock `LOCK TABLE … NOWAIT` takes):
/// `streams` ROW SHARE (its rows are share-locked), `instances` ACCESS
/// SHARE, `stream_positions`, `stream_frontiers` and `frontier_marks` ROW
/// EXCLUSIVE. None
/// when one is not granted (an operator's command holds or waits for it:
/// the pass is put off) or is gone (the extension is being dropped). The
/// worker then never waits for an operator's command while holding a lock
/// that command needs (see docs/design.md, "The position worker's locks").
pub struct PassTables {
    /// `stream_frontiers` exists (a database not yet updated from 0.2.0
    /// has none).
    pub frontiers: bool,
    /// `frontier_marks` (and consumers) exist: 0.3.0's catalog.
    pub marks: bool,
}

pub fn lock_for_pass() -> Option<PassTables> {
    const TABLES: [(&CStr, u32, bool); 5] = [
        (c"streams", pg_sys::RowShareLock, true),
        (c"instances", pg_sys::AccessShareLock, true),
        (c"stream_positions", pg_sys::RowExclusiveLock, true),
        (c"stream_frontiers", pg_sys::RowExclusiveLock, false),
        (c"frontier_marks", pg_sys::RowExclusiveLock, false),
    ];
    // SAFETY: catalog lookups that return InvalidOid for what does not
    // exist; a conditional lock raises no error (it returns false); the
    // locks are released at the end of the pass's transaction.
    unsafe {
        let nsp = pg_sys::get_namespace_oid(c"streampos".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            return None;
        }
        let mut present = [false; TABLES.len()];
        for (k, (name, mode, required)) in TABLES.into_iter().enumerate() {
            let oid = pg_sys::get_relname_relid(name.as_ptr(), nsp);
            if oid == pg_sys::InvalidOid {
                if required {
                    return None;
                }
                continue;
            }
            if !pg_sys::ConditionalLockRelationOid(oid, mode as pg_sys::LOCKMODE) {
                return None;
            }
            // Dropped between the lookup and the lock (the lock took in
            // the invalidations of the drop's commit).
            if pg_sys::get_rel_name(oid).is_null() {
                return None;
            }
            present[k] = true;
        }
        Some(PassTables {
            frontiers: present[3],
            marks: present[4],
        })
    }
}

/// Store one stream's positions and, with `frontier`, its frontier (the
/// same a reader in this snapshot gets: one statement, one snapshot, so
/// the frontier is never above a position stored with it). Run by the
/// position worker, its tables locked (`lock_for_pass`). The stream's row
/// is share-locked first, NOWAIT (55P03: the worker tries again next pass):
/// a `set_writers` in progress (which deletes removed writers' positions)
/// is not overtaken, and the positions, read by the next statement's
/// snapshot, follow its writer list (never bringing a removed writer
/// back). Neither ever moves back. False when the stream is gone (dropped
/// since the pass began).
pub fn store_positions(stream: &str, frontier: bool) -> bool {
    let locked = update_one::<bool>(
        "SELECT true FROM streampos.streams s WHERE s.stream_name OPERATOR(pg_catalog.=) $1 \
         FOR SHARE NOWAIT",
        &[stream.into()],
    );
    if locked.is_none() {
        return false;
    }
    const POSITIONS: &str =
        "INSERT INTO streampos.stream_positions (stream_name, instance_name, stream_id) \
           SELECT $1, w.instance_name, w.stream_id FROM streampos.writer_positions($1) w \
           ON CONFLICT (stream_name, instance_name) DO UPDATE \
           SET stream_id = EXCLUDED.stream_id \
           WHERE pg_catalog.abs(EXCLUDED.stream_id) OPERATOR(pg_catalog.>) \
                 pg_catalog.abs(streampos.stream_positions.stream_id)";
    if !frontier {
        // 0.2.0's catalog, until ALTER EXTENSION streampos UPDATE.
        run(POSITIONS, &[stream.into()]);
        return true;
    }
    run(
        &format!(
            "WITH p AS ({POSITIONS}) \
             INSERT INTO streampos.stream_frontiers (stream_name, stream_id) \
             VALUES ($1, streampos.frontier($1)) \
             ON CONFLICT (stream_name) DO UPDATE SET stream_id = EXCLUDED.stream_id \
             WHERE pg_catalog.abs(EXCLUDED.stream_id) OPERATOR(pg_catalog.>) \
                   pg_catalog.abs(streampos.stream_frontiers.stream_id)"
        ),
        &[stream.into()],
    );
    true
}

/// Mark the stream's current token `token` (as the position worker's pass
/// computed it) as passed now, if the stream has consumers (their lag in
/// time, the view `consumers`); and let go of marks no consumer needs:
/// every mark once the stream has no consumers, marks every consumer has
/// acknowledged, and, past an hour's age, all but the latest mark of each
/// minute (past a day's, of each hour). A consumer's lag is counted from
/// its first mark not acknowledged; keeping the latest of a bucket keeps
/// that an underestimate by less than the bucket. Run by the position
/// worker, `frontier_marks` locked (`lock_for_pass`). Not when a mark at
/// or past the token exists (a registration's, `insert_mark`: a pass that
/// first saw the token after it would mark it again). Whether the token is
/// marked (false: the stream has no consumers); None, doing nothing, when
/// `consumer_positions` is not granted to it at once (an operator's
/// command holds it: the worker marks a second later).
pub fn mark_frontier(stream: &str, token: &str) -> Option<bool> {
    // SAFETY: catalog lookups that return InvalidOid for what does not
    // exist; a conditional lock raises no error; it is released at the
    // end of the pass's transaction.
    let locked = unsafe {
        let nsp = pg_sys::get_namespace_oid(c"streampos".as_ptr(), true);
        let rel = if nsp == pg_sys::InvalidOid {
            pg_sys::InvalidOid
        } else {
            pg_sys::get_relname_relid(c"consumer_positions".as_ptr(), nsp)
        };
        rel != pg_sys::InvalidOid
            && pg_sys::ConditionalLockRelationOid(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE)
    };
    if !locked {
        return None;
    }
    // `safe` once for the statement (MATERIALIZED): as a joined subquery
    // the planner called safe_to_delete() for every mark. Only for a
    // stream this statement sees (NULL for one dropped since the pass
    // began: safe_to_delete() would raise 42704).
    let marked = update_one::<i64>(
        "WITH covered AS MATERIALIZED ( \
           SELECT FROM streampos.frontier_marks m \
           WHERE m.stream_name OPERATOR(pg_catalog.=) $1 \
             AND streampos.is_before_or_eq($2::pg_catalog.text::streampos.multi_writer_token, \
                                           m.position) \
           LIMIT 1), \
         safe AS MATERIALIZED ( \
           SELECT (SELECT streampos.safe_to_delete(s.stream_name) FROM streampos.streams s \
                   WHERE s.stream_name OPERATOR(pg_catalog.=) $1) AS safe), \
         marked AS ( \
           INSERT INTO streampos.frontier_marks (stream_name, marked_at, position) \
           SELECT $1, pg_catalog.clock_timestamp(), \
                  $2::pg_catalog.text::streampos.multi_writer_token \
           WHERE EXISTS (SELECT FROM streampos.consumer_positions c \
                         WHERE c.stream_name OPERATOR(pg_catalog.=) $1) \
             AND NOT EXISTS (SELECT FROM covered) \
           ON CONFLICT DO NOTHING \
           RETURNING true), \
         pruned AS ( \
           DELETE FROM streampos.frontier_marks m USING safe k \
           WHERE m.stream_name OPERATOR(pg_catalog.=) $1 \
             AND (k.safe IS NULL \
                  OR streampos.is_before_or_eq(m.position, k.safe) \
                  OR EXISTS ( \
                    SELECT FROM (SELECT CASE \
                        WHEN m.marked_at OPERATOR(pg_catalog.<) \
                             (pg_catalog.now() OPERATOR(pg_catalog.-) '1 day'::pg_catalog.interval) \
                          THEN 'hour' \
                        WHEN m.marked_at OPERATOR(pg_catalog.<) \
                             (pg_catalog.now() OPERATOR(pg_catalog.-) '1 hour'::pg_catalog.interval) \
                          THEN 'minute' END AS unit) b, \
                      streampos.frontier_marks n \
                    WHERE n.stream_name OPERATOR(pg_catalog.=) m.stream_name \
                      AND n.marked_at OPERATOR(pg_catalog.>) m.marked_at \
                      AND n.marked_at OPERATOR(pg_catalog.<) \
                          (pg_catalog.date_trunc(b.unit, m.marked_at) OPERATOR(pg_catalog.+) \
                           ('1 ' OPERATOR(pg_catalog.||) b.unit)::pg_catalog.interval))) \
           RETURNING true) \
         SELECT (SELECT pg_catalog.count(*) FROM marked) \
                OPERATOR(pg_catalog.+) \
                (SELECT pg_catalog.count(*) FROM covered \
                 WHERE EXISTS (SELECT FROM streampos.consumer_positions c \
                               WHERE c.stream_name OPERATOR(pg_catalog.=) $1))",
        &[stream.into(), token.into()],
    );
    Some(marked.unwrap_or(0) > 0)
}

/// Mark `token` (token text) of the stream as passed now, in the caller's
/// transaction: a consumer registered below the current token has rows
/// to catch up on from now at least, while the position worker marks only
/// tokens that move (see `mark_frontier`). Not when a mark at or past
/// `token` exists already: the token has been past the consumer's position
/// since that mark at least (so the lag stays within the truth), and
/// registering and unregistering in a loop adds no row (marks are bounded
/// by the worker's once a second and its thinning, not by registrations).
pub fn insert_mark(stream: &str, token: &str) {
    as_owner(|| {
        run(
            "INSERT INTO streampos.frontier_marks (stream_name, marked_at, position) \
             SELECT $1, pg_catalog.clock_timestamp(), t.token \
             FROM (SELECT $2::pg_catalog.text::streampos.multi_writer_token AS token) t \
             WHERE NOT EXISTS (SELECT FROM streampos.frontier_marks m \
                               WHERE m.stream_name OPERATOR(pg_catalog.=) $1 \
                                 AND streampos.is_before_or_eq(t.token, m.position)) \
             ON CONFLICT DO NOTHING",
            &[stream.into(), token.into()],
        )
    });
}

/// Longest token a notification carries: NOTIFY payloads must stay under
/// 8000 bytes, and a stream with hundreds of writers ahead of its frontier
/// has a longer token. Beyond it the payload carries the frontier alone
/// (a token never ahead of the truth).
const NOTIFY_TOKEN_BYTES: i32 = 7000;

/// Followers that prefer LISTEN to long-polling: one notification per
/// advance, from the position worker, never from the writers' commits
/// (NOTIFY takes a lock that would serialise them).
pub fn notify_positions(stream: &str) {
    run(
        "SELECT pg_catalog.pg_notify('streampos', \
                $1 OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||) \
                CASE WHEN pg_catalog.octet_length(x.t) OPERATOR(pg_catalog.<=) $2 THEN x.t \
                     ELSE 'm' OPERATOR(pg_catalog.||) streampos.frontier($1)::pg_catalog.text END) \
         FROM (SELECT streampos.current_token($1)::pg_catalog.text AS t) x",
        &[stream.into(), NOTIFY_TOKEN_BYTES.into()],
    );
}
