"""Fixtures of the cluster tests, defined in :mod:`helpers`: ``cluster`` (a :class:`helpers.Cluster`) and
``engines`` (pids reaped after the test)."""

from helpers import cluster, engines  # noqa: F401 (fixtures)
