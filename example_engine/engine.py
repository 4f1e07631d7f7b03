"""``Engine``: the driver of one TP group of ``EngineRank`` actors on one node.

Per request it does what an SGLang HiCache engine does, through raykv's public API:

1. chained page hashes of the prompt (at least one token is always computed, so at
   most ``(len - 1) // page_size`` pages can be restored);
2. L2: the leading pages its node's host pools hold (engine-side ``HostIndex``; for a
   hybrid model the prefix must end where a Mamba checkpoint is held);
3. L3: if L2 does not cover it, a *group* hit query (``CacheClient.group_exists``, both
   ranks ask their node's actor and get the same answer; KV, the Mamba checkpoint after
   the last page and the draft KV must all exist; the ranks registered when the engine
   started, so a miss costs one query over the local channel and one lookup);
4. the load guard (``load_estimates``): of the hit's runs (the L2 head, the L3 tail) it
   keeps only the leading ones estimated to arrive sooner than the engine computes their
   tokens (its own measured prefill seconds per token, and seconds per byte of its L2
   and L3 loads); the rest is recomputed, as a miss would be, so the logits are the
   same bit for bit;
5. a fetch of the kept L3 pages from Mooncake into the host pools (``batch_get_v2``; a
   failed read makes the hit fall back to L2);
6. host -> device copy of the hit pages, prefill of the rest in page-sized chunks,
   first token (TTFT stops here; ``stream`` hands it over before anything is saved);
7. offload of the newly computed full pages and Mamba checkpoints: device -> host pool
   -> L3 (``batch_set_v2``, put-if-absent), recorded in the L2 index: after the first
   token, off its path;
8. greedy decode, speculative when a draft model is loaded.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv import PoolTransferResult
from raykv.controllers.load_guard import GuardSettings, LoadChoice
from raykv.example_engine.host_index import HostIndex
from raykv.example_engine.load_estimates import EngineGuard
from raykv.example_engine.model import ModelConfig
from raykv.example_engine.page_hashes import page_hashes
from raykv.example_engine.rank import DRAFT, TARGET, EngineRank


@dataclass
class Generation:
    """What one request did. Pages are pages of ``page_size`` tokens; byte counts are
    summed over the TP ranks, per raykv pool (``kv``, ``mamba``, ``draft``).

    ``logits[i]`` ``(vocab,)`` are the target logits that chose ``tokens[i]``.
    ``l2_pages`` of the restored prefix came from the node's host pools, ``l3_pages``
    were fetched from Mooncake; ``state_tier`` says where the Mamba checkpoint came from
    (``"l2"``, ``"l3"`` or None when nothing was restored or the model has none).
    ``ttft_s`` = ``query_s`` (group hit query) + ``fetch_s`` (L3 -> host pools) + the
    prefill (host -> device copies, compute, first token) + bookkeeping.
    ``skipped_pages``: pages of the hit the load guard recomputed instead of loading,
    by the tier they were in (``l2``, ``l3``, ``l3_disk``); ``guard_reason``: why
    (``controllers.load_guard``'s reasons; empty when nothing was hit).
    """

    tokens: list[int]
    logits: list[torch.Tensor]
    ttft_s: float
    prompt_tokens: int
    prompt_pages: int
    hit_pages: int = 0
    l2_pages: int = 0
    l3_pages: int = 0
    state_tier: str | None = None
    fetched_bytes: dict[str, int] = field(default_factory=dict)
    query_s: float = 0.0
    fetch_s: float = 0.0
    offloaded_pages: dict[str, int] = field(default_factory=dict)
    offload_s: float = 0.0
    decode_s: float = 0.0
    proposed: int = 0
    accepted: int = 0
    page_size: int = 0
    skipped_pages: dict[str, int] = field(default_factory=dict)
    guard_reason: str = ""

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens prefilled (not restored)."""
        return self.prompt_tokens - self.hit_pages * self.page_size


@dataclass
class _Hit:
    pages: int = 0
    l2: int = 0
    l3: int = 0
    state_tier: str | None = None
    fetched: dict[str, int] = field(default_factory=dict)
    query_s: float = 0.0
    fetch_s: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)
    reason: str = ""


class Engine:
    """A TP group of ``tp_size`` ranks serving ``model`` (and ``draft``) on ``node_id``.

    ``host_pages`` / ``state_slots``: capacity of each rank's host KV pool (pages) and
    Mamba pool (checkpoints). ``checkpoint_interval``: a Mamba checkpoint is offloaded
    after every ``checkpoint_interval``-th page (a public attribute). ``spec_tokens``:
    draft tokens proposed per speculative step. ``load_guard``: ``auto``, ``off`` or a
    threshold in tokens (``GuardSettings.parse``); ``guard`` (public) holds the
    estimates it decides with.
    """

    def __init__(self, model: ModelConfig, node_id: str, *, draft: ModelConfig | None = None,
                 page_size: int = 64, max_tokens: int = 4352, host_pages: int = 256,
                 state_slots: int = 256, tp_size: int = 2, checkpoint_interval: int = 1,
                 spec_tokens: int = 3, name: str | None = None,
                 load_guard: str | int | None = "auto") -> None:
        if max_tokens % page_size:
            raise ValueError(f"max_tokens {max_tokens} is not a multiple of page_size")
        self.model, self.draft, self.page_size = model, draft, page_size
        self.max_tokens = max_tokens
        self.checkpoint_interval = checkpoint_interval
        self.spec_tokens = spec_tokens
        self.hybrid = model.ssm_layers > 0
        tag = name or f"eng-{uuid.uuid4().hex[:8]}"
        pin = NodeAffinitySchedulingStrategy(node_id, soft=False)
        self.ranks = [EngineRank.options(scheduling_strategy=pin).remote(
            model, draft, r, tp_size, page_size, max_tokens, host_pages, state_slots, tag)
            for r in range(tp_size)]
        self.node_id = node_id
        # every rank started (pools made, deployment registered): none left to a request
        self.page_bytes: dict[str, int] = ray.get([r.page_bytes.remote()
                                                   for r in self.ranks])[0]
        self.kv_index = HostIndex(host_pages)
        self.state_index = HostIndex(state_slots)
        self.guard = EngineGuard(GuardSettings.parse(load_guard))
        self._load_bytes = sum(b for p, b in self.page_bytes.items() if p != "mamba")

    # --------------------------------------------------------------- request
    def generate(self, tokens: list[int], max_new_tokens: int = 1, use_cache: bool = True,
                 speculate: bool = True) -> Generation:
        """Prefill ``tokens`` and greedily decode ``max_new_tokens`` (>= 1) tokens.

        ``use_cache=False`` recomputes the whole prompt and offloads nothing (the
        baseline without raykv). With a draft model, decoding is speculative unless
        ``speculate`` is False. The request as ``stream`` runs it, to its end.
        """
        *_, gen = self.stream(tokens, max_new_tokens, use_cache, speculate)
        return gen

    def stream(self, tokens: list[int], max_new_tokens: int = 1, use_cache: bool = True,
               speculate: bool = True) -> Iterator[Generation]:
        """``generate``, yielding the request's ``Generation`` twice: once its first
        token is chosen (``ttft_s`` set, nothing of this request saved yet: what a
        server streams at once), then with every token, after the offload of the
        prompt's new pages and the decode. The offload runs only once the caller asks
        for more: off the path to the first token. ``ValueError`` (at the first
        ``next``) if the request does not fit ``max_tokens``."""
        if not tokens or len(tokens) + max_new_tokens + self.spec_tokens > self.max_tokens:
            raise ValueError(f"{len(tokens)} prompt tokens + {max_new_tokens} new do not fit "
                             f"max_tokens={self.max_tokens}")
        t0 = time.perf_counter()
        keys = page_hashes(tokens, self.page_size)
        hit = self._restore(keys[:(len(tokens) - 1) // self.page_size]) if use_cache else _Hit()
        host = self.kv_index.slots(keys[:hit.pages])
        slot = self.state_index.slots([keys[hit.pages - 1]])[0] \
            if self.hybrid and hit.pages else None
        t = time.perf_counter()
        ray.get([r.start_prefill.remote(tokens, hit.pages, host, slot) for r in self.ranks])
        self.guard.l2.observe(hit.pages * self._load_bytes, time.perf_counter() - t)
        t = time.perf_counter()
        refs = [self._forward(m) for m in self._models()]
        logits = ray.get(refs)[0][-1]
        computed = len(tokens) - hit.pages * self.page_size
        self.guard.prefill.observe(-(-computed // self.page_size) * self.page_size,
                                   time.perf_counter() - t)
        gen = Generation([int(logits.argmax())], [logits], time.perf_counter() - t0,
                         len(tokens), len(keys), hit.pages, hit.l2, hit.l3, hit.state_tier,
                         hit.fetched, hit.query_s, hit.fetch_s, page_size=self.page_size,
                         skipped_pages=hit.skipped, guard_reason=hit.reason)
        yield gen
        if use_cache:
            t = time.perf_counter()
            gen.offloaded_pages = self._offload(keys, hit.pages)
            gen.offload_s = time.perf_counter() - t
        t = time.perf_counter()
        if self.draft is not None and speculate:
            self._speculate(tokens, gen, max_new_tokens)
        else:
            self._decode(tokens, gen, max_new_tokens)
        gen.decode_s = time.perf_counter() - t
        yield gen

    def _models(self) -> list[str]:
        return [TARGET] + ([DRAFT] if self.draft is not None else [])

    def _forward(self, model: str) -> ray.ObjectRef:
        """Submit one forward pass through every layer; the ref of rank 0's logits.
        Partial outputs go rank to rank as Ray object refs: nothing waits here."""
        parts: list[ray.ObjectRef] = []
        layers = (self.model if model == TARGET else self.draft).layers
        for layer in range(layers):
            parts = [r.layer.remote(model, layer, *parts) for r in self.ranks]
        return self.ranks[0].head.remote(model, *parts)

    # -------------------------------------------------------------- restore
    def _l2_prefix(self, keys: list[str]) -> int:
        n = self.kv_index.prefix(keys)
        while self.hybrid and n and keys[n - 1] not in self.state_index:
            n -= 1
        return n

    def _restore(self, keys: list[str]) -> _Hit:
        """Find the restorable prefix of ``keys`` (L2, then L3), let the load guard
        choose how much of it to load, and bring every page of that into the host
        pools."""
        l2 = self._l2_prefix(keys)
        total, load_runs, query_s = l2, [], 0.0
        if keys and l2 < len(keys):
            t = time.perf_counter()
            answers: list[PoolTransferResult] = ray.get([r.group_hit.remote(keys)
                                                         for r in self.ranks])
            query_s = time.perf_counter() - t
            if any(a != answers[0] for a in answers):
                raise RuntimeError(f"TP ranks got different group hits: {answers}")
            total, load_runs = max(l2, answers[0].kv_hit_pages), answers[0].load_runs
        choice = self.guard.choose(self.guard.runs(l2, total, load_runs, self._load_bytes,
                                                   self.hybrid), self.page_size)
        hit = _Hit(min(l2, choice.pages), min(l2, choice.pages), 0, None, {}, query_s,
                   0.0, _skipped(choice), choice.reason)
        hit.state_tier = "l2" if self.hybrid and hit.pages else None
        if choice.pages <= l2:
            return hit
        wanted = keys[:choice.pages]
        missing = [k for k in wanted if k not in self.kv_index]
        state_key = wanted[-1] if self.hybrid and wanted[-1] not in self.state_index else None
        slots = self.kv_index.allocate(len(missing), keep=wanted)
        state_slot = self.state_index.allocate(1, keep=[wanted[-1]])[0] \
            if state_key is not None else None
        t = time.perf_counter()
        got = ray.get([r.fetch.remote(missing, slots, state_key, state_slot)
                       for r in self.ranks])
        hit.fetch_s = time.perf_counter() - t
        if not all(all(ok) for answer in got for ok in answer.values()):
            self.kv_index.release(slots)
            if state_slot is not None:
                self.state_index.release([state_slot])
            return hit
        self.kv_index.insert(missing, slots)
        if state_key is not None:
            self.state_index.insert([state_key], [state_slot])
        state_bytes = self.page_bytes.get("mamba", 0) * (state_key is not None)
        self.guard.l3.observe(len(missing) * self._load_bytes + state_bytes, hit.fetch_s)
        fetched = {pool: len(self.ranks) * len(missing) * b
                   for pool, b in self.page_bytes.items() if pool != "mamba"}
        if self.hybrid:
            fetched["mamba"] = len(self.ranks) * state_bytes
        return _Hit(choice.pages, choice.pages - len(missing), len(missing),
                    ("l3" if state_key else "l2") if self.hybrid else None, fetched,
                    query_s, hit.fetch_s, hit.skipped, hit.reason)

    # -------------------------------------------------------------- offload
    def _offload(self, keys: list[str], hit: int) -> dict[str, int]:
        """Offload full pages ``hit..`` and their Mamba checkpoints; returns the pages
        L3 accepted per pool (stored or already present)."""
        new = keys[hit:]
        if not new:
            return {}
        copy = [k not in self.kv_index for k in new]
        fresh = self.kv_index.allocate(sum(copy), keep=keys)
        it = iter(fresh)
        host = [next(it) if c else self.kv_index.slots([k])[0] for k, c in zip(new, copy,
                                                                              strict=True)]
        state_pages = [p for p in range(hit, len(keys))
                       if self.hybrid and (p + 1) % self.checkpoint_interval == 0
                       and keys[p] not in self.state_index]
        state_slots = self.state_index.allocate(len(state_pages),
                                                keep=[keys[p] for p in state_pages])
        results = ray.get([r.offload.remote(hit, new, host, copy, state_pages, state_slots)
                           for r in self.ranks])
        self.kv_index.insert(new, host)
        self.state_index.insert([keys[p] for p in state_pages], state_slots)
        return {pool: min(sum(r[pool]) for r in results) for pool in results[0]}

    # --------------------------------------------------------------- decode
    def _step(self, model: str, tokens: list[int], start: int) -> torch.Tensor:
        ray.get([r.start_step.remote(model, tokens, start) for r in self.ranks])
        return ray.get(self._forward(model))

    def _decode(self, prompt: list[int], gen: Generation, max_new: int) -> None:
        while len(gen.tokens) < max_new:
            logits = self._step(TARGET, gen.tokens[-1:], len(prompt) + len(gen.tokens) - 1)[-1]
            gen.tokens.append(int(logits.argmax()))
            gen.logits.append(logits)

    def _speculate(self, prompt: list[int], gen: Generation, max_new: int) -> None:
        """Greedy speculative decoding: the draft proposes ``spec_tokens`` tokens, the
        target checks them in one multi-row step and keeps the agreeing ones plus its
        own next token, so the output equals the target's greedy decode up to
        rounding (a multi-row step rounds differently from single rows)."""
        seq = list(prompt) + gen.tokens
        draft_len = len(prompt)            # positions with valid draft KV
        while len(gen.tokens) < max_new:
            pending, proposals = seq[draft_len:], []
            for _ in range(self.spec_tokens):
                logits = self._step(DRAFT, pending, draft_len)
                draft_len += len(pending)
                pending = [int(logits[-1].argmax())]
                proposals.append(pending[0])
            base = len(seq)
            logits = self._step(TARGET, [seq[-1], *proposals], base - 1)
            k = 0
            while k < len(proposals) and int(logits[k].argmax()) == proposals[k]:
                k += 1
            if self.hybrid:
                ray.get([r.commit.remote(k + 1) for r in self.ranks])
            new = [int(logits[i].argmax()) for i in range(k + 1)]
            gen.tokens += new
            gen.logits += list(logits[:k + 1])
            gen.proposed += len(proposals)
            gen.accepted += k
            seq += new
            draft_len = base + min(k, len(proposals) - 1)
        del gen.tokens[max_new:], gen.logits[max_new:]


def _skipped(choice: LoadChoice) -> dict[str, int]:
    """Pages the guard chose not to load, by tier."""
    out: dict[str, int] = {}
    for run in choice.skipped:
        out[run.tier] = out.get(run.tier, 0) + run.pages
    return out
