"""``LinkProbe.measure`` on a fake store whose reads take set times (a fake clock): the
faster of two reads of each probe object is fitted, so one read a busy scheduler held
is not taken for the link; a segment whose probe is gone is absent. Controls: the same
reads with the held one as the only large read give a link far slower."""

from __future__ import annotations

import pytest
from raykv.cache_actors.node import link_probe
from raykv.cache_actors.node.link_probe import LARGE, SMALL, LinkProbe, probe_key

PEER = "10.0.0.2:1000"
MB_S = 100e6  # the peer link's rate, bytes per second
FIXED_S = 0.001  # per read


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedStore:
    """A store whose ``get`` of one key advances ``clock`` by the link's time for its
    size, plus ``held_s`` for the reads named there (by their order)."""

    own_segment = "10.0.0.1:1000"
    prefers_own = True
    can_locate = True

    def __init__(self, clock: Clock, held: dict[int, float], gone: set[str]) -> None:
        self.clock, self.held, self.gone, self.reads = clock, held, gone, 0

    def register(self, ptr: int, nbytes: int) -> None:
        pass

    def locate(self, keys: list[str]) -> list[tuple[str, ...]]:
        return [() if any(k == probe_key(s, n) for s in self.gone for n in (SMALL, LARGE))
                else (PEER,) for k in keys]

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        (size,) = sizes
        self.clock.now += FIXED_S + size / MB_S + self.held.get(self.reads, 0.0)
        self.reads += 1
        return [size]


def measured(monkeypatch, held: dict[int, float], gone: frozenset[str] = frozenset()):
    clock = Clock()
    monkeypatch.setattr(link_probe.time, "perf_counter", clock)
    probe = LinkProbe(TimedStore(clock, held, set(gone)))
    return probe.measure([PEER, "10.0.0.3:1000"], deadline=float("inf"))


@pytest.mark.parametrize("held_read", [0, 1, 2, 3])
def test_one_held_read_is_not_taken_for_the_link(monkeypatch, held_read):
    (got, absent) = measured(monkeypatch, {held_read: 0.5}, gone=frozenset({"10.0.0.3:1000"}))
    per_byte, fixed = got[PEER]
    assert per_byte == pytest.approx(1 / MB_S)
    assert fixed == pytest.approx(FIXED_S)
    assert absent == ["10.0.0.3:1000"]


def test_control_a_held_large_read_read_once_would_be_taken_for_a_slow_link(monkeypatch):
    """Both large reads held: no faster one to keep, the fit says a far slower link."""
    (got, _) = measured(monkeypatch, {1: 0.5, 3: 0.5}, gone=frozenset({"10.0.0.3:1000"}))
    per_byte, _ = got[PEER]
    assert 1 / per_byte < MB_S / 50
