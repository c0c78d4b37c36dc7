//! Replays the committed fuzz corpus (`fuzz/corpus/token_text/` and
//! `fuzz/corpus/token_binary/`) through the same checks as the cargo-fuzz
//! targets, without libFuzzer. The checks are the fuzz crate's own
//! `fuzz/src/checks.rs`, included here, so the two cannot drift apart.

#[path = "../../fuzz/src/checks.rs"]
mod checks;

use std::path::{Path, PathBuf};

use streampos_core::token::Token;

/// The files of `fuzz/corpus/<target>/`, sorted; fails if the directory is
/// missing or has no files, so that the test can never pass on nothing.
fn corpus_files(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let entries = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("fuzz corpus {} is missing: {e}", dir.display()));
    let mut files: Vec<PathBuf> = entries
        .map(|entry| entry.expect("readable corpus directory").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "fuzz corpus {} has no files",
        dir.display()
    );
    files
}

/// Runs `check` on every file of the corpus of `target`, naming the file
/// that fails.
fn replay(target: &str, check: fn(&[u8])) {
    let files = corpus_files(target);
    for path in &files {
        let data =
            std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let outcome = std::panic::catch_unwind(|| check(&data));
        if let Err(panic) = outcome {
            eprintln!("corpus file {} failed its checks", path.display());
            std::panic::resume_unwind(panic);
        }
    }
    println!("{target}: {} corpus files replayed", files.len());
}

#[test]
fn token_text_corpus() {
    replay("token_text", checks::check_text_input);
}

#[test]
fn token_binary_corpus() {
    replay("token_binary", checks::check_binary_input);
}

/// The seeds that `fuzz/examples/write_seeds.rs` writes pass the checks and
/// are valid inputs (so they keep steering the fuzzer to accepted tokens).
#[test]
fn seeds_are_valid_and_pass() {
    for text in checks::SEED_TEXTS {
        checks::check_text(text);
        assert!(
            checks::KINDS
                .iter()
                .any(|&kind| Token::parse(kind, text).is_ok()),
            "seed {text:?} is valid in no kind"
        );
    }
    for (name, bytes) in checks::seed_binaries() {
        checks::check_binary_input(&bytes);
        assert!(
            checks::KINDS
                .iter()
                .any(|&kind| Token::recv(kind, &bytes).is_ok()
                    || Token::decode(kind, &bytes).is_ok()),
            "binary seed {name} is valid in no kind"
        );
    }
}
