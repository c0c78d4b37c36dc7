//! Pure logic of streampos, with no PostgreSQL types, so that it is tested by
//! plain `cargo test` and fuzzed without a server.
//!
//! - [`token`]: the two token types (text form, storage form, wire form), their
//!   causal partial order, the total order that extends it, and the lattice
//!   operations (`advance`, `bound`).
//! - [`frontier`]: positions from a set of in-flight allocations.

#![forbid(unsafe_code)]

pub mod frontier;
pub mod token;
