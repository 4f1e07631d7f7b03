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
