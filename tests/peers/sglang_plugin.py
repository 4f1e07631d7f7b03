"""pytest plugin: SGLang 0.5.23's own storage-backend tests against raykv (``-p
sglang_plugin`` in a pytest run of the SGLang venv; ``test_sglang_peers.py`` starts it).

``sglang/srt/mem_cache/storage/mooncake_store/test_mooncake_store.py`` (in SGLang's
wheel) tests the HiCache storage contract through ``MooncakeStore`` and a mock host pool.
Swapped at run time, in that module only (its file is not changed):

- ``MooncakeStore`` -> ``RayKVStore`` of the test's own ``HiCacheStorageConfig``, with the
  extra config that joins the peer cluster (``RAYKV_PEER_RAY_ADDRESS``,
  ``RAYKV_PEER_NAMESPACE``, ``RAYKV_PEER_NODE_ID``) and a key tag of its own per test;
- ``create_mock_host_kv_cache`` -> SGLang's real host pool of the mock's page geometry,
  allocated with ``allocator="shm"`` (raykv serves it zero-copy), and as the test's
  "buffer" a float32 view of that pool's memory filled with ``randn`` as the mock's
  was: an MLA pool (``MLATokenToKVPoolHost``, ``page_first``: one page is one
  contiguous range, as in the mock) for one entry per page, an MHA pool
  (``MHATokenToKVPoolHost``, ``page_first``) for two;
- the ``config`` argument of ``test_batch_operation`` (the module calls it by hand from
  ``__main__``): a fixture over the module's own MLA configs (TP 1 rank 0, TP 8 rank 3).
  Its MHA configs do not apply: the mock puts a page's K and V side by side, while
  every SGLang MHA host pool holds all K before all V, so the test's flat-buffer
  comparison cannot hold for a real pool.
"""

from __future__ import annotations

import os
import uuid

import pytest

PEER_FILE = "sglang/srt/mem_cache/storage/mooncake_store/test_mooncake_store.py"
PAGES = 64  # pages of each host pool (the tests use up to 26)


def _extra() -> dict:
    return {"ray_address": os.environ["RAYKV_PEER_RAY_ADDRESS"],
            "namespace": os.environ["RAYKV_PEER_NAMESPACE"],
            "ray_node_id": os.environ["RAYKV_PEER_NODE_ID"], "allocator": "shm",
            "extra_backend_tag": f"peer-{uuid.uuid4().hex[:8]}"}


def _host_pool(entries_per_page: int, page_elements: int, dtype):
    """SGLang's real host pool of one-token pages of ``entries_per_page`` x
    ``page_elements`` values of ``dtype`` (one layer), shm-allocated."""
    if entries_per_page == 1:
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        rope = 64
        dev = MLATokenToKVPool(size=PAGES, page_size=1, dtype=dtype,
                               kv_lora_rank=page_elements - rope, qk_rope_head_dim=rope,
                               layer_num=1, device="cpu", enable_memory_saver=False)
        return MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, 1,
                                    "page_first", pin_memory=False, device="cpu",
                                    allocator_type="shm", device_capacity_tokens=dev.size,
                                    start_layer=0, end_layer=0, target_layer_num=1)
    if entries_per_page == 2:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        dev = MHATokenToKVPool(size=PAGES, page_size=1, dtype=dtype, head_num=1,
                               head_dim=page_elements, layer_num=1, device="cpu",
                               enable_memory_saver=False)
        return MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, 1,
                                    "page_first", pin_memory=False, device="cpu",
                                    allocator_type="shm", device_capacity_tokens=dev.size,
                                    start_layer=0, end_layer=0)
    raise AssertionError(f"no SGLang host pool has {entries_per_page} entries per page")


_stores: list = []


def _swap(peer) -> None:
    """Swap the names of the test module ``peer`` (the module object pytest imported)."""
    import torch
    from raykv.integrations.sglang import RayKVStore

    def store(config):
        config.extra_config = _extra()
        s = RayKVStore(config, None)
        _stores.append(s)
        return s

    def create_mock_host_kv_cache(buffer_size, entries_per_page=2, page_elements=1,
                                  dtype=torch.float32):
        host = _host_pool(entries_per_page, page_elements, dtype)
        buffer = host.kv_buffer.view(-1).view(dtype)
        buffer.copy_(torch.randn(buffer.shape, dtype=dtype))
        return host, buffer

    peer.MooncakeStore = store
    peer.create_mock_host_kv_cache = create_mock_host_kv_cache


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for module in {id(i.module): i.module for i in items}.values():
        if module.__file__.endswith(PEER_FILE):
            _swap(module)


@pytest.fixture(params=[(0, 1), (3, 8)], ids=["mla-tp1-rank0", "mla-tp8-rank3"])
def config(request):
    """``test_batch_operation``'s config: the module's own MLA configs."""
    rank, size = request.param
    return request.module.make_hicache_storage_config(is_mla_model=True, tp_rank=rank, tp_size=size)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    try:
        return (yield)
    finally:
        for s in _stores:
            s.close()
        _stores.clear()
