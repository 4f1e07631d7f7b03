"""raykv as an SGLang HiCache storage backend (SGLang 0.5.23).

Stock SGLang loads it with::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \
      '{"backend_name": "raykv", "module_path": "raykv.integrations.sglang",
        "class_name": "RayKVStore", "interface_v1": 1, "allocator": "shm",
        "ray_address": "<gcs host:port>"}'

Only SGLang imports this module (``import raykv`` never needs SGLang). ``RayKVStore``
joins the raykv cluster over Ray, talks to the cache actor of its node through a
``CacheClient`` and speaks SGLang's v1 and v2 storage API on SGLang's own host pools:

- **Zero-copy** (``"allocator": "shm"``, embedded Mooncake mode): SGLang's KV-like host
  pools (KV, SWA, draft, DSA indexer; MHA or MLA, ``page_first``) are memfds in the
  scheduler process. The node actor maps them through ``/proc/<pid>/fd/<fd>``, registers
  them with its Mooncake client (``cache_actors.node.engine_memory``), and pages move straight
  between SGLang's tensors and the store.
- **Staging** (any other allocator, Mamba pools, standalone mode): a raykv host pool of
  the same page geometry per SGLang pool; pages are copied into it before a put and out
  of it after a get (one warning names the reason and what would make it zero-copy). In
  standalone mode the store's buffers are ``mooncake_client``'s shared memory, which
  only ``mooncake_client`` can register and which cannot map SGLang's memfds, so every
  pool is staged there; the staging pools are allocated from that memory and count
  against the node's ``host_pool_bytes`` (``2 * staging_pages`` pages per pool).

Hit queries (``batch_exists``, ``batch_exists_v2``) go through raykv's group query: every
TP rank of the deployment gets the same answer, so SGLang's MIN all-reduce never shrinks
it. Keys are those of SGLang's built-in ``MooncakeStore`` (tag once, same suffixes).

Failures never crash SGLang: a node actor restart or a store outage turns into misses /
failed pages with a warning (rate-limited), never success, and the backend re-attaches
by itself (zero-copy pools are registered again with the restarted actor).
``batch_set_v2`` never raises (a raise would drop a whole backup).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from raykv.cache_actors.errors import DeadlineExceededError, NodeUnavailableError
from raykv.cache_actors.host_pools import HostPool
from raykv.cache_actors.rank.client import CacheClient
from raykv.controllers.contract import PoolHitPolicy, PoolName, PoolTransfer, StorageConfig
from raykv.controllers.naming import NAMESPACE
from raykv.controllers.pool_layout import PoolLayout
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy as SGPoolHitPolicy
from sglang.srt.mem_cache.hicache_storage import PoolName as SGPoolName
from sglang.srt.mem_cache.hicache_storage import PoolTransfer as SGPoolTransfer
from sglang.srt.mem_cache.hicache_storage import PoolTransferResult as SGPoolTransferResult

log = logging.getLogger(__name__)

# SGLang pools raykv serves (by value); every other PoolName of SGLang is refused.
SUPPORTED_POOLS = {p.value: p for p in PoolName}
# Pages staged per pool and direction (SGLang moves at most 128 pages per call).
STAGING_PAGES = 256
MAMBA_STAGING_SLOTS = 16
WARN_EVERY_S = 10.0
# extra_config keys this backend reads (SGLang's own keys pass through untouched).
CONFIG_KEYS = ("ray_address", "ray_namespace", "ray_auth_mode", "ray_node_id", "zero_copy",
               "staging_pages", "extra_backend_tag", "timeout_s")


# --------------------------------------------------------------------- config
def storage_config(config: HiCacheStorageConfig) -> StorageConfig:
    """raykv's ``StorageConfig`` for SGLang's ``config``; ``ValueError`` naming what raykv
    cannot serve (decode context parallelism, heads split across ranks). Host layouts are
    checked per pool at registration (SGLang sets ``is_page_first_layout`` only for
    ``page_first``, not for the also servable ``page_first_direct``)."""
    problems = []
    if getattr(config, "dcp_size", 1) > 1:
        problems.append(f"dcp_size={config.dcp_size} (decode context parallel keys are not "
                        "supported)")
    if getattr(config, "should_split_heads", False):
        problems.append("should_split_heads=True (heads split across a TP LCM group)")
    if problems:
        raise ValueError("raykv cannot serve this SGLang HiCache config: " + "; ".join(problems))
    extra = dict(config.extra_config or {})
    return StorageConfig(
        tp_rank=config.tp_rank, tp_size=config.tp_size, pp_rank=config.pp_rank,
        pp_size=config.pp_size, attn_cp_rank=config.attn_cp_rank,
        attn_cp_size=config.attn_cp_size, is_mla_model=config.is_mla_model,
        enable_storage_metrics=config.enable_storage_metrics,
        is_page_first_layout=config.is_page_first_layout, model_name=config.model_name,
        extra_config={k: extra[k] for k in ("extra_backend_tag", "timeout_s") if k in extra})


def _token_available() -> bool:
    return bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
                or os.path.exists(os.path.expanduser("~/.ray/auth_token")))


def connect_ray(extra: dict) -> str:
    """Join the raykv cluster's Ray unless this process is already part of it; returns
    the namespace of the raykv actors.

    Address: ``extra["ray_address"]``, else ``RAY_ADDRESS``. Ray 2.60 clusters started
    with token authentication need ``RAY_AUTH_MODE=token`` in a process that joins
    them: it is set here when unset and a token is available (``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``), or from ``extra["ray_auth_mode"]``.
    """
    namespace = extra.get("ray_namespace") or NAMESPACE
    if ray.is_initialized():
        return namespace
    address = extra.get("ray_address") or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ValueError("raykv: no Ray cluster to join: put \"ray_address\": \"<gcs "
                         "host:port>\" in --hicache-storage-backend-extra-config or set "
                         "RAY_ADDRESS")
    if extra.get("ray_auth_mode"):
        os.environ["RAY_AUTH_MODE"] = str(extra["ray_auth_mode"])
    elif "RAY_AUTH_MODE" not in os.environ and _token_available():
        os.environ["RAY_AUTH_MODE"] = "token"
    ray.init(address=address, namespace=namespace, log_to_driver=False,
             logging_level=logging.WARNING)
    return namespace


# ---------------------------------------------------------------- host pools
def _pages(buf: torch.Tensor, num_pages: int) -> torch.Tensor:
    """``buf`` (contiguous, pages outermost) as ``(num_pages, bytes per page)`` uint8."""
    if not buf.is_contiguous():
        raise ValueError(f"buffer {tuple(buf.shape)} is not contiguous")
    return buf.view(-1).view(torch.uint8).view(num_pages, -1)


@dataclass
class EnginePool:
    """One SGLang host pool as raykv serves it.

    ``layout`` describes SGLang's pool in raykv terms (same page count, page size and
    page objects; for MHA/MLA ``page_first`` the same bytes at the same offsets).
    ``pages`` are SGLang's buffers as ``(num_pages, object bytes)`` views, in key order.
    ``pool`` is the raykv pool calls name: SGLang's own memory mapped again (zero-copy)
    or a staging pool of ``2 * staging`` pages (the first half for puts, the second for
    gets). ``memfd`` is ``(pid, fd)`` of SGLang's memfd when it can be shared.
    ``locks``: the put and get halves' (a staged transfer holds its half's for its whole
    run: copies and store calls); ``closed``: set by ``RayKVStore.close`` under both.
    """

    name: PoolName
    engine: Any
    kind: str
    layout: PoolLayout
    pages: list[torch.Tensor]
    memfd: tuple[int, int] | None = None
    pool: HostPool | None = None
    zero_copy: bool = False
    staging: int = 0
    locks: tuple[threading.Lock, threading.Lock] = field(
        default_factory=lambda: (threading.Lock(), threading.Lock()))
    closed: bool = False

    @property
    def page_size(self) -> int:
        return self.layout.page_size


def describe_pool(name: PoolName, engine) -> EnginePool:
    """How raykv serves SGLang host pool ``engine`` registered as ``name``; ``ValueError``
    naming why it cannot (layout, buffer shapes)."""
    layout_name = getattr(engine, "layout", "page_first")
    if layout_name not in ("page_first", "page_first_direct"):
        raise ValueError(f"pool {name.value!r}: host layout {layout_name!r} cannot be served "
                         "(a page must be one contiguous run per buffer): use page_first or "
                         "page_first_direct")
    if name == PoolName.MAMBA:
        return _describe_mamba(engine)
    if name == PoolName.INDEXER:
        return _describe_indexer(engine, layout_name)
    buf = getattr(engine, "kv_buffer", None)
    page = int(getattr(engine, "page_size", 0) or 0)
    if not isinstance(buf, torch.Tensor) or page < 1:
        raise ValueError(f"pool {name.value!r}: {type(engine).__name__} has no kv_buffer "
                         "tensor and page_size; raykv serves MHA/MLA KV-like pools and Mamba")
    item = buf.element_size()
    dtype = str(buf.dtype).removeprefix("torch.")
    if buf.dim() == 5 and buf.shape[0] == 2 and layout_name == "page_first":
        size, layers, heads, dim = buf.shape[1:]
        kind, pages_of = "mha", [buf[0], buf[1]]
    elif buf.dim() == 6 and buf.shape[0] == 2:  # page_first_direct (2, pages, L, page, H, D)
        n, layers, p, heads, dim = buf.shape[1:]
        size, kind, pages_of = n * p, "mha", [buf[0], buf[1]]
    elif buf.dim() == 4 and layout_name == "page_first":  # MLA (size, L, 1, D)
        size, layers, _, dim = buf.shape
        kind, pages_of = "mla", [buf]
    elif buf.dim() == 5 and layout_name == "page_first_direct":  # MLA (pages, L, page, 1, D)
        n, layers, p, _, dim = buf.shape
        size, kind, pages_of = n * p, "mla", [buf]
    else:
        raise ValueError(f"pool {name.value!r}: kv_buffer {tuple(buf.shape)} with layout "
                         f"{layout_name!r} is neither MHA nor MLA")
    if kind == "mha":
        layout = PoolLayout.mha(page_size=page, size=int(size), layer_num=int(layers),
                                head_num=int(heads), head_dim=int(dim), dtype=dtype,
                                itemsize=item)
    else:
        layout = PoolLayout.mla(page_size=page, size=int(size), layer_num=int(layers),
                                kv_cache_dim=int(dim), dtype=dtype, itemsize=item)
    num_pages = layout.num_pages
    pages = [_pages(b, num_pages) for b in pages_of]
    return EnginePool(name, engine, kind, layout, pages, _memfd(engine, buf, layout_name))


def _memfd(engine, buf: torch.Tensor, layout_name: str) -> tuple[int, int] | None:
    """(pid, fd) of the memfd holding ``buf`` from its first byte, if it can be shared."""
    fd = getattr(engine, "fd", None)
    if fd is None:
        fd = getattr(getattr(engine, "allocator", None), "fd", None)
    if fd is not None and layout_name == "page_first" and _maps_at_start(fd, buf):
        return (os.getpid(), int(fd))
    return None


def _describe_indexer(engine, layout_name: str) -> EnginePool:
    """SGLang's DSA indexer pool: ``index_k_with_scale_buffer`` ``(pages, layers, 1,
    stride)``, one object per page (``P_h__indexer``), described as a raykv indexer pool
    of bytes with the same page objects at the same offsets."""
    buf = getattr(engine, "index_k_with_scale_buffer", None)
    page = int(getattr(engine, "page_size", 0) or 0)
    if not isinstance(buf, torch.Tensor) or buf.dim() != 4 or page < 1:
        raise ValueError(f"pool 'indexer': {type(engine).__name__} has no page_first "
                         "index_k_with_scale_buffer (pages, layers, 1, stride)")
    num_pages = int(buf.shape[0])
    page_bytes = buf[0].numel() * buf.element_size()
    if page_bytes % page:
        raise ValueError(f"pool 'indexer': {page_bytes} bytes per page do not split into "
                         f"{page} token slots")
    layout = PoolLayout.indexer(page_size=page, size=num_pages * page, layer_num=1,
                                index_head_dim=page_bytes // page, dtype="uint8", itemsize=1)
    return EnginePool(PoolName.INDEXER, engine, "indexer", layout, [_pages(buf, num_pages)],
                      _memfd(engine, buf, layout_name))


def _describe_mamba(engine) -> EnginePool:
    temporal = getattr(engine, "temporal_buffer", None)
    convs = list(getattr(engine, "conv_buffer", None) or [])
    if not convs or not isinstance(temporal, torch.Tensor):
        raise ValueError(f"pool 'mamba': {type(engine).__name__} has no temporal_buffer and "
                         "conv_buffer")
    if getattr(engine, "slot_state_device_tensors", ()):
        raise ValueError("pool 'mamba': slot side states are not served (SGLang's own "
                         "zero-copy backends refuse them too)")
    size = int(convs[0].shape[0])

    def spec(t: torch.Tensor):
        return (tuple(int(d) for d in t.shape[1:]), str(t.dtype).removeprefix("torch."),
                t.element_size())

    has_temporal = temporal.numel() > 0
    layout = PoolLayout.mamba(size=size, temporal=spec(temporal) if has_temporal else None,
                              convs=[spec(c) for c in convs])
    bufs = ([temporal] if has_temporal else []) + convs
    return EnginePool(PoolName.MAMBA, engine, "mamba", layout,
                      [_pages(b, size) for b in bufs])


def _maps_at_start(fd: int, buf: torch.Tensor) -> bool:
    """Whether memfd ``fd`` of this process is mapped with offset 0 at ``buf``'s first
    byte and is at least as large as ``buf`` (so offsets in ``buf`` are offsets in it)."""
    try:
        st = os.fstat(fd)
        if st.st_size < buf.numel() * buf.element_size():
            return False
        start = f"{buf.data_ptr():x}-"
        with open("/proc/self/maps") as f:
            for line in f:
                if line.startswith(start):
                    parts = line.split()
                    return int(parts[2], 16) == 0 and int(parts[4]) == st.st_ino
    except OSError:
        return False
    return False


# -------------------------------------------------------------------- backend
class RayKVStore(HiCacheStorage):
    """SGLang ``HiCacheStorage`` on raykv (see the module docstring).

    Constructed by SGLang's factory as ``RayKVStore(storage_config, {})``. Extra-config
    keys read here: ``ray_address``, ``ray_namespace``, ``ray_auth_mode``,
    ``ray_node_id`` (serve through the cache actor of that node instead of the node Ray
    placed this process on), ``zero_copy`` (default true: share ``allocator: shm``
    memfds), ``staging_pages`` (per pool and direction, default 256),
    ``extra_backend_tag`` (key tag, as in SGLang's MooncakeStore), ``timeout_s`` (the
    deadline of each call to raykv, default 5 s: past it a lookup is a miss, a backup or
    a load fails for its pages, and SGLang keeps serving).
    """

    def __init__(self, storage_config_: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config_.extra_config or {})
        self.sglang_config = storage_config_
        self.config = storage_config(storage_config_)
        self._namespace = connect_ray(extra)
        self._node_id = extra.get("ray_node_id") or None
        self.client = CacheClient(self.config, node_id=self._node_id,
                                  namespace=self._namespace)
        # The node's Mooncake mode decides what zero-copy is possible: in standalone mode
        # the store's buffers belong to mooncake_client, which cannot map SGLang's memfds.
        self._mode = self.client.health()["mode"]
        self._zero_copy = bool(extra.get("zero_copy", True))
        self._allocator = extra.get("allocator")
        self._staging_pages = int(extra.get("staging_pages", STAGING_PAGES))
        self._pools: dict[PoolName, EnginePool] = {}
        self._lock = threading.Lock()
        self._readopt = False
        self._warned_at: dict[str, float] = {}
        self._warned_staging = False
        self.counters: Counter[str] = Counter()
        self._metrics = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                         "backup_bandwidth": []}
        self.mem_pool_host = None
        self.registered_pools = {}
        if not extra.get("interface_v1"):
            log.warning("raykv: \"interface_v1\" is not set in "
                        "--hicache-storage-backend-extra-config: SGLang will use its legacy "
                        "value API, which raykv does not serve (no hits, no backups)")

    # ----------------------------------------------------------- registration
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """The anchor (KV) host pool."""
        super().register_mem_pool_host(mem_pool_host)
        self._register(PoolName.KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Any pool of the host pool group (KV again included). ``ValueError`` for a pool
        raykv does not serve (SGLang then fails the attach with that message)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        value = getattr(host_pool_name, "value", host_pool_name)
        name = SUPPORTED_POOLS.get(str(value))
        if name is None:
            raise ValueError(f"raykv does not serve SGLang pool {value!r} (served: "
                             f"{sorted(SUPPORTED_POOLS)})")
        self._register(name, host_pool)

    def on_host_pools_registered(self) -> None:
        """Register the deployment with the controller now, so a conflict with the rest
        of the group (TP size, MLA flag, pool kinds) fails the attach."""
        if PoolName.KV not in self._pools:
            raise ValueError("raykv: no KV host pool was registered")
        self.client.register_deployment()

    def _register(self, name: PoolName, engine) -> None:
        with self._lock:
            old = self._pools.get(name)
            if old is not None and old.engine is engine:
                return
            try:
                ep = describe_pool(name, engine)
            except ValueError as e:
                raise ValueError(f"raykv cannot serve this SGLang HiCache config: {e}") from None
            if name == PoolName.KV:
                want = "mla" if self.config.is_mla_model else "mha"
                if ep.kind != want:
                    raise ValueError(f"raykv: the KV host pool is {ep.kind.upper()} but SGLang "
                                     f"says is_mla_model={self.config.is_mla_model}")
            self._serve(ep)
            self._pools[name] = ep
            if name == PoolName.KV:
                self.client.register_mem_pool_host(ep.pool)
            else:
                self.client.register_mem_host_pool_v2(ep.pool, name)

    def _serve(self, ep: EnginePool) -> None:
        """Give ``ep`` its raykv pool: SGLang's memfd adopted by the node actor, or a
        staging pool."""
        hint = ("for zero-copy set \"allocator\": \"shm\" in "
                "--hicache-storage-backend-extra-config (embedded Mooncake mode)")
        if not self._zero_copy:
            why = "zero_copy is off in the extra config"
        elif ep.kind == "mamba":
            why = "Mamba pools are staged"
        elif self._mode != "embedded":
            why = (f"the node's cache actor runs in {self._mode} Mooncake mode, where the "
                   "store's buffers belong to mooncake_client, which cannot map SGLang's "
                   "memory")
            hint = "zero-copy needs raykv in embedded Mooncake mode"
        elif ep.memfd is None:
            why = (f"allocator {self._allocator or 'default'}: its host pool is not a memfd "
                   "of this process")
        else:
            try:
                self._adopt(ep)
                return
            except Exception as e:  # refused, or an actor without the hook
                why = str(e)
        if ep.kind != "mamba" and not self._warned_staging:
            self._warned_staging = True
            log.warning("raykv: host pools are served through a staging copy (%s); %s",
                        why, hint)
        # Mamba slots are large and move one per request: a few staged slots suffice
        # (a call with more goes through in rounds).
        cap = MAMBA_STAGING_SLOTS if ep.kind == "mamba" else self._staging_pages
        ep.staging = max(1, min(cap, ep.layout.num_pages))
        ep.pool = self._create_staging(ep, 2 * ep.staging)

    def _create_staging(self, ep: EnginePool, pages: int) -> HostPool:
        """A raykv pool of ``ep``'s page geometry holding ``pages`` pages."""
        lay = ep.layout
        name = f"sglang-{os.getpid()}-{ep.name.value}-{uuid.uuid4().hex[:8]}"
        size = pages * lay.page_size
        b = lay.buffers
        if lay.kind == "mha":
            layers, heads, dim = b[0].slot_shape
            return self.client.create_host_pool(
                "mha", size=size, page_size=lay.page_size, layer_num=layers, head_num=heads,
                head_dim=dim, dtype=b[0].dtype, name=name, per_process=True)
        if lay.kind == "mla":
            layers, _, dim = b[0].slot_shape
            return self.client.create_host_pool(
                "mla", size=size, page_size=lay.page_size, layer_num=layers, kv_cache_dim=dim,
                dtype=b[0].dtype, name=name, per_process=True)
        if lay.kind == "indexer":
            layers, dim = b[0].slot_shape
            return self.client.create_host_pool(
                "indexer", size=size, page_size=lay.page_size, layer_num=layers,
                index_head_dim=dim, dtype=b[0].dtype, name=name, per_process=True)
        temporal = next((x for x in b if x.name == "temporal"), None)
        convs = [x for x in b if x.name.startswith("conv_")]
        return self.client.create_host_pool(
            "mamba", size=size,
            temporal_shape=temporal.slot_shape if temporal else None,
            temporal_dtype=temporal.dtype if temporal else None,
            conv_shapes=[c.slot_shape for c in convs], conv_dtypes=[c.dtype for c in convs],
            name=name, per_process=True)

    def _adopt(self, ep: EnginePool) -> None:
        """Have the node actor map and register SGLang's memfd of ``ep`` as a pool, then
        map that pool here (the same memory: a second view of SGLang's tensor)."""
        pid, fd = ep.memfd
        name = ep.pool.name if ep.pool is not None else \
            f"sglang-{pid}-{fd}-{uuid.uuid4().hex[:8]}"
        st = os.fstat(fd)  # the memfd that _maps_at_start found under SGLang's tensors
        ep.pool = self.client.adopt_engine_pool(name, f"/proc/{pid}/fd/{fd}", ep.layout,
                                                (st.st_dev, st.st_ino))
        ep.zero_copy = True

    def _readopt_all(self) -> None:
        """After the node actor restarted: register SGLang's memfds with it again."""
        with self._lock:
            if not self._readopt:
                return
            for ep in self._pools.values():
                if ep.zero_copy:
                    self._adopt(ep)
            self._readopt = False

    # ----------------------------------------------------------------- helpers
    def _warn(self, what: str, e: BaseException) -> None:
        """Count and (rate-limited) log a failed call. After an unavailable node actor
        (a restart) the zero-copy pools are adopted again before the next call; not after
        a deadline: the actor is slow or hung, not new, and adopting is a control call
        that would hold SGLang's thread while it stays hung."""
        self.counters[f"{what}_failures"] += 1
        restarted = isinstance(e, NodeUnavailableError) and not isinstance(
            e, DeadlineExceededError)
        if restarted or "does not have" in str(e):
            self._readopt = self._readopt or any(p.zero_copy for p in self._pools.values())
        now = time.monotonic()
        if now - self._warned_at.get(what, -1e9) >= WARN_EVERY_S:
            self._warned_at[what] = now
            log.warning("raykv %s failed, reported as misses / failed pages: %s", what, e)

    def _ready(self) -> None:
        if self._readopt:
            self._readopt_all()

    def _transfers(self, transfers) -> list[tuple[EnginePool, list[str], list[int], Any]]:
        """(pool, keys, page starts in SGLang's pool, hit policy) per SGLang transfer;
        sidecars take their indices from their source pool's transfer."""
        by_name = {str(getattr(t.name, "value", t.name)): t for t in transfers}
        out = []
        for t in transfers:
            value = str(getattr(t.name, "value", t.name))
            name = SUPPORTED_POOLS.get(value)
            if name is None or name not in self._pools:
                raise ValueError(f"pool {value!r} is not registered with raykv")
            ep = self._pools[name]
            idx, keys = t.host_indices, t.keys
            if idx is None and t.indices_from_pool is not None:  # a sidecar: its source's
                src = by_name.get(str(getattr(t.indices_from_pool, "value",
                                              t.indices_from_pool)))
                idx = None if src is None else src.host_indices
                keys = keys if keys is not None or src is None else src.keys
            keys = list(keys or [])
            if idx is None:
                raise ValueError(f"pool {value!r}: the transfer has no host indices")
            starts = ep.layout.page_starts(_np(idx), len(keys))
            out.append((ep, keys, starts, t.hit_policy))
        return out

    def _move(self, items, write: bool) -> dict[PoolName, list[bool]]:
        """Put (``write``) or get the pages of ``items`` through the client; staged pools
        go through their staging half in rounds of at most ``staging`` pages."""
        results: dict[PoolName, list[bool]] = {ep.name: [] for ep, *_ in items}
        staged = [it for it in items if not it[0].zero_copy]
        direct = [it for it in items if it[0].zero_copy]
        half = 0 if write else 1
        locks = sorted({id(ep): ep.locks[half] for ep, *_ in staged}.items())
        with contextlib.ExitStack() as stack:
            for _, lock in locks:
                stack.enter_context(lock)
            closed = [ep.name.value for ep, *_ in staged if ep.closed]
            if closed:  # its mapping here is gone: a copy would fault
                raise ValueError(f"raykv: the backend was closed (pools {closed})")
            rounds = max([-(-len(keys) // ep.staging) for ep, keys, *_ in staged] + [1])
            for r in range(rounds):
                calls, plan = [], []
                for ep, keys, starts, policy in (direct if r == 0 else []):
                    calls.append(PoolTransfer(ep.name, keys, _slots(starts, ep.page_size),
                                              PoolHitPolicy(str(getattr(policy, "value",
                                                                        policy)))))
                    plan.append((ep, None, None))
                for ep, keys, starts, _policy in staged:
                    lo, hi = r * ep.staging, min(len(keys), (r + 1) * ep.staging)
                    if lo >= hi:
                        continue
                    first = half * ep.staging
                    spages = list(range(first, first + hi - lo))
                    epages = [s // ep.page_size for s in starts[lo:hi]]
                    if write:
                        self._copy(ep, epages, spages, to_stage=True)
                    calls.append(PoolTransfer(ep.name, keys[lo:hi],
                                              _slots([p * ep.page_size for p in spages],
                                                     ep.page_size)))
                    plan.append((ep, epages, spages))
                if not calls:
                    continue
                out = (self.client.batch_set_v2(calls) if write
                       else self.client.batch_get_v2(calls))
                for ep, epages, spages in plan:
                    ok = out[ep.name]
                    if epages is not None and not write:
                        good = [i for i, v in enumerate(ok) if v]
                        self._copy(ep, [epages[i] for i in good], [spages[i] for i in good],
                                   to_stage=False)
                    results[ep.name].extend(ok)
        return results

    def _copy(self, ep: EnginePool, epages: list[int], spages: list[int],
              to_stage: bool) -> None:
        """Copy SGLang pages ``epages`` to staging pages ``spages`` (or back), one slice
        copy per run of pages consecutive on both sides (no gather into a temporary)."""
        staged = [_pages(b, ep.pool.size // ep.page_size) for b in ep.pool.buffers]
        for e0, s0, n in _runs(epages, spages):
            for engine_pages, stage_pages in zip(ep.pages, staged, strict=True):
                if to_stage:
                    stage_pages[s0:s0 + n].copy_(engine_pages[e0:e0 + n])
                else:
                    engine_pages[e0:e0 + n].copy_(stage_pages[s0:s0 + n])
        self.counters["staged_bytes"] += len(epages) * sum(b.shape[1] for b in ep.pages)

    # ------------------------------------------------------------------ v1 API
    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading pages whose KV objects exist for every TP rank of the deployment."""
        if not keys:
            return 0
        try:
            self._ready()
            return self.client.group_exists(list(keys)).kv_hit_pages
        except Exception as e:
            self._warn("batch_exists", e)
            return 0

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._kv_v1(keys, host_indices, write=True)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._kv_v1(keys, host_indices, write=False)

    def _kv_v1(self, keys, host_indices, write: bool) -> list[bool]:
        if not keys:
            return []
        t = SGPoolTransfer(name=SGPoolName.KV, host_indices=host_indices, keys=list(keys))
        out = self._v2([t], write, "batch_set_v1" if write else "batch_get_v1")
        return out.get(SGPoolName.KV, [False] * len(keys))

    # ------------------------------------------------------------------ v2 API
    def batch_exists_v2(self, keys: list[str], pool_transfers: list | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None):
        """The longest prefix KV and every pool of ``pool_transfers`` can restore, for
        the whole TP group (raykv's group query)."""
        if not keys:
            return SGPoolTransferResult(0, {}, [])
        try:
            self._ready()
            queries = []
            for t in pool_transfers or []:
                value = str(getattr(t.name, "value", t.name))
                if value == PoolName.KV.value:
                    continue
                if value not in SUPPORTED_POOLS or t.hit_policy == SGPoolHitPolicy.BLOCK_GROUPS:
                    raise ValueError(f"pool {value!r} / hit policy {t.hit_policy} not served")
                queries.append(PoolTransfer(SUPPORTED_POOLS[value], list(t.keys or []) or None,
                                            None, PoolHitPolicy(str(getattr(
                                                t.hit_policy, "value", t.hit_policy)))))
            hit = self.client.group_exists(list(keys), queries)
            return SGPoolTransferResult(
                hit.kv_hit_pages,
                {SGPoolName(p.value): n for p, n in hit.extra_pool_hit_pages.items()},
                list(hit.restorable_prefix_pages))
        except Exception as e:
            self._warn("batch_exists_v2", e)
            return SGPoolTransferResult(0, {}, [])

    def batch_set_v2(self, transfers: list, extra_info=None) -> dict:
        """Never raises: a failure reports every page of the call as not stored."""
        return self._v2(transfers, True, "batch_set_v2")

    def batch_get_v2(self, transfers: list, extra_info=None) -> dict:
        return self._v2(transfers, False, "batch_get_v2")

    def _v2(self, transfers, write: bool, what: str) -> dict:
        start = time.perf_counter()
        try:
            self._ready()
            items = self._transfers(transfers)
            out = self._move(items, write)
            result = {SGPoolName(n.value): v for n, v in out.items()}
        except Exception as e:
            self._warn(what, e)
            most = max((len(t.keys or []) for t in transfers), default=0)
            return {t.name: [False] * (len(t.keys) if t.keys is not None else most)
                    for t in transfers}
        pages = sum(sum(v) for v in result.values())
        nbytes = sum(sum(v) * sum(ep.layout.object_sizes) for (ep, *_), v in
                     zip(items, (out[ep.name] for ep, *_ in items), strict=True))
        self.counters[f"{'set' if write else 'get'}_pages"] += pages
        if self.config.enable_storage_metrics:
            kind = "backup" if write else "prefetch"
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(
                nbytes / max(time.perf_counter() - start, 1e-9) / 1e9)
        return result

    # --------------------------------------------------- legacy abstract API
    # SGLang without "interface_v1" hands page *values* (tensors) to batch_set and
    # batch_get. raykv moves bytes only between registered pools and the store, never
    # through a call, so that path is refused: one warning, then False / misses, and
    # SGLang recomputes. The pointer form (target_locations = ints) is served when every
    # pointer lies inside one of SGLang's registered host pools (keys then carry their
    # own suffixes, as in MooncakeStore's pointer API; the model tag is added once).
    def _legacy(self, what: str, values, locations) -> list[int] | None:
        """Pointers of the legacy call in raykv's mappings, or None (refused, warned)."""
        if values is not None or locations is None or any(
                not isinstance(p, int) for p in locations):
            if not self._warned_at.get("legacy"):
                self._warned_at["legacy"] = time.monotonic()
                log.warning("raykv: SGLang called the legacy %s with page values; raykv "
                            "serves only the v1/v2 API: add \"interface_v1\": 1 to "
                            "--hicache-storage-backend-extra-config", what)
            return None
        out = []
        for p in locations:
            for ep in self._pools.values():
                base = ep.pages[0].data_ptr()
                end = base + sum(b.numel() for b in ep.pages)
                if ep.zero_copy and base <= p < end:
                    out.append(ep.pool.base_ptr + (p - base))
                    break
            else:
                out.append(p)  # the client refuses it unless it lies in a raykv pool
        return out

    def get(self, key, target_location=None, target_sizes=None):
        """One object into a pointer (see ``batch_get``): True, or None if not read."""
        n = self.batch_get([key], None if target_location is None else [target_location],
                           None if target_sizes is None else [target_sizes])
        return True if n == 1 else None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Legacy pointer API: the number of leading objects read in full (0 on any
        failure); the value form returns ``[None] * len(keys)`` (see above)."""
        ptrs = self._legacy("batch_get", None, target_locations)
        if ptrs is None:
            return [None] * len(keys)
        try:
            self._ready()
            return self.client.batch_get(list(keys), ptrs, target_sizes)
        except Exception as e:
            self._warn("batch_get", e)
            return 0

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        """One object from a pointer (see ``batch_set``)."""
        return self.batch_set([key], None if value is None else [value],
                              None if target_location is None else [target_location],
                              None if target_sizes is None else [target_sizes])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """Legacy pointer API: True only if every object was stored; False for the value
        form (see above) and on any failure."""
        ptrs = self._legacy("batch_set", values, target_locations)
        if ptrs is None:
            return False
        try:
            self._ready()
            return self.client.batch_set(list(keys), ptrs, target_sizes)
        except Exception as e:
            self._warn("batch_set", e)
            return False

    def exists(self, key) -> bool:
        """Whether the KV objects of page ``key`` exist for this rank."""
        try:
            self._ready()
            return self.client.batch_exists([key]) == 1
        except Exception as e:
            self._warn("exists", e)
            return False

    # ----------------------------------------------------------------- misc
    def get_stats(self):
        """SGLang's ``StorageMetrics`` since the last call (with
        ``enable_storage_metrics``), else None."""
        if not self.config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        for k, v in self._metrics.items():
            getattr(m, k).extend(v)
            v.clear()
        return m

    def raykv_stats(self) -> dict:
        """This backend's counters and how each pool is served."""
        return {"counters": dict(self.counters), "mode": self._mode,
                "pools": {n.value: {"zero_copy": p.zero_copy, "raykv_pool": p.pool.name,
                                    "memfd": p.memfd, "kind": p.kind}
                          for n, p in self._pools.items()}}

    def clear(self) -> None:
        """raykv never deletes shared objects on one engine's behalf (other engines and
        nodes may be reading them); objects leave the store by Mooncake's eviction."""
        log.info("raykv: clear() leaves the shared store as it is")

    def close(self) -> None:
        """Drop this backend's pools from the node actor and close the client (from
        any thread; a second call does nothing more). A staging pool goes only once the
        staged transfer under way on it has ended (both its locks taken): its copies run
        on this process's mapping of the pool, which destroying it unmaps at once (torch
        views keep no mapping alive), so a copy under way would fault (SIGSEGV). So
        close() may wait for one transfer per pool (its rounds' store calls, each within
        ``timeout_s``). Store calls in flight on a zero-copy pool are waited for by the
        node actor. Calls after close() fail their pages, never raise."""
        with self._lock:
            for ep in self._pools.values():
                with ep.locks[0], ep.locks[1]:
                    ep.closed = True
                    if ep.pool is not None:
                        with contextlib.suppress(Exception):
                            self.client.destroy_host_pool(ep.pool)
            self._pools.clear()
            with contextlib.suppress(Exception):
                self.client.close()


def _np(idx):
    return idx.cpu().numpy() if isinstance(idx, torch.Tensor) else idx


def _runs(a: list[int], b: list[int]) -> list[tuple[int, int, int]]:
    """``(a0, b0, n)`` per maximal run where ``a`` and ``b`` both go up by one per item:
    ``_runs([4, 5, 9], [0, 1, 2]) == [(4, 0, 2), (9, 2, 1)]``."""
    out: list[tuple[int, int, int]] = []
    for x, y in zip(a, b, strict=True):
        if out and x == out[-1][0] + out[-1][2] and y == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((x, y, 1))
    return out


def _slots(starts: list[int], page_size: int) -> torch.Tensor:
    """Token slots of pages starting at ``starts``."""
    if not starts:
        return torch.empty(0, dtype=torch.int64)
    return (torch.as_tensor(starts)[:, None] + torch.arange(page_size)[None, :]).reshape(-1)
