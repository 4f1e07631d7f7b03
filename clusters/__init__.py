"""Deployment: the embedded local cluster, Mooncake master supervision, the CLI."""

from raykv.clusters.local import LocalCluster, start_local

__all__ = ["LocalCluster", "start_local"]
