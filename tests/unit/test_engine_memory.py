"""cache_actors.engine_memory: an engine's memfd mapped as a node pool, or refused."""

import mmap
import os

import pytest
from raykv.cache_actors.engine_memory import map_engine_pool
from raykv.controllers.pool_layout import PoolLayout

LAYOUT = PoolLayout.mha(page_size=4, size=16, layer_num=2, head_num=1, head_dim=8,
                        dtype="bfloat16", itemsize=2)


@pytest.fixture
def memfd():
    """An engine-like memfd of this process holding LAYOUT, with known bytes."""
    fd = os.memfd_create("sglang_host_pool_test")
    os.ftruncate(fd, LAYOUT.nbytes)
    mm = mmap.mmap(fd, LAYOUT.nbytes)
    mm[:] = bytes(i % 251 for i in range(LAYOUT.nbytes))
    yield fd, mm
    mm.close()
    os.close(fd)


def _probe(mm, *offsets):
    return [(o, int.from_bytes(mm[o:o + 8], "little")) for o in offsets]


def test_maps_the_same_bytes(memfd):
    fd, mm = memfd
    path = f"/proc/{os.getpid()}/fd/{fd}"
    pool = map_engine_pool("eng", path, LAYOUT, "embedded",
                           _probe(mm, 0, LAYOUT.nbytes - 8))
    try:
        assert bytes(pool._bytes[:16].tolist()) == mm[:16]
        pool.kv_buffer[1, 3].fill_(0)        # a write through the pool is the engine's
        k = LAYOUT.buffer_offsets[1] + 3 * LAYOUT.buffers[1].slot_bytes
        assert mm[k:k + LAYOUT.buffers[1].slot_bytes] == bytes(LAYOUT.buffers[1].slot_bytes)
    finally:
        pool.close()


@pytest.mark.parametrize("case", ["standalone", "path", "not_memfd", "small", "probe"])
def test_refusals(memfd, tmp_path, case):
    fd, mm = memfd
    path, layout, mode, probe = f"/proc/{os.getpid()}/fd/{fd}", LAYOUT, "embedded", []
    if case == "standalone":
        mode = "standalone"
    elif case == "path":
        path = "/dev/shm/whatever"
    elif case == "not_memfd":
        f = tmp_path / "file"
        f.write_bytes(bytes(LAYOUT.nbytes))
        plain = os.open(f, os.O_RDWR)
        path = f"/proc/{os.getpid()}/fd/{plain}"
    elif case == "small":
        layout = PoolLayout.mha(page_size=4, size=32, layer_num=2, head_num=1, head_dim=8,
                                dtype="bfloat16", itemsize=2)
    else:
        probe = [(16, int.from_bytes(mm[16:24], "little") ^ 1)]
    with pytest.raises(ValueError):
        map_engine_pool("eng", path, layout, mode, probe)
