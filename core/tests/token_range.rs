//! Writer positions and the range tests on them: `instance_pos`,
//! `persisted_after`, `in_range` and `in_range_room`.

mod common;

use common::{arb_live, v};
use proptest::prelude::*;
use streampos_core::token::{in_range, in_range_room, Token};

#[test]
fn accessors_and_positions() {
    let t = v(5, &[(3, 9), (1, 7)]);
    assert_eq!(t.instances(), &[(1, 7), (3, 9)]);
    assert_eq!(t.instance_pos(1), 7);
    assert_eq!(t.instance_pos(2), 5);
    assert_eq!(t.instance_pos(3), 9);
    assert_eq!(t.max_stream_pos(), 9);
    assert_eq!(Token::live(4).max_stream_pos(), 4);
    assert!(t.persisted_after(1, 8));
    assert!(!t.persisted_after(1, 7));
    assert!(t.persisted_after(2, 6));
    assert!(!t.persisted_after(2, 5));
    assert_eq!(Token::vector(5, []).unwrap(), Token::live(5));
}

#[test]
fn in_range_examples() {
    let low = v(5, &[(1, 8)]);
    let high = v(10, &[(2, 12)]);
    // Writer 1: 8 < id <= 10.
    assert!(!in_range(Some(&low), Some(&high), Some(1), 8));
    assert!(in_range(Some(&low), Some(&high), Some(1), 9));
    assert!(in_range(Some(&low), Some(&high), Some(1), 10));
    assert!(!in_range(Some(&low), Some(&high), Some(1), 11));
    // Writer 2: 5 < id <= 12.
    assert!(in_range(Some(&low), Some(&high), Some(2), 6));
    assert!(in_range(Some(&low), Some(&high), Some(2), 12));
    assert!(!in_range(Some(&low), Some(&high), Some(2), 13));
    // No instance: 5 < id <= 10.
    assert!(!in_range(Some(&low), Some(&high), None, 5));
    assert!(in_range(Some(&low), Some(&high), None, 6));
    assert!(!in_range(Some(&low), Some(&high), None, 11));
    // A historical bound counts as its live view s{stream}.
    let hist = Token::historical(99, 5);
    assert!(!in_range(Some(&hist), None, Some(2), 5));
    assert!(in_range(Some(&hist), None, Some(2), 6));
    assert!(in_range(None, Some(&hist), None, 5));
    assert!(!in_range(None, Some(&hist), None, 6));
    // Unbounded.
    assert!(in_range(None, None, None, i64::MIN));
    assert!(in_range(None, Some(&high), Some(2), i64::MIN));
    assert!(in_range(Some(&low), None, Some(2), i64::MAX));
}

#[test]
fn in_range_room_examples() {
    let h = Token::historical;
    // Historical bounds compare tuples: (3, 10) < event <= (5, 20).
    let (lo, hi) = (h(3, 10), h(5, 20));
    assert!(!in_range_room(Some(&lo), Some(&hi), Some(1), 3, 10));
    assert!(in_range_room(Some(&lo), Some(&hi), Some(1), 3, 11));
    assert!(in_range_room(Some(&lo), Some(&hi), Some(1), 4, 1));
    assert!(in_range_room(Some(&lo), Some(&hi), Some(1), 5, 20));
    assert!(!in_range_room(Some(&lo), Some(&hi), Some(1), 5, 21));
    assert!(!in_range_room(Some(&lo), Some(&hi), Some(1), 6, 0));
    // Live bounds compare the writer's position.
    let live = v(5, &[(2, 9)]);
    assert!(!in_range_room(Some(&live), None, Some(2), 100, 9));
    assert!(in_range_room(Some(&live), None, Some(2), 0, 10));
    assert!(in_range_room(Some(&live), None, Some(1), 0, 6));
    assert!(in_range_room(Some(&live), None, None, 0, 6));
    assert!(in_range_room(None, Some(&live), Some(2), 0, 9));
    assert!(!in_range_room(None, Some(&live), Some(1), 0, 6));
    // Mixed: historical low, live high.
    assert!(in_range_room(Some(&lo), Some(&live), Some(2), 4, 8));
    assert!(!in_range_room(Some(&lo), Some(&live), Some(2), 2, 8));
    assert!(in_range_room(None, None, None, 0, 0));
}

proptest! {
    #![proptest_config(common::config())]

    #[test]
    fn in_range_matches_persisted_after(
        low in arb_live(), high in arb_live(), i in prop_oneof![Just(None), (0i32..6).prop_map(Some)],
        sid in -25i64..25,
    ) {
        let pos = |t: &Token| i.map_or(t.stream(), |i| t.instance_pos(i));
        let want = sid > pos(&low) && sid <= pos(&high);
        prop_assert_eq!(in_range(Some(&low), Some(&high), i, sid), want);
        if let Some(id) = i {
            prop_assert_eq!(in_range(Some(&low), None, i, sid), low.persisted_after(id, sid));
        }
        // Live bounds: the room variant ignores the topological part.
        prop_assert_eq!(in_range_room(Some(&low), Some(&high), i, 12345, sid), want);
    }
}
