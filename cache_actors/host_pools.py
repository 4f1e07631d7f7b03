"""Host KV pools in shared memory, seen as torch tensors by the node actor and by ranks.

A ``HostPool`` maps one shared segment. The node actor creates it (and registers it with
its Mooncake client); ranks on the same node attach to it by name and see the same
bytes as a writable ``kv_buffer`` tensor. Pointers returned by ``get_page_buffer_meta``
are valid in the calling process only.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass

import torch

from cache_actors.shared_segment import attach_segment, create_segment, unlink_segment
from controllers.pool_layout import PoolLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolHandle:
    """What a rank needs to map a pool: its name, its shared segment, its layout."""

    name: str
    segment: str
    layout: PoolLayout


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``torch.bfloat16``; ``ValueError`` otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype")
    return found


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class HostPool:
    """One MHA or MLA host pool mapped from shared memory (``page_first`` layout)."""

    def __init__(self, handle: PoolHandle, mm: mmap.mmap, owner: bool) -> None:
        self.handle = handle
        self._mm = mm
        self._owner = owner
        layout = handle.layout
        self._bytes = torch.frombuffer(mm, dtype=torch.uint8, count=layout.nbytes)
        self.kv_buffer = self._bytes.view(torch_dtype(layout.dtype)).view(layout.shape)
        self.base_ptr: int = self._bytes.data_ptr()
        self._pinned = False

    @classmethod
    def create(cls, handle: PoolHandle) -> HostPool:
        """Create the shared segment (zero-filled) and map it; the caller owns it."""
        return cls(handle, create_segment(handle.segment, handle.layout.nbytes), owner=True)

    @classmethod
    def attach(cls, handle: PoolHandle) -> HostPool:
        """Map an existing segment made by the node actor."""
        return cls(handle, attach_segment(handle.segment, handle.layout.nbytes), owner=False)

    # SGLang host-pool attribute names.
    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def layout(self) -> str:
        return self.handle.layout.layout

    @property
    def page_size(self) -> int:
        return self.handle.layout.page_size

    @property
    def size(self) -> int:
        return self.handle.layout.size

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_buffer.dtype

    @property
    def nbytes(self) -> int:
        return self.handle.layout.nbytes

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        """Pointers and byte sizes of the objects of the pages at ``indices``.

        ``indices`` are token slots, ``page_size`` per page (as SGLang passes them).
        Returns ``(ptr_list, size_list)`` in key order: per page K then V (MHA) or the
        latent (MLA). Raises ``ValueError`` for slots that are not whole pages in range.
        """
        layout = self.handle.layout
        idx = indices.cpu().numpy() if isinstance(indices, torch.Tensor) else indices
        n = len(idx) // layout.page_size
        starts = layout.page_starts(idx, n)
        ptrs = [self.base_ptr + off for off in layout.object_offsets(starts)]
        return ptrs, [layout.object_bytes] * len(ptrs)

    def offset_of(self, ptr: int, size: int) -> int | None:
        """Offset of ``[ptr, ptr + size)`` inside this mapping, or None if it is not inside."""
        off = ptr - self.base_ptr
        return off if off >= 0 and size > 0 and off + size <= self.nbytes else None

    def pin(self) -> None:
        """Page-lock the mapping for DMA-speed device copies (no-op without CUDA)."""
        if self._pinned or not torch.cuda.is_available():
            return
        rc = torch.cuda.cudart().cudaHostRegister(self.base_ptr, self.nbytes, 0)
        if int(rc) != 0:
            log.warning("cudaHostRegister of pool %s failed (%s); copies stay pageable",
                        self.name, rc)
            return
        self._pinned = True

    def close(self, unlink: bool = False) -> None:
        """Unmap; with ``unlink`` (owner only) remove the shared segment too."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base_ptr)
            self._pinned = False
        del self.kv_buffer, self._bytes
        try:
            self._mm.close()
        except BufferError:
            # A caller still holds a view of kv_buffer: the mapping lives until it drops it.
            log.debug("pool %s stays mapped while views of it are alive", self.name)
        if unlink and self._owner:
            unlink_segment(self.handle.segment)
