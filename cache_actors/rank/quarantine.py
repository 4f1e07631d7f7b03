"""Staging pages a late store call may still touch, kept out of use until it ended.

A put or get through a staging pool (``staging_pools.StagedPool``) names only the rank's
own staging pages, never the engine's memory: a put copied the engine's pages in before
the call, a get copies out only after a call that succeeded. So when such a call fails
while the node actor's store call of it still runs (its deadline passed, the node actor
was stopped with SIGSTOP in the middle of it), the rank need not wait for that store call
(``tickets.TicketBook.settle`` would, for as long as it takes): it returns at its
deadline and *quarantines* the staging pages the call named. Until the node actor has
released the call's ticket (``TicketBook.try_settle``), no later call copies into or out
of those pages: it fails at once with ``QuarantinedPagesError``, and the engine never
waits on them. The engine's own memory is never touched by the late call.

One failed round may name the staging pages of several pools: each pool's quarantine
then holds the same ticket, and each asks ``try_settle`` on its own; the book frees the
ticket's slot once, for the first, and says True to the others without touching the slot
(which may carry another call's ticket by then).

Threads: any thread of the rank (a lock guards the table; ``try_settle`` never blocks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from raykv.cache_actors.errors import QuarantinedPagesError
from raykv.cache_actors.tickets import TicketBook, TicketRef, process_book


class Quarantine:
    """The quarantined pages of one staging pool, by the ticket that holds them
    (tickets of ``book()``, this process's ticket book by default)."""

    def __init__(self, book: Callable[[], TicketBook] = process_book) -> None:
        self._book = book
        self._lock = threading.Lock()
        self._held: list[tuple[TicketRef, frozenset[int]]] = []

    def add(self, tickets: Iterable[TicketRef], pages: Iterable[int]) -> None:
        """Keep ``pages`` (staging page indices) out of use until every one of
        ``tickets`` is settled."""
        pages = frozenset(pages)
        with self._lock:
            self._held.extend((t, pages) for t in tickets)

    def held(self) -> set[int]:
        """The pages still quarantined (settles the tickets whose store call ended)."""
        book = self._book()
        with self._lock:
            self._held = [(t, p) for t, p in self._held if not book.try_settle(t)]
            return set().union(*(p for _, p in self._held))

    def check(self, pages: Iterable[int], pool: str) -> None:
        """``QuarantinedPagesError`` if any of ``pages`` is still quarantined."""
        busy = self.held()
        if busy and not busy.isdisjoint(pages):
            raise QuarantinedPagesError(
                f"raykv: staging pages {sorted(busy)[:8]} of pool {pool} are still named by "
                "a store call that outlived its caller's deadline (the node actor is slow "
                "or stopped); retry once it ended")
