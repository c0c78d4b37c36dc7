//! The causal order (`is_before_or_eq`) against an independent model, and
//! the total order (`Ord`): a linear extension, total, consistent with `Eq`.

mod common;

use std::cmp::Ordering;

use common::{arb_room, model_le, v};
use proptest::prelude::*;
use streampos_core::token::Token;

#[test]
fn causal_order_examples() {
    let h = Token::historical;
    assert!(h(1, 5).is_before_or_eq(&h(1, 5)));
    assert!(h(1, 5).is_before_or_eq(&h(2, 5)));
    assert!(!h(2, 5).is_before_or_eq(&h(1, 9)));
    assert!(!h(1, 6).is_before_or_eq(&h(2, 5)));
    assert!(h(9, 5).is_before_or_eq(&Token::live(5)));
    assert!(!h(9, 6).is_before_or_eq(&Token::live(5)));
    assert!(!Token::live(1).is_before_or_eq(&h(9, 9)));
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
    assert!(h(1, 9) < h(2, 0));
    assert!(h(1, 1) < h(1, 2));
    assert!(h(i64::MAX, i64::MAX) < Token::live(i64::MIN));
    assert!(Token::live(5) < v(5, &[(1, 6)]));
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
        // Linear extension.
        if a.is_before_or_eq(&b) {
            prop_assert!(a <= b);
        }
        // Antisymmetry of the causal order.
        if a.is_before_or_eq(&b) && b.is_before_or_eq(&a) {
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
        // Historical tokens order by (topological, stream).
        if let (Some(x), Some(y)) = (a.topological(), b.topological()) {
            prop_assert_eq!(a.cmp(&b), (x, a.stream()).cmp(&(y, b.stream())));
        }
    }

    #[test]
    fn total_order_on_near_tokens(
        s in -3i64..3,
        x in prop::collection::vec((0i32..3, 1i64..3), 0..3),
        y in prop::collection::vec((0i32..3, 1i64..3), 0..3),
        ds in -1i64..2,
    ) {
        // Dense small tokens make causal comparability frequent.
        let mk = |s: i64, e: &[(i32, i64)]| {
            let m: std::collections::BTreeMap<i32, i64> =
                e.iter().map(|&(i, d)| (i, s + d)).collect();
            Token::vector(s, m).unwrap()
        };
        let a = mk(s, &x);
        let b = mk(s + ds, &y);
        if a.is_before_or_eq(&b) {
            prop_assert!(a <= b);
        }
        prop_assert_eq!(a.is_before_or_eq(&b), model_le(&a, &b));
        let j = a.advance(&b);
        prop_assert!(a.is_before_or_eq(&j) && b.is_before_or_eq(&j));
    }
}
