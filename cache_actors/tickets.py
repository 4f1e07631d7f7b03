"""Tickets: how a put or get stays final once it returned to its rank.

A put or get names pages of pools that the rank and the node actor both map (shared
memory on one host). A call that returns to the rank (codes, an error, its deadline)
hands those pages back to the engine, which reuses them at once; so no process may
read or write them for that call afterwards. A deadline alone cannot promise that: a
store call that started in time may run past it. A **ticket** makes it a decision of
the kernel instead of a race between two processes.

Each rank process keeps a *ticket book*: a small shared file (``/dev/shm/<BOOK_PREFIX>
<pid>-<start ticks>-<random>``, mode 0600) of ``SLOTS`` slots of ``SLOT_BYTES`` bytes:
serial (u64), state (u32), 4 bytes unused, and ``touch_until`` (f64, monotonic
seconds). A slot's bytes are read and written only by a process holding the slot's
byte range locked with an open-file-description lock (``F_OFD_SETLK``: owned by the
open file, so a rank and a node actor conflict even when they are threads of one
test process, and released by the kernel when the holder dies). A ticket is the
triple ``(book, slot, serial)`` (``TicketRef``) a put or get carries on either route.

- The rank ``issue``s a ticket before it sends the call: a free slot, a new serial,
  state ``PENDING``.
- The node actor, right before the store call that touches the pages, locks the slot
  (``cache_actors.node.ticket_desk``): only if it holds this serial ``PENDING`` and the
  call's deadline is more than ``START_MARGIN_S`` away does it mark it ``STARTED`` and
  keep the lock for the whole store call; then ``ENDED`` and unlock. Anything else
  (``ABANDONED``, another serial, a deadline too close) and the call is not made.
- The rank, when the call ended without the node's reply (its deadline, a broken
  channel, a Ray error), ``settle``s it: it waits for the slot's lock (``F_OFD_SETLKW``).
  It gets it at once if no store call holds it: a ``PENDING`` slot becomes
  ``ABANDONED`` (the node skips it whenever it arrives). Otherwise a store call of this
  ticket is running, and the rank waits for its end: the only wait of a data call not
  bounded by its deadline, bounded instead by the store call itself (see
  ``docs/failure-model.md``). A slot found ``STARTED`` and unlocked was
  held by a node actor that died during the call: in embedded mode nothing can touch
  the pages any more (the transfers ran in that process); in standalone mode
  ``mooncake_client`` may still finish the transfer, so the rank waits until the slot's
  ``touch_until``.
- Staged pools (``deferring``): a call that names only the rank's own staging pages
  need not wait for its store call. Inside ``deferring`` a failed call ``try_settle``s
  its ticket instead (never blocks) and, if a store call still holds it, hands the
  ticket to the caller, which keeps those staging pages out of use until
  ``try_settle`` says True (``cache_actors.rank.quarantine``): the call returns at its
  deadline even when the node actor was stopped in the middle of the store call.
- A reply from the node actor always comes after the ticket ended (or was never
  started), so a call that got its reply frees its slot without a lock, and that slot
  is issued again without one: no process will lock it for its old serial (the node
  actor saw the call's one request, and answered it). A slot freed by a settle is
  locked when it is issued again (a late request of its old ticket may be checking it
  in a node actor at that moment).
- A slot is freed only by the ticket it was issued for, and once: settling or freeing a
  ticket already freed (several staging pools of one failed round each quarantine its
  ticket) changes nothing, so no two live calls ever share a slot.

Pure of Ray and Mooncake; the rank side (``TicketBook``) is here, the node side in
``cache_actors.node.ticket_desk``. ``check_deadline`` is the one check of a deadline that
crosses a process boundary (both routes).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import math
import mmap
import os
import re
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from typing import NamedTuple

from raykv.cache_actors.processes import ProcessIdentity
from raykv.controllers.contract import MAX_TIMEOUT_S
from raykv.controllers.naming import SHM_DIR

SLOTS = 1024
"""Tickets in flight per rank process, at most (its concurrent puts and gets)."""
SLOT_BYTES = 32
BOOK_BYTES = SLOTS * SLOT_BYTES
BOOK_PREFIX = "raykv-ticket-"
BOOK_NAME = re.compile(re.escape(BOOK_PREFIX) + r"(\d+)-(\d+)-[0-9a-f]{16}")
"""A ticket book's file name: pid and start ticks of its rank process, 16 random hex."""

FREE, PENDING, STARTED, ENDED, ABANDONED = range(5)
START_MARGIN_S = 0.02
"""A node actor never starts a store call whose deadline is closer than this (seconds):
the rank would only wait for it past its deadline."""
MAX_AHEAD_S = MAX_TIMEOUT_S + 60.0
"""A deadline further ahead than this (seconds from now) is refused: no caller's
deadline is (``timeout_s`` is at most ``MAX_TIMEOUT_S``)."""

_SLOT = struct.Struct("=QI4xd")
_FLOCK = struct.Struct("@hhqqi4x")  # struct flock (x86_64, aarch64): type whence start len pid


class TicketRef(NamedTuple):
    """A put's or get's ticket as it travels: the rank's ticket book (file name), the
    slot and its serial (travels as a plain 3-tuple on the channel)."""

    book: str
    slot: int
    serial: int


def check_deadline(deadline: object) -> float:
    """``deadline`` (``time.monotonic()`` seconds of this host) as a float; ``ValueError``
    unless it is a finite number at most ``MAX_AHEAD_S`` ahead (one in the past is
    valid: the call has expired)."""
    if isinstance(deadline, bool) or not isinstance(deadline, int | float) or \
            not math.isfinite(deadline):
        raise ValueError(f"a deadline must be a finite number of monotonic seconds, got "
                         f"{deadline!r}")
    if deadline > time.monotonic() + MAX_AHEAD_S:
        raise ValueError(f"a deadline more than {MAX_AHEAD_S:g} s ahead is refused, got "
                         f"{deadline!r} (now {time.monotonic():.3f})")
    return float(deadline)


def lock_slot(fd: int, slot: int, wait: bool = False) -> bool:
    """Lock ``slot``'s bytes of the book open as ``fd`` for this open file description;
    False if another holds them (``wait``: block until it is released instead)."""
    arg = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, slot * SLOT_BYTES, SLOT_BYTES, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, arg)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock_slot(fd: int, slot: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK,
                _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, slot * SLOT_BYTES, SLOT_BYTES, 0))


def read_slot(mem: mmap.mmap, slot: int) -> tuple[int, int, float]:
    """``(serial, state, touch_until)`` of ``slot`` (hold its lock)."""
    return _SLOT.unpack_from(mem, slot * SLOT_BYTES)


def write_slot(mem: mmap.mmap, slot: int, serial: int, state: int,
               touch_until: float = 0.0) -> None:
    """Set ``slot`` (hold its lock)."""
    _SLOT.pack_into(mem, slot * SLOT_BYTES, serial, state, touch_until)


def sweep_books(directory: str = SHM_DIR) -> list[str]:
    """Remove the ticket books of this uid whose rank process exited (it could not
    remove its own: killed); returns their names."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(directory), BOOK_PREFIX + "*")):
        name = os.path.basename(path)
        m = BOOK_NAME.fullmatch(name)
        if m is None or ProcessIdentity(int(m[1]), int(m[2])).alive():
            continue
        with contextlib.suppress(OSError):
            if os.lstat(path).st_uid == os.geteuid():
                os.unlink(path)
                removed.append(name)
    return removed


class TicketBook:
    """A rank process's tickets (see the module docstring). Thread-safe: every thread of
    the rank issues and settles its own tickets. ``RuntimeError`` when ``SLOTS`` calls
    are in flight. The book's file is removed by ``close`` or when this object is
    collected; a book left by a killed process is removed by the next book made on the
    host (``sweep_books``)."""

    def __init__(self, directory: str = SHM_DIR) -> None:
        sweep_books(directory)
        me = ProcessIdentity.current()
        self.name = f"{BOOK_PREFIX}{me.pid}-{me.start_ticks}-{secrets.token_hex(8)}"
        path = os.path.join(directory, self.name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, BOOK_BYTES)
            self._mem = mmap.mmap(fd, BOOK_BYTES, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self._fd = fd
        self._lock = threading.Lock()
        self._free = list(range(SLOTS - 1, -1, -1))  # settled: lock before reuse
        self._answered: list[int] = []  # freed after a reply: nobody else touches them
        self._issued: dict[int, int] = {}  # slot -> serial of its ticket not yet freed
        self._serial = 0
        self._close = weakref.finalize(self, _remove, path, fd, self._mem)

    def issue(self) -> TicketRef:
        """A new ``PENDING`` ticket on a free slot."""
        with self._lock:
            answered = bool(self._answered)
            if answered:
                slot = self._answered.pop()
            elif self._free:
                slot = self._free.pop()
            else:
                raise RuntimeError(f"{SLOTS} puts and gets of this process are in flight; "
                                   "no ticket is free")
            self._serial += 1
            serial = self._issued[slot] = self._serial
        if answered:
            write_slot(self._mem, slot, serial, PENDING)
            return TicketRef(self.name, slot, serial)
        lock_slot(self._fd, slot, wait=True)  # a late node call of its last ticket may hold it
        try:
            write_slot(self._mem, slot, serial, PENDING)
        finally:
            unlock_slot(self._fd, slot)
        return TicketRef(self.name, slot, serial)

    def settle(self, ticket: TicketRef) -> None:
        """After a call of ``ticket`` ended without the node actor's reply: return once
        no process will touch its pages (see the module docstring), then free it. A
        ticket already freed returns at once (its slot may carry another ticket now)."""
        with self._lock:
            if self._issued.get(ticket.slot) != ticket.serial:
                return
        lock_slot(self._fd, ticket.slot, wait=True)  # a store call of it: its end
        serial, state, until = self._abandon_locked(ticket)
        if serial == ticket.serial and state == STARTED:  # its node actor died in the call
            time.sleep(max(0.0, until - time.monotonic()))
        self.free(ticket, answered=False)

    def try_settle(self, ticket: TicketRef) -> bool:
        """``settle`` without waiting: True if no process will touch ``ticket``'s pages
        any more (it is then freed), False while a store call of it runs (or, standalone,
        a dead node actor's ``mooncake_client`` may still finish one): the caller keeps
        the pages out of use and asks again later. Idempotent: a ticket already freed
        (settled by another holder of it: one staged round names several staging pools,
        each quarantines the same ticket) is True at once, and its slot, which may carry
        another ticket by now, is neither read nor freed again."""
        with self._lock:  # one settler of a slot at a time (they share the OFD lock)
            if self._issued.get(ticket.slot) != ticket.serial:
                return True
            if not lock_slot(self._fd, ticket.slot):  # a store call of it holds the lock
                return False
            serial, state, until = self._abandon_locked(ticket)
            if serial == ticket.serial and state == STARTED and until > time.monotonic():
                return False
            self._free_locked(ticket, answered=False)
        return True

    def _abandon_locked(self, ticket: TicketRef) -> tuple[int, int, float]:
        """With ``ticket``'s slot locked by the caller: mark it abandoned if no store call
        started it, unlock, and return the slot's (serial, state, until) as read."""
        try:
            serial, state, until = read_slot(self._mem, ticket.slot)
            if serial == ticket.serial and state == PENDING:
                write_slot(self._mem, ticket.slot, serial, ABANDONED)
        finally:
            unlock_slot(self._fd, ticket.slot)
        return serial, state, until

    def free(self, ticket: TicketRef, answered: bool = True) -> None:
        """Give ``ticket``'s slot back. ``answered``: the call got its reply (the node
        actor ended the ticket, or never started it, and will not look at it again), so
        the slot is issued again without a lock; else it is locked when issued again.
        Only the ticket the slot was issued for frees it, and only once: a ticket already
        freed (its slot free, or carrying a later ticket) changes nothing."""
        with self._lock:
            self._free_locked(ticket, answered)

    def _free_locked(self, ticket: TicketRef, answered: bool) -> None:
        if self._issued.get(ticket.slot) != ticket.serial:
            return
        del self._issued[ticket.slot]
        (self._answered if answered else self._free).append(ticket.slot)

    @contextlib.contextmanager
    def held(self) -> Iterator[TicketRef]:
        """A ticket for one call: freed when the call returns, settled when it raises;
        inside ``deferring`` on this thread, a failed call's ticket that a store call
        still holds is handed to the deferral instead of waited for."""
        ticket = self.issue()
        try:
            yield ticket
        except BaseException:
            deferred = getattr(_deferral, "tickets", None)
            if deferred is None:
                self.settle(ticket)
            elif not self.try_settle(ticket):
                deferred.append(ticket)
            raise
        self.free(ticket)

    def close(self) -> None:
        """Remove the book's file (its slots are unusable after)."""
        self._close()


def _remove(path: str, fd: int, mem: mmap.mmap) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(BufferError, ValueError):
        mem.close()
    with contextlib.suppress(OSError):
        os.close(fd)


_deferral = threading.local()


@contextlib.contextmanager
def deferring() -> Iterator[list[TicketRef]]:
    """Within the block, a put or get of this thread that fails while a store call of it
    still runs returns at once instead of waiting for that call's end; its ticket is
    appended to the list yielded, and the caller must keep every page the call named
    out of use until ``try_settle`` of that ticket says True (only for pages of the
    rank's own: a staging pool, never an engine's memory). Not reentrant."""
    tickets: list[TicketRef] = []
    _deferral.tickets = tickets
    try:
        yield tickets
    finally:
        _deferral.tickets = None


_books: dict[int, TicketBook] = {}
_books_lock = threading.Lock()


def process_book() -> TicketBook:
    """This process's ticket book, made at first use (a forked child makes its own)."""
    pid = os.getpid()
    book = _books.get(pid)
    if book is None:
        with _books_lock:
            book = _books.get(pid)
            if book is None:
                book = _books[pid] = TicketBook()
    return book
