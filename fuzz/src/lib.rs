//! Fuzz targets for `streampos-core` tokens; see README.md.
//!
//! The checks live in `checks.rs`, which `core/tests/fuzz_corpus.rs` also
//! includes (by `#[path]`) to replay the committed corpus under plain
//! `cargo test`, so the fuzzer and the test can never drift apart.

pub mod checks;
