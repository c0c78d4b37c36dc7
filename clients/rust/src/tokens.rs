//! The two SQL token types as Rust values, with `ToSql`/`FromSql` in the
//! binary wire format of `streampos-core` (the server's own code).

use std::error::Error as StdError;
use std::fmt;
use std::ops::Deref;
use std::str::FromStr;

use bytes::{BufMut, BytesMut};
use streampos_core::token::{Token, TokenError, TokenKind};
use tokio_postgres::types::{to_sql_checked, FromSql, IsNull, ToSql, Type};

type BoxError = Box<dyn StdError + Sync + Send>;

macro_rules! token_type {
    ($name:ident, $kind:expr, $sql:literal, $doc:literal) => {
        #[doc = $doc]
        ///
        /// Dereferences to [`Token`] for reading (`stream()`, `instances()`,
        /// `is_before_or_eq`, …); `Display`/`FromStr` use the text form.
        #[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Token);

        impl $name {
            /// The SQL type name, without schema.
            pub const SQL_NAME: &'static str = $sql;

            /// Parses the text form exactly as the server does.
            pub fn parse(text: &str) -> Result<Self, TokenError> {
                Token::parse($kind, text).map($name)
            }

            /// The wrapped token.
            pub fn into_token(self) -> Token {
                self.0
            }

            /// Least upper bound (`streampos.advance`); more than
            /// `MAX_INSTANCES` positions is an error, as on the server.
            pub fn advance(&self, other: &Self) -> Result<Self, TokenError> {
                self.0.advance(&other.0).map($name)
            }

            /// Every component capped at `max_stream` (`streampos.bound`).
            pub fn bound(&self, max_stream: i64) -> Self {
                $name(self.0.bound(max_stream))
            }
        }

        impl Deref for $name {
            type Target = Token;
            fn deref(&self) -> &Token {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0.to_text($kind))
            }
        }

        impl FromStr for $name {
            type Err = TokenError;
            fn from_str(text: &str) -> Result<Self, TokenError> {
                Self::parse(text)
            }
        }

        impl<'a> FromSql<'a> for $name {
            fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Self, BoxError> {
                Ok($name(Token::recv($kind, raw)?))
            }

            fn accepts(ty: &Type) -> bool {
                ty.name() == $sql && ty.schema() == "streampos"
            }
        }

        impl ToSql for $name {
            fn to_sql(&self, _: &Type, out: &mut BytesMut) -> Result<IsNull, BoxError> {
                let mut buf = Vec::with_capacity(self.0.encoded_len() + 8);
                self.0.send(&mut buf);
                out.put_slice(&buf);
                Ok(IsNull::No)
            }

            fn accepts(ty: &Type) -> bool {
                <Self as FromSql>::accepts(ty)
            }

            to_sql_checked!();
        }
    };
}

token_type!(
    RoomStreamToken,
    TokenKind::Room,
    "room_stream_token",
    "`streampos.room_stream_token`: `s{stream}`, `t{topological}-{stream}` or `m{stream}~{id}.{pos}~…`."
);

token_type!(
    MultiWriterToken,
    TokenKind::MultiWriter,
    "multi_writer_token",
    "`streampos.multi_writer_token`: `{stream}` or `m{stream}~{id}.{pos}~…` (never historical)."
);

impl RoomStreamToken {
    /// A room token for any token (live or historical).
    pub fn new(token: Token) -> Self {
        RoomStreamToken(token)
    }

    /// The same live position as a multi-writer token (the SQL cast); a
    /// historical token has none.
    pub fn to_multi_writer(&self) -> Option<MultiWriterToken> {
        (!self.0.is_historical()).then(|| MultiWriterToken(self.0.clone()))
    }
}

impl MultiWriterToken {
    /// A multi-writer token for a live token; `None` for a historical one.
    pub fn new(token: Token) -> Option<Self> {
        (!token.is_historical()).then_some(MultiWriterToken(token))
    }

    /// A token with every writer at `stream`.
    pub fn live(stream: i64) -> Self {
        MultiWriterToken(Token::live(stream))
    }

    /// The same position as a live room token (the SQL cast).
    pub fn to_room(&self) -> RoomStreamToken {
        RoomStreamToken(self.0.clone())
    }
}
