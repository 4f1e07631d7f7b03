"""Ranks that loop puts and gets of checksummed pages (each page's bytes derive from its
key), for tests that change pools under them (tests/integration/test_pool_teardown.py).
A Ray actor class lives here, not in a test module, so that workers can import it."""

from __future__ import annotations

import zlib

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv import CacheClient
from raykv.controllers import StorageConfig

from tests.integration.ranks import MHA, indices

PAGES = 4
POOL = MHA | {"size": 256}  # 64 pages: room for 8 loopers sharing one pool


def fill_page(buf: torch.Tensor, start: int, key: str) -> None:
    """Write the checksummed pattern of ``key`` into the page at slot ``start``."""
    page = buf[:, start:start + MHA["page_size"]].view(torch.int16)
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    page.copy_(torch.randint(-30000, 30000, page.shape, dtype=torch.int16, generator=g))


def page_ok(buf: torch.Tensor, start: int, key: str) -> bool:
    """Whether the page at slot ``start`` holds exactly ``key``'s pattern."""
    page = buf[:, start:start + MHA["page_size"]].view(torch.int16)
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    want = torch.randint(-30000, 30000, page.shape, dtype=torch.int16, generator=g)
    return torch.equal(page, want)


@ray.remote(num_cpus=0, max_concurrency=2)
class Looper:
    """A rank putting and getting checksummed pages through pool ``pool`` (attached by
    name, or its own) until a call fails or ``rounds`` ran; ``rounds_done`` answers
    while it loops."""

    def __init__(self, uid: str, pool: str, attach: bool, slot: int = 0,
                 timeout_s: float | None = None) -> None:
        self.uid = uid
        self.put_at, self.get_at = slot, slot + PAGES * MHA["page_size"]  # own pages
        extra = {} if timeout_s is None else {"timeout_s": timeout_s}
        self.client = CacheClient(StorageConfig(model_name="teardown/" + uid[:4],
                                                extra_config=extra))
        self.pool = (self.client.attach_host_pool(pool) if attach
                     else self.client.create_host_pool("mha", name=pool, **POOL))
        self.client.register_mem_pool_host(self.pool)
        self.done = 0

    def rounds_done(self) -> int:
        return self.done

    def loop(self, rounds: int) -> dict:
        stored, mismatched, error = [], [], None
        buf = self.pool.kv_buffer
        try:
            for r in range(rounds):
                keys = [f"{self.uid}-{r}-{i}" for i in range(PAGES)]
                for i, k in enumerate(keys):
                    fill_page(buf, self.put_at + i * MHA["page_size"], k)
                ok = self.client.batch_set_v1(keys, indices(self.put_at, PAGES))
                stored += [k for k, o in zip(keys, ok, strict=True) if o]
                got = self.client.batch_get_v1(keys, indices(self.get_at, PAGES))
                mismatched += [
                    k for i, (k, g) in enumerate(zip(keys, got, strict=True))
                    if g and not page_ok(buf, self.get_at + i * MHA["page_size"], k)]
                self.done = r + 1
        except Exception as e:  # noqa: BLE001 - the destroy ends the loop; reported
            error = f"{type(e).__name__}: {e}"
        return {"stored": stored, "mismatched": mismatched, "error": error}


    def verify(self, keys: list[str]) -> list[str]:
        """The ``keys`` that do not read back as their pattern, through a fresh pool."""
        pool = self.client.create_host_pool("mha", name=f"teardown-verify-{self.uid}",
                                            **POOL)
        self.client.register_mem_pool_host(pool)
        bad = []
        for start in range(0, len(keys), PAGES * 4):
            chunk = keys[start:start + PAGES * 4]
            got = self.client.batch_get_v1(chunk, indices(0, len(chunk)))
            bad += [k for i, (k, g) in enumerate(zip(chunk, got, strict=True))
                    if not g or not page_ok(pool.kv_buffer, i * MHA["page_size"], k)]
        self.client.destroy_host_pool(pool)
        return bad


def looper(node_id: str, uid: str, pool: str, attach: bool, slot: int = 0,
           timeout_s: float | None = None):
    """A ``Looper`` pinned to ``node_id``, its pages from token slot ``slot`` on, its
    calls' deadline ``timeout_s`` (None: the default)."""
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return Looper.options(scheduling_strategy=strategy).remote(uid, pool, attach, slot,
                                                               timeout_s)


