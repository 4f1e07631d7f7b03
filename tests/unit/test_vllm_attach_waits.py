"""The connector's sides while raykv is not attached yet and the attach hangs or fails (a
cluster that refuses this process's Ray credentials, a node actor that is slow or
stopped while an engine starts): no lookup, load or save waits for the attach thread.
Every load is a load error (recomputed), every save a failed save, every lookup a
miss, and one attach runs in the background, tried again at most once per
``ATTACH_RETRY_S``.

The hung attach holds until the test ends; ``timeout_s`` is ``TIMEOUT_S``, so a step
that waited for the attach thread at all (what the sides did before: up to one
``timeout_s`` per step, 15.7 s of an engine's first request against a cluster that
refused the join) takes ``TIMEOUT_S``; the bound asserted is a third of it."""

from __future__ import annotations

import threading
import time

import pytest

TIMEOUT_S = 30.0
BOUND_S = TIMEOUT_S / 3
CALLS = 4  # loads and saves in one worker step; lookups in one scheduler step


@pytest.fixture
def hung():
    """An ``_attach`` that hangs until the test ends (then fails), counting its calls."""
    release, calls = threading.Event(), []

    def attach() -> None:
        calls.append(1)
        release.wait(120)
        raise ConnectionError("node actor hung")

    yield attach, calls
    release.set()


def _opts(**config):
    from raykv.integrations.vllm.options import ConnectorOptions, KVIdentity

    return ConnectorOptions.parse({"timeout_s": TIMEOUT_S, **config}, tp_size=1, pp_size=1,
                                  served_model="m",
                                  identity=KVIdentity("float32", 4, "cpu.lm1"))


def _worker():
    from raykv.integrations.vllm.worker import RayKVConnectorWorker

    return RayKVConnectorWorker(_opts(), None, block_size=4, tp_rank=0, tp_size=1,
                                pp_rank=0, pp_size=1)


@pytest.mark.engine("vllm")
def test_a_worker_step_never_waits_for_a_hung_attach(hung):
    """A worker step loading for 4 requests and saving for 4 while the attach hangs:
    every load is a load error, every save is counted failed, one attach thread runs,
    and the step returns while the attach still hangs."""
    from raykv.integrations.vllm.metadata import RayKVConnectorMetadata
    from raykv.integrations.vllm.request_blocks import BlockTransfer

    w = _worker()
    w._attach, calls = hung
    loads = [BlockTransfer(f"r{i}", [2 * i, 2 * i + 1], [f"a{i}", f"b{i}"])
             for i in range(CALLS)]
    saves = [BlockTransfer(f"s{i}", [100 + i], [f"c{i}"]) for i in range(CALLS)]
    meta = RayKVConnectorMetadata(loads=loads, saves=saves)
    t0 = time.monotonic()
    w.start_load_kv(meta)
    w.wait_for_save(meta)
    took = time.monotonic() - t0
    assert w.get_block_ids_with_load_errors() == set(range(2 * CALLS))
    assert w.stats.load_failed == 2 * CALLS and w.stats.save_failed == CALLS
    assert w.stats.loaded == w.stats.saved == 0
    assert len(calls) == 1 and w._attaching.is_alive()
    assert took < BOUND_S, took


@pytest.mark.engine("vllm")
def test_a_scheduler_step_never_waits_for_a_hung_attach(hung):
    """One scheduling step asking about 4 waiting requests while the attach hangs: each
    is a miss at once, with one attach thread."""
    from raykv.integrations.vllm.scheduler import RayKVConnectorScheduler
    from vllm import SamplingParams
    from vllm.v1.request import Request

    side = RayKVConnectorScheduler(_opts(), do_load=False, do_save=True, block_size=4,
                                   tp_size=1, pp_size=1)
    side.do_load = True  # asks lookups from now on, unattached
    side._attach, calls = hung
    reqs = [Request(f"r{i}", [i] * 17, SamplingParams(max_tokens=1), None)
            for i in range(CALLS)]
    t0 = time.monotonic()
    assert [side.get_num_new_matched_tokens(r, 0) for r in reqs] == [(0, False)] * CALLS
    took = time.monotonic() - t0
    assert len(calls) == 1 and side._attaching.is_alive()
    assert took < BOUND_S, took


@pytest.mark.engine("vllm")
def test_a_failing_attach_is_retried_at_most_once_per_retry_interval(monkeypatch):
    """An attach that fails at once (a join refused) is started again only after
    ``ATTACH_RETRY_S``, however many calls come in between; the call after an attach
    that succeeded in the background uses its client."""
    from raykv.cache_actors.errors import NodeUnavailableError
    from raykv.integrations.vllm import side

    w = _worker()
    calls: list[int] = []
    client, go = object(), threading.Event()

    def attach() -> None:
        calls.append(1)
        if len(calls) < 2:
            raise ConnectionError("refused")
        go.wait(120)
        w._client = client

    w._attach = attach
    monkeypatch.setattr(side, "ATTACH_RETRY_S", 3600.0)
    for _ in range(5):
        with pytest.raises(NodeUnavailableError):
            w._cache()
        w._attaching.join()
    assert len(calls) == 1
    assert "refused" in str(w._attach_error)
    w._next_attach = 0.0  # the hour has passed
    with pytest.raises(NodeUnavailableError):
        w._cache()  # attaching now, in the background
    go.set()
    w._attaching.join()
    assert len(calls) == 2 and w._cache() is client


class _Side:
    """A connector side of its own (no vLLM): its pool is made by ``make_pool`` and
    registered."""

    def __new__(cls, make_pool):
        from raykv.integrations.vllm.side import ConnectorSide

        class Side(ConnectorSide):
            def _register(self, client, name):
                pool = make_pool(client, name)
                client.register_mem_host_pool_v2(pool, "kv")
                return pool

        return Side(_opts(), block_size=4, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)


class _Client:
    """A ``CacheClient`` stand-in that records what is done with it."""

    made: list[_Client] = []

    def __init__(self, *args, **kwargs) -> None:
        self.registered, self.destroyed, self.closed = [], [], False
        _Client.made.append(self)

    def register_mem_host_pool_v2(self, pool, name) -> None:
        self.registered.append(pool)

    def destroy_host_pool(self, pool) -> bool:
        self.destroyed.append(pool)
        return True

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("shut", [True, False], ids=["shut-down", "control-attached"])
def test_a_side_shut_down_while_attaching_in_the_background_leaves_nothing(monkeypatch,
                                                                           shut):
    """vLLM shuts the connector down while its background attach is still making the
    pool (a slow node actor): once that attach ends, its pool is destroyed and its client
    closed, the side stays without a client and no metrics thread is started. Before, the
    attach published its client after ``shutdown`` had run: the pool stayed on the node
    for good, the client (a Ray connection) stayed open, and the counters' export thread
    ran on. CONTROL: not shut down, the same attach is used."""
    from raykv.cache_actors.errors import NodeUnavailableError
    from raykv.cache_actors.rank import client as client_module
    from raykv.integrations.vllm import side as side_module

    metrics = []
    monkeypatch.setattr(side_module, "join_ray", lambda address, namespace: "node")
    monkeypatch.setattr(client_module, "CacheClient", _Client)
    monkeypatch.setattr(side_module, "ConnectorMetrics",
                        lambda stats, tags, **kw: metrics.append(tags))
    _Client.made = []
    making, go = threading.Event(), threading.Event()

    def make_pool(client, name):
        making.set()
        assert go.wait(60)
        return name

    side = _Side(make_pool)
    with pytest.raises(NodeUnavailableError):
        side._cache()  # the attach starts in the background
    assert making.wait(60)
    if shut:
        side.shutdown()
    go.set()
    side._attaching.join(60)
    (client,) = _Client.made
    if not shut:
        assert side._cache() is client and not client.closed and len(metrics) == 1
        return
    assert client.closed and client.destroyed == client.registered
    assert side._client is None and side._pool is None and metrics == []
    with pytest.raises(NodeUnavailableError):
        side._cache()  # shut down: no attach starts again
    assert len(_Client.made) == 1
