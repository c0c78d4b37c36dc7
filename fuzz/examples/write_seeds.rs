//! Writes the seed corpus: `SEED_TEXTS` as files under `<dir>/token_text/`
//! and `seed_binaries()` under `<dir>/token_binary/`, each named `seed-…`.
//! `<dir>` is the first argument, by default this crate's `corpus/`.
//!
//! ```text
//! CARGO_TARGET_DIR=/tmp/fuzz-target cargo run --manifest-path fuzz/Cargo.toml --example write_seeds
//! ```

use std::path::PathBuf;

use streampos_fuzz::checks::{seed_binaries, SEED_TEXTS};

fn main() -> std::io::Result<()> {
    let root = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus"));
    let text_dir = root.join("token_text");
    let binary_dir = root.join("token_binary");
    std::fs::create_dir_all(&text_dir)?;
    std::fs::create_dir_all(&binary_dir)?;
    for text in SEED_TEXTS {
        let path = text_dir.join(format!("seed-{text}"));
        std::fs::write(&path, text)?;
        println!("{} ({} bytes)", path.display(), text.len());
    }
    for (name, bytes) in seed_binaries() {
        let path = binary_dir.join(format!("seed-{name}"));
        std::fs::write(&path, &bytes)?;
        println!("{} ({} bytes)", path.display(), bytes.len());
    }
    Ok(())
}
