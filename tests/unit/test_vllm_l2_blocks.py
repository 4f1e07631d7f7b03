"""L2Blocks, a worker's side of its node's L2, against an in-memory stand-in for the
node's L2 ops (the real ``L2Index`` behind it): blocks copied into pages and back,
blocks L2 has no page for handed back, a lost pool reopened."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import pytest
import torch
from raykv.cache_actors.errors import UnknownPoolError
from raykv.cache_actors.node.l2_index import L2Index
from raykv.integrations.vllm.l2_blocks import L2Blocks

BLOCK = (2, 4)  # one layer's block: 2 heads x 4 values
PAGES = 3


class FakePool:
    """An L2 pool as ``L2Blocks`` sees it: its name and ``held`` (``HostPool.held``),
    which counts the holds open now (``holds``) and yields the pool itself."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.holds = 0

    @contextlib.contextmanager
    def held(self):
        self.holds += 1
        try:
            yield self
        finally:
            self.holds -= 1


class FakeLink:
    """The node's L2 ops for one pool, over a real ``L2Index`` (``acquire`` never
    fills: nothing is in L3)."""

    holder = (1, 1)

    def __init__(self) -> None:
        self.index = L2Index(PAGES, 10, time.monotonic)
        self.pool = FakePool("l2-pool")
        self.gone = False
        self.opened = 0

    def _check(self, pool: str) -> None:
        if self.gone or pool != self.pool.name:
            raise UnknownPoolError(f"{pool!r} is no L2 pool of the caller's on this node")

    def acquire(self, pool, hashes, fill):
        self._check(pool)
        self.index.release(self.holder)
        return self.index.acquire(self.holder, list(hashes))

    def reserve(self, pool, hashes):
        self._check(pool)
        self.index.release(self.holder)
        return self.index.reserve(self.holder, list(hashes))

    def commit(self, pool, hashes, pages, ok, holder=None):
        self._check(pool)
        return len(self.index.commit(holder or self.holder, pages, ok, dirty=False))

    def open(self, layout, pages):
        self.opened += 1
        self.gone = False
        self.pool = FakePool(f"l2-pool-{self.opened}")
        return self.pool


def engine(blocks: int = 6, layers: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(blocks, *BLOCK) for _ in range(layers)]


def l2(link: FakeLink, layers: list[torch.Tensor], store: list[torch.Tensor]) -> L2Blocks:
    return L2Blocks(link, link.pool, layers, lambda pool: store, layout=None, pages=PAGES)


def worker(**config):
    """A one-rank worker side of the connector (no vLLM, no raykv attached) with
    ``l2_blocks`` = ``PAGES`` and the extra config ``config``."""
    from raykv.integrations.vllm.options import ConnectorOptions, KVIdentity
    from raykv.integrations.vllm.worker import RayKVConnectorWorker

    opts = ConnectorOptions.parse({"l2_blocks": PAGES, **config}, tp_size=1, pp_size=1,
                                  served_model="m",
                                  identity=KVIdentity("float32", 4, "cpu.lm1"))
    return RayKVConnectorWorker(opts, None, block_size=4, tp_rank=0, tp_size=1, pp_rank=0,
                                pp_size=1)


def test_saved_blocks_load_into_another_engine_byte_for_byte():
    link = FakeLink()
    store = [torch.zeros(PAGES, *BLOCK) for _ in range(2)]  # the pool's pages per layer
    a, b = engine(), engine()
    for layer in a:
        layer.normal_()
    saved, full = l2(link, a, store).save([4, 1], ["h4", "h1"])
    assert (saved, full) == (2, [])
    assert l2(link, b, store).load([0, 5], ["h4", "h1"]) == (2, [])
    for la, lb in zip(a, b, strict=True):
        assert torch.equal(lb[0], la[4]) and torch.equal(lb[5], la[1])
    assert link.index.stats().held == 0  # the load gave its pages back


def test_blocks_without_a_page_are_handed_back_and_a_miss_stops_a_load():
    link = FakeLink()
    store = [torch.zeros(PAGES, *BLOCK)]
    a = engine(layers=1)
    saved, full = l2(link, a, store).save([0, 1, 2, 3, 4], [f"h{i}" for i in range(5)])
    assert (saved, full) == (3, [3, 4])
    assert l2(link, engine(layers=1), store).load([0, 1], ["h0", "nope"]) == (1, [])


def test_a_hole_in_a_chain_stops_loads_until_a_later_save_fills_it():
    """Block h0 of a chain was never saved (dropped, or its save failed) while h1 and h2
    were: a load of the chain stops at the hole and loads nothing (h1 and h2 are only
    unused pages, never loaded after a block that is not there). The next engine that
    computes h0 saves it, and the whole chain loads again, byte for byte: why the
    connector keeps saving a request's later blocks after a lost one."""
    link = FakeLink()
    store = [torch.zeros(PAGES, *BLOCK)]
    a = engine(layers=1)
    a[0].normal_()
    assert l2(link, a, store).save([1, 2], ["h1", "h2"]) == (2, [])
    b = engine(layers=1)
    assert l2(link, b, store).load([3, 4, 5], ["h0", "h1", "h2"]) == (0, [])
    assert not b[0].any()
    assert l2(link, a, store).save([0, 1, 2], ["h0", "h1", "h2"]) == (3, [])  # 2 PRESENT
    assert l2(link, b, store).load([3, 4, 5], ["h0", "h1", "h2"]) == (3, [])
    assert torch.equal(b[0][3:6], a[0][0:3])


def test_a_lost_pool_is_reopened_in_the_background():
    link = FakeLink()
    store = [torch.zeros(PAGES, *BLOCK)]
    blocks = l2(link, engine(layers=1), store)
    link.gone = True  # the node actor restarted
    with pytest.raises(UnknownPoolError, match="no L2 pool"):
        blocks.load([0], ["h0"])
    deadline = time.monotonic() + 5
    while not blocks.usable or blocks.pool.name != "l2-pool-1":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert blocks.save([0], ["h0"]) == (1, [])


@pytest.mark.parametrize("async_transfers", [True, False], ids=["async", "control-sync"])
@pytest.mark.engine("vllm")
def test_async_saves_drop_and_count_what_l2_has_no_page_for(async_transfers):
    """A worker's step saving 5 blocks of two requests into an L2 of 3 pages whose
    write-behind is behind (committed pages stay dirty): with ``async_transfers`` one
    batch fills the 3 pages and the 2 blocks without a page are
    dropped and counted (``save_dropped``), never sent to the store on the step.
    Control (saves on the step): those 2 go to the store (here unreachable: counted
    failed), and nothing is counted dropped."""
    from raykv.cache_actors.rank.call_budget import Budget
    from raykv.integrations.vllm.metadata import RayKVConnectorMetadata
    from raykv.integrations.vllm.request_blocks import BlockTransfer

    w = worker(async_transfers=async_transfers, timeout_s=0.2)
    class BehindLink(FakeLink):
        """Committed pages stay dirty: the node's write-behind has not put them yet."""

        def commit(self, pool, hashes, pages, ok, holder=None):
            self._check(pool)
            return len(self.index.commit(holder or self.holder, pages, ok, dirty=True))

    link = BehindLink()
    w._steps.l2 = l2(link, engine(layers=1), [torch.zeros(PAGES, *BLOCK)])
    w._step_budget = Budget(0.2)
    stored = []

    def batch_set_v2(transfers):  # the store, unreachable
        stored.append(transfers)
        raise ConnectionError("store down")

    w._client = SimpleNamespace(batch_set_v2=batch_set_v2)
    meta = RayKVConnectorMetadata(saves=[BlockTransfer("r1", [0, 1, 2], ["a", "b", "c"]),
                                         BlockTransfer("r2", [3, 4], ["d", "e"])])
    w.wait_for_save(meta)
    w.settle()  # the async batch is committed behind the step: counted once settled
    s = w.stats
    assert s.l2_saved == 3 and link.index.stats().ready == 3
    if async_transfers:
        assert s.save_dropped == 2 and s.save_failed == 0 and not stored
    else:
        assert s.save_dropped == 0 and s.save_failed == 2 and len(stored) == 1
    assert s.save_us > 0


@pytest.mark.engine("vllm")
def test_blocks_l2_has_no_page_for_are_loaded_through_the_store():
    """A step's load of three blocks of which L2 holds the first two and has no page to
    read the third into from L3 (L2 under pressure): the third comes through the staging
    pool (one store get of it alone, counted in ``loaded_past_l2``), not recomputed.
    (Before: the load stopped where L2 stopped, and vLLM recomputed the rest.)"""
    from raykv.controllers.contract import PoolName
    from raykv.integrations.vllm.metadata import RayKVConnectorMetadata
    from raykv.integrations.vllm.request_blocks import BlockTransfer

    w = worker(timeout_s=1.0)
    link = FakeLink()
    store = [torch.zeros(PAGES, *BLOCK)]
    a = engine(layers=1)
    a[0].normal_()
    assert l2(link, a, store).save([0, 1], ["h0", "h1"]) == (2, [])
    w._layers = engine(layers=1)
    w._steps.l2 = l2(link, w._layers, store)
    asked = []

    def batch_get_v2(transfers):  # the store through the staging pool: h2 is there
        (t,) = transfers
        asked.append(list(t.keys))
        return {PoolName.KV: [True] * len(t.keys)}

    w._client = SimpleNamespace(batch_get_v2=batch_get_v2)
    w.start_load_kv(RayKVConnectorMetadata(
        loads=[BlockTransfer("r", [3, 4, 5], ["h0", "h1", "h2"])]))
    assert asked == [["h2"]]
    assert w.stats.loaded == 3 and w.stats.l2_loaded == 2
    assert w.stats.loaded_past_l2 == 1 and w.stats.load_failed == 0
    assert w.get_block_ids_with_load_errors() == set()
    assert torch.equal(w._layers[0][3:5], a[0][0:2])


def test_a_save_behind_commits_on_its_own_thread_for_the_reserving_one():
    """``save_behind`` copies (host KV cache: at once), returns, and its thread commits
    the pages for the thread that reserved them: another engine then loads them byte
    for byte; a block L2 holds already is counted as ``save`` counts it."""
    link = FakeLink()
    store = [torch.zeros(PAGES, *BLOCK)]
    a = engine(layers=1)
    a[0].normal_()
    blocks = l2(link, a, store)
    assert blocks.save([0], ["h0"]) == (1, [])
    behind = blocks.save_behind([0, 1, 2], ["h0", "h1", "h2"])
    assert behind.wait() == (3, [])  # h0 present, h1 and h2 committed
    assert link.index.stats().held == 0
    b = engine(layers=1)
    assert l2(link, b, store).load([3, 4, 5], ["h0", "h1", "h2"]) == (3, [])
    assert torch.equal(b[0][3:6], a[0][0:3])


@pytest.mark.parametrize("save", ["save", "save_behind"])
def test_a_block_another_engine_is_still_writing_is_neither_counted_nor_published(save):
    """Engine A reserved h0 and is still copying it in when engine B saves h0 and h1: B
    counts h0 as one L2 had no page for (``WRITING``), not as stored, and its KV events
    publish h1 only; A's write then fails, and h0 is in L2 nowhere, as B's answer
    said. (Before: B counted h0 saved and published it stored in L2.)"""
    from raykv.integrations.vllm.kv_events import L2, LandedBlocks

    link_a, link_b = FakeLink(), FakeLink()
    link_b.index, link_b.holder = link_a.index, (2, 1)  # one pool, two engines
    link_a.index.reserve(link_a.holder, ["h0"])  # A writes h0
    blocks = l2(link_b, engine(layers=1), [torch.zeros(PAGES, *BLOCK)])
    answer = blocks.save([0, 1], ["h0", "h1"]) if save == "save" else \
        blocks.save_behind([0, 1], ["h0", "h1"]).wait()
    assert answer == (1, [0])
    landed = LandedBlocks(True)
    landed.l2_saved(["h0", "h1"], *answer)
    assert landed.take() == [(L2, "h1")]
    link_a.index.release(link_a.holder)  # A's write did not end
    assert link_a.index.lookup(["h0"]) == 0 and link_a.index.lookup(["h1"]) == 1


@pytest.mark.parametrize("settled", [True, False], ids=["settled", "control-unsettled"])
@pytest.mark.engine("vllm")
def test_no_l2_op_of_the_next_step_comes_before_the_last_steps_commit(settled):
    """A worker's async L2 save behind step N is committed by its own thread, slowly
    (the node answers after 0.3 s); step N+1's ``start_load_kv`` makes its first L2 op
    (the load's acquire, which releases the thread's earlier pages) only after that
    commit returned, so no reserved page is released while its copy may still write it.
    Control: an L2 load that does not settle first acquires while the commit is still
    under way."""
    from raykv.cache_actors.rank.call_budget import Budget
    from raykv.integrations.vllm.metadata import RayKVConnectorMetadata
    from raykv.integrations.vllm.request_blocks import BlockTransfer

    events = []

    class SlowLink(FakeLink):
        def commit(self, pool, hashes, pages, ok, holder=None):
            time.sleep(0.3)
            out = super().commit(pool, hashes, pages, ok, holder)
            events.append("commit")
            return out

        def acquire(self, pool, hashes, fill):
            events.append("acquire")
            return super().acquire(pool, hashes, fill)

    w = worker(async_transfers=True, timeout_s=2.0)
    link = SlowLink()
    w._layers = engine(layers=1)
    w._steps.l2 = l2(link, w._layers, [torch.zeros(PAGES, *BLOCK)])
    w._step_budget = Budget(2.0)
    w._client = SimpleNamespace()
    w.wait_for_save(RayKVConnectorMetadata(saves=[BlockTransfer("r1", [0, 1], ["a", "b"])]))
    assert events == []  # the commit runs behind the step
    if settled:
        w.start_load_kv(RayKVConnectorMetadata(loads=[BlockTransfer("r2", [4, 5],
                                                                    ["a", "b"])]))
        assert events[:2] == ["commit", "acquire"]
        assert w.stats.l2_saved == 2 and w.stats.l2_loaded == 2
    else:
        w._steps.l2.load([4, 5], ["a", "b"])
        assert events[0] == "acquire"
        w.settle()


def test_a_save_behind_whose_copy_fails_frees_its_pages_and_raises():
    """A copy that fails after the pages were reserved (a block view of other bytes than
    the pool's pages) raises, and its pages are committed as not written: free for the
    next writer, never read. Control: a later save of the same keys finds them free."""
    link = FakeLink()
    blocks = l2(link, [torch.zeros(6, 3)], [torch.zeros(PAGES, *BLOCK)])  # 3 != (2, 4)
    with pytest.raises(RuntimeError):
        blocks.save_behind([0, 1], ["h0", "h1"])
    assert link.index.stats().held == 0 and link.index.stats().ready == 0
    good = l2(link, engine(layers=1), [torch.zeros(PAGES, *BLOCK)])
    assert good.save_behind([0, 1], ["h0", "h1"]).wait() == (2, [])


@pytest.mark.parametrize("op", ["load", "save", "save_behind"])
def test_an_op_copies_only_through_the_pool_it_holds_pages_of(op):
    """Another thread of the worker (the async loads', a save's commit) finds the L2
    gone and the L2 is reopened (a new pool: the node actor restarted or its pool
    memory was allocated anew) between this thread's acquire or reserve and its copy:
    the copy still goes to or from the pages it was given, in the pool that gave them,
    never the same page numbers of the new pool, whose pages hold other blocks (or are
    another writer's). Control: the new pool's page is untouched and no block of it is
    loaded as if it were the key asked for."""
    link = FakeLink()
    stores = {"l2-pool": [torch.zeros(PAGES, *BLOCK)], "l2-pool-new": [torch.zeros(PAGES, *BLOCK)]}
    a = engine(layers=1)
    a[0].normal_()
    saver = L2Blocks(link, link.pool, a, lambda pool: stores[pool.name], layout=None,
                     pages=PAGES)
    if op == "load":
        assert saver.save([0], ["h0"]) == (1, [])
    stores["l2-pool-new"][0].fill_(7.0)  # another block, in the new pool's pages
    b = engine(layers=1)
    blocks = L2Blocks(link, link.pool, b if op == "load" else a,
                      lambda pool: stores[pool.name], layout=None, pages=PAGES)
    new = FakePool("l2-pool-new")

    def reopened(answer):
        blocks.pool = new  # what _reopen does on its thread meanwhile
        return answer

    acquire, reserve = link.acquire, link.reserve
    link.acquire = lambda *args: reopened(acquire(*args))
    link.reserve = lambda *args: reopened(reserve(*args))
    if op == "load":
        assert blocks.load([3], ["h0"]) == (1, [])
        assert torch.equal(b[0][3], a[0][0])
    elif op == "save":
        assert blocks.save([0], ["h0"]) == (1, [])
    else:
        assert blocks.save_behind([0], ["h0"]).wait() == (1, [])
    assert torch.equal(stores["l2-pool-new"][0], torch.full((PAGES, *BLOCK), 7.0))
    if op != "load":
        assert torch.equal(stores["l2-pool"][0][0], a[0][0])


def test_saves_hold_the_pools_memory_until_their_commit_returned():
    """A save holds the L2 pool's memory (``HostPool.held``) from its reserve until its
    commit returned: at once for ``save``, on the commit's own thread for
    ``save_behind`` (whose copy may write the pages until then), so the node never
    gives that memory back under a copy into it."""
    link = FakeLink()
    pool, commit, at_commit = link.pool, link.commit, []

    def counted(*args, **kw):
        at_commit.append(pool.holds)
        return commit(*args, **kw)

    link.commit = counted
    a = engine(layers=1)
    assert l2(link, a, [torch.zeros(PAGES, *BLOCK)]).save([0], ["h0"]) == (1, [])
    assert at_commit == [1] and pool.holds == 0
    behind = l2(link, a, [torch.zeros(PAGES, *BLOCK)]).save_behind([1], ["h1"])
    assert behind.wait() == (1, [])
    assert at_commit == [1, 1] and pool.holds == 0
