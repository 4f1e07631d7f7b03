"""An engine's own host memory served as a node pool (zero-copy engine integrations).

SGLang started with ``"allocator": "shm"`` keeps each host pool in a memfd of its
scheduler process. A node actor on the same machine, running as the same user, can open
that memfd as ``/proc/<pid>/fd/<fd>``, map it, and register the mapping with its Mooncake
client: pages then move between the engine's own tensors and the store with no copy.

``map_engine_pool`` does the mapping and refuses, with a ``ValueError`` naming the
problem and before anything is registered, anything that is not such a memfd: a path
other than ``/proc/<pid>/fd/<fd>``, a process of another user, an fd that is not a
memfd, a file smaller than the pool's layout, or bytes at the probed offsets that differ
from what the engine read there itself (a wrong fd or a layout that does not match).

Such a pool is never written to ``/dev/shm`` and not re-adopted by a restarted actor
(the engine re-registers it; a pid may be reused). The node actor removes it once the
engine process has exited (``NodePools.reap_engines``), so an engine that dies without
closing its backend does not keep its host memory alive in the actor. It only exists in
embedded mode: in standalone mode the store's buffers belong to ``mooncake_client``,
which cannot see the engine's memory.
"""

from __future__ import annotations

import os
import re

from raykv.cache_actors.host_pools import HostPool, PoolHandle
from raykv.controllers.pool_layout import PoolLayout, check_pool_name

_PROC_FD = re.compile(r"^/proc/(\d+)/fd/(\d+)$")


def engine_pid(path: str) -> int:
    """The pid of the engine process whose memfd ``path`` (``/proc/<pid>/fd/<fd>``)
    names; ``ValueError`` for another path."""
    m = _PROC_FD.match(path or "")
    if m is None:
        raise ValueError(f"{path!r} is not /proc/<pid>/fd/<fd>")
    return int(m.group(1))


def map_engine_pool(name: str, path: str, layout: PoolLayout, mode: str,
                    probe: list[tuple[int, int]] = ()) -> HostPool:
    """Map the engine memfd ``path`` as pool ``name`` of ``layout`` (see the module
    docstring). ``probe``: ``(offset, first 8 bytes as a little-endian int)`` pairs the
    engine read through its own mapping. The caller registers the pool."""
    check_pool_name(name)
    if mode != "embedded":
        raise ValueError(f"engine memory can only be served zero-copy in embedded mode (this "
                         f"node runs {mode}: the store's buffers belong to mooncake_client)")
    try:
        pid = engine_pid(path)
    except ValueError as e:
        raise ValueError(f"engine pool {name!r}: {e}") from None
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
        target = os.readlink(path)
        size = os.stat(path).st_size
    except OSError as e:
        raise ValueError(f"engine pool {name!r}: cannot reach {path}: {e}") from None
    if owner != os.getuid():
        raise ValueError(f"engine pool {name!r}: process {pid} belongs to uid {owner}, not to "
                         f"this node actor's uid {os.getuid()}")
    if not target.startswith("/memfd:"):
        raise ValueError(f"engine pool {name!r}: {path} is {target!r}, not a memfd")
    if size < layout.nbytes:
        raise ValueError(f"engine pool {name!r}: the memfd holds {size} bytes but the layout "
                         f"needs {layout.nbytes}")
    pool = HostPool.attach(PoolHandle(name, path, layout))
    try:
        for off, want in probe:
            if not 0 <= off <= layout.nbytes - 8:
                raise ValueError(f"engine pool {name!r}: probe offset {off} is outside the "
                                 f"pool's {layout.nbytes} bytes")
            got = int.from_bytes(bytes(pool._bytes[off:off + 8].tolist()), "little")
            if got != want:
                raise ValueError(f"engine pool {name!r}: bytes at offset {off} differ from "
                                 "what the engine reads there: wrong fd or layout")
    except BaseException:
        pool.close()
        raise
    return pool
