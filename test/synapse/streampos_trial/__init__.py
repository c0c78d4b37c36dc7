"""streampos's own trial tests of streampos.synapse, run by scripts/synapse-tests
inside Synapse's test harness (its HomeserverTestCase, on PostgreSQL)."""
