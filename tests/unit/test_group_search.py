"""GroupSearch and ConfirmedPages (pure logic): the staged check gives exactly the
answer of a check of every object, asks the store only about what can change it, and
trusts a confirmation only while it is younger than its TTL."""

import random

import numpy as np
import pytest
from raykv.controllers.confirmed_pages import ConfirmedPages
from raykv.controllers.contract import PoolHitPolicy, PoolName, StorageConfig
from raykv.controllers.deployments import (
    DeploymentRegistry,
    PoolQuery,
    PoolSpec,
)
from raykv.controllers.families import group_families
from raykv.controllers.group_search import GroupSearch

from tests.unit.oracle import group_hits, group_objects

TRAIL = PoolHitPolicy.TRAILING_PAGES
KV_MHA = PoolSpec(PoolName.KV, "mha", ("k", "v"))
KV_MLA = PoolSpec(PoolName.KV, "mla", ("k",))
MAMBA = PoolSpec(PoolName.MAMBA, "mamba", ("temporal", "conv_0"))
IDX = PoolSpec(PoolName.INDEXER, "indexer", ("indexer",))
DRAFT = PoolSpec(PoolName.DRAFT, "mha", ("draft_k", "draft_v"))


def deployment(tp=2, pp=1, mla=False, pools=(MAMBA,)):
    reg = DeploymentRegistry()
    config = StorageConfig(tp_size=tp, pp_size=pp, is_mla_model=mla, model_name="org/m")
    return reg.register_rank(config, [KV_MLA if mla else KV_MHA, *pools], "n")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(search: GroupSearch, present: set[str], calls: list[list[str]], since=0.0):
    while search.result is None:
        calls.append(list(search.wanted))
        search.feed([1 if o in present else 0 for o in search.wanted], since)
    return search.result


SHAPES = [
    (deployment(), [PoolQuery(PoolName.MAMBA, TRAIL, 1)]),
    (deployment(tp=4, pp=2), [PoolQuery(PoolName.MAMBA, TRAIL, 2)]),
    (deployment(mla=True, pools=(MAMBA, IDX)),
     [PoolQuery(PoolName.MAMBA, TRAIL, 1), PoolQuery(PoolName.INDEXER)]),
    (deployment(pools=(DRAFT,)), [PoolQuery(PoolName.DRAFT)]),
    (deployment(tp=1, pools=()), []),
]


@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_staged_answer_equals_the_full_check(shape):
    dep, queries = SHAPES[shape]
    rng = random.Random(shape)
    for trial in range(300):
        hashes = [f"h{trial}-{i}" for i in range(rng.randint(1, 12))]
        every = group_objects(dep, hashes, queries)
        # Mostly present near the front, holes further back: every kind of answer.
        present = {o for i, o in enumerate(every.objects)
                   if rng.random() < (0.97 if hashes.index(o.split("_")[1]) < 4 else 0.7)}
        full = group_hits(every, queries, [int(o in present) for o in every.objects])
        calls: list[list[str]] = []
        confirmed = ConfirmedPages(0.0)
        staged = run(GroupSearch(group_families(dep, queries), hashes, confirmed, 0.0),
                     present, calls)
        assert staged == full
        at_once: list[list[str]] = []
        speculated = run(GroupSearch(group_families(dep, queries), hashes, confirmed, 0.0,
                                     speculate=True), present, at_once)
        assert speculated == full and len(at_once) == 1
        assert sorted(at_once[0]) == sorted(every.objects)
        asked = [o for c in calls for o in c]
        assert len(asked) == len(set(asked)) <= len(every.objects)
        assert set(asked) <= set(every.objects)


@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_answers_from_confirmations_equal_the_full_check(shape):
    """Queries sharing one ConfirmedPages (the store unchanged meanwhile), over random
    windows of the same pages, with and without the extra pools: every answer, whether
    from confirmations, from the store or from both, is the full check's."""
    dep, queries = SHAPES[shape]
    rng = random.Random(100 + shape)
    hashes = [f"h{i}" for i in range(16)]
    every = group_objects(dep, hashes, queries)
    present = {o for o in every.objects if rng.random() < 0.97}
    confirmed = ConfirmedPages(5.0)
    for trial in range(200):
        start = rng.randint(0, 8)
        keys = hashes[start:start + rng.randint(1, 8)]
        pools = queries if rng.random() < 0.7 else []
        objects = group_objects(dep, keys, pools).objects
        full = group_hits(group_objects(dep, keys, pools), pools,
                          [int(o in present) for o in objects])
        search = GroupSearch(group_families(dep, pools), keys, confirmed, 1.0 + trial * 1e-3)
        assert run(search, present, [], 1.0 + trial * 1e-3) == full, trial


def test_a_miss_on_page_zero_checks_no_trailing_objects():
    dep, queries = SHAPES[0]
    hashes = [f"p{i}" for i in range(8)]
    calls: list[list[str]] = []
    result = run(GroupSearch(group_families(dep, queries), hashes, ConfirmedPages(0.0), 0.0),
                 set(), calls)
    assert result.kv_hit_pages == 0 and result.restorable_prefix_pages == [0]
    # One call: page 0 of each rank's KV (2 ranks x k, v); the rest cannot matter.
    assert calls == [["org-m_p0_0_k", "org-m_p0_0_v", "org-m_p0_1_k", "org-m_p0_1_v"]]


def test_after_the_probe_everything_else_in_one_call():
    dep, queries = SHAPES[0]
    hashes = [f"p{i}" for i in range(8)]
    every = group_objects(dep, hashes, queries)
    present = {o for o in every.objects if not o.startswith("org-m_p5_")}
    calls: list[list[str]] = []
    result = run(GroupSearch(group_families(dep, queries), hashes, ConfirmedPages(0.0), 0.0),
                 present, calls)
    assert result.kv_hit_pages == 5
    assert len(calls) == 2 and {o.split("_")[1] for o in calls[0]} == {"p0"}
    assert sorted(calls[0] + calls[1]) == sorted(every.objects)  # each object once


def test_confirmed_pages_answer_without_the_store_until_the_ttl():
    dep, queries = SHAPES[1]
    group = group_families(dep, queries)
    hashes = [f"p{i}" for i in range(6)]
    present = set(group_objects(dep, hashes, queries).objects)
    clock = Clock()
    confirmed = ConfirmedPages(2.0, clock=clock)
    calls: list[list[str]] = []
    first = run(GroupSearch(group, hashes, confirmed, clock.now), present, calls, clock.now)
    assert first.kv_hit_pages == 6 and len(calls) == 2
    clock.now += 1.9
    again = GroupSearch(group, hashes, confirmed, clock.now)
    assert again.result == first and again.wanted == []       # no store call at all
    longer = GroupSearch(group, hashes + ["p6"], confirmed, clock.now)
    assert {o.split("_")[1] for o in longer.wanted} == {"p6"}  # only the new page
    clock.now += 0.2                                            # confirmations expired
    stale = GroupSearch(group, hashes, confirmed, clock.now)
    assert stale.wanted == [f"org-m_p0_{tp}_{pp}_{x}" for pp in range(2) for tp in range(4)
                            for x in "kv"]  # the probe: page 0 of every rank's KV


def test_only_whole_pages_are_confirmed_and_misses_never():
    dep, queries = SHAPES[0]
    group = group_families(dep, queries)
    hashes = ["a", "b"]
    confirmed = ConfirmedPages(5.0, clock=Clock())
    present = set(group_objects(dep, hashes, queries).objects) - {"org-m_b_1_v"}
    run(GroupSearch(group, hashes, confirmed, 100.0), present, [], 100.0)
    known = [[t > 100.0 for t in row]
             for row in confirmed.until([s.key for s in group.families], hashes, 100.0)]
    # Segments: KV rank 0, Mamba rank 0, KV rank 1, Mamba rank 1. Everything was checked
    # below rank 0's limit (2) and found, except rank 1's KV of page b (it lacks v).
    assert known == [[True, True], [True, True], [True, False], [True, True]]
    assert [t > 100.0 for t in confirmed.until([group.key], hashes, 100.0)[0]] == [True,
                                                                                    False]
    confirmed.forget()
    assert not any(t > 100.0 for row in confirmed.until([s.key for s in group.families],
                                                         hashes, 100.0) for t in row)


def test_generations_bound_memory_by_time():
    clock = Clock()
    confirmed = ConfirmedPages(1.0, clock=clock)
    for step in range(10):
        confirmed.confirm("s", [f"{step}-{i}" for i in range(100)], clock.now)
        confirmed.until(["s"], ["x"], clock.now)  # a lookup turns the generations
        clock.now += 0.5
    assert len(confirmed) <= 300
    last = clock.now - 0.5
    assert [t > last for t in confirmed.until(["s"], ["9-0", "8-0", "0-0"], last)[0]] == [
        True, True, False]


def test_disabled_remembers_nothing():
    confirmed = ConfirmedPages(0.0)
    confirmed.confirm("s", ["a"], 0.0)
    assert len(confirmed) == 0 and confirmed.until(["s"], ["a"], 0.0) == [[0.0]]


def test_unknown_pool_is_refused():
    dep, _ = SHAPES[0]
    with pytest.raises(ValueError, match="registered no 'indexer' pool"):
        group_families(dep, [PoolQuery(PoolName.INDEXER)])


def test_layout_shares_replicated_segments():
    dep, queries = SHAPES[2]
    group = group_families(dep, queries)
    # MLA KV and indexer once, Mamba per TP rank
    assert len(group.families) == 2 + 2
    assert np.array([s.window for s in group.families]).tolist().count(0) == 2


def test_a_whole_page_is_trusted_no_longer_than_its_oldest_confirmation():
    dep, queries = SHAPES[0]
    group = group_families(dep, queries)
    hashes = ["a", "b"]
    clock = Clock()
    confirmed = ConfirmedPages(2.0, clock=clock)
    present = set(group_objects(dep, hashes, queries).objects)
    kv_only = group_families(dep, [])
    run(GroupSearch(kv_only, hashes, confirmed, clock.now), present, [], clock.now)  # KV at 100
    clock.now = 101.5
    calls: list[list[str]] = []
    run(GroupSearch(group, hashes, confirmed, clock.now), present, calls, clock.now)
    assert all("temporal" in o or "conv" in o for c in calls for o in c)  # KV was known
    assert GroupSearch(group, hashes, confirmed, 101.9).wanted == []     # whole pages
    assert confirmed.until([group.key], hashes, 101.9) == [[102.0, 102.0]]
    clock.now = 102.1  # the KV confirmations ran out: checked again, Mamba still known
    again = GroupSearch(group, hashes, confirmed, clock.now)
    assert again.wanted and all(o.endswith(("_k", "_v")) for o in again.wanted)
    known = confirmed.until([s.key for s in group.families], hashes, clock.now)
    assert [min(row) > clock.now for row in known] == [s.window > 0 for s in group.families]


def test_first_page_present_follows_the_kv_not_the_hit():
    """KV everywhere but no Mamba state: nothing is restorable, yet page 0 was found
    (the probe did not settle the query), which is what the hit share learns from."""
    dep, queries = SHAPES[0]
    hashes = ["a", "b"]
    present = {o for o in group_objects(dep, hashes, queries).objects
               if o.endswith(("_k", "_v"))}
    search = GroupSearch(group_families(dep, queries), hashes, ConfirmedPages(0.0), 0.0)
    assert run(search, present, []).kv_hit_pages == 0 and search.first_page_present
    miss = GroupSearch(group_families(dep, queries), hashes, ConfirmedPages(0.0), 0.0)
    assert run(miss, set(), []).kv_hit_pages == 0 and not miss.first_page_present
