//! One read for many followers: each stream's latest `updates` answer in
//! shared memory, served to every follower that asks the same question
//! after that answer was read (docs/design.md, "One read for many").
//!
//! A commit wakes every follower of its stream at once; most of them stand
//! at the same token (each took the previous commit's answer) and would
//! read the same rows, each on its own. The first to read publishes its
//! answer here; the others copy it. A follower may take an answer only if
//! it is the one its own read would give:
//!
//! - the same question: the stream, `since`, `max_rows`, the answer's form
//!   and every setting an output function reads (time zone, date and
//!   interval styles, float digits, bytea output, money's locale,
//!   `json_bigint_as_string`), and the same tables with the same columns
//!   and types, which the follower has just been checked to read (its
//!   privileges as they are now, invalidations taken in);
//! - read with a snapshot its own read could have taken: under READ
//!   COMMITTED a follower answers for a snapshot taken during its call
//!   (README, "`wait_for` and `updates` under READ COMMITTED"), and the
//!   answer's reader took a ticket before its snapshot, the follower noted
//!   the next ticket when its call began: a ticket at or above that note
//!   was taken after the call began. Not under REPEATABLE READ (the
//!   transaction's snapshot decides), and not in a transaction that has
//!   written (its own rows would be part of its own read);
//! - only answers whose every column is of a built-in type are published
//!   (another type's output function may read any setting).
//!
//! A follower about to read announces it (`claim`); others of the same
//! question wait for its answer a few milliseconds at most
//! (`wait_for_reader`), then read for themselves.
//!
//! Each slot is a seqlock: a publisher takes it by moving its version to
//! odd (or does not publish), copies, and moves it to even; a reader copies
//! and keeps the copy only if the version did not move. Slots are indexed
//! by the stream's registry slot and keyed by its stream key (never
//! reused); `streampos.shared_answer_kb` sizes them (0: off), for at most
//! `MAX_SLOTS` streams.

use std::ffi::CStr;
use std::ptr;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use pgrx::pg_sys;

use crate::guc;

const SHMEM_NAME: &CStr = c"streampos shared answers";

#[repr(C)]
struct Area {
    /// The next ticket (see the module comment).
    next_ticket: AtomicU64,
    n_slots: u32,
    /// Bytes of key and answer a slot holds.
    slot_bytes: u32,
}

#[repr(C)]
struct SlotHeader {
    /// Odd while a publisher writes.
    version: AtomicU64,
    /// The ticket of a follower reading for itself now, to publish (0:
    /// none), and a hash of its question: followers of the same question
    /// whose call began before that ticket wait briefly for its answer.
    building: AtomicU64,
    building_question: AtomicU64,
    /// The publisher's ticket; 0: empty.
    ticket: u64,
    key_len: u32,
    answer_len: u32,
}

static mut AREA: *mut Area = ptr::null_mut();
static mut PREV_SHMEM_STARTUP: pg_sys::shmem_startup_hook_type = None;
#[cfg(not(feature = "pg14"))]
static mut PREV_SHMEM_REQUEST: pg_sys::shmem_request_hook_type = None;

fn area_header_size() -> usize {
    std::mem::size_of::<Area>().next_multiple_of(64)
}

fn slot_stride(slot_bytes: usize) -> usize {
    (std::mem::size_of::<SlotHeader>() + slot_bytes).next_multiple_of(64)
}

/// Slots for at most this many streams (the first registry slots, which
/// streams take as they are first used): memory stays bounded when
/// `streampos.max_streams` is raised far.
const MAX_SLOTS: usize = 256;

fn wanted() -> (usize, usize) {
    let slot_bytes = guc::SHARED_ANSWER_KB.get().max(0) as usize * 1024;
    ((guc::MAX_STREAMS.get() as usize).min(MAX_SLOTS), slot_bytes)
}

fn total_size(n_slots: usize, slot_bytes: usize) -> usize {
    area_header_size() + n_slots * slot_stride(slot_bytes)
}

/// At `_PG_init` in the postmaster, while preloading.
pub fn request_shared_memory() {
    // SAFETY: hooks are installed once, in the postmaster, before any
    // backend exists; the previous hooks are chained.
    unsafe {
        #[cfg(not(feature = "pg14"))]
        {
            PREV_SHMEM_REQUEST = pg_sys::shmem_request_hook;
            pg_sys::shmem_request_hook = Some(shmem_request);
        }
        PREV_SHMEM_STARTUP = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(shmem_startup);
        #[cfg(feature = "pg14")]
        shmem_request();
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_request() {
    // SAFETY: called where add-in shared memory may be requested (see
    // registry/shmem.rs).
    unsafe {
        #[cfg(not(feature = "pg14"))]
        if let Some(prev) = PREV_SHMEM_REQUEST {
            prev();
        }
        let (n_slots, slot_bytes) = wanted();
        if slot_bytes > 0 {
            pg_sys::RequestAddinShmemSpace(total_size(n_slots, slot_bytes));
        }
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn shmem_startup() {
    // SAFETY: called in every process attaching to shared memory; the area
    // is created once, zeroed, under AddinShmemInitLock.
    unsafe {
        if let Some(prev) = PREV_SHMEM_STARTUP {
            prev();
        }
        let (n_slots, slot_bytes) = wanted();
        if slot_bytes == 0 {
            return;
        }
        let size = total_size(n_slots, slot_bytes);
        // AddinShmemInitLock is MainLWLockArray[21] (lwlocknames.txt).
        let init_lock = &raw mut (*pg_sys::MainLWLockArray.add(21)).lock;
        pg_sys::LWLockAcquire(init_lock, pg_sys::LWLockMode::LW_EXCLUSIVE);
        let mut found = false;
        let base = pg_sys::ShmemInitStruct(SHMEM_NAME.as_ptr(), size, &mut found) as *mut u8;
        if !found {
            ptr::write_bytes(base, 0, size);
            let area = base as *mut Area;
            (*area).next_ticket = AtomicU64::new(1);
            (*area).n_slots = n_slots as u32;
            (*area).slot_bytes = slot_bytes as u32;
        }
        AREA = base as *mut Area;
        pg_sys::LWLockRelease(init_lock);
    }
}

fn area() -> Option<&'static Area> {
    // SAFETY: AREA is set once per process at shared memory start-up and
    // points to memory that lives as long as the process; its fields are
    // atomics or written once before any backend reads them.
    unsafe {
        let area = AREA;
        (!area.is_null()).then(|| &*area)
    }
}

/// The slot of registry index `index` (its header, and where its bytes
/// start), as raw pointers: other processes write it.
fn slot(area: &Area, index: usize) -> Option<(*mut SlotHeader, *mut u8)> {
    if index >= area.n_slots as usize {
        return None;
    }
    // SAFETY: within the area (index < n_slots); a slot's header is
    // followed by slot_bytes bytes.
    unsafe {
        let at = (area as *const Area as *mut u8)
            .add(area_header_size() + index * slot_stride(area.slot_bytes as usize));
        Some((
            at as *mut SlotHeader,
            at.add(std::mem::size_of::<SlotHeader>()),
        ))
    }
}

/// A slot's version (an atomic: shared by reference).
fn version<'a>(header: *mut SlotHeader) -> &'a AtomicU64 {
    // SAFETY: a slot header of the area, which lives as long as the
    // process; the version is only ever accessed atomically.
    unsafe { &(*header).version }
}

/// Whether the calling follower's read may be served, or published: READ
/// COMMITTED, no xid (the transaction has written nothing), the area
/// exists.
pub fn eligible() -> bool {
    // SAFETY: reads the transaction's isolation level and xid.
    area().is_some()
        && unsafe {
            pg_sys::XactIsoLevel < pg_sys::XACT_REPEATABLE_READ as i32
                && pg_sys::GetTopTransactionIdIfAny() == pg_sys::InvalidTransactionId
        }
}

/// Noted when a follower's call begins: answers published with a ticket at
/// or above it were read with a snapshot taken after this moment.
pub fn floor() -> u64 {
    area().map_or(u64::MAX, |a| a.next_ticket.load(Ordering::SeqCst))
}

/// Taken right before the snapshot an answer is read with.
pub fn take_ticket() -> u64 {
    area().map_or(0, |a| a.next_ticket.fetch_add(1, Ordering::SeqCst))
}

/// The answer published in slot `index` for `key` with a ticket at or
/// above `floor`, copied (a varlena, palloc'd in the current memory
/// context); None if there is none or a publisher is writing it.
pub fn find(index: usize, key: &[u8], floor: u64) -> Option<pg_sys::Datum> {
    let area = area()?;
    let (header, bytes) = slot(area, index)?;
    let before = version(header).load(Ordering::Acquire);
    if !before.is_multiple_of(2) {
        return None;
    }
    // SAFETY: the header's plain fields and the bytes may be torn by a
    // publisher; every copy is thrown away unless the version did not move
    // (read again after an acquire fence), and lengths are checked against
    // the slot's size before any copy.
    unsafe {
        let ticket = ptr::read_volatile(&raw const (*header).ticket);
        let key_len = ptr::read_volatile(&raw const (*header).key_len) as usize;
        let answer_len = ptr::read_volatile(&raw const (*header).answer_len) as usize;
        if ticket == 0
            || ticket < floor
            || key_len != key.len()
            || key_len + answer_len > area.slot_bytes as usize
            || answer_len < pg_sys::VARHDRSZ
        {
            return None;
        }
        // Bounded by the slot's size (checked above).
        let mut stored = vec![0u8; key_len];
        ptr::copy_nonoverlapping(bytes, stored.as_mut_ptr(), key_len);
        if stored != key {
            return None;
        }
        let copy = pg_sys::palloc(answer_len) as *mut u8;
        ptr::copy_nonoverlapping(bytes.add(key_len), copy, answer_len);
        fence(Ordering::Acquire);
        if version(header).load(Ordering::Relaxed) != before {
            pg_sys::pfree(copy.cast());
            return None;
        }
        Some(pg_sys::Datum::from(copy))
    }
}

/// Publish `answer` (a varlena) for `key`, read after taking `ticket`, in
/// slot `index`, unless it does not fit, a newer answer is there, or
/// another publisher is writing.
pub fn publish(index: usize, key: &[u8], ticket: u64, answer: pg_sys::Datum) {
    let Some(area) = area() else { return };
    let Some((header, bytes)) = slot(area, index) else {
        return;
    };
    // SAFETY: `answer` is a varlena in this backend's memory; its size is
    // read from its header (detoasted values only: the caller built it).
    let answer_len = unsafe { pgrx::varsize_any(answer.cast_mut_ptr()) };
    if key.len() + answer_len > area.slot_bytes as usize {
        return;
    }
    let before = version(header).load(Ordering::Relaxed);
    // SAFETY: a racy read of a plain field, only to skip: checked again
    // once the slot is taken.
    let newer_there = unsafe { ptr::read_volatile(&raw const (*header).ticket) } > ticket;
    if !before.is_multiple_of(2) || newer_there {
        return;
    }
    if version(header)
        .compare_exchange(before, before + 1, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        return;
    }
    fence(Ordering::Release);
    // SAFETY: the slot is taken (odd version): no other publisher writes;
    // readers throw away what they copy meanwhile. Nothing here can fail.
    unsafe {
        if (*header).ticket <= ticket {
            (*header).ticket = ticket;
            (*header).key_len = key.len() as u32;
            (*header).answer_len = answer_len as u32;
            ptr::copy_nonoverlapping(key.as_ptr(), bytes, key.len());
            ptr::copy_nonoverlapping(
                answer.cast_mut_ptr::<u8>(),
                bytes.add(key.len()),
                answer_len,
            );
        }
    }
    version(header).store(before + 2, Ordering::Release);
}

/// How long a follower waits for another's read of its question before
/// it reads for itself (a read takes tens of microseconds).
const WAIT_FOR_READER: std::time::Duration = std::time::Duration::from_millis(10);

/// Announce, in slot `index`, a read of `key` after taking `ticket`.
pub fn claim(index: usize, key: &[u8], ticket: u64) {
    let Some((header, _)) = area().and_then(|a| slot(a, index)) else {
        return;
    };
    // SAFETY: atomics of a slot header (see `version`).
    let (building, question) = unsafe { (&(*header).building, &(*header).building_question) };
    question.store(hash(key), Ordering::Relaxed);
    building.store(ticket, Ordering::Release);
}

/// The read announced with `ticket` is over (published or not).
pub fn unclaim(index: usize, ticket: u64) {
    let Some((header, _)) = area().and_then(|a| slot(a, index)) else {
        return;
    };
    // SAFETY: an atomic of a slot header (see `version`).
    let building = unsafe { &(*header).building };
    let _ = building.compare_exchange(ticket, 0, Ordering::Release, Ordering::Relaxed);
}

/// When another follower is reading `key` with a ticket at or above
/// `floor` (an answer this call may take), wait for it to publish, at most
/// `WAIT_FOR_READER`, looking only at the slot's version meanwhile.
pub fn wait_for_reader(index: usize, key: &[u8], floor: u64) -> Option<pg_sys::Datum> {
    let (header, _) = area().and_then(|a| slot(a, index))?;
    // SAFETY: atomics of a slot header (see `version`).
    let (building, question) = unsafe { (&(*header).building, &(*header).building_question) };
    let wanted = hash(key);
    let deadline = std::time::Instant::now() + WAIT_FOR_READER;
    loop {
        let ticket = building.load(Ordering::Acquire);
        if ticket == 0 || ticket < floor || question.load(Ordering::Relaxed) != wanted {
            return None;
        }
        let seen = version(header).load(Ordering::Acquire);
        std::thread::sleep(std::time::Duration::from_micros(20));
        if version(header).load(Ordering::Acquire) != seen {
            if let Some(answer) = find(index, key, floor) {
                return Some(answer);
            }
        }
        if std::time::Instant::now() >= deadline {
            return None;
        }
    }
}

/// FNV-1a, 64 bits: which question a reader announced.
fn hash(key: &[u8]) -> u64 {
    key.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The bytes that say which question an answer answers (see the module
/// comment): built by the follower that asks and by the one that
/// publishes, compared byte for byte.
pub struct Question {
    key: Vec<u8>,
    /// A column whose printing reads `bytea_output` or `lc_monetary`.
    slow_settings: bool,
}

impl Question {
    pub fn new(stream_key: i32, since: &str, max_rows: i32, form: u8) -> Question {
        let mut key = Vec::with_capacity(256);
        key.extend(stream_key.to_le_bytes());
        key.extend(max_rows.to_le_bytes());
        key.push(form);
        key.push(crate::guc::JSON_BIGINT_AS_STRING.get() as u8);
        push_text(&mut key, since.as_bytes());
        // SAFETY: the settings' variables, read as the output functions
        // read them; the time zone's name is valid while it is set.
        unsafe {
            for value in [
                pg_sys::DateStyle,
                pg_sys::DateOrder,
                pg_sys::IntervalStyle,
                pg_sys::extra_float_digits,
            ] {
                key.extend(value.to_le_bytes());
            }
            let zone = pg_sys::session_timezone;
            if !zone.is_null() {
                push_text(
                    &mut key,
                    CStr::from_ptr(pg_sys::pg_get_timezone_name(zone)).to_bytes(),
                );
            }
        }
        Question {
            key,
            slow_settings: false,
        }
    }

    /// A table the answer covers: its OID, columns and types.
    pub fn table(&mut self, oid: pg_sys::Oid, columns: &[String], types: &[pg_sys::Oid]) {
        self.key.extend(oid.to_u32().to_le_bytes());
        for (column, &type_oid) in columns.iter().zip(types) {
            push_text(&mut self.key, column.as_bytes());
            self.key.extend(type_oid.to_u32().to_le_bytes());
            self.slow_settings = self.slow_settings || reads_slow_settings(type_oid);
        }
        self.key.push(0xff);
    }

    /// The question's bytes, with the settings only some types read.
    pub fn finish(mut self) -> Vec<u8> {
        if self.slow_settings {
            for setting in [c"bytea_output", c"lc_monetary"] {
                // SAFETY: a built-in setting's value, copied at once.
                let value = unsafe { pg_sys::GetConfigOption(setting.as_ptr(), true, false) };
                if !value.is_null() {
                    // SAFETY: a NUL-terminated string.
                    push_text(&mut self.key, unsafe { CStr::from_ptr(value) }.to_bytes());
                }
            }
        }
        self.key
    }
}

/// Whether printing a value of `type_oid` may read `bytea_output` or
/// `lc_monetary`: bytea and money (through domains and arrays), and any
/// composite type (a row may hold either).
fn reads_slow_settings(type_oid: pg_sys::Oid) -> bool {
    // SAFETY: syscache lookups of a live column's type.
    unsafe {
        let base = pg_sys::getBaseType(type_oid);
        let element = pg_sys::get_element_type(base);
        if element != pg_sys::InvalidOid {
            return reads_slow_settings(element);
        }
        matches!(base, pg_sys::BYTEAOID | pg_sys::MONEYOID)
            || pg_sys::get_typtype(base) as u8 == pg_sys::TYPTYPE_COMPOSITE
    }
}

fn push_text(key: &mut Vec<u8>, text: &[u8]) {
    key.extend((text.len() as u32).to_le_bytes());
    key.extend(text);
}
