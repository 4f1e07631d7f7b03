"""A put or get that returned to its rank never touches the rank's pages afterwards (real
Ray, real mooncake_master, embedded and standalone, the local channel and the Ray route).

The node actors hold every store call ``DELAY_S`` s (``store_delay``, inside
the store call, after the pointers were resolved) and the writing rank's deadline is
``TIMEOUT_S`` < ``DELAY_S``: its call fails at its deadline while the store call that
carries it is still running. The rank then reuses the page at once, as an engine does.

- late put: page 0 holds A, the put of K1 fails, the rank writes B into page 0; K1 must
  read back as A or miss, never as B (a store call that read the page after the rank was
  told it failed would store B, under a key every reader then trusts);
- late get: the get of K2 into page 20 fails, the rank writes E into page 20; the page
  must keep E (a late get would overwrite memory the engine gave to another request).

CONTROL (``fixed=False``): the rank's settling of a failed call's ticket replaced by the
old behaviour (return at the deadline, whatever runs) shows B read back and E
overwritten, so each test can fail. The old code (no tickets) failed both the same way.

Staged pools (the engine's memory served through the rank's own staging pages, as vLLM's
KV cache and SGLang's non-shm pools are): the node actor is stopped with SIGSTOP while
the store call of a put or get runs. The call returns at its deadline while the actor is
still stopped (its staging pages quarantined, ``cache_actors.rank.quarantine``), a later
call through those pages fails at once, the engine reuses its page, and after SIGCONT
the key reads back as the bytes of before the return (or misses) and the engine's page
keeps what the engine wrote. CONTROL: the rank settling that ticket by waiting (the
rule for every pool before quarantine) is still held when the actor has been stopped
for ``STOP_S``.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time

import pytest
import ray
import torch
from raykv import CacheClient
from raykv.cache_actors.channel_codec import parse_reply, request
from raykv.cache_actors.data_ops import DataOp
from raykv.cache_actors.errors import DeadlineExceededError, QuarantinedPagesError
from raykv.cache_actors.rank.channel_client import _Link
from raykv.cache_actors.rank.staging_pools import StagedPool, describe_kv_buffer, staging_layout
from raykv.cache_actors.tickets import SLOTS, STARTED, TicketBook, process_book, read_slot
from raykv.controllers import StorageConfig
from raykv.controllers.contract import PoolName, PoolTransfer
from raykv.controllers.object_batch import ObjectBatch

from tests.integration.conftest import MODES, slow_two_nodes
from tests.integration.process_stop import stop_process

DELAY_S = 2.0
TIMEOUT_S = 1.0
READER_TIMEOUT_S = 30.0
"""The deadline of the ranks that only read and write around the call under test: each
of their store calls waits ``DELAY_S`` too, behind whatever the late call left queued, so
the default deadline left little room on a loaded machine (a reader's get ran out of it
once in a CI run)."""
POOL = dict(page_size=4, size=128, layer_num=2, head_num=2, head_dim=8, dtype=torch.float16)
A, B, E, X = 1.0, 2.0, 5.0, 7.0
ROUTES = ("channel", "ray")
STOP_S = 2.0  # the node actor stays stopped this long past the staged call's deadline


@pytest.fixture(scope="module", params=MODES)
def slow_cluster(request):
    with slow_two_nodes(request.param, DELAY_S) as cluster:
        yield cluster


def page(pool, n: int) -> torch.Tensor:
    """Page ``n``'s token slots in every buffer (a view)."""
    buf, lo = pool.kv_buffer, n * pool.page_size
    return buf[:, lo:lo + pool.page_size] if buf.dim() == 5 else buf[lo:lo + pool.page_size]


def slots(n: int) -> torch.Tensor:
    return torch.arange(n * 4, n * 4 + 4)


def rank(uid: str, route: str, timeout_s: float | None = None) -> tuple[CacheClient, object]:
    """A client of this process (on the head node) with a KV pool; ``route``: how its
    puts and gets reach the node actor."""
    extra = {} if timeout_s is None else {"timeout_s": timeout_s}
    client = CacheClient(StorageConfig(model_name=f"final/{uid}", extra_config=extra))
    if route == "ray":
        client._link._local = False  # as a rank whose actor is not on its node
    pool = client.create_host_pool("mha", **POOL)
    client.register_mem_pool_host(pool)
    return client, pool


def old_settle(book: TicketBook, ticket) -> None:
    """CONTROL: what a rank did before tickets: return at the deadline (the ticket is
    only abandoned if no store call holds it)."""
    book.free(ticket, answered=False)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "CONTROL-old"])
@pytest.mark.parametrize("route", ROUTES)
def test_a_late_put_never_stores_the_bytes_written_after_it_failed(
        slow_cluster, uid, route, fixed, monkeypatch):
    if not fixed:
        monkeypatch.setattr(TicketBook, "settle", old_settle)
    writer, wpool = rank(uid, route, TIMEOUT_S)
    reader, rpool = rank(uid, "channel", READER_TIMEOUT_S)
    key = f"{uid}-k1"
    page(wpool, 0).fill_(A)
    with pytest.raises(DeadlineExceededError):
        writer.batch_set_v1([key], slots(0))
    page(wpool, 0).fill_(B)  # the engine reuses the page at once
    time.sleep(DELAY_S + 0.5)  # any store call of the put has ended by now
    until_closed(reader)
    page(rpool, 3).fill_(0)
    (found,) = reader.batch_get_v1([key], slots(3))
    got = set(page(rpool, 3).flatten().tolist())
    if fixed:
        assert not found or got == {A}, (found, got)  # A or a miss, never B
    else:
        assert found and got == {B}, (found, got)  # CONTROL: the late put stored B
    writer.close()
    reader.close()


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "CONTROL-old"])
@pytest.mark.parametrize("route", ROUTES)
def test_a_late_get_never_overwrites_the_page_reused_after_it_failed(
        slow_cluster, uid, route, fixed, monkeypatch):
    if not fixed:
        monkeypatch.setattr(TicketBook, "settle", old_settle)
    writer, wpool = rank(uid, route, TIMEOUT_S)
    reader, rpool = rank(uid, "channel", READER_TIMEOUT_S)
    key = f"{uid}-k2"
    page(rpool, 1).fill_(X)
    assert reader.batch_set_v1([key], slots(1)) == [True]
    page(wpool, 20).fill_(0)
    with pytest.raises(DeadlineExceededError):
        writer.batch_get_v1([key], slots(20))
    page(wpool, 20).fill_(E)  # the engine gives the page to another request
    time.sleep(DELAY_S + 0.5)  # any store call of the get has ended by now
    until_closed(reader)  # the next test's calls are let through
    got = set(page(wpool, 20).flatten().tolist())
    if fixed:
        assert got == {E}, got
    else:
        assert got == {X}, got  # CONTROL: the late get overwrote the reused page
    writer.close()
    reader.close()


@pytest.mark.parametrize("deadline", [math.inf, math.nan, 1e300, "far"],
                         ids=["inf", "nan", "1e300", "now+1e6"])
def test_a_deadline_not_finite_or_too_far_is_refused_on_both_routes(slow_cluster, uid,
                                                                   deadline):
    """Before any byte moves and before the batch is queued (an infinite wait in the node
    actor was the old outcome: ``Condition.wait`` overflowed with the request queued)."""
    client, pool = rank(uid, "channel")
    bad = time.monotonic() + 1e6 if deadline == "far" else deadline
    key = client.owner_claim().key_prefix + f"{uid}-d"  # its own key space
    batch = ObjectBatch([key], [pool.name], [0], [64], pool.handle.epoch)
    actor = slow_cluster.node_actors[client.node_id]
    channel = _Link(ray.get(actor.channel_path.remote()), 30.0, time.monotonic() + 30,
                    client.owner_claim())
    ok, error = parse_reply(channel.exchange(request(DataOp.PUT, bad, [batch, None]),
                                             time.monotonic() + 30))
    channel.close()
    assert not ok and isinstance(error, ValueError) and "deadline" in str(error), error
    with pytest.raises(ValueError, match="deadline"):
        ray.get(actor.get.remote(batch, claim=client.owner_claim(), deadline=bad))
    # CONTROL: the same batch with the caller's own deadline moves, on both routes
    assert client._link.data(DataOp.PUT, batch) == [0]
    assert ray.get(actor.get.remote(batch, claim=client.owner_claim(),
                                    deadline=time.monotonic() + 30)) == [64]
    client.close()


def staged_rank(uid: str, route: str) -> tuple[CacheClient, torch.Tensor]:
    """A client with ``TIMEOUT_S`` whose KV pool is engine memory (a private tensor of
    ``POOL``'s geometry) served through a staging pool of 2 + 2 pages; the tensor."""
    client = CacheClient(StorageConfig(model_name=f"final/{uid}",
                                       extra_config={"timeout_s": TIMEOUT_S}))
    if route == "ray":
        client._link._local = False
    pool, engine = staged_pool(client)
    client.register_mem_pool_host(pool)
    return client, engine


def staged_pool(client: CacheClient) -> tuple[StagedPool, torch.Tensor]:
    """Engine memory (a private tensor of ``POOL``'s geometry) served through a staging
    pool of ``client`` of 2 + 2 pages; the tensor."""
    engine = torch.zeros(2, POOL["size"], POOL["layer_num"], POOL["head_num"],
                         POOL["head_dim"], dtype=POOL["dtype"])
    memory = describe_kv_buffer(engine, POOL["page_size"])
    staging = client.create_host_pool(staging_layout(memory.layout, 4), per_process=True)
    return StagedPool(memory, staging, 2), engine


def waiting_try_settle(book: TicketBook, ticket) -> bool:
    """CONTROL: settle a deferred ticket by waiting for its store call (no quarantine)."""
    book.settle(ticket)
    return True


def until_started() -> None:
    """Wait (bounded) until a store call of one of this process's tickets has started."""
    book = process_book()
    deadline = time.monotonic() + 30
    while not any(read_slot(book._mem, slot)[1] == STARTED for slot in range(SLOTS)):
        assert time.monotonic() < deadline, "no store call started"
        time.sleep(0.01)


def until_closed(client: CacheClient) -> None:
    """Wait (bounded) until this process's breaker on ``client``'s node actor lets a call
    through again (the stop made it open)."""
    deadline = time.monotonic() + 60
    while client.breaker_counts()["state"] == "open":
        assert time.monotonic() < deadline, "the breaker never let a call through again"
        time.sleep(0.1)


@pytest.mark.parametrize(("op", "route", "fixed"), [
    ("put", "channel", True), ("put", "ray", True), ("get", "channel", True),
    ("put", "channel", False)],
    ids=["put-channel", "put-ray", "get-channel", "CONTROL-put-waits"])
def test_a_staged_call_returns_at_its_deadline_while_the_node_actor_is_stopped(
        slow_cluster, uid, op, route, fixed, monkeypatch):
    if not fixed:
        monkeypatch.setattr(TicketBook, "try_settle", waiting_try_settle)
    writer, engine = staged_rank(uid, route)
    reader, rpool = rank(uid, "channel")
    until_closed(reader)  # an earlier test's deadline may have opened it
    pid = ray.get(slow_cluster.node_actors[writer.node_id].health.remote())["pid"]
    key, n = f"{uid}-k3", 20
    engine_page = engine[:, n * 4:n * 4 + 4]
    if op == "put":
        engine_page.fill_(A)
        call = lambda: writer.batch_set_v1([key], slots(n))  # noqa: E731
    else:
        page(rpool, 1).fill_(X)
        assert reader.batch_set_v1([key], slots(1)) == [True]
        call = lambda: writer.batch_get_v1([key], slots(n))  # noqa: E731
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = call()
        except Exception as e:  # noqa: BLE001 - checked below
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    until_started()  # its store call runs (it lasts DELAY_S)
    stop_process(pid)
    try:
        thread.join(TIMEOUT_S + STOP_S)
        returned_while_stopped = not thread.is_alive()
        if returned_while_stopped:
            engine_page.fill_(E if op == "get" else B)  # the engine reuses its page
            # the call's staging pages are quarantined: a call that needs them fails at
            # once (nothing copied into them, nothing sent)
            with pytest.raises(QuarantinedPagesError):
                (writer.batch_set_v1([f"{key}-2"], slots(n)) if op == "put"
                 else writer.batch_get_v1([key], slots(n)))
    finally:
        os.kill(pid, signal.SIGCONT)
    thread.join(60)
    if not fixed:
        assert not returned_while_stopped, out  # CONTROL: held until SIGCONT
        assert isinstance(out.get("error"), DeadlineExceededError), out
        until_closed(writer)  # no probe left running into the cluster's teardown
        return
    assert returned_while_stopped and isinstance(out.get("error"), DeadlineExceededError), out
    until_closed(writer)
    staged = writer._pools.staged[PoolName.KV]
    deadline = time.monotonic() + 60  # the late store call lasts DELAY_S once continued
    while staged.quarantine.held():  # released once the node ended the ticket
        assert time.monotonic() < deadline, "the late store call never ended"
        time.sleep(0.1)
    if op == "get":
        assert set(engine_page.flatten().tolist()) == {E}  # the late get wrote staging only
    else:
        page(rpool, 3).fill_(0)
        (found,) = reader.batch_get_v1([key], slots(3))
        got = set(page(rpool, 3).flatten().tolist())
        assert not found or got == {A}, (found, got)  # A or a miss, never B
    writer.close()
    reader.close()


def test_one_late_round_of_two_staged_pools_frees_its_ticket_once(slow_cluster, uid):
    """A put of KV and draft pages, both engine memory served through staging pools (as
    SGLang's staged KV with a draft pool), runs out of its deadline while its one store
    call is held (the node actor stopped in it): both pools quarantine their staging page
    under the call's one ticket. Once the store call ended and both let go, the ticket's
    slot is free once: every ticket the rank's book issues after is on a slot of its own.
    The old book freed the slot once per pool: two tickets then shared it (two live calls
    on one slot: the node actor refuses the first as another serial, and issuing waits on
    another call's store call)."""
    writer, _ = staged_rank(uid, "channel")
    draft, _ = staged_pool(writer)
    writer.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    staged = [writer._pools.staged[PoolName.KV], draft]
    until_closed(writer)  # an earlier test's deadline may have opened it
    pid = ray.get(slow_cluster.node_actors[writer.node_id].health.remote())["pid"]
    roles = (PoolName.KV, PoolName.DRAFT)
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = writer.batch_set_v2(
                [PoolTransfer(role, [f"{uid}-k4"], slots(20)) for role in roles])
        except Exception as e:  # noqa: BLE001 - checked below
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    until_started()  # its store call runs
    stop_process(pid)
    try:
        thread.join(60)
        assert isinstance(out.get("error"), DeadlineExceededError), out
        # the premise: one ticket, quarantined by both pools while its store call is held
        assert [sp.quarantine.held() for sp in staged] == [{0}, {0}]
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while any(sp.quarantine.held() for sp in staged):  # each pool lets go on its own
        assert time.monotonic() < deadline, "the late store call never ended"
        time.sleep(0.1)
    book = process_book()
    issued = []
    with contextlib.suppress(RuntimeError):  # every free slot of the book, issued
        while len(issued) <= SLOTS:
            issued.append(book.issue())
    for ticket in issued:
        book.free(ticket, answered=False)
    # each slot once (the old book issued 1,025 tickets, one slot twice); a slot another
    # test's late call still holds is not issued
    assert len({t.slot for t in issued}) == len(issued) <= SLOTS
    until_closed(writer)
    writer.close()
