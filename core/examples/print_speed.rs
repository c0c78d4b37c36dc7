//! Times the text output of tokens, to compare printer changes by hand:
//!
//! ```sh
//! cargo run --release -p streampos-core --example print_speed [ROUNDS]
//! ```
//!
//! Prints nanoseconds per printed token for a few token shapes: the minimum
//! over many short rounds (the round least disturbed by other processes) and
//! the median. Wall-clock numbers vary between machines and runs: compare
//! runs made one after the other on the same machine, never assert them.

use std::hint::black_box;
use std::time::Instant;

use streampos_core::token::{Token, TokenKind};

const DEFAULT_ROUNDS: usize = 101;
const PRINTS_PER_ROUND: usize = 200_000;

fn shapes() -> Vec<(&'static str, TokenKind, Vec<Token>)> {
    // Several distinct values per shape, so that the branch predictor cannot
    // learn one digit sequence.
    let live: Vec<Token> = (0..64).map(|k| Token::live(2_633_508 + k * 7919)).collect();
    let large: Vec<Token> = (0..64)
        .map(|k| Token::live(263_350_812_345 + k * 7_919_000))
        .collect();
    let small: Vec<Token> = (0..64).map(|k| Token::live(k % 10)).collect();
    let vector: Vec<Token> = (0..64)
        .map(|k| {
            let s = 56_000_000 + k * 104_729;
            Token::vector(s, [(2, s + 2 + k), (3, s + 3), (7, s + 1000 + k)]).unwrap_or_else(|e| {
                panic!("bad sample token: {e}");
            })
        })
        .collect();
    let historical: Vec<Token> = (0..64)
        .map(|k| Token::historical(426 + k, 2_633_508 + k * 31))
        .collect();
    let extreme: Vec<Token> = (0..64)
        .map(|k| Token::live(if k % 2 == 0 { i64::MIN } else { i64::MAX - k }))
        .collect();
    vec![
        ("s{7 digits}", TokenKind::Room, live),
        ("s{12 digits}", TokenKind::Room, large),
        ("s{1 digit}", TokenKind::Room, small),
        ("m{8 digits}~3 entries", TokenKind::Room, vector),
        ("t{3}-{7 digits}", TokenKind::Room, historical),
        ("{i64 extremes}", TokenKind::MultiWriter, extreme),
    ]
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(DEFAULT_ROUNDS)
        .max(1);
    let mut out = String::with_capacity(256);
    for (name, kind, tokens) in shapes() {
        let mut per_round = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let start = Instant::now();
            for k in 0..PRINTS_PER_ROUND {
                out.clear();
                black_box(&tokens[k % tokens.len()]).write_text(kind, &mut out);
                black_box(&out);
            }
            per_round.push(start.elapsed().as_nanos() as f64 / PRINTS_PER_ROUND as f64);
        }
        per_round.sort_by(f64::total_cmp);
        println!(
            "{name:<24} min {:6.2} ns/token, median {:6.2}",
            per_round[0],
            per_round[rounds / 2]
        );
    }
}
