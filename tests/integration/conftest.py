"""Fixtures of the cluster tests, defined in :mod:`cluster_helpers`: ``cluster`` (a running cluster's handle)
and ``engines`` (pids reaped after the test)."""

from cluster_helpers import cluster, engines  # noqa: F401 (fixtures)
