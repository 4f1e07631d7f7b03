"""What a warm-up chooses to read into a new L2 pool (``cache_actors.node.warm_plan``):
one rank's objects of the peers' journals, run by run (the objects one store call
touched, in that call's order), the latest first, within a budget of pages."""

from __future__ import annotations

from raykv.cache_actors.node.touch_journal import Touch, TouchJournal, hottest
from raykv.cache_actors.node.warm_plan import peers_to_ask, rank_objects, warm_runs

PAGE = 64
WANTED = rank_objects("m_", "_0_kv", PAGE)


def key(h: str, rank: int = 0) -> str:
    return f"m_{h}_{rank}_kv"


def journal(*calls: tuple[list[str], float]) -> dict[str, Touch]:
    """A peer's answer (``TouchJournal.recent``) after store calls of ``keys`` at
    ``now`` each, in that order."""
    j = TouchJournal()
    for keys, now in calls:
        j.touched(keys, [PAGE] * len(keys), now)
    return dict(j.recent())


def test_runs_keep_each_calls_order_latest_call_first():
    old = [key(f"a{i}") for i in range(3)]
    new = [key(h) for h in ("z9", "b1", "q5")]  # a chain whose hashes sort otherwise
    view = journal((old, 1.0), (new, 2.0))
    assert warm_runs([view], WANTED, 10, 100) == [new, old]
    # CONTROL: the merged order alone (ties by key) puts the chain's later pages first
    assert [k for k, _ in hottest([view])][:3] != new


def test_a_budget_ending_inside_a_run_takes_its_leading_pages():
    chain = [key(f"{9 - i}h") for i in range(5)]  # keys sort against the chain's order
    other = [key("x0"), key("x1")]
    view = journal((other, 1.0), (chain, 2.0))
    assert warm_runs([view], WANTED, 3, 100) == [chain[:3]]
    assert warm_runs([view], WANTED, 6, 100) == [chain, other[:1]]
    assert warm_runs([view], WANTED, 0, 100) == []
    # CONTROL: taking the hottest keys in their merged order picks later pages of the
    # chain without its first one
    assert chain[0] not in [k for k, _ in hottest([view])][:3]


def test_views_of_several_peers_merge_each_object_once_at_its_latest_call():
    a, b, c = key("a"), key("b"), key("c")
    first = journal(([a, b], 1.0))
    second = journal(([c, a], 3.0))
    runs = warm_runs([first, second], WANTED, 10, 100)
    assert runs == [[c, a], [b]]
    assert sum(map(len, runs)) == 3


def test_only_the_ranks_objects_of_the_pools_size_count():
    mine = key("a")
    view = journal(([key("b", rank=1), "n_a_0_kv", mine, "m_c_0_k"], 1.0))
    view["m_big_0_kv"] = Touch(2.0, 1, 2 * PAGE)  # another page size: not this pool's
    assert warm_runs([view], WANTED, 10, 100) == [[mine]]
    # the default deployment (no prefix) never takes a tenant's keys
    default = rank_objects("", "_0_kv", PAGE)
    assert default("a_0_kv", Touch(1.0, 1, PAGE))
    assert not default("t1.x_0_kv", Touch(1.0, 1, PAGE))


def test_an_answer_cut_at_its_limit_leaves_its_oldest_run_out():
    """A peer answers its ``limit`` latest entries: the oldest run in a full answer may
    have lost its leading pages (a call's first keys are its oldest), so it is not
    taken. CONTROL: the same entries in an answer that was not full are taken."""
    chain = [key(f"c{i}") for i in range(4)]
    new = [key("n0")]
    j = TouchJournal()
    j.touched(chain, [PAGE] * 4, 1.0)
    j.touched(new, [PAGE], 2.0)
    cut = dict(j.recent(3))  # n0, c3, c2: the chain's head is cut off
    assert warm_runs([cut], WANTED, 10, 3) == [new]
    assert warm_runs([cut], WANTED, 10, 4) == [new, chain[2:]]  # CONTROL


def test_peers_asked_the_deployments_nodes_first_never_itself_at_most_most():
    nodes = ["n1", "n2", "n3", "n4", "me"]
    assert peers_to_ask(nodes, ["n4", "me", "gone", "n4"], "me", 16) == ["n4", "n1", "n2", "n3"]
    assert peers_to_ask(nodes, ["n3"], "me", 2) == ["n3", "n1"]
    assert peers_to_ask(["me"], [], "me", 16) == []
