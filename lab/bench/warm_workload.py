"""The workload and the arithmetic of the warm-start benchmark (``warm_start``): a stretch
of a Mooncake trace served on one node, the next stretch on a node that joined, and the
share of the joined node's prefix tokens each tier served (pure: no Ray, no Mooncake).

A trace request (Mooncake's FAST'25 format: ``timestamp`` in ms, ``input_length``,
``hash_ids``) names its prompt's 512-token blocks by prefix-chained ids: equal ids are
equal prefixes. One block is one page of the benchmark's L2 pool, keyed by its id, so a
request is a chain of pages; a block holds 512 tokens but the last, which holds the rest
of the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512
"""Tokens of one trace block (Mooncake's traces)."""
TIERS = ("l2", "l3", "missed")


@dataclass(frozen=True)
class Request:
    """One trace request: arrival ``at_s`` (seconds from the trace's start), prompt
    ``tokens`` and its ``blocks`` (prefix-chained ids, in prompt order)."""

    at_s: float
    tokens: int
    blocks: tuple[int, ...]

    def block_tokens(self) -> list[int]:
        """Tokens of each block: 512, the last one what is left (at least 1)."""
        n = len(self.blocks)
        return [BLOCK_TOKENS if i < n - 1 else max(1, self.tokens - BLOCK_TOKENS * (n - 1))
                for i in range(n)]


def read_trace(path: str | Path) -> list[Request]:
    """The requests of a trace file (one JSON object a line), in arrival order.
    ``ValueError`` naming the line for a request without blocks or with fewer tokens than
    its blocks need."""
    requests = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        blocks = tuple(int(h) for h in r["hash_ids"])
        tokens = int(r["input_length"])
        if not blocks or tokens <= BLOCK_TOKENS * (len(blocks) - 1):
            raise ValueError(f"{path}:{n}: {tokens} tokens in {len(blocks)} blocks of "
                             f"{BLOCK_TOKENS}")
        requests.append(Request(r["timestamp"] / 1e3, tokens, blocks))
    return sorted(requests, key=lambda r: r.at_s)


def stretches(requests: Sequence[Request], before_s: float,
              after_s: float) -> tuple[list[Request], list[Request]]:
    """The requests arriving in ``[0, before_s)`` (served on the first node) and in
    ``[before_s, before_s + after_s)`` (the joined node's first ``after_s`` seconds).
    ``ValueError`` for a stretch that is not positive or holds no request."""
    if before_s <= 0 or after_s <= 0:
        raise ValueError(f"stretches must be positive, got {before_s} and {after_s}")
    first = [r for r in requests if r.at_s < before_s]
    then = [r for r in requests if before_s <= r.at_s < before_s + after_s]
    if not first or not then:
        raise ValueError(f"no request in [0, {before_s}) or [{before_s}, "
                         f"{before_s + after_s}) s of the trace")
    return first, then


def reachable(first: Iterable[Request], then: Sequence[Request]) -> dict:
    """What the best cache could give the joined node: per request of ``then``, its
    leading blocks ``first`` served (``earlier``: what a warm-up could bring), then those
    leading blocks an earlier request of ``then`` had (``own``: the node's own saves), the
    rest computed (``new``); in pages and tokens."""
    seen = {b for r in first for b in r.blocks}
    mine: set[int] = set()
    out = {k: {"pages": 0, "tokens": 0} for k in ("earlier", "own", "new")}
    for r in then:
        prefix = True
        for block, tokens in zip(r.blocks, r.block_tokens(), strict=True):
            prefix = prefix and (block in seen or block in mine)
            kind = "new" if not prefix else "earlier" if block in seen else "own"
            out[kind]["pages"] += 1
            out[kind]["tokens"] += tokens
        mine.update(r.blocks)
    return out


def best_warm(first: Iterable[Request], then: Sequence[Request], pages: int) -> dict:
    """What a warm-up of ``pages`` pages could give at best (knowing ``then``): the
    blocks of ``first`` that lead the most requests of ``then`` (a block leads at least
    as many as any block after it in a chain, so these are whole leading parts), as
    ``reachable``'s ``earlier``; its ``pages`` and ``tokens`` in ``then``'s requests,
    the node's own saves and evictions left out."""
    seen = {b for r in first for b in r.blocks}
    uses: dict[int, list[int]] = {}  # block -> [requests it leads, its place, its tokens]
    for r in then:
        for place, (block, tokens) in enumerate(zip(r.blocks, r.block_tokens(),
                                                    strict=True)):
            if block not in seen:
                break
            u = uses.setdefault(block, [0, place, 0])
            u[0] += 1
            u[2] += tokens
    chosen = sorted(uses.values(), key=lambda u: (-u[0], u[1]))[:max(0, pages)]
    return {"pages": sum(u[0] for u in chosen), "tokens": sum(u[2] for u in chosen)}


@dataclass(frozen=True)
class Served:
    """Where one request's blocks came from on its node: its first ``l2`` blocks from L2,
    the next ``l3`` from L3 (read into L2), the rest computed."""

    l2: int
    l3: int

    def tiers(self, blocks: int) -> list[str]:
        """Each of ``blocks`` blocks' tier (``TIERS``). ``ValueError`` if ``l2 + l3``
        is negative or over ``blocks``."""
        if self.l2 < 0 or self.l3 < 0 or self.l2 + self.l3 > blocks:
            raise ValueError(f"{self.l2} + {self.l3} served of {blocks} blocks")
        return ["l2"] * self.l2 + ["l3"] * self.l3 + ["missed"] * (blocks - self.l2 - self.l3)


def shares(requests: Sequence[Request], served: Sequence[Served]) -> dict:
    """Per tier (``TIERS``) the pages and tokens of ``requests`` it served (``served``:
    one per request) and its ``share`` of all tokens (0 for no token)."""
    if len(requests) != len(served):
        raise ValueError(f"{len(served)} outcomes for {len(requests)} requests")
    out = {t: {"pages": 0, "tokens": 0} for t in TIERS}
    for r, s in zip(requests, served, strict=True):
        for tier, tokens in zip(s.tiers(len(r.blocks)), r.block_tokens(), strict=True):
            out[tier]["pages"] += 1
            out[tier]["tokens"] += tokens
    total = sum(t["tokens"] for t in out.values())
    for t in out.values():
        t["share"] = t["tokens"] / total if total else 0.0
    return out


def by_slice(requests: Sequence[Request], served: Sequence[Served], start_s: float,
             slice_s: float) -> list[dict]:
    """``shares`` of the requests arriving in each ``slice_s`` seconds from ``start_s``
    (slices without a request left out), each with its ``from_s`` (trace seconds from
    ``start_s``) and ``requests``."""
    if slice_s <= 0:
        raise ValueError(f"slice_s must be positive, got {slice_s}")
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(int((r.at_s - start_s) // slice_s), []).append(i)
    return [{"from_s": k * slice_s, "requests": len(idx),
             **shares([requests[i] for i in idx], [served[i] for i in idx])}
            for k, idx in sorted(groups.items())]
