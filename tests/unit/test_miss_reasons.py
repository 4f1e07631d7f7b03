"""``raykv why``'s pure parts: the reasons per block (``controllers.miss_reasons``), the
L2 eviction record (``cache_actors.node.l2_evictions``), the deployment pick and the
page hashes of ``clusters.why`` (no Ray is started)."""

import pytest
from raykv.cache_actors.node.l2_evictions import L2Evictions
from raykv.clusters.why import page_hashes, pick, render
from raykv.controllers.deployments import Deployment
from raykv.controllers.load_guard import GuardSettings, LoadRun
from raykv.controllers.miss_reasons import (
    AFTER_GAP,
    EVICTED_L2,
    EVICTED_L3,
    NEVER_SAVED,
    OTHER_IDENTITY,
    SKIPPED_BY_GUARD,
    NodeFacts,
    OtherHolding,
    covered,
    explain,
    guard_view,
    load_runs,
)
from raykv.controllers.node_records import L2EvictionStats, StatsFailed

from tests.unit.fakes import node_stats

KEYS = ["a0", "a1", "b0", "b1", "c0", "c1", "d0", "d1"]  # 4 pages of 2 objects
HASHES = ["ha", "hb", "hc", "hd"]


def reasons(block) -> list[str]:
    return [r for r, _ in block.reasons]


def test_each_block_gets_its_tier_or_its_reason():
    store = NodeFacts("n1" * 8, l2=[True, True, False, False, False, False, False, False],
                      evicted={"b1": 90.0, "a0": 80.0}, touched={"c0": 50.0},
                      segments=[["s1"], ["s1"], ["s2"], ["s2"], [], [], [], []],
                      stored=[True, True, True, True, False, False, False, False])
    other = NodeFacts("n2" * 8, l2=[False] * 8, evicted={"d0": 95.0})
    theirs = OtherHolding("dep-bf16", ["kv_dtype='float16' (theirs: 'bfloat16')"],
                          [False, False, False, True])
    a, b, c, d = explain(HASHES, KEYS, 2, [store, other], [theirs], now=100.0)
    assert a.held == {"l2": [store.node_id], "l3": ["s1"]} and a.nearest == "l2"
    assert a.reasons == []
    assert b.held == {"l3": ["s2"]} and b.nearest == "l3"  # why no L2 hit:
    assert reasons(b) == [EVICTED_L2] and "10.0 s ago" in b.reasons[0][1]
    assert c.held == {} and reasons(c) == [EVICTED_L3]
    assert "50.0 s ago" in c.reasons[0][1]
    assert reasons(d) == [EVICTED_L2, OTHER_IDENTITY]
    assert "n2n2n2n2n2n2" in d.reasons[0][1] and "kv_dtype" in d.reasons[1][1]


def test_a_block_no_record_names_is_never_saved_and_one_after_a_gap_is_marked():
    facts = NodeFacts("n", l2=[False, False, False, False, True, True, False, False],
                      stored=[False] * 4 + [True, True, False, False],
                      segments=[[], [], [], [], [], [], [], []])
    a, b, c, d = explain(HASHES, KEYS, 2, [facts], [], now=0.0)
    assert reasons(a) == [NEVER_SAVED] and reasons(b) == [NEVER_SAVED]
    # held on L2 and in the store on no memory segment (disk), but after a gap
    assert c.held == {"l2": ["n"], "l3_disk": []} and reasons(c) == [AFTER_GAP]
    assert reasons(d) == [NEVER_SAVED]


def test_a_page_is_held_only_if_every_object_of_it_is():
    facts = NodeFacts("n", l2=[True, False] + [False] * 6, evicted={"a1": 1.0})
    (a, *_) = explain(HASHES, KEYS, 2, [facts], [], now=2.0)
    assert a.held == {} and reasons(a) == [EVICTED_L2]


def test_covered_maps_blocks_of_another_page_size():
    assert covered(4, 3, 4, [True, False, True]) == [True, False, True]
    # their blocks of 8 tokens: our blocks 0 and 1 lie in their block 0
    assert covered(4, 4, 8, [True, False]) == [True, True, False, False]
    # their blocks of 2 tokens: our block 0 needs their 0 and 1
    assert covered(4, 2, 2, [True, False, True, True]) == [False, True]
    assert covered(4, 2, 4, [True]) == [True, False]  # they hold fewer blocks


def test_load_runs_take_the_engine_nodes_l2_else_the_store_and_stop_at_a_gap():
    facts = NodeFacts("me", l2=[True, True, False, False, True, True, True, True],
                      stored=[False, False, True, True, True, True, True, True],
                      segments=[[], [], ["s"], ["s"], ["s"], ["s"], ["s"], ["s"]])
    other = NodeFacts("peer", l2=[False, False, True, True, False, False, False, False])
    blocks = explain(HASHES, KEYS, 2, [facts, other], [], now=0.0)
    assert load_runs(blocks, "me") == [LoadRun("l2", 1), LoadRun("l3", 1),
                                       LoadRun("l2", 2)]
    # block 0 is in "me"'s L2 alone: an engine on "peer" loads nothing (a gap first)
    assert load_runs(blocks, "peer") == []


def test_the_guard_marks_the_blocks_it_would_skip_with_both_estimates():
    facts = NodeFacts("me", l2=[True] * 8)
    blocks = explain(HASHES, KEYS, 2, [facts], [], now=0.0)
    runs = [LoadRun("l2", 1, 0.001), LoadRun("l3", 3, 10.0)]
    choice = guard_view(blocks, runs, 16, 1000.0, GuardSettings.parse("auto"))
    assert choice.pages == 1
    assert [reasons(b) for b in blocks] == [[], [SKIPPED_BY_GUARD]] + [[SKIPPED_BY_GUARD]] * 2
    assert "ms" in blocks[1].reasons[0][1]
    # control: a fast store is loaded in full
    blocks = explain(HASHES, KEYS, 2, [facts], [], now=0.0)
    fast = [LoadRun("l2", 1, 0.001), LoadRun("l3", 3, 0.001)]
    assert guard_view(blocks, fast, 16, 1000.0, GuardSettings.parse("auto")).pages == 4
    assert all(b.reasons == [] for b in blocks)
    # no estimate: nothing says it is slow; a threshold skips a short hit without one
    blocks = explain(HASHES, KEYS, 2, [facts], [], now=0.0)
    assert guard_view(blocks, [LoadRun("l2", 4)], 16, 1000.0,
                      GuardSettings.parse("auto")).pages == 4
    choice = guard_view(blocks, [LoadRun("l2", 4)], 16, 1000.0, GuardSettings.parse(100))
    assert choice.pages == 0 and "no estimate" in blocks[0].reasons[0][1]


def test_the_eviction_record_is_a_bounded_lru():
    rec = L2Evictions(capacity=2)
    rec.record("a", 1.0)
    rec.record("b", 2.0)
    rec.record("a", 3.0)  # again: the newest
    rec.record("c", 4.0)  # b, the oldest, is forgotten
    assert rec.of(["a", "b", "c", "x"]) == {"a": 3.0, "c": 4.0}
    assert rec.stats() == L2EvictionStats(evictions=4, kept=2)
    with pytest.raises(ValueError):
        L2Evictions(capacity=0)


def _dep(dep_id: str, model: str, tenant: str | None = None) -> Deployment:
    return Deployment(dep_id, model, None, 1, 1, False, tenant=tenant, page_size=4)


def test_pick_names_one_deployment_or_lists_them():
    deps = {d.deployment_id: d for d in (_dep("m-a_", "m/a"), _dep("x_m-b_", "m/b"),
                                        _dep("y_m-b_", "m/b"))}
    assert pick(deps, "m/a").deployment_id == "m-a_"
    assert pick(deps, "x_m-b_").deployment_id == "x_m-b_"
    with pytest.raises(ValueError, match="names 2 deployments.*m-a_"):
        pick(deps, "m/b")
    with pytest.raises(ValueError, match="no deployment 'zz'.*Registered: m-a_"):
        pick(deps, "zz")
    with pytest.raises(ValueError, match="give --deployment"):
        pick(deps, None)
    assert pick({"m-a_": deps["m-a_"]}, None).deployment_id == "m-a_"


def test_page_hashes_are_the_engines():
    from raykv.example_engine.page_hashes import page_hashes as example
    from raykv.integrations.vllm.page_hash import page_hash

    tokens = list(range(10))
    assert page_hashes("example", tokens, 4) == example(tokens, 4)
    first = page_hash(None, tokens[:4], None)  # the connector's blocks, chained
    assert page_hashes("vllm", tokens, 4) == [first.hex(),
                                              page_hash(first, tokens[4:8], None).hex()]
    with pytest.raises(ValueError, match="supported"):
        page_hashes("sglang", tokens, 4)


def test_render_groups_runs_of_one_answer():
    report = {"deployment": "d_", "model": "m", "tenant": None, "page_size": 4,
              "hashes": "vllm", "tokens": 12, "blocks_in_prompt": 3, "nodes": [],
              "failed_nodes": {"f" * 20: "timed out"}, "not_checked": ["t1.x"],
              "guard": None,
              "blocks": [{"index": i, "page_hash": "h", "tier": None,
                          "held": {"l2": ["n" * 20]} if i < 2 else {},
                          "reasons": [] if i < 2 else [[NEVER_SAVED, "no record"]]}
                         for i in range(3)]}
    lines = render(report)
    assert lines[1] == "  blocks 0-1: held in l2 on node nnnnnnnnnnnn"
    assert lines[2] == "  block 2: missing (never_saved: no record)"
    assert lines[3] == "  node ffffffffffff did not answer: timed out"
    assert "1 other deployment(s)" in lines[4]


def test_status_shows_a_nodes_l2_evictions_once_there_are_some():
    from raykv.clusters.status_view import evictions_line

    line = evictions_line("abcdef0123", node_stats(l2_evictions=L2EvictionStats(7, 5)))
    assert line == ("node abcdef01: L2 evicted 7 objects since start; the last 5 "
                    "remembered (raykv why names them)")
    assert evictions_line("n", node_stats()) is None
    assert evictions_line("n", StatsFailed("gone")) is None


def test_the_prompt_comes_from_exactly_one_input(tmp_path):
    import click
    from raykv.clusters.cli import _prompt_ids

    assert _prompt_ids("1, 2,3", None, None, None) == [1, 2, 3]
    path = tmp_path / "prompt.txt"
    path.write_text("4 5\n6,7\n")
    assert _prompt_ids(None, str(path), None, None) == [4, 5, 6, 7]
    for bad in (("1", str(path), None, None), (None, None, None, None),
                (None, None, "hi", None), ("1,x", None, None, None)):
        with pytest.raises(click.UsageError):
            _prompt_ids(*bad)


@pytest.mark.engine("transformers")
def test_text_is_encoded_by_the_tokenizer_named(tmp_path):
    from raykv.clusters.cli import _prompt_ids
    from raykv_lab.engines.vllm_model import make_llama
    from transformers import AutoTokenizer

    model = make_llama(str(tmp_path / "tiny-llama"))
    ids = _prompt_ids(None, None, "why did this miss?", model)
    assert ids == AutoTokenizer.from_pretrained(model).encode("why did this miss?")
    assert len(ids) > 3
