"""Hooks for the whole suite.

The test process leaves with ``os._exit`` once pytest has written every result: a run
here passed all 344 tests and then died at interpreter exit with a segfault inside Ray's
GCS client (dmesg: the faulting code lies in its ``NodeInfoGcsService/GetAllNodeInfo``
call), a thread of Ray's still polling while Python tore its modules down. The exit code
is pytest's own.

Test files are handed to the two workers (``--dist loadfile``) in collection order, each
file to the next worker that is free: the longest files are moved to the front
(``LONGEST_FIRST``), so the run does not end with one worker alone on a long file while
the other idles, and the files that take the shared two-node cluster follow one another
(``tests/integration/shared_cluster``), so a worker starts it about once.

A test marked ``@pytest.mark.engine(NAME)`` needs that engine (``tests/engines.py``): where
it is missing, it is skipped under ``RAYKV_NO_ENGINES=1`` and fails otherwise.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.engines import require

_exit_status = 0

LONGEST_FIRST = (
    "tests/integration/test_vllm.py",
    "tests/integration/test_dataplane.py",
    "tests/integration/test_final_returns.py",
    "tests/integration/test_production_path.py",
    "tests/integration/test_autoscaler.py",
    "tests/integration/test_cli_cluster.py",
    "tests/integration/test_engine.py",
    "tests/integration/test_hosts.py",
    "tests/integration/test_sglang_close.py",
    "tests/integration/test_vllm_disk.py",
    "tests/integration/test_sglang.py",
    "tests/integration/test_node_lifecycle.py",
    "tests/integration/test_vllm_load_guard.py",
)
"""The test files with the most worker time in a whole run (each over 100 s in a slow
one, most first; a file that takes the shared cluster stays in that block instead);
the rest keep their collection order after them."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``LONGEST_FIRST``'s files first, in its order, then the files that take the
    shared cluster (``tests/integration/shared_cluster``: one after another, a worker
    keeps it from one to the next), then the rest; a stable sort, so every file's own
    tests keep their order."""
    from tests.integration import shared_cluster

    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    modules = {item.module for item in items if isinstance(item, pytest.Function)}
    sharing = {m for m in modules if shared_cluster.shares(m, items)}

    def key(item: pytest.Item) -> tuple[int, int]:
        first = rank.get(item.nodeid.split("::")[0], len(rank))
        return first, 0 if getattr(item, "module", None) in sharing else 1

    items.sort(key=key)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "engine(name): the test needs that inference engine "
                            "(tests/engines.py: vllm, transformers, ray.serve, sglang)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Each engine a test is marked with is here, or the test is skipped (under
    ``RAYKV_NO_ENGINES=1``) or failed, before its fixtures start anything."""
    for mark in item.iter_markers("engine"):
        require(mark.args[0])


@pytest.fixture(autouse=True, scope="module")
def _no_ray_left_by_another_module(request: pytest.FixtureRequest):
    """Every test module starts with no Ray initialised in this process, but for the
    shared cluster where the module takes it (``tests/integration/shared_cluster``): a
    module that left Ray initialised (a failed teardown, a test run alone in another
    order) would make the next one's ``start_local`` refuse to start."""
    from tests.integration import shared_cluster

    if shared_cluster.shares(request.module, request.session.items):
        yield
        return
    shared_cluster.release()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)
    from tests.integration import shared_cluster

    shared_cluster.release()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """After every other plugin is done: flush and leave with pytest's exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
