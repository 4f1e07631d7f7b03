"""``DeploymentClear`` through ``MooncakeBackend`` against a fake store with leases (no
Mooncake): a clear removes the deployment's objects, waits out the leases that hold
some of them, never touches other keys, and fails (never reports success) on a refused
claim, a store error or its deadline. The real master: ``test_sglang_contract.py``."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest
from raykv.cache_actors.errors import DeadlineExceededError
from raykv.cache_actors.node import deployment_clear
from raykv.cache_actors.node.deployment_clear import PROBE_PREFIX, DeploymentClear
from raykv.cache_actors.node.mooncake_backend import MooncakeBackend
from raykv.controllers import StorageConfig
from raykv.controllers.ownership import claim_of

LEASE_S = 0.3
H = "ab" * 32
MINE = claim_of(StorageConfig(model_name="org/m"))


class LeasingStore:
    """Mooncake's rules that a clear depends on: a lookup leases what it reports for
    ``lease_s``; a non-forced remove skips (regex) or refuses (-706) a leased object."""

    def __init__(self, lease_s: float = LEASE_S) -> None:
        self.lease_s = lease_s
        self.objects: dict[str, float] = {}  # key -> lease end (monotonic)
        self.regex_code: int | None = None   # set: what remove_by_regex answers

    def _free(self, key: str) -> bool:
        return self.objects[key] <= time.monotonic()

    def put(self, key, data):
        self.objects.setdefault(key, 0.0)
        return 0

    def batch_is_exist(self, keys):
        now = time.monotonic()
        for k in keys:
            if k in self.objects:
                self.objects[k] = max(self.objects[k], now + self.lease_s)
        return [1 if k in self.objects else 0 for k in keys]

    def remove_by_regex(self, pattern, force):
        assert force is False
        if self.regex_code is not None:
            return self.regex_code
        gone = [k for k in self.objects if re.search(pattern, k) and self._free(k)]
        for k in gone:
            del self.objects[k]
        return len(gone)

    def remove(self, key, force):
        assert force is False
        if key not in self.objects:
            return -704
        if not self._free(key):
            return -706
        del self.objects[key]
        return 0

    def batch_remove(self, keys, force):
        for k in keys:
            self.objects.pop(k, None)
        return [0] * len(keys)


def clearer(store: LeasingStore, verify=lambda c: c) -> DeploymentClear:
    node_store = SimpleNamespace(backend=MooncakeBackend(store), before_call=lambda: 0)
    return DeploymentClear(node_store, verify, "node-0123456789")


@pytest.fixture(autouse=True)
def fast_poll(monkeypatch):
    monkeypatch.setattr(deployment_clear, "LEASE_POLL_S", 0.01)


def test_a_clear_waits_out_the_leases_and_leaves_other_keys():
    store = LeasingStore()
    mine = [f"org-m_{H}_0_k", f"org-m_{H}_0_v", f"org-m_{'cd' * 32}_0_k"]
    others = [f"org-m_x_{H}_0_k", f"org-m2_{H}_0_k", "org-m_test_key"]
    for k in mine + others:
        store.put(k, b"x")
    store.batch_is_exist(mine[:2] + others[:1])   # read a moment ago: leased
    c = clearer(store)
    t = time.monotonic()
    assert c.clear(MINE) == 3
    assert time.monotonic() - t >= LEASE_S * 0.9  # it waited for the leases
    assert sorted(store.objects) == sorted(others)  # no probe left either
    assert not any(k.startswith(PROBE_PREFIX) for k in store.objects)


def test_control_one_pass_alone_leaves_the_leased_objects():
    store = LeasingStore()
    mine = [f"org-m_{H}_0_k", f"org-m_{H}_0_v"]
    for k in mine:
        store.put(k, b"x")
    store.batch_is_exist(mine[:1])
    assert MooncakeBackend(store).remove_matching(f"^org-m_{H}") == 1
    assert list(store.objects) == mine[:1]


def test_past_the_deadline_a_clear_fails_and_removes_its_probe(monkeypatch):
    store = LeasingStore(lease_s=5.0)
    store.put(f"org-m_{H}_0_k", b"x")
    monkeypatch.setattr(deployment_clear, "CLEAR_WAIT_S", 0.1)
    with pytest.raises(DeadlineExceededError, match="leases"):
        clearer(store).clear(MINE)
    assert list(store.objects) == []  # the first pass removed it; the probe went too


def test_a_store_error_is_an_error_never_a_count():
    store = LeasingStore()
    store.regex_code = -600
    with pytest.raises(RuntimeError, match="-600"):
        clearer(store).clear(MINE)


def test_a_refused_claim_or_a_deployment_without_prefix_removes_nothing():
    store = LeasingStore()
    store.put(f"{H}_0_k", b"x")

    def refuse(claim):
        raise ValueError("the owner proof differs")

    with pytest.raises(ValueError, match="owner proof"):
        clearer(store, refuse).clear(MINE)
    with pytest.raises(ValueError, match="no key prefix"):
        clearer(store).clear(claim_of(StorageConfig()))
    assert list(store.objects) == [f"{H}_0_k"]
