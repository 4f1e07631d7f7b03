"""L2Pools, the node actor's L2 cache, against fakes of the pool table and the store:
capacity, owners, fills held for the reader, write-behind (retried when a put fails),
a reset."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest
from raykv.cache_actors.errors import DeadlineExceededError, UnknownPoolError
from raykv.cache_actors.host_pools import PoolHandle
from raykv.cache_actors.node.l2_pools import L2Pools, l2_family
from raykv.cache_actors.processes import ProcessIdentity
from raykv.controllers.node_records import L2Stats
from raykv.controllers.ownership import OwnerClaim
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.result_codes import FULL, PRESENT, WRITING

ME = tuple(dataclasses.astuple(ProcessIdentity.current()))  # a live holder: never reaped
GONE = (1, 1)  # pid 1 with another start: a holder whose process is gone
A = OwnerClaim("m_", key_prefix="m_")
B = OwnerClaim("n_", key_prefix="n_")


def layout(pages: int = 64) -> PoolLayout:
    return PoolLayout.vllm(page_size=4, size=4 * pages, layer_num=1, head_num=1,
                           head_dim=8, dtype="bfloat16", itemsize=2)


class FakeNode:
    """The node's pools (as ``NodePools``: no quota) and its store mover (as
    ``StoreMover``: claims pass as they are): ``stored`` holds the L3 objects (key -> the
    page offset they were put from); the next ``fail_puts`` puts fail."""

    limits: dict = {}

    def __init__(self) -> None:
        self.pools: dict[str, PoolHandle] = {}
        self.stored: dict[str, int] = {}
        self.calls: list[tuple[str, list[str]]] = []
        self.fail_puts = 0

    @property
    def table(self) -> SimpleNamespace:
        return SimpleNamespace(pools=self.pools)

    def verify(self, claim):
        return claim

    def create(self, name, lay, process, owner) -> PoolHandle:
        self.pools[name] = PoolHandle(name, "/dev/shm/" + name, lay)
        return self.pools[name]

    def destroy(self, name, owner) -> bool:
        return self.pools.pop(name, None) is not None

    def move(self, op, batch, deadline, caller) -> list[int]:
        self.calls.append((op, list(batch.keys)))
        gone = set(batch.pools) - set(self.pools)
        if gone:  # as NodePools.resolve: memory that left is never read
            raise UnknownPoolError(f"the batch names pools {gone} this node does not have")
        if op == "put":
            if self.fail_puts > 0:
                self.fail_puts -= 1
                return [-800] * len(batch)
            self.stored.update(zip(batch.keys, batch.offsets, strict=True))
            return [0] * len(batch)
        return [s if k in self.stored else -704 for k, s in zip(batch.keys, batch.sizes,
                                                                strict=True)]


def l2(node: FakeNode, l2_bytes: int = 1 << 20) -> L2Pools:
    return L2Pools(node, node, l2_bytes=l2_bytes)


def flushed(pools: L2Pools, n: int, counter: str = "") -> L2Stats:
    """Wait until the write-behind ended for ``n`` objects (or ``counter`` reached
    ``n``); the stats then."""
    deadline = time.monotonic() + 5
    while True:
        s = pools.stats()
        if (getattr(s, counter) if counter else s.l3_put + s.l3_put_failed) >= n:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.005)


def test_open_sizes_the_pool_to_what_is_left_and_shares_it():
    node = FakeNode()
    pools = l2(node, l2_bytes=10 * 64)  # a page is 4 slots x 8 x 2 bytes = 64 bytes
    h = pools.open((0, 0), layout(), 6, A)
    assert h.layout.num_pages == 6 and h.name.startswith(l2_family("m_", (0, 0)))
    assert pools.open((0, 0), layout(), 50, A) == h  # another engine: the same pool
    assert pools.open((1, 0), layout(), 50, A).layout.num_pages == 4  # what is left
    assert pools.open((2, 0), layout(), 50, A) is None  # no room
    with pytest.raises(ValueError, match="owner claim"):
        pools.open((0, 0), layout(), 6, None)


@pytest.mark.parametrize("share", [2, 1])
def test_each_rank_of_a_group_gets_its_share_of_the_node(share):
    """The ranks of one TP group on a node open their L2 pools one after the other, each
    asking for as many pages as fit (the vLLM connector's default with
    ``async_transfers``): with ``share`` = the group's ranks each gets its part of the
    node's L2 bytes. CONTROL (``share`` 1, as every rank asked before): the first rank
    takes the whole node and the second gets no L2 at all."""
    pools = l2(FakeNode(), l2_bytes=10 * 64)  # a page is 64 bytes
    first = pools.open((0, 0), layout(), 1 << 31, A, share)
    second = pools.open((1, 0), layout(), 1 << 31, A, share)
    if share == 1:
        assert first.layout.num_pages == 10 and second is None
    else:
        assert first.layout.num_pages == second.layout.num_pages == 5


@pytest.mark.parametrize("share", [0, -1, 1.5, "2", True])
def test_a_bad_share_is_refused_before_a_pool_is_made(share):
    pools = l2(FakeNode(), l2_bytes=10 * 64)
    with pytest.raises(ValueError, match="share"):
        pools.open((0, 0), layout(), 4, A, share)
    assert pools.open((0, 0), layout(), 4, A).layout.num_pages == 4  # nothing was made


def test_ops_need_the_pools_owner_and_keys_of_its_prefix():
    node = FakeNode()
    pools = l2(node)
    h = pools.open((0, 0), layout(), 8, A)
    with pytest.raises(UnknownPoolError, match="no L2 pool"):
        pools.reserve(ME, h.name, ["n_x"], B)
    with pytest.raises(ValueError, match="prefix"):
        pools.reserve(ME, h.name, ["n_x"], A)
    with pytest.raises(UnknownPoolError, match="no L2 pool"):
        pools.acquire(ME, "l2-other", ["m_x"], False, A)
    assert pools.lookup(["n_x"], 1, B) == 0


def test_save_write_behind_then_lookup_and_read():
    node = FakeNode()
    pools = l2(node)
    h = pools.open((0, 0), layout(), 8, A)
    pages = pools.reserve(ME, h.name, ["m_a", "m_b"], A)
    assert pools.reserve(GONE, h.name, ["m_a"], A) == [WRITING]
    assert pools.lookup(["m_a", "m_b"], 1, A) == 0  # not committed: not readable
    assert pools.commit(ME, h.name, ["m_a", "m_b"], pages, [True, True], A) == 2
    assert pools.reserve(GONE, h.name, ["m_a"], A) == [PRESENT]
    assert pools.stats().l3_put_submitted == 2  # handed over at the commit
    s = flushed(pools, 2)
    assert s.l3_put + s.l3_put_failed == s.l3_put_submitted == 2  # ended
    assert set(node.stored) == {"m_a", "m_b"}
    assert pools.lookup(["m_a", "m_b", "m_c"], 1, A) == 2
    assert pools.lookup(["m_a", "m_b"], 2, A) == 1  # two keys per page (TP 2)
    assert pools.acquire(ME, h.name, ["m_a", "m_b"], True, A) == pages
    assert [op for op, _ in node.calls] == ["put"]  # from L2: no get


def test_a_commit_of_pages_that_hold_other_keys_is_refused():
    node = FakeNode()
    pools = l2(node)
    h = pools.open((0, 0), layout(), 8, A)
    pages = pools.reserve(ME, h.name, ["m_a"], A)
    with pytest.raises(ValueError, match="do not hold"):
        pools.commit(ME, h.name, ["m_z"], pages, [True], A)


def test_fill_reads_l3_into_pages_held_for_the_reader():
    node = FakeNode()
    node.stored = {"m_a": 0, "m_b": 0}
    pools = l2(node)
    h = pools.open((0, 0), layout(), 2, A)
    got = pools.acquire(ME, h.name, ["m_a", "m_b", "m_c"], True, A)
    assert len(got) == 2 and pools.counts["filled"] == 2
    assert pools.counts["fill_failed"] == 0  # m_c: no page left to read it into
    assert pools.reserve(GONE, h.name, ["m_z"], A) == [FULL]  # both held by ME, alive
    got_again = pools.acquire(ME, h.name, ["m_a", "m_b"], False, A)  # releases, re-holds
    assert got_again == got
    assert [op for op, _ in node.calls] == ["get"]


def test_a_failed_fill_is_a_miss_and_frees_its_pages():
    node = FakeNode()
    pools = l2(node)
    h = pools.open((0, 0), layout(), 2, A)
    assert pools.acquire(ME, h.name, ["m_a"], True, A) == []
    assert pools.counts["fill_failed"] == 1
    assert all(p >= 0 for p in pools.reserve(GONE, h.name, ["m_y", "m_z"], A))


def test_a_fill_that_ends_past_its_readers_deadline_holds_nothing_for_the_reader():
    """The store's get of a fill ends after the reader's deadline, and the reader has
    made its next op meanwhile (an acquire that releases what it held): the fill's
    pages become ready (the bytes are right: the get ended) but are held for nobody,
    and the reader is told ``DeadlineExceededError``; a writer then finds the page
    evictable. (Before: the late commit held the page for the reader past its next
    op, unknown to it: pinned until that thread's op after, or for good.)"""
    class LateNode(FakeNode):
        def move(self, op, batch, deadline, claim):
            while time.monotonic() < deadline:  # the store call outlives the deadline
                time.sleep(0.005)
            assert pools.acquire(ME, name, [], False, A) == []  # the reader's next op
            return super().move(op, batch, deadline, claim)

    node = LateNode()
    node.stored = {"m_a": 0}
    pools = l2(node)
    name = pools.open((0, 0), layout(), 1, A).name
    with pytest.raises(DeadlineExceededError):
        pools.acquire(ME, name, ["m_a"], True, A, deadline=time.monotonic() + 0.05)
    s = pools.stats().pools[name]
    assert (s.ready, s.held) == (1, 0)
    assert pools.reserve(GONE, name, ["m_z"], A) == [0]  # the page was evictable


def one_dirty_page(node: FakeNode, attempts: int, backoff_s: float = 0.01):
    """A one-page pool whose page holds ``m_a``, committed (its write-behind started)."""
    pools = l2(node)
    pools.write_behind.attempts, pools.write_behind.backoff_s = attempts, backoff_s
    h = pools.open((0, 0), layout(), 1, A)
    pages = pools.reserve(ME, h.name, ["m_a"], A)
    pools.commit(ME, h.name, ["m_a"], pages, [True], A)
    return pools, h, pages[0]


def test_a_failed_write_behind_is_retried_and_its_page_kept_until_it_lands():
    """Puts fail for a while: the write-behind tries again after a back-off, and the
    page stays dirty meanwhile (L2 has no page for another key, never evicts it);
    once a put lands the object is in L3 and the page is evictable."""
    node = FakeNode()
    node.fail_puts = 10**6
    pools, h, p = one_dirty_page(node, attempts=1000, backoff_s=0.002)
    s = flushed(pools, 2, "l3_put_retried")
    assert s.l3_put_pending == 1 and s.l3_put == s.l3_put_failed == 0
    assert s.pools[h.name].dirty == 1
    assert pools.reserve(ME, h.name, ["m_b"], A) == [FULL]  # dirty: never evicted
    node.fail_puts = 0
    s = flushed(pools, 1)
    assert s.l3_put == 1 and s.l3_put_failed == 0 and "m_a" in node.stored
    assert s.pools[h.name].dirty == 0 and s.l3_put_pending == 0
    assert pools.reserve(ME, h.name, ["m_b"], A) == [p]  # flushed: evicted for m_b


@pytest.mark.parametrize("attempts", [3, 1])
def test_a_write_behind_that_fails_every_time_is_counted_then_evictable(attempts):
    """Every put fails: after ``attempts`` puts the object is counted in
    ``l3_put_failed`` (a hole in L3, never silent), stays readable in L2, and its page
    becomes evictable (L2 is not held hostage by L3). Control (attempts=1, the rule
    before retries): one put, nothing retried."""
    node = FakeNode()
    node.fail_puts = 10**6
    pools, h, p = one_dirty_page(node, attempts)
    s = flushed(pools, 1)
    assert s.l3_put_failed == 1 and s.l3_put == 0
    assert s.l3_put_retried == attempts - 1
    assert [op for op, _ in node.calls] == ["put"] * attempts
    assert "m_a" not in node.stored
    assert pools.resident(["m_a"], A.owner) == [True]  # still right in L2
    assert s.pools[h.name].dirty == 0
    assert pools.reserve(ME, h.name, ["m_b"], A) == [p]  # evictable: evicted for m_b


def test_a_retry_into_a_pool_that_left_the_node_is_dropped():
    """The pool is reset while its page waits for a retry: the retry is not run (its
    memory is no L2 pool any more) and the object is counted as never put."""
    node = FakeNode()
    node.fail_puts = 10**6
    pools, h, p = one_dirty_page(node, attempts=1000, backoff_s=0.05)
    flushed(pools, 1, "l3_put_retried")
    pools.reset()
    s = flushed(pools, 1, "l3_put_failed")
    puts = len(node.calls)
    time.sleep(0.2)  # several back-offs: no put runs any more
    assert len(node.calls) == puts and s.l3_put == 0 and s.l3_put_pending == 0
    assert s.l3_put_failed == s.l3_put_submitted == 1  # ended, as failed


def test_reset_forgets_every_pool_and_open_makes_a_new_one():
    node = FakeNode()
    pools = l2(node)
    h = pools.open((0, 0), layout(), 4, A)
    pages = pools.reserve(ME, h.name, ["m_a"], A)
    pools.commit(ME, h.name, ["m_a"], pages, [True], A)
    pools.reset()
    assert pools.lookup(["m_a"], 1, A) == 0
    with pytest.raises(UnknownPoolError, match="no L2 pool"):
        pools.acquire(ME, h.name, ["m_a"], False, A)
    h2 = pools.open((0, 0), layout(), 4, A)
    assert h2.name != h.name and h.name not in node.pools  # the old one removed


def test_pages_of_a_holder_whose_process_is_gone_are_released_when_short():
    node = FakeNode()
    pools = l2(node)
    h = pools.open((0, 0), layout(), 1, A)
    (p,) = pools.reserve(GONE, h.name, ["m_a"], A)
    assert pools.reserve(ME, h.name, ["m_b"], A) == [p]  # GONE's write abandoned
    with pytest.raises(ValueError, match="do not hold"):
        pools.commit(GONE, h.name, ["m_a"], [p], [True], A)


def test_another_geometry_of_the_same_bytes_is_refused():
    node = FakeNode()
    pools = l2(node)
    pools.open((0, 0), layout(), 4, A)
    other = PoolLayout.vllm(page_size=4, size=16, layer_num=2, head_num=1, head_dim=4,
                            dtype="bfloat16", itemsize=2)  # 64 bytes a page too
    assert other.object_sizes == layout().object_sizes
    with pytest.raises(ValueError, match="holds pages of"):
        pools.open((0, 0), other, 4, A)


def test_threads_of_one_process_hold_pages_apart_and_an_ended_thread_is_reaped():
    """``L2Link.holder`` names the calling thread: the main thread is the process, a
    second thread another holder. A read the load thread holds survives the step
    thread's next op (which releases only its own pages), so no page is re-filled under
    a copy; once the thread has ended its pages are reaped when pages run short.
    Control: with one holder for the whole process (the rule before), the step thread's
    reserve releases the load thread's read and hands its page to another key."""
    import threading

    from raykv.cache_actors.rank.l2_link import L2Link

    link = L2Link.__new__(L2Link)
    link._local = threading.local()
    main = link.holder
    assert main == ME
    seen, done = [], threading.Event()
    t = threading.Thread(target=lambda: (seen.append(link.holder), done.wait(10)))
    t.start()
    while not seen:
        time.sleep(0.001)
    (thread,) = seen
    assert thread != main and thread[0] != ME[0]

    def one_page_read_by(reader):
        node = FakeNode()
        pools = l2(node)
        h = pools.open((0, 0), layout(), 1, A)
        (p,) = pools.reserve(main, h.name, ["m_a"], A)
        pools.commit(main, h.name, ["m_a"], [p], [True], A)
        flushed(pools, 1)
        assert pools.acquire(reader, h.name, ["m_a"], False, A) == [p]  # being copied
        return pools, h, p

    try:
        pools, h, p = one_page_read_by(thread)
        assert pools.reserve(main, h.name, ["m_b"], A) == [FULL]  # the read's page stays
    finally:
        done.set()
        t.join()
    gone = time.monotonic() + 10  # the kernel thread ends a moment after join returns
    while ProcessIdentity(*thread).alive() and time.monotonic() < gone:
        time.sleep(0.01)
    assert ProcessIdentity(*thread).alive() is False
    assert pools.reserve(main, h.name, ["m_c"], A) == [p]  # its thread ended: reaped
    pools, h, p = one_page_read_by(main)  # control: one holder per process
    assert pools.reserve(main, h.name, ["m_b"], A) == [p]  # the read page went to m_b


def test_a_pool_removed_and_opened_again_gets_a_name_never_used_before():
    """An L2 pool removed (``destroy_pool``: the pool goes, then ``forget``) and opened
    again is new memory: it gets a new name, so an engine still mapping the old memory
    finds its pool gone (and opens L2 again) instead of reserving and committing pages
    of the new index that it writes into the old memory (readers would be given pages
    nobody wrote), and a write-behind put still queued for the old pool fails instead of
    putting the new memory's bytes to L3 under the old pool's keys. Control (the rule
    before: one name per deployment, rank and incarnation): the old name served the new
    pool, and ``m_b`` went to L3 from a page of the new memory nobody wrote."""
    import threading

    node = FakeNode()
    gate, first = threading.Event(), threading.Event()
    move = node.move

    def slow_first_put(op, batch, deadline, caller):
        if op == "put" and not first.is_set():
            first.set()
            gate.wait(5)  # the write-behind is busy: later commits wait in its queue
        return move(op, batch, deadline, caller)
    node.move = slow_first_put
    pools = L2Pools(node, node, l2_bytes=1 << 20)
    h = pools.open((0, 0), layout(), 4, A)
    for key in ("m_a", "m_b"):
        pages = pools.reserve(ME, h.name, [key], A)
        pools.commit(ME, h.name, [key], pages, [True], A)
        first.wait(5)
    assert node.destroy(h.name, A.owner)  # NodeService.destroy_pool
    pools.forget(h.name)
    h2 = pools.open((0, 0), layout(), 4, A)
    assert h2.name != h.name and h2.name.startswith(l2_family("m_", (0, 0)))
    with pytest.raises(UnknownPoolError, match="no L2 pool"):
        pools.reserve(ME, h.name, ["m_c"], A)
    assert pools.open((0, 0), layout(), 4, A) == h2  # another engine: the same pool
    gate.set()
    s = flushed(pools, 2)
    assert "m_b" not in node.stored and s.l3_put_failed >= 1


@pytest.mark.parametrize("bad", [("x", 1), (None, 1), (1, 2, 3), (-1, 1), (0, 1),
                                 (True, 1), (1.5, 1), [7, 1]])
def test_a_holder_that_is_no_process_is_refused_and_never_poisons_the_pool(bad):
    """A holder is a thread, ``(pid > 0, start ticks)``: anything else is refused with
    ``ValueError`` before the index is touched (the Ray route checks no argument
    types). Control (the rule before): ``("x", 1)`` took a page, then every
    reservation that found the pool full failed with ``TypeError`` in the reaping of
    dead holders, for every engine of the deployment, for good; ``(-1, 1)`` named the
    node's own fill holder, and released pages a fill's store call was writing."""
    node = FakeNode()
    pools = l2(node)
    h = pools.open((0, 0), layout(), 1, A)
    for op in (lambda: pools.reserve(bad, h.name, ["m_a"], A),
               lambda: pools.acquire(bad, h.name, ["m_a"], True, A),
               lambda: pools.commit(bad, h.name, ["m_a"], [0], [True], A)):
        with pytest.raises(ValueError, match="holder"):
            op()
    (p,) = pools.reserve(ME, h.name, ["m_b"], A)
    assert pools.reserve(GONE, h.name, ["m_c"], A) == [FULL]  # ME is alive: kept
    assert pools.commit(ME, h.name, ["m_b"], [p], [True], A) == 1


def test_a_commit_hands_its_pages_to_the_write_behind_under_the_lock_of_its_counters():
    """``WriteBehind.submit`` counts ``submitted`` and is called under ``L2Pools``' lock
    (its contract), so that concurrent commits never lose a count and ``stats``
    never shows more objects ended (``l3_put`` + ``l3_put_failed``) than handed over.
    Control (the rule before): the commit called it after leaving the lock."""
    node = FakeNode()
    pools = l2(node)
    h = pools.open((0, 0), layout(), 4, A)
    behind, seen = pools.write_behind, []
    submit = behind.submit
    behind.submit = lambda *a: (seen.append(pools._lock.locked()), submit(*a))[1]
    pages = pools.reserve(ME, h.name, ["m_a", "m_b"], A)
    assert pools.commit(ME, h.name, ["m_a", "m_b"], pages, [True, True], A) == 2
    assert seen == [True]
    assert flushed(pools, 2).l3_put_submitted == 2


def late_commit(pools: L2Pools) -> int:
    """A rank's save: ``reserve`` gave page p for ``m_a``; its commit outlived the
    rank's deadline, so the rank made its next op (a reserve: p free again, then p for
    ``m_a`` once more) and is writing p; then the old commit reaches the pool (its
    thread was held up past the deadline). What that commit answers."""
    h = pools.open((0, 0), layout(), 1, A)
    (p,) = pools.reserve(ME, h.name, ["m_a"], A)
    assert pools.reserve(ME, h.name, ["m_a"], A) == [p]  # the rank's next op
    return pools.commit(ME, h.name, ["m_a"], [p], [True], A,
                        deadline=time.monotonic() - 0.001)


def test_an_op_its_caller_gave_up_on_changes_nothing_after_the_callers_next_op():
    """The late commit (``late_commit``) is refused and changes nothing: p is not made
    readable while the rank writes it; a late reserve or acquire is refused the same,
    and releases nothing the rank holds; the rank's own commit, in time, publishes p."""
    pools = l2(FakeNode())
    with pytest.raises(DeadlineExceededError, match="changed nothing"):
        late_commit(pools)
    name = pools.open((0, 0), layout(), 1, A).name
    past = time.monotonic() - 0.001
    with pytest.raises(DeadlineExceededError, match="changed nothing"):
        pools.reserve(ME, name, ["m_b"], A, deadline=past)
    with pytest.raises(DeadlineExceededError, match="changed nothing"):
        pools.acquire(ME, name, ["m_a"], False, A, deadline=past)
    assert pools.lookup(["m_a"], 1, A) == 0  # p is not readable
    assert pools.reserve(GONE, name, ["m_a"], A) == [WRITING]  # still being written
    assert pools.commit(ME, name, ["m_a"], [0], [True], A,  # the pool's one page, p
                        deadline=time.monotonic() + 5) == 1  # in time: published
    assert pools.lookup(["m_a"], 1, A) == 1


def test_control_without_the_deadline_check_a_late_commit_publishes_a_page_being_written(
        monkeypatch):
    """Control: with the check off (the rule before), the late commit publishes p while
    the rank is writing it, and a reader is given a page whose bytes are not written."""
    import raykv.cache_actors.node.l2_pools as l2_pools

    monkeypatch.setattr(l2_pools, "in_time", lambda deadline: None)
    pools = l2(FakeNode())
    assert late_commit(pools) == 1
    assert pools.lookup(["m_a"], 1, A) == 1


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), "soon", True, 1e300])
def test_an_l2_op_refuses_a_deadline_that_is_no_finite_time_ahead(bad):
    """A deadline on the Ray route is whatever the caller sent: one that is no finite
    number of seconds, or lies too far ahead, is refused with ``ValueError`` before the
    pool changes (it would have turned the check off)."""
    pools = l2(FakeNode())
    name = pools.open((0, 0), layout(), 1, A).name
    with pytest.raises(ValueError, match="deadline"):
        pools.reserve(ME, name, ["m_a"], A, deadline=bad)
    assert pools.reserve(ME, name, ["m_a"], A, deadline=time.monotonic() + 5) == [0]


def test_pages_an_acquire_serves_are_touches_of_the_node():
    """An L2 hit is a touch (a page kept hot in L2 never reaches the store again: without
    it the journal saw only its first put); a miss is not."""
    from raykv.cache_actors.node.touch_journal import TouchJournal

    node, journal = FakeNode(), TouchJournal()
    pools = L2Pools(node, node, l2_bytes=1 << 20, touches=journal)
    h = pools.open((0, 0), layout(), 8, A)
    pages = pools.reserve(ME, h.name, ["m_a", "m_b"], A)
    assert pools.commit(ME, h.name, ["m_a", "m_b"], pages, [True, True], A) == 2
    assert journal.recent() == []  # a save is not a hit
    assert pools.acquire(ME, h.name, ["m_a", "m_c", "m_b"], False, A) == pages[:1]
    assert [(k, t.hits, t.size) for k, t in journal.recent()] == [
        ("m_a", 1, layout().object_bytes)]
