import os
import uuid

import pytest

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


@pytest.fixture(scope="module")
def cluster():
    """A real two-node embedded raykv cluster (Ray + mooncake_master), per test module."""
    from clusters import start_local

    with start_local(num_nodes=2, global_segment_size=256 << 20) as c:
        yield c


@pytest.fixture
def uid() -> str:
    """A fresh key namespace per test, so tests sharing a store never see each other."""
    return uuid.uuid4().hex[:10]
