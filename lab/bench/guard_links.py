"""The load guard against link speed, with real vLLM on emulated hosts: TTFT of a hit
loaded always (guard ``off``), loaded where the guard says so (``auto``), and computed
cold, per link rate and prompt length.

``run_guard_links_bench`` starts one cluster of two emulated hosts
(``start_hosts(2)``, root only; host 1's link starts at ``START_LINK``): host 0
contributes no store memory, host 1 holds the whole segment, sized to every block W
saves in the run and a quarter more (``guard_summary.store_blocks``; at least 512 MiB),
so nothing is evicted. Three vLLM engines (CPU build, in-process in Ray actors, eager,
one OMP thread with ``VLLM_CPU_OMP_THREADS_BIND=nobind``: ``vllm_actors.ENV``; an
8-layer width-512 random Llama, ``MODEL``; ``BLOCK``-token blocks; vLLM's prefix cache
off, so every cached token came through raykv), one deployment:

- **W** on host 1 computes prompts; its connector saves their blocks to L3 on host 1's
  segment on the step (no L2), so its ``generate`` returns once they are stored (its
  worker's ``saved`` counter is recorded to show it);
- **R_off** on host 0, connector ``load_guard: "off"``: loads every hit;
- **R_auto** on host 0, ``load_guard: "auto"``: loads a hit only where the guard
  estimates it arrives sooner than computing it.

Both readers are ``kv_consumer``: they load and never save, so no reader pays a save
across the link and a cold run is the engine's prefill alone.

Warm-up, with the link at ``START_LINK``: each reader computes ``WARM_COLD`` prompts
under a cache salt nobody saved (R_auto's guard then has a prefill estimate), and
loads one prompt W computed (the node's estimate of host 1's link has a measurement).
Then, for each rate of ``links`` (``guard_summary.UNSHAPED``: no shaping), host 1's link
is shaped (``EmulatedHosts.set_rate``) and R_off loads ``settle`` fresh prompts of
``SETTLE_TOKENS`` W computed, not timed: the guard's L3 estimate is the host 0 node's
moving average of its gets (each get moves it a fifth of the way), which R_off's loads
move to the new rate. Then for each prompt length and repeat, three fresh prompts of
that length (seeded by rate, length and repeat): W computes p1 and p2; R_off serves p1
(a load), R_auto serves p2 (the guard decides), R_off serves p3 under a cache salt
nobody saved (cold: computed whole), in that order, one output token each. A request's
time is the wall time of the engine's ``generate`` in its actor (the same for all
three), also vLLM's TTFT; R_auto's guard decision comes from its scheduler-side
connector counters around the request. Figures per rate and length: medians, ratios,
the fraction of the hit the guard loaded and whether its choice matched the faster of
load and cold (``guard_summary.summarise``). Writes ``bench_guard_links.json`` into
``out_dir``. Numbers only: nothing asserts a speed.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import ray
from raykv.controllers.pool_layout import MiB
from raykv.integrations.vllm.connector_stats import ConnectorStats
from raykv_lab.bench.guard_summary import (
    BLOCK,
    DEFAULT_LENGTHS,
    DEFAULT_LINKS,
    DEFAULT_SETTLE,
    MAX_TOKENS,
    TABLE_COLUMNS,
    UNSHAPED,
    Repeat,
    Served,
    check_lengths,
    check_links,
    grown,
    guard_decision,
    prompt_ids,
    store_blocks,
    summarise,
    table_row,
)
from raykv_lab.bench.toolkit import right_table
from raykv_lab.engines.vllm_actors import VLLMEngine, ready, start_engine
from raykv_lab.engines.vllm_model import LlamaDims, make_llama
from rich.console import Console

START_LINK = "10gbit"
SETTLE_TOKENS = 1024
WARM_COLD = 3
MODEL = LlamaDims.of(512, 8)
"""8 KiB of bf16 KV per token, 1 MiB per block: loads long enough to meet the link."""
ENGINE = dict(block_size=BLOCK, max_model_len=MAX_TOKENS + 96)
CONNECTOR = {"model_name": "bench-guard-links", "timeout_s": 120.0}
"""The readers' and writer's connector settings: a deadline that a 10 Mbit/s load of
the longest prompt fits in."""


@ray.remote(num_cpus=0)
class GuardEngine(VLLMEngine):
    """``VLLMEngine`` (in-process: its scheduler runs in the actor) plus ``timed``."""

    def timed(self, prompt: list[int], cache_salt: str | None = None) -> dict:
        """``generate(prompt, 1, cache_salt)``'s answer plus ``wall_s`` (seconds of that
        call, ``time.perf_counter``) and ``grown``: the scheduler-side connector
        counters that grew during it (``guard_summary.grown``)."""
        before = self._counters()
        t0 = time.perf_counter()
        got = self.generate(prompt, 1, cache_salt)
        got["wall_s"] = time.perf_counter() - t0
        got["grown"] = grown(before, self._counters())
        return got

    def _counters(self) -> ConnectorStats:
        return replace(self.llm.llm_engine.engine_core.engine_core.scheduler.connector.stats)


def _served(got: dict) -> Served:
    decision, reason = guard_decision(got["grown"])
    return Served(got["wall_s"], got["ttft_s"], got["cached"], decision, reason)


def _saved(w) -> int:
    """Blocks W's worker connector has saved so far."""
    (stats,) = ray.get(w.worker_stats.remote())
    return stats.counters.saved


def _write(w, prompts: Sequence[list[int]]) -> int:
    """W computes ``prompts`` (its connector saves them); the blocks it saved."""
    before = _saved(w)
    for p in prompts:
        ray.get(w.generate.remote(p, 1))
    return _saved(w) - before


def warm_up(w, r_off, r_auto, tokens: int) -> None:
    """The readers' prefill estimates and the node's first loads (module docstring)."""
    for i in range(WARM_COLD):
        for name, r in (("off", r_off), ("auto", r_auto)):
            ray.get(r.timed.remote(prompt_ids(f"warm-cold-{name}-{i}", tokens),
                                   f"warm-cold-{name}-{i}"))
    loads = [prompt_ids(f"warm-load-{name}", tokens) for name in ("off", "auto")]
    _write(w, loads)
    for r, p in zip((r_off, r_auto), loads, strict=True):
        ray.get(r.timed.remote(p))


def settle_link(w, r_off, link: str, count: int) -> None:
    """R_off loads ``count`` fresh prompts W computed, untimed (module docstring)."""
    for i in range(count):
        p = prompt_ids(f"settle-{link}-{i}", SETTLE_TOKENS)
        _write(w, [p])
        ray.get(r_off.timed.remote(p))


def measure(w, r_off, r_auto, link: str, tokens: int, repeat: int) -> Repeat:
    """One repeat of ``link`` and ``tokens`` (module docstring)."""
    tag = f"{link}-{tokens}-{repeat}"
    p1, p2, p3 = (prompt_ids(f"{tag}-{k}", tokens) for k in ("off", "auto", "cold"))
    saved = _write(w, [p1, p2])
    off = ray.get(r_off.timed.remote(p1))
    auto = ray.get(r_auto.timed.remote(p2))
    cold = ray.get(r_off.timed.remote(p3, f"cold-{tag}"))
    return Repeat(_served(cold), _served(off), _served(auto), saved, 2 * (tokens // BLOCK))


def _reshape(cluster, link: str, shaped: bool) -> bool:
    """Host 1's link at ``link``; whether it is shaped now."""
    if link != UNSHAPED:
        cluster.ray_nodes.set_rate(1, link)
    elif shaped:
        cluster.ray_nodes.set_rate(1, None)
    return link != UNSHAPED


def run_guard_links_bench(links: Sequence[str] = DEFAULT_LINKS,
                          lengths: Sequence[int] = DEFAULT_LENGTHS, repeats: int = 3,
                          settle: int = DEFAULT_SETTLE, out_dir: str | None = None,
                          console: Console | None = None) -> dict:
    """Run the benchmark (see the module docstring); print a table, write
    ``bench_guard_links.json`` into ``out_dir`` (default ``raykv-out/``), return the
    figures. Starts and stops its own emulated hosts: root only (``PermissionError``
    before anything starts), Ray not initialised, vLLM installed. ``ValueError`` for a
    bad rate, length, ``repeats`` < 1 or ``settle`` < 0."""
    from raykv_lab.hosts import check_root, start_hosts

    check_links(links)
    check_lengths(lengths)
    if repeats < 1 or settle < 0:
        raise ValueError(f"repeats {repeats} (at least 1), settle {settle} (at least 0)")
    check_root()
    console = console or Console()
    blocks = store_blocks(len(links), lengths, repeats, settle, SETTLE_TOKENS, max(lengths))
    segment = max(512 * MiB, blocks * BLOCK * MODEL.kv_bytes_per_token * 5 // 4)
    runs: list[dict] = []
    rows: list[dict] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_llama(os.path.join(tmp, "llama"), MODEL)
        with console.status("starting 2 emulated hosts, mooncake_master and the cache actors"):
            cluster = start_hosts(2, link=START_LINK, segment_sizes=[0, segment],
                                  log_to_driver=False)
        with cluster:
            host0, host1 = sorted(cluster.node_ids, key=cluster.ray_nodes.host_of)
            engines = []
            try:
                w = start_engine(host1, model, CONNECTOR, **ENGINE)
                engines.append(w)
                r_off, r_auto = (
                    start_engine(host0, model, CONNECTOR | {"load_guard": guard},
                                 kv_role="kv_consumer", actor_class=GuardEngine, **ENGINE)
                    for guard in ("off", "auto"))
                engines += [r_off, r_auto]
                with console.status("starting 3 vLLM engines and warming them up"):
                    ready(*engines)
                    warm_up(w, r_off, r_auto, max(lengths))
                shaped = True
                for link in links:
                    shaped = _reshape(cluster, link, shaped)
                    with console.status(f"{link}: {settle} settling loads"):
                        settle_link(w, r_off, link, settle)
                    for tokens in lengths:
                        with console.status(f"{link}, {tokens}-token prompts"):
                            done = [measure(w, r_off, r_auto, link, tokens, i)
                                    for i in range(repeats)]
                        rows.append(summarise(link, tokens, done))
                        console.print(", ".join(f"{c} {v}" for c, v in zip(
                            TABLE_COLUMNS, table_row(rows[-1]), strict=True)))
                        runs += [{"link": link, "tokens": tokens, "repeat": i,
                                  "saved_blocks": r.saved_blocks,
                                  "expected_blocks": r.expected_blocks,
                                  **{k: asdict(getattr(r, k)) for k in ("cold", "off", "auto")}}
                                 for i, r in enumerate(done)]
            finally:
                for e in engines:
                    with contextlib.suppress(ray.exceptions.RayError):
                        ray.get(e.close.remote())
                    ray.kill(e)
    table = right_table("The load guard vs link speed: TTFT of one token on host 0, "
                        "pages on host 1", list(TABLE_COLUMNS),
                        caption="medians of the generate call; loaded: auto's share of "
                                "the hit; load wins: off < cold; match: the guard chose "
                                "the faster")
    for row in rows:
        table.add_row(*table_row(row))
    console.print(table)
    result = {"benchmark": "guard_links", "links": list(links), "lengths": list(lengths),
              "repeats": repeats, "settle": settle, "settle_tokens": SETTLE_TOKENS,
              "start_link": START_LINK, "block": BLOCK,
              "model": {"hidden": MODEL.hidden, "layers": MODEL.layers,
                        "kv_bytes_per_token": MODEL.kv_bytes_per_token},
              "segment_bytes": segment, "seconds": time.monotonic() - started,
              "load_average": os.getloadavg(), "rows": rows, "runs": runs}
    out = Path(out_dir or "raykv-out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_guard_links.json").write_text(json.dumps(result, indent=2))
    return result
