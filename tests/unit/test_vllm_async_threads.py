"""The vLLM connector's background threads (pure logic, fake work): the async load
thread (``AsyncLoads``) and the lookup thread (``Lookups``): bounded queues, failures
reported never raised, answers cached per request, both end on close."""

from __future__ import annotations

import threading
import time

import pytest
from raykv.integrations.vllm.async_loads import AsyncLoads
from raykv.integrations.vllm.lookups import Lookups
from raykv.integrations.vllm.request_blocks import BlockTransfer


def _x(rid: str, n: int, first: int = 0) -> BlockTransfer:
    return BlockTransfer(rid, list(range(first, first + n)), [f"h{i}" for i in range(n)])


def _finished(loads: AsyncLoads, want: set[str]):
    got_ids, failed, loaded = set(), set(), 0
    deadline = time.monotonic() + 5
    while got_ids != want and time.monotonic() < deadline:
        d = loads.finished()
        got_ids |= d.req_ids
        failed |= d.failed_blocks
        loaded += d.loaded
        time.sleep(0.005)
    return got_ids, failed, loaded


def test_async_loads_report_every_request_with_its_failed_blocks():
    """A full load, a partial one and one that raises: all three reported finished; the
    blocks after a partial load's leading run and every block of the raising one are
    failed. Control: the load function really ran (the leading counts come back)."""
    def load(x: BlockTransfer) -> int:
        if x.req_id == "boom":
            raise RuntimeError("node actor gone")
        return 2 if x.req_id == "part" else len(x.block_ids)

    loads = AsyncLoads(load)
    try:
        for x in (_x("full", 3), _x("part", 4, 10), _x("boom", 2, 20)):
            assert loads.submit(x)
        ids, failed, loaded = _finished(loads, {"full", "part", "boom"})
    finally:
        loads.close()
    assert ids == {"full", "part", "boom"}
    assert failed == {12, 13, 20, 21}
    assert loaded == 5


def test_async_loads_queue_is_bounded_and_close_fails_what_waits():
    """A load thread stuck on its first load: the queue takes ``maxsize`` more, the next
    is refused at once (all its blocks failed and counted dropped, finished at once);
    ``close`` fails the queued ones and ends the thread once the stuck one returns."""
    gate = threading.Event()
    loads = AsyncLoads(lambda x: gate.wait(5) and len(x.block_ids), maxsize=2)
    assert loads.submit(_x("a", 1))
    time.sleep(0.05)  # the thread took "a"
    assert loads.submit(_x("b", 1, 1)) and loads.submit(_x("c", 1, 2))
    t0 = time.monotonic()
    assert not loads.submit(_x("d", 2, 3))
    assert time.monotonic() - t0 < 0.5
    d = loads.finished()
    assert d.req_ids == {"d"} and d.failed_blocks == {3, 4} and d.dropped == 2
    gate.set()
    loads.close()
    rest = loads.finished()
    assert rest.req_ids == {"a", "b", "c"} and rest.failed_blocks == {1, 2}
    assert not loads._thread.is_alive()
    assert not loads.submit(_x("e", 1, 9))  # closed: refused, reported failed
    assert loads.finished().failed_blocks == {9}



@pytest.mark.engine("vllm")
def test_close_waits_for_the_load_under_way_within_its_wait():
    """A load under way when the engine shuts down (its data op still within its
    deadline) has written what it writes when ``close`` returns: no load touches
    vLLM's blocks afterwards. The worker gives ``close`` the load's deadline plus
    ``CLOSE_WAIT_S``. Control: a wait shorter than the load returns while it still
    runs."""
    from raykv.integrations.vllm.async_loads import CLOSE_WAIT_S
    from raykv.integrations.vllm.options import ConnectorOptions, KVIdentity
    from raykv.integrations.vllm.worker import RayKVConnectorWorker

    writes: list[float] = []

    def slow(x: BlockTransfer) -> int:
        time.sleep(0.3)
        writes.append(time.monotonic())  # the copy into vLLM's blocks
        return len(x.block_ids)

    for wait_s, finished in ((2.0, True), (0.05, False)):  # the second: the control
        writes.clear()
        loads = AsyncLoads(slow, close_wait_s=wait_s)
        assert loads.submit(_x("a", 1))
        time.sleep(0.05)  # the thread took "a"
        loads.close()
        closed = time.monotonic()
        assert (bool(writes) and writes[0] <= closed) is finished
        loads._thread.join(5)
    opts = ConnectorOptions.parse({"timeout_s": 30}, tp_size=1, pp_size=1,
                                  served_model="m", identity=KVIdentity("float32", 4, "cpu"))
    w = RayKVConnectorWorker(opts, None, block_size=4, tp_rank=0, tp_size=1, pp_rank=0,
                             pp_size=1)
    w._load_async = lambda x: 0  # what the load does is not this test's
    try:
        from raykv.integrations.vllm.metadata import RayKVConnectorMetadata

        w.start_load_kv(RayKVConnectorMetadata(async_loads=[_x("b", 1)]))
        assert w._async._close_wait_s == 30 + CLOSE_WAIT_S
    finally:
        w.shutdown()

def test_lookups_answer_once_per_request_and_key_and_never_wait_past_the_allowance():
    """A fast query is answered within the wait and cached: asking again for the same
    request and key runs no second query; a new key asks again. A slow query answers
    None within the allowance (ask again later), then its answer once it came. A query
    that raises answers the miss value."""
    calls = []

    def fast():
        calls.append(1)
        return (1, 3)

    lk = Lookups(miss=(0, 0))
    try:
        assert lk.ask("r", (0, 3), fast, 1.0) == (1, 3)
        assert lk.ask("r", (0, 3), fast, 0.0) == (1, 3)
        assert len(calls) == 1
        assert lk.ask("r", (0, 4), fast, 1.0) == (1, 3) and len(calls) == 2
        gate = threading.Event()
        t0 = time.monotonic()
        assert lk.ask("s", (0, 1), lambda: gate.wait(5) and (0, 1), 0.05) is None
        assert time.monotonic() - t0 < 1.0
        gate.set()
        deadline = time.monotonic() + 5
        while (got := lk.ask("s", (0, 1), fast, 0.01)) is None and time.monotonic() < deadline:
            pass
        assert got == (0, 1)

        def boom():
            raise RuntimeError("refused")

        assert lk.ask("t", (0, 1), boom, 1.0) == (0, 0)
        lk.forget("r")
        assert lk.ask("r", (0, 3), fast, 1.0) == (1, 3) and len(calls) == 3
    finally:
        lk.close()
    assert not lk._thread.is_alive()
    assert lk.ask("u", (0, 1), fast, 0.1) is None  # closed: never answered
