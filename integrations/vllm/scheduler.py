"""The scheduler side of raykv's vLLM connector (one per engine, in vLLM's scheduler).

``get_num_new_matched_tokens`` asks ONE raykv group query (``CacheClient.group_exists``)
about every TP rank's objects of the request's full blocks beyond vLLM's local hit, and
leaves at least one token to compute. Blocks are named by raykv's own page hashes
(``raykv.integrations.vllm.page_hash``, with vLLM's per-block extra keys: cache salt,
LoRA, multimodal inputs, prompt embeddings), computed here incrementally per request,
never by vLLM's ``request.block_hashes`` (whose root depends on ``PYTHONHASHSEED``).
The answer is the same for every rank, so ranks never load different prefixes. Each
step's loads and saves are decided by ``raykv.integrations.vllm.request_blocks`` and sent to the
workers as ``RayKVConnectorMetadata``. Every method runs on vLLM's scheduler thread.

With ``async_transfers`` the lookup runs on the lookup thread (``lookups.Lookups``:
waited for at most ``STEP_WAIT_S`` per step, else "ask again later", its answer cached
per request), and a hit that needs L3 answers ``(n, True)``: vLLM parks the request
and its load goes to the workers with the next metadata (``async_loads``), although
the request is not scheduled; a hit all in the node's L2 is loaded on the step.

The load guard (``load_choice``, setting ``load_guard``) picks per lookup the leading
blocks of a hit vLLM is told to load, here alone, so every rank loads the same prefix.

With vLLM's KV events on, the side keeps a ``kv_events.KVEventBook``: saves sent
(``build_connector_meta``), the workers' reports of those that landed
(``update_connector_output``) and lookups that stopped at a published block
(``_query``) become vLLM ``BlockStored`` / ``BlockRemoved`` events of raykv's tiers
(``take_events``, which vLLM's scheduler publishes with its own).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from raykv.cache_actors.rank.call_budget import Budget
from raykv.controllers.contract import PoolName
from raykv.controllers.pool_layout import PoolLayout
from raykv.integrations.vllm.connector_stats import growth_from_vllm
from raykv.integrations.vllm.kv_events import L2, L3, KVEventBook, record_saving, to_vllm
from raykv.integrations.vllm.kv_views import config_geometry, geometry_bytes
from raykv.integrations.vllm.load_choice import LoadGuard, copy_probe, count, explain
from raykv.integrations.vllm.load_times import hit_tokens
from raykv.integrations.vllm.lookups import STEP_WAIT_S, Lookups
from raykv.integrations.vllm.metadata import LandedReports, RayKVConnectorMetadata
from raykv.integrations.vllm.options import ConnectorOptions
from raykv.integrations.vllm.page_hash import PageHashChain
from raykv.integrations.vllm.request_blocks import (
    BlockTransfer,
    RequestBlocks,
    blocks_to_load,
    blocks_to_save,
    external_tokens,
    hash_hex,
    mark_failed,
    max_loadable_blocks,
    restart,
)
from raykv.integrations.vllm.side import ConnectorSide
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

if TYPE_CHECKING:
    from collections.abc import Iterable

    from raykv.cache_actors.rank.client import CacheClient
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm." + __name__)  # shows up with vLLM's own log lines


class RayKVConnectorScheduler(ConnectorSide):
    """The connector's scheduler-side methods (vLLM's signatures and contracts);
    ``do_load``/``do_save`` follow vLLM's ``kv_role``. Attaches to raykv at construction
    when it loads."""

    ROLE = "scheduler"

    def __init__(self, opts: ConnectorOptions, *, do_load: bool, do_save: bool,
                 block_size: int, tp_size: int, pp_size: int,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(opts, block_size=block_size, tp_rank=0, tp_size=tp_size, pp_rank=0,
                         pp_size=pp_size)
        self._kv_cache_config = kv_cache_config
        self.do_load, self.do_save = do_load, do_save
        self._reqs: dict[str, RequestBlocks] = {}
        self._failures_seen: set[int] = set()  # failed blocks not yet told to the workers
        # Every lookup of one scheduling step waits on raykv at most one timeout_s in all
        # (made at the step's first lookup, dropped in build_connector_meta).
        self._step_budget: Budget | None = None
        # async_transfers: the lookup thread, this step's end of waiting for its
        # answers, and the async loads to send with this step's metadata.
        self._lookups: Lookups | None = None
        self._wait_until: float | None = None
        self._async_loads: list[BlockTransfer] = []
        self._events = KVEventBook(tp_size) if opts.kv_events else None
        self._guard = LoadGuard(opts.load_guard, block_size, geometry_bytes(
            config_geometry(kv_cache_config)), copy_probe())
        if self.do_load:
            self._attach_at_start()  # not in the first lookup: see _cache

    def _attach(self) -> None:
        """``ConnectorSide._attach``, then the deployment registered with the
        controller and its lookup home readied (``CacheClient.register_deployment``):
        at start-up or on the attach thread, so no lookup pays for it. A registration
        that fails here (raykv restarting, a conflicting group) is warned about and tried
        again by the first lookup."""
        super()._attach()
        try:
            self._client.register_deployment()
        except Exception as e:
            self._warn.warn("register", "RayKVConnector: registering the deployment "
                            "failed (%s); the first lookup tries again", e)

    def _register(self, client: CacheClient, name: str) -> None:
        """The ranks' block geometry (vLLM's KV cache spec) registered as the KV pool's,
        with no memory: the scheduler only asks group queries, and the geometry names
        the deployment's pool spec, with the bytes per page of the workers' real blocks
        (the controller refuses another geometry under the same key prefix). Without a
        spec, a placeholder of one value per token."""
        geometry = config_geometry(self._kv_cache_config) or {
            "page_size": self.block_size, "layer_num": 1, "head_num": 1, "head_dim": 1,
            "dtype": "bfloat16", "itemsize": 2}
        client.register_mem_host_pool_v2(PoolLayout.vllm(size=self.block_size, **geometry),
                                         PoolName.KV)

    def _state(self, request: Request) -> RequestBlocks:
        """The tracked state of ``request`` (made on first sight), bound to this
        ``request`` object."""
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = RequestBlocks(
                request, PageHashChain(self.block_size))
        st.request = request
        return st

    def _page_hashes(self, st: RequestBlocks) -> list[bytes]:
        """The page hashes of every full block of the request so far (hashing only the
        blocks completed since the last call)."""
        req = st.request
        return st.chain.extend(req.all_token_ids, req.num_tokens,
                               partial(generate_block_hash_extra_keys, req))

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.do_load or num_computed_tokens % self.block_size:
            return 0, False
        local = num_computed_tokens // self.block_size
        st = self._state(request)
        hashes = self._page_hashes(st)[local:max_loadable_blocks(request.num_tokens,
                                                                   self.block_size)]
        if not hashes:
            return 0, False
        if self.opts.async_transfers:
            return self._lookup_async(st, local, hashes, num_computed_tokens)
        if self._step_budget is None:  # the first lookup of this scheduling step
            self._step_budget = Budget(self.opts.timeout_s)
        t0 = time.perf_counter()
        with self._step_budget:
            answer = self._query([hash_hex(h) for h in hashes])
        self.stats.lookup_us += int((time.perf_counter() - t0) * 1e6)
        return self._answer(st, local, len(hashes), answer, num_computed_tokens)[0], False

    def _query(self, keys: list[str]) -> tuple[int, int, list]:
        """``(leading blocks of keys in the node's L2, leading blocks in L2 or L3, the
        group answer's load_runs of the L3 part)``: the node's L2 first (its blocks
        need no L3 call), then one group query for the rest; what fails is a miss
        (warned)."""
        l2, runs = 0, []
        try:
            client = self._cache()
            if self.opts.l2_blocks:
                l2 = client.l2().lookup(keys, self.tp_size)
                if self._events is not None and l2 < len(keys):
                    self._events.missing(L2, keys[l2])
            hit = l2
            if l2 < len(keys):
                found = client.group_exists(keys[l2:])
                hit, runs = hit + found.kv_hit_pages, found.load_runs
                if self._events is not None and hit < len(keys):
                    self._events.missing(L3, keys[hit])
        except Exception as e:  # raykv unreachable, restarting, or refused: a miss
            self._warn.warn("query", "RayKVConnector: hit query failed, treated as a miss: "
                            "%s", e)
            hit, runs = l2, []
        return l2, hit, runs

    def _answer(self, st: RequestBlocks, local: int, asked: int, answer: tuple,
                num_computed_tokens: int) -> tuple[int, bool]:
        """Count a lookup's ``answer`` (``_query``'s) about ``asked`` blocks, let the
        load guard choose the leading blocks to load, count the tokens asked about and
        those to load by tier; ``(tokens to load, whether any is past the node's L2)``."""
        l2, hit, runs = answer
        self.stats.queries += 1
        self.stats.hit_blocks += hit
        self.stats.l2_hit_blocks += l2
        outcome = self._guard.choose(l2, hit, runs) if hit else None
        if outcome is not None:
            count(self.stats, outcome)
            hit, l2 = outcome.pages, min(l2, outcome.pages)
        st.local_hit_tokens, st.l2_hit_blocks = num_computed_tokens, l2
        n = external_tokens(local + hit, num_computed_tokens, self.block_size,
                            st.request.num_tokens)
        l2_tokens, l3_tokens = hit_tokens(n, l2, self.block_size)
        self.stats.asked_tokens += asked * self.block_size
        self.stats.l2_hit_tokens += l2_tokens
        self.stats.l3_hit_tokens += l3_tokens
        if self.opts.explain:
            log.info(explain(st.request.request_id, asked * self.block_size,
                             num_computed_tokens, n, outcome, self.block_size))
        return n, l3_tokens > 0

    def _lookup_async(self, st: RequestBlocks, local: int, hashes: list,
                      num_computed_tokens: int) -> tuple[int | None, bool]:
        """``async_transfers``: the lookup asked on the lookup thread and waited for at
        most what is left of this step's ``STEP_WAIT_S`` (None: ask again next step);
        a hit that needs L3 is loaded asynchronously, one all in L2 on the step. A
        request whose async load was sent once loads nothing more (its blocks that
        failed are recomputed, never asked for again in a loop)."""
        if st.async_sent:
            return 0, False
        if self._lookups is None:
            self._lookups = Lookups(miss=(0, 0, []))
        now = time.monotonic()
        if self._wait_until is None:  # the first lookup of this scheduling step
            self._wait_until = now + STEP_WAIT_S
        keys = [hash_hex(h) for h in hashes]
        answer = self._lookups.ask(st.request.request_id, (local, len(keys)),
                                   partial(self._query_budgeted, keys),
                                   max(0.0, self._wait_until - now))
        if answer is None:
            self.stats.lookups_pending += 1
            return None, False
        n, st.load_async = self._answer(st, local, len(keys), answer, num_computed_tokens)
        self.stats.async_lookups += st.load_async
        return n, st.load_async

    def _query_budgeted(self, keys: list[str]) -> tuple[int, int, list]:
        """``_query`` within one ``timeout_s`` (on the lookup thread)."""
        with Budget(self.opts.timeout_s):
            return self._query(keys)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        st = self._state(request)
        if self._lookups is not None:
            self._lookups.forget(request.request_id)
        load_async, st.load_async = st.load_async, False
        if num_external_tokens > 0:
            st.pending_load = blocks_to_load(request.request_id, blocks.get_block_ids()[0],
                                        self._page_hashes(st), st.local_hit_tokens,
                                        num_external_tokens, self.block_size)
            st.pending_load.l2_blocks = st.l2_hit_blocks
            if load_async:  # vLLM parks the request: its load goes out this step
                self._async_loads.append(st.pending_load)
                st.pending_load, st.async_sent = None, True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> \
            RayKVConnectorMetadata:
        self._step_budget = None  # the next step's lookups get a budget of their own
        self._wait_until = None
        meta = RayKVConnectorMetadata(failures_seen=self._failures_seen,
                                      async_loads=self._async_loads)
        self._failures_seen, self._async_loads = set(), []
        scheduled = scheduler_output.num_scheduled_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens or {}

        def step(st: RequestBlocks, rid: str, computed_before: int) -> None:
            if st.pending_load is not None:
                meta.loads.append(st.pending_load)
                st.pending_load = None
            restart(st, computed_before, self.block_size)
            if self.do_save:
                # Draft tokens' KV may be rejected: only tokens known to be right count.
                after = computed_before + scheduled.get(rid, 0) - len(spec.get(rid, ()))
                self._page_hashes(st)
                save = blocks_to_save(st, after, self.block_size)
                if save is not None:
                    meta.saves.append(save)
                    if self._events is not None:
                        record_saving(self._events, st.request, save.hashes,
                                      len(save.context), self.block_size)

        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            # Blocks vLLM had or loaded are not saved again.
            st.own_start = new.num_computed_tokens // self.block_size
            st.saved_blocks = max(st.saved_blocks, st.own_start)
            step(st, new.req_id, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
                if st.dirty_from is None:
                    st.own_start = cached.num_computed_tokens[i] // self.block_size
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            step(st, rid, cached.num_computed_tokens[i])
        self._guard.clock.built(scheduler_output.total_num_scheduled_tokens, not (
            meta.loads or meta.async_loads) and any(
            n - len(spec.get(r, ())) >= self.block_size for r, n in scheduled.items()))
        return meta

    def step_output(self) -> None:
        """The oldest step not yet ended came back (vLLM's scheduler, once per step's
        output after ``update_connector_output``: ``load_choice.StepClock``)."""
        self._guard.clock.output()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """vLLM events of raykv's tiers since the last call (none with events off)."""
        return [] if self._events is None else to_vllm(self._events.take(), self.block_size)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        landed = connector_output.kv_cache_events
        if self._events is not None and isinstance(landed, LandedReports):
            self._events.landed(landed.get_all_events())
        if connector_output.kv_connector_stats is not None:  # the workers' measured loads
            self._guard.rates.observe(growth_from_vllm(
                connector_output.kv_connector_stats.data))
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        # The workers refused every save computed over these blocks until now; from the
        # next step on, the requests holding them save nothing until vLLM has them
        # recompute what they computed over them (``restart``).
        self._failures_seen |= invalid
        for st in self._reqs.values():
            mark_failed(st, invalid)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        if self._lookups is not None:
            self._lookups.forget(request.request_id)
        # A request aborted while its async load runs keeps its blocks until a worker
        # reports the load finished: vLLM itself delays their free.
        return False, None

    def shutdown(self) -> None:
        """End the lookup thread, then ``ConnectorSide.shutdown``."""
        lookups, self._lookups = self._lookups, None
        if lookups is not None:
            lookups.close()
        super().shutdown()
