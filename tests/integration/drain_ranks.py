"""A rank for drain tests: writes pages whose bytes derive from their keys, reads them
back and says per page exact / miss / wrong, and reads in a loop while a drain runs
(each call timed inside the rank). A Ray actor class lives here, not in a test module,
so that workers can import it."""

from __future__ import annotations

import threading
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv import CacheClient
from raykv.controllers import StorageConfig

from tests.integration.loopers import fill_page, page_ok
from tests.integration.ranks import MHA, indices

POOL_PAGES = 256
"""Pages of a drain test's pool (of small pages); each call moves a pool's worth."""


@ray.remote(num_cpus=0, max_concurrency=2)
class DrainRank:
    """A rank with a pool of ``pages`` pages of ``MHA`` geometry (``head_dim`` its
    own: the page size in bytes) under model ``model``."""

    def __init__(self, model: str, pages: int, head_dim: int = MHA["head_dim"],
                 timeout_s: float | None = None) -> None:
        extra = {} if timeout_s is None else {"timeout_s": timeout_s}
        self.client = CacheClient(StorageConfig(model_name=model, extra_config=extra))
        shape = MHA | {"size": pages * MHA["page_size"], "head_dim": head_dim}
        self.pool = self.client.create_host_pool("mha", **shape)
        self.client.register_mem_pool_host(self.pool)
        self.pages = pages
        self._stop = threading.Event()

    def node_id(self) -> str:
        return self.client.node_id

    def page_bytes(self) -> int:
        return self.pool.kv_buffer[:, :MHA["page_size"]].numel() * 2

    def write(self, keys: list[str]) -> list[bool]:
        """Put each key's page (its pattern), a pool's worth of pages a call."""
        ok: list[bool] = []
        for start in range(0, len(keys), self.pages):
            chunk = keys[start:start + self.pages]
            for i, k in enumerate(chunk):
                fill_page(self.pool.kv_buffer, i * MHA["page_size"], k)
            ok += self.client.batch_set_v1(chunk, indices(0, len(chunk)))
        return ok

    def read(self, keys: list[str]) -> list[str]:
        """Per key ``exact``, ``miss`` or ``wrong`` (read, other bytes), a pool's worth
        of pages a call."""
        out: list[str] = []
        for start in range(0, len(keys), self.pages):
            chunk = keys[start:start + self.pages]
            got = self.client.batch_get_v1(chunk, indices(0, len(chunk)))
            out += ["miss" if not g else
                    "exact" if page_ok(self.pool.kv_buffer, i * MHA["page_size"], k)
                    else "wrong" for i, (k, g) in enumerate(zip(chunk, got, strict=True))]
        return out

    def read_loop(self, keys: list[str]) -> dict:
        """Read ``keys`` (one call each round) until ``stop``: the rounds, the longest
        call in seconds, per outcome how many pages, and the first error raised."""
        counts = {"exact": 0, "miss": 0, "wrong": 0}
        rounds, longest, error = 0, 0.0, None
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                outcome = self.read(keys)
            except Exception as e:  # noqa: BLE001 - reported: a call must not raise
                error = f"{type(e).__name__}: {e}"
                break
            longest = max(longest, time.monotonic() - t)
            rounds += 1
            for o in outcome:
                counts[o] += 1
        return {"rounds": rounds, "longest_s": longest, "error": error, **counts}

    def stop(self) -> None:
        self._stop.set()


def drain_rank(node_id: str, model: str, pages: int, **kw):
    """A ``DrainRank`` hard-pinned to ``node_id``; returns it once its pool is ready."""
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    rank = DrainRank.options(scheduling_strategy=strategy).remote(model, pages, **kw)
    assert ray.get(rank.node_id.remote()) == node_id
    return rank
