"""``RayKVRouter``: a Ray Serve ``RequestRouter`` that sends a request to the replica
whose node holds the most of its prefix in the nearest tier (imports Ray Serve).

Per request, in the handle's process (Ray Serve LLM's ingress): the prompt's token ids
(``prompt_tokens``), the object keys of its loadable blocks as the engines' connector
keys them (``route_keys``; on the router's one keys thread when text must be tokenized
or the prompt is longer than ``INLINE_TOKENS``, so the router's event loop serves other
requests meanwhile: one thread, as more would only contend for the GIL and the
tokenizer's own threads), one ``residency`` call to the node actor of every
candidate replica's node, all at once under ``deadline_ms`` (``node_answers``), and
ranked groups of replicas by tier held against queue length (``ranking``). Any error,
no token ids, no key, a timeout, or answers that tell no replica apart: Ray Serve's
power of two choices, as if raykv were not there. The router never decides a load:
each engine's connector does, so a wrong or stale answer costs a hit, never bytes.

Configure it in ``LLMConfig.deployment_config``::

    "request_router_config": RequestRouterConfig(
        request_router_class="raykv.integrations.serve.router:RayKVRouter",
        request_router_kwargs={"model_name": ..., "block_size": ..., ...})

with the keys of ``route_keys.RouteOptions``. ``counts``: requests ``routed`` by
residency, ``fallback`` (power of two), ``failed`` (an error, logged at most once a
minute), and ``overhead_s`` (seconds spent choosing, in all); ``recent_s``: the
seconds each of the last ``RECENT`` requests spent choosing; ``recent_parts``: of the
last ``RECENT`` requests that asked node actors, the seconds spent on their keys (token
ids and page hashes) and on the node actors' answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica
from raykv.cache_actors.rank.rank_owner import RankOwner
from raykv.cache_actors.throttled_log import ThrottledLog
from raykv.integrations.serve.node_answers import NodeAnswers
from raykv.integrations.serve.prompt_tokens import PromptTokens
from raykv.integrations.serve.ranking import Weights, rank
from raykv.integrations.serve.route_keys import RouteKeys, RouteOptions

log = logging.getLogger(__name__)

RECENT = 1024
INLINE_TOKENS = 2048
"""Token ids a request may carry to have its keys made on the event loop (about 0.6 ms
of hashing here at 16 tokens a block); longer prompts and text are done on a thread."""


class RayKVRouter(PowerOfTwoChoicesRequestRouter):
    """See the module docstring. ``initialize_state`` takes ``request_router_kwargs``
    (``RouteOptions``: ``ValueError`` for bad ones, at deployment)."""

    def initialize_state(self, **kwargs) -> None:
        self.options = RouteOptions.parse(kwargs)
        self._keys = RouteKeys(self.options)
        self._nodes = NodeAnswers(self.options.namespace,
                                  RankOwner.of_config(self._keys.config))
        self._tokens = PromptTokens(self.options.tokenizer)
        o = self.options
        self._weights = Weights(o.weight_l2, o.weight_segment, o.weight_l3, o.weight_load)
        self._warn = ThrottledLog(log)
        self.counts = {"routed": 0, "fallback": 0, "failed": 0, "overhead_s": 0.0}
        self.recent_s: deque[float] = deque(maxlen=RECENT)
        self.recent_parts: deque[tuple[float, float]] = deque(maxlen=RECENT)
        self._keys_thread = ThreadPoolExecutor(1, thread_name_prefix="raykv-router-keys")

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's, then the node actors of the replicas' nodes are looked up ahead of
        the first request (when called on the router's event loop)."""
        super().update_replicas(replicas)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._nodes.warm(r.node_id for r in replicas)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        t = time.perf_counter()
        try:
            ranked = await self._by_residency(candidate_replicas, pending_request)
        except Exception as e:
            self.counts["failed"] += 1
            self._warn.warn("route", "RayKVRouter: routing by residency failed, power of "
                            "two choices instead: %s", e)
            ranked = None
        took = time.perf_counter() - t
        self.counts["overhead_s"] += took
        self.recent_s.append(took)
        if ranked is None:
            self.counts["fallback"] += 1
            return await super().choose_replicas(candidate_replicas, pending_request)
        self.counts["routed"] += 1
        return ranked

    async def _by_residency(self, candidates: list[RunningReplica],
                            request: PendingRequest | None) -> list[list[RunningReplica]] | None:
        if request is None or len(candidates) < 2:
            return None
        t = time.perf_counter()
        tokens = self._tokens.given(request.args, request.kwargs)
        if tokens is not None and len(tokens) <= INLINE_TOKENS:
            keys = self._keys.keys(tokens)
        elif tokens is not None or self._tokens.ready:
            keys = await asyncio.get_running_loop().run_in_executor(
                self._keys_thread, self._keys_of, request, tokens)
        else:
            return None  # text, and no tokenizer (yet)
        if not keys:
            return None
        t_keys = time.perf_counter()
        answers = await self._nodes.ask([c.node_id for c in candidates], keys,
                                        self._keys.per_page, self.options.deadline_ms / 1e3)
        self.recent_parts.append((t_keys - t, time.perf_counter() - t_keys))
        cache = self.replica_queue_len_cache
        return rank(candidates, lambda c: c.node_id, answers,
                    lambda c: cache.get(c.replica_id), self._weights)

    def _keys_of(self, request: PendingRequest, tokens: list[int] | None) -> list[str]:
        """The request's keys, its text tokenized first if it carries no ``tokens`` (on
        a thread)."""
        tokens = tokens or self._tokens.of(request.args, request.kwargs)
        return self._keys.keys(tokens) if tokens else []
