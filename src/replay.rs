//! The WAL record that wakes a hot standby's followers: after each commit
//! that stored a database's positions, the primary's position worker logs
//! which streams it stored, with a custom resource manager (PostgreSQL 15
//! and later, `streampos.standby_wakeup_rmgr_id`). Replaying the record on
//! a standby (the startup process, after the commit it follows) wakes the
//! followers of those streams (`registry::replayed`), which read the
//! stored positions their snapshot now sees. Cascading standbys replay the
//! same record. Off (0), or on PostgreSQL 14, followers on a standby look
//! again every `STANDBY_RECHECK_MS`.
//!
//! Every server that replays the primary's WAL must register the same id:
//! a record of an unknown resource manager stops replay. The setting is
//! PGC_POSTMASTER on every server; operators set it on the standbys first.

use pgrx::pg_sys;

/// The record's single kind.
#[cfg(not(feature = "pg14"))]
const XLOG_STREAMPOS_STORED: u8 = 0x00;

/// Most stream keys one record names (a pass names every stream it
/// stored; beyond this, more records).
#[cfg(not(feature = "pg14"))]
const KEYS_PER_RECORD: usize = 256;

/// Register the resource manager while the library is preloaded, if the
/// setting names an id. PostgreSQL raises an ERROR (FATAL at start) for an
/// id outside 128–255 or taken by another extension.
pub fn register(preloading: bool) {
    #[cfg(not(feature = "pg14"))]
    {
        let id = crate::guc::STANDBY_WAKEUP_RMGR_ID.get();
        if !preloading || id == 0 {
            return;
        }
        // SAFETY: called once, from _PG_init while preloading; PostgreSQL
        // keeps the pointer: the struct is static.
        unsafe {
            RMGR.rm_name = c"streampos".as_ptr();
            RMGR.rm_redo = Some(redo);
            RMGR.rm_desc = Some(desc);
            RMGR.rm_identify = Some(identify);
            pg_sys::RegisterCustomRmgr(id as pg_sys::RmgrId, &raw mut RMGR);
        }
    }
    #[cfg(feature = "pg14")]
    let _ = preloading;
}

/// Does this server log the records (the id is set)?
#[cfg(not(feature = "pg14"))]
fn enabled() -> bool {
    crate::guc::STANDBY_WAKEUP_RMGR_ID.get() != 0
}

#[cfg(not(feature = "pg14"))]
static mut RMGR: pg_sys::RmgrData = pg_sys::RmgrData {
    rm_name: std::ptr::null(),
    rm_redo: None,
    rm_desc: None,
    rm_identify: None,
    rm_startup: None,
    rm_cleanup: None,
    rm_mask: None,
    rm_decode: None,
};

/// Log that the positions of streams `keys` of database `db` were stored
/// by a transaction that has committed, and flush it: a standby then
/// replays it right after that commit (WAL order), and its followers'
/// next snapshot sees the stored positions. Outside a transaction.
pub fn log_stored(db: pg_sys::Oid, keys: &[i32]) {
    #[cfg(not(feature = "pg14"))]
    {
        if !enabled() || keys.is_empty() {
            return;
        }
        let id = crate::guc::STANDBY_WAKEUP_RMGR_ID.get() as pg_sys::RmgrId;
        for chunk in keys.chunks(KEYS_PER_RECORD) {
            let mut data = Vec::with_capacity(4 + 4 * chunk.len());
            data.extend_from_slice(&db.to_u32().to_ne_bytes());
            for key in chunk {
                data.extend_from_slice(&key.to_ne_bytes());
            }
            // SAFETY: a record of our resource manager with one data chunk,
            // which lives until XLogInsert returns; no buffer is registered.
            // XLogInsert raises an ERROR only where WAL cannot be written
            // (recovery), which the worker never runs in.
            unsafe {
                pg_sys::XLogBeginInsert();
                pg_sys::XLogRegisterData(data.as_mut_ptr().cast(), data.len() as _);
                let end = pg_sys::XLogInsert(id, XLOG_STREAMPOS_STORED);
                pg_sys::XLogFlush(end);
            }
        }
    }
    #[cfg(feature = "pg14")]
    let _ = (db, keys);
}

/// The record's (database, stream keys), if well formed.
#[cfg(not(feature = "pg14"))]
unsafe fn record_data(record: *mut pg_sys::XLogReaderState) -> Option<(pg_sys::Oid, Vec<i32>)> {
    // SAFETY: the reader's decoded record, valid during the callback.
    let bytes = unsafe {
        let decoded = (*record).record;
        if decoded.is_null() || (*decoded).main_data.is_null() {
            return None;
        }
        std::slice::from_raw_parts(
            (*decoded).main_data as *const u8,
            (*decoded).main_data_len as usize,
        )
    };
    if bytes.len() < 4 || bytes.len() % 4 != 0 {
        return None;
    }
    let word = |c: &[u8]| [c[0], c[1], c[2], c[3]];
    let mut words = bytes.chunks_exact(4);
    let db = pg_sys::Oid::from(u32::from_ne_bytes(word(words.next()?)));
    Some((db, words.map(|c| i32::from_ne_bytes(word(c))).collect()))
}

#[cfg(not(feature = "pg14"))]
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn redo(record: *mut pg_sys::XLogReaderState) {
    // SAFETY: PostgreSQL passes the record being replayed.
    if let Some((db, keys)) = unsafe { record_data(record) } {
        crate::registry::replayed(db, &keys);
    }
}

#[cfg(not(feature = "pg14"))]
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn desc(buf: pg_sys::StringInfo, record: *mut pg_sys::XLogReaderState) {
    // SAFETY: as in `redo`; the text is appended to PostgreSQL's buffer.
    unsafe {
        if let Some((db, keys)) = record_data(record) {
            let text = format!(
                "positions stored: database {} streams {:?}",
                db.to_u32(),
                keys
            );
            if let Ok(text) = std::ffi::CString::new(text) {
                pg_sys::appendStringInfoString(buf, text.as_ptr());
            }
        }
    }
}

#[cfg(not(feature = "pg14"))]
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn identify(info: u8) -> *const std::ffi::c_char {
    if info & !(pg_sys::XLR_INFO_MASK as u8) == XLOG_STREAMPOS_STORED {
        c"STORED".as_ptr()
    } else {
        std::ptr::null()
    }
}
