//! C functions that pgrx 0.18 does not bind, declared by hand. Each is
//! exported by the PostgreSQL 15 server (or libc) with exactly this
//! signature; the reason we call it is next to it.

extern "C-unwind" {
    /// `nextval` without the fmgr call (src/backend/commands/sequence.c):
    /// allocation calls it n times in a row. `check_permissions = true`
    /// keeps the sequence's own privilege check (USAGE or UPDATE), as
    /// `nextval()` has it.
    pub fn nextval_internal(relid: pgrx::pg_sys::Oid, check_permissions: bool) -> i64;

    /// PostgreSQL's own hash (src/common/hashfn.c), stable across releases
    /// as hash indexes require. Cannot raise an error.
    pub fn hash_bytes(k: *const u8, keylen: i32) -> u32;

    /// The 64-bit seeded form of [`hash_bytes`], for `hash_extended`.
    pub fn hash_bytes_extended(k: *const u8, keylen: i32, seed: u64) -> u64;
}

extern "C" {
    /// libc `kill`: with signal 0 it only asks whether a process exists
    /// (a position worker's slot whose process died must be taken over).
    pub fn kill(pid: i32, sig: i32) -> i32;
}
