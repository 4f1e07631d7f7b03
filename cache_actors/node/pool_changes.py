"""Which of a node's pools are being changed now, so that no lock is held while they are.

Creating a pool reserves its memory (``posix_fallocate``: seconds for a big pool) and
registers it with Mooncake; removing one drains its data calls (up to ``DRAIN_S``).
``NodePools`` does that work without its lock: under the lock it only checks, marks the
change begun here and publishes the result. A change is *of one pool* (create, adopt,
destroy: changes of different pools run side by side; a second change of the same pool
waits for the first, then sees its result) or *of every pool* (re-allocation, close:
it waits for the changes under way and holds off new ones until it ends). So
``health``, ``channel_path`` and the data path never wait for a change, and control
reads wait only while every pool is being replaced (``wait_whole``).

Every method but ``of`` runs with the ``NodePools`` lock held (the lock of this
condition); a wait releases it while it waits, and ends after ``wait_s`` with
``DeadlineExceededError``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from raykv.cache_actors.errors import DeadlineExceededError
from raykv.controllers.ownership import Owner


class PoolChanges:
    """The changes under way (see the module docstring): per pool name its owner and the
    bytes it will hold (a create or adoption: counted against its tenant's quota until
    it is published), and whether every pool is being changed."""

    def __init__(self, lock: threading.Lock, wait_s: float) -> None:
        self._cond = threading.Condition(lock)
        self._wait_s = wait_s
        self._names: dict[str, tuple[Owner | None, int]] = {}
        self._whole = False

    def _wait(self, busy, what: str) -> None:
        deadline = time.monotonic() + self._wait_s
        while busy():
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError(f"{what} is still being changed after "
                                            f"{self._wait_s:.0f} s: retry the call")
            self._cond.wait(left)

    def begin(self, name: str) -> None:
        """Wait until no change of pool ``name`` nor of every pool is under way, then
        mark one begun; ``end(name)`` when it is published or given up."""
        self._wait(lambda: self._whole or name in self._names, f"pool {name!r}")
        self._names[name] = (None, 0)

    @contextlib.contextmanager
    def of(self, name: str) -> Iterator[None]:
        """A change of pool ``name`` for the ``with`` block, which runs without the lock
        (it takes it for its checks and to publish): ``begin`` before, ``end`` after."""
        with self._cond:
            self.begin(name)
        try:
            yield
        finally:
            with self._cond:
                self.end(name)

    def reserve(self, name: str, owner: Owner | None, nbytes: int) -> None:
        """The change of ``name`` begun here makes a pool of ``nbytes`` for ``owner``."""
        self._names[name] = (owner, nbytes)

    def end(self, name: str) -> None:
        del self._names[name]
        self._cond.notify_all()

    def begin_whole(self) -> None:
        """Wait until no change is under way, then mark a change of every pool begun;
        ``end_whole`` after it."""
        self._wait(lambda: self._whole or bool(self._names), "this node's pools")
        self._whole = True

    def end_whole(self) -> None:
        self._whole = False
        self._cond.notify_all()

    def wait_whole(self) -> None:
        """Wait until no change of every pool is under way (changes of one pool leave
        the table consistent: they are not waited for)."""
        self._wait(lambda: self._whole, "this node's pools")

    def pending(self, tenant: str | None) -> int:
        """Bytes of the pools of ``tenant`` (None: without a tenant) being created or
        adopted now."""
        return sum(n for o, n in self._names.values()
                   if getattr(o, "tenant", None) == tenant)
