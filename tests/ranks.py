"""A stand-in inference rank: a Ray actor pinned to a node that drives a CacheClient.

Tests read results back through Ray for checking only; the cache itself moves bytes
through shared memory and Mooncake.
"""

from __future__ import annotations

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cache_actors import CacheClient
from controllers import StorageConfig

MHA = dict(page_size=4, size=64, layer_num=2, head_num=2, head_dim=8, dtype=torch.float16)
MLA = dict(page_size=4, size=64, layer_num=2, kv_cache_dim=16, dtype=torch.bfloat16)


@ray.remote(num_cpus=0)
class Rank:
    """One rank: a client with a registered KV pool (created or attached by name)."""

    def __init__(self, config: StorageConfig, kind: str = "mha", pool_name: str | None = None,
                 attach: bool = False) -> None:
        self.client = CacheClient(config)
        if attach:
            self.pool = self.client.attach_host_pool(pool_name)
        else:
            shape = MLA if kind == "mla" else MHA
            self.pool = self.client.create_host_pool(kind, name=pool_name, **shape)
        self.client.register_mem_pool_host(self.pool)

    def node_id(self) -> str:
        return self.client.node_id

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        data = torch.randn(self.pool.kv_buffer.shape, generator=g)
        self.pool.kv_buffer.copy_(data.to(self.pool.kv_buffer.dtype))

    def pages(self, start: int, n: int) -> torch.Tensor:
        """A copy of ``n`` pages' token slots from slot ``start`` (all buffers)."""
        stop = start + n * self.pool.page_size
        buf = self.pool.kv_buffer
        return (buf[:, start:stop] if buf.dim() == 5 else buf[start:stop]).clone()

    def kv_meta(self, start: int, n: int) -> tuple[list[int], list[int]]:
        """``get_page_buffer_meta`` of ``n`` pages from slot ``start`` (this process's pointers)."""
        return self.pool.get_page_buffer_meta(indices(start, n, self.pool.page_size))

    def call(self, method: str, *args, **kwargs):
        return getattr(self.client, method)(*args, **kwargs)


def start_rank(node_id: str, config: StorageConfig, **kw):
    """A ``Rank`` hard-pinned to ``node_id``; returns it once its pool is ready."""
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    rank = Rank.options(scheduling_strategy=strategy).remote(config, **kw)
    assert ray.get(rank.node_id.remote()) == node_id
    return rank


def indices(start: int, n: int, page_size: int = 4) -> torch.Tensor:
    return torch.arange(start, start + n * page_size)
