"""Pool memory on memfds of this process, as standalone mode's pools reach a rank
(``/proc/<pid>/fd/<fd>``), and the node's look at whether it may give such memory back."""

from __future__ import annotations

import fcntl
import os

from raykv.cache_actors.host_pools import PoolHandle
from raykv.controllers.pool_layout import PoolLayout


def memfd_pool_handle(name: str, layout: PoolLayout, epoch: int = 0, fill: int = 0
                      ) -> PoolHandle:
    """A handle of ``layout`` in ``epoch`` on a new memfd of this process, every byte
    ``fill``."""
    fd = os.memfd_create(name)
    os.ftruncate(fd, layout.nbytes)
    if fill:
        os.pwrite(fd, bytes([fill]) * layout.nbytes, 0)
    return PoolHandle(name, f"/proc/self/fd/{fd}", layout, epoch)


def node_may_release(fd: int) -> bool:
    """Whether the node, on its own open file ``fd`` of a pool's memory, would give it
    back now (its exclusive lock: no process holds the memory)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True
