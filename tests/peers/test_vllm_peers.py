"""vLLM 0.32.0's own KV-connector and scheduler tests, run against ``RayKVConnector``.

Their files come from vLLM's source distribution on the package index (``sources``),
run in a pytest of their own in vLLM's unpacked tests with ``vllm_plugin`` loaded (it
swaps in raykv's connector, the offline tiny model, and raykv's worker in the loop of
every scheduler step: see its docstring), against a one-node ``start_local`` cluster of
this process. Each selector below is one parametrized test here; it passes when every
case vLLM's run collected for it passed (a skip or a missing case fails). The tests of
vLLM's that do not apply to raykv, and why: ``docs/status.md``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from raykv import local_settings, start_local
from raykv_lab.engines.vllm_model import make_llama

from tests.peers import sources
from tests.peers.runs import assert_all_passed, outcomes_of, run_pytest

pytestmark = pytest.mark.engine("vllm")

UNIT = "tests/v1/kv_connector/unit/"
CORE = "tests/v1/core/"
# vLLM's tests that take a connector and hold for any connector that loads synchronously
# (by file::function, every parametrization; or one case with its [id]).
SELECTED = [
    UNIT + "test_kv_load_failure_recovery.py::test_sync_load_failure",
    UNIT + "test_kv_load_failure_recovery.py::test_sync_load_failure_with_shared_blocks",
    UNIT + "test_invalid_blocks_correctness.py::"
           "test_sync_recompute_blocks_not_freed_for_running_requests",
    UNIT + "test_invalid_blocks_correctness.py::test_sync_fail_invalid_blocks_evicted",
    UNIT + "test_cache_pollution_prevention.py::"
           "test_invalid_blocks_evicted_prevents_cache_pollution",
    UNIT + "test_error_propagation.py::test_error_propagation_sync_load",
    UNIT + "test_kv_connector_lifecycle.py::test_kv_connector_mixin_clears_metadata",
    CORE + "test_scheduler.py::test_priority_scheduling_preemption_and_resumption_when_out_of_kv",
    CORE + "test_scheduler.py::test_prepend_skipped_requests_order",
    CORE + "test_scheduler.py::test_abort_request_waiting_for_remote_kvs",
    CORE + "test_scheduler.py::test_abort_request_finished_recving",
    CORE + "test_scheduler.py::test_delayed_kv_connector_free_keeps_scheduler_active",
    CORE + "test_async_scheduler.py::test_kv_pressure_preempt_mid_handoff[kv_consumer-False]",
    CORE + "test_async_scheduler.py::test_kv_pressure_preempt_mid_handoff[kv_consumer-True]",
]
TIMEOUT_S = 900
# The models vLLM's tests name, served by a tiny random Llama made here (no download).
REDIRECTED_MODELS = ("facebook/opt-125m",)


# The control's test: raykv's loads give random bytes, so each case must fail.
CONTROL = UNIT + "test_kv_load_failure_recovery.py::test_sync_load_failure"


@pytest.fixture(scope="module")
def peer_env(tmp_path_factory):
    """vLLM's unpacked tests, and the environment of a vLLM peer run on a fresh one-node
    cluster (kept for the module)."""
    try:
        root = sources.vllm_tests()
    except sources.PeerSourceError as e:
        pytest.fail(str(e), pytrace=False)
    tmp = tmp_path_factory.mktemp("vllm-peers-model")
    redirect = tmp / "redirect.json"  # vLLM's own model redirect: name -> folder
    redirect.write_text(json.dumps(dict.fromkeys(REDIRECTED_MODELS,
                                                 make_llama(str(tmp / "tiny-llama")))))
    with start_local(settings=local_settings(global_segment_size=256 << 20),
                     num_nodes=1) as cluster:
        import ray

        yield root, {"RAYKV_PEER_RAY_ADDRESS": ray.get_runtime_context().gcs_address,
                     "RAYKV_PEER_NAMESPACE": cluster.namespace,
                     "VLLM_MODEL_REDIRECT_PATH": str(redirect),
                     "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                     "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                     "TOKENIZERS_PARALLELISM": "false",
                     "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}


@pytest.fixture(scope="module")
def vllm_run(peer_env, tmp_path_factory):
    """vLLM's selected tests, run once: (outcomes, output tail)."""
    root, env = peer_env
    return run_pytest(sys.executable, root, SELECTED, "vllm_plugin", env,
                      tmp_path_factory.mktemp("vllm-peers"), TIMEOUT_S)


@pytest.mark.parametrize("selector", SELECTED, ids=lambda s: s.split("/")[-1])
def test_vllm_own_test(vllm_run, selector):
    outcomes, tail = vllm_run
    assert_all_passed(outcomes, selector, tail)


def test_control_corrupt_loads_fail(peer_env, tmp_path):
    """Control: with raykv's loads overwritten by random bytes (the peer connector's
    worker wrapped by ``digest_engine.corrupt_loads``), every case of a test that passes
    above fails, on the worker loop's check of loaded blocks (vLLM's own assertions
    cannot see bytes)."""
    root, env = peer_env
    outcomes, tail = run_pytest(sys.executable, root, [CONTROL], "vllm_plugin",
                                env | {"RAYKV_PEER_CORRUPT_LOADS": "1"}, tmp_path, TIMEOUT_S)
    cases = outcomes_of(outcomes, CONTROL)
    assert cases, tail
    for c in cases:
        assert c.status == "failed" and "loaded from raykv holds the wrong KV" in c.message, c
