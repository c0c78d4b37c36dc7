//! A stream's registered tables: their definitions as they are now, the
//! ones that cannot be read, their highest IDs.

use super::*;

/// A table of a stream, with its columns as they are now.
pub struct StreamTable {
    pub oid: pg_sys::Oid,
    /// Quoted, schema-qualified.
    pub name: String,
    pub id_column: String,
    pub instance_column: Option<String>,
    /// Every live column, in order, unquoted.
    pub columns: Vec<String>,
    /// The columns' types, in the same order.
    pub types: Vec<pg_sys::Oid>,
}

/// A registered table that `updates` skips: its OID, what is wrong, and
/// what fixes it.
pub struct Unusable {
    pub oid: pg_sys::Oid,
    pub problem: String,
    /// It was dropped: a repair forgets it.
    pub dropped: bool,
    pub advice: &'static str,
}

fn unusable(oid: pg_sys::Oid, problem: String, advice: &'static str) -> Unusable {
    Unusable {
        oid,
        problem,
        dropped: false,
        advice,
    }
}

/// Every registered table of a stream as it is now: usable, or what is
/// wrong with it. The registrations are read with the caller's snapshot
/// (the catalog cache's rules cover them); each table's definition (kind,
/// columns, types) from the relcache, the latest catalog, which is what
/// relcache invalidations track (a snapshot's older view of a column
/// renamed back and forth must not be cached as current).
fn registered_stream_tables(stream: &str) -> Vec<Result<StreamTable, Unusable>> {
    let registered = select_all(
        "SELECT t.tbl::pg_catalog.oid, t.id_column::pg_catalog.text, t.instance_column::pg_catalog.text \
         FROM streampos.stream_tables t \
         WHERE t.stream_name OPERATOR(pg_catalog.=) $1 \
         ORDER BY 1",
        &[stream.into()],
        |r| {
            Ok(Some((
                r.get::<pg_sys::Oid>(1)?.unwrap_or(pg_sys::InvalidOid),
                r.get::<String>(2)?.unwrap_or_default(),
                r.get::<String>(3)?,
            )))
        },
    );
    registered
        .into_iter()
        .map(|(oid, id_column, instance_column)| {
            let Some((kind, columns, types)) = relation_definition(oid) else {
                return Err(Unusable {
                    oid,
                    problem: "was dropped".into(),
                    dropped: true,
                    advice: "repair => true forgets it",
                });
            };
            let name = relation_name(oid);
            if !is_table_kind(kind) {
                return Err(unusable(
                    oid,
                    format!("{name} is {} now, not a table", relkind_name(kind)),
                    "streampos reads only tables",
                ));
            }
            for column in std::iter::once(&id_column).chain(&instance_column) {
                match columns.iter().position(|c| c == column) {
                    None => {
                        return Err(unusable(
                            oid,
                            format!("{name} has no column {column}"),
                            "add_table() again with the new column names",
                        ))
                    }
                    // updates() compares and casts these columns: only
                    // built-in types, whose casts and operators nobody but
                    // the bootstrap superuser wrote.
                    Some(i) if !built_in_type(types[i]) => {
                        return Err(unusable(
                            oid,
                            format!(
                                "column {column} of {name} is of type {}, not a built-in type",
                                type_name(types[i])
                            ),
                            "streampos compares and casts ID and instance columns only of built-in types",
                        ))
                    }
                    // One table whose ID column no longer compares with
                    // bigint (altered to text) must not stop the stream.
                    Some(i) if *column == id_column && !integer_type(types[i]) => {
                        return Err(unusable(
                            oid,
                            format!(
                                "column {column} of {name} is of type {}, not an integer type",
                                type_name(types[i])
                            ),
                            crate::error::ID_COLUMN_TYPES,
                        ))
                    }
                    Some(_) => {}
                }
            }
            Ok(StreamTable {
                oid,
                name,
                id_column,
                instance_column,
                columns,
                types,
            })
        })
        .collect()
}

/// A relation's kind and live columns (names, types) from the relcache,
/// or None when it does not exist.
fn relation_definition(oid: pg_sys::Oid) -> Option<(u8, Vec<String>, Vec<pg_sys::Oid>)> {
    // SAFETY: RelationIdGetRelation returns NULL for a relation that does
    // not exist (no lock: the definition is read here and copied; the
    // reads that follow lock the table and check it again); the entry is
    // closed before returning.
    unsafe {
        let rel = pg_sys::RelationIdGetRelation(oid);
        if rel.is_null() {
            return None;
        }
        let kind = (*(*rel).rd_rel).relkind as u8;
        let mut columns = Vec::new();
        let mut types = Vec::new();
        // pgrx reads the attributes as each PostgreSQL version lays them out.
        for att in pgrx::PgTupleDesc::from_pg_unchecked((*rel).rd_att).iter() {
            if att.attisdropped {
                continue;
            }
            columns.push(
                CStr::from_ptr(att.attname.data.as_ptr())
                    .to_string_lossy()
                    .into_owned(),
            );
            types.push(att.atttypid);
        }
        pg_sys::RelationClose(rel);
        Some((kind, columns, types))
    }
}

/// The stream's usable tables, by table name.
pub fn stream_tables(stream: &str) -> Vec<StreamTable> {
    let mut tables: Vec<StreamTable> = registered_stream_tables(stream)
        .into_iter()
        .filter_map(Result::ok)
        .collect();
    tables.sort_by(|a, b| a.name.cmp(&b.name));
    tables
}

/// Registered tables of a stream that `stream_tables` skips: dropped,
/// without a registered column, not a table any more, or with an ID or
/// instance column of a type that is not built in.
pub fn unusable_stream_tables(stream: &str) -> Vec<Unusable> {
    registered_stream_tables(stream)
        .into_iter()
        .filter_map(Result::err)
        .collect()
}

/// `check_stream(…, repair => true)`: forget a registered table that was
/// dropped (only one whose OID no longer names a relation).
pub fn forget_dropped_stream_table(stream: &str, tbl: pg_sys::Oid) {
    as_owner(|| {
        run(
            "DELETE FROM streampos.stream_tables t \
             WHERE t.stream_name OPERATOR(pg_catalog.=) $1 \
               AND t.tbl::pg_catalog.oid OPERATOR(pg_catalog.=) $2 \
               AND NOT EXISTS (SELECT FROM pg_catalog.pg_class c \
                               WHERE c.oid OPERATOR(pg_catalog.=) $2)",
            &[stream.into(), tbl.into()],
        )
    });
}

/// The highest ID (internal numbering) in one table of a stream, with the
/// caller's snapshot, read as the table's owner (`read_as_owner`).
pub fn table_max_id(table: &StreamTable, backwards: bool) -> Option<i64> {
    let id = quote_ident(&table.id_column);
    let agg = if backwards {
        format!("OPERATOR(pg_catalog.-) pg_catalog.min(t.{id})::pg_catalog.int8")
    } else {
        format!("pg_catalog.max(t.{id})::pg_catalog.int8")
    };
    read_as_owner(table.oid, &[&table.id_column], |name| {
        select_one(&format!("SELECT {agg} FROM {name} t"), &[])
    })
    .flatten()
}

/// The highest ID at most `ceiling` in one table of a forward stream, with
/// the caller's snapshot, read as the table's owner (`read_as_owner`).
pub fn table_max_id_at_most(table: &StreamTable, ceiling: i64, backwards: bool) -> Option<i64> {
    let id = quote_ident(&table.id_column);
    // Internal numbering counts up for backward streams too: their rows
    // carry -1, -2, ...
    let query = |name: &str| {
        if backwards {
            format!(
                "SELECT (OPERATOR(pg_catalog.-) pg_catalog.min(t.{id}))::pg_catalog.int8 FROM {name} t \
                 WHERE t.{id} OPERATOR(pg_catalog.>=) OPERATOR(pg_catalog.-) $1"
            )
        } else {
            format!(
                "SELECT pg_catalog.max(t.{id})::pg_catalog.int8 FROM {name} t \
                 WHERE t.{id} OPERATOR(pg_catalog.<=) $1"
            )
        }
    };
    read_as_owner_for_extension(table.oid, |name| {
        select_one(&query(name), &[ceiling.into()])
    })
    .flatten()
}
