//! Streams and writers: the catalog-changing functions.

use pgrx::pgrx_sql_entity_graph::metadata::{
    ArgumentError, ReturnsError, ReturnsRef, SqlMappingRef, SqlTranslatable, TypeOrigin,
};
use pgrx::prelude::*;
use pgrx::{IntoDatum, PgRelation};

use crate::catalog;
use crate::engine;
use crate::error::{Error, OrRaise};
use crate::{sequence, sql};

/// A `regclass` return value.
pub struct RegClass(pub pg_sys::Oid);

impl IntoDatum for RegClass {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        self.0.into_datum()
    }
    fn type_oid() -> pg_sys::Oid {
        pg_sys::REGCLASSOID
    }
}

// SAFETY: a regclass datum is an OID, passed by value like `oid`.
unsafe impl pgrx::callconv::BoxRet for RegClass {
    unsafe fn box_into<'fcx>(
        self,
        fcinfo: &mut pgrx::callconv::FcInfo<'fcx>,
    ) -> pgrx::datum::Datum<'fcx> {
        // SAFETY: an OID is a valid by-value datum.
        unsafe { fcinfo.return_raw_datum(pg_sys::Datum::from(self.0)) }
    }
}

// SAFETY: maps to the SQL type regclass, which the datum above is.
unsafe impl SqlTranslatable for RegClass {
    const TYPE_IDENT: &'static str = pgrx::pgrx_resolved_type!(RegClass);
    const TYPE_ORIGIN: TypeOrigin = TypeOrigin::External;
    const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> =
        Ok(SqlMappingRef::literal("regclass"));
    const RETURN_SQL: Result<ReturnsRef, ReturnsError> =
        Ok(ReturnsRef::One(SqlMappingRef::literal("regclass")));
}

/// Most writers a stream may list.
const MAX_WRITERS: usize = 1024;

/// The writer names of a `writers` argument, each an instance (created when
/// new). The length is checked before anything is copied out of the array.
fn ensure_writer_instances(writers: &Option<Array<'_, &str>>) -> Option<Vec<String>> {
    let writers = writers.as_ref()?;
    if writers.len() > MAX_WRITERS {
        Error::TooLarge {
            what: format!("a list of {} writers", writers.len()),
            limit: format!(
                "A stream lists at most {MAX_WRITERS} writers; NULL lets any instance write."
            ),
        }
        .report();
    }
    let mut names: Vec<String> = Vec::with_capacity(writers.len());
    for w in writers.iter() {
        let Some(w) = w else {
            Error::invalid("writers must not contain NULL").report();
        };
        catalog::instance_id(w).or_raise();
        if !names.iter().any(|n| n == w) {
            names.push(w.to_string());
        }
    }
    Some(names)
}

fn check_new_stream(stream: &str) {
    catalog::validate_stream_name(stream).or_raise();
    if catalog::stream_latest(stream).is_ok() {
        Error::StreamExists(stream.into()).report();
    }
}

/// The role calling, as privilege checks see it.
fn current_role() -> pg_sys::Oid {
    // SAFETY: reads the current user id; raises no error.
    unsafe { pg_sys::GetUserId() }
}

#[pg_extern(volatile, parallel_unsafe)]
fn create_stream(
    stream: &str,
    backwards: default!(bool, false),
    writers: default!(Option<Array<'_, &str>>, "NULL"),
) -> RegClass {
    check_new_stream(stream);
    let writers = ensure_writer_instances(&writers);
    // Owned by the role creating the stream: it may allocate, grant USAGE to
    // other writers, and repair it.
    let seq = sql::create_sequence(&format!("{stream}_seq"), current_role());
    sql::insert_stream(stream, seq, true, backwards, writers);
    catalog::mark_changed();
    RegClass(seq)
}

#[pg_extern(volatile, parallel_unsafe)]
pub(super) fn adopt_stream(
    stream: &str,
    seq: PgRelation,
    backwards: default!(bool, false),
    writers: default!(Option<Array<'_, &str>>, "NULL"),
) {
    check_new_stream(stream);
    let oid = seq.oid();
    let name = sql::relation_name(oid);
    match sequence::settings(oid) {
        None => Error::NotASequence(name).report(),
        Some(settings) => {
            if let Some((message, detail)) = settings.problem(&name) {
                Error::InvalidArgument {
                    message,
                    detail: Some(detail),
                }
                .report()
            }
        }
    }
    // Registering a sequence lets the extension repair it: only its owner may.
    if !sequence::is_owner(oid, current_role()) {
        Error::NotOwner(format!("sequence {name}")).report();
    }
    sequence::check_usable(oid);
    if let Some(other) = sql::stream_of_sequence(oid) {
        Error::InvalidArgument {
            message: format!(
                "sequence {name} already belongs to stream \"{}\"",
                crate::error::clip(&other)
            ),
            detail: Some("Each stream has a sequence of its own.".into()),
        }
        .report();
    }
    let writers = ensure_writer_instances(&writers);
    sql::insert_stream(stream, oid, false, backwards, writers);
    catalog::mark_changed();
}

#[pg_extern(volatile, parallel_unsafe)]
pub(super) fn add_table(
    stream: &str,
    tbl: PgRelation,
    id_column: &str,
    instance_column: default!(Option<&str>, "NULL"),
) {
    catalog::stream_latest(stream).or_raise();
    let oid = tbl.oid();
    let name = sql::relation_name(oid);
    // SAFETY: the relation is open (pgrx opened the regclass argument with
    // a lock); its form is valid while it is.
    let (kind, owner) = unsafe { ((*tbl.rd_rel).relkind as u8, (*tbl.rd_rel).relowner) };
    // streampos reads rows only of tables (a view's rules, a foreign
    // table's wrapper are code).
    if !sql::is_table_kind(kind) {
        Error::NotATable {
            relation: name,
            kind: sql::relkind_name(kind).into(),
        }
        .report();
    }
    // updates() and check_stream() read the table as its owner (its
    // policies, index expressions and constraints run as that role):
    // registering it is for a role that may act as its owner.
    if !sql::caller_acts_as(owner) {
        Error::NotTableOwner {
            table: name,
            owner: sql::role_display_name(owner),
            action: "streampos",
        }
        .report();
    }
    // SAFETY: a catalog lookup; raises no error for an existing relation.
    let may_read = unsafe {
        pg_sys::pg_class_aclcheck(oid, current_role(), pg_sys::ACL_SELECT as pg_sys::AclMode)
    } == pg_sys::AclResult::ACLCHECK_OK;
    if !may_read {
        Error::NoSelect(name).report();
    }
    for column in std::iter::once(id_column).chain(instance_column) {
        match sql::column_type(oid, column) {
            None => Error::UnknownColumn {
                column: column.into(),
                table: name.clone(),
            }
            .report(),
            // Compared and cast by internal SQL: only types whose casts
            // and operators nobody but the bootstrap superuser wrote.
            Some(t) if !sql::built_in_type(t) => Error::ColumnType {
                column: column.into(),
                table: name.clone(),
                type_name: sql::type_name(t),
            }
            .report(),
            Some(t) if column == id_column && !sql::integer_type(t) => Error::IdColumnType {
                column: column.into(),
                table: name.clone(),
                type_name: sql::type_name(t),
            }
            .report(),
            Some(_) => {}
        }
    }
    sql::upsert_stream_table(stream, oid, id_column, instance_column);
    catalog::mark_changed();
    engine::table_added(&catalog::stream_latest(stream).or_raise());
}

#[pg_extern(volatile, parallel_unsafe)]
fn set_writers(stream: &str, writers: Option<Array<'_, &str>>) {
    let meta = catalog::stream_latest(stream).or_raise();
    let writers = ensure_writer_instances(&writers);
    sql::set_stream_writers(stream, writers.clone());
    if let (None, Some(listed)) = (&writers, &meta.writers) {
        // Opened to any writer: its tokens go on listing the writers they
        // listed (an open stream's tokens list the writers it remembers),
        // or those writers' positions would go back.
        if crate::registry::is_loaded() {
            let ids: Vec<i32> = listed
                .iter()
                .filter_map(|n| catalog::lookup_instance_id(n))
                .collect();
            engine::with_index(&meta, |index| {
                crate::registry::remember_writers(index, meta.key, meta.seq, &ids)
            });
        }
    }
    if let Some(writers) = writers {
        // A removed writer loses its stored position; a new one starts at the
        // frontier (never ahead of the truth).
        let front = meta.external(engine::answer(&meta).frontier());
        sql::reset_positions(stream, writers, front);
    }
    catalog::mark_changed();
}

#[pg_extern(volatile, parallel_unsafe)]
fn drop_stream(stream: &str) {
    let mut meta = catalog::stream_latest(stream).or_raise();
    // A consumer's open transaction (an ack, a registration) holds its row:
    // waited for before the sequence is held, so that writers never queue
    // behind it, and bounded like every wait here (55P03).
    sql::with_lock_wait_bound(|| sql::delete_consumers(stream));
    // Wait for every transaction allocating from the stream's sequence to
    // end; allocations after ours see the stream gone (sequence.rs). A
    // sequence the stream owns is about to be dropped: ACCESS EXCLUSIVE
    // now, rather than EXCLUSIVE and then a second wait (with writers
    // queued behind it) for the drop. Every wait is bounded (55P03).
    let mode = if meta.owns_sequence {
        pg_sys::AccessExclusiveLock
    } else {
        pg_sys::ExclusiveLock
    };
    sequence::lock_against_allocation(meta.seq, mode as pg_sys::LOCKMODE, stream, "drop_stream");
    meta = catalog::stream_latest(stream).or_raise();
    catalog::mark_changed();
    // Bounded: a registration still open holds the stream's row (its
    // foreign key's KEY SHARE lock).
    sql::with_lock_wait_bound(|| sql::delete_stream(stream));
    if meta.owns_sequence {
        sql::with_lock_wait_bound(|| sql::drop_owned_sequence(meta.seq, stream));
    }
    catalog::drop_at_commit(meta.key);
}

#[pg_extern(volatile, strict, parallel_unsafe)]
fn instance_id(instance_name: &str) -> i32 {
    catalog::instance_id(instance_name).or_raise()
}

#[pg_extern(stable, strict, parallel_restricted)]
fn instance_name(instance_id: i32) -> String {
    catalog::instance_name(instance_id)
        .unwrap_or_else(|| Error::UnknownInstanceId(instance_id).report())
}

/// A logical replication subscriber's streams are its own (its sequences,
/// instance ids and positions are not the publisher's): rows of the
/// catalog tables that a subscription brings (a `FOR ALL TABLES`
/// publication includes them) are not applied, so its sync never fails or
/// loops on them. ENABLE ALWAYS: it must fire in the apply worker, which
/// runs with session_replication_role = replica.
#[pg_trigger]
fn catalog_rows_stay_local<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, Error> {
    // Rows the worker applies, not the extension's own writes (a trigger of
    // the subscriber's that the apply worker fires may allocate).
    // SAFETY: reads whether this process is a logical replication worker.
    if unsafe { pg_sys::IsLogicalWorker() } && !sql::extension_writing() {
        return Ok(None);
    }
    Ok(trigger.new().or_else(|| trigger.old()))
}

/// Instance ids appear in tokens that clients hold: a row of
/// `streampos.instances` is never changed or deleted.
#[pg_trigger]
fn instances_immutable<'a>(
    _trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, Error> {
    Error::InstancesImmutable.report()
}
