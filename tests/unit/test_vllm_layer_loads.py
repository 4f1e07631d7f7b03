"""Copies behind the forward (``LayerLoads``, ``LayerWaits``) and an L2 load whose last
chunk is copied behind (``L2Blocks.load(..., behind)``), against the in-memory L2 of
``test_vllm_l2_blocks``."""

from __future__ import annotations

import threading

import pytest
import torch
from raykv.integrations.vllm.layer_loads import LayerLoads, LayerWaits, LoadsBehind

from tests.unit.test_vllm_l2_blocks import BLOCK, PAGES, FakeLink, engine, l2


def test_layer_waits_are_learnt_from_one_step_that_asks_for_every_layer():
    waits = LayerWaits(["a", "b"])
    waits.seen("a")
    waits.step_ended()
    assert not waits.learnt  # "b" never asked for: a forward that might read it unasked
    waits.seen("b")
    waits.step_ended()
    assert not waits.learnt  # asked for over two steps is not one forward asking for all
    waits.seen("a"), waits.seen("b")
    waits.step_ended()
    assert waits.learnt
    assert not _learnt_with_no_layers()


def _learnt_with_no_layers() -> bool:
    waits = LayerWaits([])
    waits.step_ended()
    return waits.learnt


def test_a_layer_wait_returns_once_that_layer_is_copied_not_before():
    gate, copied = threading.Event(), []

    def copy(i: int) -> None:
        if i == 1:
            gate.wait(10)
        copied.append(i)

    loads = LayerLoads()
    loads.start(copy, 3)
    loads.wait(0)
    assert copied == [0]
    waiter = threading.Thread(target=loads.wait, args=(1,))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and copied == [0]  # layer 1 not copied: its wait waits
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive() and copied[:2] == [0, 1]
    assert loads.finish() and copied == [0, 1, 2] and not loads.busy
    loads.wait(5)  # nothing started: at once
    loads.close()


def test_a_failed_layer_copy_is_reported_and_later_layers_are_not_copied():
    copied = []

    def copy(i: int) -> None:
        if i == 1:
            raise RuntimeError("bad copy")
        copied.append(i)

    loads = LayerLoads()
    loads.start(copy, 3)
    for i in range(3):
        loads.wait(i)  # every wait returns
    assert loads.finish() is False and copied == [0]
    loads.start(copied.append, 2)  # the next step's copies start afresh
    assert loads.finish() and copied == [0, 0, 1]
    loads.close()


def test_waits_end_when_the_copy_thread_is_gone():
    """A copy that ends its thread (``SystemExit`` on it): the waits for the layers it
    never copied return once the thread is found gone, and the step counts as failed."""

    def copy(i: int) -> None:
        raise SystemExit

    loads = LayerLoads()
    loads.start(copy, 3)
    loads.wait(2)
    assert loads.finish() is False


def _three_saved() -> tuple[FakeLink, list[torch.Tensor], list[torch.Tensor]]:
    """An L2 of two layers (``link``, ``store``) holding blocks 0-2 of engine ``a``
    (random values) as h0-h2: ``(link, store, a)``."""
    link = FakeLink()
    store = [torch.zeros(PAGES, *BLOCK) for _ in range(2)]
    a = engine(layers=2)
    for layer in a:
        layer.normal_()
    assert l2(link, a, store).save([0, 1, 2], ["h0", "h1", "h2"]) == (3, [])
    return link, store, a


class Behind:
    """LayerLoads' ``start``, the copies run when the test says."""

    def start(self, copy, layers):
        self.copy, self.layers = copy, layers


def test_an_l2_load_copies_its_last_block_at_once_and_the_rest_behind():
    """Three blocks saved through L2, then loaded by another engine with ``behind``: the
    last block is in vLLM's blocks when ``load`` returns, the other two only once their
    layers are copied, and their pages stay held until ``release``. Control: the same
    load without ``behind`` copies all three at once and holds nothing."""
    link, store, a = _three_saved()

    behind = Behind()
    b = engine(layers=2)
    blocks = l2(link, b, store)
    done, later = blocks.load([3, 4, 5], ["h0", "h1", "h2"], behind)
    assert (done, later) == (3, [3, 4]) and behind.layers == 2
    assert all(torch.equal(lb[5], la[2]) for la, lb in zip(a, b, strict=True))
    assert not any(lb[3:5].any() for lb in b)  # behind: not copied yet
    assert link.index.stats().held == 3
    behind.copy(0)
    assert torch.equal(b[0][3:6], a[0][0:3]) and not b[1][3:5].any()  # layer 0 only
    behind.copy(1)
    assert all(torch.equal(lb[3:6], la[0:3]) for la, lb in zip(a, b, strict=True))
    blocks.release()
    assert link.index.stats().held == 0

    c = engine(layers=2)
    assert l2(link, c, store).load([3, 4, 5], ["h0", "h1", "h2"]) == (3, [])
    assert all(torch.equal(lc[3:6], la[0:3]) for la, lc in zip(a, c, strict=True))
    assert link.index.stats().held == 0


def test_a_one_block_load_is_copied_at_once_even_with_behind():
    link = FakeLink()
    store = [torch.zeros(PAGES, *BLOCK)]
    a = engine(layers=1)
    a[0].normal_()
    assert l2(link, a, store).save([0], ["h0"]) == (1, [])
    loads = LayerLoads()
    b = engine(layers=1)
    assert l2(link, b, store).load([2], ["h0"], loads) == (1, [])
    assert not loads.busy and torch.equal(b[0][2], a[0][0])
    assert link.index.stats().held == 0
    loads.close()


def _worker(layers: list[torch.Tensor], link: FakeLink, store: list[torch.Tensor]):
    """A worker connector on ``layers`` (named l0, l1, ...) whose L2 is ``link``'s."""
    from types import SimpleNamespace

    from raykv.integrations.vllm.options import ConnectorOptions, KVIdentity
    from raykv.integrations.vllm.worker import RayKVConnectorWorker

    opts = ConnectorOptions.parse({"l2_blocks": PAGES, "timeout_s": 1.0}, tp_size=1,
                                  pp_size=1, served_model="m",
                                  identity=KVIdentity("float32", 4, "cpu.lm1"))
    w = RayKVConnectorWorker(opts, None, block_size=4, tp_rank=0, tp_size=1, pp_rank=0,
                             pp_size=1)
    names = [f"l{i}" for i in range(len(layers))]
    w._client, w._layers = SimpleNamespace(), layers
    w._steps.behind = LoadsBehind(names)
    w._steps.l2 = l2(link, layers, store)
    return w, names


def _step(w, names: list[str], block_ids: list[int], hashes: list[str], asks: list[str],
          between=None) -> None:
    """One step of vLLM's worker: loads, the forward asking for ``asks``, saves."""
    from raykv.integrations.vllm.metadata import RayKVConnectorMetadata
    from raykv.integrations.vllm.request_blocks import BlockTransfer

    meta = RayKVConnectorMetadata(loads=[BlockTransfer("r", block_ids, hashes)])
    w.start_load_kv(meta)
    if between is not None:
        between()
    for name in asks:
        w.wait_for_layer_load(name)
    w.wait_for_save(meta)


@pytest.mark.engine("vllm")
def test_a_worker_copies_behind_once_the_forward_asked_for_every_layer_and_settles_after():
    """Step 1: nothing learnt, the load is copied on the step. Step 2 (its forward asked
    for both layers in step 1): 2 of 3 blocks copied behind, their pages held until
    ``wait_for_save``, which ends the copies and gives the pages back. Control: a
    worker whose forward asked for one layer of two keeps copying on the step."""
    link, store, a = _three_saved()
    b = engine(blocks=9, layers=2)
    w, names = _worker(b, link, store)
    _step(w, names, [0, 1, 2], ["h0", "h1", "h2"], names)
    assert w.stats.l2_loaded == 3 and w.stats.loaded_behind == 0
    held = []
    _step(w, names, [3, 4, 5], ["h0", "h1", "h2"], names,
          between=lambda: held.append((w._steps.behind._loads.busy, link.index.stats().held)))
    assert held == [(True, 3)]
    assert w.stats.l2_loaded == 6 and w.stats.loaded_behind == 2
    assert not w._steps.behind._loads.busy and link.index.stats().held == 0
    assert all(torch.equal(lb[3:6], la[0:3]) for la, lb in zip(a, b, strict=True))
    assert w.get_block_ids_with_load_errors() == set()
    w.shutdown()

    c = engine(blocks=9, layers=2)
    w, names = _worker(c, link, store)
    for _ in range(2):
        _step(w, names, [3, 4, 5], ["h0", "h1", "h2"], names[:1])
    assert w.stats.l2_loaded == 6 and w.stats.loaded_behind == 0
    w.shutdown()


@pytest.mark.engine("vllm")
def test_a_copy_behind_that_fails_makes_its_blocks_load_errors_of_the_step():
    link, store, _ = _three_saved()
    w, names = _worker(engine(blocks=9, layers=2), link, store)
    _step(w, names, [0, 1, 2], ["h0", "h1", "h2"], names)  # learnt

    def broken(staged, runs, layer):
        raise RuntimeError("copy failed")

    w._steps.l2._copy_layer = broken
    _step(w, names, [3, 4, 5], ["h0", "h1", "h2"], names)
    assert w.get_block_ids_with_load_errors() == {3, 4}
    assert w.stats.load_failed == 2 and w.stats.loaded == 4
    assert link.index.stats().held == 0
    w.shutdown()


def test_an_l2_load_holds_its_pools_memory_until_its_last_copy_ended():
    """The L2 pool's memory is held (``HostPool.held``: the node gives it back only
    once no rank holds it, standalone mode after ``mooncake_client`` restarted) from
    before the load's first op until its copies ended: for a load copied behind the
    forward, until ``release`` after the copy thread's last layer; for one copied at
    once, until ``load`` returns. Control (the old load): never held, so the node
    punched holes in the pages under the copies and zeros were loaded."""
    link, store, a = _three_saved()
    pool = link.pool
    acquire, at_acquire = link.acquire, []

    def counted(*args):
        at_acquire.append(pool.holds)
        return acquire(*args)

    link.acquire = counted

    behind = Behind()
    b = engine(layers=2)
    blocks = l2(link, b, store)
    assert blocks.load([3, 4, 5], ["h0", "h1", "h2"], behind) == (3, [3, 4])
    assert at_acquire == [1] and pool.holds == 1  # the copies behind are still to come
    behind.copy(0)
    behind.copy(1)
    assert pool.holds == 1
    blocks.release()  # after LayerLoads.finish: the pages and the memory let go
    assert pool.holds == 0 and at_acquire == [1, 1]
    assert all(torch.equal(lb[3:6], la[0:3]) for la, lb in zip(a, b, strict=True))

    c = engine(layers=2)
    assert l2(link, c, store).load([3, 4, 5], ["h0", "h1", "h2"]) == (3, [])
    assert at_acquire == [1, 1, 1, 1] and pool.holds == 0  # acquire, then the give-back
