"""The master supervisor's start (``clusters.master_supervisor``), with a stand-in master
and GCS record: a supervisor that Ray restarted (its ports recorded) and whose master
cannot start yet does not die with its constructor (Ray never restarts an actor whose
constructor raised: L3 would stay down for good); its watch retries with back-off."""

from __future__ import annotations

import json
import threading

import pytest


class _Master:
    """A ``MooncakeMaster`` stand-in whose first ``fails`` starts (and restarts) fail."""

    fails = 0
    made: list[_Master] = []

    def __init__(self, host, extra_args=None, rpc_port=0, http_port=0) -> None:
        self.rpc_port, self.http_port = rpc_port or 5001, http_port or 5002
        self.master_address = f"{host}:{self.rpc_port}"
        self.metadata_server = f"http://{host}:{self.http_port}/metadata"
        self.metrics_url = "http://127.0.0.1:5003/metrics"
        self.proc = self.metadata_proc = None
        self.exposed = []
        self.running = False
        self.started = threading.Event()
        _Master.made.append(self)

    def _launch(self) -> None:
        if _Master.fails:
            _Master.fails -= 1
            raise RuntimeError("mooncake_master did not start: port taken")
        self.running = True
        self.started.set()

    def start(self) -> _Master:
        self._launch()
        return self

    def restart(self) -> None:
        self._launch()

    def alive(self) -> bool:
        return self.running

    def stop(self) -> None:
        self.running = False


@pytest.fixture
def supervisor_class(monkeypatch):
    """The supervisor's own class (not Ray's actor), with ``_Master`` and a dict for
    the GCS."""
    from raykv.clusters import master_supervisor as ms

    kv: dict[str, bytes] = {}
    monkeypatch.setattr(ms, "MooncakeMaster", _Master)
    monkeypatch.setattr(ms.internal_kv, "_internal_kv_get", kv.get)
    monkeypatch.setattr(ms.internal_kv, "_internal_kv_put",
                        lambda key, value, overwrite: kv.__setitem__(key, value.encode()))
    monkeypatch.setattr(ms.ray, "get_runtime_context",
                        lambda: type("Context", (), {"namespace": "ns"})())
    _Master.made, _Master.fails = [], 0
    return ms.MasterSupervisor.__ray_actor_class__, kv, ms.ports_key("ns")


@pytest.mark.parametrize("restarted", [True, False], ids=["restarted", "control-fresh"])
def test_a_restarted_supervisor_whose_master_cannot_start_yet_retries(supervisor_class,
                                                                       restarted):
    """Ray restarted the supervisor (its ports recorded) while the old master still held
    them: the first start fails, the supervisor comes up ``restarting`` and its watch
    starts the master on the recorded ports. CONTROL: a fresh supervisor (no record: the
    first ``raykv up``) whose master cannot start raises, as it did before, so ``raykv
    up`` fails loudly."""
    cls, kv, key = supervisor_class
    if restarted:
        kv[key] = json.dumps([7001, 7002]).encode()
    _Master.fails = 2
    if not restarted:
        with pytest.raises(RuntimeError, match="port taken"):
            cls("127.0.0.1", period_s=0.01, first_s=0.01, cap_s=0.01)
        return
    sup = cls("127.0.0.1", period_s=0.01, first_s=0.01, cap_s=0.01)
    try:
        (master,) = _Master.made
        assert master.started.wait(30), "the watch never started the master"
        assert (master.rpc_port, master.http_port) == (7001, 7002)
        for _ in range(3000):
            if sup.addresses()["state"] == "running":
                break
            threading.Event().wait(0.01)
        state = sup.addresses()
        assert state["state"] == "running" and state["restarts"] == 1, state
        assert "port taken" in state["last_error"]
        assert json.loads(kv[key]) == [7001, 7002]
    finally:
        sup.stop()
