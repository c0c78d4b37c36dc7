//! The client against a real server with the extension preloaded. The
//! server is named by STREAMPOS_PGHOST and STREAMPOS_PGPORT (scripts/test
//! sets them); without STREAMPOS_PGPORT every test passes after saying it was
//! skipped. Each test uses streams of its own in the database
//! `streampos_rsclient`, where the traps of test/python/traps.py are planted
//! when STREAMPOS_TRAPS_PLANT names the command (scripts/test).

use std::collections::BTreeMap;
use std::io::Write;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use streampos_client::{self as sp, MultiWriterToken, RoomStreamToken, Token};
use tokio::sync::OnceCell;
use tokio_postgres::{Client, NoTls};

const DBNAME: &str = "streampos_rsclient";

fn server() -> Option<String> {
    let port = std::env::var("STREAMPOS_PGPORT").ok()?;
    let host = std::env::var("STREAMPOS_PGHOST").unwrap_or_else(|_| "127.0.0.1".into());
    let user = std::env::var("STREAMPOS_PGUSER").unwrap_or_else(|_| "postgres".into());
    Some(format!(
        "host={host} port={port} user={user} connect_timeout=10"
    ))
}

static DATABASE: OnceCell<Option<String>> = OnceCell::const_new();

/// The conninfo of the test database (created once), or None to skip.
async fn database() -> Option<String> {
    DATABASE
        .get_or_init(|| async {
            let Some(server) = server() else {
                // Past the test harness's capture, so that it shows.
                let _ = writeln!(
                    std::io::stderr(),
                    "streampos-client: skipping the server tests: STREAMPOS_PGPORT is not set (scripts/test sets it)"
                );
                return None;
            };
            let admin = connect(&format!("{server} dbname=postgres")).await;
            for sql in [format!("DROP DATABASE IF EXISTS {DBNAME} WITH (FORCE)"), format!("CREATE DATABASE {DBNAME}")] {
                admin.batch_execute(&sql).await.expect("create the test database");
            }
            let conninfo = format!("{server} dbname={DBNAME}");
            connect(&conninfo)
                .await
                .batch_execute("CREATE EXTENSION streampos")
                .await
                .expect("create the extension");
            // The trap fixture (test/python/traps.py): scripts/test names
            // the command that plants it, and checks after the run that
            // nothing the client sent fired a trap.
            if let Ok(plant) = std::env::var("STREAMPOS_TRAPS_PLANT") {
                let status = Command::new("sh")
                    .arg("-c")
                    .arg(format!("{plant} {DBNAME}"))
                    .status()
                    .expect("run STREAMPOS_TRAPS_PLANT");
                assert!(status.success(), "planting the traps failed: {status}");
            }
            Some(conninfo)
        })
        .await
        .clone()
}

async fn connect(conninfo: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(conninfo, NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    client
}

static STREAMS: AtomicU32 = AtomicU32::new(0);

/// A new stream with its table (id bigint, instance_name text, body jsonb).
async fn new_stream(client: &Client, writers: &[&str]) -> String {
    let n = STREAMS.fetch_add(1, Ordering::Relaxed);
    let stream = format!("rs_{}_{n}", std::process::id());
    let writers: Vec<String> = writers.iter().map(|w| w.to_string()).collect();
    client
        .execute(
            "SELECT streampos.create_stream($1, writers => $2)",
            &[&stream, &writers],
        )
        .await
        .unwrap();
    client
        .batch_execute(&format!(
            "CREATE TABLE {stream}_rows (id bigint NOT NULL, instance_name text NOT NULL, body jsonb); \
             SELECT streampos.add_table('{stream}', '{stream}_rows', 'id', 'instance_name')"
        ))
        .await
        .unwrap();
    stream
}

macro_rules! setup {
    () => {
        match database().await {
            Some(conninfo) => conninfo,
            None => return,
        }
    };
}

/// Tokens covering every form, from a fixed pseudo-random sequence.
fn tokens(kind: sp::TokenKind, count: usize) -> Vec<Token> {
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move |m: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % m
    };
    (0..count)
        .map(|_| {
            let stream = next(40) as i64 - 10;
            if kind == sp::TokenKind::Room && next(5) == 0 {
                return Token::historical(next(20) as i64 - 5, stream);
            }
            let entries: BTreeMap<i32, i64> = (0..next(4))
                .map(|_| (next(6) as i32 - 1, stream + 1 + next(9) as i64))
                .collect();
            Token::vector(stream, entries).unwrap()
        })
        .collect()
}

#[tokio::test]
async fn tokens_travel_in_binary() {
    let conninfo = setup!();
    let client = connect(&conninfo).await;

    for token in tokens(sp::TokenKind::Room, 300) {
        let room = RoomStreamToken::new(token);
        let row = client
            .query_one(
                "SELECT $1::streampos.room_stream_token::text, $2::text::streampos.room_stream_token",
                &[&room, &room.to_string()],
            )
            .await
            .unwrap();
        assert_eq!(row.get::<_, String>(0), room.to_string());
        assert_eq!(row.get::<_, RoomStreamToken>(1), room);
    }
    for token in tokens(sp::TokenKind::MultiWriter, 300) {
        let mw = MultiWriterToken::new(token).unwrap();
        let row = client
            .query_one(
                "SELECT $1::streampos.multi_writer_token::text, $2::text::streampos.multi_writer_token",
                &[&mw, &mw.to_string()],
            )
            .await
            .unwrap();
        assert_eq!(row.get::<_, String>(0), mw.to_string());
        assert_eq!(row.get::<_, MultiWriterToken>(1), mw);
    }

    // Arrays, NULL, and a type that does not match.
    let row = client
        .query_one(
            "SELECT ARRAY['s1', 't1-2', 'm3~2.5']::streampos.room_stream_token[], \
                    NULL::streampos.multi_writer_token, 'm5~1.6'::streampos.room_stream_token",
            &[],
        )
        .await
        .unwrap();
    let array: Vec<RoomStreamToken> = row.get(0);
    assert_eq!(
        array.iter().map(ToString::to_string).collect::<Vec<_>>(),
        ["s1", "t1-2", "m3~2.5"]
    );
    assert_eq!(row.get::<_, Option<MultiWriterToken>>(1), None);
    assert!(row.try_get::<_, MultiWriterToken>(2).is_err());
    let m: MultiWriterToken = "m5~3.9~1.6".parse().unwrap();
    let r = client
        .query_one(
            "SELECT $1::streampos.multi_writer_token::streampos.room_stream_token",
            &[&m],
        )
        .await
        .unwrap();
    assert_eq!(r.get::<_, RoomStreamToken>(0), m.to_room());
    assert_eq!(
        RoomStreamToken::parse("t1-2").unwrap().to_multi_writer(),
        None
    );
    // The server's order is the client's.
    let texts = ["m5~1.100", "s6", "t9-9", "m5~2.6~3.7", "s-1"];
    let sorted: Vec<String> = client
        .query(
            "SELECT u.t::text FROM unnest($1::text[]::streampos.room_stream_token[]) AS u(t) ORDER BY u.t",
            &[&texts.to_vec()],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut ours: Vec<RoomStreamToken> = texts.iter().map(|t| t.parse().unwrap()).collect();
    ours.sort();
    assert_eq!(
        sorted,
        ours.iter().map(ToString::to_string).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn allocation_is_in_flight_until_the_transaction_ends() {
    let conninfo = setup!();
    let mut writer = connect(&conninfo).await;
    let reader = connect(&conninfo).await;
    let stream = new_stream(&reader, &["w1", "w2"]).await;
    let w1 = sp::instance_id(&reader, "w1").await.unwrap();

    let txn = writer.transaction().await.unwrap();
    assert_eq!(sp::next_id(&txn, &stream, "w2").await.unwrap(), 1);
    // The first ID's sequence record is not durable until the WAL is
    // flushed, and until then it holds back every writer: flush it, as any
    // commit would.
    reader
        .batch_execute(
            "SELECT pg_catalog.pg_logical_emit_message(true, 'streampos-client-test', '')",
        )
        .await
        .unwrap();
    assert_eq!(sp::frontier(&reader, &stream).await.unwrap(), 0);
    assert_eq!(sp::max_allocated(&reader, &stream).await.unwrap(), 1);
    assert_eq!(
        sp::writer_position(&reader, &stream, "w1").await.unwrap(),
        1
    );
    assert_eq!(
        sp::writer_position(&reader, &stream, "w2").await.unwrap(),
        0
    );
    assert_eq!(
        sp::current_token(&reader, &stream)
            .await
            .unwrap()
            .to_string(),
        format!("m0~{w1}.1")
    );
    let positions = sp::writer_positions(&reader, &stream).await.unwrap();
    assert_eq!(
        positions
            .iter()
            .map(|p| (p.instance_name.as_str(), p.stream_id))
            .collect::<Vec<_>>(),
        [("w1", 1), ("w2", 0)]
    );
    // The allocating transaction does not count its own ID as finished.
    assert_eq!(sp::frontier(&txn, &stream).await.unwrap(), 0);
    txn.commit().await.unwrap();
    assert_eq!(sp::frontier(&reader, &stream).await.unwrap(), 1);
    assert_eq!(
        sp::current_room_token(&reader, &stream)
            .await
            .unwrap()
            .to_string(),
        "s1"
    );

    let txn = writer.transaction().await.unwrap();
    assert_eq!(
        sp::next_ids(&txn, &stream, "w1", 3).await.unwrap(),
        [2, 3, 4]
    );
    txn.rollback().await.unwrap();
    assert_eq!(sp::frontier(&reader, &stream).await.unwrap(), 4);

    let err = {
        let txn = writer.transaction().await.unwrap();
        sp::next_id(&txn, &stream, "not_a_writer")
            .await
            .unwrap_err()
    };
    assert_eq!(err.sqlstate(), Some("55000"));
    assert_eq!(
        sp::frontier(&reader, "no_such_stream")
            .await
            .unwrap_err()
            .sqlstate(),
        Some("42704")
    );
}

#[tokio::test]
async fn wait_for_wakes_on_commit() {
    let conninfo = setup!();
    let mut writer = connect(&conninfo).await;
    let waiter = connect(&conninfo).await;
    let stream = new_stream(&waiter, &["w1"]).await;

    let txn = writer.transaction().await.unwrap();
    sp::next_id(&txn, &stream, "w1").await.unwrap();
    let wait = {
        let stream = stream.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            let reached = sp::wait_for(&waiter, &stream, 1, Duration::from_secs(20))
                .await
                .unwrap();
            (reached, start.elapsed(), waiter)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!wait.is_finished());
    txn.commit().await.unwrap();
    let (reached, elapsed, waiter) = wait.await.unwrap();
    assert_eq!(reached, 1);
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");

    // IDs 2..5 allocated and still in flight: waiting for 5 times out with
    // the frontier (a target this server never allocated would be an error:
    // the follower must resynchronise).
    let mut holder = connect(&conninfo).await;
    let held = holder.transaction().await.unwrap();
    sp::next_ids(&held, &stream, "w1", 4).await.unwrap();
    let start = Instant::now();
    assert_eq!(
        sp::wait_for(&waiter, &stream, 5, Duration::from_millis(200))
            .await
            .unwrap(),
        1
    );
    assert!(start.elapsed() >= Duration::from_millis(200));
    held.rollback().await.unwrap();
    let err = sp::wait_for(&waiter, &stream, 1000, Duration::from_millis(200))
        .await
        .unwrap_err();
    assert!(format!("{err:?}").contains("72000"), "{err:?}");
}

async fn insert(
    client: &mut Client,
    stream: &str,
    writer: &str,
    bodies: &[i64],
    commit: bool,
) -> Vec<i64> {
    let txn = client.transaction().await.unwrap();
    let ids = sp::next_ids(&txn, stream, writer, bodies.len() as i32)
        .await
        .unwrap();
    for (id, body) in ids.iter().zip(bodies) {
        let body = serde_json::json!({ "n": body });
        txn.execute(
            &format!("INSERT INTO {stream}_rows VALUES ($1, $2, $3::text::jsonb)"),
            &[id, &writer, &body.to_string()],
        )
        .await
        .unwrap();
    }
    if commit {
        txn.commit().await.unwrap();
    } else {
        txn.rollback().await.unwrap();
    }
    ids
}

#[tokio::test]
async fn updates_parse_into_typed_rows() {
    let conninfo = setup!();
    let mut writer = connect(&conninfo).await;
    let reader = connect(&conninfo).await;
    let stream = new_stream(&reader, &["w1", "w2"]).await;
    insert(&mut writer, &stream, "w1", &[10, 11], true).await;
    insert(&mut writer, &stream, "w2", &[12], false).await; // a gap
    insert(&mut writer, &stream, "w2", &[13, 14, 15], true).await;

    let mut since = MultiWriterToken::live(0);
    let mut seen = Vec::new();
    let mut answers = 0;
    loop {
        let answer = sp::updates(&reader, &stream, &since, 2, Duration::ZERO)
            .await
            .unwrap();
        answers += 1;
        // Table names are schema-qualified, as regclass prints them.
        let table = answer.table(&format!("public.{stream}_rows")).unwrap();
        assert_eq!(table.columns, ["id", "instance_name", "body"]);
        assert_eq!(table.column("body"), Some(2));
        assert!(table.rows.len() <= 2);
        for (id, instance, body) in table.rows_as::<(i64, String, Value)>().unwrap() {
            seen.push((id, instance, body["n"].as_i64().unwrap()));
        }
        assert!(since.is_before_or_eq(&answer.token));
        since = answer.token;
        if !answer.limited {
            break;
        }
    }
    assert!(answers >= 3);
    assert_eq!(
        seen,
        [
            (1, "w1".into(), 10),
            (2, "w1".into(), 11),
            (4, "w2".into(), 13),
            (5, "w2".into(), 14),
            (6, "w2".into(), 15)
        ]
    );
    assert_eq!(since.to_string(), "6");

    // Nothing new: the poll times out and the token stays.
    let start = Instant::now();
    let answer = sp::updates(&reader, &stream, &since, 10, Duration::from_millis(200))
        .await
        .unwrap();
    assert!(start.elapsed() >= Duration::from_millis(200));
    assert_eq!(
        (answer.token.clone(), answer.row_count(), answer.limited),
        (since.clone(), 0, false)
    );
    // A position-only advance: an aborted allocation moves the token, no rows.
    insert(&mut writer, &stream, "w1", &[16], false).await;
    let answer = sp::updates(&reader, &stream, &since, 10, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(
        (answer.token.to_string(), answer.row_count()),
        ("7".to_string(), 0)
    );

    assert!(matches!(
        sp::Updates::from_json(
            r#"{"token": "5", "limited": false, "data": [["t", 5, 1, 1, "id"]]}"#
        ),
        Err(sp::Error::Protocol(_))
    ));
    assert!(matches!(
        sp::Updates::from_json(r#"{"token": "s5", "limited": false, "data": []}"#),
        Err(sp::Error::Token(_))
    ));
}

/// A consumer's batch is acknowledged with the transaction that processes
/// it: rolled back, the rows come again; committed, they never do.
#[tokio::test]
async fn consumer_acknowledges_with_its_transaction() {
    let conninfo = setup!();
    let mut writer = connect(&conninfo).await;
    let mut client = connect(&conninfo).await;
    let stream = new_stream(&client, &["w1", "w2"]).await;
    insert(&mut writer, &stream, "w1", &[10, 11], true).await;
    let consumer = sp::Consumer::new(&stream, "sender")
        .with_max_rows(10)
        .with_timeout(Duration::ZERO);
    assert_eq!(sp::safe_to_delete(&client, &stream).await.unwrap(), None);
    let start = MultiWriterToken::live(0);
    assert_eq!(
        consumer.register(&client, Some(&start)).await.unwrap(),
        start
    );
    assert_eq!(consumer.register(&client, None).await.unwrap(), start);

    let txn = client.transaction().await.unwrap();
    let batch = consumer.batch(&txn).await.unwrap();
    assert_eq!(
        (batch.token.to_string(), batch.row_count()),
        ("2".into(), 2)
    );
    consumer.ack(&txn, &batch.token).await.unwrap();
    txn.rollback().await.unwrap();

    let txn = client.transaction().await.unwrap();
    let again = consumer.batch(&txn).await.unwrap();
    assert_eq!(again, batch, "rolled back: the same rows again");
    assert_eq!(consumer.ack(&txn, &again.token).await.unwrap(), again.token);
    txn.commit().await.unwrap();
    assert_eq!(
        sp::safe_to_delete(&client, &stream).await.unwrap(),
        Some(again.token.clone())
    );

    // Nothing past the position: the wait times out at the position.
    let waited = consumer
        .clone()
        .with_timeout(Duration::from_millis(50))
        .wait(&client)
        .await
        .unwrap();
    assert_eq!(waited, again.token);
    insert(&mut writer, &stream, "w2", &[12], true).await;
    assert_eq!(consumer.wait(&client).await.unwrap().to_string(), "3");
    let txn = client.transaction().await.unwrap();
    let next = consumer.batch(&txn).await.unwrap();
    assert_eq!((next.token.to_string(), next.row_count()), ("3".into(), 1));
    // A token past what this transaction has seen is refused.
    let ahead = MultiWriterToken::live(100);
    let err = consumer.ack(&txn, &ahead).await.unwrap_err();
    assert_eq!(err.sqlstate(), Some("22023"));
    txn.rollback().await.unwrap();
    assert!(consumer.unregister(&client).await.unwrap());
    assert!(!consumer.unregister(&client).await.unwrap());
}

/// A consumer that reads its batches elsewhere (a hot standby's connection;
/// here a second connection to the same server stands in for it) and
/// acknowledges on the primary: from its position, each batch after the
/// token it last acknowledged, a rolled-back batch again, every row once.
#[tokio::test]
async fn consumer_reads_elsewhere_and_acknowledges_on_the_primary() {
    let conninfo = setup!();
    let mut writer = connect(&conninfo).await;
    let mut primary = connect(&conninfo).await;
    let replica = connect(&conninfo).await;
    let stream = new_stream(&primary, &["w1", "w2"]).await;
    let consumer = sp::Consumer::new(&stream, "reader")
        .with_max_rows(2)
        .with_timeout(Duration::ZERO);
    assert_eq!(consumer.position(&primary).await.unwrap(), None);
    consumer
        .register(&primary, Some(&MultiWriterToken::live(0)))
        .await
        .unwrap();
    insert(&mut writer, &stream, "w1", &[1, 2, 3], true).await;
    insert(&mut writer, &stream, "w2", &[4, 5], true).await;
    let mut since = consumer.position(&primary).await.unwrap().unwrap();
    let mut got = Vec::new();
    let mut rolled_back = false;
    loop {
        let batch = consumer.batch_after(&replica, &since).await.unwrap();
        if batch.row_count() == 0 {
            break;
        }
        let txn = primary.transaction().await.unwrap();
        consumer.ack(&txn, &batch.token).await.unwrap();
        if !rolled_back {
            // Processing failed: the same batch again, from the same token.
            txn.rollback().await.unwrap();
            rolled_back = true;
            let again = consumer.batch_after(&replica, &since).await.unwrap();
            assert_eq!(again, batch);
            continue;
        }
        txn.commit().await.unwrap();
        for table in &batch.tables {
            got.extend(table.rows.iter().map(|r| r[0].as_i64().unwrap()));
        }
        since = batch.token;
    }
    got.sort_unstable();
    assert_eq!(got, vec![1, 2, 3, 4, 5]);
    assert_eq!(consumer.position(&primary).await.unwrap(), Some(since));
}

/// The follower receives every committed row exactly once while writers
/// commit and abort concurrently and its connection is killed repeatedly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_resumes_after_reconnects() {
    let conninfo = setup!();
    let admin = connect(&conninfo).await;
    let stream = new_stream(&admin, &["w1", "w2"]).await;
    let app = format!("{stream}_follower");

    let writers: Vec<_> = ["w1", "w2"]
        .into_iter()
        .map(|w| {
            let conninfo = conninfo.clone();
            let stream = stream.clone();
            tokio::spawn(async move {
                let mut client = connect(&conninfo).await;
                let mut committed = Vec::new();
                for k in 0..40_i64 {
                    let commit = k % 6 != 5;
                    let ids = insert(
                        &mut client,
                        &stream,
                        w,
                        &[k, k + 1000][..(1 + (k % 2) as usize)],
                        commit,
                    )
                    .await;
                    if commit {
                        committed.extend(ids);
                    }
                    tokio::time::sleep(Duration::from_millis(3)).await;
                }
                committed
            })
        })
        .collect();

    let mut follower = sp::Follower::new(
        format!("{conninfo} application_name={app}"),
        stream.clone(),
        MultiWriterToken::live(0),
    );
    follower.max_rows = 7;
    follower.poll_timeout = Duration::from_millis(500);
    let mut received: Vec<(i64, String)> = Vec::new();
    let mut kills = 0;
    let mut expected: Option<Vec<i64>> = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            Instant::now() < deadline,
            "follower did not catch up; received {}",
            received.len()
        );
        let answer = follower.next().await.unwrap();
        for table in &answer.tables {
            received.extend(
                table
                    .rows_as::<(i64, String, Value)>()
                    .unwrap()
                    .into_iter()
                    .map(|r| (r.0, r.1)),
            );
        }
        if kills < 3 && received.len() > 20 * (kills + 1) {
            admin
                .execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", &[&app])
                .await
                .unwrap();
            kills += 1;
        }
        if expected.is_none() && writers.iter().all(|w| w.is_finished()) {
            let rows = admin
                .query(&format!("SELECT id FROM {stream}_rows ORDER BY id"), &[])
                .await
                .unwrap();
            expected = Some(rows.iter().map(|r| r.get(0)).collect());
        }
        if expected.as_ref().is_some_and(|e| received.len() >= e.len()) {
            break;
        }
    }
    let mut committed = Vec::new();
    for w in writers {
        committed.extend(w.await.unwrap());
    }
    committed.sort_unstable();
    assert_eq!(Some(&committed), expected.as_ref());
    let mut ids: Vec<i64> = received.iter().map(|r| r.0).collect();
    ids.sort_unstable();
    assert_eq!(ids, committed, "every committed row exactly once");
    for w in ["w1", "w2"] {
        let own: Vec<i64> = received.iter().filter(|r| r.1 == w).map(|r| r.0).collect();
        assert!(
            own.windows(2).all(|p| p[0] < p[1]),
            "{w}'s rows out of order: {own:?}"
        );
    }
    assert_eq!(kills, 3);
    assert!(
        follower.reconnects() >= 3,
        "reconnects: {}",
        follower.reconnects()
    );
}

/// The example binary: stops after some rows, then a second run resumes
/// from the token file and prints the rest.
#[tokio::test]
async fn follower_example_resumes_from_its_token_file() {
    let conninfo = setup!();
    let mut client = connect(&conninfo).await;
    let stream = new_stream(&client, &["w1"]).await;
    for k in 0..5 {
        insert(&mut client, &stream, "w1", &[k], true).await;
    }
    // Examples are built next to the test executables (target/*/examples).
    let exe = std::env::current_exe().unwrap();
    let example = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("follower");
    assert!(example.exists(), "{} not built", example.display());
    let token_file = std::env::temp_dir().join(format!("{stream}.token"));
    let _ = std::fs::remove_file(&token_file);
    let run = |stop_after: &str| {
        let out = Command::new(&example)
            .args([
                "--conninfo",
                &conninfo,
                "--stream",
                &stream,
                "--max-rows",
                "2",
                "--poll-ms",
                "2000",
            ])
            .args([
                "--token-file",
                token_file.to_str().unwrap(),
                "--stop-after-rows",
                stop_after,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["row"]["id"]
                    .as_i64()
                    .unwrap()
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run("2"), [1, 2]);
    assert_eq!(std::fs::read_to_string(&token_file).unwrap(), "2");
    assert_eq!(run("3"), [3, 4, 5]);
    assert_eq!(std::fs::read_to_string(&token_file).unwrap(), "5");
    let _ = std::fs::remove_file(&token_file);
}
