"""SGLang-side driver of the SGLang integration tests; run with the SGLang venv's python.

It builds SGLang 0.5.23's own device and host pools on CPU and its
``HybridCacheController`` with ``storage_backend="dynamic"`` loading
``raykv.integrations.sglang.RayKVStore``, joins the raykv cluster of the test (GCS
address, namespace, node id from the spec), and runs the spec's steps through SGLang's
own prefetch / prefetch-IO / backup threads. Page bytes are a function of (seed, page
hash, TP rank), so a reader on another node knows what it must find.

Usage: ``python sglang_driver.py SPEC.json`` -> one JSON object on the last stdout line.
Spec: ``ray_address, namespace, node_id, tp_rank, tp_size, gloo_port, scenarios`` where
each scenario has ``name, model (mha | mla | hybrid), allocator, model_name, steps``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import time
import traceback

logging.basicConfig(level=logging.WARNING,
                    format="%(levelname)s %(threadName)s %(name)s: %(message)s")

PAGE = 16
LAYERS = 2
SIZE = 1024


class WarningCounter(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        if record.name.startswith("raykv"):
            self.messages.append(record.getMessage())


WARNINGS = WarningCounter()
logging.getLogger().addHandler(WARNINGS)


def page_tensor(seed: str, key: str, rank: int, shape, dtype):
    import torch

    h = int.from_bytes(hashlib.sha256(f"{seed}|{key}|{rank}".encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(h & ((1 << 63) - 1))
    return torch.randn(shape, generator=g).to(dtype)


class Engine:
    """One SGLang cache controller over SGLang's real host pools."""

    def __init__(self, spec: dict, sc: dict, group):
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
        from sglang.srt.mem_cache.pool_host.group import HostPoolGroup

        self.torch = torch
        self.sc = sc
        self.rank = spec["tp_rank"]
        alloc_type = sc.get("allocator", "shm")
        model = sc["model"]
        dtype = torch.bfloat16
        if model == "mla":
            from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
            from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

            kv = MLATokenToKVPool(size=SIZE, page_size=PAGE, dtype=dtype, kv_lora_rank=64,
                                  qk_rope_head_dim=32, layer_num=LAYERS, device="cpu",
                                  enable_memory_saver=False)
            info = kv.get_device_pool_infos()[0].buffer_info
            host = MLATokenToKVPoolHost(info, 2.0, 0, PAGE, "page_first", pin_memory=False,
                                        device="cpu", allocator_type=alloc_type,
                                        device_capacity_tokens=kv.size, start_layer=0,
                                        end_layer=LAYERS - 1, target_layer_num=LAYERS)
        else:
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
            from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

            kv = MHATokenToKVPool(size=SIZE, page_size=PAGE, dtype=dtype, head_num=2,
                                  head_dim=64, layer_num=LAYERS, device="cpu",
                                  enable_memory_saver=False)
            info = kv.get_device_pool_infos()[0].buffer_info
            host = MHATokenToKVPoolHost(info, 2.0, 0, PAGE, sc.get("layout", "page_first"),
                                        pin_memory=False, device="cpu",
                                        allocator_type=alloc_type,
                                        device_capacity_tokens=kv.size, start_layer=0,
                                        end_layer=LAYERS - 1)
        alloc = PagedTokenToKVPoolAllocator(SIZE, PAGE, dtype, "cpu", kv, need_sort=False)
        mapping = {i: i for i in range(LAYERS)}
        entries = [build_pool_entry(name=PoolName.KV, host_pool=host, device_pool=kv,
                                    layer_mapping=mapping, transfer_layer_id_max=LAYERS,
                                    is_anchor=True)]
        self.mamba = None
        if model == "hybrid":
            from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
            from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

            minfo = MambaStateBufferInfo(temporal=torch.zeros(2, 8, 4, 16, 16),
                                         conv=(torch.zeros(2, 8, 3, 64, dtype=dtype),))
            self.mamba = MambaPoolHost(minfo, 2.0, 0, device_capacity=8, pin_memory=False,
                                       allocator_type=alloc_type, layout="page_first")
            entries.append(build_pool_entry(name=PoolName.MAMBA, host_pool=self.mamba,
                                            device_pool=None, layer_mapping=mapping,
                                            transfer_layer_id_max=LAYERS))
        self.host = host
        self.group = HostPoolGroup(entries)
        if sc.get("backend") == "mooncake":  # SGLang's built-in MooncakeStore
            backend = "mooncake"
            extra = {"interface_v1": 1, **sc["mooncake"]}
        else:
            backend = "dynamic"
            extra = {"backend_name": "raykv", "module_path": "raykv.integrations.sglang",
                     "class_name": "RayKVStore", "interface_v1": 1, "allocator": alloc_type,
                     "ray_address": spec["ray_address"], "ray_namespace": spec["namespace"],
                     "ray_node_id": spec["node_id"], **sc.get("extra", {})}
        t = time.time()
        self.cc = HybridCacheController(
            alloc, self.group, PAGE, group, threading.Event(), io_backend="direct",
            storage_backend=backend, prefetch_threshold=PAGE,
            model_name=sc["model_name"], storage_backend_extra_config=extra,
            transfer_layer_id_max=LAYERS)
        self.attach_s = time.time() - t
        self.backend = self.cc.storage_backend

    # ------------------------------------------------------------ page bytes
    def kv_page_shape(self):
        buf = self.host.kv_buffer
        return (2, PAGE, *buf.shape[2:]) if buf.dim() == 5 else (PAGE, *buf.shape[1:])

    def kv_view(self, slots):
        buf = self.host.kv_buffer
        return buf[:, slots] if buf.dim() == 5 else buf[slots]

    def fill_kv(self, seed, hashes, slots):
        torch = self.torch
        pages = [page_tensor(seed, h, self.rank, self.kv_page_shape(), self.host.dtype)
                 for h in hashes]
        if self.host.kv_buffer.dim() == 5:
            data = torch.cat(pages, dim=1)
        else:
            data = torch.cat(pages, dim=0)
        if self.host.kv_buffer.dim() == 5:
            self.host.kv_buffer[:, slots] = data
        else:
            self.host.kv_buffer[slots] = data

    def kv_matches(self, seed, hashes, slots) -> list[bool]:
        out = []
        for i, h in enumerate(hashes):
            want = page_tensor(seed, h, self.rank, self.kv_page_shape(), self.host.dtype)
            got = self.kv_view(slots[i * PAGE:(i + 1) * PAGE])
            out.append(bool(self.torch.equal(got, want)))
        return out

    def mamba_bufs(self):
        return [b for b in self.mamba.get_hybrid_pool_buffer() if b.numel() > 0]

    def fill_mamba(self, seed, key, slot):
        for i, b in enumerate(self.mamba_bufs()):
            b[slot] = page_tensor(seed, f"{key}|m{i}", self.rank, b[slot].shape, b.dtype)

    def mamba_matches(self, seed, key, slot) -> bool:
        return all(bool(self.torch.equal(
            b[slot], page_tensor(seed, f"{key}|m{i}", self.rank, b[slot].shape, b.dtype)))
            for i, b in enumerate(self.mamba_bufs()))

    # ----------------------------------------------------------------- steps
    def tokens(self, seed, n_pages):
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        base = int(hashlib.sha256(seed.encode()).hexdigest()[:6], 16) * 10
        toks = list(range(base, base + n_pages * PAGE))
        return toks, get_storage_hash_str(toks, None, page_size=PAGE)

    def write(self, step) -> dict:
        """Back up pages ``pages`` (indices into the prompt) of a prompt of ``n_pages``;
        with ``mamba``: Mamba states after those prefix lengths, one backup each."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        seed = step["seed"]
        toks, hashes = self.tokens(seed, step["n_pages"])
        pages = step.get("pages", list(range(step["n_pages"])))
        runs, run = [], []
        for p in pages:
            if run and p != run[-1] + 1:
                runs.append(run)
                run = []
            run.append(p)
        if run:
            runs.append(run)
        completed = []
        for run in runs:
            hidx = self.group.alloc(len(run) * PAGE)
            sel = [hashes[p] for p in run]
            self.fill_kv(seed, sel, hidx)
            rtoks = toks[run[0] * PAGE:(run[-1] + 1) * PAGE]
            self.cc.write_storage(hidx, rtoks, hash_value=sel)
            completed.append(self.cc.ack_backup_queue.get(timeout=60).completed_tokens)
        for n in step.get("mamba", []):
            slot = self.group.alloc(1, pool=PoolName.MAMBA)
            self.fill_mamba(seed, hashes[n - 1], int(slot[0]))
            # One page of KV with the state after it (the page exists already: put-if-absent).
            hidx = self.group.alloc(PAGE)
            self.fill_kv(seed, [hashes[n - 1]], hidx)
            self.cc.write_storage(
                hidx, toks[(n - 1) * PAGE:n * PAGE], hash_value=[hashes[n - 1]],
                extra_pools=[PoolTransfer(name=PoolName.MAMBA, host_indices=slot,
                                          keys=[hashes[n - 1]],
                                          hit_policy=PoolHitPolicy.TRAILING_PAGES)])
            ack = self.cc.ack_backup_queue.get(timeout=60)
            completed.append((ack.completed_tokens, str(ack.pool_storage_result)))
        return {"completed": completed}

    def prefetch(self, step) -> dict:
        """SGLang's prefetch of a prompt of ``n_pages``: hit query on the prefetch thread,
        then the load on the prefetch-IO thread; bytes compared with what the writer
        wrote."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        seed = step["seed"]
        toks, hashes = self.tokens(seed, step["n_pages"])
        extra = None
        if self.mamba is not None:
            extra = [PoolTransfer(name=PoolName.MAMBA, keys=[hashes[-1]],
                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        rid = f"{step.get('rid', seed)}-{time.time_ns()}"
        op = self.cc.prefetch(CacheRequestHandle(rid=rid, attempt_id=0), toks, None,
                              extra_pools=extra)
        op = self.cc.prefetch_hit_queue.get(timeout=60)
        hit_tokens = op.storage_hit_count
        res = {"hit_tokens": hit_tokens, "hit_pages": hit_tokens // PAGE,
               "query_pool_hit_pages": {str(k): v for k, v in
                                        (op.query_pool_hit_pages or {}).items()}}
        if hit_tokens == 0:
            res.update(loaded_pages=0, kv_match=[], mamba_match=None)
            return res
        op.host_indices = self.group.alloc(hit_tokens)
        mslot = None
        if self.mamba is not None:
            mslot = self.group.alloc(1, pool=PoolName.MAMBA)
            for t in op.pool_transfers or []:
                if t.name == PoolName.MAMBA:
                    t.host_indices = mslot
        self.cc.prefetch_buffer.put(op)
        acks = []
        while True:
            a = self.cc.ack_prefetch_queue.get(timeout=60)
            acks.append([a.completed_tokens, str(a.pool_hits), a.completed_req])
            if a.completed_req:
                break
        loaded = max((a[0] or 0) for a in acks) // PAGE
        res["acks"] = acks
        res["loaded_pages"] = loaded
        res["kv_match"] = self.kv_matches(seed, hashes[:loaded], op.host_indices.tolist())
        if mslot is not None and loaded:
            res["mamba_match"] = self.mamba_matches(seed, hashes[loaded - 1], int(mslot[0]))
        return res

    def exists_v2(self, step) -> dict:
        """The backend's own v2 answer (as SGLang's prefetch thread asks it)."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        _, hashes = self.tokens(step["seed"], step["n_pages"])
        extra = []
        if self.mamba is not None:
            extra = [PoolTransfer(name=PoolName.MAMBA, keys=[hashes[-1]],
                                  hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        r = self.backend.batch_exists_v2(hashes, extra)
        local = self.backend.client.batch_exists(hashes)
        return {"kv_hit_pages": r.kv_hit_pages,
                "restorable": list(r.restorable_prefix_pages or []),
                "extra": {str(k): v for k, v in r.extra_pool_hit_pages.items()},
                "group_v1": self.backend.batch_exists(hashes), "rank_local_v1": local}

    def kill_node_actor(self, step) -> dict:
        import ray
        from raykv.controllers.naming import node_actor_name

        actor = ray.get_actor(node_actor_name(self.backend.client.node_id),
                              namespace=self.backend._namespace)
        ray.kill(actor, no_restart=False)
        return {"killed": True}

    def barrier(self, step) -> dict:
        import torch.distributed as dist

        dist.barrier()
        return {}

    def wait_healthy(self, step) -> dict:
        """Wait until this node's cache actor answers again (Ray restarts it)."""
        t = time.time()
        while time.time() - t < step.get("s", 120):
            try:
                if self.backend.client.health()["store_healthy"]:
                    return {"waited_s": round(time.time() - t, 1)}
            except Exception:
                pass
            time.sleep(0.5)
        return {"waited_s": None}

    def wait(self, step) -> dict:
        time.sleep(step["s"])
        return {}

    def stats(self, step) -> dict:
        be = self.backend
        st = be.raykv_stats()
        node = be.client.stats()
        st["node_pools"] = {n: {"kind": p["kind"], "bytes": p["bytes"]}
                            for n, p in node["pools"].items()}
        st["sglang_fds"] = {}
        for name, pool in [("kv", self.host)] + ([("mamba", self.mamba)] if self.mamba else []):
            fds = list(getattr(getattr(pool, "allocator", None), "fds", []) or [])
            st["sglang_fds"][name] = [[os.getpid(), fd, os.readlink(f"/proc/self/fd/{fd}"),
                                       os.fstat(fd).st_size] for fd in fds]
        return st

    def threads(self) -> dict:
        cc = self.cc
        return {n: t.is_alive() for n, t in (
            ("prefetch", cc.prefetch_thread), ("prefetch_io", cc.prefetch_io_aux_thread),
            ("backup", cc.backup_thread))}


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    group = None
    if spec.get("tp_size", 1) > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['gloo_port']}",
                                rank=spec["tp_rank"], world_size=spec["tp_size"])
        group = dist.group.WORLD
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0,
                                        tp_rank=spec["tp_rank"], tp_size=spec["tp_size"],
                                        pp_rank=0, pp_size=1)
    out = {"scenarios": {}}
    for sc in spec["scenarios"]:
        try:
            eng = Engine(spec, sc, group)
        except Exception as e:  # SGLang fails the attach: report what it said
            out["scenarios"][sc["name"]] = {"attach_error": f"{type(e).__name__}: {e}",
                                            "warnings": list(WARNINGS.messages)}
            WARNINGS.messages.clear()
            continue
        res = {"attach_s": eng.attach_s, "backend": type(eng.backend).__name__, "steps": []}
        for step in sc["steps"]:
            try:
                res["steps"].append(getattr(eng, step["op"])(step))
            except Exception as e:  # a failed step is reported, the rest still runs
                res["steps"].append({"error": repr(e),
                                     "where": traceback.format_exc()[-1500:]})
        res["threads"] = eng.threads()
        res["warnings"] = list(WARNINGS.messages)
        WARNINGS.messages.clear()
        eng.cc.detach_storage_backend()
        out["scenarios"][sc["name"]] = res
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
