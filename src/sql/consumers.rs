//! Consumers' rows: registration, acknowledgement, state, floors.

use super::*;

/// A consumer's row: its owner and acknowledged position (token text).
pub struct ConsumerRow {
    pub owner: pg_sys::Oid,
    pub position: String,
}

/// The consumer's row as the caller's snapshot sees it.
pub fn consumer(stream: &str, consumer: &str) -> Option<ConsumerRow> {
    // Kept: a consumer acknowledges again and again.
    kept_select(
        pg_sys::InvalidOid,
        "SELECT c.owner::pg_catalog.oid, c.position::pg_catalog.text \
         FROM streampos.consumer_positions c \
         WHERE c.stream_name OPERATOR(pg_catalog.=) $1 \
           AND c.consumer_name OPERATOR(pg_catalog.=) $2",
        &[TEXT, TEXT],
        &[stream.into(), consumer.into()],
        owner_and_position,
    )
    .pop()
    .map(|(owner, position)| ConsumerRow { owner, position })
}

/// (owner, position text) of a row of `consumer_positions` a statement
/// returned as its first two columns.
fn owner_and_position(
    tuple: pg_sys::HeapTuple,
    desc: pg_sys::TupleDesc,
) -> Option<(pg_sys::Oid, String)> {
    // SAFETY: a row of the statement's result, whose columns 1 and 2 are
    // an oid and a text.
    unsafe { spi_column::<pg_sys::Oid>(tuple, desc, 1).zip(spi_column::<String>(tuple, desc, 2)) }
}

/// Register a consumer owned by `owner` at `position` (token text); None if
/// the name is taken on the stream (a concurrent registration waits for the
/// other to end, as any insert of a unique key does).
pub fn insert_consumer(
    stream: &str,
    consumer: &str,
    owner: pg_sys::Oid,
    position: &str,
) -> Option<String> {
    let args: [DatumWithOid; 4] = [
        stream.into(),
        consumer.into(),
        DatumWithOid::from(owner),
        position.into(),
    ];
    as_owner(|| {
        update_one::<String>(
            "INSERT INTO streampos.consumer_positions AS c \
               (stream_name, consumer_name, owner, position, registered_at) \
             VALUES ($1, $2, $3::pg_catalog.oid::pg_catalog.regrole, \
                     $4::pg_catalog.text::streampos.multi_writer_token, pg_catalog.now()) \
             ON CONFLICT (stream_name, consumer_name) DO NOTHING \
             RETURNING c.position::pg_catalog.text",
            &args,
        )
    })
}

/// `ack`'s write as an UPDATE, where `consumer_row.rs` leaves it to SQL
/// (the table is not as the extension made it): the consumer's position
/// becomes its least upper bound with `token` (token text), never
/// backwards. The row is locked until the caller's transaction ends, and a
/// concurrent acknowledgement that committed first is joined, not
/// overwritten (READ COMMITTED re-evaluates the new value on the newest row
/// version). With `only_owner`, a row another role owns does not match
/// (it is neither written nor waited for). The owner of the row version
/// written and the position after (text); None if there is no such row.
pub fn advance_consumer_statement(
    stream: &str,
    consumer: &str,
    token: &str,
    only_owner: Option<pg_sys::Oid>,
) -> Option<(pg_sys::Oid, String)> {
    const SET_AND_MATCH: &str = "UPDATE streampos.consumer_positions c \
         SET position = streampos.advance(c.position, \
               $3::pg_catalog.text::streampos.multi_writer_token), \
             acked_at = pg_catalog.now() \
         WHERE c.stream_name OPERATOR(pg_catalog.=) $1 \
           AND c.consumer_name OPERATOR(pg_catalog.=) $2";
    const RETURNING: &str = " RETURNING c.owner::pg_catalog.oid, c.position::pg_catalog.text";
    match only_owner {
        None => consumer_write(
            &format!("{SET_AND_MATCH}{RETURNING}"),
            &[TEXT, TEXT, TEXT],
            &[stream.into(), consumer.into(), token.into()],
        ),
        Some(owner) => consumer_write(
            &format!(
                "{SET_AND_MATCH} AND c.owner::pg_catalog.oid OPERATOR(pg_catalog.=) $4{RETURNING}"
            ),
            &[TEXT, TEXT, TEXT, PgOid::BuiltIn(PgBuiltInOids::OIDOID)],
            &[
                stream.into(),
                consumer.into(),
                token.into(),
                DatumWithOid::from(owner),
            ],
        ),
    }
}

/// A write of one consumer's row (by its primary key) as the extension's
/// owner, kept for later calls, returning the row's (owner, position
/// text); None if there was no row.
fn consumer_write(
    query: &str,
    types: &[PgOid],
    args: &[DatumWithOid],
) -> Option<(pg_sys::Oid, String)> {
    as_owner(|| kept_update(query, types, args, owner_and_position).pop())
}

/// Forget a consumer; the owner (the caller checks it) and position of the
/// row deleted, None if there was none.
pub fn delete_consumer(stream: &str, consumer: &str) -> Option<(pg_sys::Oid, String)> {
    consumer_write(
        "DELETE FROM streampos.consumer_positions c \
         WHERE c.stream_name OPERATOR(pg_catalog.=) $1 \
           AND c.consumer_name OPERATOR(pg_catalog.=) $2 \
         RETURNING c.owner::pg_catalog.oid, c.position::pg_catalog.text",
        &[TEXT, TEXT],
        &[stream.into(), consumer.into()],
    )
}

/// Forget every consumer of the stream (`drop_stream`, before it holds the
/// sequence: a consumer's open transaction holds its row).
pub fn delete_consumers(stream: &str) {
    if !catalog_table_exists(c"consumer_positions") {
        return;
    }
    as_owner(|| {
        run(
            "DELETE FROM streampos.consumer_positions c \
             WHERE c.stream_name OPERATOR(pg_catalog.=) $1",
            &[stream.into()],
        )
    });
}

/// A stream's consumers and floor as last committed: the latest snapshot,
/// whatever the caller's isolation (a REPEATABLE READ transaction's
/// snapshot may predate positions a retention job has acted on).
pub struct ConsumerState {
    /// The named consumer's own row, if registered.
    pub own: Option<ConsumerRow>,
    /// Every other consumer's position (token text).
    pub others: Vec<String>,
    /// What consumers that have gone had acknowledged (token text).
    pub floor: Option<String>,
}

/// `ConsumerState` of `consumer` on `stream`, read with the latest
/// snapshot through `SPI_execute_snapshot` (an ordinary SPI query of a
/// transaction that has an xid reads with its own snapshot, whatever
/// snapshot is active).
pub fn consumer_state_latest(stream: &str, consumer: &str) -> ConsumerState {
    const QUERY: &CStr = c"SELECT 0, c.owner::pg_catalog.oid, c.position::pg_catalog.text \
        FROM streampos.consumer_positions c \
        WHERE c.stream_name OPERATOR(pg_catalog.=) $1 \
          AND c.consumer_name OPERATOR(pg_catalog.=) $2 \
        UNION ALL \
        SELECT 1, c.owner::pg_catalog.oid, c.position::pg_catalog.text \
        FROM streampos.consumer_positions c \
        WHERE c.stream_name OPERATOR(pg_catalog.=) $1 \
          AND c.consumer_name OPERATOR(pg_catalog.<>) $2 \
        UNION ALL \
        SELECT 2, 0::pg_catalog.oid, f.position::pg_catalog.text \
        FROM streampos.consumer_floors f WHERE f.stream_name OPERATOR(pg_catalog.=) $1";
    let mut state = ConsumerState {
        own: None,
        others: Vec::new(),
        floor: None,
    };
    with_safe_path(|| {
        spi(Spi::connect(|_client| -> SpiResult<()> {
            let (Some(s), Some(c)) = (stream.into_datum(), consumer.into_datum()) else {
                return Ok(());
            };
            // SAFETY: SPI is connected for the closure; the plan is freed
            // before returning (or with the SPI context on ERROR); the
            // result's tuples and descriptor are valid until SPI finishes,
            // and every value is copied out (owned Rust values) before.
            unsafe {
                let mut types = [pg_sys::TEXTOID, pg_sys::TEXTOID];
                let plan = pg_sys::SPI_prepare(QUERY.as_ptr(), 2, types.as_mut_ptr());
                if plan.is_null() {
                    return Err(pgrx::spi::SpiError::SpiError(
                        pgrx::spi::SpiErrorCodes::Unconnected,
                    ));
                }
                let mut values = [s, c];
                let nulls = [b' ' as std::ffi::c_char; 2];
                let status = pg_sys::SPI_execute_snapshot(
                    plan,
                    values.as_mut_ptr(),
                    nulls.as_ptr(),
                    pg_sys::GetLatestSnapshot(),
                    std::ptr::null_mut(),
                    true,
                    false,
                    0,
                );
                let table = pg_sys::SPI_tuptable;
                if status == pg_sys::SPI_OK_SELECT as i32 && !table.is_null() {
                    let desc = (*table).tupdesc;
                    for k in 0..pg_sys::SPI_processed as usize {
                        let tuple = *(*table).vals.add(k);
                        let mut null = false;
                        let kind =
                            i32::from_datum(pg_sys::SPI_getbinval(tuple, desc, 1, &mut null), null);
                        let owner = pg_sys::Oid::from_datum(
                            pg_sys::SPI_getbinval(tuple, desc, 2, &mut null),
                            null,
                        );
                        let position = String::from_datum(
                            pg_sys::SPI_getbinval(tuple, desc, 3, &mut null),
                            null,
                        );
                        match (kind, owner, position) {
                            (Some(0), Some(owner), Some(position)) => {
                                state.own = Some(ConsumerRow { owner, position })
                            }
                            (Some(1), _, Some(position)) => state.others.push(position),
                            (Some(2), _, Some(position)) => state.floor = Some(position),
                            _ => {}
                        }
                    }
                }
                pg_sys::SPI_freeplan(plan);
                Ok(())
            }
        }))
    });
    state
}

/// Raise the stream's consumer floor to at least `token` (token text): what
/// a retention job may have deleted up to while consumers that have gone
/// were registered. Never lowered.
pub fn raise_consumer_floor(stream: &str, token: &str) {
    as_owner(|| {
        run(
            "INSERT INTO streampos.consumer_floors AS f (stream_name, position) \
             VALUES ($1, $2::pg_catalog.text::streampos.multi_writer_token) \
             ON CONFLICT (stream_name) DO UPDATE \
             SET position = streampos.advance(f.position, EXCLUDED.position)",
            &[stream.into(), token.into()],
        )
    });
}

/// Every consumer's position (token text) on the stream, as the caller's
/// snapshot sees them.
pub fn consumer_positions(stream: &str) -> Vec<String> {
    select_all(
        "SELECT c.position::pg_catalog.text FROM streampos.consumer_positions c \
         WHERE c.stream_name OPERATOR(pg_catalog.=) $1",
        &[stream.into()],
        |r| r.get::<String>(1),
    )
}
