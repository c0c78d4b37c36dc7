//! JSON text built in PostgreSQL's memory, printed as `jsonb_out` prints
//! the same value (`streampos_core::json`): `updates_json`'s answer, which
//! PostgreSQL then sends as it is, where a jsonb answer is printed again
//! character by character on every call.
//!
//! The buffer is a `StringInfo`: it grows with `enlargeStringInfo`, whose
//! limit (1 GB) is PostgreSQL's ERROR, never a failed Rust allocation.

use super::*;
use streampos_core::json::{quoted_len, write_quoted};

pub(super) struct JsonText {
    info: pg_sys::StringInfoData,
    /// The buffer's bytes before this offset are initialised (written, or
    /// zeroed when first handed out by `room`): a Rust slice is only made
    /// over initialised memory. At least `len + 1` (the NUL).
    initialized: usize,
}

impl JsonText {
    /// An empty text; with `varlena`, room for a varlena header first
    /// (`into_text_datum`).
    pub(super) fn new(varlena: bool) -> Self {
        const INITIAL: i32 = 256;
        // SAFETY: palloc'd in the current memory context; the fields are
        // what initStringInfo sets.
        let mut text = unsafe {
            JsonText {
                info: pg_sys::StringInfoData {
                    data: pg_sys::palloc(INITIAL as usize).cast(),
                    len: 0,
                    maxlen: INITIAL,
                    cursor: 0,
                },
                initialized: 0,
            }
        };
        if varlena {
            text.push(&[0; pg_sys::VARHDRSZ]);
        }
        text
    }

    /// Bytes free after the text, its NUL aside.
    fn free(&self) -> usize {
        (self.info.maxlen - self.info.len - 1) as usize
    }

    /// Room for `n` more bytes (and the terminating NUL).
    #[inline]
    fn reserve(&mut self, n: usize) {
        if n > self.free() {
            // SAFETY: enlargeStringInfo leaves at least n + 1 bytes after
            // len (or raises PostgreSQL's ERROR beyond its limit; a length
            // beyond i32 is refused by it too, as the request is clipped to
            // fail). repalloc keeps the old bytes, so what was initialised
            // stays so.
            unsafe {
                pg_sys::enlargeStringInfo(&mut self.info, i32::try_from(n).unwrap_or(i32::MAX))
            };
        }
    }

    /// Room for `n` more bytes, and the place where they go (bytes handed
    /// out for the first time zeroed first).
    #[inline]
    fn room(&mut self, n: usize) -> &mut [u8] {
        let start = self.info.len as usize;
        self.reserve(n);
        // SAFETY: reserve() made the room; every byte of the slice is
        // initialised.
        unsafe {
            let end = start + n;
            if end > self.initialized {
                let from = self.initialized.max(start);
                std::ptr::write_bytes(self.info.data.add(from), 0, end - from);
                self.initialized = end;
            }
            std::slice::from_raw_parts_mut(self.info.data.add(start).cast(), n)
        }
    }

    #[inline]
    fn advance(&mut self, n: usize) {
        self.info.len += n as i32;
        let len = self.info.len as usize;
        // SAFETY: room() left a byte after the new length.
        unsafe { *self.info.data.add(len) = 0 };
        self.initialized = self.initialized.max(len + 1);
    }

    #[inline]
    pub(super) fn push(&mut self, bytes: &[u8]) {
        self.reserve(bytes.len());
        // SAFETY: reserve() made the room; the bytes are copied, no slice
        // is made over what was not written yet.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.info.data.add(self.info.len as usize).cast(),
                bytes.len(),
            )
        };
        self.advance(bytes.len());
    }

    /// `bytes` as a quoted JSON string: in one pass with room for its
    /// longest escape while that is small or the buffer has it already,
    /// else measured exactly first (far from PostgreSQL's 1 GB limit, a
    /// long text asks for no more than it takes, and near it, what fits is
    /// written).
    pub(super) fn string(&mut self, bytes: &[u8]) {
        const SHORT: usize = 64 * 1024;
        const FAR_FROM_LIMIT: usize = 256 * 1024 * 1024;
        let longest = bytes.len().saturating_mul(6).saturating_add(2);
        let one_pass = longest <= self.free()
            || (bytes.len() <= SHORT && (self.info.len as usize) < FAR_FROM_LIMIT);
        let n = if one_pass { longest } else { quoted_len(bytes) };
        let written = write_quoted(bytes, self.room(n));
        self.advance(written);
    }

    pub(super) fn integer(&mut self, n: i64) {
        self.push(streampos_core::json::integer(n, &mut [0; 20]));
    }

    pub(super) fn boolean(&mut self, b: bool) {
        self.push(if b { b"true" } else { b"false" });
    }

    /// A jsonb datum as `jsonb_out` prints it.
    ///
    /// # Safety
    /// `datum` is a jsonb value.
    pub(super) unsafe fn jsonb(&mut self, datum: pg_sys::Datum) {
        // SAFETY: detoasted to its 4-byte-header form; JsonbToCString
        // appends to the given StringInfo.
        unsafe {
            let jb = pg_sys::pg_detoast_datum(datum.cast_mut_ptr()) as *mut pg_sys::Jsonb;
            let len = pgrx::varsize(jb as *const pg_sys::varlena) as i32;
            pg_sys::JsonbToCString(&mut self.info, &mut (*jb).root, len);
        }
        // It wrote the text and its NUL.
        self.initialized = self.initialized.max(self.info.len as usize + 1);
    }

    /// Empty again, its room kept.
    pub(super) fn clear(&mut self) {
        self.info.len = 0;
    }

    /// A copy of the text, of its length (and a NUL after it).
    pub(super) fn copy(&self) -> JsonText {
        let len = self.info.len;
        // SAFETY: len + 1 bytes palloc'd in the current memory context; the
        // text's bytes and its NUL copied.
        unsafe {
            let data: *mut std::ffi::c_char = pg_sys::palloc(len as usize + 1).cast();
            std::ptr::copy_nonoverlapping(self.info.data, data, len as usize + 1);
            JsonText {
                info: pg_sys::StringInfoData {
                    data,
                    len,
                    maxlen: len + 1,
                    cursor: 0,
                },
                initialized: len as usize + 1,
            }
        }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        // SAFETY: len bytes of data are written.
        unsafe { std::slice::from_raw_parts(self.info.data.cast(), self.info.len as usize) }
    }

    /// A text started with `new(true)` as a text (or json) datum.
    pub(super) fn into_text_datum(self) -> pg_sys::Datum {
        // SAFETY: the buffer begins with the room left for the header.
        unsafe {
            pgrx::set_varsize_4b(self.info.data.cast(), self.info.len);
            pg_sys::Datum::from(self.info.data)
        }
    }
}
