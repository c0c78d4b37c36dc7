//! The causal order of tokens (`is_before_or_eq`, Synapse's) and the total
//! order (`Ord`) that extends it.
//!
//! # The causal order is Synapse's, and only a preorder
//!
//! Synapse's `AbstractMultiWriterStreamToken.is_before_or_eq` compares the
//! `stream` parts and the instance maps, and nothing else: a historical
//! room token's topological part is ignored (`t6-3` is before-or-equal
//! `t5-6`, and `t1-5`, `t9-5` and `s5` are each before-or-equal the others).
//! So every token `a` has a *live view* `L(a)`: `a` itself when live, `s{stream}`
//! when historical, and
//!
//! > `a ≼ b` ⇔ `L(a) ≤ L(b)` writer by writer (the position of writer `i` is
//! > its listed position, else `stream`; every writer counts, so the minimums
//! > compare too).
//!
//! Writer-by-writer `≤` on live tokens is a partial order: two live tokens
//! with the same position for every writer have the same minimum (a listed
//! position is above the minimum, and some writer is unlisted in both) and
//! the same list, so they are equal. On all tokens `≼` is a *preorder*
//! (reflexive, transitive), not antisymmetric: `a ≼ b ≼ a` exactly when
//! `L(a) = L(b)`, which for distinct tokens means `s{n}` and historical
//! tokens `t{x}-{n}` with the same `n`.

use std::cmp::Ordering;

use super::Token;

impl Token {
    /// Synapse's `is_before_or_eq`: every writer's position in `self` is at
    /// most its position in `other`, a historical token counting as its live
    /// view `s{stream}` (the topological part is ignored, see the module
    /// docs). A preorder: distinct tokens can be before-or-equal each other.
    pub fn is_before_or_eq(&self, other: &Token) -> bool {
        if self.stream > other.stream {
            return false;
        }
        // Historical tokens list no instances, so this is their live view.
        // Instances listed only in `other` are fine: self's position there is
        // self.stream <= other.stream < theirs.
        let mut rest = other.instances.as_slice();
        for &(id, pos) in &self.instances {
            while let Some((&(oid, _), tail)) = rest.split_first() {
                if oid < id {
                    rest = tail;
                } else {
                    break;
                }
            }
            let theirs = match rest.first() {
                Some(&(oid, opos)) if oid == id => opos,
                _ => other.stream,
            };
            if pos > theirs {
                return false;
            }
        }
        true
    }
}

/// The total order on tokens: a linear extension of Synapse's
/// [`Token::is_before_or_eq`], consistent with `Eq`.
///
/// The key is, lexicographically:
/// 1. the stream position (the minimum);
/// 2. the sum over listed entries of `pos - stream`, as `i128` (the total
///    "excess" of the writers ahead of the minimum);
/// 3. the instances slice, lexicographically;
/// 4. the topological part, a live token counting as +infinity (so among
///    the tokens with the live view `s{n}`: `t{x}-{n}` by `x`, then `s{n}`).
///
/// Parts 1–3 are the key of the live view `L(a)` (a historical token has
/// excess 0 and no instances, as `s{stream}` has).
///
/// *It extends the causal order strictly:* if `a ≼ b` and not `b ≼ a`, then
/// `L(a) ≤ L(b)` writer by writer and `L(a) ≠ L(b)`. Either
/// `L(a).stream < L(b).stream`, and part 1 decides `a < b`; or the minimums
/// are equal, and then every writer's excess `pos(i) - stream` in `L(a)` is at
/// most that in `L(b)` (unlisted writers have excess 0), and not all are
/// equal (else `L(a) = L(b)`), so the sum in part 2 is strictly smaller:
/// `a < b`. (Tokens with `a ≼ b ≼ a` share parts 1–3 and are ordered by part 4,
/// which is arbitrary but fixed.)
///
/// *Total and consistent with `Eq`:* the key determines the token — parts
/// 1–3 give the live view; part 4 says whether the token is that live view
/// (+infinity) or the historical token `t{x}-{stream}` — so equal keys mean
/// equal tokens; lexicographic comparison of totally ordered parts is a
/// total order.
///
/// For live tokens (every multi-writer token) this is the order of 0.1.0;
/// only historical tokens moved (0.1.0 sorted them first, by (topological,
/// stream)).
impl Ord for Token {
    fn cmp(&self, other: &Self) -> Ordering {
        self.stream
            .cmp(&other.stream)
            .then_with(|| excess(self).cmp(&excess(other)))
            .then_with(|| self.instances.cmp(&other.instances))
            .then_with(|| match (self.topological, other.topological) {
                (Some(a), Some(b)) => a.cmp(&b),
                (Some(_), None) => Ordering::Less,
                (None, Some(_)) => Ordering::Greater,
                (None, None) => Ordering::Equal,
            })
    }
}

impl PartialOrd for Token {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Sum over listed entries of `pos - stream`.
fn excess(t: &Token) -> i128 {
    let s = i128::from(t.stream);
    t.instances.iter().map(|&(_, p)| i128::from(p) - s).sum()
}
