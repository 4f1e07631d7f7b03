"""How the suite's tests are grouped into work units for ``pytest -n 2 --dist loadfile``
and in which order units go out (``tests/conftest.py`` applies both). Pure data and
functions of a test's node id."""

from __future__ import annotations

ENGINE_UNIT = "vllm-engines"
ENGINE_MODULES = (
    "tests/integration/test_vllm.py",
    "tests/integration/test_router_llm.py",
    "tests/integration/test_demo_vllm.py",
    "tests/integration/test_vllm_failed_shared_load.py",
    "tests/integration/test_vllm_deadlines.py",
    "tests/peers/test_vllm_peers.py",
    "tests/integration/test_vllm_failed_loads.py",
)
"""Modules that run real vLLM engines, each CPU-bound on 2 cores (two side by side
slowed both): one work unit, run in this order by one worker."""

SHARED_UNIT = "shared-cluster"
SHARED_CLUSTER_MODULES = (
    "tests/integration/test_bad_input.py",
    "tests/integration/test_clear.py",
    "tests/integration/test_concurrent_ranks.py",
    "tests/integration/test_deadlines.py",
    "tests/integration/test_hostile_channel.py",
    "tests/integration/test_sglang_contract.py",
    "tests/integration/test_sglang_deadlines.py",
    "tests/integration/test_tenants.py",
    "tests/integration/test_breaker.py",
    "tests/integration/test_node_kill.py",
    "tests/integration/test_restart_metadata.py",
    "tests/integration/test_sglang.py",
    "tests/integration/test_group.py",
)
"""Modules whose ``cluster`` fixture is the two-node embedded cluster that
``tests/integration/shared_cluster.py`` holds: one work unit, in this order (those
that kill or restart an actor, which ends the held cluster, last)."""

MODULE_SECONDS = {
    ENGINE_UNIT: 1510,
    SHARED_UNIT: 1150,
    "tests/integration/test_dataplane.py": 280,
    "tests/integration/test_cli_cluster.py": 240,
    "tests/integration/test_final_returns.py": 220,
    "tests/integration/test_sglang_close.py": 140,
    "tests/integration/test_hosts.py": 130,
    "tests/integration/test_pool_teardown.py": 120,
    "tests/integration/test_engine.py": 110,
    "tests/integration/test_standalone.py": 110,
    "tests/integration/test_hybrid.py": 100,
    "tests/integration/test_shm_limits.py": 80,
    "tests/integration/test_lifecycle.py": 60,
}
"""Wall seconds of the longest work units in a whole run at ``-n 2`` on 2 cores (each
module's own cluster included; measured 2026-11-28; every other module took under
60 s). Only their order matters: units go out longest first."""


def work_unit(nodeid: str) -> str:
    """The work unit of the test ``nodeid``: ``ENGINE_UNIT``, ``SHARED_UNIT``, or its
    module."""
    module = nodeid.split("::", 1)[0]
    if module in ENGINE_MODULES:
        return ENGINE_UNIT
    return SHARED_UNIT if module in SHARED_CLUSTER_MODULES else module


def unit_rank(nodeid: str) -> tuple[int, int]:
    """Sort key of a test: longer units first, then the module's place in its unit."""
    module = nodeid.split("::", 1)[0]
    unit = work_unit(nodeid)
    order = {ENGINE_UNIT: ENGINE_MODULES, SHARED_UNIT: SHARED_CLUSTER_MODULES}.get(unit)
    return -MODULE_SECONDS.get(unit, 0), order.index(module) if order else 0
