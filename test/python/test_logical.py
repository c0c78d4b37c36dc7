"""Logical replication: a subscriber's streams are its own (its sequences
are not replicated, and instance ids and positions are the publisher's),
so the extension's catalog rows a subscription brings are not applied
(0.2.0: a FOR ALL TABLES publication made the subscription's sync of
streampos.streams fail in a loop, and the subscriber's frontier stayed 0
with rows present, next_id colliding, until a repair). The subscriber
registers the replicated tables as streams of its own, and a repair moves
their sequences past the rows (README, "Logical replication").

Runs on clusters of its own (cluster.py).
"""

import pytest

from cluster import Clusters
from support import wait_until


@pytest.fixture
def clusters():
    with Clusters() as made:
        yield made


def test_a_for_all_tables_subscription_leaves_the_catalog_alone(clusters):
    publisher = clusters.node(wal_level="logical")
    subscriber = clusters.node()
    for node in (publisher, subscriber):
        with node.connect() as c:
            c.execute("SELECT streampos.create_stream('ev')")
            c.execute("CREATE TABLE ev (id bigint PRIMARY KEY, writer text NOT NULL)")
            c.execute("SELECT streampos.add_table('ev', 'ev'::regclass, 'id', 'writer')")
    with publisher.connect() as p:
        for _ in range(5):
            p.execute("INSERT INTO ev SELECT streampos.next_id('ev', 'pub_writer'), 'pub_writer'")
        p.execute("CREATE PUBLICATION everything FOR ALL TABLES")
    with subscriber.connect() as s:
        local_seq = s.execute("SELECT seq::text FROM streampos.streams").fetchall()
        s.execute(f"CREATE SUBSCRIPTION sub CONNECTION '{publisher.conninfo()}' PUBLICATION everything")
        wait_until(
            lambda: s.execute("SELECT count(*) FROM pg_subscription_rel WHERE srsubstate <> 'r'").fetchone()[0] == 0
            and s.execute("SELECT count(*) FROM ev").fetchone()[0] == 5,
            timeout=60,
            message="the subscription to sync",
        )
        with publisher.connect() as p:
            p.execute("INSERT INTO ev SELECT streampos.next_id('ev', 'pub_writer'), 'pub_writer'")
        wait_until(lambda: s.execute("SELECT count(*) FROM ev").fetchone()[0] == 6, timeout=30,
                   message="a new row to be applied")
        if s.info.server_version >= 150000:
            errors = s.execute("SELECT apply_error_count + sync_error_count FROM pg_stat_subscription_stats").fetchone()[0]
        else:
            # PostgreSQL 14 has no pg_stat_subscription_stats: a failed
            # apply or sync worker exits with code 1 in the server log.
            errors = sum(
                1
                for line in subscriber.log_tail(400).splitlines()
                if '"logical replication worker"' in line and "exited with exit code 1" in line
            )
        assert errors == 0, f"the subscription failed {errors} times:\n{subscriber.log_tail(40)}"
        # The catalog is the subscriber's own.
        assert s.execute("SELECT seq::text FROM streampos.streams").fetchall() == local_seq
        assert s.execute("SELECT count(*) FROM streampos.instances WHERE instance_name = 'pub_writer'").fetchone()[0] == 0
        assert s.execute("SELECT count(*) FROM streampos.stream_positions").fetchone()[0] == 0
        # Its stream's sequence knows nothing of the replicated rows until
        # a repair moves it past them; then it allocates above them.
        checks = dict(s.execute("SELECT check_name, ok FROM streampos.check_stream('ev')").fetchall())
        assert False in checks.values(), checks
        s.execute("SELECT * FROM streampos.check_stream('ev', repair => true)")
        s.execute("DROP SUBSCRIPTION sub")
        assert s.execute("SELECT streampos.next_id('ev', 'sub_writer')").fetchone()[0] == 7
        assert s.execute("SELECT streampos.frontier('ev')").fetchone()[0] == 7
