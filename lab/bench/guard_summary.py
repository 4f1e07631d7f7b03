"""The arithmetic of the load guard's link benchmark (``guard_links``): its settings'
checks, its prompts, the guard's decision read from the connector's counters, and the
figures per link rate and prompt length. Pure: no Ray, vLLM or torch.

Times are in seconds, link rates as ``tc`` writes them (``100mbit``) or ``UNSHAPED``,
lengths and hits in tokens.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from raykv.integrations.vllm.connector_stats import ConnectorStats
from raykv.integrations.vllm.load_choice import DECISIONS, decision_key
from raykv_lab.host_plan import parse_rate

UNSHAPED = "unshaped"
"""A link rate of ``--links``: host 1's link without ``tc`` shaping."""
BLOCK = 128
"""Tokens per vLLM block (the engines' ``block_size``)."""
MAX_TOKENS = 4000
"""The longest prompt the engines take (their ``max_model_len`` leaves room for it)."""
VOCAB = 2048
"""Token ids of the benchmark's model (``vllm_model.VOCAB``); ids 0-2 are special."""
DEFAULT_LINKS = ("10mbit", "100mbit", "1gbit", "10gbit")
DEFAULT_LENGTHS = (256, 1024, 1920)
DEFAULT_SETTLE = 8
"""The benchmark's defaults (``raykv bench-guard-links`` repeats them in its options)."""
COUNTED = ("guard_", "l2_hit_tokens", "l3_hit_tokens")
"""The scheduler-side connector counters a timed request reports (``grown``)."""


def check_links(links: Sequence[str]) -> None:
    """``ValueError`` unless ``links`` is non-empty and each is a ``tc`` rate or
    ``UNSHAPED``, none twice (a rate's prompts are seeded by its name)."""
    if not links:
        raise ValueError("no link rate given")
    if len(set(links)) < len(links):
        raise ValueError(f"a link rate is given twice: {','.join(links)}")
    for link in links:
        if link != UNSHAPED:
            parse_rate(link)


def check_lengths(lengths: Sequence[int]) -> None:
    """``ValueError`` unless ``lengths`` is non-empty, none twice, and each prompt has a
    full block to load (more than ``BLOCK`` tokens: vLLM computes a prompt's last token
    itself) and at most ``MAX_TOKENS``."""
    if not lengths:
        raise ValueError("no prompt length given")
    if len(set(lengths)) < len(lengths):
        raise ValueError(f"a prompt length is given twice: {','.join(map(str, lengths))}")
    for n in lengths:
        if not BLOCK < n <= MAX_TOKENS:
            raise ValueError(f"prompt length {n}: expected {BLOCK + 1} to {MAX_TOKENS} "
                             f"tokens (a hit is whole {BLOCK}-token blocks)")


def store_blocks(links: int, lengths: Sequence[int], repeats: int, settle: int,
                 settle_tokens: int, warm_tokens: int) -> int:
    """Blocks the writer saves in one run: two prompts of each length per repeat and
    link, ``settle`` prompts of ``settle_tokens`` per link, and two warm-up prompts of
    ``warm_tokens``."""
    per_link = 2 * repeats * sum(n // BLOCK for n in lengths) + settle * (settle_tokens // BLOCK)
    return links * per_link + 2 * (warm_tokens // BLOCK)


def prompt_ids(tag: str, tokens: int) -> list[int]:
    """``tokens`` token ids (non-special, below ``VOCAB``) seeded by ``tag``: the same
    tag gives the same prompt in every process and run, different tags different
    prompts."""
    rnd = random.Random(f"raykv-guard-links/{tag}")
    return [rnd.randrange(3, VOCAB) for _ in range(tokens)]


def grown(before: ConnectorStats, after: ConnectorStats) -> dict[str, int]:
    """The ``COUNTED`` counters that grew from ``before`` to ``after``, by how much (by
    counter name, as the result's rows hold them)."""
    then = asdict(before)
    return {k: n - then[k] for k, n in asdict(after).items()
            if k.startswith(COUNTED) and n > then[k]}


def guard_decision(counters: Mapping[str, int]) -> tuple[str, str]:
    """``(decision, reason)`` of the guard for one request from its ``grown`` counters:
    ``load``, ``recompute`` or ``mixed`` (the leading part loaded) and why
    (``load_choice.DECISIONS``); ``("none", "")`` where it decided nothing (a miss, or
    a counter that never moved). Several decisions (a request looked up more than
    once) are joined with ``+``."""
    seen = [(d, r) for d, r in DECISIONS if counters.get(decision_key(d, r), 0) > 0]
    if not seen:
        return "none", ""
    return "+".join(dict.fromkeys(d for d, _ in seen)), "+".join(r for _, r in seen)


@dataclass(frozen=True)
class Served:
    """One timed request on a reader: ``wall_s`` (its engine's ``generate`` call, one
    output token), ``ttft_s`` (vLLM's ``first_token_latency``; None without vLLM's
    stats), ``cached`` (tokens raykv's connector loaded: vLLM's prefix cache is off),
    and the guard's ``decision`` and ``reason`` (``guard_decision``)."""

    wall_s: float
    ttft_s: float | None
    cached: int
    decision: str = "none"
    reason: str = ""


@dataclass(frozen=True)
class Repeat:
    """One repeat of one link rate and length: ``off`` (guard off, always loads),
    ``auto`` (the guard) and ``cold`` (a prompt nobody saved, computed), and the blocks
    the writer saved for the two prompts it computed (``saved_blocks``) of the
    ``expected_blocks`` they hold."""

    cold: Served
    off: Served
    auto: Served
    saved_blocks: int
    expected_blocks: int


def _median(values: Sequence[float | None]) -> float | None:
    """The median; None if any value is None or there is none."""
    if not values or any(v is None for v in values):
        return None
    return statistics.median(values)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summarise(link: str, tokens: int, repeats: Sequence[Repeat]) -> dict:
    """One row of figures for ``link`` and prompt length ``tokens`` over ``repeats``
    (at least one):

    - ``cold_s``, ``off_s``, ``auto_s``: median wall seconds; ``*_ttft_s``: median of
      vLLM's TTFT (None where vLLM gave none);
    - ``auto_over_cold``, ``auto_over_off``, ``auto_over_best`` (over the faster of
      cold and off): ratios of the medians;
    - ``hit_tokens``: the median tokens the guard-off reader loaded;
      ``loaded_fraction``: the auto reader's loaded tokens over the off reader's, summed
      over repeats (None when off loaded nothing);
    - ``load_beats_cold``: ``off_s < cold_s`` (None without a hit); ``guard_loaded``:
      the guard loaded most of the hit (``loaded_fraction > 0.5``);
      ``crossover_match``: the two agree (None where either is None): a guard that loads
      where cold wins, or recomputes where loading wins, is a mismatch;
    - per repeat: ``auto_decisions`` (``decision:reason``), the tokens each reader got
      from raykv (``*_cached``); ``saved_all``: the writer saved every block it computed
      in every repeat."""
    if not repeats:
        raise ValueError(f"{link}, {tokens} tokens: no repeat to summarise")
    cold_s = _median([r.cold.wall_s for r in repeats])
    off_s = _median([r.off.wall_s for r in repeats])
    auto_s = _median([r.auto.wall_s for r in repeats])
    off_cached = [r.off.cached for r in repeats]
    auto_cached = [r.auto.cached for r in repeats]
    loaded = sum(auto_cached) / sum(off_cached) if sum(off_cached) else None
    beats = None if loaded is None else off_s < cold_s
    guard_loaded = None if loaded is None else loaded > 0.5
    return {
        "link": link, "tokens": tokens, "repeats": len(repeats),
        "cold_s": cold_s, "off_s": off_s, "auto_s": auto_s,
        **{f"{k}_ttft_s": _median([getattr(r, k).ttft_s for r in repeats])
           for k in ("cold", "off", "auto")},
        "auto_over_cold": _ratio(auto_s, cold_s), "auto_over_off": _ratio(auto_s, off_s),
        "auto_over_best": _ratio(auto_s, min(cold_s, off_s)),
        "hit_tokens": statistics.median(off_cached), "loaded_fraction": loaded,
        "load_beats_cold": beats, "guard_loaded": guard_loaded,
        "crossover_match": None if beats is None else guard_loaded == beats,
        "auto_decisions": [f"{r.auto.decision}:{r.auto.reason}" for r in repeats],
        "off_cached": off_cached, "auto_cached": auto_cached,
        "cold_cached": [r.cold.cached for r in repeats],
        "saved_all": all(r.saved_blocks >= r.expected_blocks for r in repeats),
    }


TABLE_COLUMNS = ("link", "tokens", "hit", "cold ms", "off ms", "auto ms", "auto/cold",
                 "auto/off", "loaded", "load wins", "match")
"""The printed table's columns (``table_row``)."""


def _cell(value: object, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _yes(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def table_row(row: Mapping) -> list[str]:
    """The ``TABLE_COLUMNS`` cells of one ``summarise`` row (``-``: no figure)."""
    ms = [_cell(None if row[k] is None else 1e3 * row[k], "{:.0f}")
          for k in ("cold_s", "off_s", "auto_s")]
    return [row["link"], str(row["tokens"]), _cell(row["hit_tokens"], "{:.0f}"), *ms,
            _cell(row["auto_over_cold"], "{:.2f}x"), _cell(row["auto_over_off"], "{:.2f}x"),
            _cell(row["loaded_fraction"], "{:.2f}"), _yes(row["load_beats_cold"]),
            _yes(row["crossover_match"])]
