"""SGLang's host pools described in raykv terms (torch only: no SGLang, no Ray import).

``describe_pool`` reads an SGLang host pool by its attribute names (``layout``,
``kv_buffer``, ``page_size``, ``fd`` / ``allocator.fd``, the indexer and Mamba buffers),
so it runs (and is tested) without SGLang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from raykv.cache_actors.host_pools import HostPool
from raykv.cache_actors.rank.staging_pools import (
    EngineMemory,
    StagedPool,
    describe_kv_buffer,
    dtype_of,
    page_views,
)
from raykv.controllers.contract import PoolName
from raykv.controllers.pool_layout import PoolLayout

SERVABLE_ORDERS = ("page_first", "page_first_direct")


@dataclass
class EnginePool:
    """One SGLang host pool as raykv serves it.

    ``role``: what SGLang registered it as. ``memory``: SGLang's pool in raykv terms
    (``EngineMemory``: layout and page views). ``memfd``: ``(pid, fd)`` of SGLang's memfd
    holding it from its first byte, when it can be shared. ``pool``: the raykv pool calls
    name: SGLang's own memory mapped again (zero-copy) or the staging pool of ``staged``.
    ``engine``: SGLang's host pool object.
    """

    role: PoolName
    engine: Any
    memory: EngineMemory
    memfd: tuple[int, int] | None = None
    pool: HostPool | None = None
    staged: StagedPool | None = None

    @property
    def kind(self) -> str:
        return self.memory.kind

    @property
    def layout(self) -> PoolLayout:
        return self.memory.layout

    @property
    def pages(self) -> list[torch.Tensor]:
        return self.memory.pages

    @property
    def zero_copy(self) -> bool:
        """Whether raykv serves SGLang's own memory (an adopted memfd)."""
        return self.pool is not None and self.staged is None


def describe_pool(role: PoolName, engine: Any) -> EnginePool:
    """How raykv serves SGLang host pool ``engine`` registered as ``role``; ``ValueError``
    naming why it cannot (layout, buffer shapes)."""
    order = getattr(engine, "layout", "page_first")
    if order not in SERVABLE_ORDERS:
        raise ValueError(f"pool {role.value!r}: host layout {order!r} cannot be served "
                         "(a page must be one contiguous run per buffer): use page_first or "
                         "page_first_direct")
    if role == PoolName.MAMBA:
        return EnginePool(role, engine, _describe_mamba(engine))
    if role == PoolName.INDEXER:
        buf = getattr(engine, "index_k_with_scale_buffer", None)
        return EnginePool(role, engine, _describe_indexer(engine),
                          _memfd(engine, buf, order))
    buf = getattr(engine, "kv_buffer", None)
    page = int(getattr(engine, "page_size", 0) or 0)
    if not isinstance(buf, torch.Tensor) or page < 1:
        raise ValueError(f"pool {role.value!r}: {type(engine).__name__} has no kv_buffer "
                         "tensor and page_size; raykv serves MHA/MLA KV-like pools and Mamba")
    try:
        memory = describe_kv_buffer(buf, page, order)
    except ValueError as e:
        raise ValueError(f"pool {role.value!r}: {e}") from None
    return EnginePool(role, engine, memory, _memfd(engine, buf, order))


def _describe_indexer(engine: Any) -> EngineMemory:
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
    return EngineMemory(layout, [page_views(buf, num_pages)])


def _describe_mamba(engine: Any) -> EngineMemory:
    """SGLang's Mamba pool: ``temporal_buffer`` (absent when empty) and ``conv_buffer``,
    one slot per checkpoint; slot side states are refused."""
    temporal = getattr(engine, "temporal_buffer", None)
    convs = list(getattr(engine, "conv_buffer", None) or [])
    if not convs or not isinstance(temporal, torch.Tensor):
        raise ValueError(f"pool 'mamba': {type(engine).__name__} has no temporal_buffer and "
                         "conv_buffer")
    if getattr(engine, "slot_state_device_tensors", ()):
        raise ValueError("pool 'mamba': slot side states are not served (SGLang's own "
                         "zero-copy backends refuse them too)")
    size = int(convs[0].shape[0])

    def spec(t: torch.Tensor) -> tuple[tuple[int, ...], str, int]:
        return (tuple(int(d) for d in t.shape[1:]), *dtype_of(t))

    has_temporal = temporal.numel() > 0
    layout = PoolLayout.mamba(size=size, temporal=spec(temporal) if has_temporal else None,
                              convs=[spec(c) for c in convs])
    bufs = ([temporal] if has_temporal else []) + convs
    return EngineMemory(layout, [page_views(b, size) for b in bufs])


def _memfd(engine: Any, buf: torch.Tensor, order: str) -> tuple[int, int] | None:
    """(pid, fd) of the memfd holding ``buf`` from its first byte, if it can be shared."""
    fd = getattr(engine, "fd", None)
    if fd is None:
        fd = getattr(getattr(engine, "allocator", None), "fd", None)
    if fd is not None and order == "page_first" and maps_at_start(fd, buf):
        return (os.getpid(), int(fd))
    return None


def maps_at_start(fd: int, buf: torch.Tensor) -> bool:
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
