"""Stand-ins shared by the unit tests."""

from __future__ import annotations


class Counts:
    """Counts what ``GroupQueries`` and ``TransferMerger`` report, as ``NodeMetrics``
    does (``record_group_query``, ``record_group_store_call``, ``record_merged_call``),
    without Ray: group queries by how they were answered (``recent``, ``inflight``,
    ``confirmed``, ``checked``) and their ``store_calls``; merged ``calls``, the
    ``batches`` they carried and the ``largest`` call."""

    def __init__(self) -> None:
        self.recent = self.inflight = self.confirmed = self.checked = 0
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
