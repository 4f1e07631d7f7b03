"""Host pool geometry and page arithmetic. Pure: numpy only.

A pool is one region of shared memory holding one or more *buffers*. Every buffer is laid out
``page_first``: token slot outermost, so the ``page_size`` slots of one page are one
contiguous run of bytes in each buffer, and a page is one Mooncake object per buffer.

Kinds and their buffers (in key order):
- ``mha``: ``k``, ``v``, each ``(size, layer_num, head_num, head_dim)``; back to back, so
  ``kv_buffer`` is one ``(2, size, layer_num, head_num, head_dim)`` tensor.
- ``mla``: ``kv``, ``(size, layer_num, 1, kv_cache_dim)``.
- ``mamba``: ``temporal`` (absent when the temporal state is empty) then ``conv_0``,
  ``conv_1``... of their own shapes and dtypes; ``page_size`` 1, one slot per checkpoint.
- ``indexer``: ``indexer``, ``(size, layer_num, index_head_dim)`` (DSA indexer keys).
- ``vllm``: ``kv``, one vLLM KV block per page holding every layer: page ``p`` is
  ``(layer_num, head_num, page_size, head_dim)`` (vLLM's CPU block layout per layer,
  ``head_dim`` = K and V side by side), so a page is one object and one block of one
  layer is one contiguous run. The buffer's slot shape ``(layer_num, head_num,
  head_dim)`` only sizes it; ``HostPool.kv_buffer`` is the page view.

Units: ``size`` and ``page_size`` count token slots; offsets and sizes count bytes from
the start of the pool's memory. ``host_indices`` are token-slot indices, one per token,
``page_size`` per page, each page's slots contiguous and page-aligned.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
"""Byte units: every size in raykv is in bytes; these name the powers of two."""

POOL_KINDS = ("mha", "mla", "mamba", "indexer", "vllm")
ORDERS = ("page_first", "layer_first")  # SGLang's host "mem layout" names
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_pool_name(name: str) -> str:
    """Return ``name`` if it can name a pool (and its shared-memory file), else raise
    ``ValueError``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"pool name {name!r} is invalid: use 1-64 characters of letters, digits, '_', '.', "
            "'-', starting with a letter or digit"
        )
    return name


def _positive(what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class BufferSpec:
    """One buffer of a pool: its name, the shape of one token slot, its dtype."""

    name: str
    slot_shape: tuple[int, ...]
    dtype: str
    itemsize: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "slot_shape", tuple(self.slot_shape))
        for i, d in enumerate(self.slot_shape):
            _positive(f"buffer {self.name!r} dimension {i}", d)
        _positive(f"buffer {self.name!r} itemsize", self.itemsize)

    @property
    def slot_bytes(self) -> int:
        return math.prod(self.slot_shape) * self.itemsize


@dataclass(frozen=True)
class PoolLayout:
    """Shape of one host pool: kind, page geometry and buffers (see module docstring)."""

    kind: str
    page_size: int
    size: int
    buffers: tuple[BufferSpec, ...]
    order: str = "page_first"

    def __post_init__(self) -> None:
        object.__setattr__(self, "buffers", tuple(
            b if isinstance(b, BufferSpec) else BufferSpec(**b) for b in self.buffers))
        if self.kind not in POOL_KINDS:
            raise ValueError(f"pool kind {self.kind!r} is unknown: expected one of {POOL_KINDS}")
        if self.order not in ORDERS:
            raise ValueError(f"page order {self.order!r} is unknown: expected one of {ORDERS}")
        if self.order != "page_first":
            raise ValueError(
                f"{self.kind.upper()} page order {self.order!r} cannot be served: a page must "
                "be contiguous across layers to be one Mooncake object; use 'page_first'")
        _positive(f"{self.kind} pool page_size", self.page_size)
        _positive(f"{self.kind} pool size", self.size)
        if self.size % self.page_size:
            raise ValueError(f"pool size {self.size} is not a multiple of page_size "
                             f"{self.page_size}")
        if self.kind == "mamba" and self.page_size != 1:
            raise ValueError(f"a mamba pool holds one checkpoint per slot: page_size must be "
                             f"1, got {self.page_size}")
        if not self.buffers:
            raise ValueError(f"a {self.kind} pool needs at least one buffer")

    # ------------------------------------------------------------ factories
    @classmethod
    def mha(cls, *, page_size: int, size: int, layer_num: int, head_num: int, head_dim: int,
            dtype: str, itemsize: int, order: str = "page_first") -> PoolLayout:
        shape = (_positive("mha pool layer_num", layer_num),
                 _positive("mha pool head_num", head_num),
                 _positive("mha pool head_dim", head_dim))
        return cls("mha", page_size, size, (BufferSpec("k", shape, dtype, itemsize),
                                            BufferSpec("v", shape, dtype, itemsize)), order)

    @classmethod
    def mla(cls, *, page_size: int, size: int, layer_num: int, kv_cache_dim: int, dtype: str,
            itemsize: int, order: str = "page_first") -> PoolLayout:
        shape = (_positive("mla pool layer_num", layer_num), 1,
                 _positive("mla pool kv_cache_dim", kv_cache_dim))
        return cls("mla", page_size, size, (BufferSpec("kv", shape, dtype, itemsize),), order)

    @classmethod
    def indexer(cls, *, page_size: int, size: int, layer_num: int, index_head_dim: int,
                dtype: str, itemsize: int, order: str = "page_first") -> PoolLayout:
        shape = (_positive("indexer pool layer_num", layer_num),
                 _positive("indexer pool index_head_dim", index_head_dim))
        return cls("indexer", page_size, size,
                   (BufferSpec("indexer", shape, dtype, itemsize),), order)

    @classmethod
    def vllm(cls, *, page_size: int, size: int, layer_num: int, head_num: int, head_dim: int,
             dtype: str, itemsize: int, order: str = "page_first") -> PoolLayout:
        """vLLM KV blocks, ``page_size`` = vLLM's block size: page ``p`` is ``(layer_num,
        head_num, page_size, head_dim)``, all layers of one block in one object."""
        shape = (_positive("vllm pool layer_num", layer_num),
                 _positive("vllm pool head_num", head_num),
                 _positive("vllm pool head_dim", head_dim))
        return cls("vllm", page_size, size, (BufferSpec("kv", shape, dtype, itemsize),), order)

    @classmethod
    def mamba(cls, *, size: int, temporal: tuple[tuple[int, ...], str, int] | None,
              convs: Sequence[tuple[tuple[int, ...], str, int]]) -> PoolLayout:
        """``temporal`` and each of ``convs`` are ``(slot_shape, dtype, itemsize)``; a
        temporal state that is None, ``()`` or has a zero dimension (conv-only models) has
        no buffer and no object."""
        if not convs:
            raise ValueError("a mamba pool needs at least one conv buffer")
        buffers = []
        if temporal is not None and len(temporal[0]) and math.prod(temporal[0]) > 0:
            buffers.append(BufferSpec("temporal", *temporal))
        buffers += [BufferSpec(f"conv_{i}", *c) for i, c in enumerate(convs)]
        return cls("mamba", 1, size, tuple(buffers))

    # ------------------------------------------------------------- geometry
    @property
    def buffer_offsets(self) -> list[int]:
        """Byte offset of each buffer in the pool (aligned to the buffer's itemsize)."""
        offsets, end = [], 0
        for b in self.buffers:
            end = -(-end // b.itemsize) * b.itemsize
            offsets.append(end)
            end += self.size * b.slot_bytes
        return offsets

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        last = self.buffers[-1]
        return self.buffer_offsets[-1] + self.size * last.slot_bytes

    @property
    def objects_per_page(self) -> int:
        return len(self.buffers)

    @property
    def object_sizes(self) -> list[int]:
        """Bytes of one page's object in each buffer, in key order."""
        return [self.page_size * b.slot_bytes for b in self.buffers]

    @property
    def object_bytes(self) -> int:
        """Bytes of every page object, for pools whose buffers all have one size."""
        sizes = set(self.object_sizes)
        if len(sizes) != 1:
            raise ValueError(f"{self.kind} pool objects differ in size: {self.object_sizes}")
        return sizes.pop()

    @property
    def num_pages(self) -> int:
        return self.size // self.page_size

    @cached_property
    def _object_bases(self) -> tuple[tuple[int, int], ...]:
        """(byte offset of the buffer, bytes per slot) of each buffer, in key order."""
        return tuple(zip(self.buffer_offsets, (b.slot_bytes for b in self.buffers),
                         strict=True))

    @cached_property
    def _page_run(self) -> np.ndarray:
        """0, 1, ..., page_size - 1: a page's slots relative to its first."""
        return np.arange(self.page_size)

    def page_starts(self, host_indices: Sequence[int] | np.ndarray, num_keys: int) -> list[int]:
        """Validate ``host_indices`` for ``num_keys`` pages; return each page's first slot.

        Raises ``ValueError`` naming the problem when the count does not match, a page
        is not contiguous, an index lies outside the pool, or a page is not page-aligned.
        Contiguity is one whole-array test, the rest is checked on the page starts
        (which bound every index of contiguous pages); which page fails is worked out
        only on failure.
        """
        idx = np.asarray(host_indices)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise ValueError(f"host_indices must be a 1-D sequence of ints, got {idx.dtype} "
                             f"with shape {idx.shape}")
        if idx.size != num_keys * self.page_size:
            raise ValueError(
                f"host_indices has {idx.size} entries but {num_keys} keys need "
                f"{num_keys * self.page_size} ({self.page_size} per page)")
        if idx.size == 0:
            return []
        pages = idx.reshape(num_keys, self.page_size)
        out = pages[:, 0].tolist()
        if self.page_size > 1 and not (pages - pages[:, :1] == self._page_run).all():
            ragged = (pages - pages[:, :1] != self._page_run).any(axis=1)
            bad = int(np.flatnonzero(ragged)[0])
            raise ValueError(f"page {bad} does not cover {self.page_size} contiguous "
                             f"slots from {out[bad]}")
        # every page is a run from its start now: the starts bound every index
        lo, hi = min(out), max(out) + self.page_size - 1
        if lo < 0 or hi >= self.size:
            raise ValueError(f"host_indices span [{lo}, {hi}] but the pool holds slots "
                             f"[0, {self.size - 1}]")
        if self.page_size > 1 and (pages[:, 0] % self.page_size).any():
            bad = next(i for i, s in enumerate(out) if s % self.page_size)
            raise ValueError(f"page {bad} starts at slot {out[bad]}, which is not "
                             f"aligned to page_size {self.page_size}")
        return out

    def object_offsets(self, page_starts: Sequence[int]) -> list[int]:
        """Byte offsets of every object of every page, page by page in key order."""
        return [base + s * slot for s in page_starts for base, slot in self._object_bases]
