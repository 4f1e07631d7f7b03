"""Page arithmetic and index validation of host pools (pure logic)."""

import numpy as np
import pytest
from raykv.controllers.pool_layout import PoolLayout, check_pool_name


def mha(**kw) -> PoolLayout:
    args = dict(page_size=4, size=32, layer_num=3, head_num=2, head_dim=8,
                dtype="float16", itemsize=2)
    return PoolLayout.mha(**(args | kw))


def mla(**kw) -> PoolLayout:
    args = dict(page_size=4, size=32, layer_num=3, kv_cache_dim=16,
                dtype="bfloat16", itemsize=2)
    return PoolLayout.mla(**(args | kw))


def test_mha_geometry():
    layout = mha()
    assert [b.name for b in layout.buffers] == ["k", "v"]
    assert layout.buffers[0].slot_bytes == 3 * 2 * 8 * 2
    assert layout.object_bytes == 4 * 3 * 2 * 8 * 2
    assert layout.buffer_offsets == [0, 32 * 96]
    assert layout.nbytes == 2 * 32 * 96
    assert layout.object_offsets([0, 8]) == [0, 32 * 96, 8 * 96, 32 * 96 + 8 * 96]


def test_mla_geometry():
    layout = mla()
    assert layout.buffers[0].slot_shape == (3, 1, 16)
    assert layout.object_bytes == 4 * 3 * 16 * 2
    assert layout.objects_per_page == 1
    assert layout.object_offsets([4]) == [4 * 96]


def test_page_starts_accepts_whole_pages():
    assert mha().page_starts(list(range(8, 16)) + list(range(0, 4)), 3) == [8, 12, 0]
    assert mha().page_starts(np.arange(0, 0), 0) == []


@pytest.mark.parametrize(
    ("indices", "n", "msg"),
    [
        (list(range(8)), 3, "entries but 3 keys need 12"),
        (list(range(2, 6)), 1, "not aligned"),
        ([0, 1, 3, 2], 1, "contiguous"),
        (list(range(32, 36)), 1, r"span \[32, 35\]"),
        ([-4, -3, -2, -1], 1, "span"),
        ([0.0, 1.0, 2.0, 3.0], 1, "ints"),
    ],
)
def test_page_starts_rejects(indices, n, msg):
    with pytest.raises(ValueError, match=msg):
        mha().page_starts(indices, n)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"order": "layer_first"}, "cannot be served"),
        ({"order": "weird"}, "unknown"),
        ({"size": 30}, "multiple of page_size"),
        ({"head_num": 0}, "head_num must be a positive int"),
        ({"page_size": True}, "page_size must be a positive int"),
    ],
)
def test_layout_rejects(kw, msg):
    with pytest.raises(ValueError, match=msg):
        mha(**kw)


def test_unknown_kind():
    with pytest.raises(ValueError, match="kind 'gqa' is unknown"):
        PoolLayout("gqa", 1, 1, mla().buffers)


def test_mamba_geometry_mixed_dtypes():
    layout = PoolLayout.mamba(size=6, temporal=((2, 4, 8), "float32", 4),
                              convs=[((2, 3, 5), "bfloat16", 2), ((2, 7), "float16", 2)])
    assert [b.name for b in layout.buffers] == ["temporal", "conv_0", "conv_1"]
    assert layout.object_sizes == [2 * 4 * 8 * 4, 2 * 3 * 5 * 2, 2 * 7 * 2]
    t, c0, c1 = layout.buffer_offsets
    assert (t, c0, c1) == (0, 6 * 256, 6 * 256 + 6 * 60)
    assert layout.nbytes == c1 + 6 * 28
    assert layout.object_offsets([2]) == [2 * 256, c0 + 2 * 60, c1 + 2 * 28]
    assert layout.page_starts([5, 0], 2) == [5, 0]


def test_mamba_conv_only_and_alignment():
    layout = PoolLayout.mamba(size=3, temporal=((0,), "float32", 4),
                              convs=[((3,), "bfloat16", 2), ((1,), "float32", 4)])
    assert [b.name for b in layout.buffers] == ["conv_0", "conv_1"]
    assert layout.buffer_offsets == [0, 20]  # 18 bytes of conv_0, aligned up to 4
    with pytest.raises(ValueError, match="page_size must be 1"):
        PoolLayout("mamba", 2, 4, layout.buffers)
    with pytest.raises(ValueError, match="at least one conv buffer"):
        PoolLayout.mamba(size=3, temporal=((3,), "float32", 4), convs=[])


def test_indexer_geometry():
    layout = PoolLayout.indexer(page_size=4, size=16, layer_num=2, index_head_dim=132,
                                dtype="uint8", itemsize=1)
    assert layout.object_sizes == [4 * 2 * 132]


@pytest.mark.parametrize("name", ["", "a/b", "../x", ".hidden", "x" * 65, 3])
def test_bad_pool_names(name):
    with pytest.raises(ValueError, match="pool name"):
        check_pool_name(name)
