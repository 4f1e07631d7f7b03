"""``raykv bench-gpu``'s steps on a real two-node cluster, with host tensors in place of
device ones (CI has no GPU): every page comes back byte for byte, and so does every vLLM
block, saved from each of vLLM's physical KV cache layouts and loaded into the next one
through the connector worker's L2 and store paths, and saved into L2 on and behind a
stand-in forward that writes the blocks; a get that reports success without moving
bytes, and an L2 load that does, are caught (controls)."""

from __future__ import annotations

import contextlib

import pytest
from raykv.cache_actors.rank.client import CacheClient
from raykv.controllers.pool_layout import KiB
from raykv.integrations.vllm.l2_blocks import L2Blocks
from raykv_lab.bench import gpu
from raykv_lab.bench.gpu import run_gpu_bench, start_gpu_bench_cluster
from raykv_lab.bench.gpu_vllm import LAYOUTS, VllmGeometry

# 2 layers, 2 KV heads of 8, 4-token blocks: 256 bytes per block
SMALL = VllmGeometry(layers=2, heads=2, head_size=8, block_size=4, blocks=8, moved=4,
                     window=4)


ROUNDS = 1


@pytest.fixture(scope="module")
def cluster():
    """The cluster ``run_gpu_bench`` starts for itself, started once for the module."""
    with start_gpu_bench_cluster(SMALL, ROUNDS) as c:
        yield c


def run(tmp_path, cluster) -> dict:
    return run_gpu_bench(page_sizes=[64 * KiB], batch=4, iters=1, out_dir=str(tmp_path),
                         device="cpu", vllm=SMALL, vllm_rounds=ROUNDS, cluster=cluster)


def test_bench_gpu_steps_round_trip(tmp_path, cluster):
    result = run(tmp_path, cluster)
    size = result["sizes"][0]
    assert size["batch_bytes"] == 4 * 64 * KiB and size["pool_pinned"] is False
    layouts = result["vllm_layouts"]["layouts"]
    assert list(layouts) == list(LAYOUTS)
    assert all(row["equal"] is True for row in layouts.values())
    assert [row["loaded_into"] for row in layouts.values()] == list(LAYOUTS)[1:] + ["LBHNC"]
    behind = result["vllm_layouts"]["saves_behind"]  # L2 saves on and behind the step
    assert behind["equal"] is True and len(behind["seconds"]["behind_done_s"]) == 1
    assert (tmp_path / "bench_gpu.json").exists()


def test_bench_gpu_runs_on_the_cluster_it_starts(tmp_path, monkeypatch, cluster):
    """Without a cluster given (``raykv bench-gpu``), the bench runs on the one it starts
    (here the module's, handed out by ``start_gpu_bench_cluster`` and left running)."""
    started = []

    def start(vllm, vllm_rounds, console=None):
        started.append((vllm, vllm_rounds))
        return contextlib.nullcontext(cluster)

    monkeypatch.setattr(gpu, "start_gpu_bench_cluster", start)
    result = run_gpu_bench(page_sizes=[64 * KiB], batch=4, iters=1, out_dir=str(tmp_path),
                           device="cpu", vllm=SMALL, vllm_rounds=ROUNDS)
    assert started == [(SMALL, ROUNDS)]
    assert all(row["equal"] is True for row in result["vllm_layouts"]["layouts"].values())


def test_bench_gpu_catches_a_get_that_moved_nothing(tmp_path, monkeypatch, cluster):
    monkeypatch.setattr(CacheClient, "batch_get_v1", lambda self, keys, idx: [True] * len(keys))
    with pytest.raises(RuntimeError, match="differ from the bytes sent"):
        run(tmp_path, cluster)


def test_bench_gpu_catches_an_l2_load_that_moved_nothing(tmp_path, monkeypatch, cluster):
    copy = L2Blocks._copy

    def saves_only(self, pool, pages, block_ids, *, to_pool):
        if to_pool:
            copy(self, pool, pages, block_ids, to_pool=to_pool)

    monkeypatch.setattr(L2Blocks, "_copy", saves_only)
    with pytest.raises(RuntimeError, match="l2: the blocks loaded differ"):
        run(tmp_path, cluster)
