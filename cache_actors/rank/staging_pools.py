"""An engine's own memory served through a raykv pool (torch only: no Ray, no Mooncake,
no engine import).

An engine whose host memory raykv cannot map (SGLang's default allocator, a draft
model's pool, vLLM's KV cache, Mamba states) is served through a *staging* pool: a raykv
``HostPool`` of the same page geometry. A put copies the engine's pages into it and then
stores them; a get loads into it and then copies the pages read in full out to the
engine. ``StagedPool`` is that pairing; ``staged_call`` runs one batch call of several
pools (staged or not) in rounds when a staging pool is smaller than the call.

- ``describe_kv_buffer``: an engine's KV-like buffer (shape, dtype, contiguity, page
  size) as a ``PoolLayout`` and its pages as views (``EngineMemory``).
- ``page_runs``: the runs of pages consecutive on both sides of a copy, so a copy is one
  slice copy per run (no gather into a temporary).

Units: page indices count pages; slots count tokens (``page_size`` per page).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from raykv.cache_actors.host_pools import HostPool
from raykv.cache_actors.rank.page_copies import copy_runs
from raykv.cache_actors.rank.quarantine import Quarantine
from raykv.cache_actors.tickets import deferring
from raykv.controllers.contract import PoolName
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.transfer_plan import CheckedTransfers, PoolPages, TransferPlan


def page_views(buf: torch.Tensor, num_pages: int) -> torch.Tensor:
    """``buf`` (contiguous, pages outermost) as ``(num_pages, bytes per page)`` uint8;
    ``ValueError`` if it is not contiguous."""
    if not buf.is_contiguous():
        raise ValueError(f"buffer {tuple(buf.shape)} is not contiguous")
    return buf.view(-1).view(torch.uint8).view(num_pages, -1)


def dtype_of(t: torch.Tensor) -> tuple[str, int]:
    """``(dtype name, itemsize)`` of ``t`` as ``PoolLayout`` spells them."""
    return str(t.dtype).removeprefix("torch."), t.element_size()


@dataclass(frozen=True)
class EngineMemory:
    """An engine's pool in raykv terms: ``layout`` (same page count, page size and page
    objects as the engine's; for ``page_first`` KV the same bytes at the same offsets)
    and ``pages``, the engine's memory as ``(num_pages, ...)`` tensors whose row ``p``
    holds a part of page ``p``: by default one per buffer of ``layout`` in key order
    (that buffer's object of the page); they line up with a staging pool's views
    (``StagedPool``'s ``stage``: vLLM's are one per layer)."""

    layout: PoolLayout
    pages: list[torch.Tensor]

    @property
    def kind(self) -> str:
        return self.layout.kind


def describe_kv_buffer(buf: torch.Tensor, page_size: int,
                       order: str = "page_first") -> EngineMemory:
    """The engine KV buffer ``buf`` of ``page_size``-slot pages as an MHA or MLA pool.

    Shapes: MHA ``(2, size, layers, heads, dim)`` (``order`` ``page_first``) or ``(2,
    pages, layers, page, heads, dim)`` (SGLang's ``page_first_direct``); MLA ``(size,
    layers, 1, dim)`` (``page_first``) or ``(pages, layers, page, 1, dim)``
    (``page_first_direct``). ``ValueError`` for any other shape or a buffer that is not
    contiguous."""
    if buf.dim() == 5 and buf.shape[0] == 2 and order == "page_first":
        size, layers, heads, dim = buf.shape[1:]
        kind, parts = "mha", [buf[0], buf[1]]
    elif buf.dim() == 6 and buf.shape[0] == 2:  # page_first_direct
        n, layers, p, heads, dim = buf.shape[1:]
        size, kind, parts = n * p, "mha", [buf[0], buf[1]]
    elif buf.dim() == 4 and order == "page_first":
        size, layers, _, dim = buf.shape
        kind, parts = "mla", [buf]
    elif buf.dim() == 5 and order == "page_first_direct":
        n, layers, p, _, dim = buf.shape
        size, kind, parts = n * p, "mla", [buf]
    else:
        raise ValueError(f"kv_buffer {tuple(buf.shape)} with layout {order!r} is neither "
                         "MHA nor MLA")
    dtype, itemsize = dtype_of(buf)
    if kind == "mha":
        layout = PoolLayout.mha(page_size=page_size, size=int(size), layer_num=int(layers),
                                head_num=int(heads), head_dim=int(dim), dtype=dtype,
                                itemsize=itemsize)
    else:
        layout = PoolLayout.mla(page_size=page_size, size=int(size), layer_num=int(layers),
                                kv_cache_dim=int(dim), dtype=dtype, itemsize=itemsize)
    return EngineMemory(layout, [page_views(b, layout.num_pages) for b in parts])


def staging_layout(layout: PoolLayout, pages: int) -> PoolLayout:
    """``layout``'s page geometry for a pool of ``pages`` pages."""
    return dataclasses.replace(layout, size=pages * layout.page_size)


def page_runs(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(a0, b0, n)`` per maximal run where ``a`` and ``b`` both go up by one per item:
    ``page_runs([4, 5, 9], [0, 1, 2]) == [(4, 0, 2), (9, 2, 1)]``."""
    out: list[tuple[int, int, int]] = []
    for x, y in zip(a, b, strict=True):
        if out and x == out[-1][0] + out[-1][2] and y == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((x, y, 1))
    return out


def buffer_pages(pool: HostPool) -> list[torch.Tensor]:
    """``pool``'s buffers as ``(num_pages, bytes per page)`` views (``EngineMemory.pages``
    of a described engine buffer line up with them)."""
    return [page_views(b, pool.layout.num_pages) for b in pool.buffers]


class StagedPool:
    """Engine memory served through the raykv staging pool ``pool``.

    ``memory``: the engine's pool (its layout is the one calls' host indices refer to).
    ``window``: pages per direction and round; the staging pool then holds ``2 *
    window`` pages (puts use the first half, gets the second) unless ``shared``
    (one caller thread: both directions use the first ``window`` pages). ``window``
    None: the staging pool mirrors the engine's (same size, engine page ``p`` staged at
    page ``p``; one round; no lock, so concurrent calls never wait on each other).
    ``stage``: a staging pool's pages as tensors lining up with ``memory.pages`` (of the
    pool as a transfer holds it, read anew at every copy: a pool the node allocated
    anew is re-mapped, ``HostPool.remap``); default ``buffer_pages``.

    Threads: a windowed transfer holds its direction's lock (``lock``) for its whole
    run, copies and store calls; ``closed``, set under both locks by whoever destroys
    ``pool``, makes later transfers fail (its mapping is gone: a copy would fault).
    ``quarantine``: staging pages a call that failed at its deadline left to a store
    call still running (``rank.quarantine``); a transfer that needs them fails at once.
    """

    def __init__(self, memory: EngineMemory, pool: HostPool, window: int | None = None, *,
                 shared: bool = False,
                 stage: Callable[[HostPool], list[torch.Tensor]] = buffer_pages) -> None:
        self.memory = memory
        self.pool = pool
        self.window = window
        self._get_first = 0 if shared or window is None else window
        self._stage = stage
        put = threading.Lock()
        self._locks = (put, put if shared else threading.Lock())
        self.closed = False
        self.copied_bytes = 0
        self.quarantine = Quarantine()

    @property
    def layout(self) -> PoolLayout:
        """The engine's layout (what host indices of calls refer to)."""
        return self.memory.layout

    @property
    def kind(self) -> str:
        return self.memory.layout.kind

    @property
    def name(self) -> str:
        """The staging pool's name (what batches name)."""
        return self.pool.name

    def lock(self, write: bool) -> contextlib.AbstractContextManager:
        """The lock a put (``write``) or a get holds for its whole run."""
        if self.window is None:
            return contextlib.nullcontext()
        return self._locks[0 if write else 1]

    @contextlib.contextmanager
    def closing(self):
        """Both locks held (no transfer under way), then ``closed`` set: the caller may
        destroy ``pool`` inside."""
        with self._locks[0], self._locks[1]:
            self.closed = True
            yield

    def rounds(self, pages: int) -> int:
        """Rounds a transfer of ``pages`` pages needs."""
        return 1 if self.window is None else -(-pages // self.window)

    def chunk(self, r: int, pages: int) -> tuple[int, int]:
        """Pages ``[lo, hi)`` of a transfer of ``pages`` pages that go in round ``r``."""
        if self.window is None:
            return (0, pages) if r == 0 else (0, 0)
        return r * self.window, min(pages, (r + 1) * self.window)

    def staging_pages(self, engine_pages: Sequence[int], write: bool) -> list[int]:
        """Where the engine's ``engine_pages`` (one round's) are staged."""
        if self.window is None:
            return list(engine_pages)
        first = 0 if write else self._get_first
        return list(range(first, first + len(engine_pages)))

    def copy_in(self, engine_pages: Sequence[int], staging_pages: Sequence[int],
                pool: HostPool) -> None:
        """Copy the engine's pages to the staging pages of ``pool`` (before a put; the
        staging pool as the transfer holds it: ``HostPool.held``)."""
        self._copy(engine_pages, staging_pages, pool, to_stage=True)

    def copy_out(self, engine_pages: Sequence[int], staging_pages: Sequence[int],
                 pool: HostPool) -> None:
        """Copy the staging pages of ``pool`` to the engine's (after a get; as
        ``copy_in``)."""
        self._copy(engine_pages, staging_pages, pool, to_stage=False)

    def _copy(self, engine_pages: Sequence[int], staging_pages: Sequence[int],
              pool: HostPool, to_stage: bool) -> None:
        copy_runs(self.memory.pages, self._stage(pool),
                  page_runs(engine_pages, staging_pages), to_pool=to_stage)
        self.copied_bytes += len(engine_pages) * sum(
            p[0].numel() * p.element_size() for p in self.memory.pages)


def staged_call(checked: CheckedTransfers, staged: Mapping[PoolName, StagedPool], *,
                write: bool, epoch: int,
                call: Callable[[ObjectBatch], Sequence[int]]) -> dict[PoolName, list[bool]]:
    """Run the put (``write``) or get of ``checked`` through ``call`` (one data call:
    a batch in, one code per object out), one bool per page and pool as
    ``TransferPlan.stored`` / ``read`` give them.

    Pools of ``staged`` go through their staging pools, in rounds of at most their
    ``window`` pages (one ``call`` per round; the other pools go in the first): a put
    copies each round's pages in before its call, a get copies the pages read in full
    out after it. ``epoch``: that of the pool handles. ``ValueError`` if a staged pool
    was closed; ``QuarantinedPagesError`` (before any copy of that round) if a round's
    staging pages are quarantined. A round that names staging pages only does not wait
    for a late store call of its own when it fails: its staging pages are quarantined
    instead (``rank.quarantine``). What ``call`` raises propagates (pages of earlier
    rounds are then stored or copied out, but reported by none)."""
    results = dict(checked.fixed)
    direct = [p for p in checked.parts if p.role not in staged]
    moved = [(p, staged[p.role]) for p in checked.parts if p.role in staged]
    for part in checked.parts:
        results[part.role] = []
    if not moved:  # the engine's own memory only: one call, nothing to lock or copy
        _round(0, direct, (), write, epoch, call, results)
        return results
    with contextlib.ExitStack() as stack:
        for sp in sorted({id(sp): sp for _, sp in moved}.values(), key=id):
            stack.enter_context(sp.lock(write))
        closed = [p.role.value for p, sp in moved if sp.closed]
        if closed:  # its mapping here is gone: a copy would fault
            raise ValueError(f"raykv: staged pools {closed} were closed")
        held = {id(sp): stack.enter_context(sp.pool.held())
                for sp in {id(sp): sp for _, sp in moved}.values()}
        epochs = {p.handle.epoch for p in held.values()}
        if epochs != {epoch}:  # re-mapped in between: the oldest, which the node refuses
            epoch = min(epochs | {epoch})
        for r in range(max([sp.rounds(len(p.starts)) for p, sp in moved] + [1])):
            _round(r, direct if r == 0 else [], [(p, sp, held[id(sp)]) for p, sp in moved],
                   write, epoch, call, results)
    return results


def _round(r: int, direct: Iterable[PoolPages],
           moved: Sequence[tuple[PoolPages, StagedPool, HostPool]], write: bool, epoch: int,
           call: Callable[[ObjectBatch], Sequence[int]],
           results: dict[PoolName, list[bool]]) -> None:
    """Round ``r`` of ``staged_call`` (``moved``: each staged part, its pool and the
    staging pool as held): its pages appended to ``results``."""
    plan = TransferPlan()
    plan.batch.epoch = epoch
    direct = list(direct)
    for part in direct:
        plan.add(part, part.pool.pool_name, part.pool.layout, part.starts)
    rounds = []
    for part, sp, pool in moved:
        lo, hi = sp.chunk(r, len(part.starts))
        if lo >= hi:
            continue
        page = sp.layout.page_size
        engine_pages = [s // page for s in part.starts[lo:hi]]
        staging_pages = sp.staging_pages(engine_pages, write)
        sp.quarantine.check(staging_pages, sp.name)
        rounds.append((part, sp, pool, lo, hi, engine_pages, staging_pages))
    copies = []
    for part, sp, pool, lo, hi, engine_pages, staging_pages in rounds:
        if write:
            sp.copy_in(engine_pages, staging_pages, pool)
        page = sp.layout.page_size
        plan.add(part.pages(lo, hi), sp.name, pool.layout, [p * page for p in staging_pages])
        copies.append((part.role, sp, pool, engine_pages, staging_pages))
    if not plan.spans:
        return
    codes = _call(plan.batch, call, [] if direct else copies) if len(plan.batch) else []
    out = plan.stored(codes) if write else plan.read(codes)
    for role, sp, pool, engine_pages, staging_pages in copies:
        if not write:
            read = [i for i, ok in enumerate(out[role]) if ok]
            sp.copy_out([engine_pages[i] for i in read], [staging_pages[i] for i in read],
                        pool)
    for role, ok in out.items():
        results[role].extend(ok)


def _call(batch: ObjectBatch, call: Callable[[ObjectBatch], Sequence[int]],
          staged: Sequence[tuple[PoolName, StagedPool, HostPool, list[int], list[int]]]
          ) -> Sequence[int]:
    """``call(batch)``; with ``staged`` (the round names staging pages only: ``(role,
    pool, staging pool held, engine pages, staging pages)`` each), a failure whose store
    call runs on quarantines those staging pages instead of waiting for it
    (``tickets.deferring``): each staged pool of the round holds the same late tickets,
    and whichever settles one first frees it (``TicketBook.try_settle`` is idempotent
    per ticket)."""
    if not staged:
        return call(batch)
    with deferring() as late:
        try:
            return call(batch)
        except BaseException:
            for _, sp, _, _, staging_pages in staged:
                sp.quarantine.add(late, staging_pages)
            raise
