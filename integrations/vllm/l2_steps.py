"""The worker connector's steps through its node's L2 (``L2Steps``): loads (the step's
last chunk copied behind the forward, ``layer_loads``), saves per request or one batch
per step, and the end of a step's copies behind the forward.

The worker holds one ``L2Steps`` and sets what it learns as it attaches: ``l2`` (its
``L2Blocks``, once the node's L2 opened; None without L2) and ``behind`` (its
``LoadsBehind``, once vLLM registered host KV caches; None on a GPU). Counters go into
the worker's ``stats``, landed saves into its ``LandedBlocks``; blocks whose copy behind
the forward failed are handed back to the worker (``settle_behind``), which reports them
to vLLM. Nothing here calls the worker.

Threads: vLLM's worker thread calls every method (``wait_for_layer_load`` from inside
the forward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raykv.integrations.vllm.request_blocks import BlockTransfer

if TYPE_CHECKING:
    from raykv.cache_actors.throttled_log import ThrottledLog
    from raykv.integrations.vllm.connector_stats import ConnectorStats
    from raykv.integrations.vllm.kv_events import LandedBlocks
    from raykv.integrations.vllm.l2_blocks import L2Blocks, SaveBehind
    from raykv.integrations.vllm.layer_loads import LayerLoads, LoadsBehind


class L2Steps:
    """See the module docstring: counting into ``stats``, reporting landed saves to
    ``landed``, warning through ``warn``."""

    def __init__(self, stats: ConnectorStats, landed: LandedBlocks,
                 warn: ThrottledLog) -> None:
        self.l2: L2Blocks | None = None
        self.behind: LoadsBehind | None = None
        self._stats, self._landed, self._warn = stats, landed, warn
        self._saving: tuple[SaveBehind, list[str]] | None = None  # the last step's L2 save

    @property
    def usable(self) -> bool:
        """Whether the node's L2 is open and usable now."""
        return self.l2 is not None and self.l2.usable

    def load(self, x: BlockTransfer, behind: LayerLoads | None) -> int | None:
        """Load ``x``'s leading blocks through the node's L2 (``L2Blocks.load``: from
        L2, or from L3 into L2 first; its last chunk copied ``behind`` the forward when
        given); how many. None if an L2 op failed (the node actor restarted and its L2
        is new, or it is unreachable): warned about, and the caller loads through the
        staging pool."""
        try:
            done, later = self.l2.load(x.block_ids, x.hashes, behind)
        except Exception as e:
            self._warn.warn("l2 load", "RayKVConnector: L2 load failed (%s); loading "
                            "through the store", e)
            return None
        if later:
            self.behind.blocks = later
        self._stats.l2_loaded += done
        self._stats.loaded_behind += len(later)
        return done

    def layer_loads(self) -> LayerLoads | None:
        """The copy thread for this step's last L2 load (``LoadsBehind.copier``); None:
        every copy on the step (GPU caches, a forward not seen to ask for every layer
        yet)."""
        return None if self.behind is None else self.behind.copier()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once layer ``layer_name`` of the step's loads is in vLLM's KV cache
        (vLLM's forward calls this before each attention layer); the time waited is
        counted in ``layer_wait_us``."""
        if self.behind is not None:
            self._stats.layer_wait_us += int(self.behind.wait(layer_name) * 1e6)

    def settle_behind(self) -> list[int]:
        """End the step's copies behind the forward: wait for them, give their pages
        back to the node's L2; the blocks whose copy failed (counted as failed loads),
        for the worker to report to vLLM as load errors ([] if none)."""
        ended = None if self.behind is None else self.behind.settle()
        if ended is None:
            return []
        ok, blocks = ended
        if self.l2 is not None:
            self.l2.release()
        if ok:
            return []
        self._stats.loaded -= len(blocks)
        self._stats.l2_loaded -= len(blocks)
        self._stats.load_failed += len(blocks)
        return list(blocks)

    def save_batch(self, saves: list[BlockTransfer]) -> list[BlockTransfer]:
        """``async_transfers``: every block of ``saves`` saved into L2 pages in one
        batch behind the step (``L2Blocks.save_behind``: one reserve, the copy queued,
        the commit on a thread of its own; ``settle_saves`` ends it before the worker
        thread's next L2 op); the node actor puts them to L3 behind. A block L2 has no
        page for (held, leased or not yet flushed pages: the write-behind is behind) is
        dropped and counted in ``save_dropped``: a future miss, never a store call on the
        step. The saves to go through the store instead (the reserve failed, e.g. the
        node actor restarted, or the copy failed: its pages are freed first)."""
        ids = [b for x in saves for b in x.block_ids]
        if not ids:
            return []
        hashes = [h for x in saves for h in x.hashes]
        try:
            self._saving = (self.l2.save_behind(ids, hashes), hashes)
        except Exception as e:
            self._warn.warn("l2 save", "RayKVConnector: L2 save failed (%s); saving "
                            "through the store", e)
            return saves
        return []

    @property
    def saved_behind(self) -> bool:
        """Whether the L2 save behind the last step has ended (committed or failed)."""
        return self._saving is not None and self._saving[0].done

    def settle_saves(self) -> None:
        """End the L2 save behind the last step (``save_batch``): wait until its copy is
        done and its pages committed, then count it. Called before every L2 op of the
        worker thread (``start_load_kv``, ``wait_for_save``, ``shutdown``)."""
        if self._saving is None:
            return
        (behind, hashes), self._saving = self._saving, None
        try:
            saved, full = behind.wait()
        except Exception as e:
            self._stats.save_failed += len(hashes)
            self._warn.warn("l2 save", "RayKVConnector: L2 save of %d blocks failed (%s)",
                            len(hashes), e)
            return
        self._landed.l2_saved(hashes, saved, full)
        self._stats.saved += saved
        self._stats.l2_saved += saved
        self._stats.save_dropped += len(full)
        self._stats.save_failed += len(hashes) - saved - len(full)
        if full:
            self._warn.warn("l2 full", "RayKVConnector: the node's L2 had no page for %d "
                            "blocks (its write-behind is behind, or another engine was "
                            "still writing them); dropped", len(full))

    def save(self, x: BlockTransfer) -> BlockTransfer | None:
        """Save ``x`` into the node's L2 (the node puts it to L3 behind); the blocks L2
        had no page for, to save through the store (None: none). What the client
        raises propagates: the worker counts the blocks not saved."""
        saved, full = self.l2.save(x.block_ids, x.hashes)
        self._landed.l2_saved(x.hashes, saved, full)
        self._stats.saved += saved
        self._stats.l2_saved += saved
        self._stats.save_failed += len(x.block_ids) - saved - len(full)
        if not full:
            return None
        self._warn.warn("l2 full", "RayKVConnector: the node's L2 had no page for %d "
                        "blocks (or another engine was still writing them); saving them "
                        "through the store", len(full))
        return BlockTransfer(x.req_id, [x.block_ids[i] for i in full],
                             [x.hashes[i] for i in full], x.context)
