"""``kv_connector_extra_config`` of the vLLM connector and what its two sides share
(pure: no vLLM, no Ray needed)."""

import threading

import pytest
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.controllers.contract import DEFAULT_TIMEOUT_S
from raykv.controllers.naming import NAMESPACE
from raykv.integrations.vllm.connector_stats import ConnectorStats
from raykv.integrations.vllm.options import (
    ConnectorOptions,
    KVIdentity,
    check_attention_backends,
    default_backend_tag,
    kv_layout,
    misspelt_keys,
)
from raykv.integrations.vllm.side import ConnectorSide

IDENT = KVIdentity(kv_dtype="bfloat16", page_size=128, layout="cpu.lm1")


def parse(extra=None, tp=1, pp=1, model="org/m", identity=IDENT):
    return ConnectorOptions.parse(extra, tp_size=tp, pp_size=pp, served_model=model,
                                  identity=identity)


def test_defaults():
    o = parse()
    assert o == ConnectorOptions(model_name="org/m",
                                 extra_backend_tag="vllm-tp1-bfloat16-b128-cpu.lm1",
                                 identity=IDENT, namespace=NAMESPACE, ray_address=None,
                                 pool_blocks=64, timeout_s=DEFAULT_TIMEOUT_S, tenant=None)


def test_backend_tag_names_tp_and_pp():
    assert default_backend_tag(2, 1, IDENT) == "vllm-tp2-bfloat16-b128-cpu.lm1"
    assert default_backend_tag(2, 3, IDENT) == "vllm-tp2-pp3-bfloat16-b128-cpu.lm1"
    assert parse(tp=4, pp=2).extra_backend_tag == "vllm-tp4-pp2-bfloat16-b128-cpu.lm1"
    assert parse({"extra_backend_tag": "mine"}, tp=4).extra_backend_tag == "mine"
    assert parse({"extra_backend_tag": ""}).extra_backend_tag == ""  # explicitly none


def test_backend_tag_covers_the_bytes_identity():
    """Every part of the identity changes the default tag (blocks of other bytes are
    misses); control: the same identity gives the same tag."""
    from dataclasses import replace

    base = default_backend_tag(1, 1, IDENT)
    assert default_backend_tag(1, 1, KVIdentity("bfloat16", 128, "cpu.lm1")) == base
    others = [replace(IDENT, kv_dtype="float16"), replace(IDENT, kv_dtype="fp8_e4m3"),
              replace(IDENT, page_size=64), replace(IDENT, layout="cuda.lm1"),
              replace(IDENT, model_revision="v2"), replace(IDENT, model_revision="v3")]
    tags = [default_backend_tag(1, 1, i) for i in others]
    assert len(set(tags + [base])) == len(others) + 1, tags
    assert tags[1] == "vllm-tp1-fp8-e4m3-b128-cpu.lm1"
    assert tags[4] == "vllm-tp1-bfloat16-b128-cpu.lm1-rev.v2"


def test_the_layout_names_the_attention_backend():
    """The layout part of the tag names the device and the backend as vLLM names it;
    two backends give two tags (their blocks are other bytes); control: none named."""
    assert kv_layout("cpu", "CPU_ATTN") == "cpu.cpu-attn.lm1"
    assert kv_layout("cuda", "FLASH_ATTN") == "cuda.flash-attn.lm1"
    assert kv_layout("cuda", None) == "cuda.lm1"
    tags = {default_backend_tag(1, 1, KVIdentity("float16", 16, kv_layout("cuda", b), None, b))
            for b in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")}
    assert len(tags) == 3


def test_a_worker_refuses_layers_of_another_backend_than_its_tag():
    """The worker's check at ``register_kv_caches``: layers that all run the backend the
    tag names pass; one layer of another backend (vLLM chose otherwise than the
    scheduler's resolution) or no backend named: refused, naming the backends and the
    fix; no layer vLLM knows (a test harness's own caches): not checked."""
    assert check_attention_backends("CPU_ATTN", {"model.layers.0.attn": "CPU_ATTN",
                                                 "model.layers.1.attn": "CPU_ATTN"})
    with pytest.raises(ValueError, match=r"names attention backend FLASH_ATTN but vLLM "
                                         r"runs FLASHINFER \(layers l1\).*--attention-backend"):
        check_attention_backends("FLASH_ATTN", {"l0": "FLASH_ATTN", "l1": "FLASHINFER"})
    with pytest.raises(ValueError, match="names attention backend none but vLLM runs CPU_ATTN"):
        check_attention_backends(None, {"l0": "CPU_ATTN"})
    assert check_attention_backends("CPU_ATTN", {}) is False  # nothing to check against


def test_odd_revisions_become_hashed_tag_parts():
    """A revision with characters keys do not use (or a long one) becomes a hash: no
    '_' or '/' enters the key prefix, and two revisions never share a part."""
    a = default_backend_tag(1, 1, KVIdentity("bfloat16", 128, "cpu.lm1", "refs/pr/1"))
    b = default_backend_tag(1, 1, KVIdentity("bfloat16", 128, "cpu.lm1", "refs-pr-1"))
    assert a != b and b.endswith("-rev.refs-pr-1")
    assert "/" not in a and "_" not in a and a.startswith("vllm-tp1-bfloat16-b128-cpu.lm1-rev.h")
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert default_backend_tag(1, 1, KVIdentity("bfloat16", 128, "cpu.lm1", sha)) \
        .endswith(f"-rev.{sha}")


def test_every_key():
    o = parse({"model_name": "shared", "namespace": "ns", "ray_address": "h:1",
               "pool_blocks": "8", "timeout_s": 1.5, "tenant": "team-a"})
    assert (o.model_name, o.namespace, o.ray_address) == ("shared", "ns", "h:1")
    assert o.tenant == "team-a"
    assert (o.pool_blocks, o.timeout_s) == (8, 1.5)
    assert parse({"model_name": ""}).model_name == "org/m"  # empty: the served model


def test_ignores_a_wrapper_connectors_keys(caplog):
    """A wrapper connector's own keys (vLLM's recording connector passes ``name`` through
    the extra config it shares with the connector it wraps) are ignored and logged; the
    options are those without them. Control: a misspelt raykv key is refused."""
    with caplog.at_level("WARNING", logger="vllm.raykv.integrations.vllm.options"):
        o = parse({"name": "recorder", "connectors": [], "pool_blocks": 8})
    assert o == parse({"pool_blocks": 8})
    assert "ignoring kv_connector_extra_config keys ['connectors', 'name']" in caplog.text
    with pytest.raises(ValueError, match=r"\{'pool_block': 'pool_blocks'\} look misspelt"):
        parse({"pool_block": 8, "name": "recorder"})


@pytest.mark.parametrize(("key", "meant"), [("tennant", "tenant"), ("timeout", "timeout_s"),
                                            ("extra_backend_tags", "extra_backend_tag"),
                                            ("ray_namespace", "namespace")])
def test_refuses_misspelt_keys(key, meant):
    assert misspelt_keys([key]) == {key: meant}
    with pytest.raises(ValueError, match="look misspelt"):
        parse({key: "x"})


def test_refuses_bad_config():
    with pytest.raises(ValueError, match="pool_blocks must be >= 1"):
        parse({"pool_blocks": 0})
    with pytest.raises(ValueError, match="timeout_s"):
        parse({"timeout_s": -1})
    with pytest.raises(ValueError, match="tenant must be"):
        parse({"tenant": "a b"})
    with pytest.raises(ValueError, match="async_transfers needs l2_blocks"):
        parse({"async_transfers": True, "l2_blocks": 0})
    with pytest.raises(ValueError, match="async_transfers must be true or false"):
        parse({"async_transfers": "yes", "l2_blocks": 8})
    o = parse({"async_transfers": True, "l2_blocks": 8})  # control: with L2 it is taken
    assert o.async_transfers and o.l2_blocks == 8 and not parse().async_transfers


def test_async_transfers_alone_takes_the_l2_room_of_the_node():
    """``async_transfers`` without ``l2_blocks`` (the README's production line): L2 of
    whatever the node's L2 capacity leaves; no L2 without either (before: refused)."""
    from raykv.integrations.vllm.options import L2_NODE_ROOM

    o = parse({"async_transfers": True})
    assert o.async_transfers and o.l2_blocks == L2_NODE_ROOM
    assert parse().l2_blocks == 0


def test_storage_config_carries_key_prefix_and_deadline():
    sc = parse({"timeout_s": 2}, tp=2).storage_config(tp_rank=1, tp_size=2, pp_rank=0,
                                                       pp_size=1)
    assert (sc.tp_rank, sc.tp_size, sc.model_name) == (1, 2, "org/m")
    assert sc.extra_config == {"extra_backend_tag": "vllm-tp2-bfloat16-b128-cpu.lm1",
                               "timeout_s": 2.0, "kv_dtype": "bfloat16", "page_size": 128,
                               "lookup_home": "node"}  # the scheduler alone asks
    assert sc.timeout_s == 2.0 and sc.tenant is None


def test_storage_config_carries_tenant_and_revision():
    sc = parse({"tenant": "team-a"}, identity=KVIdentity("float16", 64, "cpu.lm1", "v2")) \
        .storage_config(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    assert sc.tenant == "team-a"
    assert sc.extra_config == {"extra_backend_tag": "vllm-tp1-float16-b64-cpu.lm1-rev.v2",
                               "timeout_s": DEFAULT_TIMEOUT_S, "kv_dtype": "float16",
                               "page_size": 64, "model_revision": "v2", "tenant": "team-a",
                               "lookup_home": "node"}


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

    def _register(self, client, name):
        raise AssertionError("not used: _attach is replaced")

    def _attach(self) -> None:
        self.attaches += 1
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("no node actor")
        self._pool, self._client = "pool", FakeClient()


def test_cache_attaches_in_background_without_waiting():
    side = Side(timeout_s=0.05)
    with pytest.raises(NodeUnavailableError, match="not attached yet"):
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
    with pytest.raises(NodeUnavailableError):
        side._cache()  # the attach starts in the background
    side._attaching.join(5)
    with pytest.raises(NodeUnavailableError, match="no node actor"):
        side._cache()
    assert side.stats == ConnectorStats()
