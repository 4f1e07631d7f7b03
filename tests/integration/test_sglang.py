"""raykv as SGLang's HiCache storage backend, driven by SGLang 0.5.23's own code.

The cluster (``start_local(num_nodes=2)``, real ``mooncake_master``) runs in this
process; SGLang lives in its own venv (``scripts/sglang-venv.sh``), so each "SGLang server" is
``sglang_driver.py`` run by that venv's python: it joins this cluster's Ray with the GCS
address and namespace, is pinned to one node actor, builds SGLang's real CPU host
pools and its ``HybridCacheController`` with ``storage_backend="dynamic"`` loading
``raykv.integrations.sglang.RayKVStore``, and drives backups and prefetches through
SGLang's own threads. Page bytes are a function of (seed, page hash, pool, TP rank), so
the reader checks every byte it loaded, and loads land in slots filled with noise first.

Pools through SGLang's own host pool classes: MHA and MLA KV, Mamba (``MambaPoolHost``),
SWA (an ``MHATokenToKVPoolHost`` of the SWA device pool, as ``build_hybrid_swa_group``
builds it), the DSA indexer (``DSAIndexerPoolHost`` over a ``DSATokenToKVPool``, 64-token
pages) and a draft model's KV (an ``MHATokenToKVPoolHost`` registered after attach as
``build_full_draft_pools`` + ``register_host_pool_entry`` do). Faults: the node actor
killed under SGLang, and SGLang's own ``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE``
injector around the backend. Interop with SGLang's built-in ``MooncakeStore`` on the same
master, TP=1 and TP=2, both directions. Standalone Mooncake mode: ``test_standalone.py``.

Without the SGLang venv these tests fail (skip only under ``RAYKV_NO_ENGINES=1``): set
RAYKV_SGLANG_PYTHON or run ``scripts/sglang-venv.sh``.
"""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from tests import engines
from tests.integration import sglang_runs
from tests.integration.sglang_runs import (
    DSA_PAGE,
    FAILURE_ENV,
    PAGE,
    free_port,
    mooncake_config,
    run_driver,
    scenario,
    steps,
)

pytestmark = pytest.mark.engine("sglang")

# Prompts of the fault scenarios (4 pages, Mamba state after page 4), and the failure
# probability SGLang's injector applies to every backend call.
FAULTY_PROMPTS = 8
FAILURE_P = "0.3"
# Tables of pages present (tests below): SWA windows of 2 pages.
SWA_HOLES = {"n_pages": 7, "pages": [2, 6], "swa": [2, 5]}
SWA_SHORT = {"n_pages": 5, "pages": [2, 3, 4], "swa": [2]}
DSA_HOLE = {"n_pages": 5, "side": [0, 1, 2, 4]}
DRAFT_HOLE = {"n_pages": 5, "side": [0, 1, 3, 4]}


@pytest.fixture(scope="module")
def cross_node(cluster, tmp_path_factory):
    """One SGLang "server" on node 0 backs up; one on node 1 prefetches (run once)."""
    tmp = tmp_path_factory.mktemp("sglang")
    uid = os.urandom(4).hex()
    hy = {"seed": f"hy-{uid}", "n_pages": 6, "pages": [0, 1, 2, 3, 5], "mamba": [2, 4, 6]}
    swa_holes = {"seed": f"swa-{uid}", **SWA_HOLES}
    swa_short = {"seed": f"swa-short-{uid}", **SWA_SHORT}
    dsa = {"seed": f"dsa-{uid}", **DSA_HOLE}
    draft = {"seed": f"draft-{uid}", **DRAFT_HOLE}
    faulty = [{"seed": f"faulty-{uid}-{i}", "n_pages": 4} for i in range(FAULTY_PROMPTS)]
    mooncake = mooncake_config(cluster)
    interop = f"org/interop-{uid}"
    injector = {"env": {FAILURE_ENV: FAILURE_P}}
    writer = run_driver(tmp, cluster, 0, [
        # MHA: zero-copy on the writer (allocator shm), staged on the reader: byte identity
        # across both paths.
        scenario("mha", "mha", "shm", [
            {"op": "write", "seed": f"mha-{uid}", "n_pages": 5},
            {"op": "stats"}], model_name=f"org/mha-{uid}"),
        scenario("hybrid", "hybrid", "shm", [
            {"op": "write", **hy},
            {"op": "write", "seed": f"hy-nomamba-{uid}", "n_pages": 3},
            {"op": "stats"}], model_name=f"org/hybrid-{uid}"),
        scenario("mla", "mla", "shm", [
            {"op": "write", "seed": f"mla-{uid}", "n_pages": 4},
            {"op": "stats"}], model_name=f"org/mla-{uid}"),
        scenario("swa", "swa", "shm", [
            {"op": "write", **swa_holes},
            {"op": "write", **swa_short},
            {"op": "write", "seed": f"swa-none-{uid}", "n_pages": 3},
            {"op": "stats"}], model_name=f"org/swa-{uid}"),
        scenario("dsa", "dsa", "shm", [
            {"op": "write", **dsa},
            {"op": "stats"}], model_name=f"org/dsa-{uid}"),
        scenario("draft", "draft", "shm", [
            {"op": "write", **draft},
            {"op": "stats"}], model_name=f"org/draft-{uid}"),
        # SGLang's fault injector fails ~30% of the backend calls of these backups.
        scenario("faulty", "hybrid", "shm", [
            {"op": "write", **p, "mamba": [4]} for p in faulty],
            model_name=f"org/faulty-{uid}", **injector),
        # Interop, same master, same model: SGLang's MooncakeStore writes one prompt,
        # raykv the other; the reader swaps them.
        scenario("interop-mooncake", "mha", "shm", [
            {"op": "write", "seed": f"by-mooncake-{uid}", "n_pages": 3}],
            model_name=interop, backend="mooncake", mooncake=mooncake),
        scenario("interop-raykv", "mha", "shm", [
            {"op": "write", "seed": f"by-raykv-{uid}", "n_pages": 3}], model_name=interop),
    ])
    reader = run_driver(tmp, cluster, 1, [
        scenario("interop-raykv", "mha", "shm", [
            {"op": "prefetch", "seed": f"by-mooncake-{uid}", "n_pages": 3}],
            model_name=interop),
        scenario("interop-mooncake", "mha", "shm", [
            {"op": "prefetch", "seed": f"by-raykv-{uid}", "n_pages": 3},
            {"op": "prefetch", "seed": f"never-{uid}", "n_pages": 3}],
            model_name=interop, backend="mooncake", mooncake=mooncake),
        # Staged with 2 pages per direction: 5 pages load in 3 rounds.
        scenario("mha", "mha", "default", [
            {"op": "prefetch", "seed": f"mha-{uid}", "n_pages": 5},
            {"op": "prefetch", "seed": f"mha-{uid}", "n_pages": 5, "rid": "again"},
            {"op": "prefetch", "seed": f"never-{uid}", "n_pages": 4},
            {"op": "stats"}], model_name=f"org/mha-{uid}", extra={"staging_pages": 2}),
        scenario("hybrid", "hybrid", "shm", [
            {"op": "exists_v2", **hy},
            {"op": "prefetch", **hy},
            {"op": "exists_v2", "seed": f"hy-nomamba-{uid}", "n_pages": 3},
            {"op": "stats"}], model_name=f"org/hybrid-{uid}"),
        scenario("mla", "mla", "shm", [
            {"op": "prefetch", "seed": f"mla-{uid}", "n_pages": 4},
            {"op": "stats"}], model_name=f"org/mla-{uid}"),
        scenario("swa", "swa", "shm", [
            {"op": "exists_v2", **swa_holes},
            {"op": "prefetch", **swa_holes},
            {"op": "exists_v2", **swa_short},
            {"op": "prefetch", **swa_short},
            {"op": "exists_v2", "seed": f"swa-none-{uid}", "n_pages": 3},
            {"op": "stats"}], model_name=f"org/swa-{uid}"),
        scenario("dsa", "dsa", "shm", [
            {"op": "exists_v2", **dsa},
            {"op": "prefetch", **dsa},
            {"op": "stats"}], model_name=f"org/dsa-{uid}"),
        scenario("draft", "draft", "shm", [
            {"op": "exists_v2", **draft},
            {"op": "prefetch", **draft},
            {"op": "stats"}], model_name=f"org/draft-{uid}"),
        scenario("faulty", "hybrid", "shm", [{"op": "prefetch", **p} for p in faulty],
                 model_name=f"org/faulty-{uid}", **injector),
        # The injector off again: backups complete what failed, every prompt hits again.
        scenario("recovered", "hybrid", "shm",
                 [{"op": "write", **p, "mamba": [4]} for p in faulty]
                 + [{"op": "prefetch", **p} for p in faulty], model_name=f"org/faulty-{uid}"),
        # An unservable config: SGLang's attach fails with raykv's one clear error.
        scenario("layer-first", "mha", "shm", [], layout="layer_first"),
        # Same model as "mla" but another tag: nothing is found (keys are tagged).
        scenario("mla-tagged", "mla", "shm", [
            {"op": "prefetch", "seed": f"mla-{uid}", "n_pages": 4}],
            model_name=f"org/mla-{uid}", extra={"extra_backend_tag": "other"}),
    ])
    return writer["scenarios"], reader["scenarios"]


def test_mha_written_on_node0_prefetched_on_node1(cross_node):
    writer, reader = cross_node
    w, r = writer["mha"], reader["mha"]
    assert w["backend"] == "RayKVStore" and r["backend"] == "RayKVStore"
    assert steps(w)[0]["completed"] == [5 * PAGE]
    first, again, never, _ = steps(r)
    assert first["hit_pages"] == 5 and first["loaded_pages"] == 5
    assert first["kv_match"] == [True] * 5          # control: noise or other bytes fail
    assert again["hit_pages"] == 5 and all(again["kv_match"])
    assert never["hit_pages"] == 0 and never["loaded_pages"] == 0
    assert all(w["threads"].values()) and all(r["threads"].values())


def test_hybrid_mamba_trailing_pages_with_holes(cross_node):
    writer, reader = cross_node
    steps(writer["hybrid"])
    ex, pre, nomamba, _ = steps(reader["hybrid"])
    # KV pages 0-3 and 5 exist (4 is missing); Mamba states after 2, 4 and 6 pages.
    assert ex["rank_local_v1"] == 4
    assert ex["restorable"] == [0, 2, 4] and ex["kv_hit_pages"] == 4
    assert ex["extra"] == {"mamba": 1}
    assert pre["hit_pages"] == 4 and pre["loaded_pages"] == 4
    assert pre["kv_match"] == [True] * 4 and pre["mamba_match"] is True
    # Control: KV present, no Mamba state -> nothing restorable.
    assert nomamba["rank_local_v1"] == 3 and nomamba["kv_hit_pages"] == 0
    assert nomamba["restorable"] == [0]


def test_swa_windows_through_sglang_swa_pool(cross_node):
    """SGLang's SWA host pool, 2-page windows. ``holes``: KV pages 0-4 and 6 (5 missing),
    SWA windows ending after 2 and 5 pages -> prefixes 1, 2 and 5 restorable, SGLang
    loads 5 KV pages and the SWA pages 3-4. ``short``: KV 0-4, one window ending after 2
    -> SGLang loads 2 pages (not the 5 KV pages). No SWA at all -> nothing."""
    writer, reader = cross_node
    w = steps(writer["swa"])
    assert w[0]["completed"] == [16, 16, 32, 32]        # KV runs [2], [6]; windows 0-1, 3-4
    assert w[0]["pool_results"][2:] == [{"swa": 2}, {"swa": 2}]
    ex, pre, ex_short, pre_short, ex_none, st = steps(reader["swa"])
    assert ex["rank_local_v1"] == 5
    assert ex["restorable"] == [0, 1, 2, 5] and ex["kv_hit_pages"] == 5
    assert ex["extra"] == {"swa": 2}
    assert pre["hit_pages"] == 5 and pre["loaded_pages"] == 5
    assert pre["restorable"] == [0, 1, 2, 5]
    assert pre["query_pool_hit_pages"] == {"kv": 5, "swa": 2}
    assert pre["kv_match"] == [True] * 5
    assert pre["pool_hits"]["swa"] == 2 and pre["swa_pages"] == [3, 4]
    assert pre["swa_match"] == [True, True]
    assert ex_short["rank_local_v1"] == 5 and ex_short["restorable"] == [0, 1, 2]
    assert pre_short["hit_pages"] == 2 and pre_short["loaded_pages"] == 2
    assert pre_short["restorable"] == [0, 1, 2]
    assert pre_short["query_pool_hit_pages"] == {"kv": 2, "swa": 2}
    assert pre_short["kv_match"] == [True] * 2
    assert pre_short["swa_pages"] == [0, 1] and pre_short["swa_match"] == [True, True]
    assert ex_none["rank_local_v1"] == 3 and ex_none["kv_hit_pages"] == 0
    assert st["pools"]["swa"]["zero_copy"] is True
    assert all(reader["swa"]["threads"].values())


def test_dsa_indexer_sidecar_through_sglang_dsa_pool(cross_node):
    """SGLang's DSAIndexerPoolHost as a KV sidecar (64-token MLA pages): KV pages 0-4,
    indexer pages 0-2 and 4 -> SGLang loads 3 pages, KV and indexer byte-identical."""
    writer, reader = cross_node
    w = steps(writer["dsa"])
    assert w[0]["completed"] == [3 * DSA_PAGE, DSA_PAGE, DSA_PAGE]
    assert w[0]["pool_results"] == [{"indexer": 3}, {}, {"indexer": 1}]
    ex, pre, st = steps(reader["dsa"])
    assert ex["rank_local_v1"] == 5 and ex["kv_hit_pages"] == 3
    assert ex["extra"] == {"indexer": 3}
    assert pre["hit_pages"] == 3 and pre["loaded_pages"] == 3
    assert pre["restorable"] == [0, 1, 2, 3]
    assert pre["query_pool_hit_pages"] == {"kv": 3, "indexer": 3}
    assert pre["kv_match"] == [True] * 3 and pre["side_match"] == [True] * 3
    assert st["pools"]["indexer"]["zero_copy"] is True
    assert all(reader["dsa"]["threads"].values())


def test_draft_sidecar_through_sglang_draft_pool(cross_node):
    """A draft model's MHA host pool registered after attach: SGLang backs it up through
    a dynamic backend (TP=1, MHA) and the missing draft page 2 caps the hit at 2."""
    writer, reader = cross_node
    w = steps(writer["draft"])
    assert w[0]["completed"] == [2 * PAGE, PAGE, 2 * PAGE]
    assert w[0]["pool_results"] == [{"draft": 2}, {}, {"draft": 2}]
    ex, pre, st = steps(reader["draft"])
    assert ex["rank_local_v1"] == 5 and ex["kv_hit_pages"] == 2
    assert ex["extra"] == {"draft": 2}
    assert pre["hit_pages"] == 2 and pre["loaded_pages"] == 2
    assert pre["restorable"] == [0, 1, 2]
    assert pre["query_pool_hit_pages"] == {"kv": 2, "draft": 2}
    assert pre["kv_match"] == [True] * 2 and pre["side_match"] == [True] * 2
    assert st["pools"]["draft"]["zero_copy"] is True
    assert all(reader["draft"]["threads"].values())


def test_random_backend_failures_never_load_wrong_bytes(cross_node):
    """SGLang's own fault injector fails ~30% of the backend's calls on both sides:
    SGLang's threads live on, every page it reports loaded is byte-identical, and with the
    injector off the prompts hit in full again."""
    writer, reader = cross_node
    w, r, rec = writer["faulty"], reader["faulty"], reader["recovered"]
    assert w["wrapper"] == r["wrapper"] == "HiCacheStorageFailureInjector"
    # ~50 calls at p = 0.3: no injected failure at all has a probability of ~1e-7.
    assert sum(w["injected"].values()) + sum(r["injected"].values()) > 0
    steps(w)
    served = []
    for pre in steps(r):
        assert pre["loaded_pages"] <= pre["hit_pages"] <= 4
        assert pre["kv_match"] == [True] * pre["loaded_pages"], pre
        assert pre["mamba_match"] in (None, True), pre
        served.append(pre["loaded_pages"] == 4 and pre["mamba_match"] is True)
    assert not all(served), "control: the injected failures cost some prompt its hit"
    assert all(w["threads"].values()) and all(r["threads"].values())
    assert rec["wrapper"] == "RayKVStore" and not rec["injected"]
    for pre in steps(rec)[FAULTY_PROMPTS:]:
        assert pre["hit_pages"] == 4 and pre["kv_match"] == [True] * 4, pre
        assert pre["mamba_match"] is True, pre


def test_mla(cross_node):
    writer, reader = cross_node
    assert steps(writer["mla"])[0]["completed"] == [4 * PAGE]
    pre = steps(reader["mla"])[0]
    assert pre["hit_pages"] == 4 and pre["kv_match"] == [True] * 4
    tagged = steps(reader["mla-tagged"])[0]
    assert tagged["hit_pages"] == 0


def test_unservable_config_fails_the_attach_clearly(cross_node):
    _, reader = cross_node
    err = reader["layer-first"]["attach_error"]
    assert "raykv cannot serve this SGLang HiCache config" in err and "layer_first" in err
    # Control: the same model in page_first attached and served (test_mha...).
    assert "attach_error" not in reader["mha"]


def test_interop_with_sglang_mooncake_store(cross_node):
    """SGLang's built-in MooncakeStore and raykv on one master read each other's pages."""
    writer, reader = cross_node
    assert writer["interop-mooncake"]["backend"] == "MooncakeStore"
    assert steps(writer["interop-mooncake"])[0]["completed"] == [3 * PAGE]
    assert steps(writer["interop-raykv"])[0]["completed"] == [3 * PAGE]
    from_mooncake = steps(reader["interop-raykv"])[0]
    assert from_mooncake["hit_pages"] == 3 and from_mooncake["kv_match"] == [True] * 3
    from_raykv, never = steps(reader["interop-mooncake"])
    assert from_raykv["hit_pages"] == 3 and from_raykv["kv_match"] == [True] * 3
    assert never["hit_pages"] == 0


def test_zero_copy_registers_sglang_memfds(cross_node):
    writer, reader = cross_node
    st = steps(writer["mha"])[-1]
    kv = st["pools"]["kv"]
    assert kv["zero_copy"] is True
    assert st["counters"].get("staged_bytes", 0) == 0
    pid, fd = kv["memfd"]
    fds = {(p, f): (link, size) for p, f, link, size in st["sglang_fds"]["kv"]}
    assert (pid, fd) in fds and fds[(pid, fd)][0].startswith("/memfd:sglang_host_pool_")
    # The node actor serves SGLang's memfd itself: a pool of exactly its layout's bytes.
    assert st["node_pools"][kv["raykv_pool"]]["bytes"] <= fds[(pid, fd)][1]
    assert not any("staging copy" in m for m in writer["mha"]["warnings"])
    # Control: the reader's default allocator is staged, with one warning naming the flag.
    rst = steps(reader["mha"])[-1]
    assert rst["pools"]["kv"]["zero_copy"] is False
    assert rst["counters"]["staged_bytes"] > 0
    staging = [m for m in reader["mha"]["warnings"] if "staging copy" in m]
    assert len(staging) == 1 and '"allocator": "shm"' in staging[0]
    # Mamba is always staged; hybrid KV is zero-copy.
    hst = steps(reader["hybrid"])[-1]
    assert hst["pools"]["kv"]["zero_copy"] is True and hst["pools"]["mamba"]["zero_copy"] is False


@pytest.fixture(scope="module")
def tp2(cluster, tmp_path_factory):
    """Two TP ranks over gloo, rank 0 on node 0 and rank 1 on node 1 (run once): the
    ranks back up different pages, then interop with SGLang's MooncakeStore at TP=2."""
    tmp = tmp_path_factory.mktemp("sglang-tp2")
    uid = os.urandom(4).hex()
    port = free_port()
    mooncake = mooncake_config(cluster)
    interop = f"org/interop-tp2-{uid}"
    results: dict[int, dict] = {}

    def rank(r: int, pages: list[int]) -> None:
        results[r] = run_driver(tmp, cluster, r, [
            scenario("tp2", "mha", "shm", [
                {"op": "write", "seed": f"tp-{uid}", "n_pages": 5, "pages": pages},
                {"op": "barrier"},
                {"op": "exists_v2", "seed": f"tp-{uid}", "n_pages": 5},
                {"op": "prefetch", "seed": f"tp-{uid}", "n_pages": 5}],
                model_name=f"org/tp2-{uid}"),
            scenario("mooncake-writes", "mha", "shm", [
                {"op": "write", "seed": f"by-mooncake-{uid}", "n_pages": 3}],
                model_name=interop, backend="mooncake", mooncake=mooncake),
            scenario("raykv-writes", "mha", "shm", [
                {"op": "write", "seed": f"by-raykv-{uid}", "n_pages": 3}],
                model_name=interop),
            scenario("raykv-reads", "mha", "shm", [
                {"op": "barrier"},
                {"op": "prefetch", "seed": f"by-mooncake-{uid}", "n_pages": 3}],
                model_name=interop),
            scenario("mooncake-reads", "mha", "shm", [
                {"op": "prefetch", "seed": f"by-raykv-{uid}", "n_pages": 3},
                {"op": "prefetch", "seed": f"never-{uid}", "n_pages": 3}],
                model_name=interop, backend="mooncake", mooncake=mooncake),
        ], tp_rank=r, tp_size=2, gloo_port=port)

    threads = [threading.Thread(target=rank, args=(0, [0, 1, 2, 3, 4])),
               threading.Thread(target=rank, args=(1, [0, 1, 2]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) == {0, 1}, "a rank's driver failed"
    return {r: results[r]["scenarios"] for r in (0, 1)}


def test_tp2_ranks_report_identical_hits(tp2):
    """TP=2 over gloo (SGLang's own all-reduce): rank 0 backs up 5 pages, rank 1 only 3.
    raykv's group answer is 3 for both ranks before any all-reduce; SGLang loads 3."""
    ex0, ex1 = (steps(tp2[r]["tp2"])[2] for r in (0, 1))
    assert (ex0["rank_local_v1"], ex1["rank_local_v1"]) == (5, 3)   # the ranks differ
    assert ex0["group_v1"] == ex1["group_v1"] == 3                   # one group answer
    assert ex0["kv_hit_pages"] == ex1["kv_hit_pages"] == 3
    for r in (0, 1):
        pre = steps(tp2[r]["tp2"])[3]
        assert pre["hit_pages"] == 3 and pre["kv_match"] == [True] * 3


def test_tp2_interop_with_sglang_mooncake_store(tp2):
    """MHA at TP=2: each rank's pages carry its TP rank in their keys; what SGLang's
    MooncakeStore wrote, raykv loads on both ranks, and the other way round (page bytes
    differ per rank, so a rank loading the other rank's object fails the check)."""
    for r in (0, 1):
        sc = tp2[r]
        assert sc["mooncake-writes"]["backend"] == "MooncakeStore"
        assert steps(sc["mooncake-writes"])[0]["completed"] == [3 * PAGE]
        assert steps(sc["raykv-writes"])[0]["completed"] == [3 * PAGE]
        from_mooncake = steps(sc["raykv-reads"])[1]
        assert from_mooncake["hit_pages"] == 3 and from_mooncake["kv_match"] == [True] * 3
        from_raykv, never = steps(sc["mooncake-reads"])
        assert from_raykv["hit_pages"] == 3 and from_raykv["kv_match"] == [True] * 3
        assert never["hit_pages"] == 0


def test_node_actor_killed_mid_traffic(cluster, tmp_path):
    """Kill node 1's node actor under SGLang: its threads live on, nothing wrong is
    loaded, failures are warnings, and requests hit again once Ray restarted it."""
    uid = os.urandom(4).hex()
    out = run_driver(tmp_path, cluster, 1, [scenario("fault", "hybrid", "shm", [
        {"op": "write", "seed": f"f1-{uid}", "n_pages": 4, "mamba": [4]},
        {"op": "prefetch", "seed": f"f1-{uid}", "n_pages": 4},
        {"op": "kill_node_actor"},
        {"op": "prefetch", "seed": f"f1-{uid}", "n_pages": 4, "rid": "during"},
        {"op": "write", "seed": f"f2-{uid}", "n_pages": 4, "mamba": [4]},
        {"op": "wait_healthy"},
        # Until the master expires the killed actor's Mooncake client (~10 s), it still
        # places new objects in that dead segment and those puts fail.
        {"op": "wait", "s": 15},
        {"op": "write", "seed": f"f3-{uid}", "n_pages": 4, "mamba": [4]},
        {"op": "prefetch", "seed": f"f3-{uid}", "n_pages": 4, "rid": "after"},
        {"op": "stats"}], model_name=f"org/fault-{uid}")])
    sc = out["scenarios"]["fault"]
    st = sc["steps"]
    before, during, after = st[1], st[3], st[8]
    for s in st[:9]:
        assert "error" not in s, s
    assert st[5]["waited_s"] is not None, "the node actor did not come back"
    assert before["hit_pages"] == 4 and all(before["kv_match"]), st
    # Whatever was loaded during the outage is right (a miss is fine, wrong bytes never).
    assert all(during["kv_match"]) and during.get("mamba_match") in (None, True)
    assert after["hit_pages"] == 4 and after["kv_match"] == [True] * 4, st
    assert after["mamba_match"] is True, st
    assert all(sc["threads"].values()), sc["threads"]
    assert any("failed" in m for m in sc["warnings"]), sc["warnings"]
    assert st[9]["pools"]["kv"]["zero_copy"] is True       # re-registered after restart


def test_missing_sglang_venv_fails_clearly(monkeypatch):
    """The tests above fail without the SGLang venv, with what to run; they skip only
    under ``RAYKV_NO_ENGINES=1`` (an environment set up without engines)."""
    monkeypatch.setattr(engines, "SGLANG_PY", "/nonexistent/python")
    monkeypatch.delenv(engines.NO_ENGINES, raising=False)
    with pytest.raises(pytest.fail.Exception, match="sglang-venv"):
        sglang_runs.require_sglang()
    monkeypatch.setenv(engines.NO_ENGINES, "1")
    with pytest.raises(pytest.skip.Exception, match="needs sglang"):
        sglang_runs.require_sglang()


def test_the_set_up_built_sglangs_hash_extension_where_its_processes_take_it(monkeypatch):
    """``scripts/sglang-venv.sh`` compiles SGLang's page-hash extension into the venv's
    ``torch_extensions``, and every SGLang process of the tests (and of ``raykv bench
    --engine sglang``) is pointed there (``sglang_env``): no test builds it again under
    another HOME (``.ci/run`` runs the tests under a fresh one; a build in the first test
    cost ~40 CPU-s), nor with another ninja than the set-up's. Control: an SGLang process
    loading it with this test's own ``PATH`` (the main venv's ninja first, as in an
    activated venv; the set-up built it with the system's before) compiled it again."""
    sglang_runs.require_sglang()
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    venv = os.path.dirname(os.path.dirname(sglang_runs.SGLANG_PY))
    folder = os.path.join(venv, "torch_extensions")
    env = sglang_runs.sglang_env(sglang_runs.SGLANG_PY)
    assert env["TORCH_EXTENSIONS_DIR"] == folder
    assert env["PATH"].split(os.pathsep)[0] == os.path.join(venv, "bin")
    built = os.path.join(folder, "hicache_hash_cpp", "hicache_hash_cpp.so")
    assert os.path.isfile(built)
    before = os.stat(built).st_mtime_ns
    load = subprocess.run(
        [sglang_runs.SGLANG_PY, "-W", "ignore", "-c",
         "from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module;"
         "_load_native_hash_module()"],
        env=os.environ | env, capture_output=True, text=True, timeout=300)
    assert load.returncode == 0, load.stderr[-3000:]
    assert os.stat(built).st_mtime_ns == before, "an SGLang process compiled it again"
