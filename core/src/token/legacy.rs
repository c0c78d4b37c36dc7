//! The room token order and causal order of 0.1.0, kept only so that a
//! database still at 0.1.0 keeps the order its indexes were built in while
//! it runs the new library, until `ALTER EXTENSION streampos UPDATE`
//! switches it (and rebuilds those indexes). Nothing else uses them.
//!
//! 0.1.0 counted a live token as topological +infinity: historical tokens
//! sorted first, by (topological, stream), and a historical token was
//! before-or-equal a live one when its stream was at most the live token's
//! minimum; a live token was never before a historical one.

use std::cmp::Ordering;

use super::Token;

/// 0.1.0's total order.
pub fn cmp(a: &Token, b: &Token) -> Ordering {
    let topological = match (a.topological, b.topological) {
        (Some(x), Some(y)) => x.cmp(&y),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    };
    // Among tokens with the same topological part (live ones, or historical
    // ones with the same value), the key of the live view; for live tokens
    // this is today's order.
    topological.then_with(|| a.stream.cmp(&b.stream).then_with(|| a.live_cmp(b)))
}

/// 0.1.0's causal order.
pub fn is_before_or_eq(a: &Token, b: &Token) -> bool {
    match (a.topological, b.topological) {
        (Some(x), Some(y)) => x <= y && a.stream <= b.stream,
        (Some(_), None) => a.stream <= b.stream,
        (None, Some(_)) => false,
        (None, None) => a.is_before_or_eq(b),
    }
}

impl Token {
    /// The order of live views with equal minimums: total excess, then the
    /// list (parts 2 and 3 of today's order).
    fn live_cmp(&self, other: &Token) -> Ordering {
        let excess = |t: &Token| -> i128 {
            let s = i128::from(t.stream);
            t.instances.iter().map(|&(_, p)| i128::from(p) - s).sum()
        };
        excess(self)
            .cmp(&excess(other))
            .then_with(|| self.instances.cmp(&other.instances))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::TokenKind;

    fn t(text: &str) -> Token {
        Token::parse(TokenKind::Room, text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn historical_tokens_sort_first_by_topological_then_stream() {
        let sorted = ["t1-9", "t2-3", "t2-7", "s1", "m1~2.5", "s2"];
        for (i, a) in sorted.iter().enumerate() {
            for (j, b) in sorted.iter().enumerate() {
                assert_eq!(cmp(&t(a), &t(b)), i.cmp(&j), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn causal_order_counts_live_tokens_as_topological_infinity() {
        assert!(is_before_or_eq(&t("t5-3"), &t("s3")));
        assert!(!is_before_or_eq(&t("s3"), &t("t9-9")));
        assert!(!is_before_or_eq(&t("t6-3"), &t("t5-6")));
        assert!(is_before_or_eq(&t("t5-3"), &t("t6-6")));
        assert!(is_before_or_eq(&t("m1~2.5"), &t("m2~2.5")));
        // Every strictly ordered pair of the causal order is ordered by cmp.
        let all = [
            "t1-9", "t2-3", "t2-7", "s1", "m1~2.5", "s2", "m2~3.4", "t0-0",
        ];
        for a in all {
            for b in all {
                let (x, y) = (t(a), t(b));
                if is_before_or_eq(&x, &y) && !is_before_or_eq(&y, &x) {
                    assert_eq!(cmp(&x, &y), Ordering::Less, "{a} vs {b}");
                }
            }
        }
    }
}
