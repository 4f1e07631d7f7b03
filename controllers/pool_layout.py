"""Host pool geometry and page arithmetic (DESIGN section 5). Pure: numpy only.

Units: ``size`` and ``page_size`` count token slots; offsets and sizes count bytes from
the start of the pool's shared segment. ``host_indices`` are token-slot indices, one
per token, ``page_size`` per page, each page's slots contiguous and page-aligned.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

POOL_KINDS = ("mha", "mla")
LAYOUTS = ("page_first", "layer_first")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_pool_name(name: str) -> str:
    """Return ``name`` if it can name a shared segment, else raise ``ValueError``."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"pool name {name!r} is invalid: use 1-64 characters of letters, digits, '_', '.', "
            "'-', starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class PoolLayout:
    """Shape of one host pool.

    MHA: ``kv_buffer`` is ``(2, size, layer_num, head_num, head_dim)``; a page is two
    objects (K, V) of ``page_size * layer_num * head_num * head_dim * itemsize`` bytes.
    MLA: ``kv_buffer`` is ``(size, layer_num, 1, kv_cache_dim)``; a page is one object of
    ``page_size * layer_num * kv_cache_dim * itemsize`` bytes.
    """

    kind: str
    page_size: int
    size: int
    layer_num: int
    dtype: str
    itemsize: int
    head_num: int = 0
    head_dim: int = 0
    kv_cache_dim: int = 0
    layout: str = "page_first"

    def __post_init__(self) -> None:
        if self.kind not in POOL_KINDS:
            raise ValueError(f"pool kind {self.kind!r} is unknown: expected one of {POOL_KINDS}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is unknown: expected one of {LAYOUTS}")
        if self.layout != "page_first":
            raise ValueError(
                f"{self.kind.upper()} layout {self.layout!r} cannot be served: a page must be "
                "contiguous across layers to be one Mooncake object; use 'page_first'"
            )
        dims = {"page_size": self.page_size, "size": self.size, "layer_num": self.layer_num,
                "itemsize": self.itemsize}
        if self.kind == "mha":
            dims |= {"head_num": self.head_num, "head_dim": self.head_dim}
        else:
            dims |= {"kv_cache_dim": self.kv_cache_dim}
        for what, value in dims.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.kind} pool {what} must be a positive int, got {value!r}")
        if self.size % self.page_size:
            raise ValueError(
                f"pool size {self.size} is not a multiple of page_size {self.page_size}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of ``kv_buffer`` in elements."""
        if self.kind == "mha":
            return (2, self.size, self.layer_num, self.head_num, self.head_dim)
        return (self.size, self.layer_num, 1, self.kv_cache_dim)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token slot of one buffer (K, V or the MLA latent)."""
        per_layer = self.head_num * self.head_dim if self.kind == "mha" else self.kv_cache_dim
        return self.layer_num * per_layer * self.itemsize

    @property
    def object_bytes(self) -> int:
        """Bytes of one page object (one of K/V for MHA, the page for MLA)."""
        return self.page_size * self.token_bytes

    @property
    def objects_per_page(self) -> int:
        return 2 if self.kind == "mha" else 1

    @property
    def num_pages(self) -> int:
        return self.size // self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.objects_per_page * self.size * self.token_bytes

    def page_starts(self, host_indices: Sequence[int] | np.ndarray, num_keys: int) -> list[int]:
        """Validate ``host_indices`` for ``num_keys`` pages; return each page's first slot.

        Raises ``ValueError`` naming the problem when the count does not match, a page
        is not page-aligned or not contiguous, or an index lies outside the pool.
        """
        idx = np.asarray(host_indices)
        if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
            raise ValueError(f"host_indices must be a 1-D sequence of ints, got {idx.dtype} "
                             f"with shape {idx.shape}")
        if idx.size != num_keys * self.page_size:
            raise ValueError(
                f"host_indices has {idx.size} entries but {num_keys} keys need "
                f"{num_keys * self.page_size} ({self.page_size} per page)"
            )
        if idx.size == 0:
            return []
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.size:
            raise ValueError(f"host_indices span [{lo}, {hi}] but the pool holds slots "
                             f"[0, {self.size - 1}]")
        pages = idx.reshape(num_keys, self.page_size)
        starts = pages[:, 0]
        bad = np.flatnonzero(starts % self.page_size)
        if bad.size:
            raise ValueError(f"page {int(bad[0])} starts at slot {int(starts[bad[0]])}, which is "
                             f"not aligned to page_size {self.page_size}")
        ragged = np.flatnonzero((pages - starts[:, None] != np.arange(self.page_size)).any(axis=1))
        if ragged.size:
            raise ValueError(f"page {int(ragged[0])} does not cover {self.page_size} contiguous "
                             f"slots from {int(starts[ragged[0]])}")
        return starts.tolist()

    def object_offsets(self, page_starts: Sequence[int]) -> list[int]:
        """Byte offsets of every object of every page, in key order (K then V per page)."""
        tb = self.token_bytes
        if self.kind == "mla":
            return [s * tb for s in page_starts]
        v_base = self.size * tb
        out: list[int] = []
        for s in page_starts:
            out += (s * tb, v_base + s * tb)
        return out

    def locate(self, offset: int, size: int) -> None:
        """Raise ``ValueError`` unless ``[offset, offset + size)`` lies inside the pool."""
        if size <= 0 or offset < 0 or offset + size > self.nbytes:
            raise ValueError(f"range of {size} bytes at offset {offset} does not lie inside "
                             f"the pool of {self.nbytes} bytes")
