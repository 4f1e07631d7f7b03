"""``kv_connector_extra_config`` of the vLLM connector and what its two sides share
(pure: no vLLM, no Ray needed)."""

import threading

import pytest
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.controllers.contract import DEFAULT_TIMEOUT_S
from raykv.controllers.naming import NAMESPACE
from raykv.integrations.vllm.options import ConnectorOptions, default_backend_tag
from raykv.integrations.vllm.side import ConnectorSide, new_stats


def parse(extra=None, tp=1, pp=1, model="org/m"):
    return ConnectorOptions.parse(extra, tp_size=tp, pp_size=pp, served_model=model)


def test_defaults():
    o = parse()
    assert o == ConnectorOptions(model_name="org/m", extra_backend_tag="vllm-tp1",
                                 namespace=NAMESPACE, ray_address=None, pool_blocks=64,
                                 timeout_s=DEFAULT_TIMEOUT_S, debug_corrupt_loads=False)


def test_backend_tag_names_tp_and_pp():
    assert default_backend_tag(2, 1) == "vllm-tp2"
    assert default_backend_tag(2, 3) == "vllm-tp2-pp3"
    assert parse(tp=4, pp=2).extra_backend_tag == "vllm-tp4-pp2"
    assert parse({"extra_backend_tag": "mine"}, tp=4).extra_backend_tag == "mine"


def test_every_key():
    o = parse({"model_name": "shared", "namespace": "ns", "ray_address": "h:1",
               "pool_blocks": "8", "timeout_s": 1.5, "debug_corrupt_loads": 1})
    assert (o.model_name, o.namespace, o.ray_address) == ("shared", "ns", "h:1")
    assert (o.pool_blocks, o.timeout_s, o.debug_corrupt_loads) == (8, 1.5, True)
    assert parse({"model_name": ""}).model_name == "org/m"  # empty: the served model


def test_refuses_bad_config():
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config keys \['pool'\]"):
        parse({"pool": 1})
    with pytest.raises(ValueError, match="pool_blocks must be >= 1"):
        parse({"pool_blocks": 0})
    with pytest.raises(ValueError, match="timeout_s"):
        parse({"timeout_s": -1})


def test_storage_config_carries_key_prefix_and_deadline():
    sc = parse({"timeout_s": 2}, tp=2).storage_config(tp_rank=1, tp_size=2, pp_rank=0,
                                                       pp_size=1)
    assert (sc.tp_rank, sc.tp_size, sc.model_name) == (1, 2, "org/m")
    assert sc.extra_config == {"extra_backend_tag": "vllm-tp2", "timeout_s": 2.0}
    assert sc.timeout_s == 2.0


class FakeClient:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def destroy_host_pool(self, pool) -> None:
        self.calls.append(f"destroy {pool}")

    def close(self) -> None:
        self.calls.append("close")


class Side(ConnectorSide):
    """A side whose ``_attach`` waits for ``release`` (a node actor that answers late)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(parse({"timeout_s": timeout_s}), block_size=16, tp_rank=0,
                         tp_size=1, pp_rank=0, pp_size=1)
        self.release = threading.Event()
        self.attaches = 0
        self.fail = False

    def _create_pool(self, client, name):
        raise AssertionError("not used: _attach is replaced")

    def _attach(self) -> None:
        self.attaches += 1
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("no node actor")
        self._pool, self._client = "pool", FakeClient()


def test_cache_waits_one_deadline_then_attaches_in_background():
    side = Side(timeout_s=0.05)
    with pytest.raises(NodeUnavailableError, match="still attaching"):
        side._cache()
    with pytest.raises(NodeUnavailableError):
        side._cache()
    assert side.attaches == 1  # one attach thread at a time
    side.release.set()
    side._attaching.join(5)
    client = side._cache()
    assert side._cache() is client and side.attaches == 1
    side.shutdown()
    assert client.calls == ["destroy pool", "close"] and side._client is None
    side.shutdown()  # twice: nothing left to close
    assert client.calls == ["destroy pool", "close"]


def test_cache_reports_why_attaching_failed():
    side = Side(timeout_s=5)
    side.fail = True
    side.release.set()
    with pytest.raises(NodeUnavailableError, match="no node actor"):
        side._cache()
    assert side.stats == new_stats()
