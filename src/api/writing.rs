//! Allocation: `next_id` and `next_ids`, inside the transaction that persists
//! the rows.

use pgrx::prelude::*;

use crate::engine;

#[pg_extern(volatile, strict, parallel_unsafe)]
fn next_id(stream: &str, writer: &str) -> i64 {
    engine::allocate(stream, writer, 1)
        .first()
        .copied()
        .unwrap_or(0)
}

#[pg_extern(volatile, strict, parallel_unsafe)]
fn next_ids(stream: &str, writer: &str, n: i32) -> Vec<i64> {
    engine::allocate(stream, writer, n)
}
