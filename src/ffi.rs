//! C functions declared by hand. Each is exported by the server (or libc)
//! with exactly this signature on every supported PostgreSQL (14 to 18,
//! checked against each version's headers; where one differs, the
//! declaration is per version, behind its feature); the reason we call it
//! is next to it.
//!
//! pgrx binds every server function behind a guard (a `sigsetjmp`, about 60
//! instructions a call) that turns an ERROR into a Rust panic. The functions
//! in `unguarded` cannot raise an ERROR, and they are on the paths of every
//! allocation, commit and read, so they are called without it.

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

extern "C-unwind" {
    /// Is the client still connected (src/backend/libpq/pqcomm.c, since
    /// PostgreSQL 14; `client_connection_check_interval` uses it)? A
    /// follower's long-poll asks between its sleeps, so that a killed
    /// client's backend does not wait out its timeout holding its
    /// transaction and locks. Only for a backend with a client
    /// (`MyProcPort`); called through `pg_guard_ffi_boundary`.
    pub fn pq_check_connection() -> bool;
}

#[cfg(not(feature = "pg14"))]
extern "C" {
    /// The backend's wait set on its client's socket, its latch and the
    /// postmaster (src/include/libpq/libpq.h; the socket at position 0).
    /// A follower sleeps on it with `WL_SOCKET_CLOSED` (PostgreSQL 15 and
    /// later), as `pq_check_connection` polls it: woken by a broadcast
    /// (its latch), its timeout, or its client going away.
    pub static mut FeBeWaitSet: *mut pgrx::pg_sys::WaitEventSet;
}

/// `FeBeWaitSetSocketPos` (a macro in libpq.h).
#[cfg(not(feature = "pg14"))]
pub const FE_BE_WAIT_SET_SOCKET_POS: i32 = 0;

extern "C" {
    /// libc `kill`: with signal 0 it only asks whether a process exists
    /// (a position worker's slot whose process died must be taken over).
    pub fn kill(pid: i32, sig: i32) -> i32;
}

#[cfg(feature = "pg14")]
extern "C" {
    /// A setting (postmaster/autovacuum.h) that PostgreSQL 14 adds into
    /// `MaxBackends` only after the preloaded libraries were loaded:
    /// `registry::shmem` sizes the registry before that.
    pub static autovacuum_max_workers: i32;
}

/// Server functions that never raise an ERROR (nor FATAL); called without
/// pgrx's guard. Only add a function here after reading its source: an
/// ERROR raised through these calls would skip Rust frames.
pub mod unguarded {
    use pgrx::pg_sys::{
        ConditionVariable, LWLock, LWLockMode, Oid, Snapshot, TimestampTz, XLogRecPtr,
    };

    /// Reads the flush pointer under a spinlock. PostgreSQL 14's takes no
    /// argument (15 added the timeline out-parameter, which we never ask
    /// for).
    ///
    /// # Safety
    /// As any call into the server.
    #[cfg(feature = "pg14")]
    #[allow(non_snake_case)]
    pub unsafe fn GetFlushRecPtr(_insert_tli: *mut u32) -> XLogRecPtr {
        extern "C-unwind" {
            #[link_name = "GetFlushRecPtr"]
            fn get_flush_rec_ptr() -> XLogRecPtr;
        }
        // SAFETY: reads shared state under a spinlock; raises no error.
        unsafe { get_flush_rec_ptr() }
    }

    extern "C-unwind" {
        /// Raises an ERROR only with 200 LWLocks held at once (lwlock.c);
        /// the registry takes one, and never while holding another.
        pub fn LWLockAcquire(lock: *mut LWLock, mode: LWLockMode::Type) -> bool;
        /// Raises an ERROR only for a lock not held: `Locked` releases the
        /// one it acquired, once.
        pub fn LWLockRelease(lock: *mut LWLock);
        /// Reads shared state under a spinlock.
        pub fn RecoveryInProgress() -> bool;
        /// Reads the flush pointer under a spinlock.
        #[cfg(not(feature = "pg14"))]
        pub fn GetFlushRecPtr(insert_tli: *mut u32) -> XLogRecPtr;
        /// Reads the insert pointer under a spinlock.
        pub fn GetXLogInsertRecPtr() -> XLogRecPtr;
        /// Reads the clock.
        pub fn GetCurrentTimestamp() -> TimestampTz;
        /// Pops waiters and sets their latches.
        pub fn ConditionVariableBroadcast(cv: *mut ConditionVariable);
        /// Reads a backend-local pointer.
        pub fn ActiveSnapshotSet() -> bool;
        /// Reads a backend-local pointer (callers check `ActiveSnapshotSet`).
        pub fn GetActiveSnapshot() -> Snapshot;
        /// Reads a backend-local value.
        pub fn GetUserId() -> Oid;
        /// Reads a backend-local value.
        pub fn GetCurrentTransactionStartTimestamp() -> TimestampTz;
        /// Reads a backend-local value (assigns nothing).
        pub fn GetTopTransactionIdIfAny() -> pgrx::pg_sys::TransactionId;
    }
}

/// Server functions that can raise an ERROR, declared without pgrx's guard
/// so that several calls share one `pg_guard_ffi_boundary`. Call them only
/// inside one, from a closure that owns nothing needing a drop: an ERROR
/// jumps straight back to the boundary, over the closure's frame.
pub mod in_boundary {
    use pgrx::pg_sys::{BlockNumber, Buffer, ForkNumber, Oid, Relation, LOCKMODE};

    #[cfg(not(any(feature = "pg14", feature = "pg15")))]
    pub use pgrx::pg_sys::RelFileLocator;
    /// A relation's file (`RelFileNode` until PostgreSQL 16 renamed it; the
    /// same three OIDs). `sequence::file_of` reads it from a relation.
    #[cfg(any(feature = "pg14", feature = "pg15"))]
    pub use pgrx::pg_sys::RelFileNode as RelFileLocator;

    extern "C-unwind" {
        /// Null when the relation is gone (after waiting for the lock).
        pub fn try_relation_open(relid: Oid, lockmode: LOCKMODE) -> Relation;
        pub fn relation_close(rel: Relation, lockmode: LOCKMODE);
        pub fn ReadBuffer(rel: Relation, block: BlockNumber) -> Buffer;
        /// Pins `recent` if it still holds the block (no buffer mapping
        /// lookup); false otherwise.
        pub fn ReadRecentBuffer(
            rnode: RelFileLocator,
            fork: ForkNumber::Type,
            block: BlockNumber,
            recent: Buffer,
        ) -> bool;
        pub fn LockBuffer(buffer: Buffer, mode: i32);
        pub fn UnlockReleaseBuffer(buffer: Buffer);
    }
}
