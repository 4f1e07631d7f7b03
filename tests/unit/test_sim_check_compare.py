"""``sim_check``'s pure parts (``lab.bench.sim_check_compare``): the sample is whole
conversations in arrival order, the same for a seed; the comparison finds a tier's
difference in points (control: identical figures differ by none)."""

from raykv_lab.bench.sim_check_compare import (
    compare,
    conversation_sample,
    layout,
    one_at_a_time,
    simulate,
)
from raykv_lab.sim.trace import BLOCK_TOKENS, Request


def conversation(c: int, turns: int, at: float) -> list[Request]:
    """``turns`` requests of conversation ``c``, each extending the last by a block."""
    return [Request(at + 10 * t, (t + 2) * BLOCK_TOKENS, 1,
                    (0, *range(1000 * c + 1, 1000 * c + t + 2))) for t in range(turns)]


def test_the_sample_is_whole_conversations_in_arrival_order():
    trace = sorted([r for c in range(6) for r in conversation(c, 3, float(c))],
                   key=lambda r: r.at)
    got = conversation_sample(trace, 6, seed=1)
    assert got == conversation_sample(trace, 6, seed=1)
    assert [r.at for r in got] == sorted(r.at for r in got)
    drawn = {r.blocks[1] for r in got}
    assert len(drawn) == 2 and all(
        sum(r.blocks[1] == b for r in got) == 3 for b in drawn)
    # CONTROL: another seed draws other conversations
    assert {r.blocks[1] for r in conversation_sample(trace, 6, seed=3)} != drawn


def test_compare_names_the_points_a_tier_is_off():
    reqs = [r for c in range(4) for r in conversation(c, 3, 100.0 * c)]
    with_l2, _ = simulate(reqs, layout(2, 64, 1000))
    assert compare(with_l2, with_l2)["max_diff_pp"] == 0
    without, _ = simulate(reqs, layout(2, 0, 1000))
    got = compare(with_l2, without)
    l2 = got["tiers"]["l2"]["block"]
    assert l2["sim"] == 0 and l2["diff_pp"] == l2["real"] > 0
    assert got["max_diff_pp"] >= l2["diff_pp"]
    assert [r.at for r in one_at_a_time(reqs[:3])] == [0.0, 1000.0, 2000.0]
