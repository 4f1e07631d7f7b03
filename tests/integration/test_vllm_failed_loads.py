"""Nothing computed over a block whose load failed is stored, whichever request's load
failed: vLLM's own scenario ``test_sync_load_failure_with_shared_blocks`` (its KV
connector tests, 0.32.0) run against ``RayKVConnector`` and a real raykv cluster through
vLLM's own scheduler (``vllm_steps.StepEngine``: vLLM's ``Scheduler`` or
``AsyncScheduler``, the connector's two sides, a stand-in forward whose KV is exact).

Request 1 loads all 100 of its blocks from raykv (its last token computed again);
request 2 shares its first 50 through vLLM's prefix cache, scheduled in the same step,
and computes its blocks 50-52 in that step over them; the read of the shared block 49
fails. vLLM reschedules both requests.
Afterwards every object raykv holds under a key of request 2's blocks must be the KV
that key names (``expected_kv``), as a fresh engine would load it.

Controls (``RULES``): the worker's rule of which saves to refuse replaced by the old one
(only the saves of the request whose own load failed: request 2's blocks 50-52 are
stored over the failed block, under both failure policies), and, with vLLM's async
scheduling (step N+1 is scheduled before step N's failure reaches the scheduler), by a
rule that forgets a failed block after its step: request 2's blocks computed in step
N+1 are stored over it.
"""

from __future__ import annotations

import itertools
import random
import uuid

import pytest
from raykv import local_settings, start_local
from raykv_lab.engines.vllm_model import make_llama

from tests.integration.vllm_steps import StepEngine
from tests.peers.vllm_world import expected_kv

pytestmark = pytest.mark.engine("vllm")

BS = 16
SHARED = 50  # blocks request 2 shares with request 1
FAILED = 49  # the shared block whose read fails
_suffixes = itertools.count(1)  # request 2's own tokens: other ones in every scenario


def _per_request(engine: StepEngine):
    """The old rule: refuse only the saves of a request whose own load failed in this
    step."""
    w = engine.worker

    def refuses(x) -> bool:
        meta = engine.connector._get_connector_metadata()
        return x.req_id in {ld.req_id for ld in meta.loads
                            if not w._unsettled.isdisjoint(ld.block_ids)}

    return refuses


def _per_step(engine: StepEngine):
    """A rule that forgets a failed block after its step: refuse the saves computed over
    a block that failed to load in this step only."""
    w = engine.worker

    def refuses(x) -> bool:
        meta = engine.connector._get_connector_metadata()
        return x.computed_over({b for ld in meta.loads for b in ld.block_ids} & w._unsettled)

    return refuses


RULES = {"per_request": _per_request, "per_step": _per_step}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_llama(str(tmp_path_factory.mktemp("vllm") / "tiny-llama"))


@pytest.fixture(scope="module")
def seeded(model):
    """A one-node raykv cluster holding request 1's 100 blocks (an engine computed and
    saved them), the model name of their keys, request 1's tokens, and an idle engine
    that reads what raykv holds (``StepEngine.stored``)."""
    rnd = random.Random(29)
    p1 = [rnd.randrange(3, 2000) for _ in range(100 * BS)]
    name = f"steps-{uuid.uuid4().hex[:8]}"
    with start_local(settings=local_settings(global_segment_size=128 << 20), num_nodes=1):
        seed = StepEngine(model, name)
        seed.add(p1)
        seed.run()
        assert seed.worker.stats.saved == 100, seed.worker.stats
        seed.close()
        reader = StepEngine(model, name)
        assert all(b == expected_kv(p1)[j * BS:(j + 1) * BS]
                   for j, b in enumerate(reader.stored(p1)))
        yield name, p1, reader
        reader.close()


def shared_failure(model, seeded, *, policy: str, async_scheduling: bool,
                   rule: str | None = None) -> tuple[list[int], list]:
    """vLLM's shared-blocks scenario on a fresh engine (``rule``: a control's rule, None:
    the connector's own), request 2's blocks after the shared ones new to raykv: request
    2's tokens and what raykv then holds for each of its blocks
    (``StepEngine.stored``)."""
    name, p1, reader = seeded
    rnd = random.Random(next(_suffixes))
    p2 = p1[:SHARED * BS] + [rnd.randrange(3, 2000) for _ in range(50 * BS)]
    e = StepEngine(model, name, policy=policy, async_scheduling=async_scheduling)
    try:
        if rule is not None:
            e.worker.refuses = RULES[rule](e)
        armed = [True]

        def fail(meta) -> set[str]:  # the first load's read of the shared block fails
            if armed[0] and meta.loads:
                armed[0] = False
                (x,) = meta.loads
                assert len(x.block_ids) == 100
                return {x.hashes[FAILED]}
            return set()

        e.fail_loads = fail
        r1, r2 = e.add(p1), e.add(p2)
        e.run()
        assert not armed[0], "request 1 loaded nothing"
        assert e.loaded == {r1.request_id: e.loaded[r1.request_id]}  # request 2: a local hit
        assert e.worker.stats.load_failed == 100 - FAILED, e.worker.stats
        assert r2.request_id not in e.loaded
    finally:
        e.close()
    return p2, reader.stored(p2)


def wrong_blocks(tokens: list[int], stored: list) -> list[int]:
    want = expected_kv(tokens)
    return [j for j, kv in enumerate(stored)
            if kv is not None and kv != want[j * BS:(j + 1) * BS]]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_no_block_computed_over_a_failed_shared_load_is_stored(model, seeded, policy,
                                                               async_scheduling):
    p2, stored = shared_failure(model, seeded, policy=policy,
                                async_scheduling=async_scheduling)
    assert wrong_blocks(p2, stored) == []
    present = [j for j, kv in enumerate(stored) if kv is not None]
    if policy == "recompute" and not async_scheduling:
        # vLLM recomputed request 2 from its block 50 on: every block is saved then.
        assert present == list(range(100))
    else:
        assert present[:SHARED] == list(range(SHARED))


@pytest.mark.parametrize(("policy", "async_scheduling", "rule", "wrong"), [
    ("recompute", False, "per_request", [50, 51, 52]),
    ("fail", False, "per_request", [50, 51, 52]),
    # step N+1's blocks of request 2 (how many follows the steps' token budget: 53-56
    # since request 1 loads all its blocks and computes one token instead of a block)
    ("recompute", True, "per_step", [53, 54, 55, 56]),
], ids=["recompute-sync-per_request", "fail-sync-per_request", "recompute-async-per_step"])
def test_control_old_rules_store_blocks_computed_over_the_failed_block(
        model, seeded, policy, async_scheduling, rule, wrong):
    p2, stored = shared_failure(model, seeded, policy=policy,
                                async_scheduling=async_scheduling, rule=rule)
    assert wrong_blocks(p2, stored) == wrong


def test_kv_delivery_not_required_and_wrapper_keys_pass(model, seeded):
    """``requires_kv_delivery`` is False (vLLM's base class would answer True for
    ``kv_both``: the control), and a wrapper connector's own key in the shared extra
    config (``name``, as vLLM's recording test connector passes it) does not stop the
    engine; a misspelt raykv key does."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    name, p1, reader = seeded
    e = StepEngine(model, name, extra={"name": "recorder"})
    try:
        assert e.scheduler.requires_kv_delivery is False
        assert KVConnectorBase_V1.requires_kv_delivery.fget(e.scheduler.connector) is True
        e.add(p1[:4 * BS + 3])
        e.run()
        assert e.worker.stats.loaded == 4
    finally:
        e.close()
    with pytest.raises(ValueError, match="look misspelt"):
        StepEngine(model, name, extra={"pool_block": 8})
