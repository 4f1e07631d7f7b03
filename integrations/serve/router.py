"""``RayKVRouter``: a Ray Serve ``RequestRouter`` that sends a request to the replica
whose node holds the most of its prefix in the nearest tier (imports Ray Serve).

Per request, in the handle's process (Ray Serve LLM's ingress): the prompt's token ids
(``prompt_tokens``), the object keys of its loadable blocks as the engines' connector
keys them (``route_keys``; on the router's one keys thread when text must be tokenized
or the prompt is longer than ``INLINE_TOKENS``, so the router's event loop serves other
requests meanwhile: one thread, as more would only contend for the GIL and the
tokenizer's own threads. A request is routed on the part of it known at once, its first
``INLINE_TOKENS`` token ids or the leading text the memo holds (which is what other
requests share), the rest of its keys made meanwhile and counted for its replica once
made; a text the memo holds nothing of waits for its keys ``keys_wait_ms`` at most), the
residency of those keys on each candidate replica's node as the router's view has it
(``residency_view``: no call, microseconds), the pages the router itself sent to each
candidate lately (``sent_keys``: its stand-in for the engine's own cache, learnt in
``on_request_routed``), and ranked groups of replicas by tier held against queue length
(``ranking``). Beside the requests, one task per node of the replicas asks that node's
actor what changed every ``refresh_ms`` (``residency_changes``, each call within
``deadline_ms``), so the view lags the nodes by about one refresh. A request the view
and the engine tier tell no replica apart for (a new prefix) goes to the replicas queued
shortest and, among them, sent the fewest requests lately (``ranking.spread``, over the
last ``SPREAD_WINDOW``): the conversations and documents that later requests follow
spread evenly. Any error, no token ids, no key, or a node not heard from for
``stale_ms``: Ray Serve's power of two choices, as if raykv were not there. The router
never decides a load: each engine's connector does, so a wrong or stale view costs a
hit, never bytes.

Configure it in ``LLMConfig.deployment_config``::

    "request_router_config": RequestRouterConfig(
        request_router_class="raykv.integrations.serve.router:RayKVRouter",
        request_router_kwargs={"model_name": ..., "block_size": ..., ...})

with the keys of ``route_keys.RouteOptions``. ``counts``: requests ``routed`` by
residency, ``spread`` (a new prefix), ``fallback`` (power of two), ``failed`` (an error,
logged at most once a minute), ``overhead_s`` (seconds spent choosing, in all),
``refreshed`` and ``refresh_failed`` (calls to the nodes' logs), ``keys_known``
(routed on the part known at once, the rest of their keys made after), ``keys_late``
(nothing known at once, their keys not made within ``keys_wait_ms``) and
``keys_dropped`` (routed on their known part alone, ``MAX_BEHIND`` requests' keys being
made already); ``recent_s``: the
seconds each of the last ``RECENT`` requests spent choosing; ``recent_parts``: of the
last ``RECENT`` requests that had keys, the seconds spent on their keys (token ids and
page hashes) and on the view's answers; ``text_memo()``: the prompt text memo's
counters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray.serve._private.common import ReplicaID
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica
from raykv.cache_actors.rank.rank_owner import RankOwner
from raykv.cache_actors.throttled_log import ThrottledLog
from raykv.controllers.residency import MAX_CHANGES
from raykv.integrations.serve.node_answers import NodeAnswers
from raykv.integrations.serve.prompt_tokens import PromptTokens
from raykv.integrations.serve.ranking import Credit, Weights, rank, spread
from raykv.integrations.serve.residency_view import ResidencyView
from raykv.integrations.serve.route_keys import RouteKeys, RouteOptions
from raykv.integrations.serve.sent_keys import SPREAD_WINDOW, RecentRoutes, RoutedKeys

log = logging.getLogger(__name__)

RECENT = 1024
ROUTING = 4096
"""Requests whose keys the router holds between choosing their replica and Serve's
``on_request_routed`` at most (a request Serve never routes is forgotten oldest first)."""
INLINE_TOKENS = 2048
"""Token ids a request may carry to have its keys made on the event loop (about 0.6 ms
of hashing here at 16 tokens a block); longer prompts and text are done on a thread."""
MAX_BEHIND = 256
"""Requests routed before their keys were made whose keys the keys thread may still be
making, at most; past it a request is routed on its known part alone."""


class RayKVRouter(PowerOfTwoChoicesRequestRouter):
    """See the module docstring. ``initialize_state`` takes ``request_router_kwargs``
    (``RouteOptions``: ``ValueError`` for bad ones, at deployment)."""

    def initialize_state(self, **kwargs) -> None:
        self.options = RouteOptions.parse(kwargs)
        self._keys = RouteKeys(self.options)
        self._nodes = NodeAnswers(self.options.namespace,
                                  RankOwner.of_config(self._keys.config))
        self._tokens = PromptTokens(self.options.tokenizer, self.options.text_memo_ids)
        o = self.options
        self._weights = Weights(o.weight_engine, o.weight_l2, o.weight_segment, o.weight_l3,
                                o.weight_load, o.max_queue_gap)
        self._credit = None if o.page_bytes is None else Credit(
            o.page_bytes, o.block_size / o.prefill_tokens_per_s)
        self.routed = RoutedKeys(o.engine_blocks)
        self.recent = RecentRoutes(SPREAD_WINDOW)
        # request id -> (its keys known when routed, the future of its whole keys)
        self._routing: OrderedDict[str, tuple[list[str], asyncio.Future | None]] = \
            OrderedDict()
        self._warn = ThrottledLog(log)
        self.view = ResidencyView(o.stale_ms / 1e3, time.monotonic)
        self._refreshing: dict[str, asyncio.Task] = {}
        self.counts = {"routed": 0, "spread": 0, "fallback": 0, "failed": 0, "overhead_s": 0.0,
                       "refreshed": 0, "refresh_failed": 0, "keys_known": 0,
                       "keys_late": 0, "keys_dropped": 0}
        self._behind = 0
        self.recent_s: deque[float] = deque(maxlen=RECENT)
        self.recent_parts: deque[tuple[float, float]] = deque(maxlen=RECENT)
        self._keys_thread = ThreadPoolExecutor(1, thread_name_prefix="raykv-router-keys")

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's, then (when called on the router's event loop) the view watches
        exactly the replicas' nodes, their actors looked up ahead of the first request."""
        super().update_replicas(replicas)
        self.routed.keep_only(r.replica_id for r in replicas)
        self.recent.keep_only(r.replica_id for r in replicas)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._watch({r.node_id for r in replicas}, exact=True)

    def _watch(self, nodes: set[str], exact: bool) -> None:
        """Keep the view of ``nodes`` fresh (``exact``: and of no other node). On the
        router's event loop."""
        if exact:
            for node in set(self._refreshing) - nodes:
                self._refreshing.pop(node).cancel()
            self.view.watch(nodes)
        else:
            self.view.watch(set(self.view.nodes) | nodes)
        self._nodes.warm(nodes)
        for node in nodes - set(self._refreshing):
            self._refreshing[node] = asyncio.ensure_future(self._refresh(node))

    async def _refresh(self, node: str) -> None:
        """Ask ``node``'s log what changed every ``refresh_ms`` (at once again after a
        full answer), one call at a time, each within ``deadline_ms``, until cancelled;
        a failed call is counted (the node goes stale in the view if none succeeds for
        ``stale_ms``)."""
        period, deadline = self.options.refresh_ms / 1e3, self.options.deadline_ms / 1e3
        loop = asyncio.get_running_loop()
        while True:
            t, more = loop.time(), False
            try:
                answer = await self._nodes.changes(node, self.view.since(node), deadline)
                self.view.apply(answer)
                self.counts["refreshed"] += 1
                more = len(answer.changes) >= MAX_CHANGES  # the rest: ask again now
            except Exception as e:
                self.counts["refresh_failed"] += 1
                log.debug("RayKVRouter: refreshing the view of node %s failed: %s",
                          node[:8], e)
            await asyncio.sleep(0.0 if more else max(0.0, period - (loop.time() - t)))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        t = time.perf_counter()
        try:
            how, ranked = await self._by_residency(candidate_replicas, pending_request)
        except Exception as e:
            self.counts["failed"] += 1
            self._warn.warn("route", "RayKVRouter: routing by residency failed, power of "
                            "two choices instead: %s", e)
            how, ranked = "fallback", None
        took = time.perf_counter() - t
        self.counts["overhead_s"] += took
        self.recent_s.append(took)
        self.counts[how] += 1
        if ranked is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        return ranked

    async def _by_residency(self, candidates: list[RunningReplica], request: PendingRequest | None
                            ) -> tuple[str, list[list[RunningReplica]] | None]:
        """``(how, ranked groups)``: ``routed`` by residency, ``spread`` (a new prefix)
        or ``fallback`` (None: power of two)."""
        fallback = ("fallback", None)
        if request is None or len(candidates) < 2:
            return fallback
        nodes = {c.node_id for c in candidates}
        if not nodes <= set(self._refreshing):
            self._watch(nodes, exact=False)
        t = time.perf_counter()
        tokens = self._tokens.given(request.args, request.kwargs)
        later: asyncio.Future | None = None
        if tokens is not None and len(tokens) <= INLINE_TOKENS:
            keys = self._keys.keys(tokens)
        elif tokens is not None or self._tokens.ready:
            keys, later = await self._keys_within(request, tokens)
        else:
            return fallback  # text, and no tokenizer (yet)
        if not keys and later is None:
            return fallback
        self._routing[request.metadata.internal_request_id] = (keys, later)
        while len(self._routing) > ROUTING:
            self._routing.popitem(last=False)
        t_keys = time.perf_counter()
        per_page = self._keys.per_page
        answers = {n: a for n in nodes
                   if (a := self.view.answer(n, keys, per_page)) is not None}
        self.recent_parts.append((t_keys - t, time.perf_counter() - t_keys))
        if len(answers) < len(nodes):
            return fallback  # a partial view (see ``ranking``)
        cache = self.replica_queue_len_cache

        def queue_len(c: RunningReplica) -> int | None:
            return cache.get(c.replica_id)

        worth = None if self._credit is None else {
            n: self._credit.worth(self.view.load_s(n)) for n in answers}
        ranked = rank(candidates, lambda c: c.node_id, answers, queue_len, self._weights,
                      lambda c: self.routed.pages(c.replica_id, keys, per_page), worth)
        if ranked is None:
            return "spread", spread(candidates, lambda c: self.recent.count(c.replica_id),
                                    queue_len)
        return "routed", ranked

    async def _keys_within(self, request: PendingRequest, tokens: list[int] | None
                           ) -> tuple[list[str], asyncio.Future | None]:
        """``(keys to route on, the future of the request's whole keys or None)``. The
        keys of the part known at once (``_known_keys``) when there is one, the whole
        keys made meanwhile on the keys thread (``keys_known``); else the whole keys,
        waited for ``keys_wait_ms`` at most, past which what is known by then
        (``keys_late``). With ``MAX_BEHIND`` requests' keys still being made, none are
        made: the known part's keys alone (``keys_dropped``)."""
        known = self._known_keys(request, tokens)
        if self._behind >= MAX_BEHIND:
            self.counts["keys_dropped"] += 1
            return known, None
        work = asyncio.get_running_loop().run_in_executor(
            self._keys_thread, self._keys_of, request, tokens)
        if known:
            self.counts["keys_known"] += 1
        else:
            try:
                return await asyncio.wait_for(asyncio.shield(work),
                                              self.options.keys_wait_ms / 1e3), None
            except TimeoutError:
                self.counts["keys_late"] += 1
                known = self._known_keys(request, tokens)  # another's may have filled it
        self._behind += 1
        work.add_done_callback(self._one_less_behind)
        return known, work

    def _one_less_behind(self, work: asyncio.Future) -> None:
        self._behind -= 1
        if not work.cancelled():
            work.exception()  # retrieved: a request Serve never routes is not logged

    def _known_keys(self, request: PendingRequest, tokens: list[int] | None) -> list[str]:
        """Keys of the request's leading part known without the keys thread: its first
        ``INLINE_TOKENS`` token ids, or the text the memo holds (``PromptTokens.known``)."""
        known = tokens[:INLINE_TOKENS] if tokens is not None else \
            self._tokens.known(request.args, request.kwargs)
        return self._keys.keys(known) if known else []

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: object) -> None:
        """Serve sent ``pending_request`` to ``replica_id``: its keys (if the router
        made them; those still being made once they are) count as that replica's from
        now on (``sent_keys``), and the request among those it was sent lately."""
        self.recent.routed(replica_id)
        keys, later = self._routing.pop(pending_request.metadata.internal_request_id,
                                        ([], None))
        if keys:
            self.routed.routed(replica_id, keys)
        if later is not None:
            later.add_done_callback(lambda f: self._routed_later(replica_id, f))

    def _routed_later(self, replica_id: ReplicaID, work: asyncio.Future) -> None:
        """A late request's whole keys count as ``replica_id``'s (on the event loop)."""
        if work.cancelled() or work.exception() is not None:
            self._warn.warn("keys", "RayKVRouter: a request's keys failed: %s",
                            "cancelled" if work.cancelled() else work.exception())
            return
        if work.result():
            self.routed.routed(replica_id, work.result())

    def text_memo(self) -> dict[str, Any]:
        """The prompt text memo's counters (``PromptTokens.text_stats``; {} without one)."""
        return self._tokens.text_stats()

    def _keys_of(self, request: PendingRequest, tokens: list[int] | None) -> list[str]:
        """The request's keys, its text tokenized first if it carries no ``tokens`` (on
        a thread)."""
        tokens = tokens or self._tokens.of(request.args, request.kwargs)
        return self._keys.keys(tokens) if tokens else []
