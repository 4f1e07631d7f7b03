"""``raykv sim`` against a real cluster (``lab.bench.sim_check``): whole
conversations of Mooncake's conversation trace replayed one request at a time on a real
two-node embedded cluster (real Ray, real ``mooncake_master``, placement ``own``), each
block one tiny page, and in the simulator on the same requests with the same tiers: the
share of blocks (and of tokens) each tier served agrees within 2 points. Two replays:
through the node actors' L2 pools and write-behind (the L2 ops of vLLM's connector),
and through the example engine (a real model, its own host pool, L3). Control in each:
the simulator with none of that tier, or four times it, disagrees with the same real
run by more than 2 points (the check can fail)."""

import pytest
from raykv_lab.bench import sim_check_engine
from raykv_lab.bench.sim_check import TRACE, check
from raykv_lab.bench.sim_check_compare import MAX_DIFF_PP, conversation_sample
from raykv_lab.sim.trace import read_trace

REQUESTS = 300
PAGES = 256


@pytest.fixture(scope="module")
def requests():
    got = conversation_sample(read_trace(TRACE), REQUESTS)
    assert max(len(r.blocks) for r in got) < PAGES  # no FULL answer, by design
    return got


def agree(got: dict, tiers: tuple[str, ...]) -> None:
    """Each tier served a share worth checking, the two sides agree within the bound,
    and every control (the simulator with another size of the tier) does not."""
    shares = got["found"]["tiers"]
    assert all(shares[t]["block"]["real"] > 2 * MAX_DIFF_PP for t in tiers), shares
    assert got["found"]["max_diff_pp"] <= MAX_DIFF_PP, got["found"]
    assert len(got["sim_controls"]) == 2
    for pages, off in got["sim_controls"].items():  # CONTROL
        assert off["max_diff_pp"] > MAX_DIFF_PP, (pages, off)


def test_node_l2_replay_agrees_with_the_simulator_per_tier(cluster, uid, requests):
    assert cluster.settings.placement == "own"
    got = check(cluster, requests, PAGES, cluster.settings.global_segment_size, uid,
                (0, 4 * PAGES))
    real = got["real"]
    # what makes the two comparable held: nothing lost in L3, every block had a page
    assert real["l3_missing"] == 0 and real["full"] == 0
    assert got["sim"]["stats"]["l3"]["evicted"] == 0
    # L2's eviction mattered: both nodes' L2 pools evicted
    assert all(c["evicted"] > 0 and c["pages"] == PAGES for c in real["counters"])
    agree(got, ("l2", "l3_own", "l3_remote"))
    assert got["loaded"]["max_diff_pp"] <= MAX_DIFF_PP, got["loaded"]


def test_example_engine_replay_agrees_with_the_simulator_per_tier(cluster, uid, requests):
    got = sim_check_engine.check(cluster, requests, PAGES,
                                 cluster.settings.global_segment_size, uid, 2,
                                 (0, 4 * PAGES))
    assert got["real"]["l3_missing"] == 0
    assert got["sim"]["stats"]["l3"]["evicted"] == 0
    agree(got, sim_check_engine.TIERS)
