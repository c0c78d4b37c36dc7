//! `adopt_synapse`: one call turns a stopped Synapse's database into
//! streampos streams, with no data migration.
//!
//! Every stream of Synapse's stream map (`sql/synapse_streams.tsv`, embedded
//! here at build time) is registered with its existing sequence, direction
//! and tables through `adopt_stream` and `add_table`, so with their
//! privilege checks: the caller must own each sequence it adopts and act as
//! the owner of each table it registers. `instance_map` is imported keeping every
//! id (tokens clients hold name writers by those ids), `stream_positions`
//! is imported without lowering anything, and `check_stream(…, repair =>
//! true)` moves lagging sequences forward. The answer says, row by row,
//! what was done and what was skipped and why.
//!
//! Order of steps: every check (schema, Synapse's tables, instance
//! conflicts, ownership, SELECT) before any write; then instances (stored
//! positions name them), streams and tables, positions, each stream's
//! registry state (seeded with the writers that have a stored position, so
//! after the positions), and repairs last: `setval` is not undone by a
//! rollback, so nothing found earlier may fail the call after a sequence
//! moved (a moved sequence is only a gap). Any ERROR rolls the call back: it
//! runs in the caller's transaction.
//!
//! Refusals: 3F000 for a schema that does not exist, 42P01 when it lacks
//! Synapse's `schema_version`, `instance_map` or `stream_positions` (or a
//! column of them), 55000 when streampos's instance ids disagree with
//! Synapse's, 42501 without USAGE on the schema, without the privileges of
//! the owner of those three tables (they are read as their owner), or
//! without SELECT on a table to register.
//!
//! Objects of the layout that another role owns (docs/design.md,
//! "Untrusted objects") are skipped, with the reason in the answer, never
//! registered: a sequence whose owner the caller cannot act as, or whose
//! owner cannot act as the owner of Synapse's `instance_map`; a table whose
//! owner the caller cannot act as, or whose owner cannot act as the owner
//! of the stream's sequence (a repair moves the sequence up to the highest
//! ID in the stream's tables).

use pgrx::callconv::{Arg, ArgAbi};
use pgrx::pgrx_sql_entity_graph::metadata::{
    ArgumentError, ReturnsError, ReturnsRef, SqlMappingRef, SqlTranslatable, TypeOrigin,
};
use pgrx::prelude::*;
use pgrx::PgRelation;
use streampos_core::synapse_map::{self, MapStream, Writers};

use super::{check, streams};
use crate::catalog;
use crate::engine::{self, in_recovery};
use crate::error::{clip, Error, OrRaise};
use crate::{registry, sequence, sql};

/// Synapse's streams, one row per (stream, table): the file a test checks
/// against Synapse's source.
const STREAM_MAP: &str = include_str!("../../sql/synapse_streams.tsv");

/// The Synapse database schema version the map was verified against
/// (matrix-synapse 1.163.2; docs/synapse-streams.md). A newer database may
/// have streams the map does not know.
const MAP_SCHEMA_VERSION: i64 = 94;

/// The kind of value a column holds: internal SQL casts Synapse's columns
/// to int8 or text, and only these types get there without a cast function
/// (which whoever owns a type may write, and which would run as the caller).
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Integer,
    Text,
}

fn kind_of(type_oid: pg_sys::Oid) -> Option<Kind> {
    match type_oid {
        pg_sys::INT2OID | pg_sys::INT4OID | pg_sys::INT8OID => Some(Kind::Integer),
        pg_sys::TEXTOID | pg_sys::VARCHAROID => Some(Kind::Text),
        _ => None,
    }
}

/// Tables (and their columns) that every Synapse database has since full
/// schema 72 and that adoption reads.
const SYNAPSE_TABLES: [(&str, &[(&str, Kind)]); 3] = [
    ("schema_version", &[("version", Kind::Integer)]),
    (
        "instance_map",
        &[
            ("instance_id", Kind::Integer),
            ("instance_name", Kind::Text),
        ],
    ),
    (
        "stream_positions",
        &[
            ("stream_name", Kind::Text),
            ("instance_name", Kind::Text),
            ("stream_id", Kind::Integer),
        ],
    ),
];

const ADOPTED: &str = "adopted";
const UNCHANGED: &str = "unchanged";
const IMPORTED: &str = "imported";
const REPAIRED: &str = "repaired";
const SKIPPED: &str = "skipped";

/// A row of the answer: (stream, action, detail).
type Row = (Option<String>, String, String);

fn row(stream: Option<&str>, action: &str, detail: String) -> Row {
    (stream.map(str::to_string), action.to_string(), detail)
}

/// An argument of SQL type `name`.
pub struct SqlName(String);

impl FromDatum for SqlName {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        _typoid: pg_sys::Oid,
    ) -> Option<Self> {
        if is_null {
            return None;
        }
        // SAFETY: a non-null `name` datum points to a NameData, a
        // NUL-terminated string of at most NAMEDATALEN bytes.
        let name = unsafe {
            let data = datum.cast_mut_ptr::<pg_sys::NameData>();
            std::ffi::CStr::from_ptr((*data).data.as_ptr())
        };
        Some(SqlName(name.to_string_lossy().into_owned()))
    }
}

// SAFETY: the argument is declared `name` in SQL (below), which is what
// `from_polymorphic_datum` reads; NULL is never unboxed (the function is
// STRICT, and `unbox_nullable_arg` checks).
unsafe impl<'fcx> ArgAbi<'fcx> for SqlName {
    unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
        // SAFETY: a `name` argument, not NULL (see above).
        unsafe { arg.unbox_arg_using_from_datum() }
            .unwrap_or_else(|| Error::invalid("schema must not be NULL").report())
    }
}

// SAFETY: maps to the SQL type name, which `from_polymorphic_datum` reads.
unsafe impl SqlTranslatable for SqlName {
    const TYPE_IDENT: &'static str = pgrx::pgrx_resolved_type!(SqlName);
    const TYPE_ORIGIN: TypeOrigin = TypeOrigin::External;
    const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> = Ok(SqlMappingRef::literal("name"));
    const RETURN_SQL: Result<ReturnsRef, ReturnsError> =
        Ok(ReturnsRef::One(SqlMappingRef::literal("name")));
}

/// The role calling, as privilege checks see it.
fn current_role() -> pg_sys::Oid {
    // SAFETY: reads the current user id; raises no error.
    unsafe { pg_sys::GetUserId() }
}

fn is_table(kind: &str) -> bool {
    kind == "r" || kind == "p"
}

/// Synapse's schema and the tables adoption reads in it.
struct Synapse {
    schema: String,
    nsp: pg_sys::Oid,
    /// The owner of `instance_map`: Synapse's role. A sequence of the
    /// layout whose owner cannot act as it is not Synapse's.
    owner: pg_sys::Oid,
    schema_version: pg_sys::Oid,
    instance_map: pg_sys::Oid,
    stream_positions: pg_sys::Oid,
}

impl Synapse {
    /// Find Synapse's tables in `schema`, or refuse: 3F000 for a schema
    /// that does not exist, 42501 without USAGE on it, 42P01 when a table
    /// or column every Synapse database has is missing.
    fn find(schema: &str) -> Synapse {
        let nsp = sql::namespace_oid(schema)
            .unwrap_or_else(|| Error::UnknownSchema(schema.into()).report());
        // Looking its tables up by name would need USAGE: so does this.
        // SAFETY: a catalog lookup for an existing schema; raises no error.
        // PostgreSQL 16 replaced the per-kind privilege checks with one.
        let usage = unsafe {
            let usage = pg_sys::ACL_USAGE as pg_sys::AclMode;
            #[cfg(any(feature = "pg14", feature = "pg15"))]
            let result = pg_sys::pg_namespace_aclcheck(nsp, current_role(), usage);
            #[cfg(not(any(feature = "pg14", feature = "pg15")))]
            let result =
                pg_sys::object_aclcheck(pg_sys::NamespaceRelationId, nsp, current_role(), usage);
            result
        };
        if usage != pg_sys::AclResult::ACLCHECK_OK {
            Error::NoSchemaUsage(schema.into()).report();
        }
        let mut found = Vec::new();
        let mut missing_tables = Vec::new();
        let mut missing_columns = Vec::new();
        let mut wrong_types = Vec::new();
        for (table, columns) in SYNAPSE_TABLES {
            match sql::relation_in(nsp, table) {
                Some((oid, kind)) if is_table(&kind) => {
                    for &(column, kind) in columns.iter() {
                        match sql::column_type(oid, column) {
                            None => missing_columns.push(format!("{table}.{column}")),
                            Some(t) if kind_of(t) != Some(kind) => {
                                wrong_types.push(format!("{table}.{column}"))
                            }
                            Some(_) => {}
                        }
                    }
                    found.push(oid);
                }
                _ => missing_tables.push(table),
            }
        }
        let missing = if !missing_tables.is_empty() {
            Some(format!("It has no table {}.", missing_tables.join(", ")))
        } else if !missing_columns.is_empty() {
            Some(format!("It has no column {}.", missing_columns.join(", ")))
        } else if !wrong_types.is_empty() {
            Some(format!(
                "Column {} is not of the type Synapse gives it.",
                wrong_types.join(", ")
            ))
        } else {
            None
        };
        if let Some(missing) = missing {
            Error::NotSynapse {
                schema: schema.into(),
                missing,
            }
            .report();
        }
        // They are read as their owner (sql::read_as_owner): an owner the
        // caller cannot act as is refused before anything of theirs is
        // read or planned (a look-alike planted by another role).
        for &oid in &found {
            if let Some(owner) = sql::relation_owner(oid) {
                if !sql::caller_acts_as(owner) {
                    Error::NotTableOwner {
                        table: sql::relation_name(oid),
                        owner: sql::role_display_name(owner),
                        action: "adopt_synapse",
                    }
                    .report();
                }
            }
        }
        Synapse {
            schema: schema.to_string(),
            nsp,
            owner: sql::relation_owner(found[1]).unwrap_or(pg_sys::InvalidOid),
            schema_version: found[0],
            instance_map: found[1],
            stream_positions: found[2],
        }
    }

    fn name_of(&self, relation: &str) -> String {
        sql::qualified_name(&self.schema, relation)
    }
}

// ------------------------------------------------------------------ instances

/// Instance ids: 1 to i32::MAX (streampos.instances' check); names: 1 to
/// 63 bytes.
fn unusable_instance(id: i64, name: &str) -> Option<String> {
    if id < 1 || id > i64::from(i32::MAX) {
        return Some(format!(
            "Instance {} has id {id}, outside the ids streampos keeps (1 to {}); tokens naming it cannot be decoded.",
            clip(name),
            i32::MAX
        ));
    }
    catalog::validate_instance_name(name).err().map(|_| {
        format!(
            "Instance {} (id {id}) has a name of {} bytes; streampos keeps names of 1 to 63 bytes.",
            clip(name),
            name.len()
        )
    })
}

/// Synapse's instances streampos does not know yet (those it cannot keep
/// are reported in `rows`), and the id a later name must be above.
/// Refuses (55000) if streampos gives a name another id, or an id another
/// name.
fn plan_instances(synapse: &Synapse, rows: &mut Vec<Row>) -> (Vec<(i32, String)>, i64) {
    let known = sql::instance_names();
    let by_name: std::collections::HashMap<&str, i32> = known
        .iter()
        .map(|(id, name)| (name.as_str(), *id))
        .collect();
    let mapped = sql::synapse_instances(synapse.instance_map);
    // Synapse's upserts burn ids of its sequence: none of them may be given
    // to a new name either.
    let mut floor = sql::column_sequence(synapse.instance_map, "instance_id")
        .map(sequence::max_allocated)
        .unwrap_or(0);
    let mut new = Vec::new();
    for (id, name) in mapped {
        floor = floor.max(id);
        if let Some(reason) = unusable_instance(id, &name) {
            rows.push(row(None, SKIPPED, reason));
            continue;
        }
        let id32 = id as i32;
        match (by_name.get(name.as_str()), known.get(&id32)) {
            (Some(&mine), _) if mine == id32 => {}
            (Some(&mine), _) => Error::InstanceConflict(format!(
                "instance \"{}\" has id {mine} in streampos but {id} in Synapse's instance_map",
                clip(&name)
            ))
            .report(),
            (None, Some(other)) => Error::InstanceConflict(format!(
                "instance id {id} is \"{}\" in streampos but \"{}\" in Synapse's instance_map",
                clip(other),
                clip(&name)
            ))
            .report(),
            (None, None) => new.push((id32, name)),
        }
    }
    // streampos's ids are int4: past the last one, new names get none.
    (new, floor.min(i64::from(i32::MAX)))
}

// -------------------------------------------------------------------- streams

/// A table to register.
struct TablePlan {
    oid: pg_sys::Oid,
    id_column: String,
    instance_column: Option<String>,
}

/// What adoption does with one stream of the map.
struct StreamPlan<'m> {
    spec: &'m MapStream,
    seq: pg_sys::Oid,
    /// Not registered yet: `adopt_stream` registers it.
    new: bool,
    add: Vec<TablePlan>,
    /// Tables (or columns) of the map left out, and why.
    left_out: Vec<String>,
}

/// Plan one stream, checking what the per-stream functions check
/// (ownership, SELECT) now, before anything is written. Err: the reason it
/// is skipped.
fn plan_stream<'m>(synapse: &Synapse, spec: &'m MapStream) -> Result<StreamPlan<'m>, String> {
    let seq = match sql::relation_in(synapse.nsp, &spec.sequence) {
        Some((oid, kind)) if kind == "S" => oid,
        Some((oid, _)) => return Err(format!("{} is not a sequence.", sql::relation_name(oid))),
        None => {
            return Err(format!(
                "Sequence {} does not exist (a Synapse older than the stream's schema version).",
                synapse.name_of(&spec.sequence)
            ))
        }
    };
    let seq_name = sql::relation_name(seq);
    let registered = sql::stream_row(&spec.name);
    if let Some(row) = &registered {
        if row.seq != seq || row.backwards != spec.backwards {
            return Err(format!(
                "Stream {} is registered already, with sequence {}{}; left as it is.",
                spec.name,
                sql::relation_name(row.seq),
                if row.backwards { " (backwards)" } else { "" }
            ));
        }
    } else {
        match sequence::settings(seq) {
            Some(s) if s.increment != 1 || s.cache != 1 => {
                return Err(format!(
                    "Sequence {seq_name} has INCREMENT {} and CACHE {}; streampos needs both to be 1 \
                     (with a cache, backends hand out IDs out of order). ALTER SEQUENCE {seq_name} CACHE 1 INCREMENT 1, then call again.",
                    s.increment, s.cache
                ))
            }
            Some(s) if s.min < 1 || s.cycle => {
                return Err(format!(
                    "Sequence {seq_name} has MINVALUE {}{}; streampos needs MINVALUE 1 or more and NO CYCLE \
                     (stream IDs are positive and never handed out twice). ALTER SEQUENCE {seq_name} MINVALUE 1 NO CYCLE, then call again.",
                    s.min,
                    if s.cycle { " and CYCLE" } else { "" }
                ))
            }
            Some(_) => {}
            None => return Err(format!("{seq_name} is not a sequence.")),
        }
        match sql::relation_persistence(seq).as_deref() {
            Some("p") => {}
            Some("u") => {
                return Err(format!(
                    "Sequence {seq_name} is UNLOGGED: crash recovery resets it and it would hand out its IDs again."
                ))
            }
            _ => return Err(format!("Sequence {seq_name} is not permanent.")),
        }
        if let Some(other) = sql::stream_of_sequence(seq) {
            return Err(format!(
                "Sequence {seq_name} belongs to stream {} already.",
                clip(&other)
            ));
        }
        // adopt_stream's check (the caller owns the sequence, or acts as
        // its owner), made before anything is written; and a sequence of
        // the layout that another role planted (one an older Synapse
        // lacks) is not Synapse's: its owner must be able to act as the
        // owner of Synapse's instance_map. Either way the stream is
        // skipped, never the whole call refused: a planted object must not
        // stop the adoption of the others.
        let owner = sql::relation_owner(seq).unwrap_or(pg_sys::InvalidOid);
        if !sql::caller_acts_as(owner) {
            return Err(format!(
                "Sequence {seq_name} is owned by {}, a role you cannot act as: not adopted (adopting lets streampos move it).",
                sql::role_display_name(owner)
            ));
        }
        if !sql::role_acts_as(owner, synapse.owner) {
            return Err(format!(
                "Sequence {seq_name} is owned by {}, which cannot act as {}, the owner of Synapse's instance_map: not adopted.",
                sql::role_display_name(owner),
                sql::role_display_name(synapse.owner)
            ));
        }
    }

    let already = sql::registered_tables(&spec.name);
    let mut add = Vec::new();
    let mut left_out = Vec::new();
    for table in &spec.tables {
        let oid = match sql::relation_in(synapse.nsp, &table.name) {
            Some((oid, kind)) if is_table(&kind) => oid,
            _ => {
                left_out.push(format!(
                    "Table {} does not exist: not registered.",
                    synapse.name_of(&table.name)
                ));
                continue;
            }
        };
        let name = sql::relation_name(oid);
        match sql::column_type(oid, &table.id_column) {
            None => {
                left_out.push(format!(
                    "Table {name} has no column {}: not registered.",
                    table.id_column
                ));
                continue;
            }
            Some(t) if kind_of(t) != Some(Kind::Integer) => {
                left_out.push(format!(
                    "Column {} of table {name} is not an integer: not registered.",
                    table.id_column
                ));
                continue;
            }
            Some(_) => {}
        }
        let instance_column = match sql::column_type(oid, &table.instance_column) {
            Some(t) if kind_of(t) == Some(Kind::Text) => Some(table.instance_column.clone()),
            Some(_) => {
                left_out.push(format!(
                    "Column {} of table {name} is not text: registered without an instance column.",
                    table.instance_column
                ));
                None
            }
            None => {
                left_out.push(format!(
                    "Table {name} has no column {}: registered without an instance column.",
                    table.instance_column
                ));
                None
            }
        };
        if let Some((_, id, instance)) = already.iter().find(|(t, _, _)| *t == oid) {
            if *id != table.id_column || *instance != instance_column {
                left_out.push(format!(
                    "Table {name} is registered already with ID column {id} and instance column {}; left as it is.",
                    instance.as_deref().unwrap_or("NULL")
                ));
            }
            continue;
        }
        // A table of the layout that another role owns (one an older
        // Synapse lacks, planted): never registered. streampos reads a
        // stream's tables as their owner, so the caller must be able to act
        // as it; and a repair moves the sequence up to the highest ID a
        // table holds, so its owner must be able to move the sequence
        // itself (act as the sequence's owner).
        let Some(owner) = sql::relation_owner(oid) else {
            continue;
        };
        if !sql::caller_acts_as(owner) {
            left_out.push(format!(
                "Table {name} is owned by {}, a role you cannot act as: not registered (streampos reads a stream's tables as their owner).",
                sql::role_display_name(owner)
            ));
            continue;
        }
        if let Some(seq_owner) = sql::relation_owner(seq) {
            if !sql::role_acts_as(owner, seq_owner) {
                left_out.push(format!(
                    "Table {name} is owned by {}, which cannot act as {}, the owner of sequence {seq_name}: not registered (a row of it would move the sequence further than its owner may).",
                    sql::role_display_name(owner),
                    sql::role_display_name(seq_owner)
                ));
                continue;
            }
        }
        // add_table's check, made before anything is written.
        // SAFETY: a catalog lookup; raises no error for an existing relation.
        let may_read = unsafe {
            pg_sys::pg_class_aclcheck(oid, current_role(), pg_sys::ACL_SELECT as pg_sys::AclMode)
        } == pg_sys::AclResult::ACLCHECK_OK;
        if !may_read {
            Error::NoSelect(name).report();
        }
        add.push(TablePlan {
            oid,
            id_column: table.id_column.clone(),
            instance_column,
        });
    }
    Ok(StreamPlan {
        spec,
        seq,
        new: registered.is_none(),
        add,
        left_out,
    })
}

/// Who may write, as the answer says it: the database does not hold
/// Synapse's writer lists (they are in homeserver.yaml), so every stream is
/// left open.
fn writers_note(writers: &Writers) -> String {
    match writers {
        Writers::Configured(key) => format!(
            "any instance may write (Synapse's writers: stream_writers.{key} in homeserver.yaml)"
        ),
        Writers::Fixed(list) if list.is_empty() => "any instance may write, as in Synapse".into(),
        Writers::Fixed(list) => format!(
            "any instance may write (Synapse's writers: {})",
            list.join(", ")
        ),
    }
}

/// Register (or complete) one planned stream; the rows that say so.
fn register(plan: &StreamPlan, rows: &mut Vec<Row>) {
    let spec = plan.spec;
    let stream = Some(spec.name.as_str());
    if plan.new {
        // SAFETY: opened with a lock (AccessShareLock, held to the end of
        // the transaction); one dropped meanwhile is an ERROR.
        let seq =
            unsafe { PgRelation::with_lock(plan.seq, pg_sys::AccessShareLock as pg_sys::LOCKMODE) };
        streams::adopt_stream(&spec.name, seq, spec.backwards, None);
    }
    for table in &plan.add {
        // SAFETY: as above.
        let tbl = unsafe {
            PgRelation::with_lock(table.oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE)
        };
        streams::add_table(
            &spec.name,
            tbl,
            &table.id_column,
            table.instance_column.as_deref(),
        );
    }
    let tables = plan
        .add
        .iter()
        .map(|t| sql::relation_name(t.oid))
        .collect::<Vec<_>>()
        .join(", ");
    if plan.new {
        rows.push(row(
            stream,
            ADOPTED,
            format!(
                "Sequence {}{}, tables {}; {}.",
                sql::relation_name(plan.seq),
                if spec.backwards { " (backwards)" } else { "" },
                if tables.is_empty() { "none" } else { &tables },
                writers_note(&spec.writers)
            ),
        ));
    } else if !plan.add.is_empty() {
        rows.push(row(
            stream,
            ADOPTED,
            format!("Registered already; tables added: {tables}."),
        ));
    } else {
        rows.push(row(
            stream,
            UNCHANGED,
            "Registered already, as the map says.".into(),
        ));
    }
    for reason in &plan.left_out {
        rows.push(row(stream, SKIPPED, reason.clone()));
    }
}

/// Import Synapse's stored positions of one stream: as they are (signed:
/// backward streams store negative positions, as streampos does), never
/// lowering one streampos stored, and only of instances the stream lets
/// write.
fn import_positions(synapse: &Synapse, plan: &StreamPlan, rows: &mut Vec<Row>) {
    let spec = plan.spec;
    let stream = Some(spec.name.as_str());
    let writers = sql::stream_row(&spec.name).and_then(|r| r.writers);
    let mut positions = Vec::new();
    for (instance, position) in sql::synapse_positions(synapse.stream_positions, &spec.name) {
        if (spec.backwards && position > 0) || (!spec.backwards && position < 0) {
            rows.push(row(
                stream,
                SKIPPED,
                format!(
                    "Synapse's stored position of {} ({position}) has the wrong sign for a {} stream: not imported.",
                    clip(&instance),
                    if spec.backwards { "backward" } else { "forward" }
                ),
            ));
        } else if writers.as_ref().is_some_and(|w| !w.contains(&instance)) {
            // The stream's writer list (set since an earlier adoption) says
            // this instance does not write it: set_writers deleted its
            // position, and it stays deleted.
        } else {
            positions.push((instance, position));
        }
    }
    if positions.is_empty() {
        return;
    }
    let changed = sql::import_positions(&spec.name, &positions);
    if !changed.is_empty() {
        let list = changed
            .iter()
            .map(|(instance, position)| format!("{} {position}", clip(instance)))
            .collect::<Vec<_>>()
            .join(", ");
        rows.push(row(
            stream,
            IMPORTED,
            format!("Stored positions from Synapse's stream_positions: {list}."),
        ));
    }
}

/// `check_stream(…, repair => true)`; a row if the sequence moved.
fn repair(plan: &StreamPlan, rows: &mut Vec<Row>) {
    let stream = plan.spec.name.as_str();
    for (check_name, _ok, detail) in check::check_stream(stream, true) {
        if check_name == "repair" {
            rows.push(row(
                Some(stream),
                REPAIRED,
                format!("{}.", capitalise(&detail)),
            ));
        }
    }
}

fn capitalise(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}

#[pg_extern(volatile, parallel_unsafe)]
fn adopt_synapse(
    schema: default!(SqlName, "'public'"),
) -> TableIterator<
    'static,
    (
        name!(stream, Option<String>),
        name!(action, String),
        name!(detail, String),
    ),
> {
    if in_recovery() {
        Error::Recovery("adopt a Synapse database").report();
    }
    let map = synapse_map::parse(STREAM_MAP)
        .unwrap_or_else(|e| Error::Internal(format!("the stream map is broken: {e}")).report());
    let synapse = Synapse::find(&schema.0);
    // After the lock every read takes a new snapshot (the transaction has
    // an xid now, and SPI reads of such a transaction do), so a concurrent
    // adoption the lock waited for is seen, under READ COMMITTED.
    sql::lock_catalog_for_adoption();
    catalog::mark_changed();

    let mut rows = Vec::new();
    if let Some(version) = sql::synapse_schema_version(synapse.schema_version) {
        if version > MAP_SCHEMA_VERSION {
            rows.push(row(
                None,
                SKIPPED,
                format!(
                    "Synapse's schema is version {version}, newer than the stream map's ({MAP_SCHEMA_VERSION}): streams Synapse added since are not adopted."
                ),
            ));
        }
    }

    // Every check first.
    let (instances, floor) = plan_instances(&synapse, &mut rows);
    let plans: Vec<Result<StreamPlan, String>> =
        map.iter().map(|spec| plan_stream(&synapse, spec)).collect();

    // Then the writes. Rows about each stream are collected by stream and
    // answered in map order.
    sql::import_instances(&instances, floor);
    for (id, name) in &instances {
        rows.push(row(
            None,
            IMPORTED,
            format!(
                "Instance {} has id {id}, as in Synapse's instance_map.",
                clip(name)
            ),
        ));
    }
    let mut stream_rows: Vec<Vec<Row>> = map.iter().map(|_| Vec::new()).collect();
    for ((spec, plan), out) in map.iter().zip(&plans).zip(stream_rows.iter_mut()) {
        match plan {
            Ok(plan) => register(plan, out),
            Err(reason) => out.push(row(Some(&spec.name), SKIPPED, reason.clone())),
        }
    }
    // The planned streams, with their place in the map.
    let adopted = || {
        plans
            .iter()
            .enumerate()
            .filter_map(|(i, plan)| Some((plan.as_ref().ok()?, i)))
    };
    for (plan, i) in adopted() {
        import_positions(&synapse, plan, &mut stream_rows[i]);
    }
    // Each stream's registry state, loaded now that its positions are
    // stored (they seed its writers), and before any repair: a full
    // registry fails the call before a sequence has moved.
    if registry::is_loaded() {
        for (plan, _) in adopted() {
            engine::registry_index(&catalog::stream_latest(&plan.spec.name).or_raise());
        }
    }
    for (plan, i) in adopted() {
        repair(plan, &mut stream_rows[i]);
    }
    rows.extend(stream_rows.into_iter().flatten());
    TableIterator::new(rows)
}
