"""Hooks for the whole suite.

Order of work (``pytest -n 2 --dist loadfile --no-loadscope-reorder``, the pyproject's
options): test files go out to the workers longest first (``MODULE_SECONDS``), so the
run does not end on one long file while the other worker idles. xdist's own order, by
test count, sent the one-test Serve LLM files last: a whole run here ended with one
worker idle for ~140 s.

The test process leaves with ``os._exit`` once pytest has written every result: a run
here passed all 344 tests and then died at interpreter exit with a segfault inside Ray's
GCS client (dmesg: the faulting code lies in its ``NodeInfoGcsService/GetAllNodeInfo``
call), a thread of Ray's still polling while Python tore its modules down. The exit code
is pytest's own.
"""

from __future__ import annotations

import os
import sys

import pytest

_exit_status = 0

MODULE_SECONDS = {
    "tests/integration/test_vllm.py": 670,
    "tests/integration/test_router_llm.py": 290,
    "tests/integration/test_dataplane.py": 280,
    "tests/integration/test_cli_cluster.py": 240,
    "tests/integration/test_final_returns.py": 220,
    "tests/integration/test_group.py": 200,
    "tests/integration/test_sglang.py": 190,
    "tests/integration/test_demo_vllm.py": 160,
    "tests/integration/test_sglang_close.py": 140,
    "tests/integration/test_hosts.py": 130,
    "tests/integration/test_vllm_failed_shared_load.py": 130,
    "tests/integration/test_pool_teardown.py": 120,
    "tests/integration/test_vllm_deadlines.py": 120,
    "tests/integration/test_engine.py": 110,
    "tests/integration/test_sglang_deadlines.py": 110,
    "tests/integration/test_standalone.py": 110,
    "tests/integration/test_concurrent_ranks.py": 100,
    "tests/integration/test_hybrid.py": 100,
    "tests/peers/test_vllm_peers.py": 100,
    "tests/integration/test_node_kill.py": 90,
    "tests/integration/test_deadlines.py": 90,
    "tests/integration/test_shm_limits.py": 80,
    "tests/integration/test_sglang_contract.py": 70,
    "tests/integration/test_hostile_channel.py": 70,
    "tests/integration/test_lifecycle.py": 60,
}
"""Wall seconds of the longest test files in a whole run at ``-n 2`` on 2 cores, each
file's own clusters and engines included (measured 2026-11-28; every other file took
under 60 s). Only their order matters."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first (a stable sort: the rest keep their collection order)."""
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.nodeid.split("::", 1)[0], 0))


@pytest.fixture(autouse=True, scope="module")
def _no_ray_left_by_another_module():
    """Every test module starts with no Ray initialised in this process: a module that
    left Ray initialised (a failed teardown, a test run alone in another order) would
    make the next one's ``start_local`` refuse to start."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """After every other plugin is done: flush and leave with pytest's exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
