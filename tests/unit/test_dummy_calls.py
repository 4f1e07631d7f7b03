"""A standalone node's dummy-client calls (``cache_actors.node.dummy_calls``, pure logic
over a fake client and simulated time): a call that failed whole and at once, as one
drawn on a dead connection to a restarted ``mooncake_client`` fails (or one the dummy
refused while it reconnects), is sent again; anything else is answered as it came."""

import pytest
from raykv.cache_actors.node import dummy_calls
from raykv.cache_actors.node.dummy_calls import REDIAL_S, DummyCalls
from raykv.controllers.result_codes import RPC_FAIL

UP = lambda: True  # noqa: E731  mooncake_client is up


class Clock:
    """Simulated time for ``dummy_calls`` (its ``time.monotonic`` and ``time.sleep``)."""

    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(dummy_calls, "time", c)
    return c


class Pool:
    """A dummy client whose next ``dead`` calls break (every object ``broken``: a dead
    connection drawn, or the dummy disconnected), each taking ``cost`` seconds of
    ``clock``; then ``answer``."""

    def __init__(self, dead: int, answer: list[int], broken: int = RPC_FAIL,
                 clock: Clock | None = None, cost: float = 0.0) -> None:
        self.dead, self.answer, self.broken, self.calls = dead, answer, broken, 0
        self.clock, self.cost = clock, cost

    def _draw(self, n: int) -> list[int]:
        self.calls += 1
        if self.clock is not None:
            self.clock.now += self.cost
        if self.dead:
            self.dead -= 1
            return [self.broken] * n
        return list(self.answer)

    def batch_is_exist(self, keys):
        return self._draw(len(keys))

    def batch_put_from(self, keys, ptrs, sizes, config=None):
        return self._draw(len(keys))

    def batch_get_into(self, keys, ptrs, sizes):
        return self._draw(len(keys))

    def batch_remove(self, keys, force):
        return self._draw(len(keys))

    def health_check(self):
        return 0


def test_a_broken_call_is_sent_again_until_it_gets_through(clock):
    pool = Pool(3, [1, 0], broken=-1)  # exists: -1 for every key on a broken call
    assert DummyCalls(pool, UP).batch_is_exist(["a", "b"]) == [1, 0]
    assert pool.calls == 4 and clock.slept == [0.02, 0.04, 0.08]  # pauses double
    for call, args in (("batch_put_from", (["a"], [1], [8])),
                       ("batch_get_into", (["a"], [1], [8])),
                       ("batch_remove", (["a"], True))):
        pool = Pool(2, [0])
        assert getattr(DummyCalls(pool, UP), call)(*args) == [0]
        assert pool.calls == 3
    assert DummyCalls(Pool(0, [0]), UP).health_check() == 0  # the rest is the client's
    # the dummy disconnected for its 2 s between reconnection attempts: still through
    clock.slept.clear()
    long = Pool(12, [0])
    assert DummyCalls(long, UP).batch_get_into(["a"], [1], [8]) == [0]
    assert 2.0 < sum(clock.slept) < REDIAL_S


def test_only_whole_quick_failures_while_up_are_sent_again(clock):
    """CONTROL: without the retry the node reported the broken call's codes (the put
    then counted its pages not stored); a per-object failure is the object's own; a
    slow failure may be a live, busy server; the retries end; nothing is sent again
    while mooncake_client is down (the node's reconnection probe)."""
    pool = Pool(1, [1], broken=-1)
    assert DummyCalls(pool, UP, redial_s=0).batch_is_exist(["a", "b"]) == [-1, -1]
    mixed = Pool(0, [1, -1])
    assert DummyCalls(mixed, UP).batch_is_exist(["a", "b"]) == [1, -1] and mixed.calls == 1
    other = Pool(1, [0], broken=-800)  # a transfer failure is not a broken call
    assert DummyCalls(other, UP).batch_put_from(["a"], [1], [8]) == [-800]
    endless = Pool(1000, [0])
    assert DummyCalls(endless, UP).batch_get_into(["a"], [1], [8]) == [RPC_FAIL]
    assert 5 < endless.calls < 20 and clock.now <= REDIAL_S
    slow = Pool(1, [0], clock=clock, cost=2.0)
    assert DummyCalls(slow, UP).batch_get_into(["a"], [1], [8]) == [RPC_FAIL]
    assert slow.calls == 1
    assert DummyCalls(Pool(1, []), UP).batch_remove([], True) == []  # nothing to fail
    down = Pool(3, [0])  # mooncake_client down or reconnecting: every call fails so
    assert DummyCalls(down, lambda: False).batch_is_exist(["p"]) == [RPC_FAIL]
    assert down.calls == 1


@pytest.mark.parametrize("codes, broken", [([], False), ([-1], True), ([RPC_FAIL] * 3, True),
                                           ([-1, 0], False), ([-704], False)])
def test_what_a_broken_exists_looks_like(codes, broken):
    assert dummy_calls.broken(codes, dummy_calls.EXISTS_BROKEN) is broken
