"""SGLang's own MooncakeStore test module run against ``RayKVStore`` (SGLang venv side).

``sglang/srt/mem_cache/storage/mooncake_store/test_mooncake_store.py`` ships in SGLang's
wheel. Its tests construct ``MooncakeStore(config)`` and a mock host pool (a plain
``torch.randn`` buffer), so two names of that module are swapped here, nothing else:

- ``MooncakeStore`` -> a factory making ``RayKVStore`` of the test's own config, with
  the extra config that joins the test's raykv cluster (``extra``) and a tag of its own;
- ``create_mock_host_kv_cache`` -> SGLang's real ``MHATokenToKVPoolHost`` with
  ``allocator="shm"`` (raykv serves it zero-copy), and as the test's "buffer" a float32
  view of that pool's memory filled with ``randn`` as the mock's was (the pool is
  smaller than the 16M elements the test asks for; it uses the first few thousand).

The test functions run unchanged; ``run`` reports each one's outcome (passed, or the
assertion or error it failed with). Used by ``sglang_driver.py``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

PEER_MODULE = "sglang.srt.mem_cache.storage.mooncake_store.test_mooncake_store"


def run(tests: list[str], extra: dict, make_host: Callable, *,
        patch_store: Callable | None = None) -> dict:
    """Run SGLang's ``tests`` (function names of ``PEER_MODULE``) against ``RayKVStore``
    built with extra config ``extra``; ``make_host()`` builds the host pool;
    ``patch_store(store)`` may change each store before the test uses it (controls).
    Returns ``{test: {"passed": bool, "error": str | None}}``."""
    import importlib

    import torch
    from raykv.integrations.sglang import RayKVStore

    peer = importlib.import_module(PEER_MODULE)
    stores: list = []

    def store_factory(config):
        config.extra_config = dict(extra)
        store = RayKVStore(config, {})
        if patch_store is not None:
            patch_store(store)
        stores.append(store)
        return store

    def host_pool(buffer_size, entries_per_page=2, page_elements=1, dtype=torch.float32):
        host = make_host()
        buffer = host.kv_buffer.view(-1).view(dtype)
        buffer.copy_(torch.randn(buffer.shape, dtype=dtype))
        return host, buffer

    saved = (peer.MooncakeStore, peer.create_mock_host_kv_cache)
    peer.MooncakeStore, peer.create_mock_host_kv_cache = store_factory, host_pool
    out = {}
    try:
        for name in tests:
            try:
                getattr(peer, name)()
                out[name] = {"passed": True, "error": None}
            except Exception as e:
                out[name] = {"passed": False, "error": f"{type(e).__name__}: {e}",
                             "where": traceback.format_exc()[-1500:]}
    finally:
        peer.MooncakeStore, peer.create_mock_host_kv_cache = saved
        for store in stores:
            store.close()
    return out
