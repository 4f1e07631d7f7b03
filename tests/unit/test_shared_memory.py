"""cache_actors.shared_memory: a pool is allocated whole when it is made, so a shared
memory that is too small refuses it at creation (a clear error naming the free space)
instead of a SIGBUS at the first write of an untouched page. On a real tmpfs of 8 MiB
mounted for the test (root only)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from raykv.cache_actors import shared_memory
from raykv.cache_actors.host_pools import HostPool, PoolHandle
from raykv.cache_actors.node.pool_memory import PoolBudget, ShmPoolMemory
from raykv.controllers.pool_layout import MiB, PoolLayout


def _mha(mib: int) -> PoolLayout:
    """An MHA layout of ``mib`` MiB."""
    return PoolLayout.mha(page_size=16, size=mib * 256, layer_num=4, head_num=4, head_dim=64,
                          dtype="bfloat16", itemsize=2)


@pytest.fixture
def small_shm(tmp_path, monkeypatch):
    """A real 8 MiB tmpfs as this process's SHM_DIR (a Docker-like small /dev/shm)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = tmp_path / "shm"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(path)], check=True)
    monkeypatch.setattr(shared_memory, "SHM_DIR", str(path))
    yield str(path)
    subprocess.run(["umount", "--lazy", str(path)], check=True)


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_every_byte_is_allocated_when_the_pool_is_made(small_shm):
    pool = HostPool.create(PoolHandle("kv", "kv", _mha(4)))
    try:
        assert os.stat(os.path.join(small_shm, "kv")).st_blocks * 512 == 4 * MiB
        assert _free(small_shm) == 4 * MiB
    finally:
        pool.close(unlink=True)


def test_a_pool_the_shared_memory_cannot_hold_is_refused_and_nothing_is_left(small_shm):
    memory = ShmPoolMemory("node.", PoolBudget(0))
    kept = memory.create("first", _mha(3))
    with pytest.raises(ValueError) as e:
        memory.create("kv", _mha(6))
    msg = str(e.value)
    assert f"pool 'kv' needs {6 * MiB} bytes" in msg
    assert f"{small_shm} has {5 * MiB} bytes free (of {8 * MiB})" in msg
    assert f"at least {9 * MiB} bytes in all" in msg
    assert "--shm-size" in msg and "host_pool_bytes" in msg and "--host-pool-size" in msg
    assert os.listdir(small_shm) == ["node.first"]  # the refused pool left no file
    assert _free(small_shm) == 5 * MiB               # ... and no page
    assert memory.budget.used == 3 * MiB             # ... and no budget
    memory.release(kept)


WRITE_A_BIG_POOL = textwrap.dedent("""
    import sys
    from raykv.cache_actors import shared_memory
    from raykv.cache_actors.host_pools import HostPool, PoolHandle
    from raykv.controllers.pool_layout import PoolLayout

    shared_memory.SHM_DIR = sys.argv[1]
    layout = PoolLayout.mha(page_size=16, size=16 * 256, layer_num=4, head_num=4,
                            head_dim=64, dtype="bfloat16", itemsize=2)  # 16 MiB
    try:
        pool = HostPool.create(PoolHandle("kv", "kv", layout))
    except ValueError as e:
        print("refused:", e)
        raise SystemExit(0)
    pool.kv_buffer.fill_(1)  # what a rank does with its pool
    print("wrote the whole pool")
""")


def test_a_pool_larger_than_the_shared_memory_never_raises_sigbus(small_shm):
    """In a child process (a SIGBUS kills it): a 16 MiB pool on the 8 MiB tmpfs."""
    run = subprocess.run([sys.executable, "-c", WRITE_A_BIG_POOL, small_shm],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != -signal.SIGBUS, "writing the pool raised SIGBUS"
    assert run.returncode == 0, run.stderr
    assert f"refused: pool 'kv' needs {16 * MiB} bytes" in run.stdout
    assert os.listdir(small_shm) == []
