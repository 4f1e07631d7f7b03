"""SGLang 0.5.23's own storage-backend tests, run against ``RayKVStore``.

Their file ships in SGLang's wheel, installed in the SGLang venv (``sources``); it runs
in a pytest of that venv with ``sglang_plugin`` loaded (it swaps in raykv's backend and
SGLang's real host pools: see its docstring), against a one-node ``start_local``
cluster of this process. Each selector below is one parametrized test here; it passes
when every case SGLang's run collected for it passed (a skip or a missing case fails).
The tests of SGLang's that do not apply to raykv, and why: ``docs/status.md``.
"""

from __future__ import annotations

import os

import pytest
from raykv import local_settings, start_local
from raykv_lab.bench.sglang import sglang_env

from tests.peers import sources
from tests.peers.runs import assert_all_passed, run_pytest

pytestmark = pytest.mark.engine("sglang")

MOONCAKE = "srt/mem_cache/storage/mooncake_store/test_mooncake_store.py"
SELECTED = [
    MOONCAKE + "::test_single_operation",
    MOONCAKE + "::test_batch_operation",
]
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def sglang_run(tmp_path_factory):
    """SGLang's selected tests, run once against a fresh cluster: (outcomes, tail)."""
    try:
        package = sources.sglang_package()
    except sources.PeerSourceError as e:
        pytest.fail(str(e), pytrace=False)
    tmp = tmp_path_factory.mktemp("sglang-peers")
    with start_local(settings=local_settings(global_segment_size=256 << 20),
                     num_nodes=1) as cluster:
        import ray

        env = {"RAYKV_PEER_RAY_ADDRESS": ray.get_runtime_context().gcs_address,
               "RAYKV_PEER_NAMESPACE": cluster.namespace,
               "RAYKV_PEER_NODE_ID": cluster.node_ids[0],
               "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
        env |= sglang_env(sources.sglang_python())
        targets = [str(package / s) for s in SELECTED]
        yield run_pytest(sources.sglang_python(), package.parent, targets, "sglang_plugin",
                         env, tmp, TIMEOUT_S)


@pytest.mark.parametrize("selector", SELECTED, ids=lambda s: s.split("/")[-1])
def test_sglang_own_test(sglang_run, selector):
    outcomes, tail = sglang_run
    assert_all_passed(outcomes, "sglang/" + selector, tail)
