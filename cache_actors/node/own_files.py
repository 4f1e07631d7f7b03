"""The node actor's own small files under ``SHM_DIR`` (pool records, the standalone
``mooncake_client`` record), read and written so that nothing planted there can steer
or stall it.

``/dev/shm`` is writable by every user of the machine: a file found under one of the
node's names may be a FIFO (a blocking open would hang the actor's constructor), a
symbolic link (to a file the actor would then read or overwrite), another user's file,
or one that anyone may rewrite. ``read_own_file`` opens without following a link and
without blocking (``O_NOFOLLOW | O_NONBLOCK``), then checks the open file itself
(``check_own_file``): only a regular file of this process's uid that neither its group
nor others may write, of at most a given size, is read. ``write_own_file`` replaces a
file atomically (a new 0600 file, fsync, rename), never writing through what is there.
Pure file logic: no Ray or Mooncake import.
"""

from __future__ import annotations

import contextlib
import os
import stat


def check_own_file(file: int | str, what: str) -> None:
    """``ValueError`` unless ``file`` (an open fd, or a path: not followed if a link) is
    a regular file of this process's uid that neither its group nor others may write:
    what a node actor re-adopts after a restart must be its own."""
    st = os.fstat(file) if isinstance(file, int) else os.lstat(file)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what} is not a regular file")
    if st.st_uid != os.getuid():
        raise ValueError(f"{what} belongs to uid {st.st_uid}, not to this node actor's uid "
                         f"{os.getuid()}")
    if st.st_mode & 0o022:
        raise ValueError(f"{what} is writable by group or others (mode "
                         f"{stat.S_IMODE(st.st_mode):o})")


def read_own_file(path: str, what: str, max_bytes: int) -> bytes:
    """The bytes of ``path`` if it is this uid's own regular file (``check_own_file``)
    of at most ``max_bytes`` bytes; returns at once whatever ``path`` is (a FIFO or a
    device is never read, a link never followed). ``FileNotFoundError`` if it is gone,
    ``ValueError`` naming what is wrong, another ``OSError`` if it cannot be opened (a
    link: ``ELOOP``)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        check_own_file(fd, what)
        if os.fstat(fd).st_size > max_bytes:
            raise ValueError(f"{what} is larger than {max_bytes} bytes")
        chunks, left = [], max_bytes + 1
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:  # grew after the fstat
        raise ValueError(f"{what} is larger than {max_bytes} bytes")
    return data


def write_own_file(path: str, data: bytes) -> None:
    """Replace ``path`` with a 0600 file of this uid holding ``data``, atomically: a new
    temporary file beside it (``O_EXCL | O_NOFOLLOW``), fsync, rename over ``path``. What
    was at ``path`` (a link, a FIFO) is replaced, never written through; ``OSError`` if
    it cannot be (e.g. another user's file in a sticky directory)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
