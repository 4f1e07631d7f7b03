"""SGLang side of ``raykv bench --engine sglang``; run by a python with SGLang installed.

``python -m raykv_lab.bench.sglang_runner SPEC.json`` prints one JSON line: per page
size, the seconds each timed SGLang operation took through ``RayKVStore`` and through
SGLang's built-in ``MooncakeStore``. The caller (``lab.bench.sglang``) starts the
raykv cluster, runs this in SGLang's environment and turns the seconds into GB/s. Only
SGLang's environment runs this module; it imports SGLang inside its functions.

Per page size, one SGLang MHA device pool and one ``MHATokenToKVPoolHost`` (``page_first``,
``allocator: shm``, 64-token pages of 2 heads x 128 bf16 per layer, so K + V of one layer
of one page are 64 KiB and a page of ``n`` x 64 KiB has ``n`` layers; each page is two
objects, K and V). The host pool holds ``2 * batch`` pages: the first half is what
backups read, the second what prefetches fill. Two ``HybridCacheController`` run over
that one host pool group, ``storage_backend="dynamic"`` (``RayKVStore``, through the
node actor of ``spec["node_id"]``) and ``"mooncake"`` (``MooncakeStore``, a Mooncake
client in this process that contributes no segment), so both move the same bytes from
and to the same memory into the same store. Per iteration and backend, on a fresh prompt
of ``batch`` pages:

- **write**: ``write_storage`` of the prompt's pages until SGLang's backup ack (the
  backup thread's put-if-absent check and put, in one 128-page chunk);
- **prefetch**: ``prefetch`` of the same prompt until the completed ack: the hit query
  on the prefetch thread (``batch_exists``), then the load on the prefetch-IO thread
  (``batch_get_v1``); ``load`` is the part from handing the operation to the IO thread.

The two backends take turns going first. One untimed warm-up iteration checks that every
page loaded back equals the page written, on both backends. Every iteration ends with a
forced remove of what it wrote, so the store never fills. Any failed page stops the run
with an error.

Spec keys: ``ray_address, namespace, node_id, mooncake`` (MooncakeStore's extra config),
``page_sizes, batch, iters, run_id``, ``staging_pages`` (RayKVStore's, when it stages).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from raykv_lab.bench.toolkit import check_codes, mooncake_wheel

PAGE_TOKENS = 64
HEADS = 2
HEAD_DIM = 128
LAYER_PAGE_BYTES = 2 * PAGE_TOKENS * HEADS * HEAD_DIM * 2   # K + V of one layer, bf16
BACKENDS = ("raykv", "mooncake")
ACK_TIMEOUT_S = 300


class Bench:
    """One page size: SGLang's pools and one controller per backend over them."""

    def __init__(self, spec: dict, page_bytes: int) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        if page_bytes % LAYER_PAGE_BYTES:
            raise ValueError(f"page size {page_bytes} is not a multiple of "
                             f"{LAYER_PAGE_BYTES} bytes (K + V of one layer of one page)")
        self.torch = torch
        self.batch = batch = spec["batch"]
        self.layers = layers = page_bytes // LAYER_PAGE_BYTES
        mapping = {i: i for i in range(layers)}
        # The device pool only describes the geometry (SGLang builds host pools from it).
        device = MHATokenToKVPool(size=PAGE_TOKENS, page_size=PAGE_TOKENS, dtype=torch.bfloat16,
                                  head_num=HEADS, head_dim=HEAD_DIM, layer_num=layers,
                                  device="cpu", enable_memory_saver=False)
        info = device.get_device_pool_infos()[0].buffer_info
        self.host = MHATokenToKVPoolHost(
            info, 1.0, 0, PAGE_TOKENS, "page_first", pin_memory=False, device="cpu",
            allocator_type="shm", device_capacity_tokens=device.size, start_layer=0,
            end_layer=layers - 1, host_token_capacity=2 * batch * PAGE_TOKENS)
        alloc = PagedTokenToKVPoolAllocator(PAGE_TOKENS, PAGE_TOKENS, torch.bfloat16, "cpu",
                                            device, need_sort=False)
        self.group = HostPoolGroup([build_pool_entry(
            name=PoolName.KV, host_pool=self.host, device_pool=device, layer_mapping=mapping,
            transfer_layer_id_max=layers, is_anchor=True)])
        n = batch * PAGE_TOKENS
        self.src = self.group.alloc(n)
        self.dst = self.group.alloc(n)
        self.bytes = self.host.kv_buffer.view(torch.uint8)   # (2, slots, L, H, 2 * D)
        self.bytes.random_(0, 256)
        configs = {
            "raykv": ("dynamic", {
                "backend_name": "raykv", "module_path": "raykv.integrations.sglang",
                "class_name": "RayKVStore", "interface_v1": 1, "allocator": "shm",
                "ray_address": spec["ray_address"], "ray_namespace": spec["namespace"],
                "ray_node_id": spec["node_id"],
                **({"staging_pages": spec["staging_pages"]} if spec.get("staging_pages")
                   else {})}),
            "mooncake": ("mooncake", {"interface_v1": 1, **spec["mooncake"]}),
        }
        self.cc: dict[str, Any] = {}
        for name, (backend, extra) in configs.items():
            self.cc[name] = HybridCacheController(
                alloc, self.group, PAGE_TOKENS, None, threading.Event(), io_backend="direct",
                storage_backend=backend, prefetch_threshold=PAGE_TOKENS,
                model_name=f"raykv-bench-sglang-{spec['run_id']}",
                storage_backend_extra_config=extra, transfer_layer_id_max=layers)
        self.store = self.cc["raykv"].storage_backend

    def prompt(self, base: int) -> tuple[list[int], list[str]]:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        toks = list(range(base, base + self.batch * PAGE_TOKENS))
        return toks, get_storage_hash_str(toks, None, page_size=PAGE_TOKENS)

    def write(self, name: str, toks: list[int], hashes: list[str]) -> float:
        """Seconds of SGLang's ``write_storage`` of the prompt until its backup ack."""
        cc = self.cc[name]
        t0 = time.perf_counter()
        cc.write_storage(self.src, toks, hash_value=hashes)
        ack = cc.ack_backup_queue.get(timeout=ACK_TIMEOUT_S)
        t = time.perf_counter() - t0
        if ack.completed_tokens != len(toks):
            raise RuntimeError(f"{name}: the backup stored {ack.completed_tokens} of "
                               f"{len(toks)} tokens")
        return t

    def prefetch(self, name: str, toks: list[int], rid: str) -> tuple[float, float]:
        """(seconds of the whole prefetch, seconds of its load) of the prompt into the
        destination half: SGLang's hit query, then its load, until the completed ack."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        cc = self.cc[name]
        t0 = time.perf_counter()
        cc.prefetch(CacheRequestHandle(rid=rid, attempt_id=0), toks, None)
        op = cc.prefetch_hit_queue.get(timeout=ACK_TIMEOUT_S)
        if op.storage_hit_count != len(toks):
            raise RuntimeError(f"{name}: the prefetch query found {op.storage_hit_count} of "
                               f"{len(toks)} tokens")
        op.host_indices = self.dst
        t1 = time.perf_counter()
        cc.prefetch_buffer.put(op)
        done = 0
        while True:
            ack = cc.ack_prefetch_queue.get(timeout=ACK_TIMEOUT_S)
            done = max(done, ack.completed_tokens or 0)
            if ack.completed_req:
                break
        t2 = time.perf_counter()
        if done != len(toks):
            raise RuntimeError(f"{name}: the prefetch loaded {done} of {len(toks)} tokens")
        return t2 - t0, t2 - t1

    def remove(self, hashes: list[str]) -> None:
        """Force-remove every object of ``hashes`` (both backends use the same keys)."""
        keys = [k for h in hashes for k in self.store.client.key_scheme.kv_keys(h)]
        check_codes("batch_remove",
                    self.cc["mooncake"].storage_backend.store.batch_remove(keys, True),
                    lambda c: c == 0)

    def pages(self, slots) -> list:
        """Each page of ``slots`` (token slots, page-aligned runs) as a byte view."""
        return [self.bytes[:, s:s + PAGE_TOKENS] for s in slots[::PAGE_TOKENS].tolist()]

    def run(self, iters: int, base: int) -> dict:
        times: dict[str, list[float]] = {f"{b}_{op}": [] for b in BACKENDS
                                         for op in ("write", "prefetch", "load")}
        for it in range(iters + 1):
            order = BACKENDS if it % 2 == 0 else BACKENDS[::-1]
            written = []
            for b in order:
                first = base + (2 * it + BACKENDS.index(b)) * self.batch * PAGE_TOKENS
                toks, hashes = self.prompt(first)
                written += hashes
                if it == 0:
                    for page in self.pages(self.dst):
                        page.zero_()
                t_write = self.write(b, toks, hashes)
                t_prefetch, t_load = self.prefetch(b, toks, f"{b}-{it}-{base}")
                if it == 0:
                    if not all(self.torch.equal(x, y) for x, y in
                               zip(self.pages(self.src), self.pages(self.dst), strict=True)):
                        raise RuntimeError(f"{b}: the pages loaded back differ from the "
                                           "pages written")
                else:
                    times[f"{b}_write"].append(t_write)
                    times[f"{b}_prefetch"].append(t_prefetch)
                    times[f"{b}_load"].append(t_load)
            self.remove(written)
        return times

    def close(self) -> dict:
        stats = self.store.raykv_stats()
        for cc in self.cc.values():
            cc.detach_storage_backend()
        return stats


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0,
                                        tp_size=1, pp_rank=0, pp_size=1)
    import sglang
    import torch

    out: dict[str, Any] = {"sglang": sglang.__version__, "sizes": [], "environment": {
        "torch": torch.__version__, "python": sys.version.split()[0],
        "mooncake": mooncake_wheel()[1]}}
    base = int(spec["run_id"], 16) % (1 << 40)
    for i, page_bytes in enumerate(spec["page_sizes"]):
        t = time.perf_counter()
        bench = Bench(spec, page_bytes)
        attach_s = time.perf_counter() - t
        try:
            times = bench.run(spec["iters"], base + i * (1 << 30))
        finally:
            stats = bench.close()
        out["sizes"].append({
            "page_bytes": page_bytes, "object_bytes": page_bytes // 2, "layers": bench.layers,
            "batch": bench.batch, "attach_s": attach_s, "times": times,
            "raykv_zero_copy": stats["pools"]["kv"]["zero_copy"], "raykv_mode": stats["mode"],
            "raykv_staged_bytes": stats["counters"].get("staged_bytes", 0)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
