//! Followers as load, for bench/followers_scale.py: N followers of one
//! stream in this one process (a client light enough not to be what is
//! measured), each on its own connection, until standard input closes.
//!
//! ```sh
//! cargo run --release --example follower_load -- --conninfo "host=/tmp dbname=bench" \
//!     --kind updates --followers 32 --stream s --table t
//! ```
//!
//! `--kind updates`: each is a [`Follower`] (long-polling
//! `streampos.updates_json`, prepared once). `--kind listen`: the usual
//! hand-written follower, `LISTEN <stream>` and, on each notification, the
//! rows after the last one it has up to the stream's frontier:
//! `SELECT id, at_us FROM <table> WHERE id > $1 AND id <= (SELECT
//! streampos.frontier(<stream>)) ORDER BY id LIMIT 100` (prepared).
//!
//! The table's rows are `(id, w, body, at_us)`, `at_us` the commit's
//! `clock_timestamp()` in microseconds since the epoch (this machine's
//! clock: the client runs beside the server). Prints `ready` once every
//! follower has connected and is waiting, and at the end one JSON object:
//! each follower's rows received and rows received twice, and the delivery
//! latencies (ms) of follower 0's rows.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::{stream, StreamExt};
use streampos_client::{Follower, MultiWriterToken};
use tokio_postgres::{AsyncMessage, NoTls};

struct Options {
    conninfo: String,
    kind: String,
    followers: usize,
    stream: String,
    table: String,
}

fn options() -> Result<Options, String> {
    let mut o = Options {
        conninfo: String::new(),
        kind: "updates".into(),
        followers: 1,
        stream: String::new(),
        table: String::new(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--conninfo" => o.conninfo = value,
            "--kind" => o.kind = value,
            "--followers" => o.followers = value.parse().map_err(|e| format!("{flag}: {e}"))?,
            "--stream" => o.stream = value,
            "--table" => o.table = value,
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    if o.stream.is_empty()
        || o.table.is_empty()
        || !["updates", "listen"].contains(&o.kind.as_str())
    {
        return Err("--stream, --table and --kind updates|listen are needed".into());
    }
    Ok(o)
}

#[derive(Default)]
struct Received {
    rows: usize,
    twice: usize,
    latencies_ms: Vec<f64>,
}

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

impl Received {
    fn row(&mut self, seen: &mut HashSet<i64>, id: i64, at_us: Option<i64>, timed: bool) {
        if !seen.insert(id) {
            self.twice += 1;
        }
        self.rows += 1;
        if let (true, Some(at)) = (timed, at_us) {
            self.latencies_ms.push((now_us() - at) as f64 / 1000.0);
        }
    }
}

async fn follow_updates(
    o: Arc<Options>,
    k: usize,
    ready: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
) -> Result<Received, String> {
    // From the stream's current token, read on a connection of its own.
    let (client, connection) = tokio_postgres::connect(&o.conninfo, NoTls)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    let token: String = client
        .query_one(
            "SELECT streampos.current_token($1)::text",
            &[&o.stream.as_str()],
        )
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    drop(client);
    let since = MultiWriterToken::parse(&token).map_err(|e| e.to_string())?;
    let mut follower = Follower::new(o.conninfo.clone(), o.stream.clone(), since);
    follower.poll_timeout = Duration::from_millis(1000);
    let (mut received, mut seen) = (Received::default(), HashSet::new());
    let mut first = true;
    while !stop.load(Ordering::Relaxed) {
        if first {
            // Counted as waiting once its first call is on its way.
            ready.fetch_add(1, Ordering::Relaxed);
            first = false;
        }
        let answer = follower.next().await.map_err(|e| e.to_string())?;
        for table in &answer.tables {
            for row in &table.rows {
                let id = row.first().and_then(|v| v.as_i64()).unwrap_or(-1);
                let at = row.get(3).and_then(|v| v.as_i64());
                received.row(&mut seen, id, at, k == 0);
            }
        }
    }
    Ok(received)
}

async fn follow_listen(
    o: Arc<Options>,
    k: usize,
    ready: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
) -> Result<Received, String> {
    let (client, mut connection) = tokio_postgres::connect(&o.conninfo, NoTls)
        .await
        .map_err(|e| e.to_string())?;
    // The connection's messages: notifications go to the follower.
    let (tx, mut notifications) = tokio::sync::mpsc::unbounded_channel();
    let messages = stream::poll_fn(move |cx| connection.poll_message(cx));
    tokio::spawn(async move {
        let mut messages = std::pin::pin!(messages);
        while let Some(message) = messages.next().await {
            match message {
                Ok(AsyncMessage::Notification(n)) => {
                    if tx.send(n).is_err() {
                        break;
                    }
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    });
    client
        .batch_execute(&format!("LISTEN \"{}\"", o.stream))
        .await
        .map_err(|e| e.to_string())?;
    let query = client
        .prepare(&format!(
            "SELECT id, at_us FROM \"{}\" WHERE id > $1 AND id <= (SELECT streampos.frontier($2)) \
             ORDER BY id LIMIT 100",
            o.table
        ))
        .await
        .map_err(|e| e.to_string())?;
    let mut last: i64 = client
        .query_one(
            &format!("SELECT coalesce(max(id), 0) FROM \"{}\"", o.table),
            &[],
        )
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    ready.fetch_add(1, Ordering::Relaxed);
    let (mut received, mut seen) = (Received::default(), HashSet::new());
    while !stop.load(Ordering::Relaxed) {
        match tokio::time::timeout(Duration::from_secs(1), notifications.recv()).await {
            Ok(Some(_)) => {}
            Ok(None) => return Err("the connection closed".into()),
            Err(_) => continue,
        }
        // Every notification queued by now is answered by this one query.
        while notifications.try_recv().is_ok() {}
        loop {
            let rows = client
                .query(&query, &[&last, &o.stream.as_str()])
                .await
                .map_err(|e| e.to_string())?;
            for row in &rows {
                let id: i64 = row.get(0);
                received.row(&mut seen, id, row.get(1), k == 0);
                last = last.max(id);
            }
            if rows.len() < 100 {
                break;
            }
        }
    }
    Ok(received)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let o = Arc::new(options().map_err(|e| format!("follower_load: {e}"))?);
    let ready = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for k in 0..o.followers {
        let (o, ready, stop) = (o.clone(), ready.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            if o.kind == "listen" {
                follow_listen(o, k, ready, stop).await
            } else {
                follow_updates(o, k, ready, stop).await
            }
        }));
    }
    while ready.load(Ordering::Relaxed) < o.followers {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let the last ones reach their wait.
    tokio::time::sleep(Duration::from_millis(300)).await;
    println!("ready");
    // Until standard input closes.
    let stopper = stop.clone();
    tokio::task::spawn_blocking(move || {
        let mut sink = String::new();
        while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {}
        stopper.store(true, Ordering::Relaxed);
    })
    .await?;
    let mut followers = Vec::new();
    let mut latencies = Vec::new();
    for task in tasks {
        match task.await? {
            Ok(r) => {
                followers.push(serde_json::json!({ "rows": r.rows, "twice": r.twice }));
                latencies.extend(r.latencies_ms);
            }
            Err(e) => followers.push(serde_json::json!({ "error": e })),
        }
    }
    println!(
        "{}",
        serde_json::json!({ "followers": followers, "latencies_ms": latencies })
    );
    Ok(())
}
