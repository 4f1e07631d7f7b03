"""Copies between an engine's per-layer block views and a host pool's pages (torch only).

Both sides are lists of per-layer tensors whose first axis counts pages (engine blocks
on one side, pool pages on the other), copied in runs ``(engine page, pool page, n)``
(``staging_pools.page_runs``). On the host every layer is one copy per run. When the
engine's views live on a device and the pool's views are the layers of whole pages
laid side by side (``page_major``: a raykv vLLM pool, whose page holds every layer's
block, layer after layer), a per-layer copy would be a strided device <-> host copy,
which torch runs through a pageable bounce buffer and a CPU copy (measured on an H200:
2-6 GB/s against 35-45 GB/s for a contiguous pinned copy). ``copy_runs`` then gathers
(or scatters) the layers on the device in a buffer of whole pages of at most
``DEVICE_STAGE_BYTES`` and moves it with one contiguous copy per piece.
``copy_runs_behind`` does the same for a save without waiting for the device -> host
copies (vLLM's saves behind the step): vLLM's blocks are read on the caller's stream,
only the gathered pages travel behind it.

Threads: none of its own; the caller's thread copies (and waits for the device).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEVICE_STAGE_BYTES = 32 << 20
"""The most device memory one gathered piece of a run takes (whole pages; at least one)."""
BEHIND_BYTES = 128 << 20
"""The most device memory gathered pages copied behind the caller hold at once."""


def page_major(staged: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``(pages, bytes-worth per page)`` view of the memory under ``staged`` (per layer
    a ``(pages, ...)`` view) when the layers of each page lie side by side, layer after
    layer, each contiguous within its page; None otherwise."""
    first = staged[0]
    if first.dim() < 2 or not first[0].is_contiguous():
        return None
    per_layer = first[0].numel()
    stride = per_layer * len(staged)
    for i, t in enumerate(staged):
        if (t.shape != first.shape or t.dtype != first.dtype or t.device != first.device
                or t.stride(0) != stride or not t[0].is_contiguous()
                or t.data_ptr() != first.data_ptr() + i * per_layer * t.element_size()):
            return None
    return first.as_strided((first.shape[0], stride), (stride, 1))


def _engine_pages(engine: Sequence[torch.Tensor],
                  staged: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``page_major(staged)`` if its pages are whole pages of ``engine``'s blocks (same
    dtype, every layer's block once); None otherwise."""
    whole = page_major(staged)
    if whole is None or engine[0].dtype != whole.dtype \
            or engine[0][0].numel() * len(engine) != whole.shape[1]:
        return None
    return whole


def _pieces(runs: Sequence[tuple[int, int, int]], whole: torch.Tensor):
    """``(engine page, pool page, n)`` per piece of ``runs`` of at most
    ``DEVICE_STAGE_BYTES`` of ``whole``'s pages (at least one page)."""
    step = max(1, DEVICE_STAGE_BYTES // (whole.shape[1] * whole.element_size()))
    for e0, s0, n in runs:
        for i in range(0, n, step):
            yield e0 + i, s0 + i, min(step, n - i)


def copy_runs(engine: Sequence[torch.Tensor], staged: Sequence[torch.Tensor],
              runs: Sequence[tuple[int, int, int]], *, to_pool: bool,
              gather: bool | None = None) -> None:
    """Copy the runs ``(engine page, pool page, n)`` from ``engine`` into ``staged``
    (``to_pool``) or back, every layer. ``gather``: through whole pages gathered on
    the engine's device (default: when ``engine`` is not on the CPU and ``staged`` is
    ``page_major``); False: one copy per layer and run."""
    whole = None
    if gather or (gather is None and engine[0].device.type != "cpu"):
        whole = _engine_pages(engine, staged)
    if whole is None:
        for e0, s0, n in runs:
            for blocks, pages in zip(engine, staged, strict=True):
                if to_pool:
                    pages[s0:s0 + n].copy_(blocks[e0:e0 + n])
                else:
                    blocks[e0:e0 + n].copy_(pages[s0:s0 + n])
        return
    for e0, s0, n in _pieces(runs, whole):
        _gathered(engine, whole, e0, s0, n, to_pool)


def _gathered(engine: Sequence[torch.Tensor], whole: torch.Tensor, e0: int, s0: int, n: int,
              to_pool: bool) -> None:
    """Pages ``[s0, s0 + n)`` of ``whole`` <-> engine pages ``[e0, e0 + n)`` through one
    device buffer of ``n`` whole pages."""
    if to_pool:
        whole[s0:s0 + n].copy_(_gather(engine, e0, n))
        return
    buf = torch.empty((n, whole.shape[1]), dtype=whole.dtype, device=engine[0].device)
    buf.copy_(whole[s0:s0 + n])
    pages = buf.view(n, len(engine), *engine[0].shape[1:])
    for i, blocks in enumerate(engine):
        blocks[e0:e0 + n].copy_(pages[:, i])


def _gather(engine: Sequence[torch.Tensor], e0: int, n: int) -> torch.Tensor:
    """Engine pages ``[e0, e0 + n)`` of every layer as ``(n, bytes-worth per page)``
    whole pages in a new buffer on the engine's device, queued on the current stream
    (one kernel for every layer)."""
    buf = torch.empty((n, len(engine) * engine[0][0].numel()), dtype=engine[0].dtype,
                      device=engine[0].device)
    torch.stack([blocks[e0:e0 + n] for blocks in engine], dim=1,
                out=buf.view(n, len(engine), *engine[0].shape[1:]))
    return buf


def copy_runs_behind(engine: Sequence[torch.Tensor], staged: Sequence[torch.Tensor],
                     runs: Sequence[tuple[int, int, int]],
                     stream: torch.cuda.Stream) -> torch.cuda.Event:
    """Copy the runs ``(engine page, pool page, n)`` from a device ``engine`` into the
    page-locked ``page_major`` pages ``staged`` behind the caller: each piece of at
    most ``DEVICE_STAGE_BYTES`` is gathered on the current stream (so whatever the
    caller queues there later, which may write those blocks, runs after the gather has
    read them) and copied to the host on ``stream``; returns the event that ``stream``
    records after the last copy. At most ``BEHIND_BYTES`` of gathered pages are in
    flight: a larger save waits here for its earlier pieces' copies. ``ValueError`` if
    ``staged`` is not ``page_major`` or is not ``engine``'s geometry."""
    whole = _engine_pages(engine, staged)
    if whole is None:
        raise ValueError("a copy behind needs whole pages of the engine's blocks")
    current = torch.cuda.current_stream(engine[0].device)
    flying: list[tuple[torch.cuda.Event, int]] = []  # (copied, bytes) per piece
    done = torch.cuda.Event()
    for e0, s0, k in _pieces(runs, whole):
        nbytes = k * whole.shape[1] * whole.element_size()
        while flying and sum(b for _, b in flying) + nbytes > BEHIND_BYTES:
            flying.pop(0)[0].synchronize()
        buf = _gather(engine, e0, k)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            whole[s0:s0 + k].copy_(buf, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        buf.record_stream(stream)  # its memory is reused only after that copy
        flying.append((copied, nbytes))
    done.record(stream)
    return done
