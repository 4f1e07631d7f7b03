"""Host KV pools in shared memory: base pointers for the node actor, torch tensors for ranks.

A ``HostPool`` maps one shared-memory file. The node actor creates it (and registers it with
its Mooncake client); ranks on the same node attach to it by name and see the same
bytes as a writable ``kv_buffer`` tensor. Pointers returned by ``get_page_buffer_meta``
are valid in the calling process only.

That file is a ``/dev/shm`` file (embedded mode) or, in standalone mode, a memfd that the
node actor allocated from ``mooncake_client``'s shared memory, reached by ranks through
``/proc/<actor pid>/fd/<fd>``.

Holds: a rank that moves bytes through a pool's memory across a node call (a get, then
the copy out of the pages it read; an L2 load, then its copies) holds the pool for the
whole of it (``HostPool.held``): a shared ``flock`` on the rank's own open file of that
memory. The node actor gives a pool's memory back (standalone: holes punched) only
under an exclusive ``flock`` of it (``pool_memory.MemfdPoolMemory.release``), so never
while a rank copies out of it; a rank that dies lets go with its files.

Memory the node allocated anew is mapped as a new ``PoolMapping`` of the same
``HostPool`` (``remap``): a mapping is never re-bound or unmapped in place, and one
that is replaced is unmapped only once no tensor view of it is left
(``torch.frombuffer`` keeps it alive), so a thread still copying through the old views
never touches unmapped memory, and a transfer that copies through the pool ``held``
gave it never copies into the new memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raykv.cache_actors.shared_memory import (
    create_shm_file,
    map_fd,
    shm_path,
    unlink_shm_file,
)
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


def _open_mapped(handle: PoolHandle) -> tuple[mmap.mmap, int]:
    """``handle``'s shared-memory file mapped, and kept open (``HostPool.held``).
    ``FileNotFoundError`` if it is gone, ``ValueError`` if it is smaller than the
    layout (nothing left open)."""
    fd = os.open(shm_path(handle.path), os.O_RDWR | os.O_CLOEXEC)
    try:
        actual = os.fstat(fd).st_size
        if actual < handle.layout.nbytes:
            raise ValueError(f"shared file {handle.path} holds {actual} bytes, expected "
                             f"{handle.layout.nbytes}")
        return map_fd(fd, handle.layout.nbytes), fd
    except BaseException:
        os.close(fd)
        raise


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


def _let_go(fd: int | None, pinned: list[int]) -> None:
    """What a ``PoolMapping`` holds besides its mapping, given back: its page-locking
    (``pinned``: the base address while locked) and its open file (its holds with it)."""
    if pinned:
        import torch

        torch.cuda.cudart().cudaHostUnregister(pinned.pop())
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


class PoolMapping:
    """One mapping of one generation of a pool's memory (``handle``): ``mm``, its
    ``base_ptr``, the open file ``fd`` it was mapped from (None: mapped by address or
    closed after mapping), the tensor views made of it, its page-locking and its holds
    (``HostPool.held``). Never re-bound: memory allocated anew is a new mapping. Dropped
    (no ``HostPool`` or hold refers to it), its page-locking and file are given back;
    ``mm`` is unmapped once its last tensor view is gone (``torch.frombuffer`` keeps it)."""

    def __init__(self, handle: PoolHandle, mm: mmap.mmap | ctypes.Array,
                 fd: int | None) -> None:
        self.handle = handle
        self.mm = mm
        self.base_ptr: int = mapped_address(mm)
        self.fd = fd
        self.views: dict | None = None
        self.pinned: list[int] = []  # the base address while page-locked
        self.holds = 0
        self.lock = threading.Lock()
        self.let_go = weakref.finalize(self, _let_go, fd, self.pinned)
        self.let_go.atexit = False


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

    ``handle``, ``base_ptr`` and the views are those of the pool's current mapping
    (``PoolMapping``), which ``remap`` replaces; ``held`` gives a pool fixed to the
    mapping it holds, for a transfer that must copy through one generation throughout.
    """

    def __init__(self, handle: PoolHandle, mm: mmap.mmap | ctypes.Array, owner: bool,
                 fd: int | None = None) -> None:
        self._owner = owner
        self._map = PoolMapping(handle, mm, fd)
        self._closed = False

    @classmethod
    def _fixed(cls, mapping: PoolMapping) -> HostPool:
        """A pool that is ``mapping`` for good (``held``'s): owns nothing, never
        re-mapped."""
        pool = cls.__new__(cls)
        pool._owner, pool._map, pool._closed = False, mapping, False
        return pool

    @property
    def handle(self) -> PoolHandle:
        """The handle of the memory mapped now."""
        return self._map.handle

    @property
    def base_ptr(self) -> int:
        """The address of the first byte of the memory mapped now, in this process."""
        return self._map.base_ptr

    def __getattr__(self, name: str):
        # only called for names not set on the instance: the views
        if name not in VIEWS or self.__dict__.get("_closed", True):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        mapping = self._map
        if mapping.views is None:
            mapping.views = self._tensor_views(mapping)
        try:
            return mapping.views[name]
        except KeyError:
            raise AttributeError(f"a {mapping.handle.layout.kind} pool has no {name}") from None

    @staticmethod
    def _tensor_views(mapping: PoolMapping) -> dict:
        """Every view of ``mapping``'s kind, by name (``VIEWS``)."""
        import torch

        layout = mapping.handle.layout
        whole = torch.frombuffer(mapping.mm, dtype=torch.uint8, count=layout.nbytes)
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
        """Map an existing shared-memory file made by the node actor, keeping it open
        for ``held``; ``owner``: the caller owns it (a restarted node actor re-adopting
        its pool), so ``close`` may remove it. ``FileNotFoundError`` if it is gone,
        ``ValueError`` if it is smaller than the layout."""
        mm, fd = _open_mapped(handle)
        return cls(handle, mm, owner=owner, fd=fd)

    @classmethod
    def wrap(cls, handle: PoolHandle, address: int) -> HostPool:
        """View ``handle.layout.nbytes`` bytes at ``address`` that someone else mapped and
        keeps mapped (the dummy Mooncake client's allocation, in standalone mode)."""
        return cls(handle, (ctypes.c_ubyte * handle.layout.nbytes).from_address(address),
                   owner=False)

    def remap(self, handle: PoolHandle) -> None:
        """Map ``handle``'s memory (the node actor allocated the pool anew; same
        layout) as this pool's from now on: a new ``PoolMapping``. The old one is never
        unmapped here: a thread still copying through its views (or holding it) goes
        on with it, and it is unmapped once the last of them is gone. Tensors taken from
        this pool before stay on the old memory: read ``kv_buffer`` etc. again."""
        old = self._map
        if handle.layout != old.handle.layout:
            raise ValueError(f"pool {handle.name!r} changed layout: {old.handle.layout} -> "
                             f"{handle.layout}")
        mm, fd = _open_mapped(handle)
        self._map = PoolMapping(handle, mm, fd)
        if old.pinned:
            self.pin()

    @contextlib.contextmanager
    def held(self) -> Iterator[HostPool]:
        """Hold the memory mapped now for the block; yields a pool fixed to that
        mapping (a later ``remap`` does not move it), to copy through for the whole
        block. The node actor does not give that memory back
        (``MemfdPoolMemory.release``) until every hold of every process on it ended
        (module docstring). Threads of a process share one shared ``flock`` per
        mapping, taken by its first hold and dropped by its last. A pool mapped by
        address (``wrap``, ``create``) has no file to lock: its holds only count."""
        mapping = self._map
        with mapping.lock:
            if mapping.holds == 0 and mapping.fd is not None:
                fcntl.flock(mapping.fd, fcntl.LOCK_SH)
            mapping.holds += 1
        try:
            yield HostPool._fixed(mapping)
        finally:
            with mapping.lock:
                mapping.holds -= 1
                if mapping.holds == 0 and mapping.fd is not None:
                    fcntl.flock(mapping.fd, fcntl.LOCK_UN)

    @property
    def holds(self) -> int:
        """How many ``held`` blocks of this process hold the memory mapped now."""
        return self._map.holds

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
        return bool(self._map.pinned)

    def pin(self) -> None:
        """Page-lock the mapping for DMA-speed device copies (no-op without CUDA)."""
        import torch

        mapping = self._map
        if mapping.pinned or not torch.cuda.is_available():
            return
        rc = torch.cuda.cudart().cudaHostRegister(mapping.base_ptr, self.nbytes, 0)
        if int(rc) != 0:
            log.warning("cudaHostRegister of pool %s failed (%s); copies stay pageable",
                        self.name, rc)
            return
        mapping.pinned.append(mapping.base_ptr)

    def close(self, unlink: bool = False) -> None:
        """Unmap; with ``unlink`` (owner only) remove the shared-memory file too. The
        caller makes sure no thread still uses a tensor of this pool: torch views made
        with ``torch.frombuffer`` do not keep the mapping alive (measured: the unmap
        succeeds with views alive), so touching one afterwards is a use after unmap."""
        mapping = self._map
        mapping.let_go()  # page-locking and file (once)
        mapping.views = None
        self._closed = True
        try:
            if isinstance(mapping.mm, mmap.mmap):
                mapping.mm.close()
        except BufferError:  # a memoryview (not a torch view) of the mapping is alive
            log.debug("pool %s stays mapped while a memoryview of it is alive", self.name)
        if unlink and self._owner:
            unlink_shm_file(self.handle.path)
