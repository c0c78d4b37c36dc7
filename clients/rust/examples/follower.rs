//! Follow a stream's replication feed: long-poll `streampos.updates`, print
//! each row as a JSON line, and resume from the token after a reconnect (the
//! [`Follower`] does that) or after a restart (with `--token-file`).
//!
//! ```sh
//! cargo run --example follower -- --conninfo "host=/tmp dbname=synapse" --stream events \
//!     --token-file /var/tmp/events.token
//! ```
//!
//! Options: `--since TOKEN` (default `0`, or the token file's content),
//! `--max-rows N` per poll, `--poll-ms N`, `--stop-after-rows N` (exit once
//! that many rows were printed).

use std::time::Duration;

use streampos_client::{Follower, MultiWriterToken};

struct Options {
    conninfo: String,
    stream: String,
    since: Option<String>,
    token_file: Option<String>,
    max_rows: i32,
    poll: Duration,
    stop_after_rows: Option<usize>,
}

fn options() -> Result<Options, String> {
    let mut o = Options {
        conninfo: String::new(),
        stream: "events".into(),
        since: None,
        token_file: None,
        max_rows: 100,
        poll: Duration::from_secs(10),
        stop_after_rows: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--conninfo" => o.conninfo = value()?,
            "--stream" => o.stream = value()?,
            "--since" => o.since = Some(value()?),
            "--token-file" => o.token_file = Some(value()?),
            "--max-rows" => {
                o.max_rows = i32::try_from(number(value()?)?).map_err(|e| e.to_string())?
            }
            "--poll-ms" => o.poll = Duration::from_millis(number(value()?)?),
            "--stop-after-rows" => o.stop_after_rows = Some(number(value()?)? as usize),
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok(o)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let o = options().map_err(|e| format!("follower: {e}"))?;
    let saved = match &o.token_file {
        Some(path) => std::fs::read_to_string(path)
            .ok()
            .map(|t| t.trim().to_owned()),
        None => None,
    };
    let since = MultiWriterToken::parse(saved.as_deref().or(o.since.as_deref()).unwrap_or("0"))?;
    let mut follower = Follower::new(o.conninfo, o.stream, since);
    follower.max_rows = o.max_rows;
    follower.poll_timeout = o.poll;
    let mut printed = 0;
    loop {
        let answer = follower.next().await?;
        for table in &answer.tables {
            for row in &table.rows {
                let object: serde_json::Map<String, serde_json::Value> = table
                    .columns
                    .iter()
                    .cloned()
                    .zip(row.iter().cloned())
                    .collect();
                println!(
                    "{}",
                    serde_json::json!({ "table": table.table, "row": object })
                );
                printed += 1;
            }
        }
        // Rows first, then the token: a crash in between repeats rows, never
        // loses them.
        if let Some(path) = &o.token_file {
            std::fs::write(path, follower.token().to_string())?;
        }
        if answer.row_count() > 0 || follower.reconnects() > 0 {
            eprintln!(
                "token {} after {} reconnects",
                follower.token(),
                follower.reconnects()
            );
        }
        if o.stop_after_rows.is_some_and(|n| printed >= n) {
            return Ok(());
        }
    }
}
