"""``raykv sim`` against a real cluster (``clusters.bench.sim_check``): whole
conversations of Mooncake's conversation trace replayed one request at a time on a real
two-node embedded cluster (real Ray, real ``mooncake_master``, the node actors' L2 pools,
write-behind and placement ``own``), each block one tiny page, and in the simulator on
the same requests with the same tiers: the share of blocks (and of tokens) each tier
served agrees within 2 points. Control: the simulator with no L2, or with four times
the L2, disagrees with the same real run by more than 2 points (the check can fail)."""

from raykv.clusters.bench.sim_check import TRACE, check
from raykv.clusters.bench.sim_check_compare import MAX_DIFF_PP, conversation_sample
from raykv.clusters.sim.trace import read_trace

REQUESTS = 300
L2_PAGES = 256


def test_per_tier_hits_of_a_real_replay_agree_with_the_simulator(cluster, uid):
    requests = conversation_sample(read_trace(TRACE), REQUESTS)
    assert max(len(r.blocks) for r in requests) < L2_PAGES  # no FULL answer by design
    segment = cluster.settings.global_segment_size
    assert cluster.settings.placement == "own"
    got = check(cluster, requests, L2_PAGES, segment, uid, (0, 4 * L2_PAGES))
    real = got["real"]
    # what makes the two comparable held: nothing lost in L3, every block had a page
    assert real["l3_missing"] == 0 and real["full"] == 0
    assert got["sim"]["stats"]["l3"]["evicted"] == 0
    # L2's eviction mattered: both nodes evicted, and L2 served part of the hits
    assert all(c["evicted"] > 0 and c["pages"] == L2_PAGES for c in real["counters"])
    tiers = got["found"]["tiers"]
    assert all(tiers[t]["block"]["real"] > 2 * MAX_DIFF_PP
               for t in ("l2", "l3_own", "l3_remote"))
    assert got["found"]["max_diff_pp"] <= MAX_DIFF_PP, got["found"]
    assert got["loaded"]["max_diff_pp"] <= MAX_DIFF_PP, got["loaded"]
    # CONTROL: the simulator with another L2 is off by more than the bound
    for pages, off in got["sim_controls"].items():
        assert off["max_diff_pp"] > MAX_DIFF_PP, (pages, off)
