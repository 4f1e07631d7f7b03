"""The node actor's side of tickets (``cache_actors.tickets``): the ranks' ticket books it
opened, and the claim a store call holds on each ticket it carries.

``TicketDesk.ticket(ref, deadline)`` checks a put's or get's ticket before anything is
queued (``ValueError`` for a book that is not a rank's ticket book of this uid: a
symlink, another owner, a wrong size or name); the ``Ticket`` it returns is started by
whichever thread makes the store call (``TransferMerger``), right before the call, and
ended right after it, before any caller is answered.

Books are opened once and kept (at most ``MAX_BOOKS``; the least recently used one is
let go when there are more, and closed once no ticket of it is left): a book whose rank
exited stays open until then, 32 KiB of shared memory each. ``outlived_by_store``: standalone mode,
where ``mooncake_client`` moves the bytes and may finish a transfer after this process
died; a started ticket then tells the rank how long to wait (``touch_until``:
``STORE_CALL_LIMIT_S`` after the start).

Threads: any data thread; the table of open books is guarded by the desk's lock (dict
work only); each ticket is started and ended by the one thread that makes its store call.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
import time
from collections import OrderedDict

from raykv.cache_actors.tickets import (
    ABANDONED,
    BOOK_BYTES,
    BOOK_NAME,
    ENDED,
    PENDING,
    SLOTS,
    START_MARGIN_S,
    STARTED,
    TicketRef,
    lock_slot,
    read_slot,
    unlock_slot,
    write_slot,
)
from raykv.controllers.naming import SHM_DIR

MAX_BOOKS = 4096
STORE_CALL_LIMIT_S = 60.0
"""Standalone mode: how long after its start a store call may still touch the pages of a
node actor that died during it (``touch_until``), in seconds."""
_BUSY_POLL_S = 0.0005


class _Book:
    """One rank's ticket book, open here: its fd (the locks) and its mapping, closed when
    the last reference goes (a started ticket holds one: its lock lives with the fd)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or \
                    st.st_size != BOOK_BYTES or st.st_mode & 0o077:
                raise ValueError(f"{path} is not a ticket book of this uid (a regular file "
                                 f"of {BOOK_BYTES} bytes, mode 0600)")
            self.mem = mmap.mmap(fd, BOOK_BYTES, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def __del__(self) -> None:
        if hasattr(self, "fd"):  # made whole
            self.mem.close()
            os.close(self.fd)


class Ticket:
    """A put's or get's ticket on this node (made by ``TicketDesk.ticket``). ``start()``
    before the store call: True if the call may touch the pages (the ticket is then
    held until ``end()``), False if it must not be made (the rank abandoned it, another
    serial, or its deadline is within ``START_MARGIN_S``). One thread starts and ends it."""

    __slots__ = ("_desk", "_book", "ref", "deadline", "_held")

    def __init__(self, desk: TicketDesk, book: _Book, ref: TicketRef, deadline: float) -> None:
        self._desk, self._book, self.ref, self.deadline = desk, book, ref, deadline
        self._held = False

    def start(self) -> bool:
        book, slot = self._book, self.ref.slot
        late = self.deadline - START_MARGIN_S
        while not lock_slot(book.fd, slot):  # its rank holds it for a moment
            if time.monotonic() >= late:
                return False
            time.sleep(_BUSY_POLL_S)
        serial, state, _ = read_slot(book.mem, slot)
        if serial != self.ref.serial or state != PENDING or time.monotonic() >= late:
            if serial == self.ref.serial and state == PENDING:
                write_slot(book.mem, slot, serial, ABANDONED)  # never later either
            unlock_slot(book.fd, slot)
            return False
        until = time.monotonic() + STORE_CALL_LIMIT_S if self._desk.outlived_by_store else 0.0
        write_slot(book.mem, slot, serial, STARTED, until)
        self._held = True
        return True

    def end(self) -> None:
        """After the store call: the ticket ended, its rank may have its pages back."""
        if not self._held:
            return
        self._held = False
        write_slot(self._book.mem, self.ref.slot, self.ref.serial, ENDED)
        unlock_slot(self._book.fd, self.ref.slot)


class TicketDesk:
    """The ticket books of the ranks this node actor serves (see the module docstring)."""

    def __init__(self, *, outlived_by_store: bool, directory: str = SHM_DIR,
                 max_books: int = MAX_BOOKS) -> None:
        self.outlived_by_store = outlived_by_store
        self._dir = directory
        self._max = max_books
        self._books: OrderedDict[str, _Book] = OrderedDict()
        self._lock = threading.Lock()

    def ticket(self, ref: object, deadline: float) -> Ticket:
        """The ticket ``ref`` (a ``TicketRef`` or its 3-tuple) of a call due by
        ``deadline``; ``ValueError`` naming what is wrong with it."""
        if not isinstance(ref, tuple) or len(ref) != 3:
            raise ValueError(f"a ticket is (book, slot, serial), got {ref!r}")
        ref = TicketRef(*ref)
        if type(ref.book) is not str or BOOK_NAME.fullmatch(ref.book) is None:
            raise ValueError(f"{ref.book!r} is not a ticket book's name")
        if type(ref.slot) is not int or not 0 <= ref.slot < SLOTS or \
                type(ref.serial) is not int or not 0 < ref.serial < 1 << 64:
            raise ValueError(f"ticket slot {ref.slot!r} / serial {ref.serial!r} out of range")
        return Ticket(self, self._open(ref.book), ref, deadline)

    def _open(self, name: str) -> _Book:
        with self._lock:
            book = self._books.get(name)
            if book is not None:
                self._books.move_to_end(name)
                return book
        try:
            book = _Book(os.path.join(self._dir, name))
        except FileNotFoundError:
            raise ValueError(f"no ticket book {name!r} in {self._dir}: the rank must run on "
                             "this node's host") from None
        except OSError as e:  # a symlink (ELOOP), a FIFO (ENXIO), ...
            raise ValueError(f"ticket book {name!r} cannot be opened: {e}") from None
        with self._lock:
            known = self._books.setdefault(name, book)
            while len(self._books) > self._max:  # closed once its last ticket is gone
                self._books.popitem(last=False)
        return known

    def close(self) -> None:
        """Let every book go (each closes once its last ticket is gone)."""
        with self._lock:
            self._books = OrderedDict()
