"""A fake node for rank-side tests without Ray: the shared ``FakeRoute`` whose pool calls
run over files in a temporary folder (what ``NodeLink.call`` / ``ask`` reach), with a
store of object bytes that ``move`` puts and gets through the rank's own mappings."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from raykv.cache_actors.host_pools import HostPool, PoolHandle
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.pool_layout import PoolLayout

from tests.unit.fakes import FakeRoute


class FakeNode(FakeRoute):
    """``FakeRoute`` whose pool calls (``call``, ``ask``) make files under ``root``, plus
    ``reallocate`` (the node allocates every pool anew, a new epoch: standalone mode
    after a restart) and a store (``move``: a put or get of an ``ObjectBatch`` on the
    pools a ``PoolLifecycle`` mapped)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.pools: dict[str, PoolHandle] = {}
        self.processes: dict[str, object] = {}
        self.owners: dict[str, object] = {}
        self.epoch = 0
        self.calls: list[str] = []
        self.store: dict[str, bytes] = {}
        self.data_calls = 0

    # ------------------------------------------------------------ NodeLink
    def call(self, method: str, *args, **kwargs):
        self.calls.append(method)
        return getattr(self, method)(*args, **kwargs)

    ask = call

    # ----------------------------------------------------- node pool calls
    def _file(self, name: str, layout: PoolLayout) -> str:
        path = str(self.root / f"{name}.{self.epoch}")
        with open(path, "wb") as f:
            f.truncate(layout.nbytes)
        return path

    def create_pool(self, name: str, layout: PoolLayout, process=None,
                    claim=None) -> PoolHandle:
        old = self.pools.get(name)
        if old is not None:
            if old.layout != layout:
                raise ValueError(f"pool {name!r} exists with another layout")
            return old
        self.pools[name] = PoolHandle(name, self._file(name, layout), layout, self.epoch)
        self.processes[name] = process
        self.owners[name] = claim
        return self.pools[name]

    def get_pool(self, name: str, claim=None) -> PoolHandle:
        if name not in self.pools:
            raise ValueError(f"this node has no pool {name!r}")
        return self.pools[name]

    def destroy_pool(self, name: str, claim=None) -> bool:
        handle = self.pools.pop(name, None)
        if handle is not None:
            os.unlink(handle.path)
        return handle is not None

    def adopt_engine_pool(self, name: str, path: str, layout: PoolLayout,
                          inode: Sequence[int], claim=None) -> None:
        self.pools[name] = PoolHandle(name, path, layout, self.epoch)

    def reallocate(self) -> None:
        """Every pool on new (zeroed) memory of a new epoch."""
        self.epoch += 1
        for name, handle in list(self.pools.items()):
            os.unlink(handle.path)
            self.pools[name] = PoolHandle(name, self._file(name, handle.layout),
                                          handle.layout, self.epoch)

    # --------------------------------------------------------------- store
    def move(self, pools: Sequence[HostPool], write: bool, batch: ObjectBatch) -> list[int]:
        """A put (``write``) or get of ``batch`` on ``pools`` (the rank's mappings):
        put codes 0, get codes the bytes read (-1 for a missing object)."""
        self.data_calls += 1
        by_name = {p.name: p for p in pools}
        codes = []
        for key, pool, off, size in zip(batch.keys, batch.pools, batch.offsets, batch.sizes,
                                        strict=True):
            view = by_name[pool]._bytes[off:off + size]
            if write:
                self.store[key] = view.numpy().tobytes()
                codes.append(0)
            elif key in self.store:
                view.copy_(torch.frombuffer(bytearray(self.store[key]), dtype=torch.uint8))
                codes.append(size)
            else:
                codes.append(-1)
        return codes
