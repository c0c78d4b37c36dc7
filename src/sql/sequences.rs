//! A stream's sequence: create, drop, settings, `setval`.

use super::*;

/// Create the sequence a stream owns, owned by `owner_role` (the role that
/// created the stream); returns its OID.
pub fn create_sequence(name: &str, owner_role: pg_sys::Oid) -> pg_sys::Oid {
    let qualified = format!("streampos.{}", quote_ident(name));
    as_owner(|| {
        run(
            &format!(
                "CREATE SEQUENCE {qualified} AS pg_catalog.int8 \
                 INCREMENT 1 MINVALUE 1 START 1 CACHE 1 NO CYCLE"
            ),
            &[],
        );
        run(
            &format!(
                "ALTER SEQUENCE {qualified} OWNER TO {}",
                role_name(owner_role)
            ),
            &[],
        );
        select_one(
            "SELECT c.oid FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace \
             WHERE n.nspname OPERATOR(pg_catalog.=) 'streampos' \
               AND c.relname OPERATOR(pg_catalog.=) $1",
            &[name.into()],
        )
        .unwrap_or(pg_sys::InvalidOid)
    })
}

/// Drop a sequence a stream owns, if it is still the one in schema
/// streampos that the stream created, with what depends on it: a view or a
/// column default another role made on it (any role may make one, and one
/// would otherwise make `drop_stream` fail), each named in a NOTICE. Run
/// under `with_lock_wait_bound`: such an object locked by another session
/// makes the drop fail (55P03) instead of waiting while the stream's
/// writers queue behind it.
pub fn drop_owned_sequence(seq: pg_sys::Oid, stream: &str) {
    let in_streampos: Option<bool> = select_one(
        "SELECT true FROM pg_catalog.pg_class c \
         JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace \
         WHERE c.oid OPERATOR(pg_catalog.=) $1 AND c.relkind OPERATOR(pg_catalog.=) 'S' \
           AND n.nspname OPERATOR(pg_catalog.=) 'streampos'",
        &[seq.into()],
    );
    if in_streampos.is_some() {
        let name = relation_name(seq);
        let message = format!(
            "could not drop sequence {name} of stream \"{}\": an object that depends on it is locked by another session",
            crate::error::clip(stream)
        );
        let detail = format!(
            "drop_stream waits at most {} ms for a lock, so that the stream's writers do not queue behind it.",
            lock_wait_bound_ms()
        );
        let statement = format!("DROP SEQUENCE {name} CASCADE");
        pgrx::PgTryBuilder::new(|| as_owner(|| run(&statement, &[])))
            .catch_when(pgrx::PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE, |_| {
                Error::LockTimeout {
                    message: message.clone(),
                    detail: detail.clone(),
                }
                .report()
            })
            .execute();
    }
}

/// (INCREMENT, CACHE, MINVALUE, CYCLE) of a sequence; None when `oid` is
/// not a sequence.
pub fn sequence_settings(oid: pg_sys::Oid) -> Option<(i64, i64, i64, bool)> {
    with_safe_path(|| {
        spi(Spi::connect(|client| {
            let table = client.select(
                "SELECT q.seqincrement, q.seqcache, q.seqmin, q.seqcycle FROM pg_catalog.pg_sequence q \
                 WHERE q.seqrelid OPERATOR(pg_catalog.=) $1",
                Some(1),
                &[oid.into()],
            )?;
            if table.is_empty() {
                return Ok(None);
            }
            let row = table.first();
            Ok(Some((
                row.get::<i64>(1)?.unwrap_or(0),
                row.get::<i64>(2)?.unwrap_or(0),
                row.get::<i64>(3)?.unwrap_or(0),
                row.get::<bool>(4)?.unwrap_or(false),
            )))
        }))
    })
}

/// A relation's persistence: 'p' permanent, 'u' unlogged, 't' temporary.
pub fn relation_persistence(oid: pg_sys::Oid) -> Option<String> {
    select_one(
        "SELECT c.relpersistence::pg_catalog.text FROM pg_catalog.pg_class c \
         WHERE c.oid OPERATOR(pg_catalog.=) $1",
        &[oid.into()],
    )
}

/// Move a sequence to `value` (is_called), with the caller's privileges.
pub fn setval(seq: pg_sys::Oid, value: i64) {
    update_one::<i64>(
        "SELECT pg_catalog.setval($1::pg_catalog.oid::pg_catalog.regclass, $2, true)",
        &[seq.into(), value.into()],
    );
}
