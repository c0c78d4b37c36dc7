//! The text form of tokens: accepted and rejected inputs with their
//! canonical output or SQLSTATE, error messages and details, round trips,
//! and arbitrary input that must never panic.

mod common;

use common::{arb_room, parse_ok};
use proptest::prelude::*;
use streampos_core::token::{Token, TokenError, TokenKind};
use TokenKind::{MultiWriter, Room};

const ROOM_VALID: &[(&str, &str)] = &[
    ("s5", "s5"),
    ("s0", "s0"),
    ("s-5", "s-5"),
    ("s-0", "s0"),
    ("s007", "s7"),
    ("s-007", "s-7"),
    ("s2633508", "s2633508"),
    ("s9223372036854775807", "s9223372036854775807"),
    ("s-9223372036854775808", "s-9223372036854775808"),
    ("s00000000000000000000000000009", "s9"),
    ("t426-2633508", "t426-2633508"),
    ("t5-12", "t5-12"),
    ("t5--12", "t5--12"),
    ("t-3-4", "t-3-4"),
    ("t-3--4", "t-3--4"),
    ("t0-0", "t0-0"),
    ("t007-008", "t7-8"),
    (
        "t-9223372036854775808--9223372036854775808",
        "t-9223372036854775808--9223372036854775808",
    ),
    (
        "t9223372036854775807-9223372036854775807",
        "t9223372036854775807-9223372036854775807",
    ),
    ("m5", "s5"),
    ("m5~", "s5"),
    ("m-5~", "s-5"),
    ("m5~2.7", "m5~2.7"),
    ("m5~2.7~", "m5~2.7"),
    ("m56~2.58~3.59", "m56~2.58~3.59"),
    ("m56~3.59~2.58", "m56~2.58~3.59"),
    ("m1~9.2~-4.3~0.4~3.5", "m1~-4.3~0.4~3.5~9.2"),
    ("m-5~1.-3", "m-5~1.-3"),
    ("m5~-2.6", "m5~-2.6"),
    ("m05~02.06", "m5~2.6"),
    ("m5~2147483647.6", "m5~2147483647.6"),
    ("m5~-2147483648.6", "m5~-2147483648.6"),
    (
        "m-9223372036854775808~1.9223372036854775807",
        "m-9223372036854775808~1.9223372036854775807",
    ),
];

const ROOM_INVALID: &[(&str, &str)] = &[
    ("", "22P02"),
    ("s", "22P02"),
    ("x5", "22P02"),
    ("S5", "22P02"),
    ("5", "22P02"),
    ("-5", "22P02"),
    ("s5 ", "22P02"),
    (" s5", "22P02"),
    ("s+5", "22P02"),
    ("s5_0", "22P02"),
    ("s5.0", "22P02"),
    ("s-", "22P02"),
    ("s--5", "22P02"),
    ("s5x", "22P02"),
    ("s\u{e9}", "22P02"),
    ("s5\u{e9}", "22P02"),
    ("s5\n", "22P02"),
    ("t", "22P02"),
    ("t-", "22P02"),
    ("t5", "22P02"),
    ("t5-", "22P02"),
    ("t-5", "22P02"),
    ("t5--", "22P02"),
    ("t5---1", "22P02"),
    ("t5-1-", "22P02"),
    ("t5-1x", "22P02"),
    ("t5~1", "22P02"),
    ("t5-1~2.3", "22P02"),
    ("tt5-5", "22P02"),
    ("m", "22P02"),
    ("m~2.3", "22P02"),
    ("m-", "22P02"),
    ("m5~2", "22P02"),
    ("m5~2.", "22P02"),
    ("m5~.3", "22P02"),
    ("m5~2.3~2.4", "22P02"),
    ("m5~2.6~2.7", "22P02"),
    ("m5~2.5", "22P02"),
    ("m5~2.4", "22P02"),
    ("m5~~2.7", "22P02"),
    ("m5~~", "22P02"),
    ("m5~2.7~~", "22P02"),
    ("m5~2.7~~3.8", "22P02"),
    ("m5~2.7x", "22P02"),
    ("m5.2", "22P02"),
    ("m5~2.7.8", "22P02"),
    ("m5~2~3", "22P02"),
    ("m5~2.+7", "22P02"),
    ("m5~+2.7", "22P02"),
    ("m5 ~2.7", "22P02"),
    ("s9223372036854775808", "22003"),
    ("s-9223372036854775809", "22003"),
    ("s99999999999999999999", "22003"),
    ("s99999999999999999999999999999999999999999999", "22003"),
    ("t99999999999999999999-1", "22003"),
    ("t1-99999999999999999999", "22003"),
    ("m5~2147483648.9", "22003"),
    ("m5~-2147483649.9", "22003"),
    ("m5~2.99999999999999999999", "22003"),
    ("m99999999999999999999~2.3", "22003"),
    // Grammar errors win over range errors, range over semantics.
    ("s99999999999999999999x", "22P02"),
    ("m5~2147483648.9~", "22003"),
    ("m5~2147483648.9~~", "22P02"),
    ("m5~2.4~3.99999999999999999999", "22003"),
];

const MW_VALID: &[(&str, &str)] = &[
    ("5", "5"),
    ("0", "0"),
    ("-5", "-5"),
    ("-0", "0"),
    ("007", "7"),
    ("9223372036854775807", "9223372036854775807"),
    ("-9223372036854775808", "-9223372036854775808"),
    ("m5", "5"),
    ("m5~", "5"),
    ("m5~1.6", "m5~1.6"),
    ("m5~3.9~1.6", "m5~1.6~3.9"),
    ("m5~1.6~", "m5~1.6"),
    ("m-5~1.-4", "m-5~1.-4"),
];

const MW_INVALID: &[(&str, &str)] = &[
    ("", "22P02"),
    ("s5", "22P02"),
    ("t1-2", "22P02"),
    ("5x", "22P02"),
    ("-", "22P02"),
    ("--5", "22P02"),
    ("+5", "22P02"),
    (" 5", "22P02"),
    ("5 ", "22P02"),
    ("5_000", "22P02"),
    ("m", "22P02"),
    ("m5~1.5", "22P02"),
    ("m5~1.6~1.7", "22P02"),
    ("m5~~1.7", "22P02"),
    ("x", "22P02"),
    ("9223372036854775808", "22003"),
    ("-9223372036854775809", "22003"),
    ("m5~2147483648.9", "22003"),
];

#[test]
fn valid_text_parses_to_canonical_form() {
    for (kind, table) in [(Room, ROOM_VALID), (MultiWriter, MW_VALID)] {
        for &(input, canonical) in table {
            let t = parse_ok(kind, input);
            assert_eq!(t.to_text(kind), canonical, "{kind:?} {input:?}");
            assert_eq!(t.text_len(kind), canonical.len(), "{kind:?} {input:?}");
            assert_eq!(parse_ok(kind, canonical), t, "{kind:?} {canonical:?}");
        }
    }
}

#[test]
fn invalid_text_fails_with_sqlstate() {
    for (kind, table) in [(Room, ROOM_INVALID), (MultiWriter, MW_INVALID)] {
        for &(input, state) in table {
            match Token::parse(kind, input) {
                Ok(t) => panic!("{kind:?} {input:?} should fail, got {t:?}"),
                Err(e) => {
                    assert_eq!(
                        e.sqlstate(),
                        state,
                        "{kind:?} {input:?}: {e} / {}",
                        e.detail()
                    );
                    let d = e.detail();
                    assert!(
                        d.starts_with(|c: char| c.is_ascii_uppercase()) && d.ends_with('.'),
                        "detail {d:?}"
                    );
                    let msg = e.to_string();
                    assert!(msg.contains(kind.type_name()), "{msg}");
                    assert!(msg.contains(&format!("\"{input}\"")), "{msg}");
                }
            }
        }
    }
}

#[test]
fn parsed_fields() {
    let t = parse_ok(Room, "t5--12");
    assert_eq!((t.topological(), t.stream()), (Some(5), -12));
    assert!(t.is_historical());
    let t = parse_ok(Room, "t-3-4");
    assert_eq!((t.topological(), t.stream()), (Some(-3), 4));
    let t = parse_ok(Room, "m56~3.59~2.58");
    assert_eq!(t.instances(), &[(2, 58), (3, 59)]);
    assert_eq!(t.topological(), None);
    assert_eq!(parse_ok(Room, "m5~"), Token::live(5));
    assert_eq!(parse_ok(MultiWriter, "m5~1.6"), parse_ok(Room, "m5~1.6"));
}

#[test]
fn error_details() {
    let detail = |kind, s| Token::parse(kind, s).unwrap_err().detail().to_owned();
    assert_eq!(detail(Room, "m5~2.6~2.7"), "Instance 2 is listed twice.");
    assert_eq!(
        detail(Room, "m5~2.3~2.4"),
        "Position 3 of instance 2 is not greater than the minimum 5."
    );
    assert_eq!(
        detail(Room, "s99999999999999999999"),
        "Number \"99999999999999999999\" at byte 2 does not fit in a signed 64-bit integer."
    );
    assert_eq!(
        detail(Room, "m5~2147483648.9"),
        "Instance ID \"2147483648\" at byte 4 does not fit in a signed 32-bit integer."
    );
    assert_eq!(
        detail(Room, "s5x"),
        "Unexpected character \"x\" at byte 3 after the stream position; expected end of input."
    );
    assert!(detail(Room, "t-5").contains("Expected \"-\""));
    assert!(detail(Room, "m5~~2.7").starts_with("Empty entry"));
    assert!(detail(Room, "m5~2").contains("found end of input"));
    assert!(detail(Room, "").starts_with("The input is empty"));
    assert!(detail(MultiWriter, "s5").contains("\"s\" at byte 1"));
    assert!(detail(Room, "s\u{e9}").contains("\"\u{e9}\""));
    assert!(detail(Room, "s5\n").contains("\"\\n\""));
    // Long numbers are clipped in details.
    let long = format!("s{}", "9".repeat(1000));
    assert!(detail(Room, &long).len() < 200);
}

#[test]
fn long_text_is_clipped_in_message() {
    let s = "x".repeat(300);
    let e = Token::parse(Room, &s).unwrap_err();
    let TokenError::Syntax { text, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(text.len(), 203);
    assert!(text.ends_with("..."));
    // Cut on a char boundary: 199 bytes of 'x' then a 2-byte char.
    let s = format!("{}{}", "x".repeat(199), "\u{e9}".repeat(10));
    let e = Token::parse(Room, &s).unwrap_err();
    let TokenError::Syntax { text, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(text, &format!("{}...", "x".repeat(199)));
    assert_eq!(
        e.to_string(),
        format!(
            "invalid input syntax for type room_stream_token: \"{}...\"",
            "x".repeat(199)
        )
    );
}

#[test]
fn sqlstates_and_messages() {
    let e = Token::vector(5, [(2, 6), (2, 7)]).unwrap_err();
    assert_eq!(e.sqlstate(), "22023");
    assert_eq!(e.to_string(), "instance 2 is listed twice");
    let e = Token::vector(5, [(2, 3)]).unwrap_err();
    assert_eq!(e.sqlstate(), "22023");
    assert_eq!(
        e.to_string(),
        "position 3 of instance 2 is not greater than the minimum 5"
    );
    assert!(e.detail().ends_with('.'));
    let e = Token::parse(Room, "s99999999999999999999").unwrap_err();
    assert_eq!(
        e.to_string(),
        "value out of range for type room_stream_token: \"s99999999999999999999\""
    );
    assert_eq!(Token::recv(Room, &[]).unwrap_err().sqlstate(), "22P03");
    assert_eq!(Token::decode(Room, &[]).unwrap_err().sqlstate(), "XX001");
    assert_eq!(
        Token::decode(Room, &[]).unwrap_err().to_string(),
        "corrupt stored value of type room_stream_token"
    );
    assert_eq!(
        Token::recv(MultiWriter, &[]).unwrap_err().to_string(),
        "invalid binary data for type multi_writer_token"
    );
    assert_eq!(Room.type_name(), "room_stream_token");
    assert_eq!(MultiWriter.type_name(), "multi_writer_token");
}

#[test]
fn multi_writer_historical_prints_live() {
    let t = Token::historical(3, 7);
    assert_eq!(t.to_text(MultiWriter), "7");
    assert_eq!(t.text_len(MultiWriter), 1);
    assert_eq!(t.to_text(Room), "t3-7");
}

fn mutate(s: &str, ops: &[(u8, usize, char)]) -> String {
    let mut chars: Vec<char> = s.chars().collect();
    for &(op, at, c) in ops {
        let at = if chars.is_empty() {
            0
        } else {
            at % (chars.len() + 1)
        };
        match op % 3 {
            0 => chars.insert(at, c),
            1 if at < chars.len() => {
                chars.remove(at);
            }
            _ if at < chars.len() => chars[at] = c,
            _ => chars.push(c),
        }
    }
    chars.into_iter().collect()
}

fn check_any_text(kind: TokenKind, s: &str) {
    if let Ok(t) = Token::parse(kind, s) {
        let printed = t.to_text(kind);
        assert_eq!(printed.len(), t.text_len(kind));
        assert_eq!(Token::parse(kind, &printed).as_ref(), Ok(&t), "{s:?}");
        if kind == MultiWriter {
            assert!(!t.is_historical());
        }
    }
}

proptest! {
    #![proptest_config(common::config())]

    #[test]
    fn text_round_trip(t in arb_room(), perm in any::<prop::sample::Index>()) {
        for kind in [Room, MultiWriter] {
            if kind == MultiWriter && t.is_historical() {
                continue;
            }
            let s = t.to_text(kind);
            prop_assert_eq!(s.len(), t.text_len(kind));
            let back = Token::parse(kind, &s).unwrap();
            prop_assert_eq!(&back, &t);
            prop_assert_eq!(back.to_text(kind), s.clone());
            // Entries in another order parse to the same token.
            if t.instances().len() > 1 {
                let mut entries = t.instances().to_vec();
                let k = perm.index(entries.len());
                entries.rotate_left(k.max(1));
                entries.reverse();
                let mut alt = format!("m{}", t.stream());
                for (id, pos) in &entries {
                    alt.push_str(&format!("~{id}.{pos}"));
                }
                if k % 2 == 0 {
                    alt.push('~');
                }
                prop_assert_eq!(Token::parse(kind, &alt).unwrap(), t.clone());
            }
        }
    }

    #[test]
    fn arbitrary_strings_never_panic(s in any::<String>()) {
        check_any_text(Room, &s);
        check_any_text(MultiWriter, &s);
    }

    #[test]
    fn near_valid_strings_never_panic(s in "[smt~.\\- 0-9+_x]{0,24}") {
        check_any_text(Room, &s);
        check_any_text(MultiWriter, &s);
    }

    #[test]
    fn mutated_valid_strings_never_panic(
        t in arb_room(),
        ops in prop::collection::vec(
            (any::<u8>(), any::<usize>(), prop::sample::select(vec!['s', 'm', 't', '~', '.', '-', '0', '9', ' ', '+', 'x', '\u{e9}'])),
            1..4,
        ),
    ) {
        for kind in [Room, MultiWriter] {
            let s = mutate(&t.to_text(kind), &ops);
            check_any_text(kind, &s);
        }
    }
}

#[test]
fn clipping_counts_bytes_and_renders_invalid_utf8_after_cutting() {
    use streampos_core::token::{clip_lossy, MAX_QUOTED_TEXT};
    assert_eq!(clip_lossy(b"m5~2.7", 200), "m5~2.7");
    assert_eq!(clip_lossy(b"", 200), "");
    assert_eq!(clip_lossy(b"abcdef", 3), "abc...");
    // Exactly `max` bytes is not cut.
    assert_eq!(clip_lossy(b"abc", 3), "abc");
    // A character the cut would split is left out whole.
    assert_eq!(clip_lossy("ab\u{e9}".as_bytes(), 3), "ab...");
    // Bytes that are not UTF-8 show as U+FFFD, 3 bytes each against `max`.
    assert_eq!(clip_lossy(b"s\xff5", 200), "s\u{fffd}5");
    assert_eq!(clip_lossy(b"\xff\xff\xff", 7), "\u{fffd}\u{fffd}...");
    // Whatever the input, the result is bounded by the clip, not the input.
    for input in [
        vec![0xffu8; 100_000],
        vec![b'x'; 100_000],
        [0xe9u8, b'x'].repeat(50_000),
    ] {
        let shown = clip_lossy(&input, MAX_QUOTED_TEXT);
        assert!(shown.len() <= MAX_QUOTED_TEXT + 3, "{}", shown.len());
        assert!(shown.ends_with("..."));
    }
}

#[test]
fn input_that_is_not_utf8_is_22p02_with_a_clipped_quote() {
    use streampos_core::token::MAX_QUOTED_TEXT;
    let input = [b'm', b'5', 0xff].repeat(50_000);
    for kind in [Room, MultiWriter] {
        let e = Token::parse_bytes(kind, &input).unwrap_err();
        assert_eq!(e.sqlstate(), "22P02", "{e:?}");
        let TokenError::Syntax { text, detail, .. } = &e else {
            panic!("{e:?}")
        };
        assert!(text.len() <= MAX_QUOTED_TEXT + 3, "{}", text.len());
        assert!(text.starts_with("m5\u{fffd}m5"), "{text}");
        assert_eq!(
            detail,
            "Byte 3 (0xff) is not valid UTF-8; a token is ASCII."
        );
        assert!(e.to_string().len() < 300);
    }
    // Valid UTF-8 is parsed as text.
    assert_eq!(
        Token::parse_bytes(Room, b"m5~2.7").unwrap(),
        Token::parse(Room, "m5~2.7").unwrap()
    );
    assert_eq!(
        Token::parse_bytes(Room, "s\u{e9}".as_bytes()),
        Token::parse(Room, "s\u{e9}")
    );
}

#[test]
fn more_instance_positions_than_the_cap_is_54000_before_anything_is_allocated() {
    use streampos_core::token::{Token, TokenKind, MAX_INSTANCES};
    let entries = |n: usize| -> String {
        let mut s = String::from("m0");
        for id in 0..n {
            s.push_str(&format!("~{id}.1"));
        }
        s
    };
    assert!(Token::parse(TokenKind::Room, &entries(MAX_INSTANCES)).is_ok());
    assert!(Token::parse(TokenKind::Room, &format!("{}~", entries(MAX_INSTANCES))).is_ok());
    let e = Token::parse(TokenKind::Room, &entries(MAX_INSTANCES + 1)).unwrap_err();
    assert_eq!(e.sqlstate(), "54000", "{e:?}");
    // A huge run of separators is refused by counting, not by parsing it.
    let e = Token::parse(
        TokenKind::MultiWriter,
        &format!("m1{}", "~".repeat(5_000_000)),
    )
    .unwrap_err();
    assert_eq!(e.sqlstate(), "54000", "{e:?}");
    assert!(e.to_string().len() < 200);
}
