"""The example engine's load guard (pure: no Ray, no torch): its own estimates and the
runs of a hit it weighs with ``controllers.load_guard.choose_load``.

Estimates (``Rate``s, moving averages of what the engine measured itself):

- ``prefill``: seconds per prompt token of a prefill forward pass (its tokens padded to
  whole pages, as the ranks compute them; the pass's fixed cost folded in);
- ``l2``: seconds per byte of restoring pages from the host pools onto the devices
  (``start_prefill``; every loaded page pays it, an L3 page too);
- ``l3``: seconds per byte of fetching pages from Mooncake into the host pools.

Bytes are per TP rank (the ranks move their shards in parallel): a page's KV and draft
bytes, plus a Mamba checkpoint where one moves.

A hit's runs: the engine's L2 head (the leading pages its host pools hold), then the
rest of the group hit: the group answer's ``load_runs`` past the head where the node
gave estimates (each plus the L2 copy of its bytes), else one ``l3`` run from the
engine's own ``l3`` rate. A hybrid model restores a prefix only where a Mamba checkpoint
is held (the group query vouches for the one after the hit's last page), so its remote
runs are merged into one: the cut falls at the L2 head or at the whole hit.

Threads: the engine's driver thread calls everything (``Rate`` is thread-safe anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from raykv.controllers.load_guard import GuardSettings, LoadChoice, LoadRun, Rate, choose_load


def _sum(values: Sequence[float | None]) -> float | None:
    """The sum, None if any is unknown."""
    return None if any(v is None for v in values) else sum(values)


def remote_runs(load_runs: Sequence[tuple[str, int, float | None]], head: int,
                pages: int) -> list[LoadRun]:
    """The group answer's ``load_runs`` past the first ``head`` pages, cut to ``pages``
    pages (a run split by either end keeps its share of the seconds); empty when the
    runs do not cover them (no estimates: the caller falls back to its own)."""
    out, at = [], 0
    for tier, n, seconds in load_runs:
        lo, hi = max(at, head), min(at + n, head + pages)
        if hi > lo:
            out.append(LoadRun(tier, hi - lo, None if seconds is None
                               else seconds * (hi - lo) / n))
        at += n
    return out if sum(r.pages for r in out) == pages else []


@dataclass
class EngineGuard:
    """``settings`` (``GuardSettings``) and the engine's estimates (module docstring).
    The priors are None: the first loads and forward passes measure."""

    settings: GuardSettings = field(default_factory=GuardSettings)
    prefill: Rate = field(default_factory=Rate)
    l2: Rate = field(default_factory=Rate)
    l3: Rate = field(default_factory=Rate)

    def runs(self, head: int, hit: int, load_runs: Sequence[tuple[str, int, float | None]],
             page_bytes: int, hybrid: bool) -> list[LoadRun]:
        """The runs of a hit of ``hit`` pages whose first ``head`` are in the engine's
        host pools (``page_bytes``: bytes of a page per rank; ``load_runs``: the group
        answer's, maybe empty)."""
        out = [LoadRun("l2", head, self.l2.seconds(head * page_bytes))] if head else []
        tail = hit - head
        if tail <= 0:
            return out
        copy = self.l2.per_unit()
        remote = [LoadRun(r.tier, r.pages, _sum([r.seconds, None if copy is None
                                                 else copy * r.pages * page_bytes]))
                  for r in remote_runs(load_runs, head, tail)]
        if not remote:
            remote = [LoadRun("l3", tail, _sum([self.l3.seconds(tail * page_bytes),
                                                self.l2.seconds(tail * page_bytes)]))]
        if hybrid and len(remote) > 1:
            slowest = "l3_disk" if any(r.tier == "l3_disk" for r in remote) else "l3"
            remote = [LoadRun(slowest, tail, _sum([r.seconds for r in remote]))]
        return out + remote

    def choose(self, runs: Sequence[LoadRun], page_tokens: int) -> LoadChoice:
        """``choose_load`` of ``runs`` against the engine's prefill estimate."""
        return choose_load(runs, page_tokens, self.prefill.per_unit(), self.settings)
