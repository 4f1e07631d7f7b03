"""The worker side of raykv's vLLM connector (one per TP rank, in vLLM's worker).

vLLM's KV cache is served through a staging pool of kind ``vllm`` on the rank's node
(page = one vLLM block of every layer, laid out as vLLM's CPU block layout, so a block
of one layer is one contiguous copy; ``staging_pools.StagedPool``): the client copies a
save's blocks into it and a load's blocks read in full out of it, and the node actor
moves pages between that pool and Mooncake with no copy. Loads
run before the forward (``start_load_kv``), saves of newly completed full blocks after
it (``wait_for_save``); both synchronous, on vLLM's worker thread, unless
``async_transfers``: then a step's saves are one batch into the node's L2 pages, saved
behind the step (``L2Blocks.save_behind``: on a GPU only the gather runs on the step;
the commit is a thread's; the node puts them to L3 behind; a block L2 has no page for
is dropped and counted), and
loads the scheduler side sends as ``async_loads`` run on the load thread
(``async_loads.AsyncLoads``), reported by ``get_finished``. Through the node's L2 into
a host KV cache, a step's last L2 chunk is copied layer by layer behind the forward on
the copy thread (``layer_loads.LayerLoads``): ``wait_for_layer_load`` waits for a
layer's copy, ``wait_for_save`` for all of them before it gives their pages back.
Every block that did
not load is reported by ``get_block_ids_with_load_errors`` (so
``kv_load_failure_policy="recompute"`` recomputes it); an unavailable node actor or
store never raises into vLLM and never counts as a loaded block.

Nothing computed over a block that did not load is stored: from its failed load until
the scheduler side tells the workers it has seen the failure (``failures_seen``: vLLM has
then rescheduled every request holding the block, from that block on), such a block is
*unsettled*, and a save whose blocks or ``context`` hold an unsettled block is refused,
whichever request's load failed (vLLM's prefix cache shares blocks between requests).
The scheduler side marks those blocks for a save again, once recomputed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

import torch
from raykv.cache_actors.rank.call_budget import Budget
from raykv.cache_actors.rank.staging_pools import (
    EngineMemory,
    StagedPool,
    dtype_of,
    staging_layout,
)
from raykv.controllers.contract import PoolName, PoolTransfer
from raykv.controllers.pool_layout import PoolLayout
from raykv.integrations.vllm.async_loads import CLOSE_WAIT_S, AsyncLoads
from raykv.integrations.vllm.kv_events import LandedBlocks
from raykv.integrations.vllm.kv_views import (
    block_slots,
    block_views,
    pool_block_views,
    pool_dims,
)
from raykv.integrations.vllm.l2_blocks import L2Blocks
from raykv.integrations.vllm.l2_steps import L2Steps
from raykv.integrations.vllm.layer_loads import LayerLoads, LoadsBehind
from raykv.integrations.vllm.metadata import LandedReports, RayKVConnectorMetadata
from raykv.integrations.vllm.options import ConnectorOptions
from raykv.integrations.vllm.request_blocks import BlockTransfer
from raykv.integrations.vllm.side import ConnectorSide

if TYPE_CHECKING:
    from raykv.cache_actors.host_pools import HostPool
    from raykv.cache_actors.rank.client import CacheClient
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("vllm." + __name__)  # shows up with vLLM's own log lines


class RayKVConnectorWorker(ConnectorSide):
    """The connector's worker-side methods (vLLM's contracts; the connector passes in
    the step's metadata). Attaches to raykv in ``register_kv_caches``, when the pool's
    geometry is known. Its steps through the node's L2 are ``_steps`` (``L2Steps``)."""

    ROLE = "worker"

    def __init__(self, opts: ConnectorOptions, kv_cache_config: KVCacheConfig | None, *,
                 block_size: int, tp_rank: int, tp_size: int, pp_rank: int,
                 pp_size: int) -> None:
        super().__init__(opts, block_size=block_size, tp_rank=tp_rank, tp_size=tp_size,
                         pp_rank=pp_rank, pp_size=pp_size)
        self._kv_cache_config = kv_cache_config
        self._layers: list[torch.Tensor] = []  # per layer: (num_blocks, *block) views
        self._memory: EngineMemory | None = None  # the same, as a raykv pool
        self._block_shape: tuple[int, ...] = ()
        self._block_bytes = 0  # of one block, every layer of this rank
        self._load_errors: set[int] = set()  # failed blocks not yet reported to vLLM
        self._unsettled: set[int] = set()  # failed blocks the scheduler has not seen yet
        # a step's loads and saves wait one timeout_s in all (made anew in start_load_kv)
        self._step_budget = Budget(opts.timeout_s)
        self._async: AsyncLoads | None = None  # the load thread (first async load)
        self._landed = LandedBlocks(opts.kv_events)  # saves that landed, for KV events
        # the node's L2 (opts.l2_blocks > 0) and loads behind the forward (host KV)
        self._steps = L2Steps(self.stats, self._landed, self._warn)

    def _attach(self) -> None:
        """``ConnectorSide._attach``, then the node's L2 if ``l2_blocks`` (none: refused)."""
        super()._attach()
        if self.opts.l2_blocks:
            try:
                self._steps.l2 = L2Blocks.open(self._client, self._layers, self._pages,
                                               staging_layout(self._memory.layout, 1),
                                               self.opts.l2_blocks)
            except Exception as e:  # the staging pool serves every block then
                self._warn.warn("l2", "RayKVConnector: no L2 on this node (%s)", e)
            if self._steps.l2 is None:
                log.warning("RayKVConnector tp %d: the node has no L2 room; blocks go "
                            "through the store", self.tp_rank)

    def _register(self, client: CacheClient, name: str) -> HostPool:
        """The staging pool (``pool_blocks`` pages of vLLM's block geometry), registered
        as vLLM's KV cache served through it: one window of ``pool_blocks`` blocks for
        loads and saves (both run on vLLM's worker thread)."""
        pool = client.create_host_pool(
            staging_layout(self._memory.layout, self.opts.pool_blocks), name=name,
            per_process=True)
        client.register_mem_host_pool_v2(StagedPool(
            self._memory, pool, self.opts.pool_blocks, shared=True, stage=self._pages),
            PoolName.KV)
        return pool

    def _pages(self, pool: HostPool) -> list[torch.Tensor]:
        return pool_block_views(pool.kv_buffer, self._block_shape)  # pool's pages

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = list(kv_caches.values())
        if not tensors:
            raise ValueError("RayKVConnector: vLLM registered no KV cache tensors")
        first = tensors[0]
        for name, t in kv_caches.items():
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(f"RayKVConnector: layer {name} has KV {tuple(t.shape)} "
                                 f"{t.dtype}, layer 0 {tuple(first.shape)} {first.dtype}; "
                                 "all layers must match")
        num_blocks = (self._kv_cache_config.num_blocks if self._kv_cache_config is not None
                      else first.shape[0])
        # Per layer a (num_blocks, *block) view, the block axis by vLLM's contract.
        self._layers = block_views(tensors, num_blocks, self.block_size)
        # Copies behind the forward on host KV caches only (a GPU's would need a
        # stream of their own and pinned pages: loads stay on the step there).
        self._steps.behind = (LoadsBehind(list(kv_caches)) if first.device.type == "cpu"
                              else None)
        self._block_shape = tuple(self._layers[0].shape[1:])
        self._block_bytes = self._layers[0][0].nbytes * len(self._layers)  # all layers
        if math.prod(self._block_shape) % self.block_size:
            raise ValueError(f"RayKVConnector: a block {self._block_shape} is not a multiple "
                             f"of block_size {self.block_size}")
        heads, dim = pool_dims(self._block_shape, self.block_size)
        dtype, itemsize = dtype_of(first)
        # vLLM's blocks as a raykv pool: page = block id, one view per layer.
        self._memory = EngineMemory(PoolLayout.vllm(
            page_size=self.block_size, size=num_blocks * self.block_size,
            layer_num=len(tensors), head_num=heads, head_dim=dim, dtype=dtype,
            itemsize=itemsize), self._layers)
        log.info("RayKVConnector tp %d: %d layers of %d blocks %s %s", self.tp_rank,
                 len(tensors), num_blocks, self._block_shape, first.dtype)
        self._attach_at_start()

    def _slots(self, block_ids: list[int]) -> torch.Tensor:
        """Host indices (token slots) of vLLM's blocks ``block_ids``."""
        return block_slots(block_ids, self.block_size)

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Settle the failures the scheduler side has seen (``meta.failures_seen``), then
        load the step's blocks (``meta.loads``) before the forward; the blocks that did
        not load (on any TP rank) go to ``get_block_ids_with_load_errors`` and stay
        unsettled until the scheduler side has seen them. vLLM calls this every step
        before ``wait_for_save`` (before the forward in a step with loads)."""
        self._steps.settle_saves()  # before any L2 op of this step
        self._failed(self._steps.settle_behind())  # wait_for_save not called last step
        if not isinstance(meta, RayKVConnectorMetadata):
            return
        self._step_budget = Budget(self.opts.timeout_s)  # this step's loads and saves
        self._unsettled -= meta.failures_seen
        for x in meta.async_loads:
            if self._async is None:
                self._async = AsyncLoads(
                    lambda y: self.loads.timed(partial(self._load_async, y), y.l2_blocks,
                                               self._block_bytes),
                    close_wait_s=self.opts.timeout_s + CLOSE_WAIT_S)
            self._async.submit(x)
        if not meta.loads:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        behind = self._steps.layer_loads()
        with self._step_budget:  # first failed block per request; the last behind
            firsts = [self.loads.timed(
                partial(self._load, x, behind if x is meta.loads[-1] else None),
                x.l2_blocks, self._block_bytes) for x in meta.loads]
        if self.tp_size > 1:
            firsts = agree_tp(firsts)
        for x, first in zip(meta.loads, firsts, strict=True):
            if first < len(x.block_ids):
                self._failed(x.block_ids[first:])
                self.stats.load_failed += len(x.block_ids) - first
            self.stats.loaded += first
        self.stats.load_us += int((time.perf_counter() - t0) * 1e6)
        self.stats.load_cpu_us += int((time.thread_time() - c0) * 1e6)

    def _load(self, x: BlockTransfer, behind: LayerLoads | None = None) -> int:
        """Load ``x``'s blocks into vLLM's KV cache (the client copies each block read in
        full out of the staging pool), ``pool_blocks`` at a time, up to the first chunk
        with a block that did not load; the index of that block (``len`` if all did).
        Through the node's L2 first (its last chunk may be copied ``behind`` the
        forward); the blocks after those L2 had a page for (none free to read them from
        L3 into: L2 under pressure) through the staging pool, counted in
        ``loaded_past_l2``. Never raises."""
        done, past_l2 = 0, None  # past_l2: where L2 stopped
        try:
            self._cache()
            if self._steps.usable:
                loaded = self._steps.load(x, behind)
                if loaded == len(x.block_ids):
                    return loaded
                if loaded is not None:
                    done = past_l2 = loaded
            n_pool = self.opts.pool_blocks
            while done < len(x.block_ids):
                n = min(n_pool, len(x.block_ids) - done)
                hashes = x.hashes[done:done + n]
                ok = self._client.batch_get_v2([PoolTransfer(
                    PoolName.KV, hashes, self._slots(x.block_ids[done:done + n]))])[PoolName.KV]
                good = ok.index(False) if False in ok else n
                done += good
                if good < n:
                    break
        except Exception as e:  # node actor restarting, store down, bad state: not loaded
            self._warn.warn("load", "RayKVConnector: load of %d blocks failed (%s); "
                            "vLLM recomputes them", len(x.block_ids) - done, e)
        if past_l2 is not None:
            self.stats.loaded_past_l2 += done - past_l2
        return done

    def _load_async(self, x: BlockTransfer) -> int:
        """On the load thread: ``x``'s leading blocks loaded through the node's L2 (L3
        into L2 into vLLM's blocks) within one ``timeout_s``; how many. 0 while the L2
        is lost (vLLM recomputes them). Raises what the client raises (the load thread
        fails the load)."""
        with Budget(self.opts.timeout_s):
            self._cache()
            if not self._steps.usable:
                return 0
            done, _ = self._steps.l2.load(x.block_ids, x.hashes)
        return done

    def wait_for_layer_load(self, layer_name: str) -> None:
        """``L2Steps.wait_for_layer_load``: vLLM's forward, before each attention layer."""
        self._steps.wait_for_layer_load(layer_name)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                               set[str] | None]:
        """``(None, requests whose async load ended since the last call)``; the blocks
        that did not load go to this step's ``get_block_ids_with_load_errors`` (vLLM
        calls it after this) and stay unsettled until the scheduler side has seen them.
        Nothing is ever sent: raykv's saves end within the step."""
        if self._async is None:
            return None, None
        done = self._async.finished()
        self._failed(done.failed_blocks)
        self.stats.loaded += done.loaded
        self.stats.async_loaded += done.loaded
        self.stats.load_failed += done.failed
        self.stats.load_dropped += done.dropped
        return None, done.req_ids or None

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """After the forward: end the step's copies behind it (``L2Steps.settle_behind``), then
        save the step's newly full blocks (``meta.saves``), except those computed over
        an unsettled block (``refuses``), whichever request's load failed: those are
        counted in ``save_refused`` and never stored. The time spent in steps that save
        is counted in ``save_us`` (wall) and ``save_cpu_us`` (this thread's CPU)."""
        self._steps.settle_saves()  # a step whose start_load_kv vLLM did not call
        self._failed(self._steps.settle_behind())
        if self._steps.behind is not None:
            self._steps.behind.waits.step_ended()
        if not isinstance(meta, RayKVConnectorMetadata) or not meta.saves:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        with self._step_budget:
            saves = []
            for x in meta.saves:
                if self.refuses(x):
                    self.stats.save_refused += len(x.block_ids)
                    continue
                saves.append(x)
            if self.opts.async_transfers and self._steps.usable:
                saves = self._steps.save_batch(saves)
            for x in saves:
                self._save(x)
        self.stats.save_us += int((time.perf_counter() - t0) * 1e6)
        self.stats.save_cpu_us += int((time.thread_time() - c0) * 1e6)

    def settle(self) -> None:
        self._steps.settle_saves()

    def refuses(self, x: BlockTransfer) -> bool:
        """Whether the save ``x`` was computed over a block whose load failed and that
        vLLM may not have recomputed yet (an unsettled block among its blocks or
        their context)."""
        return bool(self._unsettled) and x.computed_over(self._unsettled)

    def _save(self, x: BlockTransfer) -> None:
        done = 0
        try:
            self._cache()
            if self._steps.usable:
                try:
                    x = self._steps.save(x)
                except Exception as e:  # the store takes the whole save then
                    self._warn.warn("l2 save", "RayKVConnector: L2 save failed (%s); saving "
                                    "through the store", e)
                if x is None:
                    return
            while done < len(x.block_ids):  # the client copies the blocks into staging
                n = min(self.opts.pool_blocks, len(x.block_ids) - done)
                ok = self._client.batch_set_v2([PoolTransfer(
                    PoolName.KV, x.hashes[done:done + n],
                    self._slots(x.block_ids[done:done + n]))])[PoolName.KV]
                self._landed.l3_saved(x.hashes[done:done + n], ok)
                self.stats.saved += sum(ok)
                self.stats.save_failed += n - sum(ok)
                done += n
        except Exception as e:  # a lost save is a future miss, never an error for vLLM
            self.stats.save_failed += len(x.block_ids) - done
            self._warn.warn("save", "RayKVConnector: save of %d blocks failed (%s)",
                            len(x.block_ids) - done, e)

    def get_kv_connector_kv_cache_events(self) -> LandedReports | None:
        """This step's reports of saves that landed (None: none, or events off); an L2
        save behind a step is reported once committed (here if it already is, else
        with a later step's)."""
        if self._steps.saved_behind:
            self._steps.settle_saves()
        return LandedReports(reports) if (reports := self._landed.take()) else None

    def _failed(self, blocks: Iterable[int]) -> None:
        """``blocks`` did not load: reported to vLLM by this step's
        ``get_block_ids_with_load_errors``, unsettled until the scheduler side has seen
        them."""
        self._load_errors.update(blocks)
        self._unsettled.update(blocks)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """End the load thread (queued loads fail), then ``ConnectorSide.shutdown``."""
        loads, self._async = self._async, None
        if loads is not None:
            loads.close()
        self._steps.settle_saves()
        self._failed(self._steps.settle_behind())
        if self._steps.behind is not None:
            self._steps.behind.close()
        super().shutdown()


def agree_tp(firsts: list[int]) -> list[int]:
    """Every TP rank takes the smallest first-failed block of any rank, so all ranks
    report the same blocks and none saves KV computed over another rank's bad load."""
    from vllm.distributed.parallel_state import get_tp_group

    t = torch.tensor(firsts, dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN,
                                 group=get_tp_group().cpu_group)
    return t.tolist()

