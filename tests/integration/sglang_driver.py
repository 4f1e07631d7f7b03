"""SGLang-side driver of the SGLang integration tests; run with the SGLang venv's python.

It builds SGLang 0.5.23's own device and host pools on CPU and its
``HybridCacheController`` with ``storage_backend="dynamic"`` loading
``raykv.integrations.sglang.RayKVStore`` (or ``"mooncake"``: SGLang's built-in
``MooncakeStore``), joins the raykv cluster of the test (GCS address, namespace, node id
from the spec), and runs the spec's steps through SGLang's own prefetch / prefetch-IO /
backup threads. Page bytes are a function of (seed, page hash, pool, TP rank), so a reader
on another node knows what it must find; every load lands in slots first filled with
noise, so a page reported loaded but not written fails the byte check.

Models (``model``), each SGLang's own classes on ``device="cpu"``:

- ``mha`` / ``mla``: one KV host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``);
- ``hybrid``: MHA KV + ``MambaPoolHost`` (Mamba state after a page, ``trailing_pages``);
- ``swa``: MHA full-attention KV + an SWA host pool (an ``MHATokenToKVPoolHost`` of its own
  device pool, as ``build_hybrid_swa_group`` makes it) whose window of ``SWA_WINDOW``
  pages is backed up and loaded as SGLang's SWA component does (``trailing_pages``; the
  prefetch query carries ``SWA_WINDOW`` placeholder keys, SGLang re-aligns them to the
  hit);
- ``dsa``: ``DSATokenToKVPool`` (64-token pages) with its MLA host pool and SGLang's
  ``DSAIndexerPoolHost`` as the ``indexer`` sidecar (``indices_from_pool=KV``);
- ``draft``: MHA KV + a draft model's MHA host pool registered after attach through
  ``register_host_pool_entry`` as ``build_full_draft_pools`` does, the ``draft`` sidecar
  (``indices_from_pool=KV``).

Deadline steps (``test_sglang_deadlines.py``): ``stop_node_actor`` / ``cont_node_actor``
(SIGSTOP / SIGCONT this backend's node actor), ``logged`` (another step with every
backend data call timed, ``CallLog``; optionally stopping the actor between SGLang's hit
query and its load), ``until_hit``, ``store_delay`` (slow store calls),
``until_breaker_admits``, ``slow_runs`` (group answers carrying slow ``load_runs``:
the load guard's tests, ``test_sglang_guard.py``), ``reuse`` (the last write's or load's
host pages given to other bytes) and ``old_return`` (a control: failed calls return
whatever runs).
Close steps (``test_sglang_close.py``): ``close_during_backup`` (the backend closed
while SGLang's backup thread is in a store call), ``close_during_copy`` (closed while the
backend copies pages through its staging pool) and ``read_back`` (every object of a
prompt that exists, read by a fresh backend and compared byte for byte).

Contract steps (``test_sglang_contract.py``): ``trio`` (``set`` / ``exists`` / ``get``
of one object), ``legacy_batch_get`` (the pointer API's page count), ``clear`` (SGLang's
own ``clear_storage_backend``) and ``peer_tests`` (SGLang's ``test_mooncake_store``
functions against ``RayKVStore``, ``sglang_peer``).

Usage: ``python sglang_driver.py SPEC.json`` -> one JSON object on the last stdout line.
Spec: ``ray_address, namespace, node_ids, node (default node index), tp_rank, tp_size,
gloo_port, scenarios`` where each scenario has ``name, model, allocator, model_name,
steps`` and optionally ``node`` (serve through that node's actor), ``backend``
(``mooncake``) with ``mooncake`` (its config), ``extra`` (extra-config keys), ``layout``
and ``env`` (environment set while SGLang builds the backend, e.g.
``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE``).
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
from collections import Counter

START = time.perf_counter()
logging.basicConfig(level=logging.WARNING,
                    format="%(levelname)s %(threadName)s %(name)s: %(message)s")

PAGE = 16
DSA_PAGE = 64            # DSATokenToKVPool requires 64-token pages
LAYERS = 2
SIZE = 1024
SWA_WINDOW = 2           # SWA pages per window (sliding window / page size)
INJECTOR_LOG = "sglang.srt.mem_cache.hicache_storage"


class WarningCounter(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        if record.name.startswith("raykv"):
            self.messages.append(record.getMessage())


class InjectionCounter(logging.Handler):
    """Counts the failures SGLang's ``HiCacheStorageFailureInjector`` injected, per call."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.calls: Counter[str] = Counter()

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Inject failure in "):
            self.calls[msg.removeprefix("Inject failure in ")] += 1


WARNINGS = WarningCounter()
logging.getLogger().addHandler(WARNINGS)
INJECTED = InjectionCounter()
_injector_log = logging.getLogger(INJECTOR_LOG)
_injector_log.setLevel(logging.DEBUG)
_injector_log.propagate = False
_injector_log.addHandler(INJECTED)


def page_tensor(seed: str, key: str, rank: int, shape, dtype):
    import torch

    h = int.from_bytes(hashlib.sha256(f"{seed}|{key}|{rank}".encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(h & ((1 << 63) - 1))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(dtype)


def noise(shape, dtype):
    """Random bytes that no page of any seed equals (a fresh, unseeded draw)."""
    import torch

    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0, 256, shape, dtype=torch.uint8).to(dtype)


class CallLog:
    """Every data call SGLang's threads make on the backend (wrapped on ``store``, inside
    any fault injector): the call, SGLang's thread, its seconds (None while it runs),
    a summary of what it returned, or what it raised into SGLang."""

    CALLS = ("batch_exists", "batch_exists_v2", "batch_get_v1", "batch_get_v2",
             "batch_set_v1", "batch_set_v2")

    def __init__(self, store) -> None:
        self.calls: list[dict] = []
        self._lock = threading.Lock()
        for name in self.CALLS:
            setattr(store, name, self._wrap(name, getattr(store, name)))

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            rec = {"call": name, "thread": threading.current_thread().name, "seconds": None}
            with self._lock:
                self.calls.append(rec)
            t = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            except BaseException as e:
                rec["raised"] = repr(e)
                raise
            finally:
                rec["seconds"] = round(time.perf_counter() - t, 3)
            rec["result"] = summary(out)
            return out
        return call

    def since(self, n: int) -> list[dict]:
        with self._lock:
            return [dict(c) for c in self.calls[n:]]


def summary(out):
    """A backend call's result as JSON: a count, a list of bools, ``{pool: bools}``, or a
    ``PoolTransferResult``'s KV hit."""
    if isinstance(out, dict):
        return {str(getattr(k, "value", k)): [bool(v) for v in vs] for k, vs in out.items()}
    if isinstance(out, list):
        return [bool(v) for v in out]
    if hasattr(out, "kv_hit_pages"):
        return {"kv_hit_pages": out.kv_hit_pages}
    return out


def mha_device_pool(layers: int, page: int):
    """SGLang's MHA device pool of the tests (bfloat16, 2 heads of 64, on CPU)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=SIZE, page_size=page, dtype=torch.bfloat16, head_num=2,
                            head_dim=64, layer_num=layers, device="cpu",
                            enable_memory_saver=False)


def mha_host_pool(device_pool, page: int, alloc_type: str, layout: str = "page_first",
                  capacity=None):
    """SGLang's MHA host pool of ``device_pool`` (twice its size unless ``capacity``)."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    info = device_pool.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                allocator_type=alloc_type,
                                device_capacity_tokens=device_pool.size, start_layer=0,
                                end_layer=device_pool.layer_num - 1,
                                host_token_capacity=capacity)


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
        self.node_ids = spec["node_ids"]
        self.last_hidx = None  # host slots of the last write run or prefetch load
        alloc_type = sc.get("allocator", "shm")
        model = sc["model"]
        self.page = page = DSA_PAGE if model == "dsa" else PAGE
        dtype = torch.bfloat16
        mapping = {i: i for i in range(LAYERS)}

        def mha_pool(layers: int):
            return mha_device_pool(layers, page)

        def mha_host(device_pool, layout="page_first", capacity=None):
            return mha_host_pool(device_pool, page, alloc_type, layout, capacity)

        if model in ("mla", "dsa"):
            from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool
            from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

            if model == "dsa":
                kv = DSATokenToKVPool(size=SIZE, page_size=page, kv_lora_rank=64, dtype=dtype,
                                      qk_rope_head_dim=32, layer_num=LAYERS, device="cpu",
                                      index_head_dim=128, enable_memory_saver=False,
                                      kv_cache_dim=96)
            else:
                kv = MLATokenToKVPool(size=SIZE, page_size=page, dtype=dtype, kv_lora_rank=64,
                                      qk_rope_head_dim=32, layer_num=LAYERS, device="cpu",
                                      enable_memory_saver=False)
            info = kv.get_device_pool_infos()[0].buffer_info
            host = MLATokenToKVPoolHost(info, 2.0, 0, page, "page_first", pin_memory=False,
                                        device="cpu", allocator_type=alloc_type,
                                        device_capacity_tokens=kv.size, start_layer=0,
                                        end_layer=LAYERS - 1, target_layer_num=LAYERS)
        else:
            kv = mha_pool(LAYERS)
            host = mha_host(kv, sc.get("layout", "page_first"))
        alloc = PagedTokenToKVPoolAllocator(SIZE, page, dtype, "cpu", kv, need_sort=False)
        entries = [build_pool_entry(name=PoolName.KV, host_pool=host, device_pool=kv,
                                    layer_mapping=mapping, transfer_layer_id_max=LAYERS,
                                    is_anchor=True)]
        self.mamba = self.swa = self.side = None
        self.side_name = None
        if model == "hybrid":
            from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
            from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

            minfo = MambaStateBufferInfo(temporal=torch.zeros(2, 8, 4, 16, 16),
                                         conv=(torch.zeros(2, 8, 3, 64, dtype=dtype),))
            self.mamba = MambaPoolHost(minfo, 2.0, 0, device_capacity=16, pin_memory=False,
                                       allocator_type=alloc_type, layout="page_first")
            entries.append(build_pool_entry(name=PoolName.MAMBA, host_pool=self.mamba,
                                            device_pool=None, layer_mapping=mapping,
                                            transfer_layer_id_max=LAYERS))
        elif model == "swa":
            swa_kv = mha_pool(LAYERS)
            self.swa = mha_host(swa_kv)
            entries.append(build_pool_entry(name=PoolName.SWA, host_pool=self.swa,
                                            device_pool=swa_kv, layer_mapping=mapping,
                                            transfer_layer_id_max=LAYERS))
        elif model == "dsa":
            from sglang.srt.mem_cache.pool_host.dsa import (
                DSAIndexerPoolHost,
                make_dsa_indexer_pool_decl,
            )

            self.side = DSAIndexerPoolHost(decl=make_dsa_indexer_pool_decl(kv), anchor_host=host,
                                           pin_memory=False, allocator_type=alloc_type)
            self.side_name = PoolName.INDEXER
            entries.append(build_pool_entry(name=PoolName.INDEXER, host_pool=self.side,
                                            device_pool=kv, layer_mapping=mapping,
                                            transfer_layer_id_max=LAYERS))
        self.host = host
        self.group = HostPoolGroup(entries)
        if sc.get("backend") == "mooncake":  # SGLang's built-in MooncakeStore
            backend = "mooncake"
            extra = {"interface_v1": 1, **sc["mooncake"]}
        else:
            backend = "dynamic"
            node = spec["node_ids"][sc.get("node", spec["node"])]
            extra = {"backend_name": "raykv", "module_path": "raykv.integrations.sglang",
                     "class_name": "RayKVStore", "interface_v1": 1, "allocator": alloc_type,
                     "ray_address": spec["ray_address"], "ray_namespace": spec["namespace"],
                     "ray_node_id": node, **sc.get("extra", {})}
        self.extra = extra
        t = time.time()
        env = sc.get("env", {})
        os.environ.update(env)  # SGLang reads its test switches while it builds the backend
        try:
            self.cc = HybridCacheController(
                alloc, self.group, page, group, threading.Event(), io_backend="direct",
                storage_backend=backend, prefetch_threshold=page,
                model_name=sc["model_name"], storage_backend_extra_config=extra,
                transfer_layer_id_max=LAYERS)
        finally:
            for k in env:
                os.environ.pop(k, None)
        if model == "draft":
            # A draft model's KV arrives after attach, as a sidecar of the target KV's
            # indices (SGLang's build_full_draft_pools + register_host_pool_entry).
            draft_kv = mha_pool(1)
            self.side = mha_host(draft_kv, capacity=host.size)
            self.side_name = PoolName.DRAFT
            self.cc.register_host_pool_entry(build_pool_entry(
                name=PoolName.DRAFT, host_pool=self.side, device_pool=draft_kv,
                layer_mapping={0: 0}, transfer_layer_id_max=1))
        self.attach_s = time.time() - t
        self.backend = self.cc.storage_backend
        # SGLang's fault injector wraps the backend; the store itself is inside.
        self.store = getattr(self.backend, "_backend", self.backend)
        self.side_tag = f"|{self.side_name.value}" if self.side_name is not None else ""

    # ------------------------------------------------------------ page bytes
    def page_view(self, pool, slot: int):
        """The page of SGLang host pool ``pool`` whose first token slot is ``slot``."""
        buf = getattr(pool, "index_k_with_scale_buffer", None)
        if buf is not None:
            return buf[slot // self.page]
        buf = pool.kv_buffer
        return buf[:, slot:slot + self.page] if buf.dim() == 5 else buf[slot:slot + self.page]

    def starts(self, slots) -> list[int]:
        return [int(s) for s in slots[::self.page].tolist()]

    def fill(self, pool, tag, seed, hashes, slots) -> None:
        for h, s in zip(hashes, self.starts(slots), strict=True):
            v = self.page_view(pool, s)
            v.copy_(page_tensor(seed, h + tag, self.rank, v.shape, v.dtype))

    def matches(self, pool, tag, seed, hashes, slots) -> list[bool]:
        out = []
        for h, s in zip(hashes, self.starts(slots)[:len(hashes)], strict=True):
            v = self.page_view(pool, s)
            out.append(bool(self.torch.equal(
                v, page_tensor(seed, h + tag, self.rank, v.shape, v.dtype))))
        return out

    def poison(self, pool, slots) -> None:
        for s in self.starts(slots):
            v = self.page_view(pool, s)
            v.copy_(noise(v.shape, v.dtype))

    def mamba_bufs(self):
        return [b for b in self.mamba.get_hybrid_pool_buffer() if b.numel() > 0]

    def fill_mamba(self, seed, key, slot):
        for i, b in enumerate(self.mamba_bufs()):
            b[slot] = page_tensor(seed, f"{key}|m{i}", self.rank, b[slot].shape, b.dtype)

    def poison_mamba(self, slot):
        for b in self.mamba_bufs():
            b[slot] = noise(b[slot].shape, b.dtype)

    def mamba_matches(self, seed, key, slot) -> bool:
        return all(bool(self.torch.equal(
            b[slot], page_tensor(seed, f"{key}|m{i}", self.rank, b[slot].shape, b.dtype)))
            for i, b in enumerate(self.mamba_bufs()))

    # ----------------------------------------------------------------- steps
    def tokens(self, seed, n_pages):
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        base = int(hashlib.sha256(seed.encode()).hexdigest()[:6], 16) * 10
        toks = list(range(base, base + n_pages * self.page))
        return toks, get_storage_hash_str(toks, None, page_size=self.page)

    def extra_transfers(self, hashes) -> list:
        """The extra pools of a prefetch query, as SGLang's components build them."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        out = []
        if self.mamba is not None:
            out.append(PoolTransfer(name=PoolName.MAMBA, keys=[hashes[-1]],
                                    hit_policy=PoolHitPolicy.TRAILING_PAGES))
        if self.swa is not None:  # SWAComponent: placeholders, re-aligned to the hit
            out.append(PoolTransfer(name=PoolName.SWA, keys=["__placeholder__"] * SWA_WINDOW,
                                    hit_policy=PoolHitPolicy.TRAILING_PAGES))
        if self.side is not None:
            out.append(PoolTransfer(name=self.side_name, indices_from_pool=PoolName.KV))
        return out

    def write(self, step) -> dict:
        """Back up pages ``pages`` (indices into the prompt, default all) of a prompt of
        ``n_pages``, in runs of consecutive pages; the sidecar pool (dsa, draft) rides
        along for the pages in ``side`` (default all). ``mamba``: Mamba states after those
        prefix lengths; ``swa``: SWA windows ending after those prefix lengths (each with
        the KV pages of its window), one backup each."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        P = self.page
        seed = step["seed"]
        toks, hashes = self.tokens(seed, step["n_pages"])
        pages = step.get("pages", list(range(step["n_pages"])))
        side = set(step.get("side", pages))
        runs, run = [], []
        for p in pages:
            if run and (p != run[-1] + 1 or (p in side) != (run[-1] in side)):
                runs.append(run)
                run = []
            run.append(p)
        if run:
            runs.append(run)
        completed, pool_results = [], []
        for run in runs:
            hidx = self.last_hidx = self.group.alloc(len(run) * P)
            sel = [hashes[p] for p in run]
            self.fill(self.host, "", seed, sel, hidx)
            extra = None
            if self.side is not None and run[0] in side:
                self.fill(self.side, self.side_tag, seed, sel, hidx)
                extra = [PoolTransfer(name=self.side_name, indices_from_pool=PoolName.KV)]
            rtoks = toks[run[0] * P:(run[-1] + 1) * P]
            self.cc.write_storage(hidx, rtoks, hash_value=sel, extra_pools=extra)
            ack = self.cc.ack_backup_queue.get(timeout=60)
            completed.append(ack.completed_tokens)
            pool_results.append({str(getattr(k, "value", k)): v for k, v in
                                 ack.pool_storage_result.extra_pool_hit_pages.items()})
        for n in step.get("mamba", []):
            slot = self.group.alloc(1, pool=PoolName.MAMBA)
            self.fill_mamba(seed, hashes[n - 1], int(slot[0]))
            # One page of KV with the state after it (the page exists already: put-if-absent).
            hidx = self.group.alloc(P)
            self.fill(self.host, "", seed, [hashes[n - 1]], hidx)
            self.cc.write_storage(
                hidx, toks[(n - 1) * P:n * P], hash_value=[hashes[n - 1]],
                extra_pools=[PoolTransfer(name=PoolName.MAMBA, host_indices=slot,
                                          keys=[hashes[n - 1]],
                                          hit_policy=PoolHitPolicy.TRAILING_PAGES)])
            ack = self.cc.ack_backup_queue.get(timeout=60)
            completed.append((ack.completed_tokens, str(ack.pool_storage_result)))
        for n in step.get("swa", []):
            lo = max(0, n - SWA_WINDOW)
            sel = hashes[lo:n]
            hidx = self.group.alloc(len(sel) * P)
            self.fill(self.host, "", seed, sel, hidx)
            sslots = self.group.alloc(len(sel) * P, pool=PoolName.SWA)
            self.fill(self.swa, "|swa", seed, sel, sslots)
            self.cc.write_storage(
                hidx, toks[lo * P:n * P], hash_value=sel,
                extra_pools=[PoolTransfer(name=PoolName.SWA, host_indices=sslots, keys=sel,
                                          hit_policy=PoolHitPolicy.TRAILING_PAGES)])
            ack = self.cc.ack_backup_queue.get(timeout=60)
            completed.append(ack.completed_tokens)
            pool_results.append({str(getattr(k, "value", k)): v for k, v in
                                 ack.pool_storage_result.extra_pool_hit_pages.items()})
        return {"completed": completed, "pool_results": pool_results}

    def prefetch(self, step) -> dict:
        """SGLang's prefetch of a prompt of ``n_pages``: hit query on the prefetch thread,
        then the load on the prefetch-IO thread into slots filled with noise; bytes
        compared with what the writer wrote, for the pages SGLang reports loaded."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hicache_storage import PoolName

        P = self.page
        seed = step["seed"]
        toks, hashes = self.tokens(seed, step["n_pages"])
        rid = f"{step.get('rid', seed)}-{time.time_ns()}"
        self.cc.prefetch(CacheRequestHandle(rid=rid, attempt_id=0), toks, None,
                         extra_pools=self.extra_transfers(hashes) or None)
        op = self.cc.prefetch_hit_queue.get(timeout=60)
        hit_tokens = op.storage_hit_count
        res = {"hit_tokens": hit_tokens, "hit_pages": hit_tokens // P,
               "restorable": list(op.pool_storage_result.restorable_prefix_pages or []),
               "query_pool_hit_pages": {str(getattr(k, "value", k)): v for k, v in
                                        (op.query_pool_hit_pages or {}).items()}}
        if hit_tokens == 0:
            res.update(loaded_pages=0, kv_match=[], mamba_match=None)
            return res
        op.host_indices = self.last_hidx = self.group.alloc(hit_tokens)
        self.poison(self.host, op.host_indices)
        if self.side is not None:
            self.poison(self.side, op.host_indices)
        mslot = swa = None
        for t in op.pool_transfers or []:
            if t.name == PoolName.MAMBA:
                mslot = self.group.alloc(1, pool=PoolName.MAMBA)
                self.poison_mamba(int(mslot[0]))
                t.host_indices = mslot
            elif t.name == PoolName.SWA:
                swa = t
                n = min(SWA_WINDOW, hit_tokens // P)
                t.host_indices = self.group.alloc(n * P, pool=PoolName.SWA)
                self.poison(self.swa, t.host_indices)
        self.cc.prefetch_buffer.put(op)
        acks, pool_hits = [], {}
        while True:
            a = self.cc.ack_prefetch_queue.get(timeout=60)
            acks.append([a.completed_tokens, str(a.pool_hits), a.completed_req])
            pool_hits.update({str(getattr(k, "value", k)): v  # SGLang lists every pool
                              for k, v in (a.pool_hits or {}).items() if v})
            if a.completed_req:
                break
        loaded = max((a[0] or 0) for a in acks) // P
        res.update(acks=acks, loaded_pages=loaded, pool_hits=pool_hits)
        res["kv_match"] = self.matches(self.host, "", seed, hashes[:loaded], op.host_indices)
        if self.side is not None:
            res["side_match"] = self.matches(self.side, self.side_tag, seed, hashes[:loaded],
                                             op.host_indices)
        if mslot is not None and loaded and pool_hits.get("mamba", 0) >= 1:
            res["mamba_match"] = self.mamba_matches(seed, hashes[loaded - 1], int(mslot[0]))
        else:
            res["mamba_match"] = None
        if swa is not None and pool_hits.get("swa", 0) >= 1:
            # SGLang re-aligned the placeholder keys to the last window pages of the hit.
            res["swa_pages"] = [hashes.index(k) for k in swa.keys]
            res["swa_match"] = self.matches(self.swa, "|swa", seed, list(swa.keys),
                                            swa.host_indices)
        return res

    def exists_v2(self, step) -> dict:
        """The backend's own v2 answer (as SGLang's prefetch thread asks it)."""
        _, hashes = self.tokens(step["seed"], step["n_pages"])
        r = self.store.batch_exists_v2(hashes, self.extra_transfers(hashes))
        local = self.store.client.batch_exists(hashes)
        return {"kv_hit_pages": r.kv_hit_pages,
                "restorable": list(r.restorable_prefix_pages or []),
                "extra": {str(getattr(k, "value", k)): v
                          for k, v in r.extra_pool_hit_pages.items()},
                "group_v1": self.store.batch_exists(hashes), "rank_local_v1": local}

    def kill_node_actor(self, step) -> dict:
        import ray
        from raykv.controllers.naming import node_actor_name

        actor = ray.get_actor(node_actor_name(self.store.client.node_id),
                              namespace=self.store._namespace)
        ray.kill(actor, no_restart=False)
        return {"killed": True}

    def barrier(self, step) -> dict:
        import torch.distributed as dist

        dist.barrier()
        return {}

    def wait_healthy(self, step) -> dict:
        """Wait until this node's actor answers again (Ray restarts it)."""
        t = time.time()
        while time.time() - t < step.get("s", 120):
            try:
                if self.store.client.health()["store_healthy"]:
                    return {"waited_s": round(time.time() - t, 1)}
            except Exception:
                pass
            time.sleep(0.5)
        return {"waited_s": None}

    def wait(self, step) -> dict:
        time.sleep(step["s"])
        return {}

    def stats(self, step) -> dict:
        be = self.store
        st = be.raykv_stats()
        node = be.client.stats()
        st["node"] = {"mode": node.mode, "host_pool_used": node.host_pool_used}
        st["node_pools"] = {n: {"kind": p.kind, "bytes": p.bytes}
                            for n, p in node.pools.items()}
        st["sglang_fds"] = {}
        pools = [("kv", self.host), ("mamba", self.mamba), ("swa", self.swa),
                 (self.side_name.value if self.side_name else "", self.side)]
        for name, pool in pools:
            if pool is None:
                continue
            fds = list(getattr(getattr(pool, "allocator", None), "fds", []) or [])
            st["sglang_fds"][name] = [[os.getpid(), fd, os.readlink(f"/proc/self/fd/{fd}"),
                                       os.fstat(fd).st_size] for fd in fds]
        return st

    # ------------------------------------ single-key calls, legacy pointers, clear
    def trio(self, step) -> dict:
        """SGLang's single-key calls on one object, the K object of a page of SGLang's
        host pool (pointer and size from its own ``get_page_buffer_meta``), under key
        ``{seed}-obj``: ``exists`` before and after ``set``, of another key (control),
        the page hit of that key (``batch_exists``: a page's objects, not this one),
        ``get`` into a page filled with noise first (``bytes_equal``) and of a missing
        key; ``old_exists``: what the backend's ``exists`` answered before this fix
        (the page's KV objects of this rank), the control of ``exists``; ``value_*``:
        the value form of ``set``, ``get`` and ``batch_get`` (a tensor, no pointer)."""
        import numpy as np

        P, store = self.page, self.store
        key = f"{step['seed']}-obj"
        src, dst = self.group.alloc(P), self.group.alloc(P)
        self.fill(self.host, "", step["seed"], [key], src)
        self.poison(self.host, dst)
        ptrs, sizes = self.host.get_page_buffer_meta(np.asarray(src))
        dptrs, _ = self.host.get_page_buffer_meta(np.asarray(dst))
        out = {"exists_before": store.exists(key),
               "set": store.set(key, target_location=ptrs[0], target_sizes=sizes[0])}
        out.update(exists=store.exists(key), exists_other=store.exists(key + "-other"),
                   page_hit=store.batch_exists([key]),
                   old_exists=store.client.batch_exists([key]) == 1,
                   get=store.get(key, target_location=dptrs[0], target_sizes=sizes[0]),
                   get_missing=store.get(key + "-other", target_location=dptrs[0],
                                         target_sizes=sizes[0]))
        # The value form (SGLang without interface_v1): refused, never stored.
        out.update(value_set=store.set(key + "-value", value=self.torch.zeros(4)),
                   value_get=store.get(key + "-value"),
                   value_batch_get=store.batch_get([key + "-value"]))
        views = [self.page_view(self.host, self.starts(x)[0]) for x in (src, dst)]
        if self.host.kv_buffer.dim() == 5:  # MHA: the K object is the first of the page
            views = [v[0] for v in views]
        out["bytes_equal"] = bool(self.torch.equal(*views))
        return out

    def legacy_batch_get(self, step) -> dict:
        """SGLang's legacy pointer calls on ``n_pages`` pages of its host pool (its own
        ``get_page_buffer_meta``; keys ``{hash}_{tp}_k`` / ``_v`` as MooncakeStore's
        pointer API names them): ``batch_set`` of the first ``objects`` objects (default
        all), then ``batch_get`` of all of them into pages filled with noise.
        Returns ``set``, ``pages`` (what ``batch_get`` answered), ``objects`` (the
        leading objects a client ``batch_get`` reads: the count before this fix),
        ``per_page`` and ``match`` (bytes of the pages reported read)."""
        import numpy as np

        P, store, n = self.page, self.store, step["n_pages"]
        _, hashes = self.tokens(step["seed"], n)
        src, dst = self.group.alloc(n * P), self.group.alloc(n * P)
        self.fill(self.host, "", step["seed"], hashes, src)
        self.poison(self.host, dst)
        ptrs, sizes = self.host.get_page_buffer_meta(np.asarray(src))
        dptrs, dsizes = self.host.get_page_buffer_meta(np.asarray(dst))
        per = len(ptrs) // n
        names = ["k", "v"][:per]
        keys = [f"{h}_{self.rank}_{b}" for h in hashes for b in names]
        stored = step.get("objects", len(keys))
        out = {"per_page": per, "set": store.batch_set(
            keys[:stored], target_locations=ptrs[:stored], target_sizes=sizes[:stored])}
        out["pages"] = store.batch_get(keys, target_locations=dptrs, target_sizes=dsizes)
        out["match"] = self.matches(self.host, "", step["seed"], hashes[:out["pages"]], dst)
        out["objects"] = store.client.batch_get(
            keys, [store._served.pointer(p) for p in dptrs], dsizes)
        return out

    def clear(self, step) -> dict:
        """SGLang's own ``HybridCacheController.clear_storage_backend()`` (what its
        ``/hicache/storage-backend/clear`` runs on every rank): ``ok`` (what SGLang
        returned), or ``raised``; ``seconds`` it took; the backend's counters."""
        t = time.perf_counter()
        out: dict = {}
        try:
            out["ok"] = self.cc.clear_storage_backend()
        except Exception as e:
            out.update(ok=False, raised=f"{type(e).__name__}: {e}")
        out.update(seconds=round(time.perf_counter() - t, 2),
                   counters=dict(self.store.counters))
        return out

    def peer_tests(self, step) -> dict:
        """SGLang's own ``test_mooncake_store`` functions ``tests`` run against
        ``RayKVStore`` (``sglang_peer``: this scenario's extra config, a tag of their
        own, SGLang's MHA host pool with the shm allocator). ``old_exists``: control,
        every store's ``exists`` is the one before this fix (the page's KV objects)."""
        import sglang_peer  # this script's folder

        def old_exists(store):
            store.exists = lambda key: store.client.batch_exists([key]) == 1

        extra = {**self.extra, "extra_backend_tag": f"peer-{os.urandom(4).hex()}"}
        return sglang_peer.run(
            step["tests"], extra,
            lambda: mha_host_pool(mha_device_pool(LAYERS, PAGE), PAGE, "shm"),
            patch_store=old_exists if step.get("old_exists") else None)

    # ------------------------------------------------------- deadline steps
    def stop_node_actor(self, step) -> dict:
        """SIGSTOP this backend's node actor (hung, as its callers see it)."""
        from process_stop import stop_process  # this script's folder

        self.stopped_pid = self.store.client.health()["pid"]
        stop_process(self.stopped_pid)
        return {"pid": self.stopped_pid}

    def cont_node_actor(self, step) -> dict:
        """SIGCONT the node actor ``stop_node_actor`` stopped."""
        import signal

        os.kill(self.stopped_pid, signal.SIGCONT)
        return {"pid": self.stopped_pid}

    def logged(self, step) -> dict:
        """Run step ``inner`` with every backend data call logged (``CallLog``):
        ``result`` (or ``inner_error``: the step itself failed, e.g. an SGLang queue
        wait ran out because a call hung), ``calls`` made meanwhile, and a moment later
        the calls still running. ``stop_after_hit``: SIGSTOP the node actor once SGLang's
        prefetch thread has answered the hit query, before the load starts."""
        log_ = getattr(self, "call_log", None) or CallLog(self.store)
        self.call_log = log_
        first = len(log_.calls)
        queue = self.cc.prefetch_hit_queue
        if step.get("stop_after_hit"):
            get = queue.get

            def get_then_stop(*args, **kwargs):
                op = get(*args, **kwargs)
                self.stop_node_actor({})
                return op
            queue.get = get_then_stop
        out: dict = {}
        try:
            out["result"] = getattr(self, step["inner"]["op"])(step["inner"])
        except Exception as e:
            out["inner_error"] = repr(e)
        finally:
            queue.__dict__.pop("get", None)
        time.sleep(step.get("settle_s", 0.5))  # a call SGLang's thread still has running
        out["calls"] = log_.since(first)
        return out

    def until_hit(self, step) -> dict:
        """Prefetch ``seed`` (``n_pages``) until every page loads byte-identical, for at
        most ``s`` seconds (the node actor may first work through calls that expired
        while it was stopped); the tries and the last prefetch."""
        t = time.time()
        tries = 0
        while True:
            tries += 1
            res = self.prefetch({**step, "rid": f"until-{tries}"})
            full = res["loaded_pages"] == step["n_pages"] and all(res["kv_match"])
            if full or time.time() - t > step.get("s", 60):
                return {"tries": tries, "hit": full, "last": res}
            time.sleep(0.5)

    # ------------------------------------------------- slow store calls
    def store_delay(self, step) -> dict:
        """From now on every node actor of the cluster holds each put and get ``s``
        seconds inside its store call (``store_delay.delay_store_calls``; 0: off)."""
        import ray
        import store_delay  # this script's folder
        from raykv.controllers.naming import node_actor_name

        actors = [ray.get_actor(node_actor_name(n), namespace=self.store._namespace)
                  for n in self.node_ids]
        store_delay.delay_store_calls(actors, step["s"])
        return {"s": step["s"]}

    def slow_runs(self, step) -> dict:
        """From now on every group answer of this backend carries ``load_runs`` as a
        node that gave estimates would: its first ``head`` pages from ``l2`` (1 us), the
        rest from ``l3`` taking ``s`` seconds (the test's stand-in for a slow link; the
        answer's pages stay the node's)."""
        import dataclasses

        client = self.store.client
        plain = client.group_exists

        def with_runs(*args, **kwargs):
            hit = plain(*args, **kwargs)
            n = hit.kv_hit_pages
            head = min(step.get("head", 0), n)
            runs = ([("l2", head, 1e-6)] if head else []) + \
                ([("l3", n - head, step["s"])] if n > head else [])
            return dataclasses.replace(hit, load_runs=runs)

        client.group_exists = with_runs
        return {"s": step["s"], "head": step.get("head", 0)}

    def old_return(self, step) -> dict:
        """CONTROL, for the rest of this process: a failed put's or get's ticket is freed
        at once, whatever store call of it still runs (a rank's return before tickets)."""
        from raykv.cache_actors.tickets import TicketBook

        def free(book, ticket) -> bool:
            book.free(ticket, answered=False)
            return True

        TicketBook.settle = TicketBook.try_settle = free
        return {}

    def until_breaker_admits(self, step) -> dict:
        """Wait (at most 30 s) until this backend's circuit breaker lets a data call
        through again (its probe found the node actor answering)."""
        t = time.time()
        while self.store.client.breaker_counts()["state"] == "open":
            if time.time() - t > 30:
                raise TimeoutError("the breaker never let a call through again")
            time.sleep(0.05)
        return {"waited_s": round(time.time() - t, 3)}

    def reuse(self, step) -> dict:
        """The host pages of the last ``write`` or ``prefetch`` given to other data at
        once, as SGLang reuses host pages it freed (after a failed prefetch) or evicted
        (after a backup): filled with seed ``seed``'s bytes; ``wait_s`` later, whether
        each page still holds them (``kept``)."""
        hidx = self.last_hidx
        _, hashes = self.tokens(step["seed"], len(self.starts(hidx)))
        self.fill(self.host, "", step["seed"], hashes, hidx)
        time.sleep(step.get("wait_s", 0))
        return {"kept": self.matches(self.host, "", step["seed"], hashes, hidx)}

    # ------------------------------------------------ close under a backup
    def close_during_backup(self, step) -> dict:
        """SGLang's backup of prompt ``seed`` as ``ops`` write operations of ``run_pages``
        consecutive pages each, queued at once (SGLang's backup thread takes them in
        turn, one ``batch_set_v1`` each), with the backend's ``close()`` called from this
        thread while one of those calls is in the node actor's store call: once
        ``after_calls`` calls have started and the latest has run ``into_s`` seconds (the
        node actors are slowed, ``store_delay``). One more
        operation (the prompt's last ``run_pages`` pages) is queued after ``close()``
        returned: SGLang's backup thread then calls the closed backend.

        Returns ``pid`` (the node actor's, from ``health()`` before), ``close`` (its start
        and end), ``calls`` (per ``batch_set_v1``: its page indices, start, end, what it
        reported per page, or what it raised), ``completed`` (SGLang's acked tokens per
        operation, the late one last) and ``stored_pages`` (page indices SGLang's acks
        count stored). Times are seconds since the step began."""
        P = self.page
        seed, run, n_ops = step["seed"], step["run_pages"], step["ops"]
        toks, hashes = self.tokens(seed, run * (n_ops + 1))
        index = {h: i for i, h in enumerate(hashes)}
        pid = self.store.client.health()["pid"]
        calls: list[dict] = []
        lock = threading.Lock()
        t0 = time.perf_counter()
        original = self.store.batch_set_v1

        def batch_set_v1(keys, host_indices, extra_info=None):
            rec = {"pages": [index.get(k) for k in keys],
                   "start": time.perf_counter() - t0, "end": None}
            with lock:
                calls.append(rec)
            try:
                out = original(keys, host_indices, extra_info)
                rec["result"] = [bool(v) for v in out]
                return out
            except BaseException as e:
                rec["raised"] = repr(e)
                raise
            finally:
                rec["end"] = time.perf_counter() - t0

        def backup(r: int) -> None:
            hidx = self.group.alloc(run * P)
            self.fill(self.host, "", seed, hashes[r * run:(r + 1) * run], hidx)
            self.cc.write_storage(hidx, toks[r * run * P:(r + 1) * run * P],
                                  hash_value=hashes[r * run:(r + 1) * run])

        self.store.batch_set_v1 = batch_set_v1  # SGLang looks it up at every call
        try:
            for r in range(n_ops):
                backup(r)
            deadline = time.monotonic() + 60
            while True:
                with lock:
                    started = len(calls)
                    running = [c for c in calls if c["end"] is None]
                now = time.perf_counter() - t0
                if (started >= step["after_calls"] and running
                        and now - running[-1]["start"] >= step["into_s"]):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"SGLang's backup thread made {started} calls in 60 s")
                time.sleep(0.002)
            close = {"start": time.perf_counter() - t0}
            self.store.close()
            close["end"] = time.perf_counter() - t0
            backup(n_ops)
            completed = [self.cc.ack_backup_queue.get(timeout=60).completed_tokens
                         for _ in range(n_ops + 1)]
        finally:
            self.store.__dict__.pop("batch_set_v1", None)
        stored = [r * run + i for r, done in enumerate(completed) for i in range(done // P)]
        return {"pid": pid, "close": close, "calls": calls, "completed": completed,
                "stored_pages": stored}

    def close_during_copy(self, step) -> dict:
        """The backend's ``close()`` called from this thread while the backend copies
        pages between SGLang's pool and its staging pool: ``direction`` ``"in"``, a
        backup of prompt ``seed`` (``n_pages``; SGLang's pages copied into staging before
        the put), or ``"out"``, a prefetch of it (backed up before; the pages read copied
        out of staging into SGLang's). Each page of that copy is slowed by ``copy_s``
        seconds (test-only: ``staging_pools.page_runs`` patched for this step),
        and ``close()`` runs once the copy has begun; the backup or prefetch runs on a
        thread of this step through SGLang's own threads.

        Returns ``result`` (what ``write`` / ``prefetch`` report: the acked tokens, or
        the pages SGLang's acks count loaded and whether their bytes are the writer's),
        ``close`` (start, end) and ``copy_started`` (seconds since the step began)."""
        from raykv.cache_actors.rank import staging_pools
        from raykv.cache_actors.rank.staging_pools import StagedPool

        runs = staging_pools.page_runs
        method = "copy_in" if step["direction"] == "in" else "copy_out"
        copy = getattr(StagedPool, method)
        slowed = threading.local()
        copying = threading.Event()
        backup = step["direction"] == "in"
        t0 = time.perf_counter()
        copy_started: list[float] = []

        def slow_copy(staged, epages, spages, pool):
            slowed.on = True
            try:
                return copy(staged, epages, spages, pool)
            finally:
                slowed.on = False

        def slow_runs(a, b):
            for a0, b0, n in runs(a, b):
                for i in range(n):
                    if getattr(slowed, "on", False):
                        if not copying.is_set():
                            copy_started.append(time.perf_counter() - t0)
                            copying.set()
                        time.sleep(step["copy_s"])
                    yield a0 + i, b0 + i, 1

        done: dict = {}
        inner = {"seed": step["seed"], "n_pages": step["n_pages"], "rid": "close-copy"}

        def transfer() -> None:
            try:
                done["result"] = self.write(inner) if backup else self.prefetch(inner)
            except Exception as e:
                done["error"] = repr(e)

        setattr(StagedPool, method, slow_copy)
        staging_pools.page_runs = slow_runs
        try:
            thread = threading.Thread(target=transfer, name="close-copy")
            thread.start()
            if not copying.wait(60):
                raise TimeoutError("the backend never copied pages through its staging pool")
            close = {"start": time.perf_counter() - t0}
            self.store.close()
            close["end"] = time.perf_counter() - t0
            thread.join(120)
        finally:
            staging_pools.page_runs = runs
            setattr(StagedPool, method, copy)
        if "error" in done:
            raise RuntimeError(f"the {step['direction']} transfer failed: {done['error']}")
        return {"result": done.get("result"), "close": close,
                "copy_started": copy_started[0]}

    def read_back(self, step) -> dict:
        """Every KV object of prompt ``seed`` (``n_pages``) that exists in the store, read
        through this backend's own client (a fresh ``CacheClient``) into pages of its
        pool filled with noise first, and compared with what the writer wrote.

        Existence per object: the node actor's ``exists``; the reads: one pointer-API
        ``batch_get`` of every existing object. Returns ``objects`` (per page, per object
        K, V: None absent, True the writer's bytes, False other bytes or not read),
        ``read`` (objects read in full, of ``existing``) and ``pid`` (the node actor's,
        from ``health()``)."""
        import numpy as np
        import ray
        from raykv.controllers.contract import PoolName as RayKVPool
        from raykv.controllers.naming import node_actor_name

        P = self.page
        seed = step["seed"]
        _, hashes = self.tokens(seed, step["n_pages"])
        client = self.store.client
        scheme = client.key_scheme
        tagged = [scheme.kv_keys(h) for h in hashes]
        actor = ray.get_actor(node_actor_name(client.node_id), namespace=self.store._namespace)
        flat = [k for keys in tagged for k in keys]
        codes = ray.get(actor.exists.remote(flat), timeout=60)
        per_page = len(tagged[0])
        exists = [[codes[p * per_page + i] == 1 for i in range(per_page)]
                  for p in range(len(hashes))]
        pool = self.store._pools[RayKVPool.KV].pool
        keys, ptrs, sizes, slots = [], [], [], {}
        for p, (page_keys, present) in enumerate(zip(tagged, exists, strict=True)):
            if not any(present):
                continue
            slot = len(slots) * P
            slots[p] = slot
            view = pool.kv_buffer[:, slot:slot + P]
            view.copy_(noise(view.shape, view.dtype))
            page_ptrs, page_sizes = pool.get_page_buffer_meta(np.arange(slot, slot + P))
            for i, key in enumerate(page_keys):
                if present[i]:  # the pointer API tags keys itself
                    keys.append(key.removeprefix(scheme.prefix))
                    ptrs.append(page_ptrs[i])
                    sizes.append(page_sizes[i])
        read = client.batch_get(keys, ptrs, sizes) if keys else 0
        objects = []
        for p, h in enumerate(hashes):
            if p not in slots:
                objects.append([None] * per_page)
                continue
            view = pool.kv_buffer[:, slots[p]:slots[p] + P]
            want = page_tensor(seed, h, self.rank, view.shape, view.dtype)
            objects.append([bool(self.torch.equal(view[i], want[i])) if exists[p][i] else None
                            for i in range(per_page)])
        return {"objects": objects, "read": read, "existing": len(keys),
                "pid": client.health()["pid"]}

    def threads(self) -> dict:
        cc = self.cc
        return {n: t.is_alive() for n, t in (
            ("prefetch", cc.prefetch_thread), ("prefetch_io", cc.prefetch_io_aux_thread),
            ("prefetch_sync", cc.prefetch_sync_thread), ("backup", cc.backup_thread))}


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
        INJECTED.calls.clear()
        started = time.perf_counter()
        try:
            eng = Engine(spec, sc, group)
        except Exception as e:  # SGLang fails the attach: report what it said
            out["scenarios"][sc["name"]] = {"attach_error": f"{type(e).__name__}: {e}",
                                            "warnings": list(WARNINGS.messages)}
            WARNINGS.messages.clear()
            continue
        res = {"attach_s": eng.attach_s, "backend": type(eng.store).__name__,
               "wrapper": type(eng.backend).__name__, "steps": []}
        for step in sc["steps"]:
            try:
                res["steps"].append(getattr(eng, step["op"])(step))
            except Exception as e:  # a failed step is reported, the rest still runs
                res["steps"].append({"error": repr(e),
                                     "where": traceback.format_exc()[-1500:]})
        res["threads"] = eng.threads()
        res["warnings"] = list(WARNINGS.messages)
        res["injected"] = dict(INJECTED.calls)
        WARNINGS.messages.clear()
        eng.cc.detach_storage_backend()
        res["elapsed_s"] = round(time.perf_counter() - started, 2)
        out["scenarios"][sc["name"]] = res
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    out["process_s"] = round(time.perf_counter() - START, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
