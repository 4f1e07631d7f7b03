"""Seeded synthetic traces in Mooncake's format (pure): the two workloads the field
benchmarks prefix caching with, as ``Request`` lists whose blocks are prefix-chained
exactly as a real prompt's would be (equal leading tokens, equal leading blocks).

- ``multi_round_qa`` (LMCache's multi-round QA benchmark): users who each keep a
  conversation: a system prompt every user shares, a context of the user's own, then
  rounds of a question; each round's prompt is the previous one with its answer and the
  next question appended.
- ``shared_prefix`` (llm-d's shared-prefix workload): groups of prompts, each a prefix
  its group shares and a question of its own, the groups' prompts interleaved at random.

Arrivals are a Poisson process of ``rate`` requests per second. A prompt is spans of
content (a span: a content id and a token range); a block is named by the block before
it and the spans it covers, so two prompts share a block exactly when they share every
token up to its end.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

from raykv_lab.sim.trace import BLOCK_TOKENS, Request

Span = tuple[int, int, int]
"""``(content id, first token, end token)`` of one piece of a prompt."""


class _Blocks:
    """Block ids of prompts, equal for equal prefixes."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def of(self, spans: list[Span]) -> tuple[int, ...]:
        out: list[int] = []
        prev = -1
        for piece in _chunks(spans):
            key = (prev, piece)
            prev = self._ids.setdefault(key, len(self._ids))
            out.append(prev)
        return tuple(out)


def _chunks(spans: list[Span]) -> Iterator[tuple[Span, ...]]:
    """The spans of each ``BLOCK_TOKENS`` tokens of a prompt, in order."""
    piece: list[Span] = []
    room = BLOCK_TOKENS
    for cid, start, end in spans:
        while start < end:
            take = min(room, end - start)
            piece.append((cid, start, start + take))
            start, room = start + take, room - take
            if not room:
                yield tuple(piece)
                piece, room = [], BLOCK_TOKENS
    if piece:
        yield tuple(piece)


def _check(**counts: float) -> None:
    for name, v in counts.items():
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")


def _arrivals(rng: random.Random, rate: float) -> Iterator[float]:
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


def multi_round_qa(users: int, rounds: int, *, system_tokens: int = 1000,
                   context_tokens: int = 20000, question_tokens: int = 100,
                   answer_tokens: int = 200, rate: float = 1.0,
                   seed: int = 0) -> list[Request]:
    """``users`` x ``rounds`` requests, round by round, the users in a seeded order each
    round (see the module docstring); ``answer_tokens`` is each request's output."""
    _check(users=users, rounds=rounds, system_tokens=system_tokens,
           context_tokens=context_tokens, question_tokens=question_tokens,
           answer_tokens=answer_tokens, rate=rate)
    rng = random.Random(seed)
    blocks, when = _Blocks(), _arrivals(rng, rate)
    ids = itertools.count(1)
    prompts = [[(0, 0, system_tokens), (next(ids), 0, context_tokens)] for _ in range(users)]
    out = []
    for r in range(rounds):
        order = list(range(users))
        rng.shuffle(order)
        for u in order:
            if r:
                prompts[u].append((next(ids), 0, answer_tokens))
            prompts[u].append((next(ids), 0, question_tokens))
            n = sum(end - start for _, start, end in prompts[u])
            out.append(Request(next(when), n, answer_tokens, blocks.of(prompts[u])))
    return out


def shared_prefix(groups: int, prompts_per_group: int, *, prefix_tokens: int = 2048,
                  question_tokens: int = 256, output_tokens: int = 256, rate: float = 1.0,
                  seed: int = 0) -> list[Request]:
    """``groups`` x ``prompts_per_group`` requests in a seeded random order (see the
    module docstring)."""
    _check(groups=groups, prompts_per_group=prompts_per_group, prefix_tokens=prefix_tokens,
           question_tokens=question_tokens, output_tokens=output_tokens, rate=rate)
    rng = random.Random(seed)
    order = [g for g in range(groups) for _ in range(prompts_per_group)]
    rng.shuffle(order)
    blocks, when = _Blocks(), _arrivals(rng, rate)
    out = []
    for i, g in enumerate(order):
        spans = [(g, 0, prefix_tokens), (groups + i, 0, question_tokens)]
        out.append(Request(next(when), prefix_tokens + question_tokens, output_tokens,
                           blocks.of(spans)))
    return out


def to_jsonl(requests: list[Request]) -> str:
    """``requests`` as Mooncake's JSONL (timestamps in whole ms)."""
    import json

    return "".join(json.dumps({"timestamp": round(r.at * 1000), "input_length":
                               r.input_tokens, "output_length": r.output_tokens,
                               "hash_ids": list(r.blocks)}) + "\n" for r in requests)
