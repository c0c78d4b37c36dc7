//! The text form: the parser (Synapse-compatible, see the module docs of
//! [`super`]) and the printer.

use super::{normalise_vector, Token, TokenError, TokenKind};

/// Longest offending text quoted in a message, in bytes.
pub const MAX_QUOTED_TEXT: usize = 200;
/// Longest number quoted in a detail, in bytes.
const MAX_QUOTED_NUMBER: usize = 40;

/// `bytes` as a message may quote them: at most `max` bytes of text, cut on
/// a character boundary, with `...` appended when cut. Bytes that are not
/// UTF-8 (input in a `SQL_ASCII` or `LATIN1` database) are shown as U+FFFD,
/// which counts its 3 bytes against `max`. Reads no further than the part
/// it shows, so the cost is bounded whatever the input's length.
pub fn clip_lossy(bytes: &[u8], max: usize) -> String {
    let mut out = String::with_capacity(max.min(bytes.len().saturating_mul(3)) + 3);
    for chunk in bytes.utf8_chunks() {
        let invalid = (!chunk.invalid().is_empty()).then_some(char::REPLACEMENT_CHARACTER);
        for c in chunk.valid().chars().chain(invalid) {
            if out.len() + c.len_utf8() > max {
                out.push_str("...");
                return out;
            }
            out.push(c);
        }
    }
    out
}

/// `text` cut to at most `max` bytes on a char boundary, with `...` appended
/// when cut.
fn clip(text: &str, max: usize) -> String {
    clip_lossy(text.as_bytes(), max)
}

impl Token {
    /// Parses the text form of `kind` (Synapse-compatible, see module docs).
    pub fn parse(kind: TokenKind, text: &str) -> Result<Token, TokenError> {
        parse_inner(kind, text).map_err(|f| f.into_error(kind, text))
    }

    /// [`Token::parse`] of bytes in any server encoding: bytes that are not
    /// UTF-8 are not ASCII either, so no token has them; the error quotes
    /// the input clipped like every other.
    pub fn parse_bytes(kind: TokenKind, bytes: &[u8]) -> Result<Token, TokenError> {
        match std::str::from_utf8(bytes) {
            Ok(text) => Token::parse(kind, text),
            Err(e) => {
                let at = e.valid_up_to();
                let byte = bytes.get(at).copied().unwrap_or(0);
                Err(TokenError::Syntax {
                    type_name: kind.type_name(),
                    text: clip_lossy(bytes, MAX_QUOTED_TEXT),
                    detail: format!(
                        "Byte {} (0x{byte:02x}) is not valid UTF-8; a token is ASCII.",
                        at + 1
                    ),
                })
            }
        }
    }

    /// Appends the canonical text form to `out`. A historical token given
    /// with [`TokenKind::MultiWriter`] (which the caller must not do) is
    /// written as its live form `{stream}`.
    pub fn write_text(&self, kind: TokenKind, out: &mut String) {
        out.reserve(self.text_len(kind));
        self.write_text_reserved(kind, out);
    }

    /// [`Token::write_text`] without the up-front reservation.
    fn write_text_reserved(&self, kind: TokenKind, out: &mut String) {
        match (kind, self.topological) {
            (TokenKind::Room, Some(topo)) => {
                out.push('t');
                push_i64(out, topo);
                out.push('-');
                push_i64(out, self.stream);
            }
            (TokenKind::MultiWriter, Some(_)) => push_i64(out, self.stream),
            (TokenKind::Room, None) if self.instances.is_empty() => {
                out.push('s');
                push_i64(out, self.stream);
            }
            (TokenKind::MultiWriter, None) if self.instances.is_empty() => {
                push_i64(out, self.stream);
            }
            (_, None) => {
                out.push('m');
                push_i64(out, self.stream);
                for &(id, pos) in &self.instances {
                    out.push('~');
                    push_i64(out, i64::from(id));
                    out.push('.');
                    push_i64(out, pos);
                }
            }
        }
    }

    /// The canonical text form as a new `String`.
    pub fn to_text(&self, kind: TokenKind) -> String {
        let mut s = String::with_capacity(self.text_len(kind));
        self.write_text_reserved(kind, &mut s);
        s
    }

    /// The exact length in bytes of the canonical text form (what
    /// [`Token::write_text`] appends).
    pub fn text_len(&self, kind: TokenKind) -> usize {
        match (kind, self.topological) {
            (TokenKind::Room, Some(topo)) => 2 + dec_len(topo) + dec_len(self.stream),
            (TokenKind::MultiWriter, Some(_)) => dec_len(self.stream),
            (TokenKind::Room, None) if self.instances.is_empty() => 1 + dec_len(self.stream),
            (TokenKind::MultiWriter, None) if self.instances.is_empty() => dec_len(self.stream),
            (_, None) => {
                1 + dec_len(self.stream)
                    + self
                        .instances
                        .iter()
                        .map(|&(id, pos)| 2 + dec_len(i64::from(id)) + dec_len(pos))
                        .sum::<usize>()
            }
        }
    }
}

/// Number of bytes of the decimal form of `v`.
fn dec_len(v: i64) -> usize {
    let digits = v
        .unsigned_abs()
        .checked_ilog10()
        .map_or(1, |l| l as usize + 1);
    digits + usize::from(v < 0)
}

/// The two-digit decimal forms of 0..=99, concatenated. A `&str`, so that
/// digits are appended with `push_str` and neither a UTF-8 check nor
/// `unsafe` (appending bytes to a `String` needs one or the other); ASCII, so
/// every offset is a char boundary.
const PAIRS: &str = "\
0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";

/// The two digits of `pair` (0..=99).
#[inline(always)]
fn pair(pair: u64) -> &'static str {
    let at = pair as usize * 2;
    PAIRS.get(at..at + 2).unwrap_or("00")
}

/// Appends exactly 8 digits of `n` (< 10^8), with leading zeros.
#[inline(always)]
fn push_8_digits(out: &mut String, n: u64) {
    let (hi, lo) = (n / 10_000, n % 10_000);
    out.push_str(pair(hi / 100));
    out.push_str(pair(hi % 100));
    out.push_str(pair(lo / 100));
    out.push_str(pair(lo % 100));
}

/// Appends `n` (< 10^8) without leading zeros.
#[inline(always)]
fn push_up_to_8_digits(out: &mut String, n: u64) {
    let mut digits = [0u64; 4];
    let mut k = 0;
    let mut rest = n;
    while rest >= 100 {
        digits[k] = rest % 100;
        rest /= 100;
        k += 1;
    }
    if rest >= 10 {
        out.push_str(pair(rest));
    } else {
        out.push_str(pair(rest).get(1..).unwrap_or("0"));
    }
    while k > 0 {
        k -= 1;
        out.push_str(pair(digits[k]));
    }
}

/// Appends the decimal form of `v`, two digits at a time, most significant
/// first: the number is cut into 8-digit chunks by constant divisors.
fn push_i64(out: &mut String, v: i64) {
    if v < 0 {
        out.push('-');
    }
    let n = v.unsigned_abs();
    if n < 100_000_000 {
        push_up_to_8_digits(out, n);
    } else if n < 10_000_000_000_000_000 {
        push_up_to_8_digits(out, n / 100_000_000);
        push_8_digits(out, n % 100_000_000);
    } else {
        push_up_to_8_digits(out, n / 10_000_000_000_000_000);
        push_8_digits(out, n / 100_000_000 % 100_000_000);
        push_8_digits(out, n % 100_000_000);
    }
}

// ------------------------------------------------------------------ parser

/// A parse failure before the text and type are attached.
enum Fail {
    Syntax(String),
    Range(String),
    TooLarge(u64),
}

impl Fail {
    fn into_error(self, kind: TokenKind, text: &str) -> TokenError {
        let type_name = kind.type_name();
        let text = clip(text, MAX_QUOTED_TEXT);
        match self {
            Fail::Syntax(detail) => TokenError::Syntax {
                type_name,
                text,
                detail,
            },
            Fail::Range(detail) => TokenError::OutOfRange {
                type_name,
                text,
                detail,
            },
            Fail::TooLarge(count) => super::check_instance_count(type_name, count)
                .err()
                .unwrap_or_else(|| TokenError::TooLarge {
                    type_name,
                    detail: format!("It lists {count} instance positions."),
                }),
        }
    }
}

/// What is at byte `i`: `"c"` (the character, escaped) or `end of input`.
fn found_at(text: &str, i: usize) -> String {
    match text.get(i..).and_then(|s| s.chars().next()) {
        Some(c) => format!("\"{}\"", c.escape_debug()),
        None => "end of input".to_owned(),
    }
}

/// A scanned decimal number: sign, magnitude (saturated flag on u64
/// overflow) and where it was.
struct Num {
    start: usize,
    end: usize,
    neg: bool,
    mag: u64,
    overflow: bool,
}

impl Num {
    fn to_i64(&self) -> Option<i64> {
        if self.overflow {
            return None;
        }
        if self.neg {
            if self.mag == 1 << 63 {
                Some(i64::MIN)
            } else {
                i64::try_from(self.mag).ok().map(|m| -m)
            }
        } else {
            i64::try_from(self.mag).ok()
        }
    }

    fn to_i32(&self) -> Option<i32> {
        self.to_i64().and_then(|v| i32::try_from(v).ok())
    }
}

/// The one-pass parser state: the text, its bytes, the cursor, and the first
/// out-of-range number seen (reported only if the grammar is fine).
struct Parser<'a> {
    text: &'a str,
    b: &'a [u8],
    i: usize,
    range: Option<String>,
}

impl<'a> Parser<'a> {
    fn new(text: &'a str) -> Self {
        Parser {
            text,
            b: text.as_bytes(),
            i: 0,
            range: None,
        }
    }

    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn found(&self) -> String {
        found_at(self.text, self.i)
    }

    /// `-`? digit+ at the cursor; `what` names it in the error.
    #[inline]
    fn number(&mut self, what: &str) -> Result<Num, Fail> {
        let b = self.b;
        let start = self.i;
        let neg = b.get(start) == Some(&b'-');
        let digits_start = start + usize::from(neg);
        let mut i = digits_start;
        // Up to 19 digits cannot overflow a u64, so accumulate unchecked
        // (wrapping) and redo the rare longer numbers with checks.
        let mut mag: u64 = 0;
        while let Some(&c) = b.get(i) {
            let d = c.wrapping_sub(b'0');
            if d > 9 {
                break;
            }
            mag = mag.wrapping_mul(10).wrapping_add(u64::from(d));
            i += 1;
        }
        self.i = i;
        if i == digits_start {
            return Err(self.number_missing(neg, what));
        }
        let mut overflow = false;
        if i - digits_start > 19 {
            mag = 0;
            for &c in b.get(digits_start..i).unwrap_or(&[]) {
                match mag
                    .checked_mul(10)
                    .and_then(|m| m.checked_add(u64::from(c.wrapping_sub(b'0'))))
                {
                    Some(m) => mag = m,
                    None => {
                        overflow = true;
                        break;
                    }
                }
            }
        }
        Ok(Num {
            start,
            end: i,
            neg,
            mag,
            overflow,
        })
    }

    #[cold]
    #[inline(never)]
    fn number_missing(&self, neg: bool, what: &str) -> Fail {
        Fail::Syntax(if neg {
            format!(
                "Expected a digit after \"-\" in {what} at byte {}, found {}.",
                self.i + 1,
                self.found()
            )
        } else {
            format!(
                "Expected {what} at byte {}, found {}.",
                self.i + 1,
                self.found()
            )
        })
    }

    fn note_range(&mut self, n: &Num, bits: u32) {
        if self.range.is_none() {
            let digits = self.text.get(n.start..n.end).unwrap_or("");
            let label = if bits == 32 { "Instance ID" } else { "Number" };
            self.range = Some(format!(
                "{label} \"{}\" at byte {} does not fit in a signed {bits}-bit integer.",
                clip(digits, MAX_QUOTED_NUMBER),
                n.start + 1
            ));
        }
    }

    /// A number converted to i64 (0 after noting an overflow).
    fn i64(&mut self, what: &str) -> Result<i64, Fail> {
        let n = self.number(what)?;
        Ok(n.to_i64().unwrap_or_else(|| {
            self.note_range(&n, 64);
            0
        }))
    }

    /// A number converted to i32 (0 after noting an overflow).
    fn i32(&mut self, what: &str) -> Result<i32, Fail> {
        let n = self.number(what)?;
        Ok(n.to_i32().unwrap_or_else(|| {
            self.note_range(&n, 32);
            0
        }))
    }

    /// The grammar is complete: fail on anything left, else report a pending
    /// range error.
    fn end(&mut self, after: &str) -> Result<(), Fail> {
        if self.i < self.b.len() {
            return Err(Fail::Syntax(format!(
                "Unexpected character {} at byte {} after {after}; expected end of input.",
                self.found(),
                self.i + 1
            )));
        }
        self.range_ok()
    }

    fn range_ok(&mut self) -> Result<(), Fail> {
        match self.range.take() {
            Some(d) => Err(Fail::Range(d)),
            None => Ok(()),
        }
    }

    /// `{stream}(~{id}.{pos})*~?` after the `m`.
    fn vector(&mut self) -> Result<Token, Fail> {
        let stream = self.i64("the stream position")?;
        let tildes = self
            .b
            .get(self.i..)
            .map_or(0, |r| r.iter().filter(|&&c| c == b'~').count());
        // One trailing `~` may be empty; beyond the cap, refuse before
        // allocating anything for the entries.
        // A trailing `~` is the one empty entry allowed, not an entry.
        let trailing = usize::from(self.b.last() == Some(&b'~'));
        let entries = tildes.saturating_sub(trailing) as u64;
        if entries > super::MAX_INSTANCES as u64 {
            return Err(Fail::TooLarge(entries));
        }
        let mut instances = Vec::with_capacity(tildes);
        loop {
            match self.peek() {
                None => break,
                Some(b'~') => {
                    self.i += 1;
                    match self.peek() {
                        // One empty trailing entry (`m5~`, `m5~2.7~`).
                        None => break,
                        Some(b'~') => {
                            return Err(Fail::Syntax(format!(
                                "Empty entry before byte {}; only a single empty entry at the end is accepted.",
                                self.i + 1
                            )))
                        }
                        Some(_) => {}
                    }
                    let id = self.i32("an instance ID")?;
                    if self.peek() != Some(b'.') {
                        return Err(Fail::Syntax(format!(
                            "Expected \".\" after the instance ID at byte {}, found {}.",
                            self.i + 1,
                            self.found()
                        )));
                    }
                    self.i += 1;
                    let pos = self.i64("a position")?;
                    instances.push((id, pos));
                }
                Some(_) => {
                    return Err(Fail::Syntax(format!(
                        "Unexpected character {} at byte {}; expected \"~\" and an entry, or end of input.",
                        self.found(),
                        self.i + 1
                    )))
                }
            }
        }
        self.range_ok()?;
        normalise_vector(stream, &mut instances).map_err(|f| Fail::Syntax(f.sentence()))?;
        Ok(Token {
            topological: None,
            stream,
            instances,
        })
    }
}

fn parse_inner(kind: TokenKind, text: &str) -> Result<Token, Fail> {
    let mut p = Parser::new(text);
    let Some(first) = p.peek() else {
        return Err(Fail::Syntax(match kind {
            TokenKind::Room => {
                "The input is empty; a room stream token is \"s\", \"t\" or \"m\" followed by numbers."
            }
            TokenKind::MultiWriter => {
                "The input is empty; a multi-writer token is a number, or \"m\" followed by numbers."
            }
        }
        .to_owned()));
    };
    match (kind, first) {
        (TokenKind::Room, b's') => {
            p.i = 1;
            let stream = p.i64("the stream position")?;
            p.end("the stream position")?;
            Ok(Token::live(stream))
        }
        (TokenKind::Room, b't') => {
            p.i = 1;
            let topo = p.i64("the topological position")?;
            if p.peek() != Some(b'-') {
                return Err(Fail::Syntax(format!(
                    "Expected \"-\" and the stream position after the topological position at byte {}, found {}.",
                    p.i + 1,
                    p.found()
                )));
            }
            p.i += 1;
            let stream = p.i64("the stream position")?;
            p.end("the stream position")?;
            Ok(Token::historical(topo, stream))
        }
        (_, b'm') => {
            p.i = 1;
            p.vector()
        }
        (TokenKind::MultiWriter, b'-' | b'0'..=b'9') => {
            let stream = p.i64("the stream position")?;
            p.end("the stream position")?;
            Ok(Token::live(stream))
        }
        (TokenKind::Room, _) => Err(Fail::Syntax(format!(
            "Unexpected character {} at byte 1; a room stream token starts with \"s\", \"t\" or \"m\".",
            p.found()
        ))),
        (TokenKind::MultiWriter, _) => Err(Fail::Syntax(format!(
            "Unexpected character {} at byte 1; a multi-writer token is a number or starts with \"m\".",
            p.found()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_i64_matches_std() {
        for x in [
            0,
            1,
            -1,
            9,
            10,
            99,
            100,
            101,
            999,
            1000,
            12345,
            -12345,
            i64::MAX,
            i64::MIN,
            i64::MAX - 1,
            i64::MIN + 1,
            1_000_000_000_000_000_000,
        ]
        .into_iter()
        // Every digit count, at both ends, on both sides of zero: the chunk
        // boundaries at 8 and 16 digits included.
        .chain((0..19).flat_map(|e| {
            let p = 10i64.pow(e);
            [
                p - 1,
                p,
                p + 1,
                -p,
                -(p - 1),
                p.checked_mul(10).map_or(i64::MAX, |q| q - 1),
            ]
        })) {
            let mut s = String::new();
            push_i64(&mut s, x);
            assert_eq!(s, x.to_string());
            assert_eq!(dec_len(x), s.len());
        }
    }
}
