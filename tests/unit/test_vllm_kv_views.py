"""vLLM's per-layer KV cache views: the block axis by vLLM's contract, not by a size
match."""

from __future__ import annotations

import pytest
import torch
from raykv.integrations.vllm.kv_views import block_views, kernel_split


def test_blocks_first_view_is_taken_as_it_is():
    t = torch.arange(3 * 2 * 8 * 4).view(3, 2, 8, 4)
    (v,) = block_views([t], 3, 8)
    assert v is t


def test_kernel_blocks_are_grouped_per_block_over_a_strided_view():
    """A layout whose physical order is not the logical one (heads inside tokens) and a
    block split in two kernel blocks: block 1 is kernel blocks 2 and 3."""
    physical = torch.arange(6 * 4 * 2 * 3).view(6, 4, 2, 3)  # [B, N, H, C] in memory
    logical = physical.permute(0, 2, 1, 3)  # vLLM's [B, H, N, C] view of it
    assert kernel_split(logical.shape, 3, 8) == 2
    (v,) = block_views([logical], 3, 8)
    assert v.shape == (3, 2, 2, 4, 3)
    assert torch.equal(v[1], logical[2:4])


@pytest.mark.parametrize("shape", [(2, 4, 16, 2, 8),  # a 5-D [2, B, N, H, D] tensor
                                   (4, 2, 7, 8),  # tokens that make no block
                                   (5, 2, 8, 8)])  # blocks that are no multiple
def test_other_shapes_are_refused(shape):
    with pytest.raises(ValueError, match="RayKVConnector"):
        kernel_split(shape, 2, 8)


def test_control_a_size_match_takes_the_wrong_axis():
    """The old rule (the first dimension equal to the block count) picks the K/V axis of
    a ``(2, blocks, ...)`` tensor with 2 blocks; the contract does not need it."""
    shape = (2, 2, 8, 4)  # [B=2, H=2, N=8, C=4] by the contract
    assert [d for d, n in enumerate(shape) if n == 2] == [0, 1]  # ambiguous by size
    assert kernel_split(shape, 2, 8) == 1


def test_block_geometry_gives_the_workers_bytes_per_page():
    """vLLM's CPU spec of the tests' tiny model: 2 KV heads of 64, K and V of 128
    tokens, bf16: 64 KiB per block and layer, four layers: the page of the workers' pool
    (``(heads, block_size, 2 * head_size)`` per layer)."""
    from types import SimpleNamespace

    from raykv.controllers.pool_layout import PoolLayout
    from raykv.integrations.vllm.kv_views import block_geometry

    spec = SimpleNamespace(block_size=128, num_kv_heads=2, page_size_bytes=64 << 10,
                           dtype=torch.bfloat16)
    geometry = block_geometry(spec, 4)
    assert geometry == {"page_size": 128, "layer_num": 4, "head_num": 2, "head_dim": 128,
                        "dtype": "bfloat16", "itemsize": 2}
    scheduler = PoolLayout.vllm(size=128, **geometry)
    worker = PoolLayout.vllm(page_size=128, size=128, layer_num=4, head_num=2, head_dim=128,
                             dtype="bfloat16", itemsize=2)
    assert scheduler.object_sizes == worker.object_sizes == [256 << 10]
    with pytest.raises(ValueError, match="no whole number"):
        block_geometry(SimpleNamespace(block_size=128, num_kv_heads=3, page_size_bytes=1000,
                                       dtype=torch.bfloat16), 4)
