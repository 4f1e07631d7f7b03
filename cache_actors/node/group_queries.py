"""Answering group existence queries: shared within a window, batched when concurrent.

``GroupQueries.submit`` starts a query on behalf of one rank ``(tp_rank, pp_rank)`` of
one engine (``StorageConfig.engine_id``) and calls ``done(result, error)`` once it is
answered; it never blocks. An answer is shared by the ranks of the engine that ask the
same question (deployment, page keys, pools): a query that arrives while the same one
is being looked up joins it, and a rank that has not yet had a recent answer (at most
``window_s`` seconds old) gets that very answer. So every rank of one engine step gets
the identical hit. A rank that asks again gets a fresh answer, and an answer is dropped
once every rank of the group has had it, so a miss is never served from memory to a
later request after the pages were stored. Ranks that name no engine share answers as
one engine per deployment: two replicas asking the same keys within the window can
then take each other's answers, so one replica's ranks can get different hits.

Each query is a ``GroupSearch``: it looks up only the objects that can change its answer
and that the store has not confirmed within ``confirm_ttl_s`` (``ConfirmedPages``:
Mooncake leases every object it reports present), so a query may be answered at once,
in the submitting thread, with no store call. Per deployment and pool set, the share of
recent queries that needed an existence check and found their first page (a moving average)
decides how a query looks up: mostly hits, every object in one store call (one round
trip); mostly misses, a probe of page 0 first (a miss then costs a handful of objects).
The others queue; up to ``parallel`` query threads take everything queued, make one
``exists`` call over the union of the objects the current step of each query needs (no
name twice), feed the codes back, call ``done`` for the queries answered and queue the
rest for their next step. Nobody waits on a query but its own ``done``: under load one
store call and one thread wake-up serve a whole batch. Lookup threads are started when
work is queued and none is idle, and end after ``idle_s`` without work; two of them (the
default) gave the most group queries/s on 2 cores (four: ~20% fewer, smaller batches).
What happened is told to ``on_query`` and ``on_store_call`` (``NodeMetrics`` counts it).
Pure logic: the store is a callable.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raykv.controllers.confirmed_pages import ConfirmedPages
from raykv.controllers.contract import PoolTransferResult, check_engine_id
from raykv.controllers.deployments import Deployment, PoolQuery, check_group_query
from raykv.controllers.families import GroupFamilies, group_families
from raykv.controllers.group_search import GroupSearch
from raykv.controllers.object_batch import check_object_keys

Done = Callable[[PoolTransferResult | None, BaseException | None], None]
log = logging.getLogger(__name__)

HIT_SHARE_WEIGHT = 0.1  # of the newest looked-up query in the moving average of hits
SPECULATE_FROM = 0.5    # share of hits from which a query looks everything up at once


def _tell(done: Done, result: PoolTransferResult | None, error: BaseException | None) -> None:
    """Call ``done``; its own failure (a caller gone) is logged, never raised into the
    thread answering other queries."""
    try:
        done(result, error)
    except Exception:
        log.exception("a group query's done callback failed")


@dataclass
class _Query:
    key: tuple
    search: GroupSearch
    ranks: set[tuple[int, int]]
    group: int
    done: list[Done]  # one per caller of this query
    error: BaseException | None = None


@dataclass
class _Answer:
    at: float
    result: PoolTransferResult
    ranks: set[tuple[int, int]]


class GroupQueries:
    """See the module docstring. ``exists(objects) -> list[int]`` returns 1 / 0 /
    negative per object; ``confirm_ttl_s`` (below the store's lease; 0 = off) is how
    long a confirmed page is trusted; ``on_store_call(seconds)`` is told the duration of
    each store call (on the query thread, before its queries are answered),
    ``on_query(how)`` how each query was answered, under this object's lock, before the
    answer is handed over: ``"recent"`` (another rank's recent answer), ``"inflight"``
    (joined an existence check in flight), ``"confirmed"`` (from confirmations alone, no store
    call) or ``"looked_up"`` (existence checks of its own)."""

    def __init__(self, exists: Callable[[list[str]], list[int]], window_s: float,
                 confirm_ttl_s: float = 0.0,
                 on_store_call: Callable[[float], None] = lambda s: None,
                 on_query: Callable[[str], None] = lambda how: None,
                 max_recent: int = 4096, parallel: int = 2, idle_s: float = 5.0) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self._exists = exists
        self._window = window_s
        self.confirmed = ConfirmedPages(confirm_ttl_s)
        self._on_store_call = on_store_call
        self._on_query = on_query
        self._max_recent = max_recent
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # query threads wait here
        self._recent: OrderedDict[tuple, _Answer] = OrderedDict()
        self._inflight: dict[tuple, _Query] = {}
        self._pending: list[_Query] = []
        self._family_sets: dict[tuple, GroupFamilies] = {}
        self._hit_share: dict[frozenset, float] = {}  # per group key, moving average
        self._parallel = parallel
        self._idle_s = idle_s
        self._threads = 0  # query threads alive
        self._idle = 0     # of which waiting for work

    def forget(self) -> None:
        """Drop every confirmation: the store may have lost objects (a node left, the
        master restarted, objects were removed by force)."""
        self.confirmed.forget()

    def _families(self, dep: Deployment, queries: Sequence[PoolQuery]) -> GroupFamilies:
        key = (dep.deployment_id, dep.version, tuple(queries))
        families = self._family_sets.get(key)
        if families is None:
            families = group_families(dep, queries)
            if len(self._family_sets) >= 1024:
                self._family_sets.clear()
            self._family_sets[key] = families
        return families

    def submit(self, dep: Deployment, keys: Sequence[str], queries: Sequence[PoolQuery],
               rank: tuple[int, int], done: Done, engine: str = "") -> None:
        """Start the group hit query of ``dep`` for page ``keys`` and extra pools
        ``queries``, asked by ``rank`` of ``engine`` ("": none named); ``done(result,
        None)`` or ``done(None, error)`` is called once it is answered (a store failure:
        for every query of that check), in this thread if the answer is known at once.
        ``ValueError`` (raised here, ``done`` never called) if ``queries`` names a pool
        the deployment did not register, ``keys`` that are not a list of non-empty str
        of at most ``MAX_BATCH_OBJECTS`` (``check_object_keys``), an ``engine`` that is
        not a str of at most ``MAX_ENGINE_ID`` characters, or a ``rank`` not of the
        group or ill-formed ``queries`` (``check_group_query``)."""
        keys = check_object_keys(keys, "the group query's keys")
        check_engine_id(engine, "a group query's engine", unnamed=True)
        rank, queries = check_group_query(dep, rank, queries)
        key = (dep.deployment_id, engine, tuple(keys), tuple(queries))
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
                    hit.ranks.add(rank)
                    if len(hit.ranks) >= group:
                        del self._recent[key]
                    how = "recent"
                    self._on_query(how)
                    break
                hit = None
                q = self._inflight.get(key)
                if q is not None:
                    q.ranks.add(rank)
                    q.done.append(done)
                    how = "inflight"
                    self._on_query(how)
                    break
                if search is not None:
                    q = _Query(key, search, {rank}, group, [done])
                    if search.result is not None:
                        self._keep([q], now)
                        how = "confirmed"
                        self._on_query(how)
                        break
                    self._inflight[key] = q
                    self._pending.append(q)
                    how = "looked_up"
                    self._on_query(how)
                    self._wake()
                    q = None  # answered by a query thread
                    break
            # outside the lock, then look again
            families = self._families(dep, queries)
            search = GroupSearch(
                families, keys, self.confirmed, time.monotonic(),
                speculate=self._hit_share.get(families.key, 0.0) >= SPECULATE_FROM)
        if hit is not None:
            _tell(done, hit.result, None)
        elif how == "confirmed":
            _tell(done, q.search.result, None)

    def _wake(self) -> None:
        """Under the lock: get a query thread to the queue, starting one if none is idle."""
        if self._idle:
            self._work.notify()
        elif self._threads < self._parallel:
            self._threads += 1
            threading.Thread(target=self._serve_queue, name="raykv-group-query",
                             daemon=True).start()

    def _serve_queue(self) -> None:
        """A query thread: answer queued queries until idle for ``idle_s``."""
        while True:
            with self._lock:
                while not self._pending:
                    self._idle += 1
                    woken = self._work.wait(self._idle_s)
                    self._idle -= 1
                    if not woken and not self._pending:
                        self._threads -= 1
                        return
                batch, self._pending = self._pending, []
            try:
                self._answer(batch)
            except Exception as e:  # a bug: never leave the callers waiting
                log.exception("answering a batch of group queries failed")
                with self._lock:
                    for q in batch:
                        self._inflight.pop(q.key, None)
                for q in batch:
                    for done in q.done:
                        _tell(done, None, e)

    def _answer(self, batch: list[_Query]) -> None:
        """One store call for the current step of every query in ``batch``; queries
        with a further step go back in the queue; the answered are told."""
        wanted = [q.search.wanted for q in batch]
        names = list(itertools.chain.from_iterable(wanted))
        union = dict.fromkeys(names)  # no name twice (prompts sharing a prefix)
        shared = len(union) < len(names)
        if shared:
            names = list(union)
        since, t = time.monotonic(), time.perf_counter()
        try:
            codes, error = self._exists(names), None
        except Exception as e:  # every query of this round gets it
            codes, error = None, e
        took = time.perf_counter() - t
        self._on_store_call(took)
        if codes is not None and len(codes) != len(names):
            codes, error = None, RuntimeError(
                f"the store answered {len(codes)} codes for {len(names)} objects")
        if codes is not None and shared:
            union = dict(zip(names, codes, strict=True))
        at = 0
        for q, mine in zip(batch, wanted, strict=True):
            if codes is None:
                q.error = error
                continue
            if shared:
                mine = list(map(union.__getitem__, mine))
            else:
                mine, at = codes[at:at + len(mine)], at + len(mine)
            try:
                q.search.feed(mine, since)
            except Exception as e:  # reported to this query's callers only
                q.error = e
        with self._lock:
            finished = [q for q in batch if q.error is not None or q.search.result is not None]
            again = [q for q in batch if q.error is None and q.search.result is None]
            if again:
                self._pending += again
                if self._idle:  # another query thread may take them while this one replies
                    self._work.notify()
            self._keep(finished, time.monotonic())
            for q in finished:
                self._inflight.pop(q.key, None)
                if q.error is None:
                    key = q.search.group.key
                    share = self._hit_share.get(key, 0.0)
                    if len(self._hit_share) >= 1024 and key not in self._hit_share:
                        self._hit_share.clear()  # deployments come and go: start over
                    self._hit_share[key] = share + HIT_SHARE_WEIGHT * (
                        q.search.first_page_present - share)
        for q in finished:  # callers joined until the query left ``_inflight``
            for done in q.done:
                _tell(done, None if q.error else q.search.result, q.error)

    def _keep(self, queries: list[_Query], now: float) -> None:
        """Under the lock: keep the answers of ``queries`` for the ranks of the group
        that have not had them yet."""
        for q in queries:
            self._recent.pop(q.key, None)
            if q.error is None and self._window > 0 and len(q.ranks) < q.group:
                self._recent[q.key] = _Answer(now, q.search.result, q.ranks)
