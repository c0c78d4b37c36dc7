//! The extension's catalog tables: streams, instances, stored positions
//! and frontiers, history marks, prepared transactions' holds.

use super::*;

/// A row of `streampos.streams`.
pub struct StreamRow {
    pub key: i32,
    pub seq: pg_sys::Oid,
    pub owns_sequence: bool,
    pub backwards: bool,
    pub writers: Option<Vec<String>>,
}

/// The stream's row as the latest snapshot sees it (with this transaction's
/// own changes).
pub fn stream_row(name: &str) -> Option<StreamRow> {
    // SAFETY: called inside a running transaction, never in parallel mode
    // (its callers change the catalog); the command counter moves first so
    // that the transaction's own changes so far are seen.
    let snapshot = unsafe {
        pg_sys::CommandCounterIncrement();
        pg_sys::GetLatestSnapshot()
    };
    stream_row_as_of(name, snapshot)
}

/// The stream's row as `snapshot` sees it. Executed read-only with exactly
/// that snapshot (`SPI_execute_snapshot`): an ordinary SPI query in a
/// transaction that has an xid takes a new snapshot under READ COMMITTED,
/// and a cursor's FETCH would then read another catalog than its snapshot's.
pub fn stream_row_as_of(name: &str, snapshot: pg_sys::Snapshot) -> Option<StreamRow> {
    const QUERY: &CStr =
        c"SELECT s.stream_key, s.seq::pg_catalog.oid, s.owns_sequence, s.backwards, s.writers \
        FROM streampos.streams s WHERE s.stream_name OPERATOR(pg_catalog.=) $1";
    with_safe_path(|| {
        spi(Spi::connect(|_client| -> SpiResult<Option<StreamRow>> {
            let Some(arg) = name.into_datum() else {
                return Ok(None);
            };
            // SAFETY: SPI is connected for the closure; the plan is freed
            // before returning (or with the SPI context on ERROR); the
            // result's tuple and descriptor are valid until SPI finishes,
            // and every value is copied out (owned Rust values) before.
            unsafe {
                let mut types = [pg_sys::TEXTOID];
                let plan = pg_sys::SPI_prepare(QUERY.as_ptr(), 1, types.as_mut_ptr());
                if plan.is_null() {
                    return Err(pgrx::spi::SpiError::SpiError(
                        pgrx::spi::SpiErrorCodes::Unconnected,
                    ));
                }
                let mut values = [arg];
                let nulls = [b' ' as std::ffi::c_char];
                let status = pg_sys::SPI_execute_snapshot(
                    plan,
                    values.as_mut_ptr(),
                    nulls.as_ptr(),
                    snapshot,
                    std::ptr::null_mut(),
                    true,
                    false,
                    1,
                );
                let table = pg_sys::SPI_tuptable;
                let row = if status != pg_sys::SPI_OK_SELECT as i32
                    || pg_sys::SPI_processed == 0
                    || table.is_null()
                {
                    None
                } else {
                    let tuple = *(*table).vals;
                    let desc = (*table).tupdesc;
                    let column = |n: i32| {
                        let mut null = false;
                        let datum = pg_sys::SPI_getbinval(tuple, desc, n, &mut null);
                        (datum, null)
                    };
                    let (d, n) = column(1);
                    let key = i32::from_datum(d, n).unwrap_or_default();
                    let (d, n) = column(2);
                    let seq = pg_sys::Oid::from_datum(d, n).unwrap_or(pg_sys::InvalidOid);
                    let (d, n) = column(3);
                    let owns_sequence = bool::from_datum(d, n).unwrap_or_default();
                    let (d, n) = column(4);
                    let backwards = bool::from_datum(d, n).unwrap_or_default();
                    let (d, n) = column(5);
                    let writers = Vec::<Option<String>>::from_datum(d, n)
                        .map(|w| w.into_iter().flatten().collect());
                    Some(StreamRow {
                        key,
                        seq,
                        owns_sequence,
                        backwards,
                        writers,
                    })
                };
                pg_sys::SPI_freeplan(plan);
                Ok(row)
            }
        }))
    })
}

/// The OID of `streampos.streams`.
pub fn streams_table_oid() -> pg_sys::Oid {
    select_one(
        "SELECT c.oid FROM pg_catalog.pg_class c \
         JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace \
         WHERE n.nspname OPERATOR(pg_catalog.=) 'streampos' \
           AND c.relname OPERATOR(pg_catalog.=) 'streams'",
        &[],
    )
    .unwrap_or(pg_sys::InvalidOid)
}

pub fn stream_names() -> Vec<String> {
    select_all("SELECT s.stream_name FROM streampos.streams s", &[], |r| {
        r.get::<String>(1)
    })
}

/// The stream that already uses sequence `seq`, if any.
pub fn stream_of_sequence(seq: pg_sys::Oid) -> Option<String> {
    select_one(
        "SELECT s.stream_name FROM streampos.streams s \
         WHERE s.seq::pg_catalog.oid OPERATOR(pg_catalog.=) $1",
        &[seq.into()],
    )
}

pub fn instance_id_of(name: &str) -> Option<i32> {
    select_one(
        "SELECT i.instance_id FROM streampos.instances i \
         WHERE i.instance_name OPERATOR(pg_catalog.=) $1",
        &[name.into()],
    )
}

/// Insert a new instance name; None when it exists already. The id
/// sequence is first moved past every id in the table, so that ids given
/// explicitly (imported, restored) are never handed out again.
pub fn insert_instance(name: &str) -> Option<i32> {
    lock_catalog_for_change();
    as_owner(|| {
        update_one::<i64>(
            "SELECT pg_catalog.setval('streampos.instances_instance_id_seq'::pg_catalog.regclass, m.max_id) \
             FROM (SELECT pg_catalog.max(i.instance_id)::pg_catalog.int8 AS max_id FROM streampos.instances i) m \
             WHERE m.max_id OPERATOR(pg_catalog.>) \
                   (SELECT CASE WHEN q.is_called THEN q.last_value \
                                ELSE q.last_value OPERATOR(pg_catalog.-) 1 END \
                    FROM streampos.instances_instance_id_seq q)",
            &[],
        );
        update_one(
            "INSERT INTO streampos.instances (instance_name) VALUES ($1) \
             ON CONFLICT (instance_name) DO NOTHING RETURNING instance_id",
            &[name.into()],
        )
    })
}

pub fn instance_name_of(id: i32) -> Option<String> {
    select_one(
        "SELECT i.instance_name FROM streampos.instances i \
         WHERE i.instance_id OPERATOR(pg_catalog.=) $1",
        &[id.into()],
    )
}

pub fn instance_names() -> HashMap<i32, String> {
    select_all(
        "SELECT i.instance_id, i.instance_name FROM streampos.instances i",
        &[],
        |r| Ok(r.get::<i32>(1)?.zip(r.get::<String>(2)?)),
    )
    .into_iter()
    .collect()
}

/// (instance id, stored position in internal numbering) for the stream.
pub fn stored_positions(stream: &str) -> Vec<(i32, i64)> {
    select_all(
        "SELECT i.instance_id, pg_catalog.abs(p.stream_id) FROM streampos.stream_positions p \
         JOIN streampos.instances i ON i.instance_name OPERATOR(pg_catalog.=) p.instance_name \
         WHERE p.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
        |r| Ok(r.get::<i32>(1)?.zip(r.get::<i64>(2)?)),
    )
}

/// The stored frontier (internal numbering), written with the positions;
/// None before the worker stored one.
pub fn stored_frontier(stream: &str) -> Option<i64> {
    // A database not yet updated from 0.2.0 has no stored frontiers.
    if !catalog_table_exists(c"stream_frontiers") {
        return None;
    }
    select_one(
        "SELECT pg_catalog.abs(f.stream_id) FROM streampos.stream_frontiers f \
         WHERE f.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
    )
}

/// Whether a prepared transaction from before the start whose first xid
/// is `start` (its low 32 bits) is still there, or a session's snapshot
/// from before one's COMMIT PREPARED (docs/design.md, "What outlives a
/// start"). The shared horizon says "maybe" for both, and also for what
/// reads nothing of this server's registry: a standby's
/// `hot_standby_feedback` (its walsender's xmin, sent again after a
/// restart) and replication slots. Read as the extension's owner: another
/// role's sessions show no backend type (counted, as a walsender of such a
/// role would be).
pub fn older_than_start(start: u32) -> bool {
    as_role(extension_owner(), || {
        select_one::<bool>(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_prepared_xacts p \
                 WHERE pg_catalog.age(p.transaction) OPERATOR(pg_catalog.>) \
                       pg_catalog.age($1::pg_catalog.text::pg_catalog.xid)) \
             OR EXISTS (SELECT FROM pg_catalog.pg_stat_activity a \
                 WHERE a.backend_type IS DISTINCT FROM 'walsender' \
                   AND pg_catalog.age(a.backend_xmin) OPERATOR(pg_catalog.>) \
                       pg_catalog.age($1::pg_catalog.text::pg_catalog.xid))",
            &[start.to_string().into()],
        )
    })
    .unwrap_or(true)
}

/// Whether a prepared transaction of this database, or a session's
/// snapshot in it, is older than xid `xid` (its low 32 bits): a
/// transaction prepared before the records table was made recorded
/// nothing, and a snapshot from before its COMMIT PREPARED still cannot
/// see its rows. Read as the extension's owner (other roles' sessions
/// show their xmin only to it).
pub fn older_than(xid: u32) -> bool {
    as_role(extension_owner(), || {
        select_one::<bool>(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_prepared_xacts p \
                 WHERE p.database OPERATOR(pg_catalog.=) pg_catalog.current_database() \
                   AND pg_catalog.age(p.transaction) OPERATOR(pg_catalog.>) \
                       pg_catalog.age($1::pg_catalog.text::pg_catalog.xid)) \
             OR EXISTS (SELECT FROM pg_catalog.pg_stat_activity a \
                 WHERE a.datname OPERATOR(pg_catalog.=) pg_catalog.current_database() \
                   AND pg_catalog.age(a.backend_xmin) OPERATOR(pg_catalog.>) \
                       pg_catalog.age($1::pg_catalog.text::pg_catalog.xid))",
            &[xid.to_string().into()],
        )
    })
    .unwrap_or(true)
}

/// The highest stored position or frontier at or below `at_most`
/// (internal numbering).
pub fn max_stored_at_most(stream: &str, at_most: i64) -> Option<i64> {
    select_one(
        "SELECT pg_catalog.max(x.p) FROM ( \
           SELECT pg_catalog.abs(p.stream_id) AS p FROM streampos.stream_positions p \
           WHERE p.stream_name OPERATOR(pg_catalog.=) $1 \
           UNION ALL \
           SELECT pg_catalog.abs(f.stream_id) FROM streampos.stream_frontiers f \
           WHERE f.stream_name OPERATOR(pg_catalog.=) $1) x \
         WHERE x.p OPERATOR(pg_catalog.<=) $2",
        &[stream.into(), at_most.into()],
    )
}

/// Does the extension's table `name` exist? (A database not yet updated
/// from 0.2.0 lacks the tables 0.3.0 added.)
pub(super) fn catalog_table_exists(name: &CStr) -> bool {
    catalog_table(name).is_some()
}

/// The extension's table `name`, if it exists (a database not yet updated
/// lacks the tables later versions added).
pub fn catalog_table(name: &CStr) -> Option<pg_sys::Oid> {
    // SAFETY: catalog lookups that return InvalidOid for what does not
    // exist; they raise no error.
    let relid = unsafe {
        let nsp = pg_sys::get_namespace_oid(c"streampos".as_ptr(), true);
        if nsp == pg_sys::InvalidOid {
            return None;
        }
        pg_sys::get_relname_relid(name.as_ptr(), nsp)
    };
    (relid != pg_sys::InvalidOid).then_some(relid)
}

/// In the transaction being prepared: what it may hold rows of, (stream
/// key, writer, lowest ID) (`prepared::record`), as the extension's owner.
/// Nothing in a catalog not yet updated to 0.4.0.
pub fn record_prepared_holds(holds: &[(i32, i32, i64)]) {
    if holds.is_empty() || !catalog_table_exists(c"prepared_holds") {
        return;
    }
    let keys: Vec<i32> = holds.iter().map(|h| h.0).collect();
    let writers: Vec<i32> = holds.iter().map(|h| h.1).collect();
    let ids: Vec<i64> = holds.iter().map(|h| h.2).collect();
    as_owner(|| {
        run(
            "INSERT INTO streampos.prepared_holds (stream_key, instance_id, min_id) \
             SELECT u.k, u.w, u.m \
             FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int4[]), \
                             pg_catalog.unnest($2::pg_catalog.int4[]), \
                             pg_catalog.unnest($3::pg_catalog.int8[])) AS u(k, w, m)",
            &[keys.into(), writers.into(), ids.into()],
        )
    });
}

/// Forget the records of prepared transactions that committed before the
/// shared horizon `horizon`: every snapshot sees their rows (a snapshot
/// from before a COMMIT PREPARED holds the horizon at or below its xid, and
/// keeps its records). Run by the position worker, as the extension's
/// owner. The rows of transactions still prepared are not visible to it.
pub fn forget_prepared_holds(horizon: pg_sys::TransactionId) {
    if !catalog_table_exists(c"prepared_holds") {
        return;
    }
    as_owner(|| {
        run(
            "DELETE FROM streampos.prepared_holds h \
             WHERE h.stream_key OPERATOR(pg_catalog.<>) 0 \
               AND pg_catalog.age(h.xmin) OPERATOR(pg_catalog.>) \
                   pg_catalog.age($1::pg_catalog.text::pg_catalog.xid)",
            &[horizon.into_inner().to_string().into()],
        )
    });
}

/// The stream's marks, of every history: (history, have, ceiling). None in
/// a database not yet updated from 0.2.0 (no `history_marks`: it keeps
/// working with the new library, as before).
pub fn history_marks(stream: &str) -> Vec<(u64, i64, i64)> {
    if !catalog_table_exists(c"history_marks") {
        return Vec::new();
    }
    select_all(
        "SELECT m.history, m.have, m.ceiling FROM streampos.history_marks m \
         WHERE m.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
        |r| {
            Ok(r.get::<i64>(1)?
                .zip(r.get::<i64>(2)?)
                .zip(r.get::<i64>(3)?)
                .map(|((h, have), ceiling)| (h as u64, have, ceiling)))
        },
    )
}

/// Store a stream's mark in history `history`, as the extension's owner;
/// a mark once stored is kept.
pub fn insert_history_mark(history: u64, stream: &str, have: i64, ceiling: i64) {
    as_owner(|| {
        run(
            "INSERT INTO streampos.history_marks (history, stream_name, have, ceiling) \
             VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
            &[
                (history as i64).into(),
                stream.into(),
                have.into(),
                ceiling.into(),
            ],
        )
    });
}

pub fn max_stored_position(stream: &str) -> Option<i64> {
    select_one(
        "SELECT pg_catalog.max(pg_catalog.abs(p.stream_id)) FROM streampos.stream_positions p \
         WHERE p.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
    )
}

fn text_array(values: Option<Vec<String>>) -> DatumWithOid<'static> {
    match values {
        Some(v) => v.into(),
        None => DatumWithOid::null::<Vec<String>>(),
    }
}

pub fn insert_stream(
    stream: &str,
    seq: pg_sys::Oid,
    owns: bool,
    backwards: bool,
    writers: Option<Vec<String>>,
) {
    let args: [DatumWithOid; 5] = [
        stream.into(),
        DatumWithOid::from(seq),
        owns.into(),
        backwards.into(),
        text_array(writers),
    ];
    lock_catalog_for_change();
    as_owner(|| {
        run(
            "INSERT INTO streampos.streams (stream_name, seq, owns_sequence, backwards, writers) \
             VALUES ($1, $2::pg_catalog.oid::pg_catalog.regclass, $3, $4, $5)",
            &args,
        )
    });
}

pub fn delete_stream(stream: &str) {
    lock_catalog_for_change();
    as_owner(|| {
        run(
            "DELETE FROM streampos.streams s WHERE s.stream_name OPERATOR(pg_catalog.=) $1",
            &[stream.into()],
        )
    });
}

pub fn set_stream_writers(stream: &str, writers: Option<Vec<String>>) {
    let args: [DatumWithOid; 2] = [stream.into(), text_array(writers)];
    lock_catalog_for_change();
    as_owner(|| {
        run(
            "UPDATE streampos.streams s SET writers = $2 \
             WHERE s.stream_name OPERATOR(pg_catalog.=) $1",
            &args,
        )
    });
}

/// A removed writer loses its stored position; a new one starts at `front`.
pub fn reset_positions(stream: &str, writers: Vec<String>, front: i64) {
    as_owner(|| {
        run(
            "DELETE FROM streampos.stream_positions p \
             WHERE p.stream_name OPERATOR(pg_catalog.=) $1 \
               AND p.instance_name OPERATOR(pg_catalog.<>) ALL ($2)",
            &[stream.into(), writers.clone().into()],
        );
        run(
            "INSERT INTO streampos.stream_positions (stream_name, instance_name, stream_id) \
             SELECT $1, w.name, $3 FROM pg_catalog.unnest($2::pg_catalog.text[]) AS w(name) \
             ON CONFLICT DO NOTHING",
            &[stream.into(), writers.into(), front.into()],
        );
    });
}

pub fn upsert_stream_table(
    stream: &str,
    tbl: pg_sys::Oid,
    id_column: &str,
    instance_column: Option<&str>,
) {
    as_owner(|| {
        run(
            "INSERT INTO streampos.stream_tables (stream_name, tbl, id_column, instance_column) \
             VALUES ($1, $2::pg_catalog.oid::pg_catalog.regclass, $3, $4) \
             ON CONFLICT (stream_name, tbl) DO UPDATE \
             SET id_column = EXCLUDED.id_column, instance_column = EXCLUDED.instance_column",
            &[
                stream.into(),
                tbl.into(),
                id_column.into(),
                instance_column.into(),
            ],
        )
    });
}

/// Databases that exist (for reclaiming registry state of dropped ones).
pub fn database_oids() -> Vec<pg_sys::Oid> {
    select_all("SELECT d.oid FROM pg_catalog.pg_database d", &[], |r| {
        r.get::<pg_sys::Oid>(1)
    })
}
