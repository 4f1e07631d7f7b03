"""An engine's own host memory served as a node pool (zero-copy engine integrations).

SGLang started with ``"allocator": "shm"`` keeps each host pool in a memfd of its
scheduler process. A node actor on the same machine, running as the same user, can open
that memfd as ``/proc/<pid>/fd/<fd>``, map it, and register the mapping with its Mooncake
client: pages then move between the engine's own tensors and the store with no copy.

``map_engine_pool`` opens the fd first and checks only what it opened (never a path
checked and then opened again: the engine could swap its fd in between). It refuses,
with a ``ValueError`` naming the problem and before anything is registered: a path
other than ``/proc/<pid>/fd/<fd>``, a process of another user or one that exited or was
replaced while the fd was opened, a file that is not a memfd or belongs to another
user, a memfd smaller than the pool's layout, and a memfd that is not the one the engine
names by ``inode`` (``(st_dev, st_ino)`` of its own fd, whose mapping holds its
tensors): that identity proves the actor maps the engine's very bytes, which comparing
bytes cannot do for a fresh, zero-filled memfd.

Shrinking. A mapped page past the end of a truncated memfd raises SIGBUS in whichever
process touches it: an engine that truncated its memfd would kill this actor in the
middle of a store call. The actor therefore seals the memfd against shrinking
(``F_SEAL_SHRINK``) when it allows seals (made with ``MFD_ALLOW_SEALING``): then no
process can shrink it any more. SGLang 0.5.23's shm allocator makes its memfds with
``MFD_CLOEXEC`` only, which the kernel never lets anyone seal; refusing those would end
zero-copy for SGLang, so such a pool is served unsealed and its size is checked
(``fstat``) at every data call that names it (``EngineHostPool.check``): a memfd that
shrank below the layout fails the call with ``ValueError`` instead of a SIGBUS. The
check narrows the risk to an engine that truncates its memfd during a store call
already under way; SGLang never truncates a host pool it has made.

Such a pool is never written to ``SHM_DIR`` and not re-adopted by a restarted actor
(the engine re-registers it; a pid may be reused). The node actor removes it once the
engine process has exited (``NodePools.reap_engines``), so an engine that dies without
closing its backend does not keep its host memory alive in the actor. It only exists in
embedded mode: in standalone mode the store's buffers belong to ``mooncake_client``,
which cannot see the engine's memory.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat

from raykv.cache_actors.host_pools import HostPool, PoolHandle
from raykv.cache_actors.processes import ProcessIdentity
from raykv.cache_actors.shared_memory import map_fd
from raykv.controllers.pool_layout import PoolLayout, check_pool_name

log = logging.getLogger(__name__)

_PROC_FD = re.compile(r"^/proc/(\d+)/fd/(\d+)$")


def engine_pid(path: str) -> int:
    """The pid of the engine process whose memfd ``path`` (``/proc/<pid>/fd/<fd>``)
    names; ``ValueError`` for another path."""
    m = _PROC_FD.match(path or "")
    if m is None:
        raise ValueError(f"{path!r} is not /proc/<pid>/fd/<fd>")
    return int(m.group(1))


def seal_shrink(fd: int) -> bool:
    """Seal memfd ``fd`` (open for writing) against shrinking; False if the memfd does
    not allow seals (made without ``MFD_ALLOW_SEALING``, or sealed against new seals)."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except PermissionError:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    return True


class EngineHostPool(HostPool):
    """An engine's memfd mapped as a pool; holds the fd it was mapped from.

    ``sealed``: the memfd can no longer shrink. Unsealed, ``check`` compares its size
    with the layout (one ``fstat``, ~1 us) before every data call that names it.
    """

    def __init__(self, handle: PoolHandle, fd: int, sealed: bool) -> None:
        super().__init__(handle, map_fd(fd, handle.layout.nbytes), owner=False)
        self._fd = fd
        self.sealed = sealed

    def check(self) -> None:
        """``ValueError`` if the engine truncated its memfd below the layout (touching
        the lost pages would raise SIGBUS). Any thread."""
        if self.sealed:
            return
        fd = self._fd
        if fd < 0:
            raise ValueError(f"engine pool {self.name!r} was removed")
        size = os.fstat(fd).st_size
        if size < self.nbytes:
            raise ValueError(f"engine pool {self.name!r}: the engine truncated its memfd to "
                             f"{size} bytes but the pool's layout needs {self.nbytes}: no "
                             "page of it moves while it is smaller")

    def close(self, unlink: bool = False) -> None:
        """Unmap and close the fd (an engine's memfd is never unlinked)."""
        super().close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _check_opened(name: str, fd: int, pid: int, process: ProcessIdentity,
                  layout: PoolLayout, inode: tuple[int, int]) -> None:
    """``ValueError`` unless ``fd`` (opened from ``/proc/<pid>/fd/...``) is the engine's
    memfd described by ``inode``, of this actor's user and large enough for ``layout``,
    and ``process`` still is the process that held it."""
    what = f"engine pool {name!r}"
    owner = os.stat(f"/proc/{pid}").st_uid
    if not process.alive():
        raise ValueError(f"{what}: process {pid} exited while its memfd was opened")
    if owner != os.getuid():
        raise ValueError(f"{what}: process {pid} belongs to uid {owner}, not to this node "
                         f"actor's uid {os.getuid()}")
    st = os.fstat(fd)
    target = os.readlink(f"/proc/self/fd/{fd}")
    if not stat.S_ISREG(st.st_mode) or not target.startswith("/memfd:"):
        raise ValueError(f"{what}: the fd of process {pid} is {target!r}, not a memfd")
    if st.st_uid != os.getuid():
        raise ValueError(f"{what}: the memfd belongs to uid {st.st_uid}, not to this node "
                         f"actor's uid {os.getuid()}")
    if (st.st_dev, st.st_ino) != tuple(inode):
        raise ValueError(f"{what}: the fd of process {pid} is memfd (dev {st.st_dev}, inode "
                         f"{st.st_ino}), not the one the engine named (dev {inode[0]}, "
                         f"inode {inode[1]}): a wrong or reused fd")
    if st.st_size < layout.nbytes:
        raise ValueError(f"{what}: the memfd holds {st.st_size} bytes but the layout needs "
                         f"{layout.nbytes}")


def map_engine_pool(name: str, path: str, layout: PoolLayout, mode: str,
                    inode: tuple[int, int]) -> tuple[EngineHostPool, ProcessIdentity]:
    """Map the engine memfd ``path`` as pool ``name`` of ``layout`` (see the module
    docstring). ``inode``: ``(st_dev, st_ino)`` of the memfd as the engine's ``fstat`` of
    its own fd reports it. Returns the pool and the engine process that held the fd
    (for ``NodePools.reap_engines``); the caller registers the pool."""
    check_pool_name(name)
    if mode != "embedded":
        raise ValueError(f"engine memory can only be served zero-copy in embedded mode (this "
                         f"node runs {mode}: the store's buffers belong to mooncake_client)")
    try:
        pid = engine_pid(path)
    except ValueError as e:
        raise ValueError(f"engine pool {name!r}: {e}") from None
    process = ProcessIdentity.of(pid)
    if process is None:
        raise ValueError(f"engine pool {name!r}: there is no process {pid}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"engine pool {name!r}: cannot open {path}: {e}") from None
    try:
        try:
            _check_opened(name, fd, pid, process, layout, inode)
        except OSError as e:
            raise ValueError(f"engine pool {name!r}: cannot check {path}: {e}") from None
        sealed = seal_shrink(fd)
        if sealed:  # it may have shrunk between the check and the seal
            _check_opened(name, fd, pid, process, layout, inode)
        else:
            log.info("engine pool %s: the memfd does not allow seals; its size is checked at "
                     "every data call", name)
        return EngineHostPool(PoolHandle(name, path, layout), fd, sealed), process
    except BaseException:
        os.close(fd)
        raise
