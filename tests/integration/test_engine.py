"""The example engine on a real two-node cluster: restoring a prefix from raykv (local
host pool or Mooncake, computed on the other node) gives the same logits as recomputing
it, bit for bit; KV without its Mamba checkpoint is a miss; with the store made slow,
the load guard recomputes the L3 tail, bit for bit too.

Bit-exact equality holds by construction (see ``example_engine.rank``): prefill always
runs in page-aligned, page-sized chunks on single-threaded deterministic ranks, so
every chunk computes with the same shapes and inputs whether its prefix was computed
or restored. Both nodes run on this machine, so the kernels are the same.
"""

import hashlib
import os
import random
import signal
import threading
import time

import numpy as np
import pytest
import ray
import torch
from mooncake.store import MooncakeDistributedStore
from raykv.example_engine import Engine
from raykv.example_engine.host_index import HostIndex
from raykv.example_engine.page_hashes import page_hashes
from raykv.example_engine.presets import build
from raykv.example_engine.workload import ChatWorkload

from tests.integration.conftest import set_store_delay

PS = 16  # tokens per page
SIZES = dict(hidden=64, layers=4, head_dim=16, vocab=128)
DELAY_S = 1.0  # a slow store call: far slower than the prefill of a few pages, even under load
"""Seconds every put and get of the node actors waits in the guard's test (far beyond
what computing a few pages of this tiny model takes)."""


@pytest.fixture(scope="module")
def cluster():
    """A two-node cluster of its own (default settings). The engine asks about the same
    keys again right after another node stored them: group answers are shared by the
    ranks of one request only, so the second request sees the new pages."""
    from raykv import local_settings, start_local

    with start_local(settings=local_settings(global_segment_size=256 << 20), num_nodes=2) as c:
        yield c


@pytest.fixture(scope="module")
def engines(cluster):
    """Per variant, a TP=2 engine on each node (made on first use), the load guard off:
    these tests restore every hit to check it equals recomputing (the guard's choice:
    ``test_slow_l3_tail_is_recomputed_and_exact``)."""
    made: dict[str, tuple[Engine, Engine]] = {}

    def get(variant: str) -> tuple[Engine, Engine]:
        if variant not in made:
            target, draft = build(variant, f"test/{variant}", **SIZES)
            made[variant] = tuple(Engine(target, node, draft=draft, page_size=PS,
                                         max_tokens=512, host_pages=24, state_slots=24,
                                         load_guard="off")
                                  for node in cluster.node_ids)
        return made[variant]

    return get


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(SIZES["vocab"]) for _ in range(n)]


def stored(cluster, objects: list[str]) -> list[int]:
    """``batch_is_exist`` of raw object keys, asked by a separate Mooncake client."""
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", cluster.metadata_server, 0, 16 << 20, "tcp", "",
                       cluster.master_address) == 0
    try:
        return store.batch_is_exist(objects)
    finally:
        store.close()


def assert_same(got, want) -> None:
    """Same generated tokens and bit-identical logits at every step."""
    assert got.tokens == want.tokens
    assert len(got.logits) == len(want.logits)
    for a, b in zip(got.logits, want.logits, strict=True):
        assert torch.equal(a, b)


def test_page_hashes_are_chained():
    toks = tokens(3 * PS + 5, 1)
    keys = page_hashes(toks, PS)
    assert len(keys) == 3
    prev = b""
    for i, key in enumerate(keys):
        digest = hashlib.sha256(prev + np.asarray(toks[i * PS:(i + 1) * PS], "<i4").tobytes())
        assert key == digest.hexdigest()
        prev = digest.digest()
    assert page_hashes(toks[:2 * PS] + [7] * PS, PS)[:2] == keys[:2]
    assert page_hashes([toks[0] + 1] + toks[1:], PS)[2] != keys[2]  # a prefix change spreads


def test_host_index_evicts_least_recently_used_but_never_kept():
    index = HostIndex(3)
    index.insert(["a", "b", "c"], index.allocate(3))
    assert index.prefix(["a", "b", "x", "c"]) == 2
    assert index.slots(["a", "b"]) == [0, 1]     # LRU order now: c, a, b
    assert index.allocate(1, keep=["c"]) == [0]  # c is kept, so a goes
    assert "a" not in index and len(index) == 2
    with pytest.raises(RuntimeError, match="too small"):
        index.allocate(3, keep=["b", "c"])


@pytest.mark.parametrize("variant", ["mha", "mla-draft", "hybrid-draft"])
def test_restore_equals_recompute(cluster, engines, variant):
    a, b = engines(variant)
    prompt = tokens(4 * PS + 7, seed=len(variant))
    first = a.generate(prompt, 4)                  # node A: nothing cached yet
    assert first.hit_pages == 0 and first.offloaded_pages["kv"] == 4
    if variant.startswith("mla"):  # the latent is stored once (TP rank 0), draft per rank
        p = f"test-{variant}_{page_hashes(prompt, PS)[0]}_"
        assert stored(cluster, [p + "_k", p + "0_k", p + "1_k", p + "0_draft_k",
                                p + "1_draft_k"]) == [1, 0, 0, 1, 1]

    longer = prompt + tokens(2 * PS + 3, 2)        # node B: prefix from L3 (Mooncake)
    from_l3 = b.generate(longer, 6)
    assert (from_l3.hit_pages, from_l3.l2_pages, from_l3.l3_pages) == (4, 0, 4)
    assert from_l3.fetched_bytes["kv"] > 0
    assert_same(from_l3, b.generate(longer, 6, use_cache=False))

    mixed = a.generate(longer, 6)                  # node A: 4 pages in L2, 2 from L3
    assert (mixed.hit_pages, mixed.l2_pages, mixed.l3_pages) == (6, 4, 2)
    assert_same(mixed, a.generate(longer, 6, use_cache=False))

    again = a.generate(longer + [1, 2, 3], 3)     # node A: all 6 pages local now
    assert (again.hit_pages, again.l2_pages, again.l3_pages) == (6, 6, 0)
    assert not again.fetched_bytes
    assert_same(again, a.generate(longer + [1, 2, 3], 3, use_cache=False))

    if "hybrid" in variant:
        assert (from_l3.state_tier, mixed.state_tier, again.state_tier) == ("l3", "l3", "l2")
    if "draft" in variant:
        assert from_l3.fetched_bytes["draft"] > 0 and from_l3.proposed > 0
        # Speculative decoding keeps the target's greedy output (the recurrent state is
        # rolled back past rejected tokens); a multi-row verify step rounds differently
        # from single-row steps, hence a tolerance on its logits.
        plain = b.generate(longer, 6, use_cache=False, speculate=False)
        assert plain.tokens == from_l3.tokens and plain.proposed == 0
        for x, y in zip(plain.logits, from_l3.logits, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_kv_without_its_mamba_state_is_a_miss(engines, cluster):
    a, b = engines("hybrid-draft")
    a.checkpoint_interval = 4       # node A offloads KV for 6 pages, a state after page 4
    try:
        prompt = tokens(6 * PS + 5, seed=77)
        assert a.generate(prompt, 1).offloaded_pages == {"kv": 6, "mamba": 1, "draft": 6}
    finally:
        a.checkpoint_interval = 1
    keys = page_hashes(prompt, PS)
    found = stored(cluster, [f"test-hybrid-draft_{k}_0_k" for k in keys]
                   + [f"test-hybrid-draft_{k}_0_temporal" for k in keys])
    assert found == [1] * 6 + [0, 0, 0, 1, 0, 0]   # all KV; one state, after page 4

    got = b.generate(prompt, 3)                  # 6 KV pages exist but only 4 restorable
    assert (got.hit_pages, got.l3_pages, got.state_tier) == (4, 4, "l3")
    assert_same(got, b.generate(prompt, 3, use_cache=False))
    # Node A holds the 6 KV pages in L2 but a state only after page 4; node B has since
    # stored the state after page 6 in L3: KV comes from L2, the state from L3.
    local = a.generate(prompt + [5], 3)
    assert (local.hit_pages, local.l2_pages, local.l3_pages, local.state_tier) == (
        6, 6, 0, "l3")
    assert_same(local, a.generate(prompt + [5], 3, use_cache=False))


@pytest.mark.parametrize("variant", ["mha", "hybrid-draft"])
def test_slow_l3_tail_is_recomputed_and_exact(cluster, variant):
    """The load guard with the store made slow from the test side (``store_delay``): the
    engine measures its own slow L3 load, then loads only its L2 head and recomputes the
    L3 tail, with logits identical to recomputing the whole prompt; the control, an
    engine on the same node with the guard off, loads the tail from L3. No wall-clock
    threshold: the assertions are the guard's decisions."""
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


def queue_wait_s(cluster, node: str) -> float:
    """The node actor's queue wait (``LoadCosts.queue_wait``), from its ``stats``."""
    return ray.get(cluster.node_actors[node].stats.remote()).loads.queue_wait_s


def test_a_stopped_peer_raises_the_estimates_and_requests_recompute_not_wait(cluster):
    """Engine A's prompts are stored on A's node's segment; then A's node actor is
    stopped (SIGSTOP: its process, the segment's server included, halts). Engine C on
    node B asks for one of them: B's store call to read it hangs on the stopped peer.
    While it hangs, B's queue wait grows with its age (the estimates move before any
    deadline passes or any breaker opens), and engine B, on the same node, recomputes
    its next L3 hit at once (``slower_than_prefill``) with the logits of recomputing it,
    instead of queueing behind the hung call. Control: before the stop, B loads its
    first L3 hit from A's segment."""
    here = ray.get_runtime_context().get_node_id()
    (there,) = [n for n in cluster.node_ids if n != here]
    target, draft = build("mha", "test/stopped-peer", **SIZES)
    made = dict(page_size=PS, max_tokens=512, host_pages=32, state_slots=32, draft=draft)
    a = Engine(target, there, **made)
    b, c = (Engine(target, here, **made) for _ in range(2))
    prompts = [tokens(12 * PS + 3, seed=300 + i) for i in range(3)]
    for p in prompts:
        a.generate(p, 1)                        # L3, on A's segment
    b.generate(tokens(4 * PS + 3, seed=399), 1)  # B measures its prefill (a miss)
    loaded = b.generate(prompts[0], 1)          # CONTROL: A answers, B loads from L3
    assert (loaded.l3_pages, loaded.skipped_pages) == (12, {}), loaded
    pid = ray.get(cluster.node_actors[there].health.remote())["pid"]
    hung = threading.Thread(target=lambda: c.generate(prompts[1], 1), daemon=True)
    os.kill(pid, signal.SIGSTOP)
    try:
        hung.start()
        deadline = time.monotonic() + 60
        while queue_wait_s(cluster, here) < 2.0:  # C's read, hung on the stopped peer
            assert time.monotonic() < deadline, "B's estimates never moved"
            time.sleep(0.2)
        got = next(b.stream(prompts[2], 1))     # its first token: nothing waited for A
        assert (got.l3_pages, got.skipped_pages) == (0, {"l3": 12}), got
        assert got.guard_reason == "slower_than_prefill"
        want = next(b.stream(prompts[2], 1, use_cache=False))
        assert got.tokens == want.tokens and torch.equal(got.logits[0], want.logits[0])
    finally:
        os.kill(pid, signal.SIGCONT)
        hung.join(120)


def test_chat_workload_shares_the_system_prompt_and_alternates_nodes():
    work = ChatWorkload(sessions=3, turns=2, system_tokens=40, user_tokens=8, vocab=128)
    assert list(work.schedule(2)) == [(0, 0, 0), (1, 0, 1), (2, 0, 0),
                                      (0, 1, 1), (1, 1, 0), (2, 1, 1)]
    assert work.system_prompt() == work.system_prompt() and len(work.system_prompt()) == 40
    assert work.user_message(0, 1) != work.user_message(1, 1)
