"""A worker's side of its node's L2 cache (no vLLM import): vLLM blocks copied into and
out of pages of the L2 pool that every engine of the deployment on the node shares
(``cache_actors.node.l2_pools``).

A save reserves a page per block, copies the block of every layer into it and commits
it; the node actor puts it to L3 afterwards (write-behind), so no Mooncake call runs on
vLLM's step for a block that lands in L2. A load asks for the pages of its blocks (the
node reads from L3 into L2 first those L2 does not hold) and copies them into vLLM's
blocks. Pages are this process's from the node's answer until its next L2 op (a load
ends with an empty one, so an idle engine holds none; a load copied behind the forward
holds its last chunk until ``release``), so a copy never races another engine's
writes; a page whose commit did not reach the node is never read by anyone. A load
holds the L2 pool's memory (``HostPool.held``) as long as it holds pages to copy, so
the node never gives that memory back under its copies (standalone mode, after
``mooncake_client`` restarted: the pools are allocated anew).

When the node actor restarted (its L2 pools are new and empty), the first op finds the
pool unknown: the L2 is then *lost*, the worker uses its staging pool meanwhile, and a
background thread opens the new L2 pool (a control call, never on vLLM's step). An op
under way on another thread meanwhile copies through the pool that gave it its pages
until it ends, never the same page numbers of the new pool (other blocks, or another
writer's).

A save *behind* the step (``save_behind``: vLLM's ``async_transfers``) reserves the
pages on the worker thread, gathers the blocks on vLLM's own stream (so what vLLM
queues there later, the next forward or the zeroing of a block it gave to another
request, runs after they were read), copies the gathered pages into the page-locked L2
pages on a CUDA stream of the L2's own and returns (on a host KV cache the copy is done
at once); a thread of its own waits for the copy and commits the pages for the worker
thread. The worker thread waits for that (``SaveBehind.wait``) before its next L2 op,
which would release the pages while the copy may still write them.

Threads: ``load``, ``save``, ``save_behind`` and ``release`` run on vLLM's worker
thread (``load`` also on the async loads' thread, never with ``behind``);
``_copy_layer`` on ``LayerLoads``' copy thread; ``_reopen`` and each
``SaveBehind._finish`` on their own.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
from raykv.cache_actors.errors import UnknownPoolError
from raykv.cache_actors.rank.page_copies import copy_runs, copy_runs_behind
from raykv.cache_actors.rank.staging_pools import page_runs
from raykv.controllers.result_codes import FULL, PRESENT, WRITING

if TYPE_CHECKING:
    from raykv.cache_actors.host_pools import HostPool
    from raykv.cache_actors.rank.client import CacheClient
    from raykv.cache_actors.rank.l2_link import L2Link
    from raykv.controllers.pool_layout import PoolLayout
    from raykv.integrations.vllm.layer_loads import LayerLoads

log = logging.getLogger("vllm." + __name__)

CHUNK = 64
"""Blocks per L2 op: a load holds at most this many pages at once."""


class L2Blocks:
    """vLLM's ``layers`` (per layer a ``(num_blocks, *block)`` tensor) moved through the
    L2 pool ``pool``; ``views(pool)``: the pool's pages as tensors lining up with
    ``layers``. Made by ``open``."""

    def __init__(self, link: L2Link, pool: HostPool, layers: list[torch.Tensor],
                 views: Callable[[HostPool], list[torch.Tensor]], layout: PoolLayout,
                 pages: int) -> None:
        self._link, self.pool = link, pool
        self._layers, self._views = layers, views
        self._layout, self._pages = layout, pages
        self._reopening: threading.Thread | None = None
        self._held = threading.local()  # .pages: the hold of a load copied behind
        device = layers[0].device if layers else torch.device("cpu")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @classmethod
    def open(cls, client: CacheClient, layers: list[torch.Tensor],
             views: Callable[[HostPool], list[torch.Tensor]], layout: PoolLayout,
             pages: int) -> L2Blocks | None:
        """The L2 of ``client``'s rank on its node, of at most ``pages`` pages of
        ``layout``'s geometry; None if the node has no L2 room (a control call: raises
        what the client raises)."""
        link = client.l2()
        pool = link.open(layout, pages)
        if pool is None:
            return None
        map_ahead(pool)
        return cls(link, pool, layers, views, layout, pages)

    @property
    def usable(self) -> bool:
        """False while the L2 is lost (the node actor restarted) and not reopened."""
        return self.pool is not None

    def load(self, block_ids: Sequence[int], hashes: Sequence[str],
             behind: LayerLoads | None = None) -> tuple[int, list[int]]:
        """Copy the blocks ``hashes`` (from L2, or L3 through L2) into vLLM's
        ``block_ids``, ``CHUNK`` at a time, up to the first that has no page:
        ``(leading blocks loaded, those of them copied behind)``. With ``behind``, the
        last chunk's blocks but its last are copied layer by layer on ``behind``'s copy
        thread (``LayerLoads``) and their pages stay held: the caller calls ``release``
        after ``behind.finish()``; the last block, the one vLLM may write into in this
        step, is copied here. Every copy goes through the pool the pages came from,
        whatever another thread's loss or reopening of the L2 meanwhile, and that pool's
        memory is held (``HostPool.held``) from before the first op until the last copy
        ended (``release`` for copies behind): the node never gives it back under a
        copy (standalone: ``mooncake_client`` restarted). Raises what the client
        raises."""
        done = 0
        self._let_go()  # a caller that skipped ``release``: its copies ended
        hold = contextlib.ExitStack()
        with hold:
            pool = hold.enter_context(self._pool().held())
            while done < len(block_ids):
                n = min(CHUNK, len(block_ids) - done)
                pages = self._op(self._link.acquire, pool.name, hashes[done:done + n], True)
                ids = block_ids[done:done + len(pages)]
                done += len(pages)
                if behind is not None and len(pages) > 1 and (len(pages) < n
                                                              or done == len(block_ids)):
                    self._copy(pool, pages[-1:], ids[-1:], to_pool=False)
                    behind.start(partial(self._copy_layer, self._views(pool),
                                         page_runs(list(ids[:-1]), list(pages[:-1]))),
                                 len(self._layers))
                    self._held.pages = hold.pop_all()  # until ``release``
                    return done, list(ids[:-1])
                self._copy(pool, pages, ids, to_pool=False)
                if len(pages) < n:
                    break
            self._give_back()
        return done, []

    def release(self) -> None:
        """Give the pages this thread holds back to the cache (they stay held until
        its next op otherwise), then the hold of the pool's memory a load copied behind
        took (``load``); a failure is ignored (the node releases them at this
        thread's next op, or when the process is gone)."""
        self._give_back()
        self._let_go()

    def _give_back(self) -> None:
        if self.pool is not None:
            with contextlib.suppress(Exception):
                self._link.acquire(self.pool.name, [], False)

    def _let_go(self) -> None:
        """End this thread's hold of a load copied behind (``load``), if any."""
        hold = getattr(self._held, "pages", None)
        if hold is not None:
            self._held.pages = None
            hold.close()

    def save(self, block_ids: Sequence[int], hashes: Sequence[str]) -> tuple[int, list[int]]:
        """Copy vLLM's ``block_ids`` into L2 pages and commit them (the node puts them
        to L3 behind): ``(blocks now in L2, indices of the blocks L2 had no page for)``.
        The pool's memory is held throughout (as ``load``'s). A block another engine is
        still writing into L2 (``WRITING``) counts as one L2 had no page for: that write
        may yet fail, so it is not counted in L2 (nor published stored there). Raises
        what the client raises (blocks of earlier chunks stay saved)."""
        saved, full = 0, []
        with self._pool().held() as pool:
            for lo in range(0, len(block_ids), CHUNK):
                ids, hs = block_ids[lo:lo + CHUNK], list(hashes[lo:lo + CHUNK])
                pages = self._op(self._link.reserve, pool.name, hs)
                mine = [i for i, p in enumerate(pages) if p >= 0]
                saved += sum(p == PRESENT for p in pages)
                full += [lo + i for i, p in enumerate(pages) if p in (FULL, WRITING)]
                if not mine:
                    continue
                self._copy(pool, [pages[i] for i in mine], [ids[i] for i in mine],
                           to_pool=True)
                saved += self._op(self._link.commit, pool.name, [hs[i] for i in mine],
                                  [pages[i] for i in mine], [True] * len(mine))
        return saved, full

    def save_behind(self, block_ids: Sequence[int], hashes: Sequence[str]) -> SaveBehind:
        """Reserve L2 pages for vLLM's ``block_ids`` (one op for all of them), queue
        their copy into the pages (``page_copies.copy_runs_behind``) and return:
        ``SaveBehind.wait`` gives ``save``'s answer once the pages are committed. The
        calling thread makes no other L2 op before that ``wait``. The pool's memory is
        held until the commit returned (the copy may still write it until then). Raises
        what the client or the copy raises (a copy that failed is first waited for, its
        pages freed)."""
        hashes = list(hashes)
        hold = contextlib.ExitStack()
        with hold:
            pool = hold.enter_context(self._pool().held())
            return self._save_behind(pool, block_ids, hashes, hold)

    def _save_behind(self, pool: HostPool, block_ids: Sequence[int], hashes: list[str],
                     hold: contextlib.ExitStack) -> SaveBehind:
        """``save_behind`` through ``pool`` as ``hold`` holds it (handed over to the
        ``SaveBehind`` once the copy is queued)."""
        name = pool.name
        pages = self._op(self._link.reserve, name, hashes)
        mine = [i for i, p in enumerate(pages) if p >= 0]
        present = sum(p == PRESENT for p in pages)
        full = [i for i, p in enumerate(pages) if p in (FULL, WRITING)]
        keys, ours = [hashes[i] for i in mine], [pages[i] for i in mine]
        done = None
        if mine:
            runs = page_runs([block_ids[i] for i in mine], ours)
            try:
                if self._stream is None:
                    copy_runs(self._layers, self._views(pool), runs, to_pool=True)
                else:  # gathered on vLLM's stream, the pinned pages written behind
                    done = copy_runs_behind(self._layers, self._views(pool), runs,
                                            self._stream)
            except BaseException:  # nothing may still write the pages once they are free
                if self._stream is not None:
                    self._stream.synchronize()
                with contextlib.suppress(Exception):
                    self._op(self._link.commit, name, keys, ours, [False] * len(ours))
                raise
        return SaveBehind(self, name, keys, ours, present, full, done, hold.pop_all())

    def _op(self, op: Callable, *args, **kw):
        """``op(*args)``; an ``UnknownPoolError`` (the pool is no L2 pool of the node's:
        it restarted) loses the L2 and starts reopening it."""
        try:
            return op(*args, **kw)
        except UnknownPoolError:
            self._lose()
            raise

    def _pool(self) -> HostPool:
        """The L2 pool now, for one op: its pages are copied through this pool only
        (``_reopen`` may replace ``pool`` on another thread meanwhile);
        ``ValueError`` while the L2 is lost."""
        pool = self.pool
        if pool is None:
            raise ValueError("the node's L2 is lost (not reopened yet)")
        return pool

    def _copy(self, pool: HostPool, pages: Sequence[int], block_ids: Sequence[int], *,
              to_pool: bool) -> None:
        copy_runs(self._layers, self._views(pool), page_runs(list(block_ids), list(pages)),
                  to_pool=to_pool)

    def _copy_layer(self, staged: list[torch.Tensor], runs: list[tuple[int, int, int]],
                    layer: int) -> None:
        """Copy layer ``layer`` of the pages ``runs`` (``page_runs``) of ``staged`` (the
        pool's views) into vLLM's blocks (on ``LayerLoads``' copy thread)."""
        blocks, stage = self._layers[layer], staged[layer]
        for b0, p0, n in runs:
            blocks[b0:b0 + n].copy_(stage[p0:p0 + n])

    def _lose(self) -> None:
        self.pool = None
        if self._reopening is None or not self._reopening.is_alive():
            self._reopening = threading.Thread(target=self._reopen, name="raykv-l2-reopen",
                                               daemon=True)
            self._reopening.start()

    def _reopen(self) -> None:
        try:
            self.pool = self._link.open(self._layout, self._pages)
            if self.pool is not None:
                map_ahead(self.pool)
        except Exception as e:  # next loss tries again; the staging pool serves meanwhile
            log.warning("RayKVConnector: L2 not reopened (%s); saves and loads go through "
                        "the store", e)


class SaveBehind:
    """One ``L2Blocks.save_behind``: ``hashes`` reserved at ``pages`` of the L2 pool
    ``pool`` by the calling thread, their copy done once ``copied`` (a CUDA event;
    None: done already), committed by a thread of its own for the calling thread;
    ``present``, ``full``: as ``L2Blocks.save`` counts them; ``held``: the hold of the
    pool's memory, ended once the commit returned."""

    def __init__(self, l2: L2Blocks, pool: str, hashes: list[str], pages: list[int],
                 present: int, full: list[int], copied: torch.cuda.Event | None,
                 held: contextlib.ExitStack) -> None:
        self._l2, self._pool, self._held = l2, pool, held
        self._holder = l2._link.holder  # the reserving thread, read on that thread
        self._hashes, self._pages = hashes, pages
        self._present, self._full = present, full
        self._copied = copied
        self._saved = 0
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._finish, name="raykv-l2-save",
                                        daemon=True)
        self._thread.start()

    def _finish(self) -> None:
        """Wait for the copy, then commit the pages (written in full if the copy did
        not fail) for the thread that reserved them."""
        ok = True
        if self._copied is not None:
            try:
                self._copied.synchronize()
            except Exception:  # a failed copy: its pages are freed, never read
                ok = False
        try:
            if self._pages:
                self._saved = self._l2._op(self._l2._link.commit, self._pool,
                                           self._hashes, self._pages,
                                           [ok] * len(self._pages), holder=self._holder)
        except Exception as e:
            self._error = e
        finally:
            self._held.close()

    @property
    def done(self) -> bool:
        """Whether the commit returned (``wait`` then does not block)."""
        return not self._thread.is_alive()

    def wait(self) -> tuple[int, list[int]]:
        """``L2Blocks.save``'s answer once the pages are committed: ``(blocks now in L2,
        indices of the blocks L2 had no page for)``; raises what the commit raised. The
        copy ends with the device's work; the commit within the client's deadline."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._present + self._saved, self._full


def map_ahead(pool: HostPool) -> None:
    """Map every page of ``pool`` into this process on a thread of its own (one read per
    memory page), so that the first copy out of an L2 page does not take its page
    fault on vLLM's step: a fresh engine's first load of 32 MiB spends ~2 ms in page
    faults otherwise. The pool's pages are all allocated by the node actor already:
    this allocates nothing."""
    flat = pool.kv_buffer.reshape(-1).view(torch.uint8)
    threading.Thread(target=lambda: int(flat[::mmap.PAGESIZE].sum()),
                     name="raykv-l2-map-ahead", daemon=True).start()
