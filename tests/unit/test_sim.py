"""``raykv sim``'s simulator (``lab.sim``, pure): the reference hit rates of
Mooncake's published traces (tests/data/traces/README.md: one global LRU, unbounded)
come out of its untimed references and of the timed cluster itself; the L3 model
evicts as Mooncake documents; Belady bounds LRU; traces are checked line by line;
raykv's routing sends a request where its prefix lives; the package imports no Ray,
Mooncake or torch."""

import random
import subprocess
import sys
from pathlib import Path

import pytest
from raykv_lab.sim.bounds import belady, global_lru, unbounded
from raykv_lab.sim.cluster import ClusterSim
from raykv_lab.sim.costs import Costs
from raykv_lab.sim.l3_store import L3Store
from raykv_lab.sim.layout import Layout
from raykv_lab.sim.tally import percentile
from raykv_lab.sim.trace import BLOCK_TOKENS, Request, read_trace, shifted_copies
from raykv_lab.sim.workloads import multi_round_qa, shared_prefix, to_jsonl

TRACES = Path(__file__).parent.parent / "data" / "traces"
# tests/data/traces/README.md: capacity in tokens (None: unbounded) -> percent
REFERENCE = {
    "conversation": {1_000_000: 5.3, 3_000_000: 13.6, 10_000_000: 28.5, 50_000_000: 36.4,
                     None: 36.6},
    "synthetic": {1_000_000: 13.9, 3_000_000: 30.9, 10_000_000: 56.6, 50_000_000: 64.0,
                  None: 64.0},
}
# every speed so high that each request ends before the next one starts: the timed
# cluster replays the trace one request after the other, as the reference does
INSTANT = Costs(prefill_tokens_per_s=1e18, l2_load_gbps=1e9, host_load_gbps=1e9,
                store_get_gbps=1e9, store_put_gbps=1e9, l2_call_s=1e-12,
                store_call_s=1e-12, link_gbit=1e9)


def trace(name: str) -> list[Request]:
    return read_trace(TRACES / f"{name}_trace.jsonl")


def percent(rate: float) -> float:
    return round(100 * rate, 1)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_figures_of_one_global_lru_and_unbounded(name):
    reqs = trace(name)
    for capacity, want in REFERENCE[name].items():
        hits = unbounded(reqs) if capacity is None else \
            global_lru(reqs, capacity // BLOCK_TOKENS)
        assert percent(hits.block_rate) == pytest.approx(want, abs=0.051), capacity


@pytest.mark.parametrize("name", sorted(REFERENCE))
@pytest.mark.parametrize("capacity", [3_000_000, None])
def test_the_timed_cluster_gives_them_too(name, capacity):
    """One node, one engine whose GPU prefix cache is the one LRU (or holds every
    block), every cost near zero: the event loop, the tiers' bookkeeping and the tally
    give the reference figure and the untimed reference's exact counts."""
    reqs = trace(name)
    blocks = 10**9 if capacity is None else capacity // BLOCK_TOKENS
    sim = ClusterSim(Layout(1, 1, blocks), INSTANT, reqs)
    got = sim.run().as_dict()
    ref = unbounded(reqs) if capacity is None else global_lru(reqs, blocks)
    assert round(got["block_hit_rate"] * ref.blocks) == ref.hit_blocks
    assert got["prefill_tokens_saved"] == ref.hit_tokens
    assert percent(got["block_hit_rate"]) == pytest.approx(REFERENCE[name][capacity],
                                                           abs=0.051)
    # CONTROL: one block fewer per engine is another figure (the check can fail)
    if capacity is not None:
        fewer = ClusterSim(Layout(1, 1, blocks // 2), INSTANT, reqs).run().as_dict()
        assert fewer["block_hit_rate"] < got["block_hit_rate"]


def test_the_l3_model_alone_stays_near_one_lru():
    """The same replay through L3 only (Mooncake's model: 0.95 watermark, 5 % batches,
    puts that find the key do not refresh it) hits less than an exact LRU of its size,
    by the room the watermark keeps free: within 2 points on the synthetic trace."""
    reqs = trace("synthetic")
    cap = 3_000_000 // BLOCK_TOKENS
    got = ClusterSim(Layout(1, 1, 1, l3_blocks=cap), INSTANT, reqs).run().as_dict()
    lru = global_lru(reqs, cap).block_rate
    assert lru - 0.02 < got["tiers_block"]["l3_own"] < lru


def test_belady_bounds_lru_and_unbounded_bounds_belady():
    reqs = trace("synthetic")
    for tokens in (1_000_000, 3_000_000):
        cap = tokens // BLOCK_TOKENS
        assert global_lru(reqs, cap).hit_blocks < belady(reqs, cap).hit_blocks \
            <= unbounded(reqs).hit_blocks


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_l3_store_evicts_a_share_past_the_watermark_least_recent_first():
    clock = Clock()
    store = L3Store([10, 10], clock, random.Random(0), lease_s=5.0)
    for i in range(19):
        assert store.start_put(f"k{i}", preferred=0) is not None
        store.end_put(f"k{i}")
    assert store.stats()["objects"] == 19 and store.counts["evicted"] == 0
    # own placement: segment 0 is full, so the puts after the tenth landed on segment 1
    assert [store.segment_of(f"k{i}") for i in (9, 10)] == [0, 1]
    clock.t = 10.0  # every lease of the puts' time ran out
    store.lookup(["k0"])  # leased and the most recent: not evicted
    assert store.start_put("k19", preferred=None) is not None  # 20 > 0.95 x 20
    gone = [f"k{i}" for i in range(20) if store.segment_of(f"k{i}") is None]
    # ceil(0.05 x 19 readable objects) = 1: the least recently used that is not leased
    # (k19's put has not ended: neither readable nor evictable)
    assert gone == ["k1", "k19"] and store.counts["evicted"] == 1
    assert store.start_put("k0", preferred=1) is None  # put-if-absent: no bytes


def test_l3_store_put_without_room_fails_and_evicts():
    clock = Clock()
    store = L3Store([2], clock, random.Random(0), high_watermark=1.0, lease_s=5.0)
    for k in ("a", "b"):
        store.start_put(k, None)
        store.end_put(k)
    store.lookup(["a", "b"])
    assert store.start_put("c", None) is None  # both leased: nothing evictable
    assert store.counts["put_failed"] == 1 and store.counts["evicted"] == 0
    clock.t = 6.0
    assert store.start_put("d", None) is None  # no room: it fails, eviction runs
    assert store.counts["evicted"] == 1 and store.start_put("d", None) == 0


@pytest.mark.parametrize("line, words", [
    ("not json", "not JSON"),
    ("[1]", "not a JSON object"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
     "timestamp"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
     "2 blocks"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}',
     "hash_ids"),
])
def test_a_bad_trace_line_is_named_and_nothing_is_read(tmp_path, line, words):
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [7]}'
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"t.jsonl:2: .*{words}"):
        read_trace(path)
    path.write_text(good + "\n")
    assert read_trace(path) == [Request(0.0, 5, 1, (7,))]


def test_raykv_routing_sends_a_prefix_where_it_lives():
    """Two nodes of one engine each: the second request shares the first's prefix.
    raykv's routing sends it to the engine that computed it, whatever its seed; power
    of two choices (the control) sends it elsewhere for some seeds."""
    first = Request(0.0, 4 * BLOCK_TOKENS, 1, (1, 2, 3, 4))
    second = Request(100.0, 5 * BLOCK_TOKENS, 1, (1, 2, 3, 4, 5))
    gpu_hits = {}
    for routing in ("raykv", "pow2"):
        gpu_hits[routing] = [
            ClusterSim(Layout(2, 1, 64, l2_blocks=64, l3_blocks=64, routing=routing,
                              seed=seed), Costs(), [first, second]).run().blocks["gpu"]
            for seed in range(8)]
    assert gpu_hits["raykv"] == [4] * 8
    assert 0 in gpu_hits["pow2"]


def test_round_robin_takes_the_engines_in_turn_and_no_gpu_cache_holds_nothing():
    """Round robin: the i-th request on engine i modulo 3, whatever the queues; with no
    GPU cache (``gpu_blocks`` 0) and no other tier nothing is found. Control: with a GPU
    cache each engine's second request finds the block every request starts with."""
    reqs = [Request(float(i), 2 * BLOCK_TOKENS, 1, (0, i + 1)) for i in range(6)]
    got = ClusterSim(Layout(3, 1, 0, routing="round_robin"), INSTANT, reqs).run().as_dict()
    assert got["requests_per_node"]["all"] == [2, 2, 2]
    assert got["block_hit_rate"] == 0
    cached = ClusterSim(Layout(3, 1, 4, routing="round_robin"), INSTANT, reqs).run()
    assert cached.blocks["gpu"] == 3


def test_the_simulator_imports_no_ray_mooncake_or_torch():
    code = ("import sys; import raykv_lab.sim.cluster, raykv_lab.sim.compare; "
            "bad = [m for m in ('ray', 'mooncake', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_shifted_copies_repeat_the_trace_after_itself_sharing_nothing():
    reqs = trace("synthetic")[:300]
    four = shifted_copies(reqs, 4)
    span = reqs[-1].at - reqs[0].at + 1.0
    assert len(four) == 1200 and four[300].at == reqs[0].at + span
    assert [r.at for r in four] == sorted(r.at for r in four)
    assert unbounded(four).hit_blocks == 4 * unbounded(reqs).hit_blocks
    # CONTROL: copies that kept their block names would hit across copies
    same = [Request(r.at + c * span, r.input_tokens, r.output_tokens, r.blocks)
            for c in range(4) for r in reqs]
    assert unbounded(same).hit_blocks > 4 * unbounded(reqs).hit_blocks
    with pytest.raises(ValueError, match="copies"):
        shifted_copies(reqs, 0)


def test_percentile_is_the_nearest_rank():
    values = list(range(1, 101))
    assert [percentile(values, q) for q in (0.5, 0.9, 0.99, 1.0)] == [50, 90, 99, 100]
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0 and percentile([], 0.5) == 0.0
    assert percentile(list(range(1, 5)), 0.75) == 3  # ceil(3.0): the third, not the fourth


def common(a: Request, b: Request) -> int:
    n = 0
    while n < min(len(a.blocks), len(b.blocks)) and a.blocks[n] == b.blocks[n]:
        n += 1
    return n


def test_shared_prefix_workload_shares_each_groups_prefix_and_nothing_else():
    reqs = shared_prefix(4, 5, prefix_tokens=4 * BLOCK_TOKENS, question_tokens=BLOCK_TOKENS)
    assert len(reqs) == 20 and all(len(r.blocks) == 5 for r in reqs)
    # each group's first prompt computes its 4 prefix blocks, every later one finds them
    assert unbounded(reqs).hit_blocks == 4 * 4 * 4
    assert shared_prefix(4, 5, seed=1) != shared_prefix(4, 5, seed=2)
    assert shared_prefix(4, 5, seed=1) == shared_prefix(4, 5, seed=1)
    # a prefix that ends inside a block: that block holds a question too, so is not shared
    odd = shared_prefix(2, 3, prefix_tokens=BLOCK_TOKENS + 10, question_tokens=100)
    assert unbounded(odd).hit_blocks == 2 * 2 * 1


def test_multi_round_qa_rounds_extend_the_users_previous_prompt():
    reqs = multi_round_qa(1, 4, system_tokens=700, context_tokens=900, question_tokens=300,
                          answer_tokens=200)
    for before, after in zip(reqs, reqs[1:], strict=False):
        assert after.input_tokens == before.input_tokens + 200 + 300
        # every whole block of the previous prompt, and not its partial last one
        assert common(before, after) == before.input_tokens // BLOCK_TOKENS
    two = multi_round_qa(2, 1, system_tokens=700, context_tokens=900)
    assert common(*two) == 700 // BLOCK_TOKENS  # the shared system prompt's whole blocks
    with pytest.raises(ValueError, match="users"):
        multi_round_qa(0, 1)


def test_a_written_workload_reads_back_as_a_trace(tmp_path):
    reqs = multi_round_qa(3, 2, rate=5.0, seed=3)
    path = tmp_path / "w.jsonl"
    path.write_text(to_jsonl(reqs))
    back = read_trace(path)
    assert [(r.input_tokens, r.output_tokens, r.blocks) for r in back] == \
        [(r.input_tokens, r.output_tokens, r.blocks) for r in reqs]
    assert [r.at for r in back] == [round(r.at * 1000) / 1000 for r in reqs]


def test_the_l2_runs_the_eviction_policy_the_layout_names():
    """The synthetic trace's first 400 requests on one node whose L2 (300 pages) is its
    cache (GPU caches of 2 blocks, L3 of 1): the L2 hits differ between ``lru`` and
    ``s3fifo`` (the policy reaches the node's ``L2Index``); control: the same policy
    twice gives the same figures. The layout's default policy is the node's; an unknown
    one is refused."""
    from raykv.controllers.node_settings import DEFAULTS

    reqs = read_trace(TRACES / "synthetic_trace.jsonl", 400)

    def l2_hits(policy: str) -> int:
        layout = Layout(1, 2, 2, l2_blocks=300, l3_blocks=1, l2_eviction=policy)
        return ClusterSim(layout, Costs(), reqs).run().blocks["l2"]

    assert l2_hits("lru") < l2_hits("s3fifo")
    assert l2_hits("slru") == l2_hits("slru")
    assert Layout(1, 1, 1).l2_eviction == DEFAULTS.l2_eviction
    with pytest.raises(ValueError, match="L2 eviction"):
        Layout(1, 1, 1, l2_eviction="fifo")


def eviction_table_errors(text: str, result: dict) -> list[str]:
    """The rows of benchmarks.md's policy and split tables (*Eviction and the L2
    split*) whose hit rates are not the recorded run's (``sim_eviction.json``)."""
    import re

    names = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}
    want = []
    for trace, r in result["traces"].items():
        short = next(k for k, v in names.items() if v == trace)
        for p in r["policies"]:
            want.append((short, [p["runs"][n]["block_hit_rate"] for n in ("lru", "s3fifo",
                                                                          "slru")]))
        for p in r["split"]:
            want.append((short, [x[n]["block_hit_rate"] for x in p["runs"].values()
                                 for n in ("lru", "s3fifo") if n in x]))
    rows = [line for line in text.split("### Eviction and the L2 split", 1)[1].split(
        "**What the figures say.**", 1)[0].splitlines() if line.startswith(("| conv", "| synth"))]
    got = [(row.split("|")[1].strip().split(",")[0],
            [float(x) for x in re.findall(r"(?<![\w.(])(\d+\.\d\d)(?!\d)", row)])
           for row in rows]
    errors = []
    for trace, rates in want:
        rates = [round(100 * x, 2) for x in rates]
        if not any(t == trace and g[:len(rates)] == rates or
                   (len(set(rates)) == 1 and set(g) == set(rates)) for t, g in got):
            errors.append(f"{trace}: {rates}")
    return errors


def test_the_eviction_tables_quote_the_recorded_runs():
    """Every recorded policy point and split row of ``docs/sim_eviction.json`` is a row
    of benchmarks.md's tables, figure for figure. Control: one figure changed is
    caught."""
    import json

    docs = Path(__file__).parent.parent.parent / "docs"
    text = (docs / "benchmarks.md").read_text()
    result = json.loads((docs / "sim_eviction.json").read_text())
    assert eviction_table_errors(text, result) == []
    assert eviction_table_errors(text.replace("| 9.15 | **12.59**", "| 9.16 | **12.59**"),
                                 result) != []
