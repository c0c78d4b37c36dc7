//! The lattice operations: `advance` is the least upper bound of the
//! causal order, `bound` caps positions and never raises one.

mod common;

use common::{arb_room, arb_stream, ids, live_view, v};
use proptest::prelude::*;
use streampos_core::token::{Token, TokenKind, MAX_INSTANCES};
use TokenKind::Room;

#[test]
fn advance_examples() {
    let h = Token::historical;
    let join = |a: Token, b: Token| a.advance(&b).unwrap();
    assert_eq!(join(h(1, 9), h(2, 3)), h(2, 9));
    assert_eq!(join(h(1, 9), Token::live(3)), Token::live(9));
    assert_eq!(join(h(1, 7), v(5, &[(1, 6), (2, 9)])), v(7, &[(2, 9)]));
    assert_eq!(
        join(v(5, &[(1, 8), (2, 6)]), v(6, &[(2, 7), (3, 9)])),
        v(6, &[(1, 8), (2, 7), (3, 9)])
    );
    assert_eq!(join(v(5, &[(1, 8)]), v(8, &[(2, 9)])), v(8, &[(2, 9)]));
    // Tokens before-or-equal each other (one live view s5) join to one of
    // that view: the historical one with the larger topological part.
    assert_eq!(join(h(1, 5), h(2, 5)), h(2, 5));
    assert_eq!(join(h(1, 5), Token::live(5)), Token::live(5));
}

#[test]
fn meet_examples() {
    let h = Token::historical;
    let meet = |a: Token, b: Token| a.meet(&b);
    assert_eq!(
        meet(v(5, &[(1, 8), (2, 6)]), v(6, &[(2, 7), (3, 9)])),
        v(5, &[(1, 6), (2, 6)])
    );
    assert_eq!(meet(v(5, &[(1, 8)]), v(8, &[(2, 9)])), v(5, &[(1, 8)]));
    assert_eq!(meet(v(5, &[(1, 8)]), Token::live(3)), Token::live(3));
    assert_eq!(
        meet(h(9, 7), v(5, &[(1, 8), (2, 6)])),
        v(5, &[(1, 7), (2, 6)])
    );
    assert_eq!(meet(h(9, 7), h(1, 9)), Token::live(7));
    assert_eq!(meet(v(5, &[(1, 8)]), v(5, &[(2, 9)])), Token::live(5));
}

#[test]
fn meet_of_full_tokens_stays_within_the_cap() {
    let full = many(1, MAX_INSTANCES);
    assert_eq!(full.meet(&full), full);
    assert_eq!(
        full.meet(&many(1 + MAX_INSTANCES, MAX_INSTANCES)),
        Token::live(0)
    );
}

#[test]
fn bound_examples() {
    assert_eq!(v(5, &[(1, 8), (2, 12)]).bound(10), v(5, &[(1, 8), (2, 10)]));
    assert_eq!(v(5, &[(1, 8), (2, 12)]).bound(4), Token::live(4));
    assert_eq!(v(5, &[(1, 8), (2, 12)]).bound(5), Token::live(5));
    assert_eq!(
        v(5, &[(1, 8), (2, 12)]).bound(100),
        v(5, &[(1, 8), (2, 12)])
    );
    assert_eq!(Token::historical(3, 9).bound(4), Token::historical(3, 4));
    assert_eq!(Token::historical(3, 9).bound(10), Token::historical(3, 9));
}

/// Minimum 0 and `count` instances from `first` on, each at position 5.
fn many(first: usize, count: usize) -> Token {
    Token::vector(0, (first..first + count).map(|i| (i as i32, 5))).unwrap()
}

#[test]
fn advance_refuses_a_join_longer_than_the_cap() {
    let half = MAX_INSTANCES / 2;
    let full = many(1, half).advance(&many(1 + half, half)).unwrap();
    assert_eq!(full, many(1, MAX_INSTANCES));
    let one_more = many(1 + MAX_INSTANCES, 1);
    for e in [
        full.advance(&one_more).unwrap_err(),
        one_more.advance(&full).unwrap_err(),
        many(1, MAX_INSTANCES)
            .advance(&many(1 + MAX_INSTANCES, MAX_INSTANCES))
            .unwrap_err(),
    ] {
        assert_eq!(e.sqlstate(), "54000", "{e:?}");
        assert!(e.detail().contains("at most 10000"), "{e:?}");
    }
    assert!(full
        .advance(&one_more)
        .unwrap_err()
        .detail()
        .contains("lists 10001 instance positions"));
    // What the join lists counts, not what its arguments do: shared
    // instances once, and entries the new minimum covers not at all.
    assert_eq!(full.advance(&full).unwrap(), full);
    let above = Token::vector(5, [(1 + MAX_INSTANCES as i32, 6)]).unwrap();
    assert_eq!(full.advance(&above).unwrap(), above);
    assert_eq!(
        Token::historical(9, 0).advance(&full).unwrap(),
        full,
        "a historical token at the minimum leaves the vector as it is"
    );
}

#[test]
fn folding_advance_stops_at_the_cap() {
    // The SQL aggregate folds with advance: disjoint parts of 1000 entries
    // reach the cap after 10 and fail on the 11th.
    let mut acc = Token::live(0);
    let mut failed_at = None;
    for k in 0..12 {
        match acc.advance(&many(1 + k * 1000, 1000)) {
            Ok(j) => acc = j,
            Err(e) => {
                assert_eq!(e.sqlstate(), "54000", "{e:?}");
                failed_at.get_or_insert(k);
            }
        }
    }
    assert_eq!(failed_at, Some(10));
    assert_eq!(acc.instances().len(), MAX_INSTANCES);
    // Every value the fold kept is still readable from text.
    assert_eq!(
        Token::parse(TokenKind::MultiWriter, &acc.to_text(TokenKind::MultiWriter)).unwrap(),
        acc
    );
}

/// An upper bound of `a` and `b` built without `advance`, raised by bumps.
fn some_upper_bound(a: &Token, b: &Token, bumps: &[u8], hist: bool) -> Token {
    let bump = |k: usize| i64::from(bumps.get(k).copied().unwrap_or(0) % 4);
    let s = a.stream().max(b.stream()).saturating_add(bump(0));
    if hist {
        if let (Some(x), Some(y)) = (a.topological(), b.topological()) {
            return Token::historical(x.max(y).saturating_add(bump(1)), s);
        }
    }
    let lp = |t: &Token, i| {
        if t.is_historical() {
            t.stream()
        } else {
            t.instance_pos(i)
        }
    };
    let entries: Vec<(i32, i64)> = ids(&[a, b])
        .into_iter()
        .enumerate()
        .map(|(k, i)| (i, lp(a, i).max(lp(b, i)).max(s).saturating_add(bump(k + 2))))
        .filter(|&(_, p)| p > s)
        .collect();
    Token::vector(s, entries).unwrap()
}

proptest! {
    #![proptest_config(common::config())]

    #[test]
    fn advance_is_least_upper_bound(
        a in arb_room(), b in arb_room(), c in arb_room(),
        bumps in prop::collection::vec(any::<u8>(), 0..16), hist in any::<bool>(),
    ) {
        // Small tokens (common::arb_room): never near the cap.
        let join = |x: &Token, y: &Token| x.advance(y).unwrap();
        let j = join(&a, &b);
        // Commutative, idempotent, associative.
        prop_assert_eq!(&j, &join(&b, &a));
        prop_assert_eq!(&join(&a, &a), &a);
        prop_assert_eq!(join(&j, &c), join(&a, &join(&b, &c)));
        // An upper bound.
        prop_assert!(a.is_before_or_eq(&j));
        prop_assert!(b.is_before_or_eq(&j));
        // The least one: against a random c, and a constructed upper bound.
        if a.is_before_or_eq(&c) && b.is_before_or_eq(&c) {
            prop_assert!(j.is_before_or_eq(&c));
        }
        let u = some_upper_bound(&a, &b, &bumps, hist);
        prop_assert!(a.is_before_or_eq(&u) && b.is_before_or_eq(&u), "{:?}", u);
        prop_assert!(j.is_before_or_eq(&u));
        // Componentwise for live results.
        if !j.is_historical() {
            for i in ids(&[&a, &b]) {
                let p = |t: &Token| if t.is_historical() { t.stream() } else { t.instance_pos(i) };
                prop_assert_eq!(j.instance_pos(i), p(&a).max(p(&b)));
            }
        }
        // a ≼ b exactly when the join has b's live view; the join is b
        // itself when b is live.
        prop_assert_eq!(a.is_before_or_eq(&b), live_view(&j) == live_view(&b));
        if a.is_before_or_eq(&b) && !b.is_historical() {
            prop_assert_eq!(&j, &b);
        }
    }

    #[test]
    fn meet_is_greatest_lower_bound(a in arb_room(), b in arb_room(), c in arb_room()) {
        let m = a.meet(&b);
        prop_assert!(!m.is_historical());
        // Commutative, idempotent on live views, associative.
        prop_assert_eq!(&m, &b.meet(&a));
        prop_assert_eq!(&a.meet(&a), &live_view(&a));
        prop_assert_eq!(m.meet(&c), a.meet(&b.meet(&c)));
        // A lower bound, and the greatest one.
        prop_assert!(m.is_before_or_eq(&a));
        prop_assert!(m.is_before_or_eq(&b));
        if c.is_before_or_eq(&a) && c.is_before_or_eq(&b) {
            prop_assert!(c.is_before_or_eq(&m));
        }
        for i in ids(&[&a, &b]) {
            let p = |t: &Token| if t.is_historical() { t.stream() } else { t.instance_pos(i) };
            prop_assert_eq!(m.instance_pos(i), p(&a).min(p(&b)));
        }
        // Still a valid token.
        prop_assert_eq!(Token::parse(TokenKind::MultiWriter, &m.to_text(TokenKind::MultiWriter)).unwrap(), m.clone());
    }

    #[test]
    fn bound_never_raises(t in arb_room(), m in arb_stream()) {
        let bt = t.bound(m);
        prop_assert_eq!(bt.topological(), t.topological());
        prop_assert_eq!(bt.stream(), t.stream().min(m));
        for i in ids(&[&t, &bt]) {
            prop_assert!(bt.instance_pos(i) <= t.instance_pos(i));
            prop_assert!(bt.instance_pos(i) <= m.max(bt.stream()));
            prop_assert_eq!(bt.instance_pos(i), t.instance_pos(i).min(m));
        }
        prop_assert!(bt.is_before_or_eq(&t));
        prop_assert!(bt.max_stream_pos() <= t.max_stream_pos());
        // Still a valid token: it round-trips through text and storage.
        prop_assert_eq!(Token::parse(Room, &bt.to_text(Room)).unwrap(), bt.clone());
        let mut b = Vec::new();
        bt.encode(&mut b);
        prop_assert_eq!(Token::decode(Room, &b).unwrap(), bt);
    }
}
