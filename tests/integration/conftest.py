import os
import uuid

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


MODES = ("embedded", "standalone")


def two_nodes(mode: str):
    """A real two-node raykv cluster (Ray + mooncake_master; standalone: a supervised
    mooncake_client per node) in Mooncake ``mode``."""
    from raykv.clusters import start_local

    return start_local(num_nodes=2, global_segment_size=256 << 20,
                       standalone=mode == "standalone")


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
