"""L2Blocks, a worker's side of its node's L2, against an in-memory stand-in for the
node's L2 ops (the real ``L2Index`` behind it): blocks copied into pages and back,
blocks L2 has no page for handed back, a lost pool reopened."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from raykv.cache_actors.node.l2_index import L2Index
from raykv.integrations.vllm.l2_blocks import L2Blocks

BLOCK = (2, 4)  # one layer's block: 2 heads x 4 values
PAGES = 3


class FakeLink:
    """The node's L2 ops for one pool, over a real ``L2Index`` (``acquire`` never
    fills: nothing is in L3)."""

    holder = (1, 1)

    def __init__(self) -> None:
        self.index = L2Index(PAGES, 10, time.monotonic)
        self.pool = SimpleNamespace(name="l2-pool")
        self.gone = False
        self.opened = 0

    def _check(self, pool: str) -> None:
        if self.gone or pool != self.pool.name:
            raise ValueError(f"{pool!r} is no L2 pool of the caller's on this node")

    def acquire(self, pool, hashes, fill):
        self._check(pool)
        self.index.release(self.holder)
        return self.index.acquire(self.holder, list(hashes))

    def reserve(self, pool, hashes):
        self._check(pool)
        self.index.release(self.holder)
        return self.index.reserve(self.holder, list(hashes))

    def commit(self, pool, hashes, pages, ok):
        self._check(pool)
        return len(self.index.commit(self.holder, pages, ok, dirty=False))

    def open(self, layout, pages):
        self.opened += 1
        self.gone = False
        self.pool = SimpleNamespace(name=f"l2-pool-{self.opened}")
        return self.pool


def engine(blocks: int = 6, layers: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(blocks, *BLOCK) for _ in range(layers)]


def l2(link: FakeLink, layers: list[torch.Tensor], store: list[torch.Tensor]) -> L2Blocks:
    return L2Blocks(link, link.pool, layers, lambda pool: store, layout=None, pages=PAGES)


def test_saved_blocks_load_into_another_engine_byte_for_byte():
    link = FakeLink()
    store = [torch.zeros(PAGES, *BLOCK) for _ in range(2)]  # the pool's pages per layer
    a, b = engine(), engine()
    for layer in a:
        layer.normal_()
    saved, full = l2(link, a, store).save([4, 1], ["h4", "h1"])
    assert (saved, full) == (2, [])
    assert l2(link, b, store).load([0, 5], ["h4", "h1"]) == 2
    for la, lb in zip(a, b, strict=True):
        assert torch.equal(lb[0], la[4]) and torch.equal(lb[5], la[1])
    assert link.index.stats()["held"] == 0  # the load gave its pages back


def test_blocks_without_a_page_are_handed_back_and_a_miss_stops_a_load():
    link = FakeLink()
    store = [torch.zeros(PAGES, *BLOCK)]
    a = engine(layers=1)
    saved, full = l2(link, a, store).save([0, 1, 2, 3, 4], [f"h{i}" for i in range(5)])
    assert (saved, full) == (3, [3, 4])
    assert l2(link, engine(layers=1), store).load([0, 1], ["h0", "nope"]) == 1


def test_a_lost_pool_is_reopened_in_the_background():
    link = FakeLink()
    store = [torch.zeros(PAGES, *BLOCK)]
    blocks = l2(link, engine(layers=1), store)
    link.gone = True  # the node actor restarted
    with pytest.raises(ValueError, match="no L2 pool"):
        blocks.load([0], ["h0"])
    deadline = time.monotonic() + 5
    while not blocks.usable or blocks.pool.name != "l2-pool-1":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert blocks.save([0], ["h0"]) == (1, [])
