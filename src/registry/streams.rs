//! Stream states: one per (database, stream key), found or created on first
//! use after start-up, loaded with the sequence's value once, marked dropped
//! by `drop_stream` and reclaimed when the registry is full.

use pgrx::pg_sys;
use pgrx::pg_sys::TransactionId;

pub use super::shmem::Stale;
use super::shmem::{is_state_of, matches, Locked, Section, HEADER};
use crate::error::Error;

thread_local! {
    /// Stream key -> state index, for streams known to be loaded. Validated
    /// under the lock by every user (`matches`), so a stale entry costs a
    /// retry, never a wrong answer.
    static INDEX_CACHE: std::cell::RefCell<crate::fast_hash::FastMap<i32, usize>> =
        std::cell::RefCell::new(crate::fast_hash::FastMap::default());
    /// Set from an invalidation callback, which must not touch the cache.
    static INDEX_CACHE_STALE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub fn forget_index(key: i32) {
    INDEX_CACHE.with(|c| c.borrow_mut().remove(&key));
}

/// After the extension was dropped and created again, stream keys start
/// over: forget every cached index at the next use (they are validated
/// anyway; this saves the retries). Safe from any callback.
pub fn forget_all_indexes() {
    INDEX_CACHE_STALE.with(|x| x.set(true));
}

/// Find the state of (current database, stream key, sequence), creating it
/// if needed. Returns its index and whether its maximum allocated ID is known
/// yet.
pub fn stream_index(key: i32, seq: pg_sys::Oid) -> Result<(usize, bool), Error> {
    super::require_loaded()?;
    if INDEX_CACHE_STALE.with(|x| x.replace(false)) {
        INDEX_CACHE.with(|c| c.borrow_mut().clear());
    }
    if let Some(i) = INDEX_CACHE.with(|c| c.borrow().get(&key).copied()) {
        return Ok((i, true));
    }
    let (index, loaded) = lookup_stream_index(key, seq)?;
    if loaded {
        INDEX_CACHE.with(|c| c.borrow_mut().insert(key, index));
    }
    Ok((index, loaded))
}

fn lookup_stream_index(key: i32, seq: pg_sys::Oid) -> Result<(usize, bool), Error> {
    // SAFETY: MyDatabaseId is set once the backend is connected.
    let db = unsafe { pg_sys::MyDatabaseId };
    {
        let locked = Locked::acquire(Section::OtherShared)?;
        if let Some(i) = locked
            .streams()
            .iter()
            .position(|s| is_state_of(s, key, seq))
        {
            return Ok((i, locked.streams()[i].loaded));
        }
    }
    let full = Locked::acquire(Section::OtherShared)?
        .streams()
        .iter()
        .all(|s| s.in_use);
    if full {
        forget_dropped_databases()?;
        // A dropped stream's state is reclaimed once no finished entry
        // refers to it, and entries leave the ring only when pruned: by the
        // position worker of their database (gone with a dropped
        // database) or when the ring is crowded. A full registry must not
        // wait for either.
        super::visibility::prune()?;
    }
    // Read before the lock (they take PostgreSQL's own locks): every
    // snapshot has an xmin at or past `horizon`; every transaction that
    // dropped something before this call, this one included, is below
    // `next`.
    // SAFETY: compute the shared horizon and read the next xid; no error.
    let (horizon, next) = unsafe {
        (
            pg_sys::GetOldestNonRemovableTransactionId(std::ptr::null_mut()),
            pg_sys::ReadNextTransactionId(),
        )
    };
    let locked = Locked::acquire(Section::OtherExclusive)?;
    let streams = locked.streams();
    if let Some(i) = streams.iter().position(|s| is_state_of(s, key, seq)) {
        return Ok((i, streams[i].loaded));
    }
    // The same key with another sequence: the stream was dropped with the
    // extension and created again. Its old state is never used again.
    for s in streams.iter_mut() {
        if s.in_use && s.db == db && s.key == key && !s.dropped {
            s.dropped = true;
            s.dropped_by = next;
        }
    }
    let free = match streams.iter().position(|s| !s.in_use) {
        Some(i) => Some(i),
        None => reclaim_dropped(&locked, horizon),
    };
    let Some(i) = free else {
        return Err(Error::RegistryFull {
            what: "stream slot",
            guc: "streampos.max_streams",
        });
    };
    // Field by field: the condition variable stays as it is, as followers
    // of the state's previous stream may still be on its wait list.
    let s = &mut locked.streams()[i];
    s.in_use = true;
    s.loaded = false;
    s.dropped = false;
    s.dropped_by = pg_sys::InvalidTransactionId;
    s.db = db;
    s.key = key;
    s.seq = seq;
    s.max_allocated = 0;
    s.lost.n = 0;
    s.lost.set_mark(None);
    s.generation = s.generation.wrapping_add(1);
    s.summary.valid = false;
    s.orphans.clear();
    s.n_seen = 0;
    super::stats::reset_stream(s);
    Ok((i, false))
}

/// States of databases that no longer exist count as dropped streams. Only
/// when the registry is full: it reads pg_database.
fn forget_dropped_databases() -> Result<(), Error> {
    let existing = crate::sql::database_oids();
    if existing.is_empty() {
        return Ok(());
    }
    let locked = Locked::acquire(Section::OtherExclusive)?;
    for s in locked.streams().iter_mut() {
        if s.in_use && !existing.contains(&s.db) {
            // Nobody is connected to a database that no longer exists.
            s.dropped = true;
            s.dropped_by = pg_sys::InvalidTransactionId;
        }
    }
    Ok(())
}

/// A dropped stream's state can be reused once nothing refers to it: no
/// entry, and no snapshot that may still see the stream (a cursor, a
/// REPEATABLE READ transaction or an imported snapshot from before the
/// drop asks about it, and its answer comes from this state).
fn reclaim_dropped(locked: &Locked, horizon: TransactionId) -> Option<usize> {
    let candidates: Vec<usize> = locked
        .streams()
        .iter()
        .enumerate()
        .filter(|(_, s)| {
            s.in_use
                && s.dropped
                && (s.dropped_by == pg_sys::InvalidTransactionId
                    || super::visibility::precedes(s.dropped_by, horizon))
        })
        .map(|(i, _)| i)
        .collect();
    'next: for i in candidates {
        let i32_index = i as i32;
        if locked.ring_entries().any(|f| f.stream == i32_index) {
            continue;
        }
        if locked.streams()[i].orphans.valid {
            continue;
        }
        for &slot in locked.active_slots() {
            let slot = slot as usize;
            if locked
                .entries_in_use(slot)
                .iter()
                .chain(locked.holds_in_use(slot).iter())
                .any(|a| a.stream == i32_index)
            {
                continue 'next;
            }
        }
        locked.streams()[i].in_use = false;
        return Some(i);
    }
    None
}

/// Record the maximum allocated ID read from the sequence, unless another
/// backend did first. Allocations only start once it is known, so a value
/// read before any allocation since start-up is exact.
/// `stored_writers`: instances with a stored position, remembered as seen
/// so that tokens list them without reading the table on every call.
/// False when state `index` is no longer the stream's (it was dropped and
/// the state given to another stream while the sequence was read): the
/// value read belongs to another sequence, and the stream is gone.
/// `lost`: the stream's lost ranges (see `Lost`).
/// `orphaned`: (writer or `ALL_WRITERS`, lowest ID) that a transaction
/// which outlived the start (a prepared one) may still commit a row for:
/// from it up, the writer is held as by orphaned holds, until the position
/// worker has seen every transaction running now end (see `Orphans`).
pub fn set_loaded(
    index: usize,
    key: i32,
    seq: pg_sys::Oid,
    max_allocated: i64,
    stored_writers: &[i32],
    lost: &super::history::LostRanges,
    orphaned: &[(i32, i64)],
) -> Result<bool, Error> {
    let locked = Locked::acquire(Section::OtherExclusive)?;
    let s = &mut locked.streams()[index];
    if !is_state_of(s, key, seq) {
        return Ok(false);
    }
    if !s.loaded {
        s.loaded = true;
        s.max_allocated = max_allocated;
        lost.store(&mut s.lost);
        for &(writer, min_id) in orphaned {
            // Durable already: the start replayed everything before it.
            s.orphans.fold(writer, min_id, 0);
        }
        if !orphaned.is_empty() {
            s.generation += 1;
        }
        // Stored positions are written for the writers a token lists, at
        // most SEEN_WRITERS (more can only be imported: the extras are
        // not listed, as no writer of theirs could allocate since).
        for &w in stored_writers {
            if !s.add_seen(w) {
                break;
            }
        }
    }
    Ok(true)
}

/// Mark streams of this database dropped (their keys are never reused), from
/// the commit callback of the transaction that dropped them: nothing here
/// raises an ERROR or allocates. Until that commit the stream lives on.
/// `xid`: the dropping transaction (snapshots that do not see it may still
/// ask about the stream).
pub fn mark_dropped_at_commit(keys: &[i32], xid: TransactionId) {
    // SAFETY: HEADER is checked non-null (it is set once at start-up); the
    // states are touched under the registry lock; MyDatabaseId is set once
    // the backend is connected.
    unsafe {
        if keys.is_empty() || HEADER.is_null() {
            return;
        }
        let db = pg_sys::MyDatabaseId;
        let locked = Locked::acquire_raw(HEADER, Section::OtherExclusive);
        for s in locked.streams().iter_mut() {
            if s.in_use && s.db == db && keys.contains(&s.key) {
                s.dropped = true;
                s.dropped_by = xid;
            }
        }
    }
}

/// After `check_stream(…, repair => true)` moved the sequence forward, the
/// skipped values will never be handed out: nothing holds them back.
pub fn raise_max_allocated(stream: usize, value: i64) -> Result<(), Error> {
    let locked = Locked::acquire(Section::OtherExclusive)?;
    let s = &mut locked.streams()[stream];
    if s.loaded && s.max_allocated < value {
        s.max_allocated = value;
        s.generation += 1;
    }
    let cv = &mut s.cv as *mut pg_sys::ConditionVariable;
    drop(locked);
    // SAFETY: the condition variable lives in shared memory for the life of
    // the server; broadcasting needs no lock of ours.
    unsafe { pg_sys::ConditionVariableBroadcast(cv) };
    Ok(())
}

/// Streams of one database with their generation, for the position worker.
pub fn streams_of(db: pg_sys::Oid) -> Vec<(i32, usize, u64)> {
    let Ok(locked) = Locked::acquire(Section::OtherShared) else {
        return Vec::new();
    };
    locked
        .streams()
        .iter()
        .enumerate()
        .filter(|(_, s)| s.in_use && s.loaded && !s.dropped && s.db == db)
        .map(|(i, s)| (s.key, i, s.generation))
        .collect()
}

/// The highest ID this server allocated for the stream, now (not as any
/// snapshot sees it): what a follower's position must not pass.
pub fn highest_allocated(
    stream: usize,
    key: i32,
    seq: pg_sys::Oid,
) -> Result<Result<i64, Stale>, Error> {
    let locked = Locked::acquire(Section::OtherShared)?;
    let s = &locked.streams()[stream];
    Ok(if matches(s, key, seq) {
        Ok(s.max_allocated)
    } else {
        Err(Stale)
    })
}

/// The stream's generation: it moves whenever an allocation finishes.
pub fn generation(stream: usize) -> Result<u64, Error> {
    let locked = Locked::acquire(Section::Generation)?;
    Ok(locked.streams()[stream].generation)
}
