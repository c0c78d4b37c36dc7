//! A stream's registry slot, as the hot path finds it: cached per backend
//! and validated under the registry lock; the first use after start-up
//! loads it (`load.rs`, the cold path).

use crate::catalog::StreamMeta;
use crate::error::{Error, OrRaise};
use crate::registry;

use super::load::{dropped_concurrently, load_stream};
pub use crate::backend::in_recovery;

/// The registry slot of a stream, loading its maximum allocated ID from the
/// sequence the first time after start-up. Never during recovery: a
/// standby's sequences are not what its registry should start from once
/// promoted (they are loaded after promotion instead).
pub fn registry_index(meta: &StreamMeta) -> usize {
    registry::require_loaded().or_raise();
    if in_recovery() {
        Error::ReadOnly("during recovery").report();
    }
    let (index, loaded) = registry::stream_index(meta.key, meta.seq).or_raise();
    if !loaded {
        load_stream(meta, index);
    }
    index
}

/// Run `f` with the stream's registry index. The index is cached per
/// backend and validated by `f` under the registry lock; if it went stale
/// (the stream was dropped and its state reused), look it up again.
pub fn with_index<T>(
    meta: &StreamMeta,
    f: impl Fn(usize) -> Result<Result<T, registry::Stale>, Error>,
) -> T {
    for _ in 0..2 {
        let index = registry_index(meta);
        match f(index).or_raise() {
            Ok(value) => return value,
            Err(registry::Stale) => registry::forget_index(meta.key),
        }
    }
    dropped_concurrently(meta)
}
