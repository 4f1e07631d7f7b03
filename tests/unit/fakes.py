"""Stand-ins shared by the unit tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class Counts:
    """Counts what ``GroupQueries`` and ``TransferMerger`` report, as ``NodeMetrics``
    does (``record_group_query``, ``record_group_store_call``, ``record_merged_call``),
    without Ray: group queries by how they were answered (``recent``, ``inflight``,
    ``confirmed``, ``looked_up``) and their ``store_calls``; merged ``calls``, the
    ``batches`` they carried and the ``largest`` call."""

    def __init__(self) -> None:
        self.recent = self.inflight = self.confirmed = self.looked_up = 0
        self.store_calls = 0
        self.calls = self.batches = self.largest = 0

    def record_group_query(self, how: str) -> None:
        setattr(self, how, getattr(self, how) + 1)

    def record_group_store_call(self, seconds: float) -> None:
        self.store_calls += 1

    def record_merged_call(self, batches: int) -> None:
        self.calls += 1
        self.batches += batches
        self.largest = max(self.largest, batches)


class Registrations:
    """A Mooncake backend's buffer registrations: the pointers registered now."""

    def __init__(self) -> None:
        self.live: set[int] = set()

    def register(self, ptr: int, nbytes: int) -> None:
        self.live.add(ptr)

    def unregister(self, ptr: int) -> None:
        self.live.remove(ptr)


@dataclass
class ShmStore:
    """A ``NodeStore`` of embedded mode for ``NodePools``: real ``/dev/shm`` pool memory
    (a ``ShmPoolMemory``), registrations only remembered."""

    memory: Any
    backend: Registrations
    mode: str = "embedded"

    def before_call(self) -> int:
        return 0


class ServiceStore:
    """The calls a ``NodeService`` makes on its ``NodeStore`` beyond ``memory`` and
    ``backend`` (which a subclass sets, with ``mode``): epochs pass through, codes come
    back as they are, the supervisor's re-allocation hook is kept as ``reallocate``."""

    process = None

    def before_call(self) -> int:
        return self.memory.epoch

    def after_call(self, epoch: int, codes: list[int]) -> list[int]:
        return codes

    def supervise(self, reallocate) -> None:
        self.reallocate = reallocate

    def close(self) -> None:
        pass
