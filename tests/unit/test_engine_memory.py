"""cache_actors.node.engine_memory: an engine's memfd mapped as a node pool, or refused; a
memfd that shrinks afterwards fails data calls instead of raising SIGBUS."""

import mmap
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from raykv.cache_actors.node.engine_memory import map_engine_pool
from raykv.cache_actors.node.node_pools import PoolTable
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.pool_layout import PoolLayout

LAYOUT = PoolLayout.mha(page_size=4, size=16, layer_num=2, head_num=1, head_dim=8,
                        dtype="bfloat16", itemsize=2)


def _memfd(flags: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("sglang_host_pool_test", flags)
    os.ftruncate(fd, LAYOUT.nbytes)
    mm = mmap.mmap(fd, LAYOUT.nbytes)
    mm[:] = bytes(i % 251 for i in range(LAYOUT.nbytes))
    return fd, mm


@pytest.fixture(params=["sglang", "sealable"])
def memfd(request):
    """An engine-like memfd of this process holding LAYOUT, with known bytes: made like
    SGLang 0.5.23's shm allocator makes it (``MFD_CLOEXEC``: never sealable) or with
    ``MFD_ALLOW_SEALING``."""
    flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if request.param == "sealable" else 0)
    fd, mm = _memfd(flags)
    yield fd, mm
    mm.close()
    os.close(fd)


def _path(fd: int) -> str:
    return f"/proc/{os.getpid()}/fd/{fd}"


def _inode(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _get_batch(name: str, offset: int = 0) -> ObjectBatch:
    return ObjectBatch(["k"], [name], [offset], [LAYOUT.object_sizes[0]])


def test_maps_the_same_bytes(memfd):
    fd, mm = memfd
    pool, process = map_engine_pool("eng", _path(fd), LAYOUT, "embedded", _inode(fd))
    try:
        assert process.pid == os.getpid() and process.alive()
        assert bytes(pool._bytes[:16].tolist()) == mm[:16]
        pool.kv_buffer[1, 3].fill_(0)        # a write through the pool is the engine's
        k = LAYOUT.buffer_offsets[1] + 3 * LAYOUT.buffers[1].slot_bytes
        assert mm[k:k + LAYOUT.buffers[1].slot_bytes] == bytes(LAYOUT.buffers[1].slot_bytes)
    finally:
        pool.close()


@pytest.mark.parametrize(("case", "why"), [
    ("standalone", "only be served zero-copy in embedded mode"),
    ("path", "is not /proc/<pid>/fd/<fd>"),
    ("no_process", "there is no process"),
    ("not_memfd", "not a memfd"),
    ("small", "the layout needs"),
    ("other_memfd", "not the one the engine named"),
    ("other_inode", "not the one the engine named"),
])
def test_refusals(memfd, tmp_path, case, why):
    fd, _ = memfd
    path, layout, mode, inode = _path(fd), LAYOUT, "embedded", _inode(fd)
    if case == "standalone":
        mode = "standalone"
    elif case == "path":
        path = "/dev/shm/whatever"
    elif case == "no_process":
        path = f"/proc/{2**22 + 1}/fd/{fd}"  # above pid_max: no such process
    elif case == "not_memfd":
        f = tmp_path / "file"
        f.write_bytes(bytes(LAYOUT.nbytes))
        plain = os.open(f, os.O_RDWR)
        path, inode = _path(plain), _inode(plain)
    elif case == "small":
        layout = PoolLayout.mha(page_size=4, size=32, layer_num=2, head_num=1, head_dim=8,
                                dtype="bfloat16", itemsize=2)
    elif case == "other_memfd":  # the engine named another fd than the one it holds
        other, _ = _memfd(os.MFD_CLOEXEC)
        path = _path(other)
    else:
        inode = (inode[0], inode[1] + 1)
    with pytest.raises(ValueError, match=why):
        map_engine_pool("eng", path, layout, mode, inode)


def test_a_sealable_memfd_can_no_longer_shrink():
    fd, mm = _memfd(os.MFD_ALLOW_SEALING)
    pool, _ = map_engine_pool("eng", _path(fd), LAYOUT, "embedded", _inode(fd))
    try:
        assert pool.sealed
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)          # the engine can no longer truncate it
        os.ftruncate(fd, 2 * LAYOUT.nbytes)  # growing stays allowed
        PoolTable(0, {"eng": pool}).resolve(_get_batch("eng"))[0]
    finally:
        pool.close()
        mm.close()
        os.close(fd)


def test_an_unsealable_memfd_that_shrank_fails_data_calls():
    """SGLang's memfds cannot be sealed: a data call naming one that the engine
    truncated is a ValueError (before any pointer is handed out), not a SIGBUS."""
    fd, mm = _memfd(os.MFD_CLOEXEC)
    pool, _ = map_engine_pool("eng", _path(fd), LAYOUT, "embedded", _inode(fd))
    table = PoolTable(0, {"eng": pool})
    try:
        assert not pool.sealed
        assert table.resolve(_get_batch("eng"))[0] == [pool.base_ptr]
        os.ftruncate(fd, LAYOUT.nbytes // 2)
        with pytest.raises(ValueError, match="truncated its memfd"):
            table.resolve(_get_batch("eng"))[0]
        os.ftruncate(fd, LAYOUT.nbytes)  # the engine's own fix: the size is back
        assert table.resolve(_get_batch("eng"))[0] == [pool.base_ptr]
    finally:
        pool.close()
        mm.close()
        os.close(fd)


ENGINE_TRUNCATES = textwrap.dedent("""
    import ctypes, mmap, os
    from raykv.cache_actors.node.engine_memory import map_engine_pool
    from raykv.cache_actors.node.node_pools import PoolTable
    from raykv.controllers.object_batch import ObjectBatch
    from raykv.controllers.pool_layout import PoolLayout

    layout = PoolLayout.mha(page_size=4, size=16, layer_num=2, head_num=1, head_dim=8,
                            dtype="bfloat16", itemsize=2)
    fd = os.memfd_create("sglang_host_pool_test", os.MFD_CLOEXEC)  # as SGLang makes it
    os.ftruncate(fd, layout.nbytes)
    st = os.fstat(fd)
    pool, _ = map_engine_pool("eng", f"/proc/{os.getpid()}/fd/{fd}", layout, "embedded",
                              (st.st_dev, st.st_ino))
    os.ftruncate(fd, 0)  # the engine truncates its host pool
    size = layout.object_sizes[0]
    batch = ObjectBatch(["k"], ["eng"], [layout.nbytes - size], [size])
    try:
        ptrs = PoolTable(0, {"eng": pool}).resolve(batch)[0]
    except ValueError as e:
        print("refused:", e)
        raise SystemExit(0)
    ctypes.memset(ptrs[0], 1, size)  # what the store does with a get's pointer
    print("wrote past the end of the memfd")
""")


def test_a_get_into_a_truncated_memfd_never_raises_sigbus():
    """In a child process (a SIGBUS would kill it): the store's write into the pool's
    pages never happens once the memfd shrank."""
    run = subprocess.run([sys.executable, "-c", ENGINE_TRUNCATES], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != -signal.SIGBUS, "the data call raised SIGBUS"
    assert run.returncode == 0, run.stderr
    assert "refused:" in run.stdout and "truncated its memfd to 0 bytes" in run.stdout
