"""raykv as SGLang's HiCache storage backend, driven by SGLang 0.5.23's own code.

The cluster (``start_local(num_nodes=2)``, real ``mooncake_master``) runs in this
process; SGLang lives in its own venv (``.ci/sglang-venv``), so each "SGLang server" is
``sglang_driver.py`` run by that venv's python: it joins this cluster's Ray with the GCS
address and namespace, is pinned to one node's cache actor, builds SGLang's real CPU host
pools and its ``HybridCacheController`` with ``storage_backend="dynamic"`` loading
``raykv.integrations.sglang.RayKVStore``, and drives backups and prefetches through
SGLang's own threads. Page bytes are a function of (seed, page hash, TP rank), so the
reader checks every byte it loaded.

Without the SGLang venv these tests fail (not skip): set RAYKV_SGLANG_PYTHON or run
``.ci/sglang-venv``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_driver.py")
SGLANG_PY = os.environ.get("RAYKV_SGLANG_PYTHON") or os.path.join(REPO, ".venv-sglang", "bin",
                                                                  "python")
PAGE = 16


def _require_sglang() -> None:
    if not os.path.exists(SGLANG_PY):
        pytest.fail(f"the SGLang venv is missing ({SGLANG_PY}): build it with "
                    "`.ci/sglang-venv` or point RAYKV_SGLANG_PYTHON at a python with "
                    "sglang==0.5.23 and raykv installed", pytrace=False)


def run_driver(tmp_path, cluster, node: int, scenarios: list, *, tp_rank: int = 0,
               tp_size: int = 1, gloo_port: int = 0, timeout: int = 420) -> dict:
    """Run one SGLang driver process on node ``node`` of ``cluster``; its JSON result."""
    import ray

    _require_sglang()
    spec = {"ray_address": ray.get_runtime_context().gcs_address,
            "namespace": cluster.namespace, "node_id": cluster.node_ids[node],
            "tp_rank": tp_rank, "tp_size": tp_size, "gloo_port": gloo_port,
            "scenarios": scenarios}
    path = tmp_path / f"spec-{node}-{tp_rank}-{os.urandom(3).hex()}.json"
    path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    proc = subprocess.run([SGLANG_PY, DRIVER, str(path)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(tmp_path))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"SGLang driver failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}",
                    pytrace=False)
    out = json.loads(lines[-1])
    out["stderr"] = proc.stderr
    return out


def _scenario(name, model, allocator, steps, model_name=None, **kw):
    return {"name": name, "model": model, "allocator": allocator,
            "model_name": model_name or f"org/{name}", "steps": steps, **kw}


@pytest.fixture(scope="module")
def cross_node(cluster, tmp_path_factory, request):
    """One SGLang "server" on node 0 backs up; one on node 1 prefetches (run once)."""
    tmp = tmp_path_factory.mktemp("sglang")
    uid = os.urandom(4).hex()
    hy = {"seed": f"hy-{uid}", "n_pages": 6, "pages": [0, 1, 2, 3, 5], "mamba": [2, 4, 6]}
    mooncake = {"master_server_address": cluster.master_address,
                "metadata_server": cluster.metadata_server, "local_hostname": "127.0.0.1",
                "protocol": "tcp", "global_segment_size": 0, "check_server": False}
    interop = f"org/interop-{uid}"
    writer = run_driver(tmp, cluster, 0, [
        # MHA: zero-copy on the writer (allocator shm), staged on the reader: byte identity
        # across both paths.
        _scenario("mha", "mha", "shm", [
            {"op": "write", "seed": f"mha-{uid}", "n_pages": 5},
            {"op": "stats"}], model_name=f"org/mha-{uid}"),
        _scenario("hybrid", "hybrid", "shm", [
            {"op": "write", **hy},
            {"op": "write", "seed": f"hy-nomamba-{uid}", "n_pages": 3},
            {"op": "stats"}], model_name=f"org/hybrid-{uid}"),
        _scenario("mla", "mla", "shm", [
            {"op": "write", "seed": f"mla-{uid}", "n_pages": 4},
            {"op": "stats"}], model_name=f"org/mla-{uid}"),
        # Interop, same master, same model: SGLang's MooncakeStore writes one prompt,
        # raykv the other; the reader swaps them.
        _scenario("interop-mooncake", "mha", "shm", [
            {"op": "write", "seed": f"by-mooncake-{uid}", "n_pages": 3}],
            model_name=interop, backend="mooncake", mooncake=mooncake),
        _scenario("interop-raykv", "mha", "shm", [
            {"op": "write", "seed": f"by-raykv-{uid}", "n_pages": 3}], model_name=interop),
    ])
    reader = run_driver(tmp, cluster, 1, [
        _scenario("interop-raykv", "mha", "shm", [
            {"op": "prefetch", "seed": f"by-mooncake-{uid}", "n_pages": 3}],
            model_name=interop),
        _scenario("interop-mooncake", "mha", "shm", [
            {"op": "prefetch", "seed": f"by-raykv-{uid}", "n_pages": 3},
            {"op": "prefetch", "seed": f"never-{uid}", "n_pages": 3}],
            model_name=interop, backend="mooncake", mooncake=mooncake),
        # Staged with 2 pages per direction: 5 pages load in 3 rounds.
        _scenario("mha", "mha", "default", [
            {"op": "prefetch", "seed": f"mha-{uid}", "n_pages": 5},
            {"op": "prefetch", "seed": f"mha-{uid}", "n_pages": 5, "rid": "again"},
            {"op": "prefetch", "seed": f"never-{uid}", "n_pages": 4},
            {"op": "stats"}], model_name=f"org/mha-{uid}", extra={"staging_pages": 2}),
        _scenario("hybrid", "hybrid", "shm", [
            {"op": "exists_v2", **hy},
            {"op": "prefetch", **hy},
            {"op": "exists_v2", "seed": f"hy-nomamba-{uid}", "n_pages": 3},
            {"op": "stats"}], model_name=f"org/hybrid-{uid}"),
        _scenario("mla", "mla", "shm", [
            {"op": "prefetch", "seed": f"mla-{uid}", "n_pages": 4},
            {"op": "stats"}], model_name=f"org/mla-{uid}"),
        # An unservable config: SGLang's attach fails with raykv's one clear error.
        _scenario("layer-first", "mha", "shm", [], layout="layer_first"),
        # Same model as "mla" but another tag: nothing is found (keys are tagged).
        _scenario("mla-tagged", "mla", "shm", [
            {"op": "prefetch", "seed": f"mla-{uid}", "n_pages": 4}],
            model_name=f"org/mla-{uid}", extra={"extra_backend_tag": "other"}),
    ])
    return writer["scenarios"], reader["scenarios"]


def _steps(scenario):
    for s in scenario["steps"]:
        assert "error" not in s, s
    return scenario["steps"]


def test_mha_written_on_node0_prefetched_on_node1(cross_node):
    writer, reader = cross_node
    w, r = writer["mha"], reader["mha"]
    assert w["backend"] == "RayKVStore" and r["backend"] == "RayKVStore"
    assert _steps(w)[0]["completed"] == [5 * PAGE]
    first, again, never, _ = _steps(r)
    assert first["hit_pages"] == 5 and first["loaded_pages"] == 5
    assert first["kv_match"] == [True] * 5          # control: zeros or other bytes fail
    assert again["hit_pages"] == 5 and all(again["kv_match"])
    assert never["hit_pages"] == 0 and never["loaded_pages"] == 0
    assert all(w["threads"].values()) and all(r["threads"].values())


def test_hybrid_mamba_trailing_pages_with_holes(cross_node):
    writer, reader = cross_node
    _steps(writer["hybrid"])
    ex, pre, nomamba, _ = _steps(reader["hybrid"])
    # KV pages 0-3 and 5 exist (4 is missing); Mamba states after 2, 4 and 6 pages.
    assert ex["rank_local_v1"] == 4
    assert ex["restorable"] == [0, 2, 4] and ex["kv_hit_pages"] == 4
    assert ex["extra"] == {"mamba": 1}
    assert pre["hit_pages"] == 4 and pre["loaded_pages"] == 4
    assert pre["kv_match"] == [True] * 4 and pre["mamba_match"] is True
    # Control: KV present, no Mamba state -> nothing restorable.
    assert nomamba["rank_local_v1"] == 3 and nomamba["kv_hit_pages"] == 0
    assert nomamba["restorable"] == [0]


def test_mla(cross_node):
    writer, reader = cross_node
    assert _steps(writer["mla"])[0]["completed"] == [4 * PAGE]
    pre = _steps(reader["mla"])[0]
    assert pre["hit_pages"] == 4 and pre["kv_match"] == [True] * 4
    tagged = _steps(reader["mla-tagged"])[0]
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
    assert _steps(writer["interop-mooncake"])[0]["completed"] == [3 * PAGE]
    assert _steps(writer["interop-raykv"])[0]["completed"] == [3 * PAGE]
    from_mooncake = _steps(reader["interop-raykv"])[0]
    assert from_mooncake["hit_pages"] == 3 and from_mooncake["kv_match"] == [True] * 3
    from_raykv, never = _steps(reader["interop-mooncake"])
    assert from_raykv["hit_pages"] == 3 and from_raykv["kv_match"] == [True] * 3
    assert never["hit_pages"] == 0


def test_zero_copy_registers_sglang_memfds(cross_node):
    writer, reader = cross_node
    st = _steps(writer["mha"])[-1]
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
    rst = _steps(reader["mha"])[-1]
    assert rst["pools"]["kv"]["zero_copy"] is False
    assert rst["counters"]["staged_bytes"] > 0
    staging = [m for m in reader["mha"]["warnings"] if "staging copy" in m]
    assert len(staging) == 1 and '"allocator": "shm"' in staging[0]
    # Mamba is always staged; hybrid KV is zero-copy.
    hst = _steps(reader["hybrid"])[-1]
    assert hst["pools"]["kv"]["zero_copy"] is True and hst["pools"]["mamba"]["zero_copy"] is False


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_tp2_ranks_report_identical_hits(cluster, tmp_path):
    """TP=2 over gloo (SGLang's own all-reduce): rank 0 backs up 5 pages, rank 1 only 3.
    raykv's group answer is 3 for both ranks before any all-reduce; SGLang loads 3."""
    uid = os.urandom(4).hex()
    port = _free_port()
    results: dict[int, dict] = {}

    def rank(r: int, pages: list[int]) -> None:
        results[r] = run_driver(tmp_path, cluster, r, [_scenario("tp2", "mha", "shm", [
            {"op": "write", "seed": f"tp-{uid}", "n_pages": 5, "pages": pages},
            {"op": "barrier"},
            {"op": "exists_v2", "seed": f"tp-{uid}", "n_pages": 5},
            {"op": "prefetch", "seed": f"tp-{uid}", "n_pages": 5}],
            model_name=f"org/tp2-{uid}")], tp_rank=r, tp_size=2, gloo_port=port)

    threads = [threading.Thread(target=rank, args=(0, [0, 1, 2, 3, 4])),
               threading.Thread(target=rank, args=(1, [0, 1, 2]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) == {0, 1}, "a rank's driver failed"
    ex0, ex1 = (_steps(results[r]["scenarios"]["tp2"])[2] for r in (0, 1))
    assert (ex0["rank_local_v1"], ex1["rank_local_v1"]) == (5, 3)   # the ranks differ
    assert ex0["group_v1"] == ex1["group_v1"] == 3                   # one group answer
    assert ex0["kv_hit_pages"] == ex1["kv_hit_pages"] == 3
    for r in (0, 1):
        pre = _steps(results[r]["scenarios"]["tp2"])[3]
        assert pre["hit_pages"] == 3 and pre["kv_match"] == [True] * 3


def test_node_actor_killed_mid_traffic(cluster, tmp_path):
    """Kill node 1's cache actor under SGLang: its threads live on, nothing wrong is
    loaded, failures are warnings, and requests hit again once Ray restarted it."""
    uid = os.urandom(4).hex()
    out = run_driver(tmp_path, cluster, 1, [_scenario("fault", "hybrid", "shm", [
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
    steps = sc["steps"]
    before, during, after = steps[1], steps[3], steps[8]
    for s in steps[:9]:
        assert "error" not in s, s
    assert steps[5]["waited_s"] is not None, "the node actor did not come back"
    assert before["hit_pages"] == 4 and all(before["kv_match"]), steps
    # Whatever was loaded during the outage is right (a miss is fine, wrong bytes never).
    assert all(during["kv_match"]) and during.get("mamba_match") in (None, True)
    assert after["hit_pages"] == 4 and after["kv_match"] == [True] * 4, steps
    assert after["mamba_match"] is True, steps
    assert all(sc["threads"].values()), sc["threads"]
    assert any("failed" in m for m in sc["warnings"]), sc["warnings"]
    assert steps[9]["pools"]["kv"]["zero_copy"] is True       # re-registered after restart


def test_missing_sglang_venv_fails_clearly(monkeypatch):
    """The tests above fail (never skip) without the SGLang venv, with what to run."""
    monkeypatch.setattr(sys.modules[__name__], "SGLANG_PY", "/nonexistent/python")
    with pytest.raises(pytest.fail.Exception, match="sglang-venv"):
        _require_sglang()
