"""``page_copies``: the gathered copy (whole pages through one buffer, what a device KV
cache takes) moves the same bytes as one copy per layer, for vLLM's physical layouts,
both ways, in pieces; views that are not whole pages side by side are never gathered."""

from __future__ import annotations

import pytest
import torch
from raykv.cache_actors.rank import page_copies
from raykv.cache_actors.rank.page_copies import copy_runs, page_major
from raykv.integrations.vllm.kv_views import block_views, pool_block_views

L, B, H, N, C = 3, 6, 2, 4, 8  # layers, blocks, heads, tokens per block, content
ORDERS = [(0, 1, 2, 3, 4), (0, 1, 3, 2, 4), (0, 2, 1, 3, 4), (1, 0, 3, 2, 4), (1, 2, 0, 3, 4)]
RUNS = [(0, 2, 2), (3, 0, 1), (4, 5, 2)]  # (engine block, pool page, n)


def engine_blocks(order: tuple[int, ...]) -> list[torch.Tensor]:
    """A KV cache in the physical layout ``order`` of [L, B, H, N, C], as vLLM hands its
    per-layer [B, H, N, C] views over, with random values."""
    raw = torch.randn([(L, B, H, N, C)[i] for i in order]).to(torch.bfloat16)
    view = raw.permute([order.index(i) for i in range(5)])
    return block_views([view[i] for i in range(L)], B, N)


def pool_pages() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A raykv vLLM pool's buffer (pages, layers, heads, tokens, content) and its
    per-layer page views."""
    buf = torch.zeros((8, L, H, N, C), dtype=torch.bfloat16)
    return buf, pool_block_views(buf, (H, N, C))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("piece_bytes", [1, 1 << 20])  # a page per piece; a run per piece
def test_gathered_copies_move_what_per_layer_copies_move(order, piece_bytes, monkeypatch):
    monkeypatch.setattr(page_copies, "DEVICE_STAGE_BYTES", piece_bytes)
    engine = engine_blocks(order)
    plain_buf, plain = pool_pages()
    gathered_buf, gathered = pool_pages()
    copy_runs(engine, plain, RUNS, to_pool=True, gather=False)
    copy_runs(engine, gathered, RUNS, to_pool=True, gather=True)
    assert torch.equal(plain_buf, gathered_buf)
    for e0, s0, n in RUNS:  # control: the pages hold the engine's blocks, layer by layer
        for layer in range(L):
            assert torch.equal(gathered_buf[s0:s0 + n, layer], engine[layer][e0:e0 + n])
    torch.manual_seed(1)
    back_plain = engine_blocks(order)
    torch.manual_seed(1)
    back_gathered = engine_blocks(order)  # the same values: blocks no run names stay equal
    copy_runs(back_plain, plain, RUNS, to_pool=False, gather=False)
    copy_runs(back_gathered, gathered, RUNS, to_pool=False, gather=True)
    for a, b, src in zip(back_plain, back_gathered, engine, strict=True):
        assert torch.equal(a, b)
        for e0, _, n in RUNS:
            assert torch.equal(b[e0:e0 + n], src[e0:e0 + n])


def test_page_major_sees_whole_pages_side_by_side_only():
    buf, views = pool_pages()
    whole = page_major(views)
    assert whole is not None and whole.shape == (8, L * H * N * C)
    assert whole.data_ptr() == buf.data_ptr()
    assert page_major(views[::-1]) is None  # layers out of order
    assert page_major([torch.zeros(8, 5) for _ in range(L)]) is None  # separate buffers
    assert page_major([v[:, :, :2] for v in views]) is None  # part of each layer's block


def test_host_engines_copy_per_layer_by_default(monkeypatch):
    def fail(*args):
        raise AssertionError("gathered a host engine's copy")

    monkeypatch.setattr(page_copies, "_gathered", fail)
    _, views = pool_pages()
    copy_runs(engine_blocks(ORDERS[0]), views, RUNS, to_pool=True)


def test_a_copy_behind_refuses_pages_that_are_not_whole_pages_side_by_side():
    """Only gathered pages travel behind the caller: views that are not whole pages of
    the engine's blocks are refused before anything is queued."""
    from raykv.cache_actors.rank.page_copies import copy_runs_behind

    with pytest.raises(ValueError, match="whole pages"):
        copy_runs_behind(engine_blocks(ORDERS[0]), [torch.zeros(8, 5) for _ in range(L)],
                         RUNS, stream=None)
    _, views = pool_pages()
    with pytest.raises(ValueError, match="whole pages"):  # another dtype than the engine's
        copy_runs_behind([b.float() for b in engine_blocks(ORDERS[0])], views, RUNS,
                         stream=None)
