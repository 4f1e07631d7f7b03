"""A stand-in inference rank: a Ray actor pinned to a node that drives a CacheClient.

Tests read results back through Ray for checking only; the cache itself moves bytes
through shared memory and Mooncake.
"""

from __future__ import annotations

import os

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv import CacheClient
from raykv.controllers import PoolName, StorageConfig

MHA = dict(page_size=4, size=64, layer_num=2, head_num=2, head_dim=8, dtype=torch.float16)
MLA = dict(page_size=4, size=64, layer_num=2, kv_cache_dim=16, dtype=torch.bfloat16)


@ray.remote(num_cpus=0)
class Rank:
    """One rank: a client with a registered KV pool (created or attached by name)."""

    def __init__(self, config: StorageConfig, kind: str = "mha", pool_name: str | None = None,
                 attach: bool = False, shape: dict | None = None) -> None:
        """``shape``: ``create_host_pool``'s sizes (default: ``MLA`` or ``MHA``)."""
        self.client = CacheClient(config)
        if attach:
            self.pool = self.client.attach_host_pool(pool_name)
        else:
            shape = shape or (MLA if kind == "mla" else MHA)
            self.pool = self.client.create_host_pool(kind, name=pool_name, **shape)
        self.client.register_mem_pool_host(self.pool)

    def pid(self) -> int:
        return os.getpid()

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

    def retry_unsent(self, on: bool) -> None:
        """Whether this process's links send a request again after a restart broke its
        connection before the request was written (``node_link.sent_again``; off: the
        control, no call is sent again)."""
        from raykv.cache_actors.rank import node_link

        plain = getattr(self, "_sent_again", None) or node_link.sent_again
        self._sent_again = plain
        node_link.sent_again = plain if on else (lambda error: False)

    def data(self, op: str, *args):
        """A raw data op (``DataOp``: exists / put / get) over this client's route to
        its node actor (the local channel), per-object codes back."""
        from raykv.cache_actors.data_ops import DataOp

        return self.client._link.data(DataOp(op), *args)


def start_rank(node_id: str, config: StorageConfig, **kw):
    """A ``Rank`` hard-pinned to ``node_id``; returns it once its pool is ready."""
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    rank = Rank.options(scheduling_strategy=strategy).remote(config, **kw)
    assert ray.get(rank.node_id.remote()) == node_id
    return rank


def indices(start: int, n: int, page_size: int = 4) -> torch.Tensor:
    return torch.arange(start, start + n * page_size)


# Pools of a small hybrid deployment: KV, Mamba (temporal + two conv buffers of other
# shapes and dtypes), SWA, DSA indexer and an MHA draft model. ``size`` counts slots.
HYBRID = {
    "kv": ("mha", MHA),
    "mamba": ("mamba", dict(size=16, temporal_shape=(2, 3, 4), temporal_dtype=torch.float32,
                            conv_shapes=[(2, 5), (2, 3, 2)],
                            conv_dtypes=[torch.bfloat16, torch.float16])),
    "swa": ("mha", MHA),
    "indexer": ("indexer", dict(page_size=4, size=64, layer_num=2, index_head_dim=12,
                                dtype=torch.uint8)),
    "draft": ("mha", dict(MHA, layer_num=1)),
}


@ray.remote(num_cpus=0)
class HybridRank:
    """A rank with several pools registered for the v2 API (``pools``: name -> (kind,
    create_host_pool kwargs), a subset of ``HYBRID`` by default)."""

    def __init__(self, config: StorageConfig, pools: dict | None = None) -> None:
        self.client = CacheClient(config)
        self.pools = {}
        for name, (kind, kw) in (pools or HYBRID).items():
            self.add_pool(name, kind, kw)

    def add_pool(self, name: str, kind: str, kw: dict) -> None:
        """Create pool ``kind`` and register it as ``PoolName(name)``."""
        pool = self.client.create_host_pool(kind, **kw)
        self.client.register_mem_host_pool_v2(pool, PoolName(name))
        self.pools[name] = pool

    def handles(self) -> dict:
        """Pool name -> ``PoolHandle`` as this rank mapped it."""
        return {name: pool.handle for name, pool in self.pools.items()}

    def node_id(self) -> str:
        return self.client.node_id

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for pool in self.pools.values():
            for buf in pool.buffers:
                raw = buf.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))

    def slots(self, name: str, slots: list[int]) -> list[torch.Tensor]:
        """Copies of the given slots of every buffer of pool ``name``."""
        idx = torch.as_tensor(slots)
        return [b.index_select(0, idx).clone() for b in self.pools[name].buffers]

    def call(self, method: str, *args, **kwargs):
        return getattr(self.client, method)(*args, **kwargs)


def start_hybrid(node_id: str, config: StorageConfig, pools: dict | None = None):
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    rank = HybridRank.options(scheduling_strategy=strategy).remote(config, pools)
    assert ray.get(rank.node_id.remote()) == node_id
    return rank


def planned(client: CacheClient, transfers, write: bool):
    """The ``TransferPlan`` of ``transfers`` as ``client`` lays them out (keyed hashes,
    its key scheme, its pools): the object batch a test sends a node actor itself."""
    from raykv.controllers.transfer_plan import plan_transfers

    pools = client._pools
    return plan_transfers(client._hashes.transfers(transfers), pools.plan_pools,
                          client.key_scheme, write=write, epoch=pools.epoch,
                          disabled=pools.disabled)
