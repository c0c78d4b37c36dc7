"""Differential test: Synapse's own token classes against the SQL functions.

On one side matrix-synapse (pinned in test/requirements.txt): RoomStreamToken,
MultiWriterStreamToken, PersistedPosition, and the range helpers
_filter_results and _filter_results_by_stream of its event store. On the other
side the streampos functions, one batched query per function. Thousands of
tokens and pairs come from a seeded generator: i64 extremes, negative streams,
historical and live tokens mixed, many instances, historical tokens with
equal streams and different topological parts, and text variants (leading
zeros, a trailing `~`, entries out of order, mutated text).

Every case is counted per function: compared, agreements, disagreements,
and cases where Synapse raises. Where Synapse raises, the SQL answer must be
the one docs/tokens.md documents ("Where Synapse raises and streampos
answers"); a disagreement must have one of the documented reasons (EXPLAINED).
Anything else fails the test. The counts are printed and written to
streampos-synapse-tokens.txt in the temporary directory.

Synapse parses tokens asynchronously against a store that maps instance ids to
names; FakeStore does that here. A row without an instance is written by
"master" for Synapse's room helpers: the test runs the room range functions
once before any instance is called master and once after.
"""

import asyncio
import logging
import os
import random
import re
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest
from immutabledict import immutabledict

from support import connect_raw, rows

from synapse.storage.databases.main.stream import _filter_results, _filter_results_by_stream
from synapse.types import MultiWriterStreamToken, PersistedPosition, RoomStreamToken

SEED = 20261130
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1

# Why a disagreement is expected, each documented in docs/tokens.md.
EXPLAINED = {
    "python-int-syntax": "Python's int() takes +, spaces, _ and non-ASCII digits; the grammar does not",
    "out-of-range": "a number outside 64 bits (an instance id outside 32) is 22003; Python's ints are unbounded",
    "duplicate-instance": "an instance listed twice is 22P02; Synapse keeps the last entry",
    "empty-entry": "only one empty entry, at the end, is accepted; Synapse skips every empty entry",
    "negative-topological": "t-3-4 is accepted; Synapse's split on '-' fails",
    "negative-multi-writer": "a negative multi-writer token (-5) is accepted; Synapse wants a digit first",
    "synapse-t0-quirk": "Synapse tests `if self.topological`, so it advances t0-… as live and keeps topological 0",
}


# --------------------------------------------------------------- tokens


@dataclass(frozen=True)
class Tok:
    """A token as plain data: entries sorted by id, each position > stream."""

    stream: int
    topo: int | None = None
    entries: tuple = ()

    @property
    def historical(self):
        return self.topo is not None

    def text(self, room=True):
        if self.topo is not None:
            return f"t{self.topo}-{self.stream}"
        if self.entries:
            return f"m{self.stream}~" + "~".join(f"{i}.{p}" for i, p in self.entries)
        return f"s{self.stream}" if room else str(self.stream)

    def pos(self, instance):
        return dict(self.entries).get(instance, self.stream)

    def live_view(self):
        return Tok(self.stream, None, self.entries)


def tok(stream, entries=(), topo=None):
    return Tok(stream, topo, tuple(sorted(entries)))


class Names:
    """Instance id <-> name: "master" for master's id once it exists, else w{id}."""

    def __init__(self, master_id=None):
        self.master_id = master_id

    def name(self, instance_id):
        return "master" if instance_id == self.master_id else f"w{instance_id}"

    def id(self, name):
        if name == "master":
            if self.master_id is None:
                raise KeyError(name)
            return self.master_id
        return int(name[1:])


class FakeStore:
    """What Synapse's token parse/print needs of its store."""

    def __init__(self, names):
        self.names = names

    async def get_name_from_instance_id(self, instance_id):
        return self.names.name(instance_id)

    async def get_id_for_instance(self, name):
        return self.names.id(name)


def syn_room(t, names):
    return RoomStreamToken(
        topological=t.topo,
        stream=t.stream,
        instance_map=immutabledict({names.name(i): p for i, p in t.entries}),
    )


def syn_mw(t, names):
    return MultiWriterStreamToken(
        stream=t.stream, instance_map=immutabledict({names.name(i): p for i, p in t.entries})
    )


def from_syn(s, names):
    """A Synapse token as Tok (topological kept, even beside a map)."""
    topo = getattr(s, "topological", None)
    return Tok(s.stream, topo, tuple(sorted((names.id(n), p) for n, p in s.instance_map.items())))


class Gen:
    """Seeded token generator."""

    def __init__(self, rng, ids):
        self.rng = rng
        self.ids = ids

    def stream(self):
        r = self.rng.random()
        if r < 0.6:
            return self.rng.randint(-20, 40)
        if r < 0.8:
            return self.rng.randint(10**9, 10**12)
        if r < 0.9:
            return self.rng.randint(I64_MIN, I64_MAX)
        return self.rng.choice([I64_MIN, I64_MIN + 1, I64_MAX, I64_MAX - 1, I64_MAX - 5, 0, -1])

    def live(self):
        s = self.stream()
        n = self.rng.choice([0, 0, 1, 1, 2, 3, 4, 12])
        entries = {}
        for i in self.rng.sample(self.ids, min(n, len(self.ids))):
            d = self.rng.choice([1, 1, 2, 3, 5, 100, 10**10]) if self.rng.random() < 0.95 else I64_MAX
            if s + d <= I64_MAX:
                entries[i] = s + d
        return tok(s, entries.items())

    def historical(self):
        topo = self.rng.choice([0, 0, 1, 2, 3, -1, -7, 426, I64_MAX, I64_MIN, self.rng.randint(-50, 50)])
        return tok(self.stream(), topo=topo)

    def room(self):
        return self.historical() if self.rng.random() < 0.3 else self.live()

    def near(self, historical_share=0.4):
        """Small dense tokens, so that pairs are often comparable or equivalent."""
        s = self.rng.randint(-2, 3)
        if self.rng.random() < historical_share:
            return tok(s, topo=self.rng.randint(-1, 2))
        entries = {i: s + self.rng.randint(1, 2) for i in self.rng.sample(self.ids[:3], self.rng.randint(0, 3))}
        return tok(s, entries.items())


# --------------------------------------------------------------- counting


class Tally:
    def __init__(self):
        self.counts = defaultdict(Counter)
        self.unexplained = defaultdict(list)

    def agree(self, fn):
        self.counts[fn]["compared"] += 1
        self.counts[fn]["agreements"] += 1

    def disagree(self, fn, reason, case):
        self.counts[fn]["compared"] += 1
        if reason in EXPLAINED:
            self.counts[fn][f"disagreements ({reason})"] += 1
        else:
            self.counts[fn]["disagreements (unexplained)"] += 1
            self.unexplained[fn].append(case)

    def raised(self, fn, ours_as_documented, case):
        """Synapse raised; ours must give the documented answer."""
        self.counts[fn]["compared"] += 1
        self.counts[fn]["synapse raises"] += 1
        if not ours_as_documented:
            self.counts[fn]["synapse raises, ours not as documented"] += 1
            self.unexplained[fn].append(case)

    def check(self, fn, syn_call, ours, documented=None, reason_if_differs=None, case=None):
        """Compare one case. `syn_call` runs Synapse; `documented` is our
        documented answer where Synapse raises (or where a quirk applies)."""
        try:
            theirs = syn_call()
        except Exception:  # noqa: BLE001 - Synapse raises assorted types
            self.raised(fn, ours == documented, (case, ours, documented))
            return
        if theirs == ours:
            self.agree(fn)
        else:
            reason = reason_if_differs(theirs) if reason_if_differs else None
            if reason and documented is not None and ours != documented:
                reason = None
            self.disagree(fn, reason, (case, theirs, ours))

    def report(self):
        lines = [f"Synapse differential test (seed {SEED})"]
        for fn in sorted(self.counts):
            c = self.counts[fn]
            rest = ", ".join(f"{k} {v}" for k, v in sorted(c.items()) if k not in ("compared", "agreements"))
            line = f"  {fn:<34} compared {c['compared']:>6}, agreements {c['agreements']:>6}"
            lines.append(line + (f", {rest}" if rest else ""))
        for fn, cases in self.unexplained.items():
            lines.append(f"  UNEXPLAINED {fn}: {len(cases)}, e.g. {cases[:5]}")
        return "\n".join(lines)


# --------------------------------------------------------------- SQL side


@pytest.fixture(scope="module")
def sql(database):
    """A database of its own (this test creates the instance 'master')."""
    name = f"streampos_synapse_{uuid.uuid4().hex[:8]}"
    with connect_raw("postgres") as admin:
        admin.execute(f"CREATE DATABASE {name}")
    conn = connect_raw(name)
    conn.execute("CREATE EXTENSION streampos")
    conn.execute("SET search_path = streampos, public")
    # Input that fails is an answer here, not an error of the batch.
    conn.execute(
        """
        CREATE FUNCTION public.try_parse(room boolean, input text) RETURNS text
        LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
        BEGIN
            IF room THEN
                RETURN input::streampos.room_stream_token::text;
            END IF;
            RETURN input::streampos.multi_writer_token::text;
        EXCEPTION WHEN others THEN
            RETURN 'ERROR ' || SQLSTATE;
        END $$
        """
    )
    yield conn
    conn.close()
    with connect_raw("postgres") as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def texts(ts, room=True):
    return [None if t is None else t.text(room) for t in ts]


# --------------------------------------------------------------- the test


def run(coro):
    return asyncio.run(coro)


def mutate(rng, s):
    alphabet = "smt~.-0123456789+ _x\u0665"
    chars = list(s)
    for _ in range(rng.randint(1, 3)):
        op, at = rng.randrange(3), rng.randrange(len(chars) + 1)
        if op == 0:
            chars.insert(at, rng.choice(alphabet))
        elif at < len(chars):
            if op == 1:
                del chars[at]
            else:
                chars[at] = rng.choice(alphabet)
    return "".join(chars)


HAND_WRITTEN = [
    "", "s", "s5", "s-5", "s-0", "s007", "s+5", "s 5", " s5", "s5 ", "s5_0", "s\u0665",
    "s9223372036854775807", "s9223372036854775808", "s-9223372036854775808",
    "s-9223372036854775809", "s99999999999999999999999", "t5-12", "t5--12", "t-3-4",
    "t5", "t5-", "t5-1-", "t007-008", "t0-0", "m5", "m5~", "m5~~", "m5~2.7~", "m5~~2.7",
    "m5~2.7~~", "m5~2.7~~3.8", "m5~2.6~2.7", "m5~2.7~2.6", "m5~2.5", "m5~2.4", "m5~2",
    "m5~2.", "m5~.3", "m5~2.7.8", "m-5~1.-3", "m5~-2.6", "m05~02.06", "m5~2147483647.6",
    "m5~2147483648.6", "m5~-2147483649.6", "m56~3.59~2.58", "m1~9.2~-4.3~0.4~3.5",
    "m-9223372036854775808~1.9223372036854775807", "m5~1.9223372036854775808", "x5", "S5",
    "5", "-5", "-0", "007", "+5", "5 ", "5_000", "m", "m~2.3", "\u0665", "m5~+2.7",
]


def parse_reason(text, room, ours):
    """Why Synapse and streampos disagree on accepting `text` (None: no documented reason)."""
    body = text[1:] if text[:1] in ("s", "t", "m") else text
    if ours.startswith("ERROR"):
        if re.search(r"[+\s_]|[^\x00-\x7f]", text):
            return "python-int-syntax"
        if ours == "ERROR 22003":
            return "out-of-range"
        if text.startswith("m"):
            parts = body.split("~")[1:]
            if any(not p for p in parts[:-1]):
                return "empty-entry"
            ids = [p.split(".")[0] for p in parts if p]
            if len(ids) != len(set(int(i) for i in ids)):
                return "duplicate-instance"
        return None
    if room and text.startswith("t-"):
        return "negative-topological"
    if not room and text.startswith("-"):
        return "negative-multi-writer"
    return None


def canonical_syn_text(s, names, room):
    """Synapse's printed token with entries sorted by id (it prints them in
    its dict's order, streampos in ascending id order)."""
    printed = run(s.to_string(FakeStore(names)))
    if printed.startswith("m"):
        head, *entries = printed.split("~")
        entries.sort(key=lambda e: int(e.split(".")[0]))
        return "~".join([head, *entries])
    return printed


def check_parse(sql, tally, names, corpus, room):
    fn = "parse+print (room)" if room else "parse+print (multi-writer)"
    ours = [r[0] for r in rows(
        sql,
        "SELECT public.try_parse(%s, x) FROM unnest(%s::text[]) WITH ORDINALITY AS u(x, n) ORDER BY n",
        (room, corpus),
    )]
    cls = RoomStreamToken if room else MultiWriterStreamToken
    for text, our in zip(corpus, ours):
        try:
            theirs = canonical_syn_text(run(cls.parse(FakeStore(names), text)), names, room)
        except Exception:  # noqa: BLE001
            theirs = None
        if theirs is None:
            if our.startswith("ERROR"):
                tally.raised(fn, True, text)
            else:
                tally.disagree(fn, parse_reason(text, room, our), (text, "Synapse rejects", our))
        elif our == theirs:
            tally.agree(fn)
        else:
            reason = parse_reason(text, room, our) if our.startswith("ERROR") else None
            tally.disagree(fn, reason, (text, theirs, our))


def our_advance(a, b):
    """docs/tokens.md: the least upper bound, historical tokens included."""
    if a.historical and b.historical:
        return tok(max(a.stream, b.stream), topo=max(a.topo, b.topo))
    a, b = a.live_view(), b.live_view()
    s = max(a.stream, b.stream)
    ids = set(dict(a.entries)) | set(dict(b.entries))
    return tok(s, [(i, max(a.pos(i), b.pos(i))) for i in ids if max(a.pos(i), b.pos(i)) > s])


def our_bound(t, m):
    s = min(t.stream, m)
    return Tok(s, t.topo, tuple((i, min(p, m)) for i, p in t.entries if min(p, m) > s))


def syn_le(a, b, names):
    return syn_room(a, names).is_before_or_eq(syn_room(b, names))


def test_synapse_tokens_differential(sql, capsys):
    logging.getLogger("synapse").setLevel(logging.CRITICAL)
    started = time.monotonic()
    rng = random.Random(SEED)
    tally = Tally()
    base_ids = [1, 2, 3, 5, 7, 11, 0, -1, I32_MAX, I32_MIN]

    # ---- 1. the room range functions before any instance is called master
    names = Names(master_id=None)
    gen = Gen(rng, base_ids)
    check_room_ranges(sql, tally, names, gen, rng, "no master")

    # ---- then master exists and may be listed in tokens
    master_id = rows(sql, "SELECT instance_id('master')")[0][0]
    names = Names(master_id=master_id)
    ids = sorted(set(base_ids) | {master_id})
    gen = Gen(rng, ids)
    check_room_ranges(sql, tally, names, gen, rng, "master")

    # ---- 2. parse and print
    room_tokens = [gen.room() for _ in range(2500)]
    mw_tokens = [gen.live() for _ in range(1500)]
    corpus_room = list(HAND_WRITTEN)
    corpus_mw = list(HAND_WRITTEN)
    for t in room_tokens:
        corpus_room.append(t.text())
        if t.entries and len(t.entries) > 1:
            shuffled = list(t.entries)
            rng.shuffle(shuffled)
            corpus_room.append(f"m{t.stream}~" + "~".join(f"{i}.{p}" for i, p in shuffled) + rng.choice(["", "~"]))
        if rng.random() < 0.3:
            corpus_room.append(re.sub(r"(\d+)", lambda m: "00" + m.group(1), t.text(), count=1))
        corpus_room.append(mutate(rng, t.text()))
    for t in mw_tokens:
        corpus_mw.append(t.text(room=False))
        corpus_mw.append(mutate(rng, t.text(room=False)))
        if rng.random() < 0.3:
            corpus_mw.append(t.text(room=False) + ("~" if t.entries else ""))
    corpus_room = [c for c in corpus_room if "\x00" not in c]
    corpus_mw = [c for c in corpus_mw if "\x00" not in c]
    check_parse(sql, tally, names, corpus_room, room=True)
    check_parse(sql, tally, names, corpus_mw, room=False)

    # ---- 3. accessors
    check_accessors(sql, tally, names, room_tokens, mw_tokens, rng)

    # ---- 4. pairs: is_before_or_eq, advance, the total order
    pairs = [(gen.room(), gen.room()) for _ in range(3000)]
    pairs += [(gen.near(), gen.near()) for _ in range(4000)]
    pairs += [(t, tok(t.stream, topo=rng.randint(-3, 3))) for t in (gen.near(0.0) for _ in range(500))]
    check_pairs(sql, tally, names, pairs, room=True)
    mw_pairs = [(gen.live(), gen.live()) for _ in range(1500)]
    mw_pairs += [(gen.near(0.0), gen.near(0.0)) for _ in range(1500)]
    check_pairs(sql, tally, names, mw_pairs, room=False)

    # ---- 5. bound
    check_bound(sql, tally, names, room_tokens, mw_tokens, gen)

    # ---- 6. the multi-writer range test
    check_multi_writer_range(sql, tally, names, gen, rng)

    elapsed = time.monotonic() - started
    report = tally.report() + f"\n  ({elapsed:.1f} s)"
    with open(os.path.join(tempfile.gettempdir(), "streampos-synapse-tokens.txt"), "w") as f:
        f.write(report + "\n")
    with capsys.disabled():
        print("\n" + report)
    assert not tally.unexplained, report
    for fn, c in tally.counts.items():
        assert c["compared"] > 0 and c["agreements"] > 0, fn
    # The generator reaches the cases that matter.
    assert tally.counts["in_range 4-arg (room, master)"]["(of which NULL instance, master listed)"] > 50
    assert tally.counts["in_range 5-arg (room, master)"]["(of which NULL instance, master listed)"] > 50
    assert tally.counts["advance (room)"]["disagreements (synapse-t0-quirk)"] > 0
    assert tally.counts["total order vs is_before_or_eq (room)"]["compared"] > 1000


def check_accessors(sql, tally, names, room_tokens, mw_tokens, rng):
    probe_ids = sorted({i for t in room_tokens + mw_tokens for i, _ in t.entries} | {names.master_id, 4, -2})
    for room, ts in ((True, room_tokens), (False, mw_tokens)):
        kind = "room_stream_token" if room else "multi_writer_token"
        probes = [rng.choice(probe_ids) for _ in ts]
        sids = [t.pos(i) + rng.choice([-1, 0, 1]) for t, i in zip(ts, probes)]
        sids = [max(I64_MIN, min(I64_MAX, s)) for s in sids]
        out = rows(
            sql,
            f"""SELECT stream_pos(t), max_stream_pos(t), {'topological(t)' if room else 'NULL::bigint'},
                       instance_pos(t, i), persisted_after(t, i, sid)
                FROM (SELECT x::{kind} AS t, i, sid
                      FROM unnest(%s::text[], %s::int[], %s::bigint[]) WITH ORDINALITY AS u(x, i, sid, n)
                      ORDER BY n) AS s""",
            (texts(ts, room), probes, sids),
        )
        suffix = " (room)" if room else " (multi-writer)"
        for t, i, sid, (stream, max_pos, topo, pos, after) in zip(ts, probes, sids, out):
            s = syn_room(t, names) if room else syn_mw(t, names)
            tally.check("stream_pos" + suffix, lambda: s.stream, stream, case=t.text(room))
            tally.check("max_stream_pos" + suffix, s.get_max_stream_pos, max_pos, case=t.text(room))
            if room:
                tally.check("topological", lambda: s.topological, topo, case=t.text())
            name = names.name(i)
            tally.check(
                "instance_pos" + suffix,
                lambda: s.get_stream_pos_for_instance(name),
                pos,
                documented=t.pos(i),
                case=(t.text(room), i),
            )
            tally.check(
                "persisted_after" + suffix,
                lambda: PersistedPosition(name, sid).persisted_after(s),
                after,
                documented=sid > t.pos(i),
                case=(t.text(room), i, sid),
            )


def check_pairs(sql, tally, names, pairs, room):
    kind = "room_stream_token" if room else "multi_writer_token"
    suffix = " (room)" if room else " (multi-writer)"
    a_texts = [a.text(room) for a, _ in pairs]
    b_texts = [b.text(room) for _, b in pairs]
    out = rows(
        sql,
        f"""SELECT is_before_or_eq(a, b), is_before_or_eq(b, a), a < b, a = b, b < a, advance(a, b)::text
            FROM (SELECT x::{kind} AS a, y::{kind} AS b
                  FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS u(x, y, n) ORDER BY n) AS s""",
        (a_texts, b_texts),
    )
    make = syn_room if room else syn_mw
    for (a, b), (le, ge, lt, eq, gt, adv) in zip(pairs, out):
        sa, sb = make(a, names), make(b, names)
        case = (a.text(room), b.text(room))
        tally.check("is_before_or_eq" + suffix, lambda: sa.is_before_or_eq(sb), le, case=case)
        # The total order extends Synapse's order: strictly before is less.
        syn_ab, syn_ba = sa.is_before_or_eq(sb), sb.is_before_or_eq(sa)
        if syn_ab != syn_ba:
            tally.check("total order vs is_before_or_eq" + suffix, lambda: True, lt if syn_ab else gt, case=case)
        if [lt, eq, gt].count(True) != 1:
            tally.disagree("total order vs is_before_or_eq" + suffix, None, (case, "not exactly one of <, =, >"))
        if eq != (a == b):
            tally.disagree("total order vs is_before_or_eq" + suffix, None, (case, "= is not equality"))

        def advanced():
            return from_syn(sa.copy_and_advance(sb), names).text(room)

        def quirk(theirs):
            # Synapse advanced a t0-… token as live (topological 0 is falsy).
            return "synapse-t0-quirk" if 0 in (a.topo, b.topo) else None

        tally.check(
            "advance" + suffix,
            advanced,
            adv,
            documented=our_advance(a, b).text(room),
            reason_if_differs=quirk,
            case=case,
        )


def check_bound(sql, tally, names, room_tokens, mw_tokens, gen):
    for room, ts in ((True, room_tokens), (False, mw_tokens)):
        kind = "room_stream_token" if room else "multi_writer_token"
        caps = [
            gen.rng.choice([t.stream - 1, t.stream, t.stream + 1, max(p for _, p in t.entries or [(0, t.stream)]) - 1,
                            gen.stream()])
            for t in ts
        ]
        caps = [max(I64_MIN, min(I64_MAX, m)) for m in caps]
        out = rows(
            sql,
            f"""SELECT bound(x::{kind}, m)::text
                FROM unnest(%s::text[], %s::bigint[]) WITH ORDINALITY AS u(x, m, n) ORDER BY n""",
            (texts(ts, room), caps),
        )
        make = syn_room if room else syn_mw
        for t, m, (ours,) in zip(ts, caps, out):
            s = make(t, names)
            tally.check(
                "bound" + (" (room)" if room else " (multi-writer)"),
                lambda: from_syn(s.bound_stream_token(m), names).text(room),
                ours,
                documented=our_bound(t, m).text(room),
                case=(t.text(room), m),
            )


def range_cases(gen, rng, n, names, with_topological):
    cases = []
    for _ in range(n):
        lo = None if rng.random() < 0.1 else (gen.near() if rng.random() < 0.5 else gen.room())
        hi = None if rng.random() < 0.1 else (gen.near() if rng.random() < 0.5 else gen.room())
        inst = None if rng.random() < 0.35 else rng.choice(gen.ids + [4])
        anchor = rng.choice([t for t in (lo, hi) if t is not None] or [tok(0)])
        sid = anchor.pos(inst if inst is not None else names.master_id) + rng.choice([-1, 0, 1, 2])
        sid = max(I64_MIN, min(I64_MAX, sid))
        topo = (anchor.topo if anchor.topo is not None else rng.randint(-2, 3)) + rng.choice([-1, 0, 0, 1])
        topo = max(I64_MIN, min(I64_MAX, topo))
        cases.append((lo, hi, inst, topo if with_topological else None, sid))
    return cases


def check_room_ranges(sql, tally, names, gen, rng, phase):
    """in_range(room, room, instance, stream_id) against
    _filter_results_by_stream and in_range(..., topological, stream_id) against
    _filter_results, a NULL instance being "master" in both."""
    for five in (False, True):
        fn = f"in_range 5-arg (room, {phase})" if five else f"in_range 4-arg (room, {phase})"
        cases = range_cases(gen, rng, 3000, names, five)
        args = (
            texts([c[0] for c in cases]),
            texts([c[1] for c in cases]),
            [c[2] for c in cases],
            [c[3] for c in cases],
            [c[4] for c in cases],
        )
        call = "in_range(lo::room_stream_token, hi::room_stream_token, i, topo, sid)" if five else \
            "in_range(lo::room_stream_token, hi::room_stream_token, i, sid)"
        out = rows(
            sql,
            f"""SELECT {call}
                FROM unnest(%s::text[], %s::text[], %s::int[], %s::bigint[], %s::bigint[])
                     WITH ORDINALITY AS u(lo, hi, i, topo, sid, n)
                ORDER BY n""",
            args,
        )
        for (lo, hi, inst, topo, sid), (ours,) in zip(cases, out):
            if inst is None and any(
                t is not None and not t.historical and names.master_id in dict(t.entries) for t in (lo, hi)
            ):
                # Cases that tell master's position from the minimum.
                tally.counts[fn]["(of which NULL instance, master listed)"] += 1
            slo = None if lo is None else syn_room(lo, names)
            shi = None if hi is None else syn_room(hi, names)
            name = None if inst is None else names.name(inst)
            case = (lo and lo.text(), hi and hi.text(), inst, topo, sid)
            if five:
                tally.check(fn, lambda: _filter_results(slo, shi, name, topo, sid), ours, case=case)
            else:
                # Documented where Synapse asserts live bounds: a historical
                # bound counts as s{stream}.
                live = [None if t is None else syn_room(t.live_view(), names) for t in (lo, hi)]
                tally.check(
                    fn,
                    lambda: _filter_results_by_stream(slo, shi, name, sid),
                    ours,
                    documented=_filter_results_by_stream(live[0], live[1], name, sid),
                    case=case,
                )


def check_multi_writer_range(sql, tally, names, gen, rng):
    cases = []
    for _ in range(3000):
        lo = None if rng.random() < 0.1 else (gen.near(0.0) if rng.random() < 0.5 else gen.live())
        hi = None if rng.random() < 0.1 else (gen.near(0.0) if rng.random() < 0.5 else gen.live())
        inst = None if rng.random() < 0.35 else rng.choice(gen.ids + [4])
        anchor = rng.choice([t for t in (lo, hi) if t is not None] or [tok(0)])
        sid = max(I64_MIN, min(I64_MAX, anchor.pos(inst) + rng.choice([-1, 0, 1, 2])))
        cases.append((lo, hi, inst, sid))
    out = rows(
        sql,
        """SELECT in_range(lo::multi_writer_token, hi::multi_writer_token, i, sid)
           FROM unnest(%s::text[], %s::text[], %s::int[], %s::bigint[]) WITH ORDINALITY AS u(lo, hi, i, sid, n)
           ORDER BY n""",
        (
            texts([c[0] for c in cases], room=False),
            texts([c[1] for c in cases], room=False),
            [c[2] for c in cases],
            [c[3] for c in cases],
        ),
    )
    for (lo, hi, inst, sid), (ours,) in zip(cases, out):
        slo = None if lo is None else syn_mw(lo, names)
        shi = None if hi is None else syn_mw(hi, names)
        name = None if inst is None else names.name(inst)
        tally.check(
            "in_range 4-arg (multi-writer)",
            lambda: MultiWriterStreamToken.is_stream_position_in_range(slo, shi, name, sid),
            ours,
            case=(lo and lo.text(False), hi and hi.text(False), inst, sid),
        )
