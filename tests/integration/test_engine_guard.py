"""The example engine's load guard on a real two-node cluster whose store is made slow
from the test side (``store_delay``: every put and get of the node actors waits): the
engine measures its own slow L3 load, then loads only its L2 head and recomputes the L3
tail, with logits identical to recomputing the whole prompt; the control, an engine on
the same node with the guard off, loads the tail from L3.

No wall-clock threshold: the assertions are the guard's decisions (the store's delay,
1 s per call, is far beyond what computing a few pages of this tiny model takes).
"""

import random

import pytest
import torch
from raykv.example_engine import Engine
from raykv.example_engine.presets import build

from tests.integration.conftest import set_store_delay

PS = 16
SIZES = dict(hidden=64, layers=4, head_dim=16, vocab=128)
DELAY_S = 1.0


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(SIZES["vocab"]) for _ in range(n)]


def assert_same(got, want) -> None:
    assert got.tokens == want.tokens
    for a, b in zip(got.logits, want.logits, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("variant", ["mha", "hybrid-draft"])
def test_slow_l3_tail_is_recomputed_and_exact(cluster, variant):
    target, draft = build(variant, f"test/guard-{variant}", **SIZES)
    made = dict(page_size=PS, max_tokens=512, host_pages=32, state_slots=32, draft=draft)
    a, b = (Engine(target, node, **made) for node in cluster.node_ids)
    control = Engine(target, cluster.node_ids[1], load_guard="off", **made)
    system = tokens(4 * PS + 7, seed=1)
    a.generate(system, 1)                       # L3: the system prompt's 4 pages
    set_store_delay(cluster, DELAY_S)
    try:
        first = b.generate(system + tokens(2 * PS + 3, 2), 1)
        # nothing measured the store yet: the guard loads, and so measures it
        assert (first.l3_pages, first.skipped_pages) == (4, {})
        assert b.guard.l3.samples == 1
        turn = system + tokens(3 * PS + 5, 3)
        a.generate(turn, 1)                     # L3: its 3 new pages, from node A
        prompt = turn + tokens(PS + 1, 4)
        got = b.generate(prompt, 2)
        # L2 head (the system prompt's 4 pages) loaded, the slow L3 tail recomputed
        assert (got.l2_pages, got.l3_pages) == (4, 0)
        assert got.skipped_pages == {"l3": 3}
        assert got.guard_reason == "slower_than_prefill"
        assert got.computed_tokens == len(prompt) - 4 * PS
        assert_same(got, b.generate(prompt, 2, use_cache=False))
        # CONTROL: the guard off, the same request on the same node loads from L3 all
        # 8 restorable pages (B's request offloaded the pages it computed, its 8th too)
        loaded = control.generate(prompt, 2)
        assert (loaded.l3_pages, loaded.skipped_pages, loaded.guard_reason) == (8, {}, "off")
        assert_same(loaded, got)
    finally:
        set_store_delay(cluster, 0)
