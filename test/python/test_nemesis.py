"""The nemesis (nemesis.py; docs/torture.md, "Nemesis"): the torture load
and its reference model while crashes, clean restarts, a promotion,
prepared transactions, dying holds, set_writers, add_table, dropped tables,
a column's type, setval, drop_stream/create_stream, consumers and
retention happen, for a fixed set of seeds.

Every run is on clusters of its own (cluster.py: a primary and a
synchronous hot standby, own ports and data directories), never on the
server the rest of the suite shares. A failure names its seed and step;
replay it with ``python3 test/python/nemesis.py --seed N`` (docs/torture.md).
"""

import pytest

from cluster import DBNAME, USER, Clusters
from nemesis import KNOWN_FINDINGS, Nemesis

# Fixed seeds; between them crashes, clean restarts, a promotion,
# drop_stream/create_stream, each prepared transaction across a start and
# every step taken during the load (the schedule a seed draws is fixed).
SEEDS = (4, 5, 6, 14)
STEPS = 10
PHASE_SECONDS = 2.0

# Seeds that found a defect, kept as tests: (seed, steps until it showed,
# whether the standby sends hot_standby_feedback, the finding).
FINDINGS = [
    (2, 6, False, "a prepared transaction outlived a clean restart: every writer's position and token "
                  "entry fell back to the stored frontier (fixed in 0.4.0: streampos.prepared_holds)"),
    (7, 5, True, "a clean restart of a primary whose standby sends hot_standby_feedback sent every "
                 "writer's position back (fixed in 0.4.0: sql::older_than_start)"),
]


def make_pair(clusters, feedback):
    """A primary with prepared transactions and a synchronous standby (the
    one a promotion step promotes; the nemesis makes the next, with the
    same feedback setting)."""
    return clusters.pair(synchronous=True, primary_settings={"max_prepared_transactions": 10},
                         standby_settings={"hot_standby_feedback": "on" if feedback else "off"})


@pytest.fixture
def clusters():
    with Clusters() as made:
        yield made


def nemesis(pair, seed, feedback=False, **kwargs):
    primary, standby = pair
    conninfo = dict(host="127.0.0.1", port=primary.port, dbname=DBNAME, user=USER)
    return Nemesis(conninfo, pgdata=primary.datadir, standby=(standby.datadir, standby.port), seed=seed,
                   phase_seconds=PHASE_SECONDS, log=print, feedback=feedback, **kwargs)


@pytest.mark.parametrize("seed", SEEDS)
def test_nemesis(clusters, seed):
    """Nothing the model checks is broken (a ContractViolation names the
    seed, the step and what was found otherwise); every step, the prepared
    transactions across a start among them. The standby sends no
    feedback."""
    out = nemesis(make_pair(clusters, False), seed, exclude=KNOWN_FINDINGS).run(steps=STEPS)
    print(out)
    assert out["steps"] >= STEPS


@pytest.mark.parametrize("seed,steps,feedback,finding", FINDINGS, ids=[str(f[0]) for f in FINDINGS])
def test_nemesis_finding(clusters, seed, steps, feedback, finding):
    """A seed that found a defect, replayed: it must find nothing now."""
    nemesis(make_pair(clusters, feedback), seed, feedback=feedback).run(steps=steps)
