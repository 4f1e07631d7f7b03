"""The connector's sides while raykv is not attached yet and the attach hangs (a node
actor that is slow or stopped while an engine starts): every wait for the attach thread
is spent from the step's budget, so one vLLM step, or one scheduler step of lookups,
waits at most one ``timeout_s`` in all however many loads, saves or lookups it makes."""

from __future__ import annotations

import threading
import time

import pytest

TIMEOUT_S = 0.5  # before: 8 (worker) and 4 (scheduler) of these; the bound is 2
CALLS = 4  # loads and saves in one worker step; lookups in one scheduler step


@pytest.fixture
def hung():
    """An ``_attach`` that hangs until the test ends (then fails), counting its calls."""
    release, calls = threading.Event(), []

    def attach() -> None:
        calls.append(1)
        release.wait(30)
        raise ConnectionError("node actor hung")

    yield attach, calls
    release.set()


def _opts(**config):
    from raykv.integrations.vllm.options import ConnectorOptions, KVIdentity

    return ConnectorOptions.parse({"timeout_s": TIMEOUT_S, **config}, tp_size=1, pp_size=1,
                                  served_model="m",
                                  identity=KVIdentity("float32", 4, "cpu.lm1"))


@pytest.mark.engine("vllm")
def test_a_worker_step_waits_for_a_hung_attach_one_timeout_in_all(hung):
    """A worker step loading for 4 requests and saving for 4 while the attach hangs:
    every load is a load error (recomputed), every save is counted failed, the step
    waits one ``timeout_s`` in all and one attach thread runs. (Before: each load and
    each save waited a whole ``timeout_s`` for the attach thread: 8 of them here.)"""
    from raykv.integrations.vllm.metadata import RayKVConnectorMetadata
    from raykv.integrations.vllm.request_blocks import BlockTransfer
    from raykv.integrations.vllm.worker import RayKVConnectorWorker

    w = RayKVConnectorWorker(_opts(), None, block_size=4, tp_rank=0, tp_size=1, pp_rank=0,
                             pp_size=1)
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
    assert w.stats["load_failed"] == 2 * CALLS and w.stats["save_failed"] == CALLS
    assert w.stats["loaded"] == w.stats["saved"] == 0
    assert len(calls) == 1
    assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S * 2, took


@pytest.mark.engine("vllm")
def test_a_scheduler_step_waits_for_a_hung_attach_one_timeout_in_all(hung):
    """One scheduling step asking about 4 waiting requests while the attach hangs: each
    is a miss, and the step waits one ``timeout_s`` in all (before: one per request);
    the next step has a budget of its own."""
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
    assert len(calls) == 1
    assert TIMEOUT_S * 0.9 <= took < TIMEOUT_S * 2, took
