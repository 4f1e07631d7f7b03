"""Answering group existence queries: shared within a window, batched when concurrent.

``GroupQueries.ask`` is called from any number of threads, each call on behalf of one
rank ``(tp_rank, pp_rank)``. An answer is shared by the ranks of the group that ask the
same question (deployment, page keys, pools): a query that arrives while the same one
is being checked waits for it, and a rank that has not yet had a recent answer (at
most ``window_s`` seconds old) gets that very answer. So every rank of one engine step
gets the identical hit. A rank that asks again gets a fresh answer, and an answer is
dropped once every rank of the group has had it, so a miss is never served from memory
to a later request after the pages were stored.

Each query is a ``GroupSearch``: it checks only the objects that can change its answer
and that the store has not confirmed within ``confirm_ttl_s`` (``ConfirmedPages``:
Mooncake leases every object it reports present), so a query may need no store call
at all. Distinct queries that arrive while a store check runs are answered together by
the next check, one ``exists`` call over the union of the objects their current step
needs (no name twice) once ``parallel`` store calls are already running. The calling
threads do the work themselves: up to ``parallel`` of them lead at a time, each checking
everything queued; once its own query is answered a leader lets a caller still waiting
take its place, so nobody keeps checking for others. No thread or event loop of its
own is needed. Pure logic: the store is a callable.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from controllers.confirmed_pages import ConfirmedPages
from controllers.contract import PoolTransferResult
from controllers.deployments import Deployment, PoolQuery
from controllers.group_search import GroupLayout, GroupSearch, group_layout


@dataclass
class _Query:
    key: tuple
    search: GroupSearch
    ranks: set[tuple[int, int]]
    group: int
    cond: threading.Condition  # on the GroupQueries lock: wakes this query's callers only
    done: bool = False
    error: BaseException | None = None
    waiting: int = 0       # callers waiting on ``cond``
    promote: bool = False  # one of them is asked to lead (a leader place is kept for it)


@dataclass
class _Answer:
    at: float
    result: PoolTransferResult
    ranks: set[tuple[int, int]]


@dataclass
class GroupQueryStats:
    """Counters since start: queries answered from a recent answer (another rank's), by
    joining a check in flight, from confirmations alone (no store call), and with store
    checks of their own; store calls made and the seconds they took."""

    recent: int = 0
    inflight: int = 0
    confirmed: int = 0
    checked: int = 0
    store_calls: int = 0
    store_seconds: float = 0.0


class GroupQueries:
    """See the module docstring. ``exists(objects) -> list[int]`` returns 1 / 0 /
    negative per object; ``confirm_ttl_s`` (below the store's lease; 0 = off) is how
    long a confirmed page is trusted; ``on_check(seconds)`` is told the duration of each
    store call, ``on_query(how)`` how each query was answered (a ``GroupQueryStats``
    field name: ``"recent"``, ``"inflight"``, ``"confirmed"`` or ``"checked"``)."""

    def __init__(self, exists: Callable[[list[str]], list[int]], window_s: float,
                 confirm_ttl_s: float = 0.0,
                 on_check: Callable[[float], None] = lambda s: None,
                 on_query: Callable[[str], None] = lambda how: None,
                 max_recent: int = 4096, parallel: int = 4) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self._exists = exists
        self._window = window_s
        self.confirmed = ConfirmedPages(confirm_ttl_s)
        self._on_check = on_check
        self._on_query = on_query
        self._max_recent = max_recent
        self._lock = threading.Lock()
        self._recent: OrderedDict[tuple, _Answer] = OrderedDict()
        self._inflight: dict[tuple, _Query] = {}
        self._pending: list[_Query] = []
        self._layouts: dict[tuple, GroupLayout] = {}
        self._parallel = parallel
        self._leaders = 0  # callers checking queued queries now
        self.stats = GroupQueryStats()

    def forget(self) -> None:
        """Drop every confirmation: the store may have lost objects (a node left, the
        master restarted, objects were removed by force)."""
        self.confirmed.forget()

    def _layout(self, dep: Deployment, queries: Sequence[PoolQuery]) -> GroupLayout:
        key = (dep.deployment_id, dep.version, tuple(queries))
        layout = self._layouts.get(key)
        if layout is None:
            layout = group_layout(dep, queries)
            if len(self._layouts) >= 1024:
                self._layouts.clear()
            self._layouts[key] = layout
        return layout

    def ask(self, dep: Deployment, keys: Sequence[str], queries: Sequence[PoolQuery],
            rank: tuple[int, int] = (0, 0)) -> PoolTransferResult:
        """The group hit of ``dep`` for page ``keys`` and extra pools ``queries``, asked
        by ``rank``. ``ValueError`` if ``queries`` names a pool the deployment did not
        register; a store failure raises for every query of that check."""
        key = (dep.deployment_id, tuple(keys), tuple(queries))
        group = dep.tp_size * dep.pp_size
        search = None
        while True:
            with self._lock:
                now = time.monotonic()
                while self._recent and (next(iter(self._recent.values())).at
                                        < now - self._window
                                        or len(self._recent) > self._max_recent):
                    self._recent.popitem(last=False)
                hit = self._recent.get(key)
                if hit is not None and rank not in hit.ranks:
                    self.stats.recent += 1
                    hit.ranks.add(rank)
                    if len(hit.ranks) >= group:
                        del self._recent[key]
                    break
                hit = None
                q = self._inflight.get(key)
                if q is not None:
                    self.stats.inflight += 1
                    q.ranks.add(rank)
                    how = "inflight"
                    break
                if search is not None:
                    q = _Query(key, search, {rank}, group, threading.Condition(self._lock))
                    if search.result is not None:
                        self.stats.confirmed += 1
                        self._finish([q], now)
                        how = "confirmed"
                        break
                    self._inflight[key] = q
                    self._pending.append(q)
                    self.stats.checked += 1
                    how = "checked"
                    break
            # outside the lock, then look again
            search = GroupSearch(self._layout(dep, queries), keys, self.confirmed,
                                 time.monotonic())
        if hit is not None:
            self._on_query("recent")
            return hit.result
        self._on_query(how)
        while self._wait(q):
            self._lead(q)
        if q.error is not None:
            raise q.error
        return q.search.result

    def _wait(self, q: _Query) -> bool:
        """Wait until ``q`` is answered (False) or this caller is to lead (True: a
        leader place is taken for it)."""
        with self._lock:
            q.waiting += 1
            try:
                while True:
                    if q.promote:
                        q.promote = False
                        if not q.done:
                            return True
                        self._leaders -= 1  # answered meanwhile: the place goes on
                        self._promote()
                    if q.done:
                        return False
                    if self._pending and self._leaders < self._parallel:
                        self._leaders += 1
                        return True
                    q.cond.wait()
            finally:
                q.waiting -= 1

    def _lead(self, q: _Query) -> None:
        """Check queued queries until ``q`` is answered or nothing is queued; then give
        the place up to a caller whose query waits in the queue."""
        try:
            while True:
                with self._lock:
                    if q.done or not self._pending:
                        break
                    batch, self._pending = self._pending, []
                self._answer(batch)
        finally:
            with self._lock:
                self._leaders -= 1
                self._promote()

    def _promote(self) -> None:
        """Under the lock: wake one caller of queued queries per free leader place."""
        for p in self._pending:
            if self._leaders >= self._parallel:
                return
            if p.waiting and not p.promote:
                p.promote = True
                self._leaders += 1
                p.cond.notify()

    def _answer(self, batch: list[_Query]) -> None:
        """One store call for the current step of every query in ``batch``; queries
        with a further step go back in the queue."""
        if len(batch) == 1:
            union, names = None, batch[0].search.wanted
        else:
            union: dict[str, int] = {}
            for q in batch:
                for o in q.search.wanted:
                    union.setdefault(o, len(union))
            names = list(union)
        since, t = time.monotonic(), time.perf_counter()
        try:
            codes, error = self._exists(names), None
        except Exception as e:  # every waiter of this round gets it
            codes, error = None, e
        took = time.perf_counter() - t
        self._on_check(took)
        for q in batch:  # outside the lock: other leaders and callers go on meanwhile
            if codes is None:
                q.error = error
                continue
            mine = codes if union is None else [codes[union[o]] for o in q.search.wanted]
            try:
                q.search.feed(mine, since)
            except Exception as e:  # reported to this query's callers only
                q.error = e
        with self._lock:
            self.stats.store_calls += 1
            self.stats.store_seconds += took
            finished = [q for q in batch if q.error is not None or q.search.result is not None]
            self._pending += [q for q in batch if q.error is None and q.search.result is None]
            self._finish(finished, time.monotonic())
            self._promote()

    def _finish(self, queries: list[_Query], now: float) -> None:
        """Under the lock: mark ``queries`` answered and keep their answers for the
        ranks that have not had them yet."""
        for q in queries:
            self._inflight.pop(q.key, None)
            self._recent.pop(q.key, None)
            if q.error is None and self._window > 0 and len(q.ranks) < q.group:
                self._recent[q.key] = _Answer(now, q.search.result, q.ranks)
            q.done = True
            q.cond.notify_all()
