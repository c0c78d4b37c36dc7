//! The causal partial order of tokens (`is_before_or_eq`) and the total
//! order (`Ord`) that extends it.

use std::cmp::Ordering;

use super::Token;

impl Token {
    /// Causal partial order: every component of `self` is <= `other`'s.
    ///
    /// A live token counts as topological = +infinity, so: (historical a,
    /// live b): `a.stream <= b.stream`; (live a, historical b): false;
    /// (historical, historical): `a.topo <= b.topo && a.stream <= b.stream`;
    /// (live, live): `a.pos(i) <= b.pos(i)` for every instance `i` (which
    /// includes `a.stream <= b.stream`).
    pub fn is_before_or_eq(&self, other: &Token) -> bool {
        match (self.topological, other.topological) {
            (Some(a), Some(b)) => a <= b && self.stream <= other.stream,
            (Some(_), None) => self.stream <= other.stream,
            (None, Some(_)) => false,
            (None, None) => {
                if self.stream > other.stream {
                    return false;
                }
                // Instances listed only in `other` are at most fine: self's
                // position there is self.stream <= other.stream < theirs.
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
    }
}

/// The total order on tokens, which extends [`Token::is_before_or_eq`] and
/// is consistent with `Eq`.
///
/// The key is, lexicographically:
/// 1. the topological part, with live tokens counting as +infinity (so every
///    historical token sorts before every live one);
/// 2. the stream position (the minimum);
/// 3. the sum over listed entries of `pos - stream`, as `i128` (the total
///    "excess" of the writers ahead of the minimum);
/// 4. the instances slice, lexicographically.
///
/// *Proof sketch that it extends the causal order.* Suppose
/// `a.is_before_or_eq(b)`. If `a` is historical and `b` live, `a` sorts
/// first by (1). If both are historical, `a.topo <= b.topo` and
/// `a.stream <= b.stream`, and both have excess 0 and no instances, so
/// `a <= b`. (`a` live and `b` historical never happens.) If both are live,
/// (1) ties and `a.stream <= b.stream`; when the streams are equal, every
/// writer's excess `pos(i) - stream` in `a` is at most that in `b` (unlisted
/// writers have excess 0), so the sum in `a` is at most the sum in `b`, with
/// equality only when every excess is equal, i.e. when `a == b`.
///
/// *Total and consistent with `Eq`:* the key contains every field of the
/// token (3 is a function of 2 and 4), so equal keys mean equal tokens, and
/// lexicographic comparison of totally ordered parts is a total order.
impl Ord for Token {
    fn cmp(&self, other: &Self) -> Ordering {
        let topo = match (self.topological, other.topological) {
            (Some(a), Some(b)) => a.cmp(&b),
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (None, None) => Ordering::Equal,
        };
        topo.then(self.stream.cmp(&other.stream))
            .then_with(|| excess(self).cmp(&excess(other)))
            .then_with(|| self.instances.cmp(&other.instances))
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
