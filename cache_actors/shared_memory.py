"""Named shared-memory files under ``/dev/shm`` (mode 0600).

The node actor creates and unlinks files; ranks only attach. Unlike
``multiprocessing.shared_memory`` before Python 3.13, attaching registers nothing with
a resource tracker, so a rank that exits never unlinks a file it did not create.
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os

from raykv.controllers.naming import SHM_DIR


def shm_path(name: str) -> str:
    """``/dev/shm/<name>``; a name that is an absolute path is that path (the node
    actor's memfd seen as ``/proc/<pid>/fd/<fd>``, standalone mode)."""
    return name if name.startswith("/") else os.path.join(SHM_DIR, name)


def create_shm_file(name: str, nbytes: int) -> mmap.mmap:
    """Create file ``name`` of ``nbytes`` bytes (fails if it exists) and map it."""
    fd = os.open(shm_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def attach_shm_file(name: str, nbytes: int) -> mmap.mmap:
    """Map the existing file ``name``; raise ``FileNotFoundError`` if it is gone or
    ``ValueError`` if it is smaller than ``nbytes``."""
    fd = os.open(shm_path(name), os.O_RDWR)
    try:
        actual = os.fstat(fd).st_size
        if actual < nbytes:
            raise ValueError(f"shared file {name} holds {actual} bytes, expected {nbytes}")
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


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
