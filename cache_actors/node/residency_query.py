"""A node's answers to routers: where a chain of pages lives (``residency``), where
each object's replicas live (``locate``), and what changed in this node's tiers since
a router last asked (``changes``: the node's residency log, which keeps a router's view
of the node up to date so that choosing a replica needs no call at all).

``ResidencyQuery.residency`` answers in one store call (Mooncake's
``batch_get_replica_desc``) and one look at the node's L2 index
(``L2Pools.resident``: nothing leased, so routers asking every node hold no page from
eviction), as ``controllers.residency.Residency``. It never moves a byte and never
touches a pool.

Owner rules (``controllers.ownership``): the caller's claim is verified as for a data
call (a tenant's needs its call proof); every key must lie in the claim's key prefix
(a caller without one may not name a tenant's key), else the whole call is refused with
``ValueError``: a router learns nothing of keys outside its deployment, and a tenant's
keys are keyed page hashes only the tenant can compute. L2 counts only pools of the
caller's owner.

Bounds: at most ``MAX_BATCH_OBJECTS`` keys (``check_object_keys``); a call whose
thread starts after its ``deadline`` (``time.monotonic()`` of this node) is not run
(``DeadlineExceededError``); the store call itself is one round trip to the master.
``NodeUnavailableError`` while the node's ``mooncake_client`` is down (standalone).
A standalone node (a dummy client, ``MooncakeBackend.can_locate`` false) answers L3
through ``batch_is_exist`` and no own segment (``segment`` 0).

Threads: any thread (the node actor's ``route`` group executor); ``counts`` under
``_lock``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from raykv.cache_actors.errors import DeadlineExceededError
from raykv.cache_actors.node.load_costs import LoadCosts, tier_estimates
from raykv.cache_actors.node.owner_masks import outside
from raykv.cache_actors.node.residency_log import ResidencyLog
from raykv.cache_actors.node.why_query import WhyQuery
from raykv.controllers.node_records import ResidencyStats
from raykv.controllers.object_batch import check_object_keys
from raykv.controllers.ownership import OwnerClaim
from raykv.controllers.residency import (
    MAX_CHANGES,
    Residency,
    ResidencyChanges,
    check_pages,
    leading,
)

if TYPE_CHECKING:
    from raykv.cache_actors.node.l2_pools import L2Pools
    from raykv.cache_actors.node.node_store import NodeStore


class ResidencyQuery:
    """Residency and locate answers of node ``node_id`` from its ``store`` and ``l2``;
    ``verify``: a caller's claim checked (``NodeService.verify``); ``log``: the node's
    residency log; ``costs``: its load costs (what ``changes`` credits it with)."""

    def __init__(self, node_id: str, store: NodeStore, l2: L2Pools,
                 verify: Callable[[OwnerClaim | None], OwnerClaim | None],
                 log: ResidencyLog, costs: LoadCosts) -> None:
        self._node_id, self._store, self._l2, self._verify = node_id, store, l2, verify
        self._log, self._costs = log, costs
        self.why = WhyQuery(node_id, store, l2, verify)  # raykv why's facts, a route query
        self._lock = threading.Lock()
        self.counts = {"queries": 0, "refused": 0, "failed": 0, "late": 0, "seconds": 0.0}

    def residency(self, keys: list[str], per_page: int, claim: OwnerClaim | None,
                  deadline: float) -> Residency:
        """Leading pages of ``keys`` (``per_page`` keys a page, TP rank order within a
        page) in this node's L2, on its own segment and in L3 anywhere (see the module
        docstring for the rules and errors)."""
        t = time.perf_counter()
        with self._counting():
            owner = self._checked(keys, claim)
            pages = check_pages(keys, per_page)
            if time.monotonic() >= deadline:
                raise DeadlineExceededError("the residency query started after its "
                                            "deadline; it was not run")
            in_l2 = self._l2.resident(keys, None if owner is None else owner.owner)
            backend = self._store.backend
            own = backend.own_segment
            if backend.can_locate:
                where = self._located(keys)
                on_own = leading([own in w for w in where], per_page) if own else 0
                in_l3 = leading([bool(w) for w in where], per_page)
            else:  # a dummy client: L3 only, through exists
                epoch = self._store.before_call()
                codes = self._store.after_call(epoch, backend.exists(keys))
                if any(c < 0 for c in codes):
                    raise RuntimeError("the store's lookup failed")
                own, on_own, in_l3 = None, 0, leading([c == 1 for c in codes], per_page)
            answer = Residency(self._node_id, pages, leading(in_l2, per_page), on_own, in_l3,
                               own)
        with self._lock:
            self.counts["seconds"] += time.perf_counter() - t
        return answer

    def changes(self, since: tuple[str, int] | None, claim: OwnerClaim | None,
                deadline: float) -> ResidencyChanges:
        """The changes of the caller's owner (keys in its key prefix) after ``since``
        (``(incarnation, seq)`` of this node's last answer; None: none yet), or, when
        the log cannot answer from there, a ``reset`` with the caller's keys now ready
        in this node's L2 and its puts to this node's segment the log keeps (see
        ``cache_actors.node.residency_log``). Errors as
        ``residency``'s. ``load_s``: what this node's load costs say now."""
        with self._counting():
            claim = self._verify(claim)
            if time.monotonic() >= deadline:
                raise DeadlineExceededError("the changes query started after its "
                                            "deadline; it was not run")
            owner = None if claim is None else claim.owner
            prefix = "" if claim is None else claim.key_prefix
            log = self._log
            got = None
            if since is not None and since[0] == log.incarnation:
                got = log.since(since[1], owner, prefix)
            load_s = tier_estimates(self._costs, self._store.backend.own_segment)
            if got is not None:
                return ResidencyChanges(self._node_id, log.incarnation, got[1], False, got[0],
                                        load_s)
            keys, seq = self._l2.ready_keys(owner, prefix, MAX_CHANGES)
            put = log.kept("segment", owner, prefix, MAX_CHANGES - len(keys))
            return ResidencyChanges(self._node_id, log.incarnation, seq, True,
                                    [("l2", k, True) for k in keys] + put, load_s)

    def locate(self, keys: list[str], claim: OwnerClaim | None) -> list[list[str]]:
        """Per key, the segments holding a complete replica of it (empty: L3 has
        none); the same rules and errors as ``residency``, and ``RuntimeError`` on a
        node whose client cannot locate (standalone)."""
        with self._counting():
            self._checked(keys, claim)
            if not self._store.backend.can_locate:
                raise RuntimeError("this node's Mooncake client (standalone: a dummy of "
                                   "mooncake_client) cannot locate replicas")
            return [list(w) for w in self._located(keys)]

    def stats(self) -> ResidencyStats:
        """``queries`` answered or refused, ``refused`` (bad input or claim),
        ``failed`` (store errors), ``late`` (past their deadline), ``seconds`` spent
        answering."""
        with self._lock:
            return ResidencyStats(**self.counts)

    # ----------------------------------------------------------------- helpers
    def _checked(self, keys: list[str], claim: OwnerClaim | None) -> OwnerClaim | None:
        check_object_keys(keys, "the residency query's keys")
        claim = self._verify(claim)
        if outside(keys, claim) is not None:
            raise ValueError("keys outside the caller's key prefix (a tenant's keys need "
                             "the tenant's claim)")
        return claim

    def _located(self, keys: list[str]) -> list[tuple[str, ...]]:
        epoch = self._store.before_call()
        where = self._store.backend.locate(keys)
        if where is None:
            self._store.after_call(epoch, [-1])  # StoreUnavailableError if it went down
            raise RuntimeError("the store's replica lookup failed")
        return where

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        """Count one query and how it ended."""
        kind = None
        try:
            yield
        except DeadlineExceededError:
            kind = "late"
            raise
        except ValueError:
            kind = "refused"
            raise
        except Exception:
            kind = "failed"
            raise
        finally:
            with self._lock:
                self.counts["queries"] += 1
                if kind:
                    self.counts[kind] += 1
