"""What one process sends while a block runs, counted at Ray's and the channel's own entry
points (nothing in raykv is changed): Ray actor calls by method name, named-actor
lookups (``get_actor``), channel requests by op (``channel:<op>``) and channel
connections opened (``channel_connect``). A rank stand-in (``CountingRank``) counts its
own calls the same way on any node.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv import CacheClient
from raykv.cache_actors.rank.channel_client import ChannelClient
from raykv.controllers import StorageConfig

from tests.integration.ranks import MHA


@contextlib.contextmanager
def counted() -> Iterator[Counter]:
    """Count, in this process and while the block runs, every call it sends."""
    sent: Counter = Counter()
    remote, get_actor = ray.actor.ActorMethod.remote, ray.get_actor
    call, open_ = ChannelClient.call, ChannelClient._open

    def remote_counted(self, *args, **kwargs):
        sent[self._method_name] += 1
        return remote(self, *args, **kwargs)

    def get_actor_counted(*args, **kwargs):
        sent["get_actor"] += 1
        return get_actor(*args, **kwargs)

    def call_counted(self, op, *args, **kwargs):
        sent[f"channel:{op}"] += 1
        return call(self, op, *args, **kwargs)

    def open_counted(self, *args, **kwargs):
        sent["channel_connect"] += 1
        return open_(self, *args, **kwargs)

    ray.actor.ActorMethod.remote, ray.get_actor = remote_counted, get_actor_counted
    ChannelClient.call, ChannelClient._open = call_counted, open_counted
    try:
        yield sent
    finally:
        ray.actor.ActorMethod.remote, ray.get_actor = remote, get_actor
        ChannelClient.call, ChannelClient._open = call, open_


def round_trips(sent: Counter) -> int:
    """Calls that wait for another process: Ray calls, lookups, channel requests and
    connections."""
    return sum(sent.values())


@ray.remote(num_cpus=0)
class CountingRank:
    """A rank with one registered MHA pool (``ranks.MHA``) that counts its calls."""

    def __init__(self, config: StorageConfig) -> None:
        self.client = CacheClient(config)
        self.client.register_mem_pool_host(self.client.create_host_pool("mha", **MHA))

    def register(self) -> str:
        return self.client.register_deployment()

    def group_exists(self, keys: list[str]) -> tuple[int, dict[str, int]]:
        """The group's hit for ``keys`` and the calls this process sent for it."""
        with counted() as sent:
            hit = self.client.group_exists(keys).kv_hit_pages
        return hit, dict(sent)


def counting_rank(node_id: str, config: StorageConfig):
    """A ``CountingRank`` hard-pinned to ``node_id``."""
    return CountingRank.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(config)
