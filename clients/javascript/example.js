// streampos from JavaScript (node-postgres), nothing but SQL: two writers
// allocate IDs in the transactions that write their rows, a follower reads
// every row with updates_json() (updates() as json: cheaper to send, and
// node-postgres parses both alike) and its token, and a consumer reads
// batches with updates_json(consumer => …) and acknowledges each in the same
// transaction, holding the consumers' advisory lock as the Python client
// does. At the end every row must have reached the follower and the
// consumer exactly once. README, "From any language".
//
//   PGHOST=127.0.0.1 PGPORT=5432 PGUSER=postgres PGDATABASE=db node example.js
//
// STREAM (default js_events) and ROWS (per writer, default 200) change the
// run; it prints one JSON line and exits 0 only if every check held. It
// creates the stream and its table (as a role that may: a superuser, or one
// granted create_stream and add_table), dropping earlier ones of that name.
'use strict';

const { Client } = require('pg');

const STREAM = process.env.STREAM || 'js_events';
const ROWS = Number(process.env.ROWS || 200);
const WRITERS = ['js_writer1', 'js_writer2'];
const CONSUMER = 'js_consumer';
// The consumers' advisory locks: the two-integer key space, first key
// "spCN", second hashtext('<stream>\x1f<consumer>') (clients/python,
// consumer.py): one process per consumer, whatever its language.
const CONSUMER_LOCK_CLASS = 0x7370434e;

async function connect() {
  const client = new Client({ application_name: 'streampos-js-example' });
  await client.connect();
  // IDs above 2^53 would arrive rounded as JSON numbers: ask for strings.
  await client.query('SET streampos.json_bigint_as_string = on');
  return client;
}

async function setUp(client) {
  const table = `${STREAM}_ev`;
  const exists = await client.query('SELECT 1 FROM streampos.streams WHERE stream_name = $1', [STREAM]);
  if (exists.rowCount > 0) {
    await client.query('SELECT streampos.drop_stream($1)', [STREAM]);
  }
  await client.query(`DROP TABLE IF EXISTS ${table}`);
  await client.query(`CREATE TABLE ${table} (id bigint PRIMARY KEY, writer text NOT NULL, body text NOT NULL)`);
  await client.query('SELECT streampos.create_stream($1)', [STREAM]);
  await client.query("SELECT streampos.add_table($1, $2, 'id', 'writer')", [STREAM, table]);
  await client.query('SELECT streampos.register_consumer($1, $2)', [STREAM, CONSUMER]);
  return table;
}

// A writer: each row in a transaction of its own, its ID allocated in it.
async function write(table, writer) {
  const client = await connect();
  const ids = [];
  try {
    for (let k = 0; k < ROWS; k++) {
      await client.query('BEGIN');
      const res = await client.query(
        `INSERT INTO ${table} (id, writer, body) VALUES (streampos.next_id($1, $2), $2, $3) RETURNING id`,
        [STREAM, writer, `row ${k} of ${writer}`]);
      // A few roll back: their IDs are gaps no reader waits for.
      await client.query(k % 17 === 5 ? 'ROLLBACK' : 'COMMIT');
      if (k % 17 !== 5) {
        ids.push(BigInt(res.rows[0].id));
      }
    }
  } finally {
    await client.end();
  }
  return ids;
}

// The rows of one answer of updates(): for each table a header
// [table, position, row_count, column_count, column names…], then its rows.
function rowsOf(answer) {
  const rows = [];
  const data = answer.data;
  for (let i = 0; i < data.length;) {
    const [, , count, width] = data[i];
    const columns = data[i].slice(4, 4 + width);
    for (const row of data.slice(i + 1, i + 1 + count)) {
      rows.push(Object.fromEntries(columns.map((c, j) => [c, row[j]])));
    }
    i += 1 + count;
  }
  return rows;
}

// Until the writers are done and `run.expected` rows arrived (or time out).
function going(run, count) {
  return !run.timedOut && (run.expected === null || count < run.expected);
}

// A follower: its own token, long-polling, beside the writers.
async function follow(run) {
  const client = await connect();
  const seen = [];
  let token = '0';
  try {
    while (going(run, seen.length)) {
      const res = await client.query('SELECT streampos.updates_json($1, $2, 100, 1000) AS answer', [STREAM, token]);
      const answer = res.rows[0].answer;
      for (const row of rowsOf(answer)) {
        seen.push(BigInt(row.id));
      }
      token = answer.token;
    }
  } finally {
    await client.end();
  }
  return { seen, token };
}

// A consumer: one batch a transaction, acknowledged in it; the lock makes
// it the only process of this consumer.
async function consume(run) {
  const client = await connect();
  const processed = [];
  try {
    const locked = await client.query(
      'SELECT pg_catalog.pg_try_advisory_lock($1::int4, pg_catalog.hashtext($2)) AS ok',
      [CONSUMER_LOCK_CLASS, `${STREAM}\x1f${CONSUMER}`]);
    if (!locked.rows[0].ok) {
      throw new Error(`another process holds consumer ${CONSUMER}'s lock`);
    }
    while (going(run, processed.length)) {
      await client.query('BEGIN');
      const res = await client.query(
        'SELECT streampos.updates_json($1, consumer => $2, max_rows => 50, timeout_ms => 1000) AS answer',
        [STREAM, CONSUMER]);
      const answer = res.rows[0].answer;
      const batch = rowsOf(answer).map((row) => BigInt(row.id));
      // … the batch's work would be written here, in this transaction …
      await client.query('SELECT streampos.ack($1, $2, $3)', [STREAM, CONSUMER, answer.token]);
      await client.query('COMMIT');
      processed.push(...batch);
    }
  } finally {
    await client.end();
  }
  return processed;
}

function once(ids) {
  return new Set(ids.map(String)).size === ids.length;
}

async function main() {
  const admin = await connect();
  const table = await setUp(admin);
  const run = { timedOut: false, expected: null };
  const timer = setTimeout(() => { run.timedOut = true; }, 60000);
  // The follower and the consumer read while the writers commit, out of
  // ID order; they stop once they have as many rows as were committed.
  const reading = Promise.all([follow(run), consume(run)]);
  const committed = (await Promise.all(WRITERS.map((w) => write(table, w)))).flat();
  run.expected = committed.length;
  const [followed, processed] = await reading;
  clearTimeout(timer);
  const frontier = BigInt((await admin.query('SELECT streampos.frontier($1) AS f', [STREAM])).rows[0].f);
  const acked = (await admin.query(
    `SELECT streampos.safe_to_delete($1)::text AS safe,
            streampos.is_before_or_eq(streampos.current_token($1), streampos.safe_to_delete($1)) AS all_acked`,
    [STREAM])).rows[0];
  await admin.end();
  const want = new Set(committed.map(String));
  const checks = {
    follower_got_every_row_once: once(followed.seen) && followed.seen.length === want.size &&
      followed.seen.every((id) => want.has(String(id))),
    consumer_got_every_row_once: once(processed) && processed.length === want.size &&
      processed.every((id) => want.has(String(id))),
    frontier_covers_every_row: committed.every((id) => id <= frontier),
    consumer_acknowledged_everything: acked.all_acked === true,
  };
  const ok = Object.values(checks).every(Boolean);
  console.log(JSON.stringify({
    ok, stream: STREAM, rows: committed.length, frontier: String(frontier),
    follower_token: followed.token, safe_to_delete: acked.safe, checks,
  }));
  process.exitCode = ok ? 0 : 1;
}

main().catch((err) => {
  console.error(err);
  process.exitCode = 2;
});
