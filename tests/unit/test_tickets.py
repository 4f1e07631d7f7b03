"""Tickets, both sides in one process (open-file-description locks of two opens of a book
conflict as those of two processes do): a rank's ticket book and a node actor's desk."""

from __future__ import annotations

import math
import os
import threading
import time

import pytest
from raykv.cache_actors.errors import QuarantinedPagesError
from raykv.cache_actors.node import ticket_desk
from raykv.cache_actors.node.ticket_desk import TicketDesk
from raykv.cache_actors.rank.quarantine import Quarantine
from raykv.cache_actors.tickets import (
    ABANDONED,
    BOOK_BYTES,
    ENDED,
    MAX_AHEAD_S,
    PENDING,
    STARTED,
    TicketBook,
    TicketRef,
    check_deadline,
    deferring,
    read_slot,
    sweep_books,
)


@pytest.fixture
def book(tmp_path):
    b = TicketBook(str(tmp_path))
    yield b
    b.close()


def desk(tmp_path, outlived: bool = False) -> TicketDesk:
    return TicketDesk(outlived_by_store=outlived, directory=str(tmp_path))


def state(book: TicketBook, ticket: TicketRef) -> tuple[int, int]:
    serial, st, _ = read_slot(book._mem, ticket.slot)
    return serial, st


def later(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


def settle_in_thread(book: TicketBook, ticket: TicketRef) -> tuple[threading.Thread, list]:
    done: list = []
    thread = threading.Thread(target=lambda: (book.settle(ticket), done.append(True)))
    thread.start()
    return thread, done


def test_a_ticket_the_rank_abandoned_is_never_started(book, tmp_path):
    ticket = book.issue()
    assert state(book, ticket) == (ticket.serial, PENDING)
    book.settle(ticket)  # the call failed before the node actor started it
    assert state(book, ticket) == (ticket.serial, ABANDONED)
    assert not desk(tmp_path).ticket(ticket, later()).start()


def test_the_rank_waits_for_a_started_store_call_to_end(book, tmp_path):
    ticket = book.issue()
    held = desk(tmp_path).ticket(ticket, later())
    assert held.start()  # CONTROL of the above: a pending ticket starts
    assert state(book, ticket) == (ticket.serial, STARTED)
    thread, done = settle_in_thread(book, ticket)
    thread.join(0.3)
    assert thread.is_alive() and not done  # the store call still holds the pages
    held.end()
    thread.join(30)
    assert done and state(book, ticket) == (ticket.serial, ENDED)


def test_a_stale_serial_or_a_close_deadline_does_not_start(book, tmp_path):
    d = desk(tmp_path)
    first = book.issue()
    book.free(first)  # answered: the slot is reused by the next ticket
    second = book.issue()
    assert second.slot == first.slot and second.serial > first.serial
    assert not d.ticket(first, later()).start()  # a late request of the old serial
    assert state(book, second) == (second.serial, PENDING)
    assert not d.ticket(second, time.monotonic() + 0.001).start()  # within the margin
    assert state(book, second) == (second.serial, ABANDONED)  # and never later either
    assert not d.ticket(second, later()).start()


def test_a_node_that_dies_in_the_call_releases_the_ticket(book, tmp_path):
    ticket = book.issue()
    held = desk(tmp_path).ticket(ticket, later())
    assert held.start()
    del held  # the node actor's process is gone: its open book closes, its lock goes
    book.settle(ticket)  # embedded: nothing can touch the pages any more
    assert state(book, ticket) == (ticket.serial, STARTED)


def test_standalone_a_dead_node_makes_the_rank_wait_until_touch_until(book, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setattr(ticket_desk, "STORE_CALL_LIMIT_S", 0.2)
    ticket = book.issue()
    held = desk(tmp_path, outlived=True).ticket(ticket, later())
    assert held.start()
    until = read_slot(book._mem, ticket.slot)[2]
    del held
    book.settle(ticket)  # mooncake_client may still move the bytes until then
    assert time.monotonic() >= until > 0


def test_the_desk_refuses_what_is_not_a_ticket_book(book, tmp_path):
    d = desk(tmp_path)
    good = book.issue()
    with pytest.raises(ValueError, match="not a ticket book's name"):
        d.ticket(("../etc/passwd", 0, 1), later())
    with pytest.raises(ValueError, match="out of range"):
        d.ticket((good.book, 1 << 20, 1), later())
    with pytest.raises(ValueError, match="out of range"):
        d.ticket((good.book, 0, 0), later())
    with pytest.raises(ValueError, match=r"\(book, slot, serial\)"):
        d.ticket([good.book, 0], later())
    fake = f"raykv-ticket-1-2-{'0' * 16}"
    with pytest.raises(ValueError, match="must run on this node's host"):
        d.ticket((fake, 0, 1), later())
    os.symlink(os.path.join(str(tmp_path), good.book), tmp_path / fake)
    with pytest.raises(ValueError, match="cannot be opened"):  # O_NOFOLLOW
        d.ticket((fake, 0, 1), later())
    os.unlink(tmp_path / fake)
    with open(tmp_path / fake, "wb") as f:
        f.write(b"\0" * (BOOK_BYTES - 1))
    os.chmod(tmp_path / fake, 0o600)
    with pytest.raises(ValueError, match="not a ticket book of this uid"):
        d.ticket((fake, 0, 1), later())
    os.unlink(tmp_path / fake)
    os.mkfifo(tmp_path / fake, 0o600)
    with pytest.raises(ValueError, match="not a ticket book of this uid"):
        d.ticket((fake, 0, 1), later())
    assert d.ticket(good, later()).start()  # CONTROL: the rank's own book


def test_books_of_exited_processes_are_swept(book, tmp_path):
    dead = tmp_path / f"raykv-ticket-999999999-1-{'a' * 16}"
    dead.write_bytes(b"")
    assert sweep_books(str(tmp_path)) == [dead.name]
    assert os.path.exists(os.path.join(str(tmp_path), book.name))  # a live one stays
    book.close()
    assert not os.path.exists(os.path.join(str(tmp_path), book.name))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 1e300, "1", True, None])
def test_a_deadline_must_be_finite_and_near(bad):
    with pytest.raises(ValueError, match="deadline"):
        check_deadline(bad)


def test_deadlines_in_range_pass():
    now = time.monotonic()
    assert check_deadline(now) == now
    assert check_deadline(now - 10) == now - 10  # expired is valid: not run
    assert check_deadline(int(now) + 5) == int(now) + 5
    with pytest.raises(ValueError, match="ahead"):
        check_deadline(now + MAX_AHEAD_S + 5)


def test_try_settle_never_waits_for_a_started_store_call(book, tmp_path):
    ticket = book.issue()
    held = desk(tmp_path).ticket(ticket, later())
    assert held.start()
    t = time.monotonic()
    assert not book.try_settle(ticket)  # the store call still holds the pages
    assert time.monotonic() - t < 0.1
    held.end()
    assert book.try_settle(ticket)  # ended: the pages are the rank's again
    pending = book.issue()
    assert book.try_settle(pending)  # never started: abandoned at once
    assert state(book, pending) == (pending.serial, ABANDONED)


def test_a_failed_call_inside_deferring_hands_its_ticket_over(book, tmp_path):
    """Inside ``deferring`` a call that fails while its store call runs returns at once
    with its ticket deferred; CONTROL: outside it, the same failure waits for the end."""
    d = desk(tmp_path)
    with deferring() as late, pytest.raises(TimeoutError), book.held() as ticket:
        held = d.ticket(ticket, later())
        assert held.start()
        raise TimeoutError  # the rank's deadline, while the store call runs
    assert late == [ticket] and state(book, ticket) == (ticket.serial, STARTED)
    held.end()
    assert book.try_settle(ticket)

    def fail_while_started() -> None:
        with pytest.raises(TimeoutError), book.held() as t:
            started.append(d.ticket(t, later()))
            assert started[0].start()
            raise TimeoutError

    started: list = []
    thread = threading.Thread(target=fail_while_started)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # CONTROL: settle waits for the store call
    started[0].end()
    thread.join(30)
    assert not thread.is_alive()


def test_quarantined_pages_stay_out_of_use_until_the_store_call_ended(book, tmp_path):
    quarantine = Quarantine(lambda: book)
    ticket = book.issue()
    held = desk(tmp_path).ticket(ticket, later())
    assert held.start()
    quarantine.add([ticket], [0, 1])
    quarantine.check([2, 3], "pool")  # other pages are free
    with pytest.raises(QuarantinedPagesError, match="staging pages"):
        quarantine.check([1], "pool")
    held.end()
    quarantine.check([0, 1], "pool")  # released by the node
    assert quarantine.held() == set()


def test_an_answered_slot_is_reissued_without_a_lock_a_settled_one_with_it(book, tmp_path):
    """A slot freed after a reply is written at once when issued again; a slot freed
    without one waits for whoever holds its lock (a late request of its old ticket
    checking it in a node actor). Control: the same wait does not happen for an
    answered slot."""
    first = book.issue()
    held = desk(tmp_path).ticket(first, later())
    assert held.start()  # a node actor holds the slot (a store call of ``first``)
    book.free(first, answered=False)
    result: list = []
    thread = threading.Thread(target=lambda: result.append(book.issue()))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive() and not result  # waits for the node's lock
    held.end()
    thread.join(30)
    second = result[0]
    assert second.slot == first.slot and state(book, second) == (second.serial, PENDING)
    book.free(second)  # answered: no lock taken when it is issued again
    third = book.issue()
    assert third.slot == second.slot and state(book, third) == (third.serial, PENDING)


def test_a_ticket_settled_twice_frees_its_slot_once(book, tmp_path):
    """Two holders of one late ticket (the quarantines of two staging pools named by one
    failed round) each settle it once its store call ended: its slot is freed once, so
    the next two tickets are on two slots and the desk starts both. The old book listed
    the slot twice in its free list: both tickets got it, and the desk refused the first
    (another serial), a spurious "not started" for a live call."""
    d = desk(tmp_path)
    ticket = book.issue()
    held = d.ticket(ticket, later())
    assert held.start()
    assert not book.try_settle(ticket) and not book.try_settle(ticket)  # still running
    held.end()
    assert book.try_settle(ticket) and book.try_settle(ticket)  # both holders let go
    first, second = book.issue(), book.issue()
    assert first.slot != second.slot
    assert d.ticket(first, later()).start() and d.ticket(second, later()).start()


def test_a_freed_ticket_never_frees_the_slot_of_a_later_one(book, tmp_path):
    """A slot is freed only by the ticket it was issued for: settling or freeing an old
    ticket of a slot that now carries another leaves that one alone (the old book freed
    the slot under the live ticket, and the next ticket shared it)."""
    d = desk(tmp_path)
    old = book.issue()
    book.settle(old)  # the call failed before the node actor started it
    live = book.issue()
    assert live.slot == old.slot  # CONTROL of the premise: the slot was reused
    assert book.try_settle(old)  # already settled: nothing of it runs
    book.settle(old)
    book.free(old)
    book.free(old, answered=False)
    assert state(book, live) == (live.serial, PENDING)
    after = book.issue()
    assert after.slot != live.slot
    assert d.ticket(live, later()).start()
