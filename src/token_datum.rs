//! A token as a varlena datum and back: what the SQL types (`types.rs`)
//! and the extension's own writes of token columns (`sql/consumer_row.rs`)
//! both read and write. Below both: it imports only the errors.

use pgrx::prelude::*;
use streampos_core::token::{Token, TokenKind};

use crate::error::OrRaise;

/// Read a token out of a (possibly toasted or short-header) varlena datum.
///
/// # Safety
/// `datum` must be a non-null varlena datum of one of the token types.
pub unsafe fn token_from_datum(datum: pg_sys::Datum, kind: TokenKind) -> Token {
    // SAFETY: the caller passes a varlena datum; detoasting gives a pointer
    // to its full value, valid for `varsize_any_exhdr` bytes after the
    // header, in the current memory context.
    unsafe {
        let raw = pg_sys::pg_detoast_datum_packed(datum.cast_mut_ptr());
        let len = pgrx::varlena::varsize_any_exhdr(raw);
        let data = pgrx::varlena::vardata_any(raw) as *const u8;
        let bytes = std::slice::from_raw_parts(data, len);
        Token::decode(kind, bytes).or_raise()
    }
}

/// Write a token into a fresh palloc'd varlena.
pub fn token_into_datum(token: &Token) -> pg_sys::Datum {
    let len = token.encoded_len();
    let mut bytes = Vec::with_capacity(len);
    token.encode(&mut bytes);
    // SAFETY: palloc returns `total` writable bytes (or raises an ERROR); the
    // header is set for that size and the payload copied after it.
    unsafe {
        let total = pg_sys::VARHDRSZ + bytes.len();
        let ptr = pg_sys::palloc(total) as *mut pg_sys::varlena;
        pgrx::varlena::set_varsize_4b(ptr, total as i32);
        let dst = (ptr as *mut u8).add(pg_sys::VARHDRSZ);
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len());
        pg_sys::Datum::from(ptr)
    }
}
