//! The causal order (`is_before_or_eq`) against an independent model, and
//! the total order (`Ord`): a linear extension, total, consistent with `Eq`.

mod common;

use std::cmp::Ordering;

use common::{arb_room, live_view, model_le, v};
use proptest::prelude::*;
use streampos_core::token::Token;

#[test]
fn causal_order_examples() {
    let h = Token::historical;
    // Synapse's: the topological part is ignored.
    assert!(h(1, 5).is_before_or_eq(&h(1, 5)));
    assert!(h(1, 5).is_before_or_eq(&h(2, 5)));
    assert!(h(2, 5).is_before_or_eq(&h(1, 5)));
    assert!(h(6, 3).is_before_or_eq(&h(5, 6)));
    assert!(!h(5, 6).is_before_or_eq(&h(6, 3)));
    assert!(h(2, 5).is_before_or_eq(&h(1, 9)));
    assert!(!h(1, 6).is_before_or_eq(&h(2, 5)));
    assert!(h(9, 5).is_before_or_eq(&Token::live(5)));
    assert!(Token::live(5).is_before_or_eq(&h(9, 5)));
    assert!(!h(9, 6).is_before_or_eq(&Token::live(5)));
    assert!(Token::live(2).is_before_or_eq(&h(0, 2)));
    assert!(Token::live(1).is_before_or_eq(&h(9, 9)));
    assert!(!Token::live(10).is_before_or_eq(&h(9, 9)));
    // A live token is before a historical one when all its writers are.
    assert!(v(5, &[(2, 8)]).is_before_or_eq(&h(0, 8)));
    assert!(!v(5, &[(2, 8)]).is_before_or_eq(&h(0, 7)));
    assert!(h(0, 5).is_before_or_eq(&v(5, &[(2, 8)])));
    assert!(!h(0, 6).is_before_or_eq(&v(5, &[(2, 8)])));
    // Live tokens: writer by writer.
    assert!(v(5, &[(2, 8)]).is_before_or_eq(&v(5, &[(2, 8), (3, 6)])));
    assert!(!v(5, &[(2, 8)]).is_before_or_eq(&v(6, &[(3, 9)])));
    assert!(v(5, &[(2, 8)]).is_before_or_eq(&v(8, &[(3, 9)])));
    assert!(!v(5, &[(2, 8)]).is_before_or_eq(&v(4, &[(2, 9)])));
    assert!(v(5, &[(1, 6), (2, 8)]).is_before_or_eq(&v(5, &[(1, 6), (2, 9)])));
    assert!(!v(5, &[(1, 7), (2, 8)]).is_before_or_eq(&v(5, &[(1, 6), (2, 9)])));
}

#[test]
fn total_order_examples() {
    let h = Token::historical;
    // The stream part first, the topological part last.
    assert!(h(2, 0) < h(1, 9));
    assert!(h(1, 1) < h(1, 2));
    assert!(h(6, 3) < h(5, 6));
    assert!(Token::live(i64::MIN) < h(i64::MIN, i64::MIN + 1));
    // Same live view s5: historical by topological part, then s5.
    assert!(h(1, 5) < h(2, 5));
    assert!(h(i64::MAX, 5) < Token::live(5));
    assert!(Token::live(5) < v(5, &[(1, 6)]));
    assert!(h(0, 5) < v(5, &[(1, 6)]));
    assert!(v(5, &[(1, 100)]) < h(i64::MIN, 6));
    assert!(v(5, &[(1, 6)]) < v(5, &[(9, 7)]));
    // Equal excess: the instances slices decide.
    assert!(v(5, &[(1, 7)]) < v(5, &[(9, 6), (10, 6)]));
    assert!(v(5, &[(1, 7)]) < v(5, &[(9, 7)]));
    assert!(v(5, &[(2, 6), (3, 9)]) > v(5, &[(2, 6)]));
    assert!(v(5, &[(1, 100)]) < Token::live(6));
    // Extreme excess does not overflow.
    let big = v(i64::MIN, &[(1, i64::MAX), (2, i64::MAX), (3, i64::MAX)]);
    assert!(v(i64::MIN, &[(1, i64::MAX)]) < big);
}

proptest! {
    #![proptest_config(common::config())]

    #[test]
    fn causal_order_matches_model(a in arb_room(), b in arb_room()) {
        prop_assert_eq!(a.is_before_or_eq(&b), model_le(&a, &b));
        prop_assert!(a.is_before_or_eq(&a));
    }

    #[test]
    fn total_order_extends_causal_order(a in arb_room(), b in arb_room(), c in arb_room()) {
        // A linear extension of the preorder: strictly before means less.
        let (ab, ba) = (a.is_before_or_eq(&b), b.is_before_or_eq(&a));
        if ab && !ba {
            prop_assert!(a < b);
        }
        // Tokens before-or-equal each other have one live view, which
        // decides the causal order for them.
        prop_assert_eq!(ab && ba, live_view(&a) == live_view(&b));
        if ab && ba {
            prop_assert_eq!(a.is_before_or_eq(&c), b.is_before_or_eq(&c));
            prop_assert_eq!(c.is_before_or_eq(&a), c.is_before_or_eq(&b));
        }
        // On live tokens the causal order is antisymmetric.
        if ab && ba && !a.is_historical() && !b.is_historical() {
            prop_assert_eq!(&a, &b);
        }
        // Totality, consistency with Eq, antisymmetry of the total order.
        prop_assert_eq!(a.cmp(&b) == Ordering::Equal, a == b);
        prop_assert_eq!(a.cmp(&b), b.cmp(&a).reverse());
        prop_assert_eq!(a.partial_cmp(&b), Some(a.cmp(&b)));
        // Transitivity of both orders.
        if a <= b && b <= c {
            prop_assert!(a <= c);
        }
        if a.is_before_or_eq(&b) && b.is_before_or_eq(&c) {
            prop_assert!(a.is_before_or_eq(&c));
        }
        // The key: the live view's (stream, excess, instances), then the
        // topological part with live tokens last.
        let key = |t: &Token| {
            let excess: i128 = t
                .instances()
                .iter()
                .map(|&(_, p)| i128::from(p) - i128::from(t.stream()))
                .sum();
            (
                t.stream(),
                excess,
                t.instances().to_vec(),
                t.topological().map_or((1, 0), |x| (0, x)),
            )
        };
        prop_assert_eq!(a.cmp(&b), key(&a).cmp(&key(&b)));
    }

    #[test]
    fn total_order_on_near_tokens(
        s in -3i64..3,
        x in prop::collection::vec((0i32..3, 1i64..3), 0..3),
        y in prop::collection::vec((0i32..3, 1i64..3), 0..3),
        ds in -1i64..2,
        ta in prop::option::of(-1i64..2),
        tb in prop::option::of(-1i64..2),
    ) {
        // Dense small tokens make causal comparability frequent.
        let mk = |s: i64, e: &[(i32, i64)]| {
            let m: std::collections::BTreeMap<i32, i64> =
                e.iter().map(|&(i, d)| (i, s + d)).collect();
            Token::vector(s, m).unwrap()
        };
        // Sometimes historical, with topological parts that often tie.
        let a = ta.map_or_else(|| mk(s, &x), |t| Token::historical(t, s));
        let b = tb.map_or_else(|| mk(s + ds, &y), |t| Token::historical(t, s + ds));
        if a.is_before_or_eq(&b) && !b.is_before_or_eq(&a) {
            prop_assert!(a < b);
        }
        prop_assert_eq!(a.is_before_or_eq(&b), model_le(&a, &b));
        let j = a.advance(&b).unwrap();
        prop_assert!(a.is_before_or_eq(&j) && b.is_before_or_eq(&j));
    }
}
