//! Synapse stream tokens: `streampos.room_stream_token` and
//! `streampos.multi_writer_token`.
//!
//! One [`Token`] value serves both SQL types; the [`TokenKind`] passed to the
//! text, storage and wire functions says which grammar applies.
//!
//! A token is either
//!
//! - **live**: a minimum `stream` position plus a vector of writers that are
//!   ahead of it (`s5`, `m5~2.7~3.9`, or for multi-writer tokens `5`,
//!   `m5~2.7`). The position of writer `i` is its listed position, else
//!   `stream`.
//! - **historical** (room tokens only): `t{topological}-{stream}`, with no
//!   vector.
//!
//! Invariants of every constructed token: the listed instances are sorted by
//! ID ascending, the IDs are distinct, every listed position is strictly
//! greater than `stream`, and a historical token lists no instances. So two
//! tokens are equal exactly when their canonical texts are equal, and
//! [`Token::encode`] gives identical bytes for equal tokens.
//!
//! # Decisions beyond Synapse's own parser
//!
//! - Numbers are an optional `-` followed by one or more ASCII digits; leading
//!   zeros are accepted (`s007` is `s7`, `s-0` is `s0`) and printed
//!   canonically. No `+`, spaces or underscores (Python's `int()` would take
//!   them).
//! - The topological part may be negative (`t-3-4`), and a multi-writer token
//!   may be negative (`-5`), for backward streams.
//! - Error precedence: a grammar error (anywhere in the text) wins over an
//!   out-of-range number (22003), which wins over a semantic error (a listed
//!   position not greater than the minimum, or an instance listed twice). The
//!   first error of a class in reading order is reported.
//! - Byte positions in error details are 1-based.

use std::cmp::Ordering;

/// Which of the two SQL token types a text, storage or wire form belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    /// `streampos.room_stream_token` (`s…`, `t…-…`, `m…`).
    Room,
    /// `streampos.multi_writer_token` (`{stream}`, `m…`).
    MultiWriter,
}

impl TokenKind {
    /// The SQL type name (without schema) used in error messages.
    pub fn type_name(self) -> &'static str {
        match self {
            TokenKind::Room => "room_stream_token",
            TokenKind::MultiWriter => "multi_writer_token",
        }
    }
}

/// Errors of token input, construction and decoding. Each maps to one
/// SQLSTATE ([`TokenError::sqlstate`]) and carries a detail sentence
/// ([`TokenError::detail`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// 22P02
    #[error("invalid input syntax for type {type_name}: \"{text}\"")]
    Syntax {
        type_name: &'static str,
        text: String,
        detail: String,
    },
    /// 22003
    #[error("value out of range for type {type_name}: \"{text}\"")]
    OutOfRange {
        type_name: &'static str,
        text: String,
        detail: String,
    },
    /// 22023 (constructors / functions given bad arguments)
    #[error("{message}")]
    InvalidArgument { message: String, detail: String },
    /// 22P03 (binary receive)
    #[error("invalid binary data for type {type_name}")]
    Binary {
        type_name: &'static str,
        detail: String,
    },
    /// XX001 (stored bytes that we did not write)
    #[error("corrupt stored value of type {type_name}")]
    Corrupt {
        type_name: &'static str,
        detail: String,
    },
}

impl TokenError {
    /// The PostgreSQL SQLSTATE of this error.
    pub fn sqlstate(&self) -> &'static str {
        match self {
            TokenError::Syntax { .. } => "22P02",
            TokenError::OutOfRange { .. } => "22003",
            TokenError::InvalidArgument { .. } => "22023",
            TokenError::Binary { .. } => "22P03",
            TokenError::Corrupt { .. } => "XX001",
        }
    }

    /// A capitalised sentence ending with `.` that says what exactly is wrong.
    pub fn detail(&self) -> &str {
        match self {
            TokenError::Syntax { detail, .. }
            | TokenError::OutOfRange { detail, .. }
            | TokenError::InvalidArgument { detail, .. }
            | TokenError::Binary { detail, .. }
            | TokenError::Corrupt { detail, .. } => detail,
        }
    }
}

/// Longest offending text quoted in a message, in bytes.
const MAX_QUOTED_TEXT: usize = 200;
/// Longest number quoted in a detail, in bytes.
const MAX_QUOTED_NUMBER: usize = 40;

/// `text` cut to at most `max` bytes on a char boundary, with `...` appended
/// when cut.
fn clip(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut s = String::with_capacity(end + 3);
    s.push_str(text.get(..end).unwrap_or(""));
    s.push_str("...");
    s
}

/// A Synapse stream token (live or historical); see the module docs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Token {
    topological: Option<i64>,
    stream: i64,
    instances: Vec<(i32, i64)>,
}

/// A violated vector invariant, reported as different variants by the
/// different entry points.
enum VectorFault {
    NotGreater { id: i32, pos: i64, stream: i64 },
    Duplicate { id: i32 },
}

impl VectorFault {
    /// Lower-case message form (for 22023).
    fn message(&self) -> String {
        match self {
            VectorFault::NotGreater { id, pos, stream } => {
                format!("position {pos} of instance {id} is not greater than the minimum {stream}")
            }
            VectorFault::Duplicate { id } => format!("instance {id} is listed twice"),
        }
    }

    /// Sentence form (for details).
    fn sentence(&self) -> String {
        match self {
            VectorFault::NotGreater { id, pos, stream } => {
                format!("Position {pos} of instance {id} is not greater than the minimum {stream}.")
            }
            VectorFault::Duplicate { id } => format!("Instance {id} is listed twice."),
        }
    }
}

/// Checks that every position is greater than `stream` (first offender in
/// the given order), then sorts by ID if needed and checks the IDs are
/// distinct.
fn normalise_vector(stream: i64, v: &mut [(i32, i64)]) -> Result<(), VectorFault> {
    if let Some(&(id, pos)) = v.iter().find(|e| e.1 <= stream) {
        return Err(VectorFault::NotGreater { id, pos, stream });
    }
    if v.windows(2).all(|w| w[0].0 < w[1].0) {
        return Ok(());
    }
    v.sort_unstable_by_key(|e| e.0);
    match v.windows(2).find(|w| w[0].0 == w[1].0) {
        Some(w) => Err(VectorFault::Duplicate { id: w[0].0 }),
        None => Ok(()),
    }
}

impl Token {
    /// A live token with no writer ahead of `stream` (`s{stream}`).
    pub fn live(stream: i64) -> Token {
        Token {
            topological: None,
            stream,
            instances: Vec::new(),
        }
    }

    /// A historical token `t{topological}-{stream}`.
    pub fn historical(topological: i64, stream: i64) -> Token {
        Token {
            topological: Some(topological),
            stream,
            instances: Vec::new(),
        }
    }

    /// A live token with the given writers ahead of `stream`, in any order.
    ///
    /// Validates: ids distinct, each pos > stream; sorts. Errors are
    /// [`TokenError::InvalidArgument`] (22023), e.g. "instance 2 is listed
    /// twice" / "position 3 of instance 2 is not greater than the minimum 5".
    pub fn vector(
        stream: i64,
        instances: impl IntoIterator<Item = (i32, i64)>,
    ) -> Result<Token, TokenError> {
        let mut v: Vec<(i32, i64)> = instances.into_iter().collect();
        match normalise_vector(stream, &mut v) {
            Ok(()) => Ok(Token {
                topological: None,
                stream,
                instances: v,
            }),
            Err(f) => {
                let detail = match f {
                    VectorFault::NotGreater { .. } => {
                        "Every listed instance position must be greater than the token's \
                         stream position (its minimum); a writer at the minimum is not listed."
                    }
                    VectorFault::Duplicate { .. } => {
                        "Each instance may appear at most once in a token."
                    }
                };
                Err(TokenError::InvalidArgument {
                    message: f.message(),
                    detail: detail.to_owned(),
                })
            }
        }
    }

    /// The minimum position: every writer not listed is here.
    pub fn stream(&self) -> i64 {
        self.stream
    }

    /// The topological position of a historical token; `None` for live ones.
    pub fn topological(&self) -> Option<i64> {
        self.topological
    }

    /// The writers ahead of the minimum, ascending by instance ID.
    pub fn instances(&self) -> &[(i32, i64)] {
        &self.instances
    }

    /// Whether this is a historical (`t…`) token.
    pub fn is_historical(&self) -> bool {
        self.topological.is_some()
    }

    /// The largest position in the token (the stream or a listed one).
    pub fn max_stream_pos(&self) -> i64 {
        self.instances
            .iter()
            .fold(self.stream, |m, &(_, p)| if p > m { p } else { m })
    }

    /// The position of writer `instance_id`: its listed position, else the
    /// stream position.
    pub fn instance_pos(&self, instance_id: i32) -> i64 {
        match self.instances.binary_search_by_key(&instance_id, |e| e.0) {
            Ok(k) => self.instances.get(k).map_or(self.stream, |e| e.1),
            Err(_) => self.stream,
        }
    }

    /// Causal partial order: every component of `self` is <= `other`'s.
    ///
    /// A live token counts as topological = +infinity, so: (historical a,
    /// live b): `a.stream <= b.stream`; (live a, historical b): false;
    /// (historical, historical): `a.topo <= b.topo && a.stream <= b.stream`;
    /// (live, live): `a.pos(i) <= b.pos(i)` for every instance `i` (which
    /// includes `a.stream <= b.stream`).
    pub fn is_before_or_eq(&self, other: &Token) -> bool {
        match (self.topological, other.topological) {
            (Some(a), Some(b)) => a <= b && self.stream <= other.stream,
            (Some(_), None) => self.stream <= other.stream,
            (None, Some(_)) => false,
            (None, None) => {
                if self.stream > other.stream {
                    return false;
                }
                // Instances listed only in `other` are at most fine: self's
                // position there is self.stream <= other.stream < theirs.
                let mut rest = other.instances.as_slice();
                for &(id, pos) in &self.instances {
                    while let Some((&(oid, _), tail)) = rest.split_first() {
                        if oid < id {
                            rest = tail;
                        } else {
                            break;
                        }
                    }
                    let theirs = match rest.first() {
                        Some(&(oid, opos)) if oid == id => opos,
                        _ => other.stream,
                    };
                    if pos > theirs {
                        return false;
                    }
                }
                true
            }
        }
    }

    /// Synapse's `persisted_after`: whether `stream_id` (written by
    /// `instance_id`) is after this token's position for that writer.
    pub fn persisted_after(&self, instance_id: i32, stream_id: i64) -> bool {
        stream_id > self.instance_pos(instance_id)
    }

    /// Least upper bound in the [`Token::is_before_or_eq`] order (Synapse's
    /// `copy_and_advance`, extended to historical tokens).
    ///
    /// live ∨ live = componentwise maximum (entries not above the new
    /// minimum dropped); historical ∨ historical = `t{max topo}-{max stream}`;
    /// historical ∨ live = the live token with every component raised to at
    /// least the historical token's stream.
    pub fn advance(&self, other: &Token) -> Token {
        match (self.topological, other.topological) {
            (Some(a), Some(b)) => Token::historical(a.max(b), self.stream.max(other.stream)),
            _ => join_live(self.stream, &self.instances, other.stream, &other.instances),
        }
    }

    /// Synapse's `bound_stream_token`: every component capped at
    /// `max_stream`; entries that fall to the minimum are dropped; the
    /// topological part is kept. Never raises a component.
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

    // ---------------------------------------------------------------- text

    /// Parses the text form of `kind` (Synapse-compatible, see module docs).
    pub fn parse(kind: TokenKind, text: &str) -> Result<Token, TokenError> {
        parse_inner(kind, text).map_err(|f| f.into_error(kind, text))
    }

    /// Appends the canonical text form to `out`. A historical token given
    /// with [`TokenKind::MultiWriter`] (which the caller must not do) is
    /// written as its live form `{stream}`.
    pub fn write_text(&self, kind: TokenKind, out: &mut String) {
        out.reserve(self.text_len_bound());
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
        let mut s = String::with_capacity(self.text_len_bound());
        self.write_text_reserved(kind, &mut s);
        s
    }

    /// An upper bound of [`Token::text_len`] that is cheaper to compute:
    /// 20 bytes per i64, 11 per i32, plus separators.
    fn text_len_bound(&self) -> usize {
        2 + 20 + 20 + self.instances.len().saturating_mul(1 + 11 + 1 + 20)
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

    // ------------------------------------------------------------- storage

    /// Appends the compact storage form (the varlena payload, header
    /// excluded), little-endian, no alignment: byte 0 flags (bit 0 =
    /// historical, other bits 0); stream i64; topological i64 if historical;
    /// then (i32 id, i64 pos) pairs to the end, ascending by id. Equal tokens
    /// give identical bytes.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.reserve(self.encoded_len());
        out.push(u8::from(self.topological.is_some()));
        out.extend_from_slice(&self.stream.to_le_bytes());
        if let Some(topo) = self.topological {
            out.extend_from_slice(&topo.to_le_bytes());
        }
        for &(id, pos) in &self.instances {
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(&pos.to_le_bytes());
        }
    }

    /// The number of bytes [`Token::encode`] appends.
    pub fn encoded_len(&self) -> usize {
        1 + 8 + if self.topological.is_some() { 8 } else { 0 } + 12 * self.instances.len()
    }

    /// Reads the storage form written by [`Token::encode`], validating
    /// everything (length, flags, strictly ascending ids, pos > stream, no
    /// pairs when historical, not historical for multi-writer tokens).
    /// Failures are [`TokenError::Corrupt`] (XX001).
    pub fn decode(kind: TokenKind, bytes: &[u8]) -> Result<Token, TokenError> {
        let corrupt = |detail: String| TokenError::Corrupt {
            type_name: kind.type_name(),
            detail,
        };
        let mut r = Reader(bytes);
        let Some(flags) = r.u8() else {
            return Err(corrupt(
                "The stored value is empty; it needs at least 9 bytes.".to_owned(),
            ));
        };
        if flags & !1 != 0 {
            return Err(corrupt(format!(
                "The flags byte 0x{flags:02x} has unknown bits set; only bit 0 (historical) is defined."
            )));
        }
        let historical = flags & 1 != 0;
        if historical && kind == TokenKind::MultiWriter {
            return Err(corrupt(
                "The stored value is a historical token, which a multi-writer token cannot be."
                    .to_owned(),
            ));
        }
        let need = if historical { 17 } else { 9 };
        let (Some(stream), Some(topological)) = (
            r.i64_le(),
            if historical {
                r.i64_le().map(Some)
            } else {
                Some(None)
            },
        ) else {
            return Err(corrupt(format!(
                "The stored value is {} bytes long; it needs at least {need}.",
                bytes.len()
            )));
        };
        let body = r.0;
        if historical && !body.is_empty() {
            return Err(corrupt(format!(
                "A stored historical token has {} bytes after its header; it carries no instance positions.",
                body.len()
            )));
        }
        if body.len() % 12 != 0 {
            return Err(corrupt(format!(
                "The stored instance positions take {} bytes, which is not a multiple of 12.",
                body.len()
            )));
        }
        let mut instances = Vec::with_capacity(body.len() / 12);
        let mut prev: Option<i32> = None;
        let mut pairs = Reader(body);
        while let (Some(id), Some(pos)) = (pairs.i32_le(), pairs.i64_le()) {
            if let Some(p) = prev {
                if id <= p {
                    return Err(corrupt(format!(
                        "The stored instance IDs are not strictly ascending: {id} follows {p}."
                    )));
                }
            }
            if pos <= stream {
                return Err(corrupt(
                    VectorFault::NotGreater { id, pos, stream }.sentence(),
                ));
            }
            prev = Some(id);
            instances.push((id, pos));
        }
        Ok(Token {
            topological,
            stream,
            instances,
        })
    }

    // ---------------------------------------------------------------- wire

    /// Appends the binary wire form (send/recv), big-endian: byte 0 version
    /// = 1; byte 1 kind (0 = live, 1 = historical); stream i64; topological
    /// i64 if historical; u32 count; count × (i32 id, i64 pos), ascending.
    pub fn send(&self, out: &mut Vec<u8>) {
        out.reserve(2 + 8 + 8 + 4 + 12 * self.instances.len());
        out.push(WIRE_VERSION);
        out.push(u8::from(self.topological.is_some()));
        out.extend_from_slice(&self.stream.to_be_bytes());
        if let Some(topo) = self.topological {
            out.extend_from_slice(&topo.to_be_bytes());
        }
        let count = u32::try_from(self.instances.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&count.to_be_bytes());
        for &(id, pos) in &self.instances {
            out.extend_from_slice(&id.to_be_bytes());
            out.extend_from_slice(&pos.to_be_bytes());
        }
    }

    /// Reads the binary wire form, validating exactly like text input (pairs
    /// in any order; distinct ids; pos > stream; exact length). The count is
    /// checked against the remaining length before anything is allocated.
    /// Failures are [`TokenError::Binary`] (22P03).
    pub fn recv(kind: TokenKind, bytes: &[u8]) -> Result<Token, TokenError> {
        let bad = |detail: String| TokenError::Binary {
            type_name: kind.type_name(),
            detail,
        };
        let mut r = Reader(bytes);
        let Some(version) = r.u8() else {
            return Err(bad(
                "The message is empty; it must start with the format version byte 1.".to_owned(),
            ));
        };
        if version != WIRE_VERSION {
            return Err(bad(format!(
                "Unsupported binary format version {version}; only version {WIRE_VERSION} exists."
            )));
        }
        let Some(kind_byte) = r.u8() else {
            return Err(bad(
                "The message ends after the version byte; a kind byte must follow.".to_owned(),
            ));
        };
        let historical = match kind_byte {
            0 => false,
            1 => true,
            k => {
                return Err(bad(format!(
                    "Unknown token kind byte {k}; expected 0 (live) or 1 (historical)."
                )))
            }
        };
        if historical && kind == TokenKind::MultiWriter {
            return Err(bad(
                "A multi-writer token cannot be historical (kind byte 1).".to_owned(),
            ));
        }
        let need = if historical { 22 } else { 14 };
        let (Some(stream), Some(topological), Some(count)) = (
            r.i64_be(),
            if historical {
                r.i64_be().map(Some)
            } else {
                Some(None)
            },
            r.u32_be(),
        ) else {
            return Err(bad(format!(
                "The message is {} bytes long; its header needs {need}.",
                bytes.len()
            )));
        };
        if historical && count != 0 {
            return Err(bad(format!(
                "A historical token carries no instance positions, but the message lists {count}."
            )));
        }
        let remaining = r.0.len() as u64;
        if remaining != u64::from(count) * 12 {
            return Err(bad(format!(
                "The message lists {count} instance positions, which take {} bytes, but {remaining} bytes follow.",
                u64::from(count) * 12
            )));
        }
        // `count` is now bounded by the actual length of the message.
        let mut instances = Vec::with_capacity(r.0.len() / 12);
        while let (Some(id), Some(pos)) = (r.i32_be(), r.i64_be()) {
            instances.push((id, pos));
        }
        if let Err(f) = normalise_vector(stream, &mut instances) {
            return Err(bad(f.sentence()));
        }
        Ok(Token {
            topological,
            stream,
            instances,
        })
    }
}

/// The binary wire format version written by [`Token::send`].
const WIRE_VERSION: u8 = 1;

/// The join of two live views (stream, sorted distinct entries all above
/// stream): componentwise maximum, entries not above the new stream dropped.
fn join_live(s1: i64, a: &[(i32, i64)], s2: i64, b: &[(i32, i64)]) -> Token {
    let stream = s1.max(s2);
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
    Token {
        topological: None,
        stream,
        instances: out,
    }
}

/// The total order on tokens, which extends [`Token::is_before_or_eq`] and
/// is consistent with `Eq`.
///
/// The key is, lexicographically:
/// 1. the topological part, with live tokens counting as +infinity (so every
///    historical token sorts before every live one);
/// 2. the stream position (the minimum);
/// 3. the sum over listed entries of `pos - stream`, as `i128` (the total
///    "excess" of the writers ahead of the minimum);
/// 4. the instances slice, lexicographically.
///
/// *Proof sketch that it extends the causal order.* Suppose
/// `a.is_before_or_eq(b)`. If `a` is historical and `b` live, `a` sorts
/// first by (1). If both are historical, `a.topo <= b.topo` and
/// `a.stream <= b.stream`, and both have excess 0 and no instances, so
/// `a <= b`. (`a` live and `b` historical never happens.) If both are live,
/// (1) ties and `a.stream <= b.stream`; when the streams are equal, every
/// writer's excess `pos(i) - stream` in `a` is at most that in `b` (unlisted
/// writers have excess 0), so the sum in `a` is at most the sum in `b`, with
/// equality only when every excess is equal, i.e. when `a == b`.
///
/// *Total and consistent with `Eq`:* the key contains every field of the
/// token (3 is a function of 2 and 4), so equal keys mean equal tokens, and
/// lexicographic comparison of totally ordered parts is a total order.
impl Ord for Token {
    fn cmp(&self, other: &Self) -> Ordering {
        let topo = match (self.topological, other.topological) {
            (Some(a), Some(b)) => a.cmp(&b),
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (None, None) => Ordering::Equal,
        };
        topo.then(self.stream.cmp(&other.stream))
            .then_with(|| excess(self).cmp(&excess(other)))
            .then_with(|| self.instances.cmp(&other.instances))
    }
}

impl PartialOrd for Token {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Sum over listed entries of `pos - stream`.
fn excess(t: &Token) -> i128 {
    let s = i128::from(t.stream);
    t.instances.iter().map(|&(_, p)| i128::from(p) - s).sum()
}

/// Whether `stream_id`, written by `instance_id`, lies in `low < position <=
/// high` for that writer. A `None` bound is unbounded; a `None` instance uses
/// each token's stream position (its minimum).
pub fn in_range(
    low: Option<&Token>,
    high: Option<&Token>,
    instance_id: Option<i32>,
    stream_id: i64,
) -> bool {
    let pos = |t: &Token| match instance_id {
        Some(i) => t.instance_pos(i),
        None => t.stream,
    };
    if let Some(l) = low {
        if stream_id <= pos(l) {
            return false;
        }
    }
    if let Some(h) = high {
        if stream_id > pos(h) {
            return false;
        }
    }
    true
}

/// Synapse's `_filter_results` for paginating a room: for each non-`None`
/// bound, a historical bound compares `(topological, stream_id)` tuples — the
/// event is excluded if `(topo, sid) <= (low.topo, low.stream)`, or if
/// `(high.topo, high.stream) < (topo, sid)`; a live bound compares
/// `stream_id` against the writer's position (instance `None` → the token's
/// stream) as [`in_range`] does.
pub fn in_range_room(
    low: Option<&Token>,
    high: Option<&Token>,
    instance_id: Option<i32>,
    topological: i64,
    stream_id: i64,
) -> bool {
    let pos = |t: &Token| match instance_id {
        Some(i) => t.instance_pos(i),
        None => t.stream,
    };
    let event = (topological, stream_id);
    if let Some(l) = low {
        match l.topological {
            Some(lt) => {
                if event <= (lt, l.stream) {
                    return false;
                }
            }
            None => {
                if stream_id <= pos(l) {
                    return false;
                }
            }
        }
    }
    if let Some(h) = high {
        match h.topological {
            Some(ht) => {
                if (ht, h.stream) < event {
                    return false;
                }
            }
            None => {
                if pos(h) < stream_id {
                    return false;
                }
            }
        }
    }
    true
}

// ------------------------------------------------------------------ helpers

/// A cursor over untrusted bytes; every read is bounds-checked.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, tail) = self.0.split_first_chunk::<N>()?;
        self.0 = tail;
        Some(*head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    fn i64_le(&mut self) -> Option<i64> {
        self.take().map(i64::from_le_bytes)
    }
    fn i32_le(&mut self) -> Option<i32> {
        self.take().map(i32::from_le_bytes)
    }
    fn i64_be(&mut self) -> Option<i64> {
        self.take().map(i64::from_be_bytes)
    }
    fn i32_be(&mut self) -> Option<i32> {
        self.take().map(i32::from_be_bytes)
    }
    fn u32_be(&mut self) -> Option<u32> {
        self.take().map(u32::from_be_bytes)
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

const DIGIT_PAIRS: &[u8; 200] = b"\
0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";

/// Appends the decimal form of `v` without an intermediate `String`.
fn push_i64(out: &mut String, v: i64) {
    if v < 0 {
        out.push('-');
    }
    let mut n = v.unsigned_abs();
    let mut buf = [b'0'; 20];
    let mut i = buf.len();
    while n >= 100 {
        let r = (n % 100) as usize * 2;
        n /= 100;
        i -= 2;
        buf[i] = DIGIT_PAIRS[r];
        buf[i + 1] = DIGIT_PAIRS[r + 1];
    }
    if n >= 10 {
        let r = n as usize * 2;
        i -= 2;
        buf[i] = DIGIT_PAIRS[r];
        buf[i + 1] = DIGIT_PAIRS[r + 1];
    } else {
        i -= 1;
        buf[i] = b'0' + n as u8;
    }
    // SAFETY: `buf[i..]` holds only ASCII digits (b'0'..=b'9'), which is
    // valid UTF-8. (`str::from_utf8` here costs about 15% of printing.)
    out.push_str(unsafe { std::str::from_utf8_unchecked(&buf[i..]) });
}

// ------------------------------------------------------------------ parser

/// A parse failure before the text and type are attached.
enum Fail {
    Syntax(String),
    Range(String),
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

// -------------------------------------------------------------------- tests

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use TokenKind::{MultiWriter, Room};

    fn parse_ok(kind: TokenKind, s: &str) -> Token {
        match Token::parse(kind, s) {
            Ok(t) => t,
            Err(e) => panic!("{s:?} should parse as {kind:?}: {e} ({})", e.detail()),
        }
    }

    fn v(stream: i64, inst: &[(i32, i64)]) -> Token {
        Token::vector(stream, inst.iter().copied()).unwrap()
    }

    // ----------------------------------------------------------- parsing

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

    // ----------------------------------------------------------- accessors

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

    #[test]
    fn advance_examples() {
        let h = Token::historical;
        assert_eq!(h(1, 9).advance(&h(2, 3)), h(2, 9));
        assert_eq!(h(1, 9).advance(&Token::live(3)), Token::live(9));
        assert_eq!(h(1, 7).advance(&v(5, &[(1, 6), (2, 9)])), v(7, &[(2, 9)]));
        assert_eq!(
            v(5, &[(1, 8), (2, 6)]).advance(&v(6, &[(2, 7), (3, 9)])),
            v(6, &[(1, 8), (2, 7), (3, 9)])
        );
        assert_eq!(v(5, &[(1, 8)]).advance(&v(8, &[(2, 9)])), v(8, &[(2, 9)]));
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

    // ------------------------------------------------------ storage / wire

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
        ] {
            let mut s = String::new();
            push_i64(&mut s, x);
            assert_eq!(s, x.to_string());
            assert_eq!(dec_len(x), s.len());
        }
    }

    // ----------------------------------------------------------- proptest

    /// Positions near each other, sometimes at the extremes.
    fn arb_stream() -> impl Strategy<Value = i64> {
        prop_oneof![
            8 => -20i64..20,
            1 => any::<i64>(),
            1 => prop_oneof![Just(i64::MIN), Just(i64::MAX), Just(i64::MAX - 3), Just(i64::MIN + 1)],
        ]
    }

    fn arb_live() -> impl Strategy<Value = Token> {
        (
            arb_stream(),
            prop::collection::vec(
                (
                    prop_oneof![9 => 0i32..6, 1 => any::<i32>()],
                    prop_oneof![9 => 1i64..6, 1 => 1i64..i64::MAX],
                ),
                0..6,
            ),
        )
            .prop_map(|(stream, entries)| {
                let mut seen = std::collections::BTreeMap::new();
                for (id, d) in entries {
                    if let Some(pos) = stream.checked_add(d) {
                        seen.entry(id).or_insert(pos);
                    }
                }
                Token::vector(stream, seen).unwrap()
            })
    }

    fn arb_hist() -> impl Strategy<Value = Token> {
        (prop_oneof![4 => -5i64..5, 1 => any::<i64>()], arb_stream())
            .prop_map(|(t, s)| Token::historical(t, s))
    }

    fn arb_room() -> impl Strategy<Value = Token> {
        prop_oneof![3 => arb_live(), 1 => arb_hist()]
    }

    /// Every instance ID that matters when comparing `ts` (plus one unlisted).
    fn ids(ts: &[&Token]) -> Vec<i32> {
        let mut v: Vec<i32> = ts
            .iter()
            .flat_map(|t| t.instances().iter().map(|e| e.0))
            .collect();
        v.push(-77);
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Independent model of the causal order, over every relevant ID.
    fn model_le(a: &Token, b: &Token) -> bool {
        match (a.topological(), b.topological()) {
            (Some(x), Some(y)) => x <= y && a.stream() <= b.stream(),
            (Some(_), None) => a.stream() <= b.stream(),
            (None, Some(_)) => false,
            (None, None) => {
                a.stream() <= b.stream()
                    && ids(&[a, b])
                        .into_iter()
                        .all(|i| a.instance_pos(i) <= b.instance_pos(i))
            }
        }
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
        // 512 cases by default; PROPTEST_CASES overrides (e.g. for a long fuzz run).
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)
        ))]

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

        #[test]
        fn advance_is_least_upper_bound(
            a in arb_room(), b in arb_room(), c in arb_room(),
            bumps in prop::collection::vec(any::<u8>(), 0..16), hist in any::<bool>(),
        ) {
            let j = a.advance(&b);
            // Commutative, idempotent, associative.
            prop_assert_eq!(&j, &b.advance(&a));
            prop_assert_eq!(&a.advance(&a), &a);
            prop_assert_eq!(j.advance(&c), a.advance(&b.advance(&c)));
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
            // a <= b causally means the join is b.
            if a.is_before_or_eq(&b) {
                prop_assert_eq!(&j, &b);
            }
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
}
