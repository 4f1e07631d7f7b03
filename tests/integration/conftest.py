import os
import uuid

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


MODES = ("embedded", "standalone")


def two_nodes(mode: str):
    """A real two-node raykv cluster (Ray + mooncake_master; standalone: a supervised
    mooncake_client per node) in Mooncake ``mode``."""
    from raykv import start_local

    return start_local(num_nodes=2, global_segment_size=256 << 20,
                       standalone=mode == "standalone")


def slow_two_nodes(mode: str, delay_s: float):
    """``two_nodes(mode)`` whose node actors hold every put and get ``delay_s`` s inside
    the store call (``RAYKV_TEST_STORE_DELAY_S``, read by the node actors as they start):
    tests tear pools down under transfers in flight."""
    os.environ["RAYKV_TEST_STORE_DELAY_S"] = str(delay_s)
    try:
        return two_nodes(mode)
    finally:
        del os.environ["RAYKV_TEST_STORE_DELAY_S"]


def set_store_delay(cluster, seconds: float) -> None:
    """From now on every put and get of ``cluster``'s node actors waits ``seconds`` inside
    its store call (``RAYKV_TEST_STORE_DELAY_S``'s hook, changed in the running actors
    through Ray's ``__ray_call__``; 0: off), so a module's running cluster and engines
    serve a test of slow store calls without a cluster of their own."""
    import ray

    def set_delay(actor, s: float) -> None:  # runs in the node actor's process
        from raykv.cache_actors.node import mooncake_backend

        mooncake_backend._TEST_DELAY_S = s

    ray.get([a.__ray_call__.remote(set_delay, seconds) for a in cluster.node_actors.values()],
            timeout=60)


def node_pids(cluster) -> dict:
    """The pid of every node actor of ``cluster``, by node id (a crash changes one)."""
    import ray

    return {n: ray.get(a.health.remote())["pid"] for n, a in cluster.node_actors.items()}


@pytest.fixture(scope="module")
def cluster():
    """A two-node embedded cluster, per test module."""
    with two_nodes("embedded") as c:
        yield c


@pytest.fixture(scope="module", params=MODES)
def any_mode_cluster(request):
    """A two-node cluster per test module and mode: a module that names this fixture
    ``cluster`` runs every test in both modes."""
    with two_nodes(request.param) as c:
        yield c


@pytest.fixture
def uid() -> str:
    """A fresh key namespace per test, so tests sharing a store never see each other."""
    return uuid.uuid4().hex[:10]
