"""Host KV pools in shared memory: base pointers for the node actor, torch tensors for ranks.

A ``HostPool`` maps one shared-memory file. The node actor creates it (and registers it with
its Mooncake client); ranks on the same node attach to it by name and see the same
bytes as a writable ``kv_buffer`` tensor. Pointers returned by ``get_page_buffer_meta``
are valid in the calling process only.

That file is a ``/dev/shm`` file (embedded mode) or, in standalone mode, a memfd that the
node actor allocated from ``mooncake_client``'s shared memory, reached by ranks through
``/proc/<actor pid>/fd/<fd>``.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raykv.cache_actors.shared_memory import attach_shm_file, create_shm_file, unlink_shm_file
from raykv.controllers.pool_layout import PoolLayout

if TYPE_CHECKING:  # imported where used: the reconciler imports this module, never a pool
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolHandle:
    """What a rank needs to map a pool: its name, the path of its shared memory, its layout.

    ``epoch`` names the generation of the node's pool memory its memory belongs to: it
    changes when the node actor had to allocate every pool anew (standalone mode, after
    ``mooncake_client`` or the actor restarted); 0 in embedded mode, where it never does.
    """

    name: str
    path: str
    layout: PoolLayout
    epoch: int = 0


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``torch.bfloat16``; ``ValueError`` otherwise."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype")
    return found


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


VIEWS = ("_bytes", "buffers", "kv_buffer", "temporal_buffer", "conv_buffer",
         "indexer_buffer")
"""A ``HostPool``'s tensor views, made at their first use (``HostPool.__getattr__``);
``_bytes``: the whole pool as uint8 (tests read it)."""


def mapped_address(mm: mmap.mmap | ctypes.Array) -> int:
    """The address of ``mm``'s first byte in this process, holding no export of its
    buffer afterwards (the mapping can still be closed)."""
    if isinstance(mm, ctypes.Array):
        return ctypes.addressof(mm)
    first = ctypes.c_ubyte.from_buffer(mm)
    try:
        return ctypes.addressof(first)
    finally:
        del first  # releases the export at once (reference counting)


class HostPool:
    """One host pool mapped from shared memory (``page_first`` layout).

    ``base_ptr`` is the address of its first byte in this process. Tensors, all views of
    the shared bytes, made at their first use, so that a process that only moves bytes
    by pointer (the node actor) never imports torch: ``buffers`` (one
    ``(size, *slot_shape)`` tensor per buffer, in key order); MHA/MLA ``kv_buffer``; vLLM
    ``kv_buffer`` ``(pages, layer_num, head_num, page_size, head_dim)``; Mamba
    ``temporal_buffer`` (None when the temporal state is empty) and ``conv_buffer`` (a
    list); indexer ``indexer_buffer``. A view the pool's kind lacks, or any view after
    ``close``, raises ``AttributeError``.
    """

    def __init__(self, handle: PoolHandle, mm: mmap.mmap | ctypes.Array, owner: bool) -> None:
        self._owner = owner
        self._bind(handle, mm)

    def _bind(self, handle: PoolHandle, mm: mmap.mmap | ctypes.Array) -> None:
        self.handle = handle
        self._mm = mm
        self.base_ptr: int = mapped_address(mm)
        self._pinned = False
        self._views: dict | None = None
        self._closed = False

    def __getattr__(self, name: str):
        # only called for names not set on the instance: the views, before their first use
        if name not in VIEWS or self.__dict__.get("_closed", True):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if self._views is None:
            self._views = self._tensor_views()
        try:
            return self._views[name]
        except KeyError:
            raise AttributeError(f"a {self.handle.layout.kind} pool has no {name}") from None

    def _tensor_views(self) -> dict:
        """Every view of this pool's kind, by name (``VIEWS``)."""
        import torch

        layout = self.handle.layout
        whole = torch.frombuffer(self._mm, dtype=torch.uint8, count=layout.nbytes)
        buffers = [
            whole[off:off + layout.size * b.slot_bytes]
            .view(torch_dtype(b.dtype)).view(layout.size, *b.slot_shape)
            for off, b in zip(layout.buffer_offsets, layout.buffers, strict=True)
        ]
        named = {b.name: t for b, t in zip(layout.buffers, buffers, strict=True)}
        views: dict = {"_bytes": whole, "buffers": buffers}
        if layout.kind == "mha":
            k = layout.buffers[0]
            views["kv_buffer"] = whole.view(torch_dtype(k.dtype)).view(
                2, layout.size, *k.slot_shape)
        elif layout.kind == "mla":
            views["kv_buffer"] = named["kv"]
        elif layout.kind == "vllm":  # (pages, layer_num, head_num, page_size, head_dim)
            layers, heads, dim = layout.buffers[0].slot_shape
            views["kv_buffer"] = named["kv"].view(layout.num_pages, layers, heads,
                                                  layout.page_size, dim)
        elif layout.kind == "mamba":
            views["temporal_buffer"] = named.get("temporal")
            views["conv_buffer"] = [t for b, t in zip(layout.buffers, buffers, strict=True)
                                    if b.name.startswith("conv_")]
        else:
            views["indexer_buffer"] = named["indexer"]
        return views

    @classmethod
    def create(cls, handle: PoolHandle) -> HostPool:
        """Create the shared-memory file (zero-filled, every byte allocated now) and map
        it; the caller owns it. ``ValueError`` naming the pool, the bytes it needs and the
        free space if the shared-memory filesystem cannot hold it (no file is left)."""
        return cls(handle, create_shm_file(handle.path, handle.layout.nbytes,
                                           f"pool {handle.name!r}"), owner=True)

    @classmethod
    def attach(cls, handle: PoolHandle, owner: bool = False) -> HostPool:
        """Map an existing shared-memory file made by the node actor; ``owner``: the
        caller owns it (a restarted node actor re-adopting its pool), so ``close`` may
        remove it."""
        return cls(handle, attach_shm_file(handle.path, handle.layout.nbytes), owner=owner)

    @classmethod
    def wrap(cls, handle: PoolHandle, address: int) -> HostPool:
        """View ``handle.layout.nbytes`` bytes at ``address`` that someone else mapped and
        keeps mapped (the dummy Mooncake client's allocation, in standalone mode)."""
        return cls(handle, (ctypes.c_ubyte * handle.layout.nbytes).from_address(address),
                   owner=False)

    def remap(self, handle: PoolHandle) -> None:
        """Map ``handle``'s memory in place of the current one (same layout), after the
        node actor allocated the pool anew. Tensors taken from this pool before stay on
        the old memory: read ``kv_buffer`` etc. again."""
        if handle.layout != self.handle.layout:
            raise ValueError(f"pool {handle.name!r} changed layout: {self.handle.layout} -> "
                             f"{handle.layout}")
        pinned = self._pinned
        self.close()
        self._bind(handle, attach_shm_file(handle.path, handle.layout.nbytes))
        if pinned:
            self.pin()

    @property
    def layout(self) -> PoolLayout:
        """The pool's layout (kind, page geometry, buffers, page order)."""
        return self.handle.layout

    # SGLang host-pool attribute names.
    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def page_size(self) -> int:
        return self.handle.layout.page_size

    @property
    def size(self) -> int:
        return self.handle.layout.size

    @property
    def kind(self) -> str:
        return self.handle.layout.kind

    @property
    def dtype(self) -> torch.dtype:
        return self.buffers[0].dtype

    @property
    def nbytes(self) -> int:
        return self.handle.layout.nbytes

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        """Pointers and byte sizes of the objects of the pages at ``indices``.

        ``indices`` are token slots, ``page_size`` per page (as SGLang passes them).
        Returns ``(ptr_list, size_list)`` page by page in key order (MHA: K then V; Mamba:
        temporal then conv buffers). Raises ``ValueError`` for slots that are not whole
        pages in range.
        """
        layout = self.handle.layout
        idx = indices.cpu().numpy() if callable(getattr(indices, "cpu", None)) else indices
        starts = layout.page_starts(idx, len(idx) // layout.page_size)
        ptrs = [self.base_ptr + off for off in layout.object_offsets(starts)]
        return ptrs, layout.object_sizes * len(starts)

    def offset_of(self, ptr: int, size: int) -> int | None:
        """Offset of ``[ptr, ptr + size)`` inside this mapping, or None if it is not inside."""
        off = ptr - self.base_ptr
        return off if off >= 0 and size > 0 and off + size <= self.nbytes else None

    def check(self) -> None:
        """Raise ``ValueError`` if pages of this pool can no longer be touched safely
        (the node actor calls it before every data call that names the pool). Pools
        made by raykv are allocated whole and never shrink: nothing to check; an
        engine's memfd can (``engine_memory.EngineHostPool``)."""

    @property
    def pinned(self) -> bool:
        """Whether ``pin`` page-locked the mapping (False without CUDA or if it failed)."""
        return self._pinned

    def pin(self) -> None:
        """Page-lock the mapping for DMA-speed device copies (no-op without CUDA)."""
        import torch

        if self._pinned or not torch.cuda.is_available():
            return
        rc = torch.cuda.cudart().cudaHostRegister(self.base_ptr, self.nbytes, 0)
        if int(rc) != 0:
            log.warning("cudaHostRegister of pool %s failed (%s); copies stay pageable",
                        self.name, rc)
            return
        self._pinned = True

    def close(self, unlink: bool = False) -> None:
        """Unmap; with ``unlink`` (owner only) remove the shared-memory file too. The
        caller makes sure no thread still uses a tensor of this pool: torch views made
        with ``torch.frombuffer`` do not keep the mapping alive (measured: the unmap
        succeeds with views alive), so touching one afterwards is a use after unmap."""
        if self._pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.base_ptr)
            self._pinned = False
        self._views = None
        self._closed = True
        try:
            if isinstance(self._mm, mmap.mmap):
                self._mm.close()
        except BufferError:  # a memoryview (not a torch view) of the mapping is alive
            log.debug("pool %s stays mapped while a memoryview of it is alive", self.name)
        if unlink and self._owner:
            unlink_shm_file(self.handle.path)
