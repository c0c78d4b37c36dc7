//! Positions of a stream, computed from what holds it back.
//!
//! The registry hands this module the stream's maximum allocated ID and every
//! allocation that counts as in flight *for the caller's snapshot* (still
//! running, or finished but not yet visible to it). Everything here counts
//! positive; backward streams are negated at the SQL boundary.

use crate::token::Token;

/// Who an in-flight allocation holds back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeldBy {
    /// One writer's transaction.
    Writer(i32),
    /// A summary of evicted entries whose writers were forgotten: it holds
    /// back every writer, which costs lag, never correctness.
    AllWriters,
}

/// One allocation that is in flight for the caller: no ID below `min_id` is
/// held by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder {
    pub held_by: HeldBy,
    pub min_id: i64,
}

impl Holder {
    fn holds(&self, writer: i32) -> bool {
        match self.held_by {
            HeldBy::Writer(w) => w == writer,
            HeldBy::AllWriters => true,
        }
    }
}

/// The largest F such that every ID <= F is finished: one below the smallest
/// in-flight ID, or the maximum allocated ID when nothing is in flight.
pub fn frontier(max_allocated: i64, holders: &[Holder]) -> i64 {
    holders
        .iter()
        .map(|h| h.min_id.saturating_sub(1))
        .fold(max_allocated, i64::min)
}

/// The largest p such that every ID <= p allocated to `writer` is finished.
/// Only the writer's own allocations (and summaries) hold it back, so an idle
/// writer sits at the maximum allocated ID.
pub fn writer_position(max_allocated: i64, holders: &[Holder], writer: i32) -> i64 {
    holders
        .iter()
        .filter(|h| h.holds(writer))
        .map(|h| h.min_id.saturating_sub(1))
        .fold(max_allocated, i64::min)
}

/// The frontier plus every writer whose position is ahead of it. Writers not
/// listed read as the frontier, which is never ahead of the truth.
pub fn current_token(max_allocated: i64, holders: &[Holder], writers: &[i32]) -> Token {
    let minimum = frontier(max_allocated, holders);
    let ahead = writers.iter().filter_map(|&w| {
        let position = writer_position(max_allocated, holders, w);
        (position > minimum).then_some((w, position))
    });
    let mut entries: Vec<(i32, i64)> = ahead.collect();
    entries.sort_unstable();
    entries.dedup_by_key(|e| e.0);
    // Every entry is above the minimum and ids are distinct: valid by
    // construction, so the fallback is unreachable.
    Token::vector(minimum, entries).unwrap_or_else(|_| Token::live(minimum))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(writer: i32, min_id: i64) -> Holder {
        Holder {
            held_by: HeldBy::Writer(writer),
            min_id,
        }
    }

    #[test]
    fn empty_stream_is_at_zero() {
        assert_eq!(frontier(0, &[]), 0);
        assert_eq!(writer_position(0, &[], 1), 0);
    }

    #[test]
    fn out_of_order_commits() {
        // 7 committed, 8..=11 allocated by four transactions of writer 1,
        // committed in the order 9, 8, 11, 10.
        let mut held = vec![w(1, 8), w(1, 9), w(1, 10), w(1, 11)];
        let mut seen = vec![];
        for done in [9, 8, 11, 10] {
            held.retain(|h| h.min_id != done);
            seen.push((frontier(11, &held), writer_position(11, &held, 1)));
        }
        assert_eq!(seen, vec![(7, 7), (9, 9), (9, 9), (11, 11)]);
    }

    #[test]
    fn idle_writer_is_at_max_allocated() {
        let held = [w(1, 5)];
        assert_eq!(frontier(9, &held), 4);
        assert_eq!(writer_position(9, &held, 1), 4);
        assert_eq!(writer_position(9, &held, 2), 9);
        assert_eq!(
            current_token(9, &held, &[1, 2]).to_text(crate::token::TokenKind::Room),
            "m4~2.9"
        );
    }

    #[test]
    fn summary_holds_every_writer() {
        let held = [
            Holder {
                held_by: HeldBy::AllWriters,
                min_id: 3,
            },
            w(2, 7),
        ];
        assert_eq!(writer_position(10, &held, 1), 2);
        assert_eq!(writer_position(10, &held, 2), 2);
        assert_eq!(
            current_token(10, &held, &[1, 2]).to_text(crate::token::TokenKind::Room),
            "s2"
        );
    }

    #[test]
    fn token_lists_only_writers_ahead() {
        let held = [w(1, 4), w(2, 6)];
        let token = current_token(8, &held, &[3, 2, 1, 2]);
        assert_eq!(token.to_text(crate::token::TokenKind::Room), "m3~2.5~3.8");
    }
}
