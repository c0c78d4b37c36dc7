//! The lattice operations: `advance` (least upper bound), `meet`
//! (greatest lower bound of live views) and `bound`.
//!
//! The causal order is a preorder (see `order.rs`): a least upper bound is
//! unique only up to tokens with the same live view. `advance` picks one
//! that is the same whatever the order of its arguments.

use std::cmp::Ordering;

use super::{Token, TokenError, MAX_INSTANCES};

impl Token {
    /// A least upper bound in the [`Token::is_before_or_eq`] preorder
    /// (Synapse's `copy_and_advance`, extended to historical tokens, which
    /// Synapse refuses).
    ///
    /// live ∨ live = componentwise maximum (entries not above the new
    /// minimum dropped); historical ∨ historical = `t{max topo}-{max stream}`
    /// (its live view `s{max stream}` is the join of the two live views);
    /// historical ∨ live = the live token with every component raised to at
    /// least the historical token's stream. Commutative, associative,
    /// idempotent; `a ≼ b` exactly when `advance(a, b)` has `b`'s live view.
    ///
    /// A join that would list more than [`MAX_INSTANCES`] positions is
    /// [`TokenError::TooLarge`] (54000), like any other way to build one:
    /// every token can be read back from its text and wire forms. Folding
    /// many tokens (the SQL aggregate) stops at the first such step.
    pub fn advance(&self, other: &Token) -> Result<Token, TokenError> {
        match (self.topological, other.topological) {
            (Some(a), Some(b)) => Ok(Token::historical(a.max(b), self.stream.max(other.stream))),
            _ => join_live(self.stream, &self.instances, other.stream, &other.instances),
        }
    }

    /// The greatest lower bound of the two live views: every writer's
    /// position is the lower of its two positions (a historical token counts
    /// as `s{stream}`), entries not above the new minimum dropped. What every
    /// one of several consumers has acknowledged (`safe_to_delete`).
    /// Commutative, associative, idempotent; the answer is live and lists
    /// only writers the token with the lower minimum lists, so it is never
    /// longer than the longer argument and cannot fail.
    pub fn meet(&self, other: &Token) -> Token {
        let stream = self.stream.min(other.stream);
        let instances = ids_of_both(&self.instances, &other.instances)
            .filter_map(|id| {
                let pos = self.live_pos(id).min(other.live_pos(id));
                (pos > stream).then_some((id, pos))
            })
            .collect();
        Token {
            topological: None,
            stream,
            instances,
        }
    }

    /// A writer's position in the live view (a historical token lists none).
    fn live_pos(&self, id: i32) -> i64 {
        if self.is_historical() {
            self.stream
        } else {
            self.instance_pos(id)
        }
    }

    /// Synapse's `bound_stream_token`: every component capped at
    /// `max_stream`; entries that fall to the minimum are dropped; the
    /// topological part is kept (Synapse refuses historical tokens). Never
    /// raises a component.
    pub fn bound(&self, max_stream: i64) -> Token {
        let stream = self.stream.min(max_stream);
        let instances = self
            .instances
            .iter()
            .filter_map(|&(id, pos)| {
                let p = pos.min(max_stream);
                (p > stream).then_some((id, p))
            })
            .collect();
        Token {
            topological: self.topological,
            stream,
            instances,
        }
    }
}

/// The join of two live views (stream, sorted distinct entries all above
/// stream): componentwise maximum, entries not above the new stream dropped;
/// more than [`MAX_INSTANCES`] of them is an error.
fn join_live(s1: i64, a: &[(i32, i64)], s2: i64, b: &[(i32, i64)]) -> Result<Token, TokenError> {
    let stream = s1.max(s2);
    // At most twice the cap, as both inputs are tokens.
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut a, mut b) = (a, b);
    loop {
        let (id, pos) = match (a.split_first(), b.split_first()) {
            (None, None) => break,
            (Some((&(ia, pa), ta)), None) => {
                a = ta;
                (ia, pa.max(s2))
            }
            (None, Some((&(ib, pb), tb))) => {
                b = tb;
                (ib, pb.max(s1))
            }
            (Some((&(ia, pa), ta)), Some((&(ib, pb), tb))) => match ia.cmp(&ib) {
                Ordering::Less => {
                    a = ta;
                    (ia, pa.max(s2))
                }
                Ordering::Greater => {
                    b = tb;
                    (ib, pb.max(s1))
                }
                Ordering::Equal => {
                    a = ta;
                    b = tb;
                    (ia, pa.max(pb))
                }
            },
        };
        if pos > stream {
            out.push((id, pos));
        }
    }
    if out.len() > MAX_INSTANCES {
        return Err(TokenError::TooLarge {
            type_name: "token",
            detail: format!(
                "The least upper bound of the two tokens lists {} instance positions; at most {MAX_INSTANCES} are allowed.",
                out.len()
            ),
        });
    }
    Ok(Token {
        topological: None,
        stream,
        instances: out,
    })
}

/// The instance IDs listed in either sorted list, ascending, each once.
fn ids_of_both<'a>(a: &'a [(i32, i64)], b: &'a [(i32, i64)]) -> impl Iterator<Item = i32> + 'a {
    let (mut a, mut b) = (a, b);
    std::iter::from_fn(move || match (a.split_first(), b.split_first()) {
        (None, None) => None,
        (Some((&(ia, _), ta)), None) => {
            a = ta;
            Some(ia)
        }
        (None, Some((&(ib, _), tb))) => {
            b = tb;
            Some(ib)
        }
        (Some((&(ia, _), ta)), Some((&(ib, _), tb))) => match ia.cmp(&ib) {
            Ordering::Less => {
                a = ta;
                Some(ia)
            }
            Ordering::Greater => {
                b = tb;
                Some(ib)
            }
            Ordering::Equal => {
                a = ta;
                b = tb;
                Some(ia)
            }
        },
    })
}
