//! The storage form: the varlena payload PostgreSQL keeps on disk.

use super::reader::Reader;
use super::{Token, TokenError, TokenKind, VectorFault, MAX_INSTANCES};

impl Token {
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
    /// Failures are [`TokenError::Corrupt`] (XX001), or
    /// [`TokenError::TooLarge`] (54000) for more than [`MAX_INSTANCES`]
    /// positions.
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
        // Only a version without the cap could have stored more; reading it
        // is refused like any other way to build such a token.
        let count = body.len() / 12;
        if count > MAX_INSTANCES {
            return Err(TokenError::TooLarge {
                type_name: kind.type_name(),
                detail: format!(
                    "The stored value lists {count} instance positions; at most {MAX_INSTANCES} are allowed."
                ),
            });
        }
        let mut instances = Vec::with_capacity(count);
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
}
