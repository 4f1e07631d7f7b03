"""The load guard in raykv's SGLang backend, driven by SGLang 0.5.23's own controller
and prefetch threads (``sglang_driver.py``): the hit ``batch_exists`` (MHA, SGLang's v1
query) and ``batch_exists_v2`` (hybrid: KV + Mamba) report is what SGLang loads, so a
hit the guard refuses is recomputed and a refused tail is not loaded; the backend counts
each decision. Controls: the same prompts with the guard off are loaded in full.

A fixed threshold needs no estimate. ``auto`` weighs the group answer's ``load_runs``
(filled by the node side; here the driver's ``slow_runs`` step makes every answer carry
a slow L3 run, as a node over a slow link would say) against the operator's
``prefill_tokens_per_s``.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.sglang_runs import run_driver, scenario, steps

pytestmark = pytest.mark.engine("sglang")

N = 4            # pages of each prompt (16 tokens a page)
SLOW_S = 30.0    # an L3 run the node estimates at 30 s: far slower than computing it
RATE = {"prefill_tokens_per_s": 1000}   # 64 tokens: 64 ms to compute


def guarded(name: str, model: str, uid: str, extra: dict, runs: dict | None) -> dict:
    """Write a prompt of ``N`` pages, then (``runs``: a ``slow_runs`` step first)
    prefetch it through SGLang and read the backend's counters."""
    seed = f"{name}-{uid}"
    mamba = {"mamba": [N]} if model == "hybrid" else {}
    pre = [{"op": "slow_runs", **runs}] if runs is not None else []
    return scenario(name, model, "shm", [
        {"op": "write", "seed": seed, "n_pages": N, **mamba},
        *pre,
        {"op": "prefetch", "seed": seed, "n_pages": N},
        {"op": "stats"}], model_name=f"org/guard-{name}-{uid}", extra=extra)


@pytest.fixture(scope="module")
def guard_runs(cluster, tmp_path_factory):
    uid = os.urandom(3).hex()
    cases = {
        "threshold": guarded("threshold", "mha", uid, {"load_guard": 5 * 16}, None),
        "threshold-control": guarded("threshold-control", "mha", uid,
                                     {"load_guard": N * 16}, None),
        "slow": guarded("slow", "mha", uid, RATE, {"s": SLOW_S}),
        "mixed": guarded("mixed", "mha", uid, RATE, {"s": SLOW_S, "head": 2}),
        "slow-control": guarded("slow-control", "mha", uid,
                                RATE | {"load_guard": "off"}, {"s": SLOW_S}),
        "hybrid": guarded("hybrid", "hybrid", uid, RATE, {"s": SLOW_S, "head": 2}),
        "hybrid-control": guarded("hybrid-control", "hybrid", uid,
                                  RATE | {"load_guard": "off"}, {"s": SLOW_S, "head": 2}),
    }
    out = run_driver(tmp_path_factory.mktemp("guard"), cluster, 0, list(cases.values()))
    return {name: steps(out["scenarios"][name]) for name in cases}


def loaded(result: list[dict]) -> tuple[int, int, list[bool]]:
    """(hit pages SGLang agreed on, pages it loaded, their bytes' check)."""
    pre = next(s for s in result if "hit_pages" in s)
    return pre["hit_pages"], pre["loaded_pages"], pre["kv_match"]


def counters(result: list[dict]) -> dict:
    return result[-1]["counters"]


def test_a_hit_below_the_threshold_is_recomputed(guard_runs):
    assert loaded(guard_runs["threshold"]) == (0, 0, [])
    c = counters(guard_runs["threshold"])
    assert c["load_guard:recompute:below_threshold"] == 1
    assert c["load_guard_skipped_tokens:l3"] == N * 16
    # CONTROL: a threshold the hit reaches loads it, bytes checked
    assert loaded(guard_runs["threshold-control"]) == (N, N, [True] * N)
    assert counters(guard_runs["threshold-control"])["load_guard:load:above_threshold"] == 1


def test_a_slow_load_is_recomputed_and_a_slow_tail_cut(guard_runs):
    assert loaded(guard_runs["slow"]) == (0, 0, [])
    assert counters(guard_runs["slow"])["load_guard:recompute:slower_than_prefill"] == 1
    assert loaded(guard_runs["mixed"]) == (2, 2, [True, True])
    c = counters(guard_runs["mixed"])
    assert c["load_guard:mixed:slower_than_prefill"] == 1
    assert (c["hit_tokens:l2"], c["load_guard_skipped_tokens:l3"]) == (32, 32)
    assert c["asked_tokens"] >= N * 16
    # CONTROL: the guard off loads the same slow hit in full
    assert loaded(guard_runs["slow-control"]) == (N, N, [True] * N)
    control = counters(guard_runs["slow-control"])
    assert control["load_guard:load:off"] == 1
    assert not any(k.startswith("load_guard:") and not k.startswith("load_guard:load:")
                   for k in control)


def test_a_hybrid_cut_falls_only_where_a_mamba_checkpoint_is_restorable(guard_runs):
    # the L2 head (2 pages) ends where no checkpoint is held: the cut goes to 0
    assert loaded(guard_runs["hybrid"])[:2] == (0, 0)
    c = counters(guard_runs["hybrid"])
    assert c["load_guard:recompute:slower_than_prefill"] == 1
    # CONTROL: the guard off loads the whole hit with its checkpoint
    assert loaded(guard_runs["hybrid-control"]) == (N, N, [True] * N)
