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

/// A stream's positions for one snapshot, resolved from what holds it back:
/// what every reading function answers from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Positions {
    /// The highest allocated ID when the positions were computed.
    pub max_allocated: i64,
    /// The position of a writer with nothing of its own in flight: the
    /// maximum allocated ID, or lower while something holds back every
    /// writer.
    pub default: i64,
    /// Writers with allocations of their own in flight, ascending by id,
    /// each with its position (at most `default`); or, for positions that
    /// were stored (`Positions::stored`), every stored writer with its
    /// position (at least `default`, the stored frontier).
    pub held: Vec<(i32, i64)>,
}

impl Positions {
    /// Resolve the holders of a stream whose highest allocated ID is
    /// `max_allocated`.
    pub fn resolve(max_allocated: i64, holders: &[Holder]) -> Positions {
        let default = holders
            .iter()
            .filter(|h| h.held_by == HeldBy::AllWriters)
            .map(|h| h.min_id.saturating_sub(1))
            .fold(max_allocated, i64::min);
        let mut held: Vec<(i32, i64)> = holders
            .iter()
            .filter_map(|h| match h.held_by {
                HeldBy::Writer(w) => Some((w, h.min_id.saturating_sub(1).min(default))),
                HeldBy::AllWriters => None,
            })
            .collect();
        // Lowest position first within a writer, so dedup keeps it.
        held.sort_unstable();
        held.dedup_by_key(|e| e.0);
        Positions {
            max_allocated,
            default,
            held,
        }
    }

    /// Positions that were stored together: a frontier and writers'
    /// positions (none below the frontier: all were true for one
    /// snapshot). A writer not listed reads as the frontier, which is never
    /// ahead of the truth.
    pub fn stored(frontier: i64, writers: &[(i32, i64)]) -> Positions {
        let mut held: Vec<(i32, i64)> =
            writers.iter().map(|&(w, p)| (w, p.max(frontier))).collect();
        // Highest first within a writer, so dedup keeps it.
        held.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        held.dedup_by_key(|e| e.0);
        Positions {
            max_allocated: held.iter().map(|e| e.1).fold(frontier, i64::max),
            default: frontier,
            held,
        }
    }

    /// The largest F such that every ID <= F is finished.
    pub fn frontier(&self) -> i64 {
        self.held.iter().map(|e| e.1).fold(self.default, i64::min)
    }

    /// The largest p such that every ID <= p allocated to `writer` is
    /// finished.
    pub fn writer_position(&self, writer: i32) -> i64 {
        match self.held.binary_search_by_key(&writer, |e| e.0) {
            Ok(k) => self.held.get(k).map_or(self.default, |e| e.1),
            Err(_) => self.default,
        }
    }

    /// The writers with allocations of their own in flight.
    pub fn held_writers(&self) -> impl Iterator<Item = i32> + '_ {
        self.held.iter().map(|e| e.0)
    }

    /// The frontier plus every writer of `writers` whose position is ahead
    /// of it. Writers not listed read as the frontier, which is never ahead
    /// of the truth.
    pub fn token(&self, writers: &[i32]) -> Token {
        let minimum = self.frontier();
        let mut entries: Vec<(i32, i64)> = writers
            .iter()
            .map(|&w| (w, self.writer_position(w)))
            .filter(|&(_, position)| position > minimum)
            .collect();
        entries.sort_unstable();
        entries.dedup_by_key(|e| e.0);
        // Every entry is above the minimum and ids are distinct: valid by
        // construction, so the fallback is unreachable.
        Token::vector(minimum, entries).unwrap_or_else(|_| Token::live(minimum))
    }

    /// Positions at least as far as both `self` and `other`, for the same
    /// snapshot: every answer either gave was true for it, so the larger one
    /// is too. (Used to keep answers for one snapshot from ever going back.)
    pub fn join(&self, other: &Positions) -> Positions {
        let default = self.default.max(other.default);
        let mut writers: Vec<i32> = self.held_writers().chain(other.held_writers()).collect();
        writers.sort_unstable();
        writers.dedup();
        let held = writers
            .into_iter()
            .map(|w| {
                let position = self.writer_position(w).max(other.writer_position(w));
                (w, position.min(default))
            })
            .collect();
        Positions {
            max_allocated: self.max_allocated.max(other.max_allocated),
            default,
            held,
        }
    }
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

    #[test]
    fn positions_agree_with_the_holder_functions() {
        let held = [
            w(1, 4),
            w(2, 6),
            w(1, 9),
            Holder {
                held_by: HeldBy::AllWriters,
                min_id: 8,
            },
        ];
        let p = Positions::resolve(10, &held);
        assert_eq!(p.frontier(), frontier(10, &held));
        for writer in 0..4 {
            assert_eq!(
                p.writer_position(writer),
                writer_position(10, &held, writer)
            );
        }
        assert_eq!(p.token(&[1, 2, 3]), current_token(10, &held, &[1, 2, 3]));
    }

    #[test]
    fn stored_positions_are_never_below_the_stored_frontier() {
        let p = Positions::stored(5, &[(2, 9), (1, 3), (2, 7), (4, 5)]);
        assert_eq!(p.frontier(), 5);
        assert_eq!(p.writer_position(1), 5);
        assert_eq!(p.writer_position(2), 9);
        assert_eq!(p.writer_position(3), 5);
        assert_eq!(p.max_allocated, 9);
        assert_eq!(
            p.token(&[1, 2, 3, 4])
                .to_text(crate::token::TokenKind::Room),
            "m5~2.9"
        );
        assert_eq!(Positions::stored(0, &[]).frontier(), 0);
    }

    #[test]
    fn join_takes_the_larger_answer_of_each_writer() {
        let a = Positions::resolve(10, &[w(1, 4), w(2, 9)]);
        let b = Positions::resolve(
            12,
            &[
                w(1, 6),
                Holder {
                    held_by: HeldBy::AllWriters,
                    min_id: 3,
                },
            ],
        );
        let j = a.join(&b);
        for writer in 0..4 {
            assert_eq!(
                j.writer_position(writer),
                a.writer_position(writer).max(b.writer_position(writer)),
                "writer {writer}"
            );
        }
        assert!(j.frontier() >= a.frontier().max(b.frontier()));
        assert_eq!(j.join(&j), j);
    }
}
