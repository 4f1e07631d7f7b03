"""``StoreBackend``: what the node actor needs of its store client, as a contract.

``MooncakeBackend`` is the one product implementation; unit tests use the shared fake
(tests/unit/fakes.py), which a unit test keeps in step with this Protocol. Keys are
object keys (``controllers.keys``); pointers are addresses in the node actor's process
of memory registered with ``register``; sizes are bytes. Batch calls answer one code
per object (``controllers.result_codes``) and never raise for a store error. Any data
thread of the node actor may call the batch calls at once; pool threads call
``alloc`` / ``register`` / ``unregister``; ``close`` comes last, once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from raykv.controllers.node_records import TierStats


class StoreBackend(Protocol):
    """The node's client of the L3 store (Mooncake: embedded, or a dummy client of a
    ``mooncake_client`` process in standalone mode).

    ``own_segment``: the name of this node's segment (None: none known);
    ``prefers_own``: whether puts prefer it; ``can_locate``: whether ``locate`` can
    answer."""

    own_segment: str | None
    prefers_own: bool
    can_locate: bool

    def exists(self, keys: list[str]) -> list[int]:
        """A lookup: ``EXISTS`` (1) / 0 / negative error per key."""
        ...

    def put(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """Put-if-absent ``sizes[i]`` bytes at ``ptrs[i]`` under ``keys[i]`` (distinct
        keys): 0 stored and known present, ``ALREADY_PRESENT`` (left as it was),
        negative error (``NOT_CONFIRMED``: not known stored)."""
        ...

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """Read each object into ``sizes[i]`` bytes at ``ptrs[i]``: the bytes read, or
        negative error (``OBJECT_NOT_FOUND``: a miss)."""
        ...

    def remove(self, keys: list[str]) -> list[int]:
        """Forced removal (leases ignored): 0 / negative error per key."""
        ...

    def remove_matching(self, pattern: str) -> int:
        """Non-forced removal of every object whose key the regex ``pattern`` matches:
        how many were removed (leased objects stay), or negative error."""
        ...

    def remove_unleased(self, key: str) -> int:
        """Non-forced removal of one object: 0, ``OBJECT_HAS_LEASE``, or negative."""
        ...

    def put_bytes(self, key: str, data: bytes) -> int:
        """Put a small object from the client's own buffer: 0 or negative error."""
        ...

    def alloc(self, nbytes: int) -> int:
        """Standalone mode: the base address of a new memfd mapping of exactly
        ``nbytes`` of ``mooncake_client``'s shared memory, not registered yet;
        ``RuntimeError`` if it cannot."""
        ...

    def register(self, ptr: int, nbytes: int) -> None:
        """Make ``[ptr, ptr + nbytes)`` a source and target of puts and gets;
        ``RuntimeError`` if the store refuses."""
        ...

    def unregister(self, ptr: int) -> None:
        """Undo ``register`` of the range starting at ``ptr`` (a failure is logged)."""
        ...

    def healthy(self) -> bool:
        """Whether the client answers its store."""
        ...

    def endpoint(self) -> str:
        """``host:port`` the client's transfer engine tells its peers ("" if none)."""
        ...

    def locate(self, keys: list[str]) -> list[tuple[str, ...]] | None:
        """Per key, the segments holding a complete replica of it; None if the lookup
        failed or cannot be made (``can_locate``)."""
        ...

    def steer(self, segment: str | None) -> None:
        """Later puts prefer ``segment`` (None: ``own_segment`` again, when the node's
        placement says so); ``prefers_own`` follows."""
        ...

    def start_move(self, key: str, source: str, target: str) -> tuple[object, int]:
        """Start moving ``key``'s replica on segment ``source`` to segment ``target``:
        ``(task id, 0)``, or ``(None, negative error)``."""
        ...

    def move_state(self, task: object) -> str:
        """``"done"``, ``"failed"`` or ``"running"``: the state of a started move."""
        ...

    def tier_stats(self) -> TierStats | None:
        """With seals (a cluster with a disk tier): objects and bytes gets served by tier
        and objects refused by reason, and the disk slot's ``path``, ``limit_bytes`` and
        ``used_bytes`` (``MooncakeBackend.tier_stats``); None without."""
        ...

    def close(self) -> None:
        """Leave the store; no call follows."""
        ...
