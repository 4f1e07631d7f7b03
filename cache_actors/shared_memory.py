"""Named shared-memory files under ``/dev/shm`` (mode 0600), reserved when made.

The node actor creates and unlinks files; ranks only attach. Unlike
``multiprocessing.shared_memory`` before Python 3.13, attaching registers nothing with
a resource tracker, so a rank that exits never unlinks a file it did not create.

Every byte of a file is allocated when the file is made (``reserve``): a tmpfs that is
full (Docker gives a container a 64 MiB ``/dev/shm`` by default) then refuses the pool
at creation with a ``ValueError`` naming the numbers and the fix, instead of killing
the first process that writes an untouched page of a sparse file with SIGBUS.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import mmap
import os

from raykv.controllers.naming import SHM_DIR

_NO_ROOM = (errno.ENOSPC, errno.ENOMEM, errno.EFBIG)


def shm_path(name: str) -> str:
    """``/dev/shm/<name>``; a name that is an absolute path is that path (the node
    actor's memfd seen as ``/proc/<pid>/fd/<fd>``, standalone mode)."""
    return name if name.startswith("/") else os.path.join(SHM_DIR, name)


def no_room(what: str, nbytes: int, fd: int, where: str) -> ValueError:
    """The error for ``what`` (e.g. ``pool 'kv'``) that needs ``nbytes`` of shared
    memory which the filesystem of ``fd`` (described as ``where``) cannot give: its free
    space (``fstatvfs``) and the fixes."""
    try:
        st = os.fstatvfs(fd)
    except OSError as e:
        return ValueError(f"{what} needs {nbytes} bytes of shared memory that {where} cannot "
                          f"give ({e}); free some, or make the pool smaller")
    budget = ("lower the node's host pool budget (host_pool_bytes: local_settings("
              "host_pool_bytes=...) / `raykv up --host-pool-size`) or make the pool smaller")
    if st.f_blocks == 0:  # memfds: no size limit of their own
        return ValueError(f"{what} needs {nbytes} bytes of shared memory but {where} could "
                          "not allocate them (no size limit of its own: the machine's or the "
                          f"container's memory ran out): give the node more memory or {budget}")
    free, used = st.f_bavail * st.f_frsize, (st.f_blocks - st.f_bavail) * st.f_frsize
    return ValueError(
        f"{what} needs {nbytes} bytes of shared memory but {where} has {free} bytes free "
        f"(of {st.f_blocks * st.f_frsize}): give the node more shared memory (at least "
        f"{used + nbytes} bytes in all: Docker `--shm-size`, else a larger tmpfs at {where}) "
        f"or {budget}")


def reserve(fd: int, nbytes: int, what: str, where: str) -> None:
    """Allocate all ``nbytes`` of the shared-memory file ``fd`` now (``posix_fallocate``;
    the file grows to ``nbytes`` if smaller), so that no later first write to one of its
    pages can fail (SIGBUS). ``ValueError`` (``no_room``) if the filesystem or memory
    cannot hold them; tmpfs gives back what it allocated for a call that failed."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in _NO_ROOM:
            raise
        raise no_room(what, nbytes, fd, where) from None


def create_shm_file(name: str, nbytes: int, what: str | None = None) -> mmap.mmap:
    """Create file ``name`` of ``nbytes`` bytes (fails if it exists), all of them
    allocated (``reserve``), and map it. ``ValueError`` naming ``what`` (default: the
    file) when ``SHM_DIR`` has no room for them; the file is removed again then."""
    path = shm_path(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        reserve(fd, nbytes, what or f"shared file {name!r}", os.path.dirname(path))
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        unlink_shm_file(name)
        raise
    finally:
        os.close(fd)


def map_fd(fd: int, nbytes: int) -> mmap.mmap:
    """Map the first ``nbytes`` of the open file ``fd`` shared, read-write."""
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def unlink_shm_file(name: str) -> None:
    """Remove file ``name``; mappings stay valid until unmapped. Missing is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(shm_path(name))


def remove_shm_files(prefix: str) -> list[str]:
    """Unlink every file whose name starts with ``prefix``; return their names."""
    removed = []
    for path in glob.glob(shm_path(glob.escape(prefix) + "*")):
        name = os.path.basename(path)
        unlink_shm_file(name)
        removed.append(name)
    return removed
