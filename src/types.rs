//! The two token types as SQL types: a compact varlena with hand-written text
//! and binary I/O. All logic is in `streampos_core::token`; this is glue.

use std::ffi::{CStr, CString};

use pgrx::callconv::{Arg, ArgAbi, BoxRet, FcInfo};
use pgrx::datum::Datum as FcDatum;
use pgrx::nullable::Nullable;
use pgrx::pgrx_sql_entity_graph::metadata::{
    ArgumentError, ReturnsError, ReturnsRef, SqlMappingRef, SqlTranslatable, TypeOrigin,
};
use pgrx::prelude::*;
use pgrx::{FromDatum, Internal, IntoDatum};
use streampos_core::token::{Token, TokenKind};

use crate::error::{Error, OrRaise};

use crate::ffi::{hash_bytes, hash_bytes_extended};
use crate::token_datum::{token_from_datum, token_into_datum};

macro_rules! token_sql_type {
    ($rust:ident, $kind:expr, $sql:literal) => {
        #[doc = concat!("The SQL type `streampos.", $sql, "`.")]
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub struct $rust(pub Token);

        impl FromDatum for $rust {
            unsafe fn from_polymorphic_datum(
                datum: pg_sys::Datum,
                is_null: bool,
                _typoid: pg_sys::Oid,
            ) -> Option<Self> {
                if is_null {
                    None
                } else {
                    // SAFETY: a non-null datum of this type, as the caller
                    // of from_polymorphic_datum guarantees.
                    Some($rust(unsafe { token_from_datum(datum, $kind) }))
                }
            }
        }

        impl IntoDatum for $rust {
            fn into_datum(self) -> Option<pg_sys::Datum> {
                Some(token_into_datum(&self.0))
            }
            fn type_oid() -> pg_sys::Oid {
                pgrx::wrappers::regtypein(concat!("streampos.", $sql))
            }
        }

        // SAFETY: unboxes through FromDatum above, which reads the argument
        // as this type's varlena, as the function's SQL signature says.
        unsafe impl<'fcx> ArgAbi<'fcx> for $rust {
            unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
                let index = arg.index();
                // SAFETY: forwarded from the caller (an argument of this type).
                unsafe { arg.unbox_arg_using_from_datum() }.unwrap_or_else(|| {
                    // A STRICT function is never called with NULL.
                    Error::Internal(format!("argument {index} of a strict function is NULL"))
                        .report()
                })
            }
            unsafe fn unbox_nullable_arg(arg: Arg<'_, 'fcx>) -> Nullable<Self> {
                // SAFETY: forwarded from the caller (an argument of this type).
                unsafe { arg.unbox_arg_using_from_datum::<Self>() }.into()
            }
        }

        // SAFETY: returns a palloc'd varlena of this type.
        unsafe impl BoxRet for $rust {
            unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> FcDatum<'fcx> {
                // SAFETY: a valid datum of the function's return type.
                unsafe { fcinfo.return_raw_datum(token_into_datum(&self.0)) }
            }
        }

        // SAFETY: maps to the SQL type that the datums above are.
        unsafe impl SqlTranslatable for $rust {
            const TYPE_IDENT: &'static str = pgrx::pgrx_resolved_type!($rust);
            // Created by sql/bootstrap.sql (shell) and sql/finalize.sql.
            const TYPE_ORIGIN: TypeOrigin = TypeOrigin::External;
            const ARGUMENT_SQL: Result<SqlMappingRef, ArgumentError> =
                Ok(SqlMappingRef::literal($sql));
            const RETURN_SQL: Result<ReturnsRef, ReturnsError> =
                Ok(ReturnsRef::One(SqlMappingRef::literal($sql)));
        }
    };
}

token_sql_type!(RoomToken, TokenKind::Room, "room_stream_token");
token_sql_type!(
    MultiWriterToken,
    TokenKind::MultiWriter,
    "multi_writer_token"
);

fn parse(kind: TokenKind, input: &CStr) -> Token {
    // Bytes, not text: in a SQL_ASCII or LATIN1 database the input need not
    // be UTF-8 (then it is no token, and the error quotes it clipped).
    Token::parse_bytes(kind, input.to_bytes()).or_raise()
}

fn print(kind: TokenKind, token: &Token) -> CString {
    // Exactly the text and its NUL: no copy when CString::new appends it.
    let mut text = String::with_capacity(token.text_len(kind) + 1);
    token.write_text(kind, &mut text);
    // Printed tokens are ASCII digits and punctuation: no interior NUL.
    CString::new(text).unwrap_or_default()
}

fn receive(kind: TokenKind, mut internal: Internal) -> Token {
    // SAFETY: a type's receive function gets a StringInfo as its internal
    // argument.
    let buf = match unsafe { internal.get_mut::<pg_sys::StringInfoData>() } {
        Some(buf) => buf,
        None => Error::invalid("no binary data given").report(),
    };
    let start = buf.cursor.max(0) as usize;
    let end = buf.len.max(0) as usize;
    let bytes: &[u8] = if end > start {
        // SAFETY: a StringInfo holds `len` bytes at `data`; the unread part
        // starts at `cursor`.
        unsafe { std::slice::from_raw_parts((buf.data as *const u8).add(start), end - start) }
    } else {
        &[]
    };
    let token = Token::recv(kind, bytes).or_raise();
    buf.cursor = buf.len;
    token
}

fn send(token: &Token) -> Vec<u8> {
    let mut out = Vec::with_capacity(token.encoded_len() + 8);
    token.send(&mut out);
    out
}

fn hash32(token: &Token) -> i32 {
    let mut bytes = Vec::with_capacity(token.encoded_len());
    token.encode(&mut bytes);
    // SAFETY: hashes `bytes`, which it only reads; raises no error.
    unsafe { hash_bytes(bytes.as_ptr(), bytes.len() as i32) as i32 }
}

fn hash64(token: &Token, seed: i64) -> i64 {
    let mut bytes = Vec::with_capacity(token.encoded_len());
    token.encode(&mut bytes);
    // SAFETY: as in `hash32`.
    unsafe { hash_bytes_extended(bytes.as_ptr(), bytes.len() as i32, seed as u64) as i64 }
}

/// A live token from SQL arrays. Their lengths are checked against the
/// token's cap before anything is copied out of them.
fn construct(stream: i64, ids: Option<Array<'_, i32>>, positions: Option<Array<'_, i64>>) -> Token {
    let (n_ids, n_positions) = (
        ids.as_ref().map_or(0, |a| a.len()),
        positions.as_ref().map_or(0, |a| a.len()),
    );
    if n_ids != n_positions {
        Error::InvalidArgument {
            message: "instance_ids and positions must have the same length".into(),
            detail: Some(format!(
                "instance_ids has {n_ids} elements and positions has {n_positions}."
            )),
        }
        .report();
    }
    if n_ids > streampos_core::token::MAX_INSTANCES {
        Error::from(streampos_core::token::TokenError::TooLarge {
            type_name: "token",
            detail: format!(
                "It lists {n_ids} instance positions; at most {} are allowed.",
                streampos_core::token::MAX_INSTANCES
            ),
        })
        .report();
    }
    let (Some(ids), Some(positions)) = (ids, positions) else {
        return Token::live(stream);
    };
    let mut pairs = Vec::with_capacity(n_ids);
    for (id, pos) in ids.iter().zip(positions.iter()) {
        match (id, pos) {
            (Some(id), Some(pos)) => pairs.push((id, pos)),
            _ => Error::invalid("instance_ids and positions must not contain NULL").report(),
        }
    }
    Token::vector(stream, pairs).or_raise()
}

/// Functions that both token types have, generated once per type so that the
/// SQL names are overloaded.
macro_rules! token_functions {
    ($module:ident, $rust:ident, $kind:expr, [$in:literal, $out:literal, $recv:literal, $send:literal,
     $cmp:literal, $lt:literal, $le:literal, $eq:literal, $ne:literal, $ge:literal, $gt:literal,
     $hash:literal, $hash_extended:literal],
     order: [$before_fn:ident, $cmp_fn:ident, $lt_fn:ident, $le_fn:ident, $ge_fn:ident, $gt_fn:ident]) => {
        paste::paste! {

            #[pg_extern(immutable, strict, parallel_safe, name = $in)]
            fn [<$module _type_in>](input: &CStr) -> $rust {
                $rust(parse($kind, input))
            }

            #[pg_extern(immutable, strict, parallel_safe, name = $out)]
            fn [<$module _type_out>](token: $rust) -> CString {
                print($kind, &token.0)
            }

            #[pg_extern(immutable, strict, parallel_safe, name = $recv)]
            fn [<$module _type_recv>](internal: Internal) -> $rust {
                $rust(receive($kind, internal))
            }

            #[pg_extern(immutable, strict, parallel_safe, name = $send)]
            fn [<$module _type_send>](token: $rust) -> Vec<u8> {
                send(&token.0)
            }

            #[pg_extern(immutable, strict, parallel_safe, name = "stream_pos")]
            fn [<$module _stream_pos>](token: $rust) -> i64 {
                token.0.stream()
            }

            #[pg_extern(immutable, strict, parallel_safe, name = "max_stream_pos")]
            fn [<$module _max_stream_pos>](token: $rust) -> i64 {
                token.0.max_stream_pos()
            }

            #[pg_extern(immutable, strict, parallel_safe, name = "instance_pos")]
            fn [<$module _instance_pos>](token: $rust, instance_id: i32) -> i64 {
                token.0.instance_pos(instance_id)
            }

            #[pg_extern(stable, strict, parallel_restricted, name = "instance_pos")]
            fn [<$module _instance_pos_by_name>](token: $rust, instance_name: &str) -> i64 {
                let id = crate::catalog::lookup_instance_id(instance_name)
                    .unwrap_or_else(|| Error::UnknownInstanceName(instance_name.into()).report());
                token.0.instance_pos(id)
            }

            #[pg_extern(immutable, strict, parallel_safe, name = "is_before_or_eq")]
            fn $before_fn(a: $rust, b: $rust) -> bool {
                a.0.is_before_or_eq(&b.0)
            }

            #[pg_extern(immutable, strict, parallel_safe, name = "persisted_after")]
            fn [<$module _persisted_after>](token: $rust, instance_id: i32, stream_id: i64) -> bool {
                token.0.persisted_after(instance_id, stream_id)
            }

            #[pg_extern(immutable, strict, parallel_safe, name = "advance")]
            fn [<$module _advance>](a: $rust, b: $rust) -> $rust {
                $rust(a.0.advance(&b.0).or_raise())
            }

            #[pg_extern(immutable, strict, parallel_safe, name = "bound")]
            fn [<$module _bound>](token: $rust, max_stream: i64) -> $rust {
                $rust(token.0.bound(max_stream))
            }

            #[pg_extern(immutable, strict, parallel_safe, name = $cmp)]
            fn $cmp_fn(a: $rust, b: $rust) -> i32 {
                a.0.cmp(&b.0) as i32
            }

            #[pg_extern(immutable, strict, parallel_safe, name = $lt)]
            fn $lt_fn(a: $rust, b: $rust) -> bool {
                a.0 < b.0
            }

            #[pg_extern(immutable, strict, parallel_safe, name = $le)]
            fn $le_fn(a: $rust, b: $rust) -> bool {
                a.0 <= b.0
            }

            #[pg_extern(immutable, strict, parallel_safe, name = $eq)]
            fn [<$module _eq>](a: $rust, b: $rust) -> bool {
                a.0 == b.0
            }

            #[pg_extern(immutable, strict, parallel_safe, name = $ne)]
            fn [<$module _ne>](a: $rust, b: $rust) -> bool {
                a.0 != b.0
            }

            #[pg_extern(immutable, strict, parallel_safe, name = $ge)]
            fn $ge_fn(a: $rust, b: $rust) -> bool {
                a.0 >= b.0
            }

            #[pg_extern(immutable, strict, parallel_safe, name = $gt)]
            fn $gt_fn(a: $rust, b: $rust) -> bool {
                a.0 > b.0
            }

            #[pg_extern(immutable, strict, parallel_safe, name = $hash)]
            fn [<$module _hash>](token: $rust) -> i32 {
                hash32(&token.0)
            }

            #[pg_extern(immutable, strict, parallel_safe, name = $hash_extended)]
            fn [<$module _hash_extended>](token: $rust, seed: i64) -> i64 {
                hash64(&token.0, seed)
            }
        }
    };
}

token_functions!(
    room_functions,
    RoomToken,
    TokenKind::Room,
    [
        "room_stream_token_in",
        "room_stream_token_out",
        "room_stream_token_recv",
        "room_stream_token_send",
        "room_stream_token_cmp",
        "room_stream_token_lt",
        "room_stream_token_le",
        "room_stream_token_eq",
        "room_stream_token_ne",
        "room_stream_token_ge",
        "room_stream_token_gt",
        "room_stream_token_hash",
        "room_stream_token_hash_extended"
    ],
    // 0.2.0's order (Synapse's is_before_or_eq) under new C symbols; the
    // 0.1.0 symbols keep 0.1.0's order (see `legacy_room_order` below).
    order: [
        room_functions_is_before_or_eq_v2,
        room_functions_cmp_v2,
        room_functions_lt_v2,
        room_functions_le_v2,
        room_functions_ge_v2,
        room_functions_gt_v2
    ]
);
token_functions!(
    multi_writer_functions,
    MultiWriterToken,
    TokenKind::MultiWriter,
    [
        "multi_writer_token_in",
        "multi_writer_token_out",
        "multi_writer_token_recv",
        "multi_writer_token_send",
        "multi_writer_token_cmp",
        "multi_writer_token_lt",
        "multi_writer_token_le",
        "multi_writer_token_eq",
        "multi_writer_token_ne",
        "multi_writer_token_ge",
        "multi_writer_token_gt",
        "multi_writer_token_hash",
        "multi_writer_token_hash_extended"
    ],
    // Unchanged since 0.1.0 (live tokens kept their order): 0.1.0 symbols.
    order: [
        multi_writer_functions_is_before_or_eq,
        multi_writer_functions_cmp,
        multi_writer_functions_lt,
        multi_writer_functions_le,
        multi_writer_functions_ge,
        multi_writer_functions_gt
    ]
);

#[pg_extern(immutable, strict, parallel_safe)]
fn topological(token: RoomToken) -> Option<i64> {
    token.0.topological()
}

// The multi-writer `in_range` keeps its 0.1.0 C symbol (its answers did not
// change); the room forms answer as Synapse does under new symbols (`_v2`),
// and the 0.1.0 symbols keep 0.1.0's answers (`legacy_room_order` below).

/// Synapse's multi-writer helpers (`is_stream_position_in_range`,
/// `make_multiwriter_sharded_token_bounds_sql`) compare a row without an
/// instance against each token's minimum: pure, so IMMUTABLE.
#[pg_extern(immutable, parallel_safe, name = "in_range")]
fn multi_writer_functions_in_range(
    low: Option<MultiWriterToken>,
    high: Option<MultiWriterToken>,
    instance_id: Option<i32>,
    stream_id: Option<i64>,
) -> Option<bool> {
    let stream_id = stream_id?;
    Some(streampos_core::token::in_range(
        low.as_ref().map(|t| &t.0),
        high.as_ref().map(|t| &t.0),
        instance_id,
        stream_id,
    ))
}

/// The writer Synapse's room helpers (`_filter_results`,
/// `_filter_results_by_stream`) take a row to be from: its instance, or for a
/// NULL instance the one named "master" (`None` when there is none: then no
/// token lists it, and every token's minimum is its position).
///
/// Looking the name up reads `streampos.instances`, so the room `in_range`
/// functions are STABLE, not IMMUTABLE: an instance created later changes
/// the answer (and an IMMUTABLE function must not read tables at all). They
/// are PARALLEL RESTRICTED: the lookup runs internal SQL with a pinned
/// search_path, which a parallel worker may not set.
fn room_row_writer(instance_id: Option<i32>) -> Option<i32> {
    instance_id
        .or_else(|| crate::catalog::lookup_instance_id(streampos_core::token::UNNAMED_WRITER))
}

/// [`room_row_writer`], looked up only when a bound is live: historical
/// bounds and missing ones do not depend on the writer.
fn room_row_writer_for(
    low: Option<&Token>,
    high: Option<&Token>,
    instance_id: Option<i32>,
) -> Option<i32> {
    let live = |t: Option<&Token>| t.is_some_and(|t| !t.is_historical());
    if live(low) || live(high) {
        room_row_writer(instance_id)
    } else {
        instance_id
    }
}

/// Synapse's `_filter_results_by_stream`.
#[pg_extern(stable, parallel_restricted, name = "in_range")]
fn room_functions_in_range_v2(
    low: Option<RoomToken>,
    high: Option<RoomToken>,
    instance_id: Option<i32>,
    stream_id: Option<i64>,
) -> Option<bool> {
    let stream_id = stream_id?;
    let (low, high) = (low.as_ref().map(|t| &t.0), high.as_ref().map(|t| &t.0));
    let writer = room_row_writer_for(low, high, instance_id);
    Some(streampos_core::token::in_range(
        low, high, writer, stream_id,
    ))
}

/// Synapse's `_filter_results`.
#[pg_extern(stable, parallel_restricted, name = "in_range")]
fn in_range_room_v2(
    low: Option<RoomToken>,
    high: Option<RoomToken>,
    instance_id: Option<i32>,
    topological: Option<i64>,
    stream_id: Option<i64>,
) -> Option<bool> {
    let (topological, stream_id) = (topological?, stream_id?);
    let (low, high) = (low.as_ref().map(|t| &t.0), high.as_ref().map(|t| &t.0));
    let writer = room_row_writer_for(low, high, instance_id);
    Some(streampos_core::token::in_range_room(
        low,
        high,
        writer,
        topological,
        stream_id,
    ))
}

#[pg_extern(immutable, parallel_safe)]
fn make_room_token(
    stream: Option<i64>,
    instance_ids: default!(Option<Array<'_, i32>>, "NULL"),
    positions: default!(Option<Array<'_, i64>>, "NULL"),
) -> Option<RoomToken> {
    // Not STRICT, so that the arrays may be NULL; a NULL minimum is a NULL token.
    Some(RoomToken(construct(stream?, instance_ids, positions)))
}

#[pg_extern(immutable, strict, parallel_safe)]
fn make_historical_token(topological: i64, stream: i64) -> RoomToken {
    RoomToken(Token::historical(topological, stream))
}

#[pg_extern(immutable, parallel_safe)]
fn make_multi_writer_token(
    stream: Option<i64>,
    instance_ids: default!(Option<Array<'_, i32>>, "NULL"),
    positions: default!(Option<Array<'_, i64>>, "NULL"),
) -> Option<MultiWriterToken> {
    // Not STRICT, so that the arrays may be NULL; a NULL minimum is a NULL token.
    Some(MultiWriterToken(construct(
        stream?,
        instance_ids,
        positions,
    )))
}

#[pg_extern(immutable, strict, parallel_safe)]
fn room_to_multi_writer_token(token: RoomToken) -> MultiWriterToken {
    if let Some(topological) = token.0.topological() {
        Error::InvalidArgument {
            message: format!(
                "cannot cast historical token \"t{}-{}\" to multi_writer_token",
                topological,
                token.0.stream()
            ),
            detail: Some("Only live room tokens (s… or m…) have a multi-writer form.".into()),
        }
        .report();
    }
    MultiWriterToken(token.0)
}

#[pg_extern(immutable, strict, parallel_safe)]
fn multi_writer_to_room_token(token: MultiWriterToken) -> RoomToken {
    RoomToken(token.0)
}

/// The room-token functions of 0.1.0 under their 0.1.0 C symbols, with
/// 0.1.0's answers: a database still at 0.1.0 that runs this library keeps
/// the order its indexes were built in, until `ALTER EXTENSION streampos
/// UPDATE` points the SQL functions at the `_v2` symbols and rebuilds those
/// indexes. No SQL is generated for them (`sql = false`).
mod legacy_room_order {
    use super::RoomToken;
    use pgrx::prelude::*;
    use std::cmp::Ordering;
    use streampos_core::token::legacy;

    #[pg_extern(immutable, strict, parallel_safe, sql = false)]
    fn room_functions_is_before_or_eq(a: RoomToken, b: RoomToken) -> bool {
        legacy::is_before_or_eq(&a.0, &b.0)
    }

    #[pg_extern(immutable, strict, parallel_safe, sql = false)]
    fn room_functions_cmp(a: RoomToken, b: RoomToken) -> i32 {
        legacy::cmp(&a.0, &b.0) as i32
    }

    #[pg_extern(immutable, strict, parallel_safe, sql = false)]
    fn room_functions_lt(a: RoomToken, b: RoomToken) -> bool {
        legacy::cmp(&a.0, &b.0) == Ordering::Less
    }

    #[pg_extern(immutable, strict, parallel_safe, sql = false)]
    fn room_functions_le(a: RoomToken, b: RoomToken) -> bool {
        legacy::cmp(&a.0, &b.0) != Ordering::Greater
    }

    #[pg_extern(immutable, strict, parallel_safe, sql = false)]
    fn room_functions_ge(a: RoomToken, b: RoomToken) -> bool {
        legacy::cmp(&a.0, &b.0) != Ordering::Less
    }

    #[pg_extern(immutable, strict, parallel_safe, sql = false)]
    fn room_functions_gt(a: RoomToken, b: RoomToken) -> bool {
        legacy::cmp(&a.0, &b.0) == Ordering::Greater
    }

    /// 0.1.0: a NULL instance uses each token's minimum.
    #[pg_extern(immutable, parallel_safe, sql = false)]
    fn room_functions_in_range(
        low: Option<RoomToken>,
        high: Option<RoomToken>,
        instance_id: Option<i32>,
        stream_id: Option<i64>,
    ) -> Option<bool> {
        Some(streampos_core::token::in_range(
            low.as_ref().map(|t| &t.0),
            high.as_ref().map(|t| &t.0),
            instance_id,
            stream_id?,
        ))
    }

    /// 0.1.0: a NULL instance uses each live bound's minimum.
    #[pg_extern(immutable, parallel_safe, sql = false)]
    fn in_range_room(
        low: Option<RoomToken>,
        high: Option<RoomToken>,
        instance_id: Option<i32>,
        topological: Option<i64>,
        stream_id: Option<i64>,
    ) -> Option<bool> {
        Some(streampos_core::token::in_range_room(
            low.as_ref().map(|t| &t.0),
            high.as_ref().map(|t| &t.0),
            instance_id,
            topological?,
            stream_id?,
        ))
    }
}
