//! The storage form (`encode`/`decode`) and the wire form (`send`/`recv`):
//! exact layouts, rejected corruptions, round trips, and arbitrary bytes
//! that must never panic.

mod common;

use common::{arb_room, v};
use proptest::prelude::*;
use streampos_core::token::{Token, TokenKind};
use TokenKind::{MultiWriter, Room};

#[test]
fn storage_layout() {
    let mut b = Vec::new();
    v(5, &[(2, 7)]).encode(&mut b);
    let mut want = vec![0u8];
    want.extend_from_slice(&5i64.to_le_bytes());
    want.extend_from_slice(&2i32.to_le_bytes());
    want.extend_from_slice(&7i64.to_le_bytes());
    assert_eq!(b, want);
    assert_eq!(v(5, &[(2, 7)]).encoded_len(), 21);
    let mut b = Vec::new();
    Token::historical(3, -4).encode(&mut b);
    assert_eq!(b.len(), 17);
    assert_eq!(b[0], 1);
    assert_eq!(Token::historical(3, -4).encoded_len(), 17);
    assert_eq!(Token::decode(Room, &b).unwrap(), Token::historical(3, -4));
    assert_eq!(
        Token::decode(MultiWriter, &b).unwrap_err().sqlstate(),
        "XX001"
    );
}

#[test]
fn storage_rejects_corruption() {
    let mut good = Vec::new();
    v(5, &[(2, 7), (3, 8)]).encode(&mut good);
    let bad = |b: &[u8]| Token::decode(Room, b).unwrap_err().sqlstate();
    assert_eq!(bad(&good[..good.len() - 1]), "XX001");
    assert_eq!(bad(&good[..5]), "XX001");
    let mut flags = good.clone();
    flags[0] = 2;
    assert_eq!(bad(&flags), "XX001");
    let mut hist_with_pairs = good.clone();
    hist_with_pairs[0] = 1;
    // 1 + 8 + 8 + 16 remaining: historical with trailing bytes.
    assert_eq!(bad(&hist_with_pairs), "XX001");
    // Unsorted.
    let mut unsorted = Vec::new();
    unsorted.push(0);
    unsorted.extend_from_slice(&5i64.to_le_bytes());
    for (id, pos) in [(3i32, 8i64), (2, 7)] {
        unsorted.extend_from_slice(&id.to_le_bytes());
        unsorted.extend_from_slice(&pos.to_le_bytes());
    }
    assert_eq!(bad(&unsorted), "XX001");
    // Position not above stream.
    let mut low = Vec::new();
    low.push(0);
    low.extend_from_slice(&5i64.to_le_bytes());
    low.extend_from_slice(&2i32.to_le_bytes());
    low.extend_from_slice(&5i64.to_le_bytes());
    assert_eq!(bad(&low), "XX001");
}

#[test]
fn wire_layout_and_errors() {
    let mut b = Vec::new();
    v(5, &[(3, 9), (2, 7)]).send(&mut b);
    let mut want = vec![1u8, 0];
    want.extend_from_slice(&5i64.to_be_bytes());
    want.extend_from_slice(&2u32.to_be_bytes());
    for (id, pos) in [(2i32, 7i64), (3, 9)] {
        want.extend_from_slice(&id.to_be_bytes());
        want.extend_from_slice(&pos.to_be_bytes());
    }
    assert_eq!(b, want);
    assert_eq!(
        Token::recv(MultiWriter, &b).unwrap(),
        v(5, &[(2, 7), (3, 9)])
    );

    // Pairs in any order are accepted.
    let mut unordered = vec![1u8, 0];
    unordered.extend_from_slice(&5i64.to_be_bytes());
    unordered.extend_from_slice(&2u32.to_be_bytes());
    for (id, pos) in [(3i32, 9i64), (2, 7)] {
        unordered.extend_from_slice(&id.to_be_bytes());
        unordered.extend_from_slice(&pos.to_be_bytes());
    }
    assert_eq!(
        Token::recv(Room, &unordered).unwrap(),
        v(5, &[(2, 7), (3, 9)])
    );

    let err = |b: &[u8]| Token::recv(Room, b).unwrap_err();
    // A huge count with no data is rejected without allocating.
    let mut huge = vec![1u8, 0];
    huge.extend_from_slice(&5i64.to_be_bytes());
    huge.extend_from_slice(&u32::MAX.to_be_bytes());
    assert_eq!(err(&huge).sqlstate(), "22P03");
    assert!(err(&huge).detail().contains("4294967295"));
    // Wrong version, kind, trailing bytes, truncation.
    let mut wrong = b.clone();
    wrong[0] = 2;
    assert!(err(&wrong).detail().contains("version 2"));
    let mut wrong = b.clone();
    wrong[1] = 7;
    assert!(err(&wrong).detail().contains("kind byte 7"));
    let mut trailing = b.clone();
    trailing.push(0);
    assert_eq!(err(&trailing).sqlstate(), "22P03");
    assert_eq!(err(&b[..b.len() - 1]).sqlstate(), "22P03");
    assert_eq!(err(&b[..3]).sqlstate(), "22P03");
    // Duplicates and positions not above the stream.
    let mut dup = vec![1u8, 0];
    dup.extend_from_slice(&5i64.to_be_bytes());
    dup.extend_from_slice(&2u32.to_be_bytes());
    for (id, pos) in [(2i32, 9i64), (2, 7)] {
        dup.extend_from_slice(&id.to_be_bytes());
        dup.extend_from_slice(&pos.to_be_bytes());
    }
    assert_eq!(err(&dup).detail(), "Instance 2 is listed twice.");
    // Historical: only for Room, and no pairs.
    let mut hist = Vec::new();
    Token::historical(4, 5).send(&mut hist);
    assert_eq!(hist.len(), 2 + 8 + 8 + 4);
    assert_eq!(Token::recv(Room, &hist).unwrap(), Token::historical(4, 5));
    assert_eq!(
        Token::recv(MultiWriter, &hist).unwrap_err().sqlstate(),
        "22P03"
    );
    let mut hist_pairs = hist.clone();
    let n = hist_pairs.len();
    hist_pairs[n - 4..].copy_from_slice(&1u32.to_be_bytes());
    hist_pairs.extend_from_slice(&2i32.to_be_bytes());
    hist_pairs.extend_from_slice(&9i64.to_be_bytes());
    assert_eq!(err(&hist_pairs).sqlstate(), "22P03");
}

fn check_any_bytes(kind: TokenKind, b: &[u8]) {
    if let Ok(t) = Token::decode(kind, b) {
        let mut again = Vec::new();
        t.encode(&mut again);
        assert_eq!(again, b);
        assert_eq!(t.encoded_len(), b.len());
        assert_eq!(Token::parse(kind, &t.to_text(kind)).as_ref(), Ok(&t));
    }
    if let Ok(t) = Token::recv(kind, b) {
        let mut again = Vec::new();
        t.send(&mut again);
        assert_eq!(again.len(), b.len());
        assert_eq!(Token::recv(kind, &again).as_ref(), Ok(&t));
        assert_eq!(Token::parse(kind, &t.to_text(kind)).as_ref(), Ok(&t));
    }
}

proptest! {
    #![proptest_config(common::config())]

    #[test]
    fn storage_and_wire_round_trip(t in arb_room()) {
        let mut b = Vec::new();
        t.encode(&mut b);
        prop_assert_eq!(b.len(), t.encoded_len());
        prop_assert_eq!(Token::decode(Room, &b).unwrap(), t.clone());
        let mut w = Vec::new();
        t.send(&mut w);
        prop_assert_eq!(Token::recv(Room, &w).unwrap(), t.clone());
        if !t.is_historical() {
            prop_assert_eq!(Token::decode(MultiWriter, &b).unwrap(), t.clone());
            prop_assert_eq!(Token::recv(MultiWriter, &w).unwrap(), t.clone());
        } else {
            prop_assert!(Token::decode(MultiWriter, &b).is_err());
            prop_assert!(Token::recv(MultiWriter, &w).is_err());
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(b in prop::collection::vec(any::<u8>(), 0..80)) {
        check_any_bytes(Room, &b);
        check_any_bytes(MultiWriter, &b);
    }

    #[test]
    fn mutated_valid_bytes_never_panic(
        t in arb_room(),
        edits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        cut in any::<prop::sample::Index>(),
        extra in prop::collection::vec(any::<u8>(), 0..14),
    ) {
        let mut enc = Vec::new();
        t.encode(&mut enc);
        let mut wire = Vec::new();
        t.send(&mut wire);
        for mut b in [enc, wire] {
            for &(at, byte) in &edits {
                let n = b.len();
                if n > 0 {
                    b[at % n] = byte;
                }
            }
            for kind in [Room, MultiWriter] {
                check_any_bytes(kind, &b);
                check_any_bytes(kind, &b[..cut.index(b.len() + 1)]);
                let mut longer = b.clone();
                longer.extend_from_slice(&extra);
                check_any_bytes(kind, &longer);
            }
        }
    }
}

#[test]
fn a_wire_message_over_the_instance_cap_is_54000() {
    use streampos_core::token::{Token, TokenKind, MAX_INSTANCES};
    let message = |n: usize| -> Vec<u8> {
        let mut m = vec![1u8, 0];
        m.extend_from_slice(&0i64.to_be_bytes());
        m.extend_from_slice(&(n as u32).to_be_bytes());
        for id in 0..n {
            m.extend_from_slice(&(id as i32).to_be_bytes());
            m.extend_from_slice(&1i64.to_be_bytes());
        }
        m
    };
    assert!(Token::recv(TokenKind::Room, &message(MAX_INSTANCES)).is_ok());
    let e = Token::recv(TokenKind::Room, &message(MAX_INSTANCES + 1)).unwrap_err();
    assert_eq!(e.sqlstate(), "54000", "{e:?}");
    // A count the bytes do not back is a malformed message, not a big one.
    let mut short = message(0);
    short[10..14].copy_from_slice(&u32::MAX.to_be_bytes());
    assert_eq!(
        Token::recv(TokenKind::Room, &short).unwrap_err().sqlstate(),
        "22P03"
    );
}

#[test]
fn a_stored_value_over_the_instance_cap_is_54000() {
    use streampos_core::token::{Token, TokenKind, MAX_INSTANCES};
    let stored = |n: usize| -> Vec<u8> {
        let mut m = vec![0u8];
        m.extend_from_slice(&0i64.to_le_bytes());
        for id in 0..n {
            m.extend_from_slice(&(id as i32).to_le_bytes());
            m.extend_from_slice(&1i64.to_le_bytes());
        }
        m
    };
    assert!(Token::decode(TokenKind::MultiWriter, &stored(MAX_INSTANCES)).is_ok());
    let e = Token::decode(TokenKind::MultiWriter, &stored(MAX_INSTANCES + 1)).unwrap_err();
    assert_eq!(e.sqlstate(), "54000", "{e:?}");
    assert!(e.detail().contains("10001"), "{e:?}");
}

#[test]
fn the_constructor_counts_past_the_cap_without_keeping_the_rest() {
    use streampos_core::token::{Token, MAX_INSTANCES};
    // An iterator that does not say how long it is.
    let entries = |n: i32| {
        let mut id = 0;
        std::iter::from_fn(move || {
            id += 1;
            (id <= n).then_some((id, 1i64))
        })
    };
    assert!(Token::vector(0, entries(MAX_INSTANCES as i32)).is_ok());
    let e = Token::vector(0, entries(MAX_INSTANCES as i32 + 5)).unwrap_err();
    assert_eq!(e.sqlstate(), "54000", "{e:?}");
    assert!(e.detail().contains("10005"), "{e:?}");
}
