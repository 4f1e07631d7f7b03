"""Hooks for the whole suite.

Order of work (``pytest -n 2 --dist loadfile``, the pyproject's options; the units and
their order in ``tests/work_units.py``): the modules that run real vLLM engines form one
work unit, so one worker runs them one after another (each is CPU-bound on these 2
cores; two side by side slowed both) while the other runs modules that partly wait on
clusters and deadlines; the modules that share one cluster form another. Units go out
longest first, so the run never ends on one long module while the other worker idles
(xdist's own order, by test count, sent the one-test Serve LLM modules last).

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

from tests.work_units import SHARED_CLUSTER_MODULES, unit_rank, work_unit

_exit_status = 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest work units first (a stable sort: the rest keep their collection order)."""
    items.sort(key=lambda item: unit_rank(item.nodeid))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` with the units of ``tests/work_units.py``, sent out in
    collection order (the order ``pytest_collection_modifyitems`` made); other modes:
    xdist's."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return WorkUnitScheduling(config, log)


@pytest.fixture(autouse=True, scope="module")
def _no_ray_left_by_another_module(request: pytest.FixtureRequest):
    """Every test module starts with no Ray initialised in this process (a module that
    left Ray initialised, by a failed teardown or a test run alone in another order,
    would make the next one's ``start_local`` refuse to start), but for the cluster that
    ``tests/integration/shared_cluster.py`` holds for the modules that share it."""
    shared = sys.modules.get("tests.integration.shared_cluster")
    keep = request.node.nodeid in SHARED_CLUSTER_MODULES
    if shared is not None and not keep:
        shared.stop()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and not (
            keep and shared is not None and shared.holding()):
        ray.shutdown()
    yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    shared = sys.modules.get("tests.integration.shared_cluster")
    if shared is not None:
        shared.stop()
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """After every other plugin is done: flush and leave with pytest's exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
