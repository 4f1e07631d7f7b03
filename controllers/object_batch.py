"""What a data call carries from a rank to its node actor: keys and where their bytes lie.

Bytes never travel in it: each object is named by its pool and a byte offset into that
pool's shared segment, which the actor turns into a pointer in its own mapping. Pure (no
Ray, no Mooncake): transfer planning builds it, the node actor reads it.

Codes the node actor answers per object: ``put`` 0 stored, 1 already present
(put-if-absent), negative Mooncake error; ``get`` bytes read or negative error.
``stored`` and ``read_in_full`` turn them into one bool per object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class ObjectBatch:
    """Parallel lists, one entry per Mooncake object; ``epoch``: that of the pool
    handles the offsets were taken from (see ``PoolHandle``)."""

    keys: list[str] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    epoch: int = 0

    def add(self, key: str, pool: str, offset: int, size: int) -> None:
        self.keys.append(key)
        self.pools.append(pool)
        self.offsets.append(offset)
        self.sizes.append(size)

    def extend(self, keys: list[str], pool: str, offsets: list[int], sizes: list[int]) -> None:
        """Add objects that all lie in ``pool``."""
        self.keys += keys
        self.pools += [pool] * len(keys)
        self.offsets += offsets
        self.sizes += sizes

    def __len__(self) -> int:
        return len(self.keys)

    def check(self) -> None:
        """Raise ``ValueError`` unless the lists line up and no key repeats."""
        n = len(self.keys)
        if not (len(self.pools) == len(self.offsets) == len(self.sizes) == n):
            raise ValueError("object batch lists differ in length")
        if len(set(self.keys)) != n:
            raise ValueError("object batch repeats a key; Mooncake batches need distinct keys")

    @staticmethod
    def stored(codes: Sequence[int]) -> list[bool]:
        """Per object of a put: True if it is in the store (stored now or already there)."""
        return [c >= 0 for c in codes]

    def read_in_full(self, codes: Sequence[int]) -> list[bool]:
        """Per object of a get: True if every one of its ``sizes`` bytes was read."""
        return [c == s for c, s in zip(codes, self.sizes, strict=True)]
