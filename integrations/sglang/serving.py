"""How the SGLang backend serves SGLang's host pools through a ``CacheClient``: SGLang's
memfd adopted by the node actor (zero-copy), or a staging pool (no SGLang import).

Threads: registration, re-adoption and ``close`` hold ``lock``; SGLang's storage threads
call the client's batch calls, which take each staged pool's direction lock for their
whole run (``staging_pools.staged_call``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid

from raykv.cache_actors.rank.client import CacheClient
from raykv.cache_actors.rank.staging_pools import StagedPool, staging_layout
from raykv.controllers.contract import PoolName
from raykv.integrations.sglang.config import MAMBA_STAGING_SLOTS, BackendOptions
from raykv.integrations.sglang.pools import EnginePool, describe_pool

log = logging.getLogger("raykv.integrations.sglang")


class ServedPools:
    """SGLang's host pools by raykv role, each adopted or staged, registered with
    ``client``. ``mode``: the node's Mooncake mode (in standalone mode the store's
    buffers belong to ``mooncake_client``, which cannot map SGLang's memfds)."""

    def __init__(self, client: CacheClient, mode: str, opts: BackendOptions,
                 is_mla_model: bool) -> None:
        self.client = client
        self.mode = mode
        self.opts = opts
        self.is_mla_model = is_mla_model
        self.pools: dict[PoolName, EnginePool] = {}
        self.lock = threading.Lock()
        self.readopt = False
        self._warned_staging = False

    def register(self, role: PoolName, engine) -> None:
        """Serve SGLang's host pool ``engine`` as ``role`` (again only if it is another
        object); ``ValueError`` naming why it cannot be served."""
        with self.lock:
            old = self.pools.get(role)
            if old is not None and old.engine is engine:
                return
            try:
                ep = describe_pool(role, engine)
            except ValueError as e:
                raise ValueError(f"raykv cannot serve this SGLang HiCache config: {e}") from None
            if role == PoolName.KV:
                want = "mla" if self.is_mla_model else "mha"
                if ep.kind != want:
                    raise ValueError(f"raykv: the KV host pool is {ep.kind.upper()} but SGLang "
                                     f"says is_mla_model={self.is_mla_model}")
            self._serve(ep)
            self.pools[role] = ep
            served = ep.staged if ep.staged is not None else ep.pool
            if role == PoolName.KV:
                self.client.register_mem_pool_host(served)
            else:
                self.client.register_mem_host_pool_v2(served, role)

    def _serve(self, ep: EnginePool) -> None:
        """Give ``ep`` its raykv pool: SGLang's memfd adopted by the node actor, or a
        staging pool (one warning names why and what would make it zero-copy)."""
        hint = ("for zero-copy set \"allocator\": \"shm\" in "
                "--hicache-storage-backend-extra-config (embedded Mooncake mode)")
        if not self.opts.zero_copy:
            why = "zero_copy is off in the extra config"
        elif ep.kind == "mamba":
            why = "Mamba pools are staged"
        elif self.mode != "embedded":
            why = (f"the node actor runs in {self.mode} Mooncake mode, where the "
                   "store's buffers belong to mooncake_client, which cannot map SGLang's "
                   "memory")
            hint = "zero-copy needs raykv in embedded Mooncake mode"
        elif ep.memfd is None and self.opts.allocator == "shm":  # the flag is set
            order = getattr(ep.engine, "layout", "page_first")
            if order != "page_first":
                why = (f"host layout {order}: raykv maps SGLang's memfds only in the "
                       "page_first layout")
                hint = "for zero-copy use --hicache-mem-layout page_first"
            else:
                why = "SGLang's memfd does not hold this host pool from its first byte"
                hint = "zero-copy is not possible for this pool"
        elif ep.memfd is None:
            why = (f"allocator {self.opts.allocator or 'default'}: its host pool is not a "
                   "memfd of this process")
        else:
            try:
                self._adopt(ep)
                return
            except Exception as e:  # refused, or an actor without the hook
                why = f"the node actor did not map SGLang's memfd: {e}"
                hint = "pages are copied instead"
        if ep.kind != "mamba" and not self._warned_staging:
            self._warned_staging = True
            log.warning("raykv: host pools are served through a staging copy (%s); %s",
                        why, hint)
        cap = MAMBA_STAGING_SLOTS if ep.kind == "mamba" else self.opts.staging_pages
        window = max(1, min(cap, ep.layout.num_pages))
        name = f"sglang-{os.getpid()}-{ep.role.value}-{uuid.uuid4().hex[:8]}"
        ep.pool = self.client.create_host_pool(staging_layout(ep.layout, 2 * window),
                                               name=name, per_process=True)
        ep.staged = StagedPool(ep.memory, ep.pool, window)

    def _adopt(self, ep: EnginePool) -> None:
        """Have the node actor map and register SGLang's memfd of ``ep`` as a pool, then
        map that pool here (the same memory: a second view of SGLang's tensor)."""
        pid, fd = ep.memfd
        name = ep.pool.name if ep.pool is not None else \
            f"sglang-{pid}-{fd}-{uuid.uuid4().hex[:8]}"
        st = os.fstat(fd)  # the memfd that maps_at_start found under SGLang's tensors
        ep.pool = self.client.adopt_engine_pool(name, f"/proc/{pid}/fd/{fd}", ep.layout,
                                                (st.st_dev, st.st_ino))

    def mark_readopt(self) -> None:
        """The node actor restarted: adopt the zero-copy pools again before the next
        call."""
        self.readopt = self.readopt or any(p.zero_copy for p in self.pools.values())

    def readopt_all(self) -> None:
        """After the node actor restarted: register SGLang's memfds with it again."""
        with self.lock:
            if not self.readopt:
                return
            for ep in self.pools.values():
                if ep.zero_copy:
                    self._adopt(ep)
            self.readopt = False

    def pointer(self, p: int) -> int:
        """Pointer ``p`` into one of SGLang's zero-copy pools as the same byte in raykv's
        mapping of it; any other pointer as it is (the client refuses it unless it lies
        in a raykv pool). ``ValueError`` for a pointer into a staged pool: the store
        moves only the bytes of its staging pool, which the legacy pointer API does not
        copy."""
        for ep in self.pools.values():
            if not any(b.data_ptr() <= p < b.data_ptr() + b.numel() for b in ep.pages):
                continue
            if not ep.zero_copy:
                raise ValueError(
                    f"pointer {p:#x} lies in SGLang's {ep.role.value} host pool, which "
                    "raykv serves through a staging copy: the legacy pointer API needs a "
                    "zero-copy pool (\"allocator\": \"shm\", page_first, embedded "
                    "Mooncake mode)")
            # one memfd from the pool's first byte: offsets in it are offsets in raykv's
            return ep.pool.base_ptr + (p - ep.pages[0].data_ptr())
        return p

    def staged_bytes(self) -> int:
        """Bytes copied between SGLang's pools and their staging pools."""
        return sum(ep.staged.copied_bytes for ep in self.pools.values()
                   if ep.staged is not None)

    def stats(self) -> dict:
        """How each pool is served."""
        return {n.value: {"zero_copy": p.zero_copy, "raykv_pool": p.pool.name,
                          "memfd": p.memfd, "kind": p.kind} for n, p in self.pools.items()}

    def close(self) -> None:
        """Drop every pool from the node actor and close the client. A staging pool
        goes only once the staged transfer under way on it has ended (both its locks
        taken): its copies run on this process's mapping of the pool, which destroying
        it unmaps at once, so a copy under way would fault (SIGSEGV). Store calls in
        flight on a zero-copy pool are waited for by the node actor."""
        with self.lock:
            for ep in self.pools.values():
                closing = ep.staged.closing() if ep.staged is not None else \
                    contextlib.nullcontext()
                with closing:
                    if ep.pool is not None:
                        with contextlib.suppress(Exception):
                            self.client.destroy_host_pool(ep.pool)
            self.pools.clear()
            with contextlib.suppress(Exception):
                self.client.close()
