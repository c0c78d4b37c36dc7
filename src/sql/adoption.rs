//! `adopt_synapse`: what it reads in Synapse's schema and writes into the
//! catalog. Synapse's relations are looked up by (schema OID, name) in the
//! catalog, with the names as parameters, then used by OID; SQL text names
//! them only through `relation_name` at the moment of use. They are read as
//! their owner (`read_as_owner`); the catalog is written as the extension's
//! owner.

use super::*;

/// `schema.name`, each part quoted when it needs it (for messages about
/// objects that do not exist, so have no OID).
pub fn qualified_name(schema: &str, name: &str) -> String {
    format!("{}.{}", quote_ident(schema), quote_ident(name))
}

/// The OID of schema `name`.
pub fn namespace_oid(name: &str) -> Option<pg_sys::Oid> {
    select_one(
        "SELECT n.oid FROM pg_catalog.pg_namespace n WHERE n.nspname OPERATOR(pg_catalog.=) $1",
        &[name.into()],
    )
}

/// The relation called `name` in schema `nsp`: its OID and relkind.
pub fn relation_in(nsp: pg_sys::Oid, name: &str) -> Option<(pg_sys::Oid, String)> {
    select_all(
        "SELECT c.oid, c.relkind::pg_catalog.text FROM pg_catalog.pg_class c \
         WHERE c.relnamespace OPERATOR(pg_catalog.=) $1 AND c.relname OPERATOR(pg_catalog.=) $2",
        &[nsp.into(), name.into()],
        |r| Ok(r.get::<pg_sys::Oid>(1)?.zip(r.get::<String>(2)?)),
    )
    .into_iter()
    .next()
}

/// The type of the live column `column` of `tbl`.
pub fn column_type(tbl: pg_sys::Oid, column: &str) -> Option<pg_sys::Oid> {
    select_one(
        "SELECT a.atttypid FROM pg_catalog.pg_attribute a \
         WHERE a.attrelid OPERATOR(pg_catalog.=) $1 AND a.attname OPERATOR(pg_catalog.=) $2 \
           AND a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped",
        &[tbl.into(), column.into()],
    )
}

/// The highest version in Synapse's `schema_version` table `tbl`, read as
/// its owner (`read_as_owner`).
pub fn synapse_schema_version(tbl: pg_sys::Oid) -> Option<i64> {
    read_as_owner(tbl, &["version"], |name| {
        select_one(
            &format!("SELECT pg_catalog.max(t.version)::pg_catalog.int8 FROM {name} t"),
            &[],
        )
    })
    .flatten()
}

/// Synapse's `instance_map` rows (instance_id, instance_name), by id, read
/// as its owner (`read_as_owner`).
pub fn synapse_instances(tbl: pg_sys::Oid) -> Vec<(i64, String)> {
    read_as_owner(tbl, &["instance_id", "instance_name"], |name| {
        select_all(
            &format!(
                "SELECT t.instance_id::pg_catalog.int8, t.instance_name::pg_catalog.text FROM {name} t \
                 WHERE t.instance_id IS NOT NULL AND t.instance_name IS NOT NULL ORDER BY 1"
            ),
            &[],
            |r| Ok(r.get::<i64>(1)?.zip(r.get::<String>(2)?)),
        )
    })
    .unwrap_or_default()
}

/// The sequence that feeds column `column` of `tbl`: the one it owns
/// (serial, `OWNED BY`, identity) or the one its default reads.
pub fn column_sequence(tbl: pg_sys::Oid, column: &str) -> Option<pg_sys::Oid> {
    select_one(
        "SELECT d.objid FROM pg_catalog.pg_depend d \
         JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) d.refobjid \
          AND a.attnum OPERATOR(pg_catalog.=) d.refobjsubid \
         JOIN pg_catalog.pg_class s ON s.oid OPERATOR(pg_catalog.=) d.objid \
         WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass \
           AND d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass \
           AND d.refobjid OPERATOR(pg_catalog.=) $1 AND a.attname OPERATOR(pg_catalog.=) $2 \
           AND d.deptype OPERATOR(pg_catalog.=) ANY ('{a,i}'::pg_catalog.\"char\"[]) \
           AND s.relkind OPERATOR(pg_catalog.=) 'S' \
         UNION ALL \
         SELECT d.refobjid FROM pg_catalog.pg_attrdef ad \
         JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) ad.adrelid \
          AND a.attnum OPERATOR(pg_catalog.=) ad.adnum \
         JOIN pg_catalog.pg_depend d \
           ON d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_attrdef'::pg_catalog.regclass \
          AND d.objid OPERATOR(pg_catalog.=) ad.oid \
         JOIN pg_catalog.pg_class s ON s.oid OPERATOR(pg_catalog.=) d.refobjid \
         WHERE d.refclassid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass \
           AND ad.adrelid OPERATOR(pg_catalog.=) $1 AND a.attname OPERATOR(pg_catalog.=) $2 \
           AND s.relkind OPERATOR(pg_catalog.=) 'S' \
         LIMIT 1",
        &[tbl.into(), column.into()],
    )
}

/// Synapse's `stream_positions` rows of one stream (instance_name,
/// stream_id, signed), read as its owner (`read_as_owner`).
pub fn synapse_positions(tbl: pg_sys::Oid, stream: &str) -> Vec<(String, i64)> {
    read_as_owner(tbl, &["stream_name", "instance_name", "stream_id"], |name| {
        select_all(
            &format!(
                "SELECT t.instance_name::pg_catalog.text, t.stream_id::pg_catalog.int8 FROM {name} t \
                 WHERE t.stream_name::pg_catalog.text OPERATOR(pg_catalog.=) $1 \
                   AND t.instance_name IS NOT NULL AND t.stream_id IS NOT NULL \
                 ORDER BY 1"
            ),
            &[stream.into()],
            |r| Ok(r.get::<String>(1)?.zip(r.get::<i64>(2)?)),
        )
    })
    .unwrap_or_default()
}

/// A stream's registered tables: (table, id column, instance column).
pub fn registered_tables(stream: &str) -> Vec<(pg_sys::Oid, String, Option<String>)> {
    select_all(
        "SELECT t.tbl::pg_catalog.oid, t.id_column::pg_catalog.text, t.instance_column::pg_catalog.text \
         FROM streampos.stream_tables t WHERE t.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
        |r| {
            let instance = r.get::<String>(3)?;
            Ok(r
                .get::<pg_sys::Oid>(1)?
                .zip(r.get::<String>(2)?)
                .map(|(tbl, id)| (tbl, id, instance)))
        },
    )
}

/// Insert instances with the ids they have elsewhere (Synapse's), then move
/// the id sequence past every id in the table and past `floor` (ids the
/// other system handed out, or burnt), so that a name added later never
/// gets one of them. Run under `lock_catalog_for_adoption`.
pub fn import_instances(instances: &[(i32, String)], floor: i64) {
    let ids: Vec<i32> = instances.iter().map(|(id, _)| *id).collect();
    let names: Vec<String> = instances.iter().map(|(_, name)| name.clone()).collect();
    as_owner(|| {
        if !instances.is_empty() {
            run(
                "INSERT INTO streampos.instances (instance_id, instance_name) \
                 SELECT u.id, u.name \
                 FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.int4[]), \
                                 pg_catalog.unnest($2::pg_catalog.text[])) AS u(id, name)",
                &[ids.into(), names.into()],
            );
        }
        // The last value handed out is last_value, or one less before the
        // first nextval (is_called false).
        update_one::<i64>(
            "SELECT pg_catalog.setval('streampos.instances_instance_id_seq'::pg_catalog.regclass, m.target, true) \
             FROM (SELECT GREATEST($1::pg_catalog.int8, \
                                   (SELECT pg_catalog.max(i.instance_id) FROM streampos.instances i)::pg_catalog.int8) \
                          AS target) m, \
                  streampos.instances_instance_id_seq q \
             WHERE m.target OPERATOR(pg_catalog.>) \
                   CASE WHEN q.is_called THEN q.last_value ELSE q.last_value OPERATOR(pg_catalog.-) 1 END",
            &[floor.into()],
        );
    });
}

/// Store positions for a stream, signed as the stream numbers them, never
/// lowering a position already stored (compared by magnitude, as backward
/// streams store negative positions). Returns the rows inserted or raised.
pub fn import_positions(stream: &str, positions: &[(String, i64)]) -> Vec<(String, i64)> {
    let names: Vec<String> = positions.iter().map(|(name, _)| name.clone()).collect();
    let ids: Vec<i64> = positions.iter().map(|(_, id)| *id).collect();
    let args: [DatumWithOid; 3] = [stream.into(), names.into(), ids.into()];
    as_owner(|| {
        with_safe_path(|| {
            spi(Spi::connect_mut(|client| {
                let mut out = Vec::new();
                let changed = client.update(
                    "INSERT INTO streampos.stream_positions AS p (stream_name, instance_name, stream_id) \
                     SELECT $1, u.name, u.id \
                     FROM ROWS FROM (pg_catalog.unnest($2::pg_catalog.text[]), \
                                     pg_catalog.unnest($3::pg_catalog.int8[])) AS u(name, id) \
                     ON CONFLICT (stream_name, instance_name) DO UPDATE SET stream_id = EXCLUDED.stream_id \
                     WHERE pg_catalog.abs(EXCLUDED.stream_id) OPERATOR(pg_catalog.>) pg_catalog.abs(p.stream_id) \
                     RETURNING p.instance_name, p.stream_id",
                    None,
                    &args,
                )?;
                for row in changed {
                    if let Some(v) = row.get::<String>(1)?.zip(row.get::<i64>(2)?) {
                        out.push(v);
                    }
                }
                out.sort();
                Ok(out)
            }))
        })
    })
}
