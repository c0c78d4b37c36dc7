//! JSON text exactly as PostgreSQL's `jsonb_out` prints it, for answers
//! built as text (`updates_json`): a string escaped as `escape_json`
//! escapes it, an integer as `numeric_out` prints it.
//!
//! `escape_json` works on bytes: `"` and `\` get a backslash, the five
//! control characters with a short form (`\b \f \n \r \t`) use it, every
//! other byte below 0x20 is `\u00XX` (lower-case hex), and every other byte
//! (UTF-8 sequences included) is copied as it is.

/// Bytes beyond one that a byte takes inside a JSON string: 0 for most,
/// 1 for a two-byte escape (`\"`, `\\`, `\b`, `\f`, `\n`, `\r`, `\t`),
/// 5 for `\u00XX`. Branch-free, so that a long text is counted in wide
/// steps.
fn extra(byte: u8) -> usize {
    let control = (byte < 0x20) as usize;
    let short = matches!(byte, b'"' | b'\\' | 0x08 | 0x0c | b'\n' | b'\r' | b'\t') as usize;
    short + control * 5 * (1 - short)
}

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGHS: u64 = 0x8080_8080_8080_8080;

/// Whether any of the 8 bytes of `word` needs an escape: one below 0x20,
/// a `"` or a `\\` (the classic tests for a byte below n and a zero byte;
/// exact as a yes or no).
fn word_needs_escape(word: u64) -> bool {
    let below_space = word.wrapping_sub(ONES * 0x20) & !word;
    let quote = word ^ (ONES * b'"' as u64);
    let backslash = word ^ (ONES * b'\\' as u64);
    let zero_in = |x: u64| x.wrapping_sub(ONES) & !x;
    (below_space | zero_in(quote) | zero_in(backslash)) & HIGHS != 0
}

/// The index of the first byte of `bytes` that needs an escape, eight
/// bytes at a time (most text has none).
fn first_escape(bytes: &[u8]) -> Option<usize> {
    let mut words = bytes.chunks_exact(8);
    let mut at = 0;
    for word in words.by_ref() {
        let word = u64::from_le_bytes([
            word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7],
        ]);
        if word_needs_escape(word) {
            break;
        }
        at += 8;
    }
    bytes[at..]
        .iter()
        .position(|&b| extra(b) != 0)
        .map(|i| at + i)
}

/// The length of `bytes` as a quoted JSON string.
pub fn quoted_len(bytes: &[u8]) -> usize {
    let mut len = 2 + bytes.len();
    let mut rest = bytes;
    while let Some(i) = first_escape(rest) {
        len += extra(rest[i]);
        rest = &rest[i + 1..];
    }
    len
}

/// Writes `bytes` as a quoted JSON string into the start of `out`, which
/// holds at least `quoted_len(bytes)` bytes; returns the length written.
/// Runs of bytes that need no escape are copied whole.
pub fn write_quoted(bytes: &[u8], out: &mut [u8]) -> usize {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out[0] = b'"';
    let mut at = 1;
    let mut rest = bytes;
    while let Some(i) = first_escape(rest) {
        out[at..at + i].copy_from_slice(&rest[..i]);
        at += i;
        let b = rest[i];
        let short = match b {
            0x08 => Some(b'b'),
            0x0c => Some(b'f'),
            b'\n' => Some(b'n'),
            b'\r' => Some(b'r'),
            b'\t' => Some(b't'),
            b'"' | b'\\' => Some(b),
            _ => None,
        };
        match short {
            Some(c) => {
                out[at] = b'\\';
                out[at + 1] = c;
                at += 2;
            }
            None => {
                out[at..at + 4].copy_from_slice(b"\\u00");
                out[at + 4] = HEX[(b >> 4) as usize];
                out[at + 5] = HEX[(b & 0xf) as usize];
                at += 6;
            }
        }
        rest = &rest[i + 1..];
    }
    out[at..at + rest.len()].copy_from_slice(rest);
    at += rest.len();
    out[at] = b'"';
    at + 1
}

/// `n` in decimal, as `numeric_out` prints an integer: written into `buf`,
/// the digits returned.
pub fn integer(n: i64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    let mut m = n.unsigned_abs();
    loop {
        at -= 1;
        buf[at] = b'0' + (m % 10) as u8;
        m /= 10;
        if m == 0 {
            break;
        }
    }
    if n < 0 {
        at -= 1;
        buf[at] = b'-';
    }
    &buf[at..]
}

/// `bytes` as a quoted JSON string (tests and small values).
pub fn quoted(bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![0; quoted_len(bytes)];
    let len = write_quoted(bytes, &mut out);
    out.truncate(len);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_copied() {
        assert_eq!(quoted(b"abc"), b"\"abc\"");
        assert_eq!(quoted(b""), b"\"\"");
        assert_eq!(quoted("été ✓".as_bytes()), "\"été ✓\"".as_bytes());
    }

    #[test]
    fn escapes_as_escape_json() {
        assert_eq!(quoted(b"a\"b\\c"), br#""a\"b\\c""#);
        assert_eq!(quoted(b"\x08\x0c\n\r\t"), br#""\b\f\n\r\t""#);
        assert_eq!(quoted(b"\x01\x1f\x7f"), b"\"\\u0001\\u001f\x7f\"");
        assert_eq!(quoted(b"/"), b"\"/\"");
    }

    /// escape_json's loop, byte by byte.
    fn escape_json(bytes: &[u8]) -> Vec<u8> {
        let mut out = b"\"".to_vec();
        for &b in bytes {
            match b {
                0x08 => out.extend(b"\\b"),
                0x0c => out.extend(b"\\f"),
                b'\n' => out.extend(b"\\n"),
                b'\r' => out.extend(b"\\r"),
                b'\t' => out.extend(b"\\t"),
                b'"' => out.extend(b"\\\""),
                b'\\' => out.extend(b"\\\\"),
                0..0x20 => out.extend(format!("\\u{b:04x}").bytes()),
                _ => out.push(b),
            }
        }
        out.push(b'"');
        out
    }

    #[test]
    fn every_byte_in_every_place_as_escape_json() {
        for b in 1..=255u8 {
            let mut texts = vec![vec![b], vec![b'a', b, b'z'], vec![b, b, b'x', b]];
            // Every place in the words read eight bytes at a time, beside
            // bytes of every kind.
            for at in 0..20 {
                for fill in [b'a', 0xe9, 0x7f, b' ', b'!', b'#', b'[', b']'] {
                    let mut text = vec![fill; 20];
                    text[at] = b;
                    texts.push(text);
                }
            }
            for text in texts {
                assert_eq!(quoted(&text), escape_json(&text), "byte {b:#x}");
                assert_eq!(quoted_len(&text), escape_json(&text).len());
            }
        }
    }

    #[test]
    fn integers_print_as_numeric_out() {
        let mut buf = [0; 20];
        for n in [0, 7, -7, 10, 1234567890, i64::MAX, i64::MIN] {
            assert_eq!(integer(n, &mut buf), n.to_string().as_bytes());
        }
    }

    #[test]
    fn length_is_exact() {
        let all: Vec<u8> = (1..=255).collect();
        let mut out = vec![0; quoted_len(&all)];
        assert_eq!(write_quoted(&all, &mut out), out.len());
    }
}
