//! Pure logic of streampos, with no PostgreSQL types, so that it is tested by
//! plain `cargo test` and fuzzed without a server.
//!
//! - [`token`]: the two token types (text form, storage form, wire form), their
//!   causal partial order, the total order that extends it, and the lattice
//!   operations (`advance`, `bound`).
//! - [`frontier`]: positions from a set of in-flight allocations.
//! - [`json`]: JSON text as PostgreSQL's `jsonb_out` prints it.
//! - [`synapse_map`]: Synapse's streams (`sql/synapse_streams.tsv`), parsed.

#![forbid(unsafe_code)]

pub mod frontier;
pub mod json;
pub mod synapse_map;
pub mod token;
