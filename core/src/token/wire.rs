//! The binary wire form (send/receive, `COPY … (FORMAT binary)`).

use super::reader::Reader;
use super::{normalise_vector, Token, TokenError, TokenKind};

impl Token {
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
        super::check_instance_count(kind.type_name(), u64::from(count))?;
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
