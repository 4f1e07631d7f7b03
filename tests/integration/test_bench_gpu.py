"""``raykv bench-gpu``'s steps on a real two-node cluster, with host tensors in place of
device ones (CI has no GPU): every page and vLLM-layout block comes back byte for byte,
and a get that reports success without moving bytes is caught (control)."""

from __future__ import annotations

import pytest
from raykv.cache_actors.rank.client import CacheClient
from raykv.clusters.bench.gpu import VLLM_BLOCKS, run_gpu_bench
from raykv.controllers.pool_layout import KiB


def test_bench_gpu_steps_round_trip(tmp_path):
    result = run_gpu_bench(page_sizes=[64 * KiB], batch=4, iters=1, out_dir=str(tmp_path),
                           device="cpu")
    size = result["sizes"][0]
    assert size["batch_bytes"] == 4 * 64 * KiB and size["pool_pinned"] is False
    vllm = result["vllm_layout"]
    assert vllm["saved"] == vllm["loaded"] == VLLM_BLOCKS // 2 and vllm["equal"] is True
    assert (tmp_path / "bench_gpu.json").exists()


def test_bench_gpu_catches_a_get_that_moved_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(CacheClient, "batch_get_v1", lambda self, keys, idx: [True] * len(keys))
    with pytest.raises(RuntimeError, match="differ from the bytes sent"):
        run_gpu_bench(page_sizes=[64 * KiB], batch=4, iters=1, out_dir=str(tmp_path),
                      device="cpu")
