"""The ``vllm`` pool kind and its key rule (pure logic; no vLLM needed).

A page is one vLLM KV block of every layer, ``(layer_num, head_num, page_size, head_dim)``
(vLLM's CPU block layout per layer), stored as ONE object ``P_h_{tp}_kv``.
"""

import mmap

import pytest
import torch
from raykv.cache_actors.host_pools import HostPool, PoolHandle
from raykv.controllers.contract import PoolName, StorageConfig
from raykv.controllers.deployments import PoolSpec
from raykv.controllers.keys import KeyScheme, is_replicated
from raykv.controllers.pool_layout import PoolLayout


def vllm_layout(**kw) -> PoolLayout:
    args = dict(page_size=16, size=64, layer_num=3, head_num=2, head_dim=8,
                dtype="bfloat16", itemsize=2)
    return PoolLayout.vllm(**(args | kw))


def test_vllm_geometry_one_object_per_block():
    layout = vllm_layout()
    assert layout.objects_per_page == 1
    assert layout.num_pages == 4
    block = 3 * 2 * 16 * 8 * 2  # layers * heads * block_size * head_dim * bytes
    assert layout.object_bytes == block
    assert layout.object_offsets([0, 32]) == [0, 2 * block]
    assert layout.nbytes == 4 * block


def test_vllm_page_view_matches_object_bytes():
    layout = vllm_layout()
    mm = mmap.mmap(-1, layout.nbytes)
    pool = HostPool(PoolHandle("p", "seg", layout), mm, owner=False)
    assert pool.kv_buffer.shape == (4, 3, 2, 16, 8)
    assert pool.kv_buffer.is_contiguous()
    pool.kv_buffer[2, 1].fill_(1.0)  # block 2, layer 1
    raw = pool._bytes.view(torch.bfloat16)
    page = layout.object_bytes // 2
    start = 2 * page + 1 * (2 * 16 * 8)
    assert raw[start:start + 2 * 16 * 8].eq(1).all()
    assert raw.sum().item() == 2 * 16 * 8
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(32, 48))
    assert ptrs == [pool.base_ptr + 2 * layout.object_bytes] and sizes == [layout.object_bytes]
    pool.close()


def test_vllm_keys_are_sharded_single_object():
    scheme = KeyScheme.from_config(StorageConfig(tp_rank=1, tp_size=2, model_name="org/m",
                                             extra_config={"extra_backend_tag": "vllm-tp2"}))
    assert scheme.pool_keys(PoolName.KV, "vllm", ["kv"], "abc") == ["vllm-tp2_org-m_abc_1_kv"]
    assert scheme.suffixes(PoolName.KV, "vllm", ["kv"]) == ["_1_kv"]
    assert not is_replicated(PoolName.KV, "vllm")
    PoolSpec(PoolName.KV, "vllm", ("kv",))  # has a key rule
    with pytest.raises(ValueError, match="no key rule"):
        PoolSpec(PoolName.MAMBA, "vllm", ("kv",))


def test_vllm_layout_refuses_bad_shapes():
    with pytest.raises(ValueError, match="head_num"):
        vllm_layout(head_num=0)
    with pytest.raises(ValueError, match="multiple of page_size"):
        vllm_layout(size=40)
