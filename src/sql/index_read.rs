//! `updates`' rows read through the table's ID index, without SQL: no
//! statement to plan or start, no role switch, no subtransaction, and each
//! row's values put straight into the answer.
//!
//! Only where no code but PostgreSQL's own can run in the read, so that
//! reading as the caller is what `read_as_owner` (the one door for other
//! roles' relations) would give: a plain heap table (no inheritance
//! children, no row-level security: no policy to run; not temporary: another
//! session's would be in its own buffers), stored columns of built-in
//! types that print alike on any search path (their output functions and
//! JSON conversions are PostgreSQL's; not `regclass` and its kind, which
//! the statement prints under its pinned path), and a
//! valid, non-partial B-tree index whose first key is the bigint ID column
//! with the built-in integer operator family (its comparisons are
//! PostgreSQL's; no index expression or predicate is evaluated by a scan).
//! When writers stand apart (a row's writer decides whether it is in
//! range), a text or varchar instance column of the default collation is
//! looked up in `streampos.instances` through its unique index on the
//! name, with the same snapshot, as the statement's subquery does (or
//! found among the ids this backend has read, `KnownInstances`, when the
//! snapshot sees the row they came from), and compared by `in_range`, as
//! the statement compares it.
//! Anything else is read by the statement in `followers.rs`.
//! The caller is checked with the same checks (`check_may_read`), after
//! pending invalidations are taken in (its ACL and children as they are now).
//!
//! Each value becomes what `jsonb_build_array` makes of it (the statement's
//! row): booleans, integers and text directly, any other built-in type
//! through `to_jsonb`, which `jsonb_build_array` uses per argument too. For
//! `updates_json` each row is written as JSON text at once, as `jsonb_out`
//! would print that array (`json_text.rs`).

use super::json_text::JsonText;
use super::*;
use crate::guc::JSON_BIGINT_AS_STRING;
use streampos_core::token::{in_range, Token};

/// The rows `updates` reads: low < id <= high, and each row's writer in
/// range between the multi-writer tokens `since` (exclusive) and `until`.
pub struct RowRange<'a> {
    pub low: i64,
    pub high: i64,
    pub since: &'a str,
    pub until: &'a str,
    /// `since` and `until` as tokens (what the index read compares).
    pub since_token: &'a Token,
    pub until_token: &'a Token,
    pub every_writer_above: i64,
    pub every_writer_up_to: i64,
    /// Rows read here are written as JSON text (`updates_json`).
    pub as_json_text: bool,
}

/// One row of `updates`' answer: its ID and the row as a jsonb datum in
/// the caller's memory context.
pub struct UpdateRow {
    pub id: i64,
    pub(super) json: RowJson,
}

/// A row's JSON array: the statement's jsonb, or the values an index read
/// put in (`index_read`), or the text it wrote (`RowRange::as_json_text`).
pub(super) enum RowJson {
    Jsonb(pg_sys::Datum),
    Cells(Vec<Cell>),
    Text(JsonText),
}

/// How one column becomes a JSON value.
#[derive(Clone, Copy, PartialEq)]
enum ColumnKind {
    Bool,
    /// int2, int4, int8 (not a domain): a JSON number.
    Integer,
    /// A bigint (or a domain over one) with `json_bigint_as_string`.
    BigintAsText,
    /// text or varchar (not a domain): its text, a JSON string.
    Text,
    /// Any other built-in type: `to_jsonb`.
    Other,
}

/// What a read of one table needs, found once per table until a relation
/// changes (`relations_changed`).
#[derive(Clone)]
struct ReadPlan {
    generation: u64,
    as_text: bool,
    /// What the plan was made for: the registration's columns and types
    /// (another stream may register the same table with other columns,
    /// and a registration changes without any relation changing).
    id_column: String,
    instance_column: Option<String>,
    columns_of: Vec<String>,
    types_of: Vec<pg_sys::Oid>,
    /// The ID index, or InvalidOid: the table cannot be read here.
    index: pg_sys::Oid,
    id_attnum: i16,
    /// (attribute number, its type, kind) of each column, in order.
    columns: Vec<(i16, pg_sys::Oid, ColumnKind)>,
    /// How each row's writer is found when writers stand apart.
    writer: WriterColumn,
}

/// The instance column, as the index read can compare it.
#[derive(Clone, Copy, PartialEq)]
enum WriterColumn {
    /// The table has none: every row is compared at each token's minimum.
    None,
    /// A text or varchar column of the default collation (its attribute
    /// number): looked up in `streampos.instances` by name.
    Text(i16),
    /// Any other: rows are compared by the statement.
    NotHere,
}

thread_local! {
    static READ_PLANS: std::cell::RefCell<crate::fast_hash::FastMap<pg_sys::Oid, ReadPlan>> =
        std::cell::RefCell::new(crate::fast_hash::FastMap::default());
}

/// One value of a row read here: a scalar, or a jsonb datum (`to_jsonb`'s).
#[derive(Clone, Copy)]
pub(super) enum Cell {
    Scalar(pg_sys::JsonbValue),
    Jsonb(pg_sys::Datum),
}

/// What an index read gave.
pub(super) enum IndexRead {
    /// The rows (None: the table was dropped).
    Rows(Option<Vec<UpdateRow>>),
    /// This table is read by the statement.
    NotHere,
}

/// The rows of `table` in `range` (`simple`: every row with `low < id <=
/// high`; else as `rows_in_range` in `followers.rs` says), in ID order, at
/// most `limit`, read with the active snapshot through the ID index.
pub(super) fn index_read(
    table: &StreamTable,
    range: &RowRange,
    simple: bool,
    limit: Option<i64>,
) -> IndexRead {
    // SAFETY: the relation is opened with the lock any read takes (kept to
    // the end of the transaction, as the statement's would be) and closed
    // on every path; NULL when it no longer exists.
    let rel = unsafe {
        pg_sys::try_relation_open(table.oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE)
    };
    if rel.is_null() {
        return IndexRead::Rows(None);
    }
    // A lock this transaction held already took no invalidations in: the
    // relation, its ACL and its children as they are now (read_as_owner
    // does the same).
    // SAFETY: processes pending invalidation messages; no ERROR.
    unsafe { pg_sys::AcceptInvalidationMessages() };
    // SAFETY: `rel` is open and locked.
    let close = || unsafe { pg_sys::relation_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE) };
    // SAFETY: as above; the form's fields are read while it is open.
    let (facts, plain) = unsafe {
        let form = &*(*rel).rd_rel;
        (
            RelationFacts {
                owner: form.relowner,
                kind: form.relkind as u8,
                row_security: form.relrowsecurity,
            },
            form.relkind as u8 == pg_sys::RELKIND_RELATION
                && form.relam == pg_sys::HEAP_TABLE_AM_OID
                && form.relpersistence as u8 != pg_sys::RELPERSISTENCE_TEMP
                && !form.relrowsecurity
                && !form.relhassubclass,
        )
    };
    if !plain {
        close();
        return IndexRead::NotHere;
    }
    let plan = read_plan(table, rel);
    if plan.index == pg_sys::InvalidOid || (!simple && plan.writer == WriterColumn::NotHere) {
        close();
        return IndexRead::NotHere;
    }
    let columns: Vec<&str> = table.columns.iter().map(String::as_str).collect();
    check_may_read(table.oid, &relation_name(table.oid), &facts, &columns);
    // SAFETY: the index was found among the relation's indexes with the
    // relation locked; opening it locks it as a scan does.
    let index =
        unsafe { pg_sys::index_open(plan.index, pg_sys::AccessShareLock as pg_sys::LOCKMODE) };
    let mut writers = Writers::default();
    let rows = scan(
        rel,
        index,
        &plan,
        range,
        (!simple).then_some(&mut writers),
        limit,
    );
    writers.close();
    // SAFETY: both are open. The table's lock stays to the end of the
    // transaction, as any read's; the index's is released (the statement
    // took it in a subtransaction that released it).
    unsafe { pg_sys::index_close(index, pg_sys::AccessShareLock as pg_sys::LOCKMODE) };
    close();
    IndexRead::Rows(Some(rows))
}

/// The kept `ReadPlan` of `table`, or a new one.
fn read_plan(table: &StreamTable, rel: pg_sys::Relation) -> ReadPlan {
    let generation = relations_generation();
    let as_text = JSON_BIGINT_AS_STRING.get();
    let kept = READ_PLANS.with(|p| {
        p.borrow()
            .get(&table.oid)
            .filter(|plan| {
                plan.generation == generation
                    && plan.as_text == as_text
                    && plan.id_column == table.id_column
                    && plan.instance_column == table.instance_column
                    && plan.columns_of == table.columns
                    && plan.types_of == table.types
            })
            .cloned()
    });
    if let Some(plan) = kept {
        return plan;
    }
    let plan = make_read_plan(table, rel, generation, as_text);
    READ_PLANS.with(|p| {
        let mut plans = p.borrow_mut();
        if plans.len() >= MAX_KEPT {
            plans.clear();
        }
        plans.insert(table.oid, plan.clone());
    });
    plan
}

fn make_read_plan(
    table: &StreamTable,
    rel: pg_sys::Relation,
    generation: u64,
    as_text: bool,
) -> ReadPlan {
    let mut plan = ReadPlan {
        generation,
        as_text,
        id_column: table.id_column.clone(),
        instance_column: table.instance_column.clone(),
        columns_of: table.columns.clone(),
        types_of: table.types.clone(),
        index: pg_sys::InvalidOid,
        id_attnum: 0,
        columns: Vec::new(),
        writer: WriterColumn::NotHere,
    };
    // SAFETY: `rel` is open and locked; its descriptor is read in place,
    // as each PostgreSQL version lays it out (pgrx's reader). A virtual
    // generated column (PostgreSQL 18) is computed by SQL, not stored: its
    // table is not read here.
    let attribute = |name: &str| unsafe {
        pgrx::PgTupleDesc::from_pg_unchecked((*rel).rd_att)
            .iter()
            .find(|a| {
                !a.attisdropped
                    && CStr::from_ptr(a.attname.data.as_ptr()).to_bytes() == name.as_bytes()
            })
            .filter(|a| a.attgenerated as u8 != b'v')
            .map(|a| (a.attnum, a.atttypid, a.attcollation))
    };
    let Some((id_attnum, id_type, _)) = attribute(&table.id_column) else {
        return plan;
    };
    if id_type != pg_sys::INT8OID {
        return plan;
    }
    for name in &table.columns {
        let Some((attnum, type_oid, _)) = attribute(name) else {
            return plan;
        };
        let Some(kind) = column_kind(type_oid, as_text) else {
            return plan;
        };
        plan.columns.push((attnum, type_oid, kind));
    }
    // The statement compares `instance_name = column::text`: the same for
    // text and varchar of the collation of `streampos.instances`' names
    // (another collation is the statement's to refuse or compare).
    plan.writer = match &table.instance_column {
        None => WriterColumn::None,
        Some(name) => match attribute(name) {
            Some((attnum, pg_sys::TEXTOID | pg_sys::VARCHAROID, pg_sys::DEFAULT_COLLATION_OID)) => {
                WriterColumn::Text(attnum)
            }
            _ => WriterColumn::NotHere,
        },
    };
    plan.id_attnum = id_attnum;
    plan.index = id_index(rel, id_attnum);
    plan
}

/// How a column of `type_oid` is read here; None: not here (a type that is
/// not built in, or an array of bigint to be printed as strings).
fn column_kind(type_oid: pg_sys::Oid, as_text: bool) -> Option<ColumnKind> {
    match type_oid {
        pg_sys::BOOLOID => return Some(ColumnKind::Bool),
        pg_sys::INT8OID if as_text => return Some(ColumnKind::BigintAsText),
        pg_sys::INT2OID | pg_sys::INT4OID | pg_sys::INT8OID => return Some(ColumnKind::Integer),
        pg_sys::TEXTOID | pg_sys::VARCHAROID => return Some(ColumnKind::Text),
        _ => {}
    }
    if !built_in_type(type_oid) || !prints_alike_on_any_path(type_oid) {
        return None;
    }
    match (as_text, bigint_kind(type_oid)) {
        (true, Some(false)) => Some(ColumnKind::BigintAsText),
        (true, Some(true)) => None,
        _ => Some(ColumnKind::Other),
    }
}

/// Whether a value of built-in `type_oid` prints the same whatever the
/// caller's `search_path` (the statement prints with `pg_catalog,
/// pg_temp`): not an object identifier type that names what it refers to
/// only as far as it must be qualified (`regclass` and its kind), nor an
/// array or a composite type (a catalog's row type) that may hold one.
fn prints_alike_on_any_path(type_oid: pg_sys::Oid) -> bool {
    // SAFETY: syscache lookups; a missing type is InvalidOid or b'\0'.
    unsafe {
        let element = pg_sys::get_element_type(type_oid);
        let base = if element == pg_sys::InvalidOid {
            type_oid
        } else {
            element
        };
        let names_an_object = matches!(
            base,
            pg_sys::REGPROCOID
                | pg_sys::REGPROCEDUREOID
                | pg_sys::REGOPEROID
                | pg_sys::REGOPERATOROID
                | pg_sys::REGCLASSOID
                | pg_sys::REGTYPEOID
                | pg_sys::REGCOLLATIONOID
                | pg_sys::REGCONFIGOID
                | pg_sys::REGDICTIONARYOID
                | pg_sys::REGNAMESPACEOID
                | pg_sys::REGROLEOID
        );
        !names_an_object && pg_sys::get_typtype(base) as u8 != pg_sys::TYPTYPE_COMPOSITE
    }
}

/// A valid, non-partial B-tree index of `rel` whose first key is column
/// `attnum` in ascending order with the built-in integer operator family
/// (a B-tree family), the one with the fewest keys (rows of one ID then
/// come in the order a plain index on the ID gives, as the statement's plan
/// would); InvalidOid if there is none. Each index is opened to read its
/// relcache entry and its lock released at once: a reader's transaction
/// does not keep REINDEX waiting on indexes it does not scan.
fn id_index(rel: pg_sys::Relation, attnum: i16) -> pg_sys::Oid {
    let mut best: Option<(i16, pg_sys::Oid)> = None;
    let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    // SAFETY: the indexes of a locked relation; each is opened, read and
    // closed with its lock released (a lock this transaction held before is
    // only counted down).
    unsafe {
        for oid in index_oids(rel) {
            let index = pg_sys::index_open(oid, lock);
            let form = &*(*index).rd_index;
            let key_count = form.indnkeyatts;
            let suits = form.indisvalid
                && !form.indcheckxmin
                && key_count >= 1
                && *form.indkey.values.as_ptr() == attnum
                && *(*index).rd_opfamily == pg_sys::INTEGER_BTREE_FAM_OID
                && (*(*index).rd_indoption as u32 & pg_sys::INDOPTION_DESC) == 0
                && pg_sys::heap_attisnull(
                    (*index).rd_indextuple,
                    pg_sys::Anum_pg_index_indpred as i32,
                    std::ptr::null_mut(),
                );
            pg_sys::index_close(index, lock);
            if suits && best.is_none_or(|(keys, _)| key_count < keys) {
                best = Some((key_count, oid));
            }
        }
    }
    best.map_or(pg_sys::InvalidOid, |(_, oid)| oid)
}

/// The rows in `range` through `index`, at most `limit`: with `writers`,
/// a row outside the band every writer's rows are in is compared by its
/// writer's positions in the tokens, as `rows_in_range` compares it.
fn scan(
    rel: pg_sys::Relation,
    index: pg_sys::Relation,
    plan: &ReadPlan,
    range: &RowRange,
    mut writers: Option<&mut Writers>,
    limit: Option<i64>,
) -> Vec<UpdateRow> {
    let mut rows = Vec::new();
    let max = limit.unwrap_or(i64::MAX);
    if max <= 0 || range.low >= range.high {
        return rows;
    }
    let writer_attnum = match plan.writer {
        WriterColumn::Text(attnum) => Some(attnum),
        _ => None,
    };
    let last_attnum = plan
        .columns
        .iter()
        .map(|c| c.0)
        .chain([plan.id_attnum])
        .chain(writer_attnum)
        .max()
        .unwrap_or(plan.id_attnum) as i32;
    let mut to_jsonb: Vec<Option<pg_sys::FmgrInfo>> = vec![None; plan.columns.len()];
    // A memory context for what `to_jsonb` leaves behind, made at its
    // first call (see `through_to_jsonb`).
    let mut scratch: Option<pg_sys::MemoryContext> = None;
    let mut row_text: Option<JsonText> = None;
    // SAFETY: an index scan as the executor's, with the active snapshot
    // (the caller pushed it); the slot and the scan are released below, and
    // by the resource owner if an error ends the transaction. A column's
    // value is read only after slot_getsomeattrs made it valid, and copied
    // before the slot moves on (a string's bytes may be in a shared buffer).
    unsafe {
        let snapshot = pg_sys::GetActiveSnapshot();
        let scan = begin_index_scan(rel, index, snapshot, 2);
        let mut keys: [pg_sys::ScanKeyData; 2] = std::mem::zeroed();
        pg_sys::ScanKeyInit(
            &mut keys[0],
            1,
            pg_sys::BTGreaterStrategyNumber as u16,
            pg_sys::Oid::from(pg_sys::F_INT8GT),
            pg_sys::Datum::from(range.low),
        );
        pg_sys::ScanKeyInit(
            &mut keys[1],
            1,
            pg_sys::BTLessEqualStrategyNumber as u16,
            pg_sys::Oid::from(pg_sys::F_INT8LE),
            pg_sys::Datum::from(range.high),
        );
        pg_sys::index_rescan(scan, keys.as_mut_ptr(), 2, std::ptr::null_mut(), 0);
        let slot = pg_sys::table_slot_create(rel, std::ptr::null_mut());
        while (rows.len() as i64) < max
            && pg_sys::index_getnext_slot(scan, pg_sys::ScanDirection::ForwardScanDirection, slot)
        {
            pg_sys::check_for_interrupts!();
            if ((*slot).tts_nvalid as i32) < last_attnum {
                pg_sys::slot_getsomeattrs_int(slot, last_attnum);
            }
            let value = |attnum: i16| {
                let i = attnum as usize - 1;
                (!*(*slot).tts_isnull.add(i)).then(|| *(*slot).tts_values.add(i))
            };
            let Some(id) = value(plan.id_attnum) else {
                continue;
            };
            let id = id.value() as i64;
            if let Some(writers) = writers.as_deref_mut() {
                let every_writers = id > range.every_writer_above && id <= range.every_writer_up_to;
                if !every_writers {
                    let writer = writer_attnum
                        .and_then(value)
                        .and_then(|name| writers.id_of(name));
                    if !in_range(Some(range.since_token), Some(range.until_token), writer, id) {
                        continue;
                    }
                }
            }
            let columns = plan.columns.iter().zip(to_jsonb.iter_mut());
            let json = if range.as_json_text {
                // Written where the longest row so far had room, then
                // copied at its length.
                let text = row_text.get_or_insert_with(|| JsonText::new(false));
                text.clear();
                text.push(b"[");
                for (i, (&(attnum, type_oid, kind), fmgr)) in columns.enumerate() {
                    if i > 0 {
                        text.push(b", ");
                    }
                    match value(attnum) {
                        None => text.push(b"null"),
                        Some(datum) => text_cell(text, datum, type_oid, kind, fmgr, &mut scratch),
                    }
                }
                text.push(b"]");
                RowJson::Text(text.copy())
            } else {
                RowJson::Cells(
                    columns
                        .map(|(&(attnum, type_oid, kind), fmgr)| match value(attnum) {
                            None => Cell::Scalar(null_value()),
                            Some(datum) => cell(datum, type_oid, kind, fmgr, &mut scratch),
                        })
                        .collect(),
                )
            };
            rows.push(UpdateRow { id, json });
        }
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::index_endscan(scan);
        if let Some(scratch) = scratch {
            pg_sys::MemoryContextDelete(scratch);
        }
    }
    rows
}

/// The writers of rows read here: each instance name's id in
/// `streampos.instances` as the active snapshot sees it (what the
/// statement's subquery finds), looked up once per name and read.
#[derive(Default)]
struct Writers {
    /// `streampos.instances` and its index on the name, once opened.
    opened: Option<(pg_sys::Relation, pg_sys::Relation, i16)>,
    ids: crate::fast_hash::FastMap<Vec<u8>, Option<i32>>,
}

impl Writers {
    /// The id of the instance named by text datum `name`; None when no
    /// instance has that name (the row is compared at the tokens' minimum).
    fn id_of(&mut self, name: pg_sys::Datum) -> Option<i32> {
        // SAFETY: `name` is a text or varchar value of a row in the slot.
        let bytes = unsafe { with_text_bytes(name, <[u8]>::to_vec) };
        if let Some(&id) = self.ids.get(&bytes) {
            return id;
        }
        let id = match KnownInstances::visible_id(&bytes) {
            Some(id) => Some(id),
            None => self.look_up(&bytes).map(|(id, xmin)| {
                KnownInstances::remember(&bytes, id, xmin);
                id
            }),
        };
        self.ids.insert(bytes, id);
        id
    }

    /// The instance's id and the transaction that inserted its row.
    fn look_up(&mut self, name: &[u8]) -> Option<(i32, pg_sys::TransactionId)> {
        if self.opened.is_none() {
            self.opened = open_instances();
        }
        let (rel, index, id_attnum) = self.opened?;
        // SAFETY: both are open and locked, the index on the name alone;
        // the tuple's values are read while the slot holds it.
        unsafe {
            let mut key = text_equality_key(index, 1, name);
            let scan = begin_index_scan(rel, index, pg_sys::GetActiveSnapshot(), 1);
            pg_sys::index_rescan(scan, &mut key, 1, std::ptr::null_mut(), 0);
            let slot = pg_sys::table_slot_create(rel, std::ptr::null_mut());
            let mut id = None;
            if pg_sys::index_getnext_slot(scan, pg_sys::ScanDirection::ForwardScanDirection, slot) {
                pg_sys::slot_getsomeattrs_int(slot, id_attnum as i32);
                let i = id_attnum as usize - 1;
                if !*(*slot).tts_isnull.add(i) {
                    let mut should_free = false;
                    let tuple = pg_sys::ExecFetchSlotHeapTuple(slot, false, &mut should_free);
                    let xmin = inserted_by((*tuple).t_data);
                    id = Some(((*(*slot).tts_values.add(i)).value() as i32, xmin));
                }
            }
            pg_sys::ExecDropSingleTupleTableSlot(slot);
            pg_sys::index_endscan(scan);
            id
        }
    }

    fn close(self) {
        if let Some((rel, index, _)) = self.opened {
            // SAFETY: opened by `open_instances`; the locks stay to the end
            // of the transaction.
            unsafe {
                pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
                pg_sys::relation_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
            }
        }
    }
}

/// Instance ids this backend has read, with the transaction that inserted
/// each row: a follower of writers standing apart looks each row's writer
/// up on every call, and the lookup (the table and its index opened, an
/// index scan per name) cost more than the rest of a small answer.
/// `streampos.instances`' rows are never updated or deleted
/// (`instances_immutable`), so a committed row's id is the answer for
/// every snapshot that sees the row, which is every snapshot for which
/// its inserting transaction is not in progress. Emptied when any
/// relation changes (a dropped extension's table, ids given again by a
/// new one). A hit reads and locks nothing of `streampos.instances`.
#[derive(Default)]
struct KnownInstances {
    generation: u64,
    ids: crate::fast_hash::FastMap<Vec<u8>, (i32, pg_sys::TransactionId)>,
}

thread_local! {
    static KNOWN_INSTANCES: std::cell::RefCell<KnownInstances> =
        std::cell::RefCell::new(KnownInstances::default());
}

/// More names than a stream has writers (1024): past it the map starts
/// again rather than grow with every name a table's rows carry.
const KNOWN_INSTANCES_MAX: usize = 4096;

impl KnownInstances {
    /// The id of instance `name` if its row is known and the active
    /// snapshot sees it; None: look it up.
    fn visible_id(name: &[u8]) -> Option<i32> {
        let generation = relations_generation();
        let (id, xmin) = KNOWN_INSTANCES.with(|k| {
            let k = k.borrow();
            (k.generation == generation)
                .then(|| k.ids.get(name).copied())
                .flatten()
        })?;
        // SAFETY: the active snapshot of the statement reading the rows;
        // `xmin` committed (see `remember`), so only the snapshot's view
        // of it decides, and no commit log is read.
        let seen = unsafe { !pg_sys::XidInMVCCSnapshot(xmin, pg_sys::GetActiveSnapshot()) };
        seen.then_some(id)
    }

    /// Keep the id of a row just read with the active snapshot, unless
    /// this transaction inserted it (a rollback would take it back). Any
    /// other row a snapshot sees was committed.
    fn remember(name: &[u8], id: i32, xmin: pg_sys::TransactionId) {
        // SAFETY: reads this backend's transaction state.
        if unsafe { pg_sys::TransactionIdIsCurrentTransactionId(xmin) } {
            return;
        }
        let generation = relations_generation();
        KNOWN_INSTANCES.with(|k| {
            let mut k = k.borrow_mut();
            if k.generation != generation || k.ids.len() >= KNOWN_INSTANCES_MAX {
                k.ids.clear();
                k.generation = generation;
            }
            k.ids.insert(name.to_vec(), (id, xmin));
        });
    }
}

/// The transaction that inserted a row (PostgreSQL's
/// `HeapTupleHeaderGetXmin`: frozen reads as `FrozenTransactionId`).
///
/// # Safety
/// `header` is a valid heap tuple header.
unsafe fn inserted_by(header: *const pg_sys::HeapTupleHeaderData) -> pg_sys::TransactionId {
    let frozen = (pg_sys::HEAP_XMIN_COMMITTED | pg_sys::HEAP_XMIN_INVALID) as u16;
    // SAFETY: as the caller promises.
    unsafe {
        if (*header).t_infomask & frozen == frozen {
            pg_sys::FrozenTransactionId
        } else {
            (*header).t_choice.t_heap.t_xmin
        }
    }
}

/// `streampos.instances`, its unique index on `instance_name` and the
/// attribute number of `instance_id`, opened and locked for reading; None
/// if any is missing (then no name has an id, as the statement would
/// fail to find it; it cannot happen while the extension is installed).
fn open_instances() -> Option<(pg_sys::Relation, pg_sys::Relation, i16)> {
    let oid = catalog_table(c"instances")?;
    // SAFETY: the relation and its indexes opened with the lock a read
    // takes; each index not kept is closed.
    unsafe {
        let rel = pg_sys::relation_open(oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let name_attnum = pg_sys::get_attnum(oid, c"instance_name".as_ptr());
        let id_attnum = pg_sys::get_attnum(oid, c"instance_id".as_ptr());
        for index_oid in index_oids(rel) {
            let index = pg_sys::index_open(index_oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
            let form = &*(*index).rd_index;
            if (*(*index).rd_rel).relam == pg_sys::BTREE_AM_OID
                && form.indisvalid
                && form.indisunique
                && form.indnkeyatts == 1
                && *form.indkey.values.as_ptr() == name_attnum
                && *(*index).rd_opfamily == pg_sys::TEXT_BTREE_FAM_OID
                && id_attnum > 0
            {
                return Some((rel, index, id_attnum));
            }
            pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
        }
        pg_sys::relation_close(rel, pg_sys::NoLock as pg_sys::LOCKMODE);
        None
    }
}

fn null_value() -> pg_sys::JsonbValue {
    // SAFETY: a zeroed JsonbValue is a valid bit pattern (plain data).
    let mut v: pg_sys::JsonbValue = unsafe { std::mem::zeroed() };
    v.type_ = pg_sys::jbvType::jbvNull;
    v
}

/// The value of an int2, int4 or int8 datum (`ColumnKind::Integer`).
fn integer_value(datum: pg_sys::Datum, type_oid: pg_sys::Oid) -> i64 {
    match type_oid {
        pg_sys::INT2OID => datum.value() as i16 as i64,
        pg_sys::INT4OID => datum.value() as i32 as i64,
        _ => datum.value() as i64,
    }
}

/// One non-null value as `jsonb_build_array` makes it.
///
/// # Safety
/// `datum` is a valid value of `type_oid`.
unsafe fn cell(
    datum: pg_sys::Datum,
    type_oid: pg_sys::Oid,
    kind: ColumnKind,
    fmgr: &mut Option<pg_sys::FmgrInfo>,
    scratch: &mut Option<pg_sys::MemoryContext>,
) -> Cell {
    // SAFETY: a zeroed JsonbValue is a valid bit pattern; strings and
    // numerics are palloc'd copies in the current memory context.
    unsafe {
        let mut v: pg_sys::JsonbValue = std::mem::zeroed();
        match kind {
            ColumnKind::Bool => {
                v.type_ = pg_sys::jbvType::jbvBool;
                v.val.boolean = datum.value() != 0;
            }
            ColumnKind::Integer => {
                v.type_ = pg_sys::jbvType::jbvNumeric;
                v.val.numeric = pg_sys::int64_to_numeric(integer_value(datum, type_oid));
            }
            ColumnKind::BigintAsText => {
                let text = (datum.value() as i64).to_string();
                v.type_ = pg_sys::jbvType::jbvString;
                v.val.string.len = text.len() as i32;
                v.val.string.val = pg_sys::pnstrdup(text.as_ptr().cast(), text.len());
            }
            ColumnKind::Text => {
                // Only the answer's copy is kept (not a detoasted one).
                let copied = with_text_bytes(datum, |bytes| {
                    (bytes.len() <= pg_sys::JENTRY_OFFLENMASK as usize).then(|| {
                        (
                            bytes.len(),
                            pg_sys::pnstrdup(bytes.as_ptr().cast(), bytes.len()),
                        )
                    })
                });
                // Too long for jsonb: to_jsonb's own error.
                let Some((len, copy)) = copied else {
                    return Cell::Jsonb(through_to_jsonb(datum, type_oid, fmgr, scratch));
                };
                v.type_ = pg_sys::jbvType::jbvString;
                v.val.string.len = len as i32;
                v.val.string.val = copy;
            }
            ColumnKind::Other => {
                return Cell::Jsonb(through_to_jsonb(datum, type_oid, fmgr, scratch))
            }
        }
        Cell::Scalar(v)
    }
}

/// One non-null value written as `jsonb_out` prints what `cell` makes of
/// it.
///
/// # Safety
/// `datum` is a valid value of `type_oid`.
unsafe fn text_cell(
    text: &mut JsonText,
    datum: pg_sys::Datum,
    type_oid: pg_sys::Oid,
    kind: ColumnKind,
    fmgr: &mut Option<pg_sys::FmgrInfo>,
    scratch: &mut Option<pg_sys::MemoryContext>,
) {
    // SAFETY: as the caller promises.
    unsafe {
        match kind {
            ColumnKind::Bool => text.boolean(datum.value() != 0),
            ColumnKind::Integer => text.integer(integer_value(datum, type_oid)),
            ColumnKind::BigintAsText => text.string(streampos_core::json::integer(
                datum.value() as i64,
                &mut [0; 20],
            )),
            // Read in place: no copy but the answer's. Too long for jsonb:
            // to_jsonb's own error, as `updates` and the statement give.
            ColumnKind::Text
                if with_text_bytes(datum, |bytes| {
                    let fits = bytes.len() <= pg_sys::JENTRY_OFFLENMASK as usize;
                    if fits {
                        text.string(bytes);
                    }
                    fits
                }) => {}
            ColumnKind::Text | ColumnKind::Other => {
                let json = through_to_jsonb(datum, type_oid, fmgr, scratch);
                text.jsonb(json);
                pg_sys::pfree(json.cast_mut_ptr());
            }
        }
    }
}

/// `to_jsonb(datum)`, for a value of `type_oid`: the function is looked up
/// once per read and column, told its argument's type as a call in SQL is.
///
/// # Safety
/// `datum` is a valid value of `type_oid`, a built-in type.
unsafe fn through_to_jsonb(
    datum: pg_sys::Datum,
    type_oid: pg_sys::Oid,
    fmgr: &mut Option<pg_sys::FmgrInfo>,
    scratch: &mut Option<pg_sys::MemoryContext>,
) -> pg_sys::Datum {
    // SAFETY: fmgr_info of a built-in function; its fn_expr is a FuncExpr
    // whose one argument has the column's type (what get_fn_expr_argtype
    // reads), in the current memory context, which outlives the read.
    unsafe {
        let info = fmgr.get_or_insert_with(|| {
            let mut info: pg_sys::FmgrInfo = std::mem::zeroed();
            pg_sys::fmgr_info(pg_sys::Oid::from(pg_sys::F_TO_JSONB), &mut info);
            let arg = pg_sys::makeNullConst(type_oid, -1, pg_sys::InvalidOid);
            let args = pg_sys::lappend(std::ptr::null_mut(), arg.cast());
            let call = pg_sys::makeFuncExpr(
                pg_sys::Oid::from(pg_sys::F_TO_JSONB),
                pg_sys::JSONBOID,
                args,
                pg_sys::InvalidOid,
                pg_sys::InvalidOid,
                pg_sys::CoercionForm::COERCE_EXPLICIT_CALL,
            );
            info.fn_expr = call.cast();
            info
        });
        // What the conversion allocates besides its result (output texts,
        // a detoasted value) goes with the scratch context at once, as the
        // executor's per-row context would take it.
        let outer = pg_sys::CurrentMemoryContext;
        let scratch = *scratch.get_or_insert_with(|| {
            pg_sys::AllocSetContextCreateInternal(
                outer,
                c"streampos index read".as_ptr(),
                pg_sys::ALLOCSET_DEFAULT_MINSIZE as usize,
                pg_sys::ALLOCSET_DEFAULT_INITSIZE as usize,
                pg_sys::ALLOCSET_DEFAULT_MAXSIZE as usize,
            )
        });
        pg_sys::MemoryContextSwitchTo(scratch);
        let json = pg_sys::FunctionCall1Coll(info, pg_sys::InvalidOid, datum);
        pg_sys::MemoryContextSwitchTo(outer);
        let json = pg_sys::Datum::from(pg_sys::pg_detoast_datum_copy(json.cast_mut_ptr()));
        pg_sys::MemoryContextReset(scratch);
        json
    }
}
