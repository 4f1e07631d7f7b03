import contextlib
import os
import socket
import uuid
from contextlib import contextmanager

import pytest

from tests.integration import shared_cluster

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


MODES = ("embedded", "standalone")


RAY_DASHBOARD_PORT = 8265


@contextmanager
def two_nodes(mode: str):
    """A real two-node raykv cluster (Ray + mooncake_master; standalone: a supervised
    mooncake_client per node) in Mooncake ``mode``, started while Ray's default
    dashboard port is taken (as another Ray on the machine takes it: a cluster's
    start must not depend on it; with the dashboard on, the head node timed out)."""
    from raykv import local_settings, start_local

    with contextlib.ExitStack() as held:
        listener = socket.socket()
        held.callback(listener.close)
        with contextlib.suppress(OSError):  # taken already: as good
            listener.bind(("127.0.0.1", RAY_DASHBOARD_PORT))
            listener.listen()
        cluster = start_local(settings=local_settings(global_segment_size=256 << 20,
                                                      standalone=mode == "standalone"), num_nodes=2)
    with cluster:
        yield cluster


@contextmanager
def slow_two_nodes(mode: str, delay_s: float):
    """``two_nodes(mode)`` whose node actors hold every put and get ``delay_s`` s inside
    the store call (``set_store_delay``, from the start): tests tear pools down under
    transfers in flight."""
    with two_nodes(mode) as cluster:
        set_store_delay(cluster, delay_s)
        yield cluster


def set_store_delay(cluster, seconds: float) -> None:
    """From now on every put and get of ``cluster``'s node actors waits ``seconds`` inside
    its store call (``store_delay.delay_store_calls``; 0: off), so a module's running
    cluster and engines serve a test of slow store calls without a cluster of their own."""
    from tests.integration.store_delay import delay_store_calls

    delay_store_calls(list(cluster.node_actors.values()), seconds)


def node_pids(cluster) -> dict:
    """The pid of every node actor of ``cluster``, by node id (a crash changes one)."""
    import ray

    return {n: ray.get(a.health.remote())["pid"] for n, a in cluster.node_actors.items()}


@pytest.fixture(scope="module")
def cluster():
    """The two-node embedded cluster of this test process, shared by the modules that
    take it one after another (``shared_cluster``); each module leaves it with its store
    calls undelayed."""
    c = shared_cluster.get(lambda: two_nodes("embedded"))
    yield c
    set_store_delay(c, 0)


@pytest.fixture(scope="module", params=MODES)
def any_mode_cluster(request):
    """A two-node cluster per test module and mode: a module that names this fixture
    ``cluster`` runs every test in both modes."""
    with two_nodes(request.param) as c:
        yield c


@pytest.fixture(autouse=True)
def _closed_breakers() -> None:
    """Each test starts with this process's circuit breakers closed: one test whose
    store calls ran into their deadlines (a slow store on a loaded CI machine) must not
    fail the next tests of its module at once with ``CircuitOpenError``."""
    from raykv.cache_actors.rank import node_guard

    with node_guard._guards_lock:
        node_guard._guards.clear()


@pytest.fixture
def uid() -> str:
    """A fresh key namespace per test, so tests sharing a store never see each other."""
    return uuid.uuid4().hex[:10]
