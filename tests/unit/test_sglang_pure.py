"""The SGLang backend's pure modules without SGLang: config translation, host pools
described as raykv layouts, transfers mapped one to one. SGLang's objects are stood in
for by namespaces with the same field names (and enums by their values)."""

import json
import sys
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from raykv.controllers.contract import PoolHitPolicy, PoolName, PoolTransfer
from raykv.integrations.sglang.config import CONFIG_KEYS, BackendOptions, storage_config
from raykv.integrations.sglang.pools import describe_pool
from raykv.integrations.sglang.transfers import (
    exists_queries,
    failed,
    results_for,
    to_raykv,
)

PAGE = 4


class SGPool(str, Enum):  # noqa: UP042 (SGLang's PoolName is a (str, Enum) with more members)
    KV = "kv"
    MAMBA = "mamba"
    DRAFT = "draft"
    INDEXER = "indexer"
    DEEPSEEK_V4_C4 = "deepseek_v4_c4"


def sg_config(**kw) -> SimpleNamespace:
    base = dict(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                model_name="m", extra_config={"extra_backend_tag": "t", "timeout_s": 2,
                                              "ray_address": "h:1", "interface_v1": 1})
    return SimpleNamespace(**(base | kw))


def sg_transfer(name, keys=None, host_indices=None, indices_from_pool=None,
                hit_policy="all_pages") -> SimpleNamespace:
    return SimpleNamespace(name=name, keys=keys, host_indices=host_indices,
                           indices_from_pool=indices_from_pool, hit_policy=hit_policy)


# ------------------------------------------------------------------ config
def test_storage_config_keeps_ranks_and_only_raykv_extra_keys():
    cfg = storage_config(sg_config())
    assert (cfg.tp_rank, cfg.tp_size, cfg.model_name) == (1, 2, "m")
    assert cfg.extra_config == {"extra_backend_tag": "t", "timeout_s": 2}
    assert cfg.lookup_home is None  # TP 2: the deployment's home node by default
    mine = storage_config(sg_config(extra_config={"lookup_home": "node"}))
    assert mine.lookup_home == "node"  # an engine whose ranks share a node asks it


def test_storage_config_passes_tenant_and_model_revision():
    extra = {"extra_backend_tag": "t", "tenant": "acme", "model_revision": "r1",
             "ray_address": "h:1"}
    cfg = storage_config(sg_config(extra_config=extra))
    assert (cfg.tenant, cfg.model_revision, cfg.extra_backend_tag) == ("acme", "r1", "t")
    assert {"tenant", "model_revision"} <= set(CONFIG_KEYS)
    with pytest.raises(ValueError, match="tenant must be"):
        storage_config(sg_config(extra_config={"tenant": "bad name"}))


@pytest.mark.parametrize(("kw", "match"), [({"dcp_size": 2}, "dcp_size=2"),
                                           ({"should_split_heads": True}, "should_split_heads")])
def test_storage_config_refuses_what_raykv_cannot_serve(kw, match):
    with pytest.raises(ValueError, match=f"raykv cannot serve this SGLang HiCache.*{match}"):
        storage_config(sg_config(**kw))


def test_backend_options_defaults_and_overrides():
    assert BackendOptions.from_extra(None) == BackendOptions()
    opts = BackendOptions.from_extra({"ray_namespace": "ns", "ray_node_id": "n1",
                                      "zero_copy": 0, "staging_pages": "8",
                                      "interface_v1": 1, "allocator": "shm"})
    assert (opts.namespace, opts.node_id, opts.zero_copy, opts.staging_pages,
            opts.interface_v1, opts.allocator) == ("ns", "n1", False, 8, True, "shm")


def launch_extra() -> dict:
    """The extra config of the README's SGLang launch line (the one copy), whole:
    SGLang's own keys and raykv's."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = readme.split("python -m sglang.launch_server", 1)[1].split("```", 1)[0]
    return json.loads(line.split("--hicache-storage-backend-extra-config '", 1)[1]
                      .split("'", 1)[0])


LAUNCH_EXTRA = launch_extra() | {"ray_address": "10.0.0.1:6379"}  # the head's address


def test_the_readme_launch_line_is_accepted_whole():
    opts = BackendOptions.from_extra(LAUNCH_EXTRA)
    assert opts.interface_v1 and opts.allocator == "shm"
    assert {"backend_name", "module_path", "class_name", "ray_address"} <= set(LAUNCH_EXTRA)


def test_namespace_is_vllms_word_and_ray_namespace_its_alias():
    assert BackendOptions.from_extra({"namespace": "ns"}).namespace == "ns"
    assert BackendOptions.from_extra({"ray_namespace": "ns"}).namespace == "ns"
    assert BackendOptions.from_extra({"namespace": "ns", "ray_namespace": "ns"}
                                     ).namespace == "ns"
    assert BackendOptions.from_extra({}).namespace == "raykv"
    with pytest.raises(ValueError, match="\"namespace\" \\('a'\\) and its alias "
                                         "\"ray_namespace\" \\('b'\\) differ"):
        BackendOptions.from_extra({"namespace": "a", "ray_namespace": "b"})


# standalone_storage: MooncakeStore's switch, which docs/deploy.md says this backend refuses
@pytest.mark.parametrize("key", ["master_server_address", "namespce", "protocol",
                                 "standalone_storage"])
def test_unknown_keys_are_refused_with_the_valid_ones(key):
    with pytest.raises(ValueError) as e:
        BackendOptions.from_extra(LAUNCH_EXTRA | {key: "x"})
    message = str(e.value)
    assert f"unknown --hicache-storage-backend-extra-config keys ['{key}']" in message
    for valid in ("'namespace'", "'ray_namespace'", "'zero_copy'", "'timeout_s'",
                  "'tenant'", "'model_revision'", "'interface_v1'", "'backend_name'"):
        assert valid in message, (valid, message)


def test_sglangs_own_and_every_raykv_key_pass():
    """Control for the refusal above: the same config without the unknown key, and
    every key either side reads."""
    from raykv.integrations.sglang.config import CONFIG_KEYS, SGLANG_KEYS

    assert BackendOptions.from_extra(LAUNCH_EXTRA).ray_address == "10.0.0.1:6379"
    every = dict.fromkeys(CONFIG_KEYS + SGLANG_KEYS, "1") | {"namespace": "n",
                                                            "ray_namespace": "n"}
    assert BackendOptions.from_extra(every).namespace == "n"
    assert {"tenant", "model_revision"} <= set(CONFIG_KEYS)


def test_sglang_joins_ray_as_vllm_does_without_an_address(monkeypatch):
    """No ``ray_address`` and no ``$RAY_ADDRESS``: the backend joins ``auto`` (before,
    it refused to start), the fallback vLLM's connector has (both call ``join_ray``
    with the parsed address and namespace)."""
    from raykv.integrations import ray_join

    calls = []
    fake_ray = SimpleNamespace(
        is_initialized=lambda: False, init=lambda **kw: calls.append(kw),
        get_runtime_context=lambda: SimpleNamespace(get_node_id=lambda: "n"))
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    modes = []  # the auth mode is settled with the real Ray's config: recorded here
    monkeypatch.setattr(ray_join, "join_mode", modes.append)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    opts = BackendOptions.from_extra({k: v for k, v in LAUNCH_EXTRA.items()
                                      if k != "ray_address"} | {"namespace": "ns"})
    assert ray_join.join_ray(opts.ray_address, opts.namespace, opts.auth_mode) is None
    assert (calls[0]["address"], calls[0]["namespace"]) == ("auto", "ns")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    ray_join.join_ray(opts.ray_address, opts.namespace, opts.auth_mode)
    assert calls[1]["address"] == "10.0.0.2:6379"
    assert modes == [opts.auth_mode] * 2


# ------------------------------------------------------------------- pools
def test_mha_host_pool_is_described_with_the_same_bytes_per_page():
    engine = SimpleNamespace(layout="page_first", page_size=PAGE,
                             kv_buffer=torch.randn(2, 8 * PAGE, 2, 1, 8))
    ep = describe_pool(PoolName.KV, engine)
    assert ep.kind == "mha" and ep.layout.size == 8 * PAGE and ep.memfd is None
    assert not ep.zero_copy and ep.engine is engine
    assert [p.shape for p in ep.pages] == [(8, PAGE * 2 * 8 * 4)] * 2


def test_indexer_and_mamba_pools():
    indexer = SimpleNamespace(layout="page_first", page_size=PAGE,
                              index_k_with_scale_buffer=torch.zeros(6, 3, 1, 132,
                                                                    dtype=torch.uint8))
    ep = describe_pool(PoolName.INDEXER, indexer)
    assert ep.kind == "indexer" and ep.layout.object_sizes == [3 * 132]
    mamba = SimpleNamespace(temporal_buffer=torch.zeros(5, 2, 3),
                            conv_buffer=[torch.zeros(5, 2, 4, dtype=torch.bfloat16)])
    ep = describe_pool(PoolName.MAMBA, mamba)
    assert ep.kind == "mamba" and [b.name for b in ep.layout.buffers] == ["temporal", "conv_0"]
    conv_only = SimpleNamespace(temporal_buffer=torch.zeros(5, 0), conv_buffer=[
        torch.zeros(5, 2, 4)])
    assert [b.name for b in describe_pool(PoolName.MAMBA, conv_only).layout.buffers] == [
        "conv_0"]


@pytest.mark.parametrize(("name", "engine", "match"), [
    (PoolName.KV, SimpleNamespace(layout="layer_first"), "host layout 'layer_first'"),
    (PoolName.KV, SimpleNamespace(page_size=PAGE), "has no kv_buffer tensor"),
    (PoolName.KV, SimpleNamespace(page_size=PAGE, kv_buffer=torch.zeros(3, 8, 2, 1, 8)),
     "pool 'kv': kv_buffer .* is neither MHA nor MLA"),
    (PoolName.INDEXER, SimpleNamespace(page_size=PAGE, index_k_with_scale_buffer=torch.zeros(
        6, 3, 1, 3, dtype=torch.uint8)), "do not split into"),
    (PoolName.MAMBA, SimpleNamespace(temporal_buffer=torch.zeros(5, 2), conv_buffer=[
        torch.zeros(5, 2)], slot_state_device_tensors=[1]), "slot side states"),
])
def test_unservable_pools_are_refused_by_name(name, engine, match):
    with pytest.raises(ValueError, match=match):
        describe_pool(name, engine)


# --------------------------------------------------------------- transfers
def test_transfers_are_forwarded_one_to_one():
    idx = torch.arange(2 * PAGE)
    out, empty = to_raykv([
        sg_transfer(SGPool.KV, ["a", "b"], idx),
        sg_transfer(SGPool.DRAFT, None, None, SGPool.KV),  # a sidecar: the client resolves
        sg_transfer(SGPool.INDEXER, ["a", "b"], idx, SGPool.KV),  # indices filled in by SGLang
        sg_transfer(SGPool.MAMBA, [], None),
    ])
    assert out == [PoolTransfer(PoolName.KV, ["a", "b"], idx),
                   PoolTransfer(PoolName.DRAFT, None, None, indices_from_pool=PoolName.KV),
                   PoolTransfer(PoolName.INDEXER, ["a", "b"], idx)]
    assert out[0].host_indices is idx and empty == [SGPool.MAMBA]
    with pytest.raises(ValueError, match="pool 'deepseek_v4_c4' is not registered"):
        to_raykv([sg_transfer(SGPool.DEEPSEEK_V4_C4, ["a"], idx)])


def test_results_carry_sglangs_names_and_failures_cover_every_page():
    out = {PoolName.KV: [True, False], PoolName.DRAFT: [True, True]}
    assert results_for(out, [SGPool.MAMBA], SGPool) == {
        SGPool.KV: [True, False], SGPool.DRAFT: [True, True], SGPool.MAMBA: []}
    assert failed([sg_transfer(SGPool.KV, ["a", "b", "c"]), sg_transfer(SGPool.DRAFT),
                   sg_transfer(SGPool.MAMBA, [])]) == {
        SGPool.KV: [False] * 3, SGPool.DRAFT: [False] * 3, SGPool.MAMBA: []}


def test_exists_queries_skip_kv_and_refuse_block_groups():
    queries = exists_queries([sg_transfer(SGPool.KV, ["a"]),
                              sg_transfer(SGPool.MAMBA, ["a"], hit_policy="trailing_pages"),
                              sg_transfer(SGPool.DRAFT)])
    assert queries == [PoolTransfer(PoolName.MAMBA, ["a"], None, PoolHitPolicy.TRAILING_PAGES),
                       PoolTransfer(PoolName.DRAFT, None, None, PoolHitPolicy.ALL_PAGES)]
    assert exists_queries(None) == []
    with pytest.raises(ValueError, match="hit policy block_groups not served"):
        exists_queries([sg_transfer(SGPool.MAMBA, ["a"], hit_policy="block_groups")])
    with pytest.raises(ValueError, match="pool 'deepseek_v4_c4'"):
        exists_queries([sg_transfer(SGPool.DEEPSEEK_V4_C4, ["a"])])


def test_meters_count_pages_and_hand_storage_metrics_over_once():
    from raykv.integrations.sglang.meters import BackendMeters

    pool = SimpleNamespace(layout=SimpleNamespace(object_sizes=[1000, 1000]))
    meters = BackendMeters(storage_metrics=True)
    meters.record(True, {PoolName.KV: [True, True, False]}, {PoolName.KV: pool}, 1e-6)
    meters.record(False, {PoolName.KV: [True], PoolName.MAMBA: [True]}, {PoolName.KV: pool},
                  1e-6)  # a role no longer served: its pages count, its bytes do not
    assert meters.counters == {"set_pages": 2, "get_pages": 2}
    lists = ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")
    m = meters.drain_into(SimpleNamespace(**{k: [] for k in lists}))
    assert m.backup_pgs == [2] and m.prefetch_pgs == [2]
    assert m.backup_bandwidth == [pytest.approx(4.0)]  # 4,000 bytes in 1 us: 4 GB/s
    assert m.prefetch_bandwidth == [pytest.approx(2.0)]
    again = meters.drain_into(SimpleNamespace(**{k: [] for k in lists}))
    assert all(getattr(again, k) == [] for k in lists)  # handed over once
    off = BackendMeters(storage_metrics=False)
    off.record(True, {PoolName.KV: [True]}, {PoolName.KV: pool}, 1.0)
    assert off.counters == {"set_pages": 1}
    assert off.drain_into(SimpleNamespace(**{k: [] for k in lists})).backup_pgs == []
