"""Request traces: Mooncake's JSONL (pure).

One JSON object a line: ``timestamp`` (ms from the start), ``input_length``,
``output_length`` (tokens), ``hash_ids`` (the prompt's blocks of ``BLOCK_TOKENS`` tokens,
prefix-chained: equal ids at equal positions are a reusable prefix; the last block may
be partial). Every field is checked before a request is made: a bad line is a
``ValueError`` naming the line, and nothing is returned.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

BLOCK_TOKENS = 512
"""Tokens per block of Mooncake's published traces."""


@dataclass(frozen=True)
class Request:
    """One request: arrival ``at`` (seconds from the trace's start), ``input_tokens``,
    ``output_tokens`` and its ``blocks`` (block hashes, prefix order)."""

    at: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]

    def hit_tokens(self, blocks: int) -> int:
        """Prompt tokens covered by its first ``blocks`` blocks."""
        return min(self.input_tokens, blocks * BLOCK_TOKENS)


def _int(obj: dict, name: str, where: str, low: int = 0) -> int:
    v = obj.get(name)
    if type(v) is not int or v < low:
        raise ValueError(f"{where}: {name} must be an integer >= {low}, got {v!r}")
    return v


def parse_request(line: str, where: str) -> Request:
    """One trace line as a ``Request``; ``ValueError`` naming ``where`` if it is not one:
    a JSON object, ``timestamp`` and ``output_length`` integers >= 0, ``input_length``
    >= 1, ``hash_ids`` a list of integers >= 0 with as many blocks as the input needs."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: not a JSON object")
    ts = _int(obj, "timestamp", where)
    n_in = _int(obj, "input_length", where, low=1)
    n_out = _int(obj, "output_length", where)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or any(type(h) is not int or h < 0 for h in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
    need = -(-n_in // BLOCK_TOKENS)
    if len(ids) != need:
        raise ValueError(f"{where}: {n_in} input tokens are {need} blocks of "
                         f"{BLOCK_TOKENS}, hash_ids has {len(ids)}")
    return Request(ts / 1000.0, n_in, n_out, tuple(ids))


def read_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """The requests of the JSONL file ``path`` (its first ``limit``), in arrival order
    (a stable sort by timestamp); ``ValueError`` for a bad line or an empty trace,
    ``OSError`` if the file cannot be read."""
    out: list[Request] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if line.strip():
                out.append(parse_request(line, f"{path}:{n}"))
    if not out:
        raise ValueError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.at)


def shifted_copies(requests: Sequence[Request], copies: int) -> list[Request]:
    """``copies`` copies of ``requests`` one after the other, each shifted by the
    trace's span and its blocks renamed (a copy shares no prefix with another), in
    arrival order: a trace ``copies`` times as long with the same shape."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    span = requests[-1].at - requests[0].at + 1.0
    top = 1 + max(h for r in requests for h in r.blocks)
    return [Request(r.at + c * span, r.input_tokens, r.output_tokens,
                    tuple(h + c * top for h in r.blocks))
            for c in range(copies) for r in requests]


class _Blocks(Protocol):
    @property
    def blocks(self) -> Sequence[int]: ...


R = TypeVar("R", bound=_Blocks)


def conversations(requests: Sequence[R], seed: int = 0) -> list[list[R]]:
    """``requests`` grouped into conversations by their second block (their first when
    they have one: every request of the conversation trace starts with the same block),
    the groups in a random order ``seed`` decides, each group's requests in the order
    given."""
    groups: dict[int, list[R]] = {}
    for r in requests:
        groups.setdefault(r.blocks[min(1, len(r.blocks) - 1)], []).append(r)
    order = sorted(groups)
    random.Random(seed).shuffle(order)
    return [groups[g] for g in order]
