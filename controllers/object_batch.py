"""What a data call carries from a rank to its node actor: keys and where their bytes lie.

Bytes never travel in it: each object is named by its pool and a byte offset into that
pool's shared memory, which the actor turns into a pointer in its own mapping. Pure (no
Ray, no Mooncake): transfer planning builds it, the node actor reads it.

Codes the node actor answers per object: ``put`` 0 stored, 1 already present
(put-if-absent), negative Mooncake error; ``get`` bytes read or negative error.
``stored`` and ``read_in_full`` turn them into one bool per object.

The node actor validates every batch (``check``) and every list of keys it is asked
about (``check_object_keys``) before it is merged with other ranks' work into one store
call, so one caller's bad input fails that caller alone: keys are non-empty ``str``;
pools ``str``; offsets, sizes and the epoch ``int`` (numpy integers are converted; bool
and float are refused); at most ``MAX_BATCH_OBJECTS`` objects or keys per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral

MAX_BATCH_OBJECTS = 65_536
"""Objects (or keys of a lookup) one data call may name: 2048 pages of the
largest hybrid layouts; a caller with more splits its call."""


def _too_many(n: int, what: str) -> ValueError:
    return ValueError(f"{what} names {n} objects; at most MAX_BATCH_OBJECTS="
                      f"{MAX_BATCH_OBJECTS} per call: split it")


def check_object_keys(keys: object, what: str = "the key list") -> list[str]:
    """``keys`` as a list if it is a list or tuple of at most ``MAX_BATCH_OBJECTS``
    non-empty ``str``; else ``ValueError`` naming the first bad one."""
    if type(keys) is not list:
        if not isinstance(keys, list | tuple):
            raise ValueError(f"{what} must be a list of strings, got {type(keys).__name__}")
        keys = list(keys)
    if len(keys) > MAX_BATCH_OBJECTS:
        raise _too_many(len(keys), what)
    try:
        "".join(keys)  # the cheapest test that every key is a str
        if "" not in keys:
            return keys
    except TypeError:
        pass
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k:
            raise ValueError(f"{what}: key {i} is {k!r} ({type(k).__name__}); keys must be "
                             "non-empty str")
    return keys


_INT = frozenset({int})


def _ints(values: object, what: str) -> list[int]:
    """``values`` as a list of ``int``: numpy integers converted, bool and float (and
    anything else) refused with ``ValueError``."""
    if not isinstance(values, list | tuple):
        raise ValueError(f"object batch {what} must be a list, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, Integral):
            raise ValueError(f"object batch {what}[{i}] is {v!r} ({type(v).__name__}); "
                             "must be an int")
        out.append(int(v))
    return out


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

    def check(self) -> set[str]:
        """Raise ``ValueError`` unless the types are right (see the module docstring),
        the lists line up, they hold at most ``MAX_BATCH_OBJECTS`` objects and no key
        repeats; return the names of the pools the batch uses. Numpy integers in
        ``offsets``, ``sizes`` and ``epoch`` are converted to ``int`` in place. (Ranges
        are checked against the pools: ``PoolTable``.) Costs ~2 us for 32 objects."""
        keys = self.keys
        if type(keys) is not list or len(keys) > MAX_BATCH_OBJECTS:
            self.keys = keys = check_object_keys(keys, "object batch keys")
        n = len(keys)
        try:
            "".join(keys)  # the cheapest test that every key is a str
            distinct = set(keys)
        except TypeError:
            distinct = None
        if distinct is None or "" in distinct:
            check_object_keys(keys, "object batch keys")  # names the bad key
        if not (type(self.offsets) is list and type(self.sizes) is list
                and set(map(type, self.offsets + self.sizes)) <= _INT):
            self.offsets = _ints(self.offsets, "offsets")
            self.sizes = _ints(self.sizes, "sizes")
        if type(self.epoch) is not int:
            if isinstance(self.epoch, bool) or not isinstance(self.epoch, Integral):
                raise ValueError(f"object batch epoch is {self.epoch!r}; must be an int")
            self.epoch = int(self.epoch)
        try:
            names = set(self.pools)
        except TypeError:
            names = {None}  # an unhashable name: refused below
        for name in names:
            if type(name) is not str:
                raise ValueError(f"object batch pools must be pool names (str), not "
                                 f"{name!r}")
        if not (len(self.pools) == len(self.offsets) == len(self.sizes) == n):
            raise ValueError("object batch lists differ in length")
        if len(distinct) != n:
            raise ValueError("object batch repeats a key; Mooncake batches need distinct keys")
        return names

    @staticmethod
    def stored(codes: Sequence[int]) -> list[bool]:
        """Per object of a put: True if it is in the store (stored now or already there)."""
        return [c >= 0 for c in codes]

    def read_in_full(self, codes: Sequence[int]) -> list[bool]:
        """Per object of a get: True if every one of its ``sizes`` bytes was read."""
        return [c == s for c, s in zip(codes, self.sizes, strict=True)]
