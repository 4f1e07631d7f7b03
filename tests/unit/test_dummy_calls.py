"""A standalone node's dummy-client calls (``cache_actors.node.dummy_calls``, pure logic
over a fake client): a call that failed whole and at once, as one drawn on a dead
connection to a restarted ``mooncake_client`` fails, is sent again; anything else is
answered as it came."""

import pytest
from raykv.cache_actors.node import dummy_calls
from raykv.cache_actors.node.dummy_calls import REDIALS, DummyCalls
from raykv.controllers.result_codes import RPC_FAIL

UP = lambda: True  # noqa: E731  mooncake_client is up


class Pool:
    """A dummy client whose pool still holds ``dead`` connections to a dead process:
    each fails the call that draws it (every object ``broken``), then is dropped."""

    def __init__(self, dead: int, answer: list[int], broken: int = RPC_FAIL) -> None:
        self.dead, self.answer, self.broken, self.calls = dead, answer, broken, 0

    def _draw(self, n: int) -> list[int]:
        self.calls += 1
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


def test_a_call_on_dead_connections_is_sent_again_until_a_live_one():
    pool = Pool(3, [1, 0], broken=-1)  # exists: -1 for every key on a broken call
    assert DummyCalls(pool, UP).batch_is_exist(["a", "b"]) == [1, 0]
    assert pool.calls == 4
    for call, args in (("batch_put_from", (["a"], [1], [8])),
                       ("batch_get_into", (["a"], [1], [8])),
                       ("batch_remove", (["a"], True))):
        pool = Pool(2, [0])
        assert getattr(DummyCalls(pool, UP), call)(*args) == [0]
        assert pool.calls == 3
    assert DummyCalls(Pool(0, [0]), UP).health_check() == 0  # the rest is the client's


def test_only_whole_and_quick_failures_are_sent_again(monkeypatch):
    """CONTROL: without the retry the node reported the dead connection's codes (the
    put then counted its pages not stored); a per-object failure is the object's own;
    a slow failure may be a live, busy server; the retries are bounded; nothing is
    sent again while mooncake_client is down (the node's reconnection probe)."""
    pool = Pool(1, [1], broken=-1)
    assert DummyCalls(pool, UP, redials=0).batch_is_exist(["a", "b"]) == [-1, -1]
    mixed = Pool(0, [1, -1])
    assert DummyCalls(mixed, UP).batch_is_exist(["a", "b"]) == [1, -1] and mixed.calls == 1
    other = Pool(1, [0], broken=-800)  # a transfer failure is not a broken call
    assert DummyCalls(other, UP).batch_put_from(["a"], [1], [8]) == [-800]
    endless = Pool(100, [0])
    assert DummyCalls(endless, UP).batch_get_into(["a"], [1], [8]) == [RPC_FAIL]
    assert endless.calls == REDIALS + 1
    monkeypatch.setattr(dummy_calls, "AT_ONCE_S", -1.0)  # every failure counts as slow
    slow = Pool(1, [0])
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
