"""The legacy pointer API (``batch_set`` / ``batch_get`` with ``target_locations``).

SGLang's v1 backends name each object by a raw pointer and a byte size. raykv moves
bytes only between shared pools and the store, so every pointer must lie inside a pool
this client mapped; it becomes that pool's name and a byte offset in an ``ObjectBatch``.
``PointerCalls`` holds the three calls ``CacheClient`` serves this way.
"""

from __future__ import annotations

from collections.abc import Sequence

from raykv.cache_actors.data_ops import DataOp
from raykv.cache_actors.host_pools import HostPool
from raykv.cache_actors.rank.node_route import NodeRoute
from raykv.cache_actors.rank.pool_lifecycle import PoolLifecycle
from raykv.controllers.keyed_hashes import KeyedHashes
from raykv.controllers.keys import KeyScheme
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.result_codes import EXISTS
from raykv.controllers.transfer_plan import check_keys


def pointer_batch(keys: Sequence[str], target_locations: Sequence[int] | None,
                  target_sizes: Sequence[int] | None, pools: Sequence[HostPool],
                  scheme: KeyScheme, epoch: int) -> ObjectBatch:
    """One object per key: ``target_sizes[i]`` bytes at pointer ``target_locations[i]``
    (in this process), stored under ``keys[i]`` tagged by ``scheme``. ``ValueError`` for
    bad keys, missing or mismatched lists, or a range outside every pool in ``pools``."""
    keys = check_keys(keys)
    if target_locations is None or target_sizes is None:
        raise ValueError("target_locations and target_sizes are required (raykv moves "
                         "bytes only between shared pools and the store)")
    if not len(keys) == len(target_locations) == len(target_sizes):
        raise ValueError(f"{len(keys)} keys, {len(target_locations)} target_locations and "
                         f"{len(target_sizes)} target_sizes: lengths must match")
    batch = ObjectBatch(epoch=epoch)
    for key, ptr, size in zip(keys, target_locations, target_sizes, strict=True):
        for pool in pools:
            off = pool.offset_of(int(ptr), int(size))
            if off is not None:
                batch.add(scheme.tag(key), pool.name, off, int(size))
                break
        else:
            raise ValueError(f"key {key!r}: {size} bytes at {int(ptr):#x} do not lie inside "
                             "a shared pool mapped by this client")
    return batch


def all_stored(batch: ObjectBatch, codes: Sequence[int]) -> bool:
    """``batch_set``'s answer: every object is in the store."""
    return all(batch.stored(codes))


def leading_read(batch: ObjectBatch, codes: Sequence[int]) -> int:
    """``batch_get``'s answer: the number of leading objects read in full."""
    ok = batch.read_in_full(codes)
    return ok.index(False) if False in ok else len(ok)


class PointerCalls:
    """One client's pointer calls: its keyed hashes (a tenant's keys are keyed first),
    its mapped pools (where pointers must lie) and its route to the node actor. The key
    scheme is passed per call: a registration may replace the client's."""

    def __init__(self, hashes: KeyedHashes, pools: PoolLifecycle, link: NodeRoute) -> None:
        self._hashes, self._pools, self._link = hashes, pools, link

    def _batch(self, keys: Sequence[str], target_locations: Sequence[int] | None,
               target_sizes: Sequence[int] | None, scheme: KeyScheme) -> ObjectBatch:
        return pointer_batch(self._hashes.keys(keys), target_locations, target_sizes,
                             self._pools.mapped(), scheme, self._pools.epoch)

    def set(self, keys: Sequence[str], target_locations: Sequence[int] | None,
            target_sizes: Sequence[int] | None, scheme: KeyScheme) -> bool:
        """Put every object (put-if-absent); True if every object is in the store."""
        batch = self._batch(keys, target_locations, target_sizes, scheme)
        return all_stored(batch, self._link.data(DataOp.PUT, batch))

    def get(self, keys: Sequence[str], target_locations: Sequence[int] | None,
            target_sizes: Sequence[int] | None, scheme: KeyScheme) -> int:
        """Read every object; the number of leading objects read in full."""
        batch = self._batch(keys, target_locations, target_sizes, scheme)
        return leading_read(batch, self._link.data(DataOp.GET, batch))

    def exist(self, keys: Sequence[str], scheme: KeyScheme) -> list[bool]:
        """Whether each object, named as ``set`` names it, is in the store."""
        names = [scheme.tag(k) for k in self._hashes.keys(check_keys(keys))]
        return [c == EXISTS for c in self._link.data(DataOp.EXISTS, names)]
