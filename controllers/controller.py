"""``CacheController``: the one global, detached, named actor of a raykv cluster.

It is off the byte path. It records where the store is (Mooncake master and metadata
server) and which node actors serve which Ray nodes, so any process can find them.
"""

from __future__ import annotations

import ray

from controllers.naming import node_actor_name


@ray.remote(num_cpus=0)
class CacheController:
    """Registry of the cluster's store addresses and node cache actors."""

    def __init__(self, master_address: str, metadata_server: str, cluster_tag: str) -> None:
        self._info = {"master_address": master_address, "metadata_server": metadata_server,
                      "cluster_tag": cluster_tag}
        self._nodes: dict[str, str] = {}

    def info(self) -> dict:
        """``master_address``, ``metadata_server``, ``cluster_tag`` and the node ids."""
        return self._info | {"node_ids": sorted(self._nodes)}

    def register_node(self, node_id: str) -> str:
        """Record that ``node_id`` has a cache actor; returns that actor's name."""
        self._nodes[node_id] = node_actor_name(node_id)
        return self._nodes[node_id]

    def retire_node(self, node_id: str) -> bool:
        """Forget ``node_id``; False if it was not registered."""
        return self._nodes.pop(node_id, None) is not None

    def nodes(self) -> dict[str, str]:
        """Node id -> name of its cache actor."""
        return dict(self._nodes)
