"""The load guard in ``raykv sim`` (``lab.sim.guard``, pure, on small hand-made
traces): the runs a node would weigh and their estimates, the cut the product's own
``choose_load`` makes, and what it changes in a replay (a disk tier slower than the
GPU's prefill is not loaded; the skipped tail is a miss)."""

import dataclasses

import pytest
from click.testing import CliRunner
from raykv.clusters.cli import main
from raykv.controllers.load_guard import GuardSettings, LoadRun
from raykv_lab.sim.cluster import ClusterSim
from raykv_lab.sim.compare import Setup
from raykv_lab.sim.costs import Costs
from raykv_lab.sim.guard import SimGuard, hit_runs
from raykv_lab.sim.layout import Layout
from raykv_lab.sim.links import Links
from raykv_lab.sim.trace import BLOCK_TOKENS, Request

# prefill at 10,000 tokens/s; a 512-token block of 64 MiB: from a disk at 0.39 GB/s
# 0.17 s (2,975 tokens/s), from memory at 100 GB/s 0.7 ms; everything else near free
COSTS = Costs(l2_load_gbps=1e9, host_load_gbps=1e9, store_get_gbps=100.0,
              store_put_gbps=1e9, l2_call_s=1e-12, store_call_s=1e-12, link_gbit=1e9)
FAST_DISK = dataclasses.replace(COSTS, disk_get_gbps=100.0)


def prompt(at: float, blocks: tuple[int, ...]) -> Request:
    return Request(at, len(blocks) * BLOCK_TOKENS, 1, blocks)


def two_passes(prompts: int, start2: float) -> list[Request]:
    """``prompts`` prompts of two blocks each, none sharing a block, one every 10 s;
    then the same again from ``start2``."""
    first = [prompt(10.0 * i, (2 * i, 2 * i + 1)) for i in range(prompts)]
    return first + [prompt(start2 + 10.0 * i, r.blocks) for i, r in enumerate(first)]


def replay(guard: str, costs: Costs = COSTS, **layout) -> tuple[dict, dict]:
    """40 blocks through an L3 of 8 with a disk: the second pass finds them on disk."""
    lay = Layout(1, 1, 1, l3_blocks=8, disk_blocks=1000, load_guard=guard)
    sim = ClusterSim(dataclasses.replace(lay, **layout), costs, two_passes(20, 1000.0))
    return sim.run().as_dict(), sim.stats()


def test_the_runs_a_node_weighs_are_its_tiers_at_the_cost_models_rates():
    c = Costs()
    links = Links(2, c, sealed=False)
    block, copy = c.block_bytes, c.block_bytes / (c.l2_load_gbps * 1e9)
    segs = [(0, False)] * 2 + [(1, False)] * 3 + [(1, True)]
    runs = hit_runs(0, 4, segs, links, c, 0.0, through_l2=True)
    assert [(r.tier, r.pages) for r in runs] == [("l2", 4), ("l3", 2), ("l3", 3),
                                                 ("l3_disk", 1)]
    assert runs[0].seconds == pytest.approx(c.l2_call_s + 4 * copy)
    assert runs[1].seconds == pytest.approx(2 * block / 2.97e9 + 2 * copy + c.store_call_s)
    assert runs[2].seconds == pytest.approx(3 * block / min(2.97e9, c.link_bytes_per_s)
                                            + 3 * copy)
    assert runs[3].seconds == pytest.approx(block / 0.39e9 +
                                            block / min(0.39e9, c.link_bytes_per_s) + copy)
    # CONTROL: the estimate is what a fetch of the run adds, queues included, and
    # changes no queue
    assert links.estimate(0, 1, False, 3, 0.0) == pytest.approx(
        links.fetch(0, [(1, False)] * 3, 0.0))
    busy = links.estimate(0, 1, False, 3, 0.0)
    assert busy > 3 * block / min(2.97e9, c.link_bytes_per_s) * 1.9  # the queue waited
    assert links.estimate(0, 1, False, 3, 0.0) == busy  # estimating changed nothing


def test_the_guard_keeps_the_fast_head_and_cuts_a_slow_tail():
    c = Costs()
    guard = SimGuard(GuardSettings.parse("auto"), c)
    runs = [LoadRun("l2", 2, 0.001), LoadRun("l3_disk", 3, 1.0)]
    assert guard.pages(runs) == 2
    assert guard.counts == {"requests_cut": 1, "blocks_skipped": 3, "l2_skipped": 0,
                            "l3_skipped": 0, "l3_disk_skipped": 3}
    off = SimGuard(GuardSettings.parse("off"), c)  # CONTROL: off loads every hit
    assert off.off and off.pages(runs) == 5 and off.counts["requests_cut"] == 0
    fast = [LoadRun("l2", 2, 0.001), LoadRun("l3_disk", 3, 0.01)]
    assert guard.pages(fast) == 5  # CONTROL: a fast tail is loaded
    threshold = SimGuard(GuardSettings.parse(2048), c)
    assert threshold.pages(runs) == 5 and threshold.pages(runs[:1]) == 0


def test_auto_recomputes_disk_hits_slower_than_prefill():
    """The disk reads 2,975 tokens a second against the GPU's 10,000: ``auto`` computes
    the disk's blocks (a miss each, counted) and the first tokens come sooner.
    CONTROL: off loads them (today's replay); a disk faster than prefill is loaded."""
    off, _ = replay("off")
    auto, stats = replay("auto")
    assert off["block_hit_rate"] == 0.5 and off["tiers_block"]["l3_disk"] == 0.4125
    assert auto["tiers_block"]["l3_disk"] == 0.0 and auto["block_hit_rate"] == 0.075
    assert stats["load_guard"]["l3_disk_skipped"] == 33  # 0.4125 of 80 blocks
    assert stats["load_guard"]["l3_skipped"] == 1  # memory behind a disk block
    assert auto["ttft_s"]["p99"] < off["ttft_s"]["p99"]
    fast, fast_stats = replay("auto", FAST_DISK)
    assert fast == replay("off", FAST_DISK)[0] and fast["tiers_block"]["l3_disk"] > 0.4
    assert fast_stats["load_guard"]["blocks_skipped"] == 0


def test_off_is_todays_replay_and_threshold_cuts_short_hits():
    """A layout without the setting is off (every run but raykv's), and ``off`` gives
    the same figures as it. A threshold of two blocks' tokens loads these two-block
    hits, one of three blocks' none."""
    default, stats = replay("off")
    assert "load_guard" not in stats
    lay = Layout(1, 1, 1, l3_blocks=8, disk_blocks=1000)
    assert lay.load_guard == "off"
    assert ClusterSim(lay, COSTS, two_passes(20, 1000.0)).run().as_dict() == default
    loaded, _ = replay(str(2 * BLOCK_TOKENS))
    cut, cut_stats = replay(str(3 * BLOCK_TOKENS))
    assert loaded == default
    assert cut["block_hit_rate"] == 0.0 and cut_stats["load_guard"]["requests_cut"] == 20


def test_raykv_runs_take_the_setups_guard_and_the_others_none():
    setup = Setup(nodes=1, engines_per_node=1, gpu_tokens=512, l2_tokens=512,
                  l3_tokens=512)
    assert setup.load_guard == GuardSettings().describe() == "auto"
    layouts = dataclasses.replace(setup, load_guard="256").layouts()
    assert {n: lay.load_guard for n, lay in layouts.items()} == {
        "gpu_only": "off", "local_host": "off", "pooled": "off", "raykv": "256",
        "raykv_pow2": "256"}
    with pytest.raises(ValueError, match="load_guard 'sometimes'"):
        Layout(1, 1, 1, load_guard="sometimes")


def test_raykv_sim_takes_load_guard(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        f'{{"timestamp": {1000 * i}, "input_length": 1024, "output_length": 1, '
        f'"hash_ids": [{i % 3}, {i % 3 + 10}]}}\n' for i in range(20)))
    args = ["sim", str(trace), "--nodes", "1", "--engines-per-node", "1", "--runs", "raykv",
            "--gpu-tokens", "512"]
    res = CliRunner().invoke(main, [*args, "--load-guard", "4096"])
    assert res.exit_code == 0, res.output
    assert "raykv: load guard cut 17 hits" in res.output  # 2-block L2 hits < 4096
    res = CliRunner().invoke(main, [*args, "--load-guard", "off"])
    assert res.exit_code == 0 and "load guard" not in res.output  # CONTROL
    res = CliRunner().invoke(main, [*args, "--load-guard", "sometimes"])
    assert res.exit_code == 2 and "--load-guard" in res.output
