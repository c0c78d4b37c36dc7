//! The properties checked by the fuzz targets `token_text` and `token_binary`
//! and by `core/tests/fuzz_corpus.rs`, which includes this very file with
//! `#[path]` so that the fuzzer and the replay test never drift apart.
//!
//! A violated property panics with the input in the message: libFuzzer
//! reports that as a crash, `cargo test` as a failure. Only `std` and
//! `streampos_core` are used, so the file compiles in both crates.
//!
//! Every property comes from the documentation of `streampos_core::token`:
//! the invariants of a constructed token, canonical text, storage and wire
//! forms that round-trip, one SQLSTATE per entry point, error details that
//! are capitalised sentences, and quoted input clipped to 200 bytes.

use std::fmt::Debug;

use streampos_core::token::{Token, TokenError, TokenKind};

/// Both token kinds, in the order they are checked.
pub const KINDS: [TokenKind; 2] = [TokenKind::Room, TokenKind::MultiWriter];

/// SQLSTATEs that [`Token::parse`] may return.
pub const PARSE_STATES: &[&str] = &["22P02", "22003", "54000"];
/// SQLSTATE of every [`Token::recv`] error.
pub const RECV_STATES: &[&str] = &["22P03", "54000"];
/// SQLSTATE of every [`Token::decode`] error.
pub const DECODE_STATES: &[&str] = &["XX001"];

/// Upper bound of an error's `Display` form: a fixed sentence, the type name
/// and at most 200 bytes of quoted input plus `...`.
pub const MAX_MESSAGE_LEN: usize = 300;
/// Upper bound of an error's detail: one sentence quoting at most one
/// character or a number clipped to 40 bytes, and a few integers.
pub const MAX_DETAIL_LEN: usize = 300;

/// Text seeds (valid in at least one kind). Their `send` and `encode` bytes
/// are the binary seeds, see [`seed_binaries`].
pub const SEED_TEXTS: &[&str] = &[
    "s5",
    "s-9223372036854775808",
    "t426-2633508",
    "t5--12",
    "t-3-4",
    "m56~2.58~3.59",
    "m1~9.2~-4.3~0.4~3.5",
    "m5~",
    "m5~2.7~",
    "m-5~1.-4",
    "5",
    "-0",
    "007",
];

/// Binary seeds as (name, bytes): the wire form (`send`) and storage form
/// (`encode`) of every seed text that parses, for each kind that accepts it,
/// without duplicates, plus one wire form whose pairs are not in ID order
/// (which `recv` accepts).
pub fn seed_binaries() -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    let mut push = |name: String, bytes: Vec<u8>| {
        if !out.iter().any(|(_, b)| *b == bytes) {
            out.push((name, bytes));
        }
    };
    for text in SEED_TEXTS {
        for kind in KINDS {
            if let Ok(t) = Token::parse(kind, text) {
                let canonical = t.to_text(kind);
                let mut wire = Vec::new();
                t.send(&mut wire);
                push(format!("send-{canonical}"), wire);
                let mut stored = Vec::new();
                t.encode(&mut stored);
                push(format!("encode-{canonical}"), stored);
            }
        }
    }
    // m56~3.59~2.58 on the wire, pairs in descending ID order.
    let mut unordered = vec![1u8, 0];
    unordered.extend_from_slice(&56i64.to_be_bytes());
    unordered.extend_from_slice(&2u32.to_be_bytes());
    for (id, pos) in [(3i32, 59i64), (2, 58)] {
        unordered.extend_from_slice(&id.to_be_bytes());
        unordered.extend_from_slice(&pos.to_be_bytes());
    }
    push("send-unordered-m56~3.59~2.58".to_owned(), unordered);
    out
}

/// The `token_text` target: bytes that are UTF-8 are checked as text
/// ([`check_text`]); other bytes are ignored.
pub fn check_text_input(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        check_text(text);
    }
}

/// Parses `text` as both kinds. On success the token must pass
/// [`check_token`]; on failure the error must be 22P02 or 22003 and well
/// formed ([`check_error`]). Also checks that the kinds agree where their
/// grammars coincide.
pub fn check_text(text: &str) {
    let parsed = KINDS.map(|kind| Token::parse(kind, text));
    for (kind, result) in KINDS.into_iter().zip(&parsed) {
        match result {
            Ok(t) => check_token(kind, t, &text),
            Err(e) => check_error(kind, e, PARSE_STATES, &text),
        }
    }
    let [room, multi] = &parsed;
    // `m…` is one grammar in both kinds: same token, or same error.
    if text.starts_with('m') {
        match (room, multi) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "kinds disagree on {text:?}"),
            (Err(a), Err(b)) => assert_eq!(
                (a.sqlstate(), a.detail()),
                (b.sqlstate(), b.detail()),
                "kinds disagree on {text:?}"
            ),
            _ => panic!("kinds disagree on {text:?}: {room:?} / {multi:?}"),
        }
    }
    // Room `s{n}` is multi-writer `{n}`.
    if let Some(rest) = text.strip_prefix('s') {
        if !rest.starts_with('m') {
            let plain = Token::parse(TokenKind::MultiWriter, rest);
            match (room, &plain) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{text:?} vs {rest:?}"),
                (Err(a), Err(b)) => assert_eq!(a.sqlstate(), b.sqlstate(), "{text:?} vs {rest:?}"),
                _ => panic!("{text:?} vs {rest:?}: {room:?} / {plain:?}"),
            }
        }
    }
}

/// The `token_binary` target: `data` as the wire form ([`Token::recv`]) and
/// the storage form ([`Token::decode`]) of both kinds. On success the token
/// must pass [`check_token`], the storage form must be exactly what
/// `encode` writes, and the wire form must be what `send` writes up to the
/// order of its pairs. Errors must be 22P03 (recv) / XX001 (decode) and well
/// formed. A multi-writer token read from bytes must be read identically as
/// a room token, and a room token rejected as multi-writer must be
/// historical.
pub fn check_binary_input(data: &[u8]) {
    let received = KINDS.map(|kind| Token::recv(kind, data));
    let decoded = KINDS.map(|kind| Token::decode(kind, data));
    for (kind, result) in KINDS.into_iter().zip(&received) {
        match result {
            Ok(t) => {
                check_token(kind, t, &data);
                let mut wire = Vec::new();
                t.send(&mut wire);
                assert_same_pairs(&wire, data);
            }
            Err(e) => check_error(kind, e, RECV_STATES, &data),
        }
    }
    for (kind, result) in KINDS.into_iter().zip(&decoded) {
        match result {
            Ok(t) => {
                check_token(kind, t, &data);
                let mut stored = Vec::new();
                t.encode(&mut stored);
                assert_eq!(stored, data, "decode/encode changed the bytes of {t:?}");
            }
            Err(e) => check_error(kind, e, DECODE_STATES, &data),
        }
    }
    for [room, multi] in [&received, &decoded] {
        match (room, multi) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "kinds disagree on {data:02x?}"),
            (Ok(a), Err(_)) => assert!(
                a.is_historical(),
                "live {a:?} rejected as multi-writer: {data:02x?}"
            ),
            (Err(_), Ok(b)) => panic!("{b:?} accepted only as multi-writer: {data:02x?}"),
            (Err(_), Err(_)) => {}
        }
    }
}

/// `canonical` (from `send`) and `input` (accepted by `recv`) are the same
/// length, the same header, and the same 12-byte pairs in some order.
fn assert_same_pairs(canonical: &[u8], input: &[u8]) {
    assert_eq!(
        canonical.len(),
        input.len(),
        "send/recv changed the length of {input:02x?}"
    );
    // Version, kind, stream, (topological,) count; then the pairs.
    let pairs_start = if input.get(1) == Some(&1) { 22 } else { 14 };
    assert!(
        input.len() >= pairs_start && (input.len() - pairs_start).is_multiple_of(12),
        "recv accepted {input:02x?} of a length that is not header + pairs"
    );
    let (ch, cp) = canonical.split_at(pairs_start);
    let (ih, ip) = input.split_at(pairs_start);
    let header_ok = ch == ih;
    let mut cp: Vec<&[u8]> = cp.chunks(12).collect();
    let mut ip: Vec<&[u8]> = ip.chunks(12).collect();
    cp.sort_unstable();
    ip.sort_unstable();
    assert!(
        header_ok && cp == ip,
        "send {canonical:02x?} is not a reordering of recv input {input:02x?}"
    );
}

/// Every property of a token that an entry point of `kind` returned:
///
/// - the invariants (instances strictly ascending by ID, every position above
///   the stream position, historical only as a room token and then with no
///   instances);
/// - text: `to_text` is `text_len` long, `write_text` appends exactly it, it
///   re-parses to an equal token which prints identically;
/// - storage: `encode` appends `encoded_len` bytes that `decode` reads back
///   to an equal token, and re-encoding gives the same bytes;
/// - wire: `send` appends bytes that `recv` reads back to an equal token,
///   and re-sending gives the same bytes;
/// - the other kind reads the storage and wire forms of a live token to an
///   equal token and its own canonical text too, and rejects a historical
///   token's (XX001 / 22P03);
/// - the order and lattice operations are reflexive / idempotent on it.
pub fn check_token(kind: TokenKind, t: &Token, input: &dyn Debug) {
    let inst = t.instances();
    assert!(
        inst.windows(2).all(|w| w[0].0 < w[1].0),
        "instances not strictly ascending in {t:?} from {input:?}"
    );
    assert!(
        inst.iter().all(|&(_, pos)| pos > t.stream()),
        "a position not above the stream in {t:?} from {input:?}"
    );
    if t.is_historical() {
        assert!(
            inst.is_empty(),
            "historical with instances: {t:?} from {input:?}"
        );
        assert_eq!(kind, TokenKind::Room, "historical {t:?} from {input:?}");
    }

    // Text.
    let text = t.to_text(kind);
    assert_eq!(text.len(), t.text_len(kind), "text_len of {t:?} ({text:?})");
    let prefix = "prefix:";
    let mut appended = prefix.to_owned();
    t.write_text(kind, &mut appended);
    assert_eq!(
        appended.strip_prefix(prefix),
        Some(text.as_str()),
        "write_text of {t:?}"
    );
    let reparsed = Token::parse(kind, &text);
    assert_eq!(
        reparsed.as_ref(),
        Ok(t),
        "canonical text {text:?} of {t:?} (from {input:?}) does not re-parse to it"
    );
    if let Ok(r) = &reparsed {
        assert_eq!(r.to_text(kind), text, "re-print of {text:?} from {input:?}");
    }

    // Storage.
    let mut stored = vec![0xa5];
    t.encode(&mut stored);
    let stored = stored.split_off(1);
    assert_eq!(stored.len(), t.encoded_len(), "encoded_len of {t:?}");
    let decoded = Token::decode(kind, &stored);
    assert_eq!(
        decoded.as_ref(),
        Ok(t),
        "decode(encode) of {t:?} from {input:?}"
    );
    if let Ok(d) = &decoded {
        let mut again = Vec::new();
        d.encode(&mut again);
        assert_eq!(again, stored, "re-encode of {t:?}");
    }

    // Wire.
    let mut wire = vec![0xa5];
    t.send(&mut wire);
    let wire = wire.split_off(1);
    let received = Token::recv(kind, &wire);
    assert_eq!(
        received.as_ref(),
        Ok(t),
        "recv(send) of {t:?} from {input:?}"
    );
    if let Ok(r) = &received {
        let mut again = Vec::new();
        r.send(&mut again);
        assert_eq!(again, wire, "re-send of {t:?}");
    }

    // The other kind.
    let other = match kind {
        TokenKind::Room => TokenKind::MultiWriter,
        TokenKind::MultiWriter => TokenKind::Room,
    };
    if t.is_historical() {
        let d = Token::decode(other, &stored);
        assert_eq!(d.as_ref().map_err(|e| e.sqlstate()), Err("XX001"), "{t:?}");
        let r = Token::recv(other, &wire);
        assert_eq!(r.as_ref().map_err(|e| e.sqlstate()), Err("22P03"), "{t:?}");
    } else {
        let other_text = t.to_text(other);
        assert_eq!(
            Token::parse(other, &other_text).as_ref(),
            Ok(t),
            "{other:?} text {other_text:?} of {t:?}"
        );
        assert_eq!(
            Token::decode(other, &stored).as_ref(),
            Ok(t),
            "{other:?} decode of {t:?}"
        );
        assert_eq!(
            Token::recv(other, &wire).as_ref(),
            Ok(t),
            "{other:?} recv of {t:?}"
        );
    }

    // Order and lattice, on the token itself.
    assert!(t.is_before_or_eq(t), "{t:?} not before-or-equal itself");
    assert_eq!(t.cmp(t), std::cmp::Ordering::Equal, "{t:?}");
    assert_eq!(t.advance(t).as_ref(), Ok(t), "advance of {t:?} with itself");
    assert_eq!(
        &t.bound(t.max_stream_pos()),
        t,
        "bound of {t:?} at its maximum"
    );
    for &(id, pos) in inst {
        assert_eq!(t.instance_pos(id), pos, "instance_pos({id}) of {t:?}");
    }
}

/// An error from an entry point of `kind`: its SQLSTATE is one of `states`,
/// its detail is one capitalised sentence ending with `.`, its message names
/// the SQL type, and both are bounded in length whatever the input.
pub fn check_error(kind: TokenKind, e: &TokenError, states: &[&str], input: &dyn Debug) {
    assert!(
        states.contains(&e.sqlstate()),
        "SQLSTATE {} not in {states:?}: {e:?} from {input:?}",
        e.sqlstate()
    );
    let detail = e.detail();
    assert!(
        detail.starts_with(|c: char| c.is_ascii_uppercase()) && detail.ends_with('.'),
        "detail is not a sentence: {detail:?} from {input:?}"
    );
    assert!(
        detail.len() <= MAX_DETAIL_LEN,
        "detail of {} bytes from {input:?}",
        detail.len()
    );
    let message = e.to_string();
    assert!(
        message.contains(kind.type_name()),
        "message {message:?} does not name {} (from {input:?})",
        kind.type_name()
    );
    assert!(
        message.len() <= MAX_MESSAGE_LEN,
        "message of {} bytes from {input:?}",
        message.len()
    );
}
