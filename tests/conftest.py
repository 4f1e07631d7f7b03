"""Hooks for the whole suite.

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
SLOWEST_FIRST = (
    "test_vllm.py", "test_router_llm.py", "test_vllm_peers.py", "test_sglang.py",
    "test_group.py", "test_demo_vllm.py", "test_sglang_contract.py",
    "test_sglang_deadlines.py", "test_vllm_failed_shared_load.py", "test_vllm_deadlines.py",
    "test_vllm_failed_loads.py", "test_hosts.py", "test_cli_cluster.py", "test_node_kill.py",
    "test_autoscale.py")
"""Test modules that take minutes (engines, Ray Serve, clusters of their own), longest
first. They are run first: with ``-n 2 --dist loadfile`` a worker takes the next module
when it is free, so a long module started last would leave the other worker idle."""


@pytest.fixture(autouse=True, scope="module")
def _no_ray_left_by_another_module():
    """Every test module starts with no Ray initialised in this process: a module that
    left Ray initialised (a failed teardown, a test run alone in another order) would
    make the next one's ``start_local`` refuse to start."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of ``SLOWEST_FIRST`` first, in that order, then the others as
    collected; a module's own tests keep their order."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """After every other plugin is done: flush and leave with pytest's exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
