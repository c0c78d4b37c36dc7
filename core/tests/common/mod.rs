//! Helpers shared by the token tests: constructors that panic on bad test
//! data, proptest strategies, and an independent model of the causal order.
//!
//! Each test file uses a different subset, so unused ones are expected.
#![allow(dead_code)]

use proptest::prelude::*;
use streampos_core::token::{Token, TokenKind};

/// 512 cases by default; `PROPTEST_CASES` overrides (e.g. for a long fuzz run).
pub fn config() -> ProptestConfig {
    ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(512),
    )
}

pub fn parse_ok(kind: TokenKind, s: &str) -> Token {
    match Token::parse(kind, s) {
        Ok(t) => t,
        Err(e) => panic!("{s:?} should parse as {kind:?}: {e} ({})", e.detail()),
    }
}

pub fn v(stream: i64, inst: &[(i32, i64)]) -> Token {
    Token::vector(stream, inst.iter().copied()).unwrap()
}

/// Positions near each other, sometimes at the extremes.
pub fn arb_stream() -> impl Strategy<Value = i64> {
    prop_oneof![
        8 => -20i64..20,
        1 => any::<i64>(),
        1 => prop_oneof![Just(i64::MIN), Just(i64::MAX), Just(i64::MAX - 3), Just(i64::MIN + 1)],
    ]
}

pub fn arb_live() -> impl Strategy<Value = Token> {
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

pub fn arb_hist() -> impl Strategy<Value = Token> {
    (prop_oneof![4 => -5i64..5, 1 => any::<i64>()], arb_stream())
        .prop_map(|(t, s)| Token::historical(t, s))
}

pub fn arb_room() -> impl Strategy<Value = Token> {
    prop_oneof![3 => arb_live(), 1 => arb_hist()]
}

/// Every instance ID that matters when comparing `ts` (plus one unlisted).
pub fn ids(ts: &[&Token]) -> Vec<i32> {
    let mut v: Vec<i32> = ts
        .iter()
        .flat_map(|t| t.instances().iter().map(|e| e.0))
        .collect();
    v.push(-77);
    v.sort_unstable();
    v.dedup();
    v
}

/// Independent model of the causal order: Synapse's
/// `AbstractMultiWriterStreamToken.is_before_or_eq`, transcribed (the
/// streams compare, then every instance listed in either token; the
/// topological part plays no role).
pub fn model_le(a: &Token, b: &Token) -> bool {
    if a.stream() > b.stream() {
        return false;
    }
    let listed = |t: &Token, i: i32| {
        t.instances()
            .iter()
            .find(|e| e.0 == i)
            .map_or(t.stream(), |e| e.1)
    };
    ids(&[a, b])
        .into_iter()
        .all(|i| listed(a, i) <= listed(b, i))
}

/// `s{stream}` for a historical token, the token itself for a live one: what
/// the causal order sees of it.
pub fn live_view(t: &Token) -> Token {
    if t.is_historical() {
        Token::live(t.stream())
    } else {
        t.clone()
    }
}
