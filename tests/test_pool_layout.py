"""Page arithmetic and index validation of host pools (pure logic)."""

import numpy as np
import pytest

from controllers.pool_layout import PoolLayout, check_pool_name


def mha(**kw) -> PoolLayout:
    args = dict(kind="mha", page_size=4, size=32, layer_num=3, head_num=2, head_dim=8,
                dtype="float16", itemsize=2)
    return PoolLayout(**(args | kw))


def mla(**kw) -> PoolLayout:
    args = dict(kind="mla", page_size=4, size=32, layer_num=3, kv_cache_dim=16,
                dtype="bfloat16", itemsize=2)
    return PoolLayout(**(args | kw))


def test_mha_geometry():
    layout = mha()
    assert layout.shape == (2, 32, 3, 2, 8)
    assert layout.token_bytes == 3 * 2 * 8 * 2
    assert layout.object_bytes == 4 * 3 * 2 * 8 * 2
    assert layout.nbytes == 2 * 32 * layout.token_bytes
    assert layout.object_offsets([0, 8]) == [0, 32 * 96, 8 * 96, 32 * 96 + 8 * 96]


def test_mla_geometry():
    layout = mla()
    assert layout.shape == (32, 3, 1, 16)
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
        ({"layout": "layer_first"}, "cannot be served"),
        ({"layout": "weird"}, "unknown"),
        ({"kind": "gqa"}, "unknown"),
        ({"size": 30}, "multiple of page_size"),
        ({"head_num": 0}, "head_num must be a positive int"),
    ],
)
def test_layout_rejects(kw, msg):
    with pytest.raises(ValueError, match=msg):
        mha(**kw)


def test_locate():
    layout = mla()
    layout.locate(0, layout.nbytes)
    for off, size in [(-1, 4), (0, 0), (layout.nbytes - 2, 4)]:
        with pytest.raises(ValueError, match="does not lie inside"):
            layout.locate(off, size)


@pytest.mark.parametrize("name", ["", "a/b", "../x", ".hidden", "x" * 65, 3])
def test_bad_pool_names(name):
    with pytest.raises(ValueError, match="pool name"):
        check_pool_name(name)
