"""Merging concurrent callers' object batches into one store call, and splitting its codes.

Pure logic, no Ray and no Mooncake: ``cache_actors.node.transfer_merger`` runs it in front of
the node's Mooncake client. Several ranks of a node put or get pages at the same time;
instead of each batch waiting on the transfer engine on its own thread, the batches
queued at one moment go out as one ``batch_put_from`` / ``batch_get_into``:

- ``select`` picks, in queue order, the pending batches that can share one call: the
  same operation as the oldest, no key that a call in flight or an already picked batch
  names (a Mooncake
  batch needs distinct keys; a batch that collides waits for the next call, so batches
  naming the same key still run in the order they came), and at most ``max_objects``
  objects in all (the oldest is always picked, whatever its size);
- ``merge`` concatenates the picked batches' keys, pointers and sizes;
- ``split`` cuts the merged call's per-object codes back into one list per batch.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass


@dataclass(frozen=True)
class Pending:
    """What ``select`` needs to know of one queued batch: its operation and keys."""

    op: str
    keys: Sequence[str]


def select(pending: Sequence[Pending], max_objects: int,
           busy: Set[str] = frozenset()) -> list[int]:
    """Indices into ``pending`` (queue order, oldest first) of the batches to merge into one
    call. See the module docstring for the rules; besides, no batch naming a key in
    ``busy`` (the keys of calls still in flight) is picked, so two calls never move one
    key at the same time and put-if-absent has exactly one first writer. The oldest batch
    that names no busy key leads; empty if there is none."""
    op = None
    taken: list[int] = []
    names: set[str] = set()
    count = 0
    for i, p in enumerate(pending):
        if not busy.isdisjoint(p.keys):
            continue
        if op is None:
            op = p.op
        elif p.op != op:
            continue
        if taken and (count + len(p.keys) > max_objects or not names.isdisjoint(p.keys)):
            continue
        taken.append(i)
        names.update(p.keys)
        count += len(p.keys)
        if count >= max_objects:
            break
    return taken


def merge(batches: Sequence[tuple[Sequence[str], Sequence[int], Sequence[int]]]
          ) -> tuple[list[str], list[int], list[int], list[int]]:
    """``(keys, ptrs, sizes)`` of every batch, concatenated, and the start offset of each
    batch in the merged lists followed by their total length (``len(batches) + 1`` bounds)."""
    keys: list[str] = []
    ptrs: list[int] = []
    sizes: list[int] = []
    bounds = [0]
    for k, p, s in batches:
        if not len(k) == len(p) == len(s):
            raise ValueError(f"batch of {len(k)} keys, {len(p)} pointers, {len(s)} sizes")
        keys += k
        ptrs += p
        sizes += s
        bounds.append(len(keys))
    return keys, ptrs, sizes, bounds


def split(codes: Sequence[int], bounds: Sequence[int]) -> list[list[int]]:
    """The merged call's ``codes`` cut back per batch (``bounds`` from ``merge``)."""
    if len(codes) != bounds[-1]:
        raise ValueError(f"{len(codes)} codes for a merged call of {bounds[-1]} objects")
    return [list(codes[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
