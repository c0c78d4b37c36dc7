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
//!
//! # Layout
//!
//! This file holds the type, its invariants and accessors; the rest is split
//! by concern: `text` (parser and printer), `storage` (the varlena payload),
//! `wire` (binary send/receive), `order` (causal order and the total order),
//! `lattice` (`advance`, `bound`), `range` (`in_range` helpers) and `reader`
//! (the bounds-checked byte cursor of `storage` and `wire`). Tests of the
//! public API are in `core/tests/token_*.rs`.

mod lattice;
pub mod legacy;
mod order;
mod range;
mod reader;
mod storage;
mod text;
mod wire;

pub use range::{in_range, in_range_room, UNNAMED_WRITER};
pub use text::{clip_lossy, MAX_QUOTED_TEXT};

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
    /// 54000 (more instance positions than [`MAX_INSTANCES`])
    #[error("{type_name} value lists too many instance positions")]
    TooLarge {
        type_name: &'static str,
        detail: String,
    },
}

/// Most instance positions a token may list. Synapse's tokens list a few;
/// the cap keeps memory bounded for hostile input (a longer token is an
/// error, SQLSTATE 54000, before anything is allocated for it).
pub const MAX_INSTANCES: usize = 10_000;

/// The error for `count` instance positions, when above [`MAX_INSTANCES`].
/// `type_name` names the SQL type (or "token" for a constructor).
pub(crate) fn check_instance_count(type_name: &'static str, count: u64) -> Result<(), TokenError> {
    if count > MAX_INSTANCES as u64 {
        return Err(TokenError::TooLarge {
            type_name,
            detail: format!(
                "It lists {count} instance positions; at most {MAX_INSTANCES} are allowed."
            ),
        });
    }
    Ok(())
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
            TokenError::TooLarge { .. } => "54000",
        }
    }

    /// A capitalised sentence ending with `.` that says what exactly is wrong.
    pub fn detail(&self) -> &str {
        match self {
            TokenError::Syntax { detail, .. }
            | TokenError::OutOfRange { detail, .. }
            | TokenError::InvalidArgument { detail, .. }
            | TokenError::Binary { detail, .. }
            | TokenError::Corrupt { detail, .. }
            | TokenError::TooLarge { detail, .. } => detail,
        }
    }
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
        let mut instances = instances.into_iter();
        check_instance_count("token", instances.size_hint().0 as u64)?;
        // Never more than one entry past the cap is kept, whatever the
        // iterator's size hint said; the rest is only counted.
        let mut v: Vec<(i32, i64)> = instances.by_ref().take(MAX_INSTANCES + 1).collect();
        if v.len() > MAX_INSTANCES {
            let count = v.len() as u64 + instances.count() as u64;
            check_instance_count("token", count)?;
        }
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

    /// Synapse's `persisted_after`: whether `stream_id` (written by
    /// `instance_id`) is after this token's position for that writer.
    pub fn persisted_after(&self, instance_id: i32, stream_id: i64) -> bool {
        stream_id > self.instance_pos(instance_id)
    }
}
