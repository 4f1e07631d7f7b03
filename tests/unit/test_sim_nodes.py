"""``raykv sim``'s disk tier and node changes (``lab.sim``: ``disk``, ``l3_store``,
``node_changes``, ``scaling``; pure, on small hand-made traces): disk hits appear only
when the working set passes memory; a node that leaves without a drain loses its
segment's objects, with a drain the moved ones stay, hottest first; a joining node's
warm-up gives it L2 hits that no warm-up does not."""

import dataclasses
import json
import random
from pathlib import Path

import pytest
from raykv_lab.sim.cluster import ClusterSim
from raykv_lab.sim.costs import Costs
from raykv_lab.sim.disk import DiskTier
from raykv_lab.sim.l3_store import L3Store
from raykv_lab.sim.layout import Layout
from raykv_lab.sim.scaling import Scaling, around
from raykv_lab.sim.trace import BLOCK_TOKENS, Request

# every speed so high that each request ends before the next one starts (the drain's
# rate stays the measured one)
FAST = Costs(prefill_tokens_per_s=1e18, l2_load_gbps=1e9, host_load_gbps=1e9,
             store_get_gbps=1e9, store_put_gbps=1e9, disk_get_gbps=1e9, l2_call_s=1e-12,
             store_call_s=1e-12, link_gbit=1e9)


def prompt(at: float, blocks: tuple[int, ...]) -> Request:
    return Request(at, len(blocks) * BLOCK_TOKENS, 1, blocks)


def two_passes(prompts: int, start2: float) -> list[Request]:
    """``prompts`` prompts of two blocks each, none sharing a block, one a second; then
    the same again from ``start2``."""
    first = [prompt(i, (2 * i, 2 * i + 1)) for i in range(prompts)]
    return first + [prompt(start2 + i, r.blocks) for i, r in enumerate(first)]


def run(layout: Layout, reqs: list[Request], scaling: Scaling | None = None,
        costs: Costs = FAST) -> ClusterSim:
    sim = ClusterSim(layout, costs, reqs, scaling)
    sim.run()
    return sim


# ---------------------------------------------------------------- the disk tier
def test_disk_hits_appear_only_when_the_working_set_passes_memory():
    """40 blocks through an L3 of 8: the second pass finds them on disk (l3_disk), not
    in memory. CONTROL: without a disk they are misses; with memory for all of them
    the disk serves nothing and the hit rate is the same as the disk's."""
    reqs = two_passes(20, 100.0)
    small = Layout(1, 1, 1, l3_blocks=8)
    on_disk = run(dataclasses.replace(small, disk_blocks=1000), reqs).tally.as_dict()
    no_disk = run(small, reqs).tally.as_dict()
    fits = run(dataclasses.replace(small, l3_blocks=100, disk_blocks=1000),
               reqs).tally.as_dict()
    assert on_disk["tiers_block"]["l3_disk"] > 0.4
    assert on_disk["block_hit_rate"] == fits["block_hit_rate"] == 0.5  # the second pass
    assert no_disk["tiers_block"]["l3_disk"] == 0 and no_disk["block_hit_rate"] < 0.1
    assert fits["tiers_block"]["l3_disk"] == 0 and fits["tiers_block"]["l3_own"] == 0.5


def test_a_full_disk_drops_its_oldest_writes_and_reads_do_not_reorder():
    disk = DiskTier([2, 0])
    disk.offload(0, "a")
    disk.offload(0, "b")
    assert disk.node_of("a") == 0  # a read: nothing changes
    disk.offload(0, "c")
    assert [disk.node_of(k) for k in "abc"] == [None, 0, 0]
    disk.offload(1, "d")  # CONTROL: a node without a disk keeps nothing
    assert disk.node_of("d") is None
    assert disk.stats() | {} == {"objects": 2, "capacity": 2, "offloaded": 3, "deleted": 1,
                                 "lost": 0}


def test_an_evicted_object_is_served_from_its_nodes_disk_and_stays_there():
    """Mooncake 0.3.13 leaves a disk-served object on disk; a put of it moves nothing.
    CONTROL: an object still in memory is served from memory."""
    now = [0.0]
    store = L3Store([2, 2], lambda: now[0], random.Random(0), lease_s=0.0,
                    disk=DiskTier([10, 10]))
    for k in "abcd":  # the fourth passes the watermark: the oldest, a, is evicted
        assert store.start_put(k, 1) is not None
        store.end_put(k)
        now[0] += 1
    assert store.in_memory("a") is None and store.segment_of("a") == 1
    assert store.lookup(["a", "c"]) == [(1, True), (0, False)]  # c fell back to 0
    assert store.in_memory("a") is None and store.start_put("a", 0) is None
    assert store.leading(["a", "c", "z"]) == 2


# ---------------------------------------------------------------- a node leaving
LEAVE_AT = 50.0


def leaving(drain: bool, deadline_s: float = 1000.0) -> tuple[ClusterSim, dict[int, int]]:
    """Three nodes of one engine; 30 prompts, node 2 leaves, the same 30 again: the run
    and, per prompt node 2 served before it left, the blocks the second pass found."""
    reqs = two_passes(30, 200.0)
    sim = run(Layout(3, 1, 1, l3_blocks=50), reqs,
              Scaling(remove_at=LEAVE_AT, leaving=2, drain=drain,
                      drain_deadline_s=deadline_s, window_s=200.0))
    on_two = [int(at) for at, node, *_ in sim.tally.log if node == 2 and at < LEAVE_AT]
    found = {int(at) - 200: hits for at, _, hits, *_ in sim.tally.log if at >= 200}
    return sim, {i: found[i] for i in on_two}


def test_a_node_leaving_without_a_drain_loses_its_objects_with_one_keeps_them():
    drained, found = leaving(drain=True)
    assert len(found) >= 2
    d = drained.stats()["scaling"]
    assert d["drain"]["candidates"] == d["drain"]["moved"] == 2 * len(found)
    assert d["lost"]["memory"] == 0 and d["removed"]["l2_pages_lost"] == 0
    assert set(found.values()) == {2}  # node 2's blocks served from the others
    assert d["removed"]["after"]["hit_rate"] == 1.0  # every block of the second pass
    # CONTROL: without a drain node 2's blocks are gone, and their requests miss
    lost, found = leaving(drain=False)
    gone = lost.stats()["scaling"]
    assert "drain" not in gone and gone["lost"]["memory"] == 2 * len(found)
    assert set(found.values()) == {0}
    assert gone["removed"]["after"]["hit_rate"] == pytest.approx(1 - len(found) / 30)
    assert lost.tally.requests_per_node[2] == drained.tally.requests_per_node[2] > 0


def test_a_drain_moves_the_hottest_first_until_its_deadline():
    """At the measured rate (16 objects of 1 MiB a second: a 64 MiB block in 4 s), a
    9 s deadline moves two blocks: those node 2 touched last (the last prompt it served,
    put together). CONTROL: the rest are left and lost."""
    sim, found = leaving(drain=True, deadline_s=9.0)
    d = sim.stats()["scaling"]["drain"]
    assert (d["moved"], d["left"], d["seconds"]) == (2, 2 * len(found) - 2, 9.0)
    last = max(found)
    assert found[last] == 2 and {n for i, n in found.items() if i != last} == {0}


# ---------------------------------------------------------------- a node joining
def joining(warm_pages: int) -> ClusterSim:
    """Two nodes of one engine serve 20 prompts of one 4-block prefix and a block of
    their own; a third node joins, then 40 more such prompts."""
    reqs = [prompt(i if i < 20 else 20 + i, (0, 1, 2, 3, 100 + i)) for i in range(60)]
    return run(Layout(2, 1, 1, l2_blocks=16, l3_blocks=100), reqs,
               Scaling(add_at=30.0, warm_pages=warm_pages, window_s=100.0))


def test_a_joining_nodes_warm_up_gives_it_l2_hits_that_none_does_not():
    warm = joining(8)
    first = next(s for s in warm.tally.log if s[1] == 2)
    report = warm.stats()["scaling"]
    assert report["warm"]["read"] == 8 and report["warm"]["stopped"] == "done"
    assert first[4] == 4  # its first request found the prefix in its L2
    # CONTROL: without a warm-up its first request reads the prefix from L3
    cold = joining(0)
    first = next(s for s in cold.tally.log if s[1] == 2)
    assert first[4] == 0 and first[2] == 4
    assert cold.stats()["scaling"]["warm"]["stopped"] == "off"
    assert report["added"]["node_after"]["l2_blocks"] > \
        cold.stats()["scaling"]["added"]["node_after"]["l2_blocks"]


def test_windows_count_the_requests_before_and_after():
    log = [(1.0, 0, 2, 4, 0), (5.0, 1, 1, 4, 1), (12.0, 1, 4, 4, 4)]
    out = around(log, 5.0, 10.0)
    assert out["before"]["hit_rate"] == 0.5 and out["after"]["hit_rate"] == 0.625
    assert out["after_vs_before"] == 1.25 and around(log, 5.0, 10.0, 0)["after"]["requests"] == 0
    assert out["timeline"] == [[-5.0, 0.5], [5.0, 0.625]]


def test_a_run_without_node_changes_reports_its_windows_only():
    reqs = two_passes(10, 20.0)
    sim = run(Layout(2, 1, 1, l3_blocks=50), reqs, Scaling(window_at=20.0, window_s=20.0))
    report = sim.stats()["scaling"]
    assert list(report) == ["window"]
    assert report["window"]["before"]["hit_rate"] == 0.0  # CONTROL: the first pass
    assert report["window"]["after"]["hit_rate"] == 1.0


@pytest.mark.parametrize("bad", [dict(remove_at=-1.0), dict(window_s=0.0),
                                 dict(warm_pages=-1), dict(drain_deadline_s=float("nan"))])
def test_scaling_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="scaling"):
        Scaling(**bad)


# ---------------------------------------------------------------- the recorded runs
DOCS = Path(__file__).resolve().parents[2] / "docs"


def pct(rate: float) -> str:
    return f"{100 * rate:.1f}"


def disk_rows(recorded: dict) -> list[str]:
    """The rows benchmarks.md's disk tier table has of ``recorded`` (sim_disk.json)."""
    rows = []
    for trace, variants in recorded["by_trace"].items():
        for variant, result in variants.items():
            for name, r in result["runs"].items():
                tb, t = r["tiers_block"], r["ttft_s"]
                disk = r["counters"]["l3"].get("disk", {})
                rows.append(
                    f"| {trace} | {variant} | {name} | {pct(r['block_hit_rate'])} | "
                    + " | ".join(pct(tb[k]) for k in ("gpu", "l2", "l3_own", "l3_remote",
                                                      "l3_disk"))
                    + f" | {t['p50']:.2f} / {t['p90']:.2f} / {t['p99']:.2f} | "
                    f"{r['network_bytes'] / 1e9:,.0f} | {disk.get('offloaded', '-')} / "
                    f"{disk.get('deleted', '-')} |")
    return rows


def change_rows(recorded: dict) -> list[str]:
    """The rows benchmarks.md's node changes table has of ``recorded``
    (sim_node_changes.json)."""
    rows = []
    for trace, modes in recorded["by_trace"].items():
        for mode, result in modes.items():
            r = result["runs"]["raykv"]
            sc = r["counters"]["scaling"]
            w = sc.get("window") or sc.get("removed") or sc.get("added")
            d = sc.get("drain")
            moved = f"{d['moved']} of {d['candidates']} ({d['dropped']} no room, " \
                f"{d['evicted']} evicted, {d['failed']} target full, {d['left']} left)" \
                if d else "-"
            gone = f"{sc['removed']['gone_at']:g}" if "removed" in sc else "-"
            warm = sc.get("warm")
            node = sc["added"]["node_after"] if "added" in sc else None
            joined = f"{warm['read']} read; {node['requests']} requests, " \
                f"{node['l2_blocks']} L2 blocks" if warm else "-"
            rows.append(f"| {trace} | {mode} | {pct(r['block_hit_rate'])} | "
                        + " / ".join(pct(h) for _, h in w["timeline"])
                        + f" | {gone} | {moved} | {sc.get('lost', {}).get('memory', '-')} | "
                        f"{joined} |")
    return rows


def test_benchmarks_md_quotes_the_recorded_sim_runs():
    text = " ".join((DOCS / "benchmarks.md").read_text().split())
    for name, rows in (("sim_disk.json", disk_rows), ("sim_node_changes.json", change_rows)):
        recorded = json.loads((DOCS / name).read_text())
        assert [row for row in rows(recorded) if row not in text] == [], name
    # CONTROL: another run's figures (one hit rate changed) are caught
    other = json.loads((DOCS / "sim_disk.json").read_text())
    other["by_trace"]["synthetic"]["disk_4M"]["runs"]["raykv"]["block_hit_rate"] += 0.01
    assert any(row not in text for row in disk_rows(other))
