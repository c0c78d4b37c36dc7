//! Pure logic of streampos, with no PostgreSQL types, so that it is tested by
//! plain `cargo test` and fuzzed without a server.
//!
//! - [`token`]: the two token types (text form, storage form, wire form), their
//!   causal partial order, the total order that extends it, and the lattice
//!   operations (`advance`, `bound`).
//! - [`frontier`]: positions from a set of in-flight allocations.
//! - [`synapse_map`]: Synapse's streams (`sql/synapse_streams.tsv`), parsed.

#![forbid(unsafe_code)]

pub mod frontier;
pub mod synapse_map;
pub mod token;
