"""The worker connector's steps through its node's L2 (``L2StepsMixin``): loads (the
step's last chunk copied behind the forward, ``layer_loads``), saves per request or one
batch per step, and the end of a step's copies behind the forward.

Threads: vLLM's worker thread calls every method (``wait_for_layer_load`` from inside
the forward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raykv.integrations.vllm.kv_views import randomize
from raykv.integrations.vllm.request_blocks import BlockTransfer

if TYPE_CHECKING:
    from raykv.integrations.vllm.layer_loads import LayerLoads


class L2StepsMixin:
    """The L2 half of ``worker.RayKVConnectorWorker`` (vLLM's worker side groups its
    model runner's connector steps in a mixin the same way). It uses the worker's
    ``_l2`` (``L2Blocks``, None without L2), ``_behind`` (``LoadsBehind``, None on a GPU
    KV cache), ``_layers``, ``opts``, ``stats``, ``_landed``, ``_warn``, ``_failed`` and
    ``_saving`` (the L2 save behind the last step with its page hashes, or None)."""

    def _load_l2(self, x: BlockTransfer, behind: LayerLoads | None) -> int | None:
        """Load ``x``'s leading blocks through the node's L2 (``L2Blocks.load``: from
        L2, or from L3 into L2 first; its last chunk copied ``behind`` the forward when
        given); how many. None if an L2 op failed (the node actor restarted and its L2
        is new, or it is unreachable): warned about, and the caller loads through the
        staging pool."""
        try:
            done, later = self._l2.load(x.block_ids, x.hashes, behind)
        except Exception as e:
            self._warn.warn("l2 load", "RayKVConnector: L2 load failed (%s); loading "
                            "through the store", e)
            return None
        if later:
            self._behind.blocks = later
        self.stats["l2_loaded"] += done
        self.stats["loaded_behind"] += len(later)
        if done and self.opts.debug_corrupt_loads:
            randomize(self._layers, x.block_ids[:done])
        return done

    def _layer_loads(self) -> LayerLoads | None:
        """The copy thread for this step's last L2 load (``LoadsBehind.copier``); None:
        every copy on the step (GPU caches, a forward not seen to ask for every layer
        yet, ``debug_corrupt_loads``)."""
        if self._behind is None or self.opts.debug_corrupt_loads:
            return None
        return self._behind.copier()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once layer ``layer_name`` of the step's loads is in vLLM's KV cache
        (vLLM's forward calls this before each attention layer); the time waited is
        counted in ``layer_wait_us``."""
        if self._behind is not None:
            self.stats["layer_wait_us"] += int(self._behind.wait(layer_name) * 1e6)

    def _settle_behind(self) -> None:
        """End the step's copies behind the forward: wait for them, give their pages
        back to the node's L2; blocks whose copy failed become load errors (reported
        to vLLM in this step's ``get_block_ids_with_load_errors``, unsettled until the
        scheduler side has seen them)."""
        ended = None if self._behind is None else self._behind.settle()
        if ended is None:
            return
        ok, blocks = ended
        if self._l2 is not None:
            self._l2.release()
        if not ok:
            self._failed(blocks)
            self.stats["loaded"] -= len(blocks)
            self.stats["l2_loaded"] -= len(blocks)
            self.stats["load_failed"] += len(blocks)

    def _save_batch(self, saves: list[BlockTransfer]) -> list[BlockTransfer]:
        """``async_transfers``: every block of ``saves`` saved into L2 pages in one
        batch behind the step (``L2Blocks.save_behind``: one reserve, the copy queued,
        the commit on a thread of its own; ``_settle_saves`` ends it before the worker
        thread's next L2 op); the node actor puts them to L3 behind. A block L2 has no page for
        (held, leased or not yet flushed pages: the write-behind is behind) is dropped
        and counted in ``save_dropped``: a future miss, never a store call on the step.
        The saves to go through the store instead (the reserve failed, e.g. the node
        actor restarted, or the copy failed: its pages are freed first)."""
        ids = [b for x in saves for b in x.block_ids]
        if not ids:
            return []
        hashes = [h for x in saves for h in x.hashes]
        try:
            self._saving = (self._l2.save_behind(ids, hashes), hashes)
        except Exception as e:
            self._warn.warn("l2 save", "RayKVConnector: L2 save failed (%s); saving "
                            "through the store", e)
            return saves
        return []

    def _settle_saves(self) -> None:
        """End the L2 save behind the last step (``_save_batch``): wait until its
        copy is done and its pages committed, then count it. Called before every L2 op
        of the worker thread (``start_load_kv``, ``wait_for_save``, ``shutdown``)."""
        if self._saving is None:
            return
        (behind, hashes), self._saving = self._saving, None
        try:
            saved, full = behind.wait()
        except Exception as e:
            self.stats["save_failed"] += len(hashes)
            self._warn.warn("l2 save", "RayKVConnector: L2 save of %d blocks failed (%s)",
                            len(hashes), e)
            return
        self._landed.l2_saved(hashes, saved, full)
        self.stats["saved"] += saved
        self.stats["l2_saved"] += saved
        self.stats["save_dropped"] += len(full)
        self.stats["save_failed"] += len(hashes) - saved - len(full)
        if full:
            self._warn.warn("l2 full", "RayKVConnector: the node's L2 had no page for %d "
                            "blocks (its write-behind is behind, or another engine was "
                            "still writing them); dropped", len(full))

    def _save_l2(self, x: BlockTransfer) -> BlockTransfer | None:
        """Save ``x`` into the node's L2 (the node puts it to L3 behind); the blocks L2
        had no page for, to save through the store (None: none). What the client
        raises propagates: ``_save`` counts the blocks not saved."""
        saved, full = self._l2.save(x.block_ids, x.hashes)
        self._landed.l2_saved(x.hashes, saved, full)
        self.stats["saved"] += saved
        self.stats["l2_saved"] += saved
        self.stats["save_failed"] += len(x.block_ids) - saved - len(full)
        if not full:
            return None
        self._warn.warn("l2 full", "RayKVConnector: the node's L2 had no page for %d "
                        "blocks (or another engine was still writing them); saving them "
                        "through the store", len(full))
        return BlockTransfer(x.req_id, [x.block_ids[i] for i in full],
                             [x.hashes[i] for i in full], x.context)
