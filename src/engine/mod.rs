//! The stream engine between the SQL functions and the registry.
//!
//! | file | what it holds |
//! |---|---|
//! | `allocation.rs` | allocation and a hold's release: the hot path of `next_id`, from the SQL function to the registry and the sequence |
//! | `index.rs` | a stream's registry slot as the hot path finds it (cached, checked under the lock) |
//! | `load.rs` | the cold path: a stream's first use after a start (sequence, stored writers, lost ranges, prepared transactions' holds) |
//! | `marks.rs` | history marks, stored before a stream's first allocation in a new history |
//! | `answers.rs` | the answer a reader's snapshot gets (one per snapshot and transaction), the hot standby's answer, which writers a token lists |
//!
//! The hot path reads straight: `allocation.rs` calls down into `index.rs`,
//! `marks.rs` (a check of what this backend already knows), the registry
//! and the sequence. `load.rs`, the cold path, is entered by `index.rs`
//! only when a stream is not loaded, and by `marks.rs` only when a history
//! mark must be stored (bench/hot_path.py traces the warm call;
//! test_hot_path.py checks it never enters `load.rs`).

mod allocation;
mod answers;
mod index;
mod load;
mod marks;

pub use allocation::*;
pub use answers::*;
pub use index::*;
pub use load::{dropped_concurrently, loading_reads_tables};
pub use marks::{end_transaction_marks, forget_marks, table_added};
