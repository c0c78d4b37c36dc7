//! The SQL functions of the stream engine, thin: argument checks and
//! results; the work is in `engine`, `catalog`, `sequence` and `registry`.
//!
//! | file | functions |
//! |---|---|
//! | `streams.rs` | create_stream, adopt_stream, add_table, set_writers, drop_stream, instance_id, instance_name |
//! | `writing.rs` | next_id, next_ids |
//! | `reading.rs` | frontier, max_allocated, writer_position(s), current_token, current_room_token, in_flight |
//! | `follow.rs` | wait_for, updates |
//! | `check.rs` | check_stream |
//! | `consumers.rs` | register_consumer, unregister_consumer, ack, safe_to_delete |
//! | `stats.rs` | stat_get_streams, stat_get_registry (the views stat_streams, stat_registry), stat_reset |
//! | `synapse.rs` | adopt_synapse |
//! | `listen.rs` | is_position_worker |
//! | `lock_stats.rs` | lock_stats (bench builds with the feature `lock-stats` only) |

mod check;
mod consumers;
mod follow;
mod listen;
#[cfg(feature = "lock-stats")]
mod lock_stats;
mod reading;
mod stats;
mod streams;
mod synapse;
mod writing;
