//! What `updates` reads: the rows in range of each stream table, as JSON.

use super::json_text::JsonText;
use super::*;

thread_local! {
    /// `update_rows`' statement text per (table, simple form, bigint as
    /// text), as of a generation and for the columns it was built from.
    static ROW_STATEMENTS: std::cell::RefCell<crate::fast_hash::FastMap<(pg_sys::Oid, bool, bool), RowStatement>> =
        std::cell::RefCell::new(crate::fast_hash::FastMap::default());
}

/// A statement text of `update_rows` and what it was built from.
struct RowStatement {
    generation: u64,
    name: std::rc::Rc<str>,
    id_column: String,
    instance_column: Option<String>,
    columns: Vec<String>,
    types: Vec<pg_sys::Oid>,
    query: std::rc::Rc<str>,
}

/// Refuse (before a follower waits) a caller that `updates` would refuse
/// when it reads the stream's tables (see `read_as_owner`); without taking
/// their locks, which a sleeping follower would otherwise hold.
pub fn check_may_follow(tables: &[StreamTable]) {
    for table in tables {
        let columns: Vec<&str> = table.columns.iter().map(String::as_str).collect();
        check_caller_may_read(table.oid, &columns);
    }
}

/// The FROM and WHERE of `updates`' reads of one table: rows with
/// $1 < id <= $2 whose writer (the instance column) is in range between the
/// multi-writer tokens $3 (exclusive) and $4 (inclusive). Rows with
/// $6 < id <= $7 are in range whoever wrote them: for those neither the
/// writer's id is looked up nor the tokens compared (an OR's arms run in
/// order), and the tokens are read from text once per statement (initplans).
fn rows_in_range(table: &StreamTable, name: &str) -> String {
    let id = quote_ident(&table.id_column);
    let instance = match &table.instance_column {
        Some(column) => format!(
            "(SELECT i.instance_id FROM streampos.instances i \
              WHERE i.instance_name OPERATOR(pg_catalog.=) t.{}::pg_catalog.text)",
            quote_ident(column)
        ),
        None => "NULL::pg_catalog.int4".to_string(),
    };
    format!(
        "FROM {tbl} t \
         WHERE t.{id} OPERATOR(pg_catalog.>) $1 AND t.{id} OPERATOR(pg_catalog.<=) $2 \
           AND ((t.{id} OPERATOR(pg_catalog.>) $6 AND t.{id} OPERATOR(pg_catalog.<=) $7) \
                OR streampos.in_range((SELECT $3::streampos.multi_writer_token), \
                                      (SELECT $4::streampos.multi_writer_token), \
                                      {instance}, t.{id}::pg_catalog.int8))",
        tbl = name,
    )
}

impl RowRange<'_> {
    /// The arguments $1 to $4 of `rows_in_range` ($5 is the limit; $6 and
    /// $7 follow it).
    fn args(&self) -> Vec<DatumWithOid<'static>> {
        vec![
            self.low.into(),
            self.high.into(),
            self.since.to_string().into(),
            self.until.to_string().into(),
        ]
    }
}

/// The first `limit` (None: all) rows of one table that `updates` returns,
/// in ID order, read with the active snapshot as the table's owner
/// (`read_as_owner`); None for a table dropped since the list was read.
pub fn update_rows(
    table: &StreamTable,
    range: &RowRange,
    limit: Option<i64>,
) -> Option<Vec<UpdateRow>> {
    // Every writer at one position in `since`, and in `until`: the rows in
    // range are those with low < id <= high, whoever wrote them (no token
    // in the statement). Else each row's writer is looked up and compared.
    let simple = range.low == range.every_writer_above && range.high == range.every_writer_up_to;
    if let IndexRead::Rows(rows) = index_read(table, range, simple, limit) {
        return rows;
    }
    let limit = match limit {
        Some(n) => n.into(),
        None => DatumWithOid::null::<i64>(),
    };
    const INT8: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT8OID);
    let (args, types) = if simple {
        (
            vec![range.low.into(), range.high.into(), limit],
            vec![INT8, INT8, INT8],
        )
    } else {
        let mut args = range.args();
        args.extend([
            limit,
            range.every_writer_above.into(),
            range.every_writer_up_to.into(),
        ]);
        (args, vec![INT8, INT8, TEXT, TEXT, INT8, INT8, INT8])
    };
    let columns: Vec<&str> = table.columns.iter().map(String::as_str).collect();
    // Every relation the statement reads is locked before the table's name
    // is looked up (read_as_owner locks the table, then takes in pending
    // invalidations): a kept statement checked again while it runs then
    // takes no new lock, so no invalidation (a schema renamed) is taken in
    // between, and its text, if analysed again, names the table checked.
    if !simple {
        lock_instances_table();
    }
    read_as_owner(table.oid, &columns, |name| {
        let query = row_statement(table, name, simple);
        kept_select(table.oid, &query, &types, &args, |tuple, desc| {
            // SAFETY: a tuple of this statement's result, of two columns
            // (int8, jsonb); the jsonb value is copied into the upper (the
            // function's) memory context before SPI frees its own.
            unsafe {
                let mut null = false;
                let id = pg_sys::SPI_getbinval(tuple, desc, 1, &mut null);
                if null {
                    return None;
                }
                let json = pg_sys::SPI_getbinval(tuple, desc, 2, &mut null);
                (!null).then(|| UpdateRow {
                    id: id.value() as i64,
                    json: RowJson::Jsonb(pg_sys::SPI_datumTransfer(json, false, -1)),
                })
            }
        })
    })
}

/// `update_rows`' statement for `table` named `name` (`simple`: without
/// the writers' positions; see there), built once per table until a
/// relation or a schema changes (`relations_changed`) or its columns do.
fn row_statement(table: &StreamTable, name: &str, simple: bool) -> std::rc::Rc<str> {
    let generation = relations_generation();
    let as_text = crate::guc::JSON_BIGINT_AS_STRING.get();
    let key = (table.oid, simple, as_text);
    let kept = ROW_STATEMENTS.with(|r| {
        r.borrow().get(&key).and_then(|s| {
            (s.generation == generation
                && &*s.name == name
                && s.id_column == table.id_column
                && s.instance_column == table.instance_column
                && s.columns == table.columns
                && s.types == table.types)
                .then(|| s.query.clone())
        })
    });
    if let Some(query) = kept {
        return query;
    }
    let id = quote_ident(&table.id_column);
    let row = row_json(table);
    let query: std::rc::Rc<str> = if simple {
        format!(
            "SELECT t.{id}::pg_catalog.int8, {row} FROM {name} t \
             WHERE t.{id} OPERATOR(pg_catalog.>) $1 AND t.{id} OPERATOR(pg_catalog.<=) $2 \
             ORDER BY t.{id} LIMIT $3"
        )
    } else {
        format!(
            "SELECT t.{id}::pg_catalog.int8, {row} {} ORDER BY t.{id} LIMIT $5",
            rows_in_range(table, name)
        )
    }
    .into();
    ROW_STATEMENTS.with(|r| {
        let mut statements = r.borrow_mut();
        if statements.len() >= MAX_KEPT {
            statements.clear();
        }
        statements.insert(
            key,
            RowStatement {
                generation,
                name: name.into(),
                id_column: table.id_column.clone(),
                instance_column: table.instance_column.clone(),
                columns: table.columns.clone(),
                types: table.types.clone(),
                query: query.clone(),
            },
        );
    });
    query
}

/// Lock `streampos.instances` for reading (what `update_rows`' statements
/// join), for the rest of the transaction.
fn lock_instances_table() {
    if let Some(rel) = catalog_table(c"instances") {
        // SAFETY: a lock as any read takes, kept to the end of the
        // transaction.
        unsafe { pg_sys::LockRelationOid(rel, pg_sys::AccessShareLock as pg_sys::LOCKMODE) };
    }
}

/// A table's row as the JSON array `updates` returns (see `json_column`).
fn row_json(table: &StreamTable) -> String {
    // jsonb_build_array takes at most 100 arguments (a table may have up
    // to 1600 columns): concatenate arrays of 100.
    let columns: Vec<(&String, &pg_sys::Oid)> = table.columns.iter().zip(&table.types).collect();
    columns
        .chunks(100)
        .map(|chunk| {
            let values = chunk
                .iter()
                .map(|(c, t)| json_column(c, **t))
                .collect::<Vec<_>>()
                .join(", ");
            format!("pg_catalog.jsonb_build_array({values})")
        })
        .collect::<Vec<_>>()
        .join(" OPERATOR(pg_catalog.||) ")
}

/// One column of a row of `updates`' answer as a JSON value. A column of a
/// built-in type (`built_in_type`) is what `jsonb_build_array` makes of it;
/// any other is the text of the type's output function (through `format`,
/// which calls it directly: a cast to text is code the type's owner may
/// have written, and so is a cast to json, which to_jsonb would look up), or
/// null. A bigint is a JSON string with `streampos.json_bigint_as_string`.
fn json_column(column: &str, type_oid: pg_sys::Oid) -> String {
    let c = quote_ident(column);
    let as_string = crate::guc::JSON_BIGINT_AS_STRING.get();
    if as_string && bigint_kind(type_oid) == Some(false) {
        // Exact for clients whose numbers are doubles (the statement's text
        // differs: a statement kept of its own). A domain's cast is its base
        // type's: PostgreSQL looks up no cast of a domain.
        format!("t.{c}::pg_catalog.text")
    } else if as_string && bigint_kind(type_oid) == Some(true) {
        // An array of them: an array of strings, dimensions kept.
        format!("t.{c}::pg_catalog.text[]")
    } else if built_in_type(type_oid) {
        format!("t.{c}")
    } else {
        format!(
            "CASE WHEN pg_catalog.num_nulls(t.{c}) OPERATOR(pg_catalog.=) 1 THEN NULL::pg_catalog.text \
             ELSE pg_catalog.format('%s'::pg_catalog.text, t.{c}) END"
        )
    }
}

/// The `updates` answer:
/// `{"token": …, "limited": …, "data": [[header], row, …, [header], row, …]}`
/// with, for each table (skipped when `None`: dropped), `[table_name,
/// position, row_count, column_count, column_name, …]` and then its rows,
/// oldest first. Built as jsonb directly in PostgreSQL's memory (rows can
/// be large: an answer beyond what PostgreSQL can hold is its ERROR, never
/// an abort), each row's jsonb copied in by jsonb's own iterator: no text
/// printed and parsed again. With `as_json_text` (`updates_json`): the
/// text `jsonb_out` prints for that jsonb, written at once (`json_text.rs`).
pub fn updates_answer(
    tables: &[StreamTable],
    rows: &[Option<Vec<UpdateRow>>],
    token: &str,
    position: i64,
    limited: bool,
    as_json_text: bool,
) -> pg_sys::Datum {
    if as_json_text {
        // jsonb prints an object's keys shortest first.
        let mut answer = TextAnswer {
            text: JsonText::new(true),
            first: true,
        };
        answer.text.push(b"{\"data\": ");
        data_array(&mut answer, tables, rows, position);
        answer.text.push(b", \"token\": ");
        answer.text.string(token.as_bytes());
        answer.text.push(b", \"limited\": ");
        answer.text.boolean(limited);
        answer.text.push(b"}");
        return answer.text.into_text_datum();
    }
    let mut answer = JsonbBuilder::new();
    answer.push(pg_sys::JsonbIteratorToken::WJB_BEGIN_OBJECT, None);
    answer.key("token");
    answer.string(pg_sys::JsonbIteratorToken::WJB_VALUE, token);
    answer.key("limited");
    answer.boolean(limited);
    answer.key("data");
    data_array(&mut answer, tables, rows, position);
    answer.finish(pg_sys::JsonbIteratorToken::WJB_END_OBJECT)
}

/// What the answer's "data" array is written to.
trait DataArray {
    fn begin_array(&mut self);
    fn end_array(&mut self);
    fn string(&mut self, text: &str);
    fn number(&mut self, n: i64);
    fn row(&mut self, row: &UpdateRow);
}

/// The answer's "data" array (see `updates_answer`).
fn data_array(
    out: &mut impl DataArray,
    tables: &[StreamTable],
    rows: &[Option<Vec<UpdateRow>>],
    position: i64,
) {
    out.begin_array();
    for (table, rows) in tables.iter().zip(rows) {
        let Some(rows) = rows else { continue };
        out.begin_array();
        out.string(&table.name);
        if crate::guc::JSON_BIGINT_AS_STRING.get() {
            out.string(&position.to_string());
        } else {
            out.number(position);
        }
        out.number(rows.len() as i64);
        out.number(table.columns.len() as i64);
        for column in &table.columns {
            out.string(column);
        }
        out.end_array();
        for row in rows {
            out.row(row);
        }
    }
    out.end_array();
}

/// The answer as JSON text: elements apart by ", ", as `jsonb_out` prints.
struct TextAnswer {
    text: JsonText,
    /// No element yet in the array being written.
    first: bool,
}

impl TextAnswer {
    fn element(&mut self) {
        if !self.first {
            self.text.push(b", ");
        }
        self.first = false;
    }
}

impl DataArray for TextAnswer {
    fn begin_array(&mut self) {
        self.element();
        self.text.push(b"[");
        self.first = true;
    }

    fn end_array(&mut self) {
        self.text.push(b"]");
        self.first = false;
    }

    fn string(&mut self, text: &str) {
        self.element();
        self.text.string(text.as_bytes());
    }

    fn number(&mut self, n: i64) {
        self.element();
        self.text.integer(n);
    }

    fn row(&mut self, row: &UpdateRow) {
        self.element();
        match &row.json {
            RowJson::Text(text) => self.text.push(text.bytes()),
            // SAFETY: a row's jsonb value.
            RowJson::Jsonb(datum) => unsafe { self.text.jsonb(*datum) },
            RowJson::Cells(cells) => {
                let mut array = JsonbBuilder::new();
                array.push(pg_sys::JsonbIteratorToken::WJB_BEGIN_ARRAY, None);
                array.cells(cells);
                let datum = array.finish(pg_sys::JsonbIteratorToken::WJB_END_ARRAY);
                // SAFETY: the jsonb value just built.
                unsafe { self.text.jsonb(datum) }
            }
        }
    }
}

impl DataArray for JsonbBuilder {
    fn begin_array(&mut self) {
        self.push(pg_sys::JsonbIteratorToken::WJB_BEGIN_ARRAY, None);
    }

    fn end_array(&mut self) {
        self.push(pg_sys::JsonbIteratorToken::WJB_END_ARRAY, None);
    }

    fn string(&mut self, text: &str) {
        JsonbBuilder::string(self, pg_sys::JsonbIteratorToken::WJB_ELEM, text);
    }

    fn number(&mut self, n: i64) {
        JsonbBuilder::number(self, n);
    }

    fn row(&mut self, row: &UpdateRow) {
        match &row.json {
            RowJson::Jsonb(datum) => self.jsonb(*datum),
            RowJson::Cells(cells) => {
                self.begin_array();
                self.cells(cells);
                self.end_array();
            }
            // SAFETY: the text is JSON that jsonb_out printed or would
            // print (NUL-terminated), read back as jsonb.
            RowJson::Text(text) => unsafe {
                let datum = pg_sys::OidFunctionCall1Coll(
                    pg_sys::Oid::from(pg_sys::F_JSONB_IN),
                    pg_sys::InvalidOid,
                    pg_sys::Datum::from(text.bytes().as_ptr()),
                );
                self.jsonb(datum)
            },
        }
    }
}

/// A jsonb value built with PostgreSQL's `pushJsonbValue`, in the current
/// memory context (as `jsonb_build_object` and `jsonb_agg` build theirs).
struct JsonbBuilder {
    state: *mut pg_sys::JsonbParseState,
    last: *mut pg_sys::JsonbValue,
}

impl JsonbBuilder {
    fn new() -> Self {
        JsonbBuilder {
            state: std::ptr::null_mut(),
            last: std::ptr::null_mut(),
        }
    }

    fn push(
        &mut self,
        token: pg_sys::JsonbIteratorToken::Type,
        value: Option<&mut pg_sys::JsonbValue>,
    ) {
        let value = value.map_or(std::ptr::null_mut(), |v| v as *mut _);
        // SAFETY: the parse state is PostgreSQL's, started by the first
        // push (BEGIN_OBJECT) and used only through pushJsonbValue; every
        // value pushed is valid for the call (scalars are copied, binary
        // containers unpacked).
        self.last = unsafe { pg_sys::pushJsonbValue(&mut self.state, token, value) };
    }

    fn scalar(&mut self, token: pg_sys::JsonbIteratorToken::Type, mut value: pg_sys::JsonbValue) {
        self.push(token, Some(&mut value));
    }

    fn string(&mut self, token: pg_sys::JsonbIteratorToken::Type, text: &str) {
        // SAFETY: a zeroed JsonbValue is a valid bit pattern (plain data);
        // the string is copied into PostgreSQL's memory (pnstrdup) since
        // the value must outlive this call (pushJsonbValue keeps the
        // pointer until the jsonb is serialised).
        let value = unsafe {
            let mut v: pg_sys::JsonbValue = std::mem::zeroed();
            v.type_ = pg_sys::jbvType::jbvString;
            v.val.string.len = text.len() as i32;
            v.val.string.val = pg_sys::pnstrdup(text.as_ptr().cast(), text.len());
            v
        };
        self.scalar(token, value);
    }

    fn key(&mut self, key: &str) {
        self.string(pg_sys::JsonbIteratorToken::WJB_KEY, key);
    }

    fn number(&mut self, n: i64) {
        // SAFETY: as in `string`; int64_to_numeric returns a palloc'd
        // numeric.
        let value = unsafe {
            let mut v: pg_sys::JsonbValue = std::mem::zeroed();
            v.type_ = pg_sys::jbvType::jbvNumeric;
            v.val.numeric = pg_sys::int64_to_numeric(n);
            v
        };
        self.scalar(pg_sys::JsonbIteratorToken::WJB_ELEM, value);
    }

    fn boolean(&mut self, b: bool) {
        // SAFETY: as in `string`.
        let value = unsafe {
            let mut v: pg_sys::JsonbValue = std::mem::zeroed();
            v.type_ = pg_sys::jbvType::jbvBool;
            v.val.boolean = b;
            v
        };
        self.scalar(pg_sys::JsonbIteratorToken::WJB_VALUE, value);
    }

    /// An element that is a jsonb datum (an array: a row).
    fn jsonb(&mut self, datum: pg_sys::Datum) {
        // SAFETY: `datum` is a jsonb varlena in this memory context;
        // detoasting gives its 4-byte-header form, whose root container
        // pushJsonbValue unpacks with jsonb's iterator.
        let value = unsafe {
            let jb = pg_sys::pg_detoast_datum(datum.cast_mut_ptr()) as *mut pg_sys::Jsonb;
            let mut v: pg_sys::JsonbValue = std::mem::zeroed();
            v.type_ = pg_sys::jbvType::jbvBinary;
            v.val.binary.data = &mut (*jb).root;
            v.val.binary.len =
                (pgrx::varsize(jb as *const pg_sys::varlena) - pg_sys::VARHDRSZ) as i32;
            v
        };
        self.scalar(pg_sys::JsonbIteratorToken::WJB_ELEM, value);
    }

    /// An index read's values, as elements.
    fn cells(&mut self, cells: &[Cell]) {
        for cell in cells {
            match *cell {
                Cell::Scalar(value) => self.scalar(pg_sys::JsonbIteratorToken::WJB_ELEM, value),
                Cell::Jsonb(datum) => self.jsonb(datum),
            }
        }
    }

    /// The jsonb datum, after the outermost container's end (`closing`).
    fn finish(mut self, closing: pg_sys::JsonbIteratorToken::Type) -> pg_sys::Datum {
        self.push(closing, None);
        // SAFETY: `last` is the complete value pushJsonbValue returned for
        // the closing token.
        unsafe { pg_sys::Datum::from(pg_sys::JsonbValueToJsonb(self.last)) }
    }
}
