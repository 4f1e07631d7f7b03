"""Hit resolution tables: intersections of restorable prefixes across pools and ranks."""

import random

import pytest
from raykv.controllers.contract import PoolHitPolicy, PoolName
from raykv.controllers.hit_resolution import trailing_ends

from tests.unit.oracle import PoolPresence, resolve_hits, restorable_lengths

ALL, TRAIL = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES
T, F = True, False


def trailing(exists, window=1):
    return PoolPresence(exists, TRAIL, window)


@pytest.mark.parametrize(
    ("kv", "extra", "hit", "lengths"),
    [
        # KV present for 5 pages, Mamba (window 1) only after pages 3 and 5 -> 5.
        ([T] * 5, {PoolName.MAMBA: trailing([F, F, T, F, T])}, 5, [0, 3, 5]),
        # Mamba missing after page 5 -> 3.
        ([T] * 5, {PoolName.MAMBA: trailing([F, F, T, F, F])}, 3, [0, 3]),
        # Indexer missing at page 2 (0-based) -> 2.
        ([T] * 5, {PoolName.INDEXER: PoolPresence([T, T, F, T, T])}, 2, [0, 1, 2]),
        # KV shorter than Mamba's checkpoints -> the checkpoint inside KV's run.
        ([T, T, T, F, T], {PoolName.MAMBA: trailing([F, F, T, F, T])}, 3, [0, 3]),
        # Window 2 needs the last two checkpoints.
        ([T] * 5, {PoolName.MAMBA: trailing([F, T, T, F, T], 2)}, 3, [0, 3]),
        ([T] * 5, {PoolName.MAMBA: trailing([T, F, T, T, F], 2)}, 4, [0, 1, 4]),
        ([T] * 5, {PoolName.SWA: trailing([T, T, T, T, T], 2)}, 5, [0, 1, 2, 3, 4, 5]),
        # Draft missing at page 4 with Mamba at 3 and 5 -> 3.
        ([T] * 5, {PoolName.MAMBA: trailing([F, F, T, F, T]),
                   PoolName.DRAFT: PoolPresence([T, T, T, T, F])}, 3, [0, 3]),
        ([F, T], {}, 0, [0]),
        ([], {}, 0, [0]),
    ],
)
def test_hit_tables(kv, extra, hit, lengths):
    result = resolve_hits(PoolPresence(kv), extra)
    assert result.kv_hit_pages == hit
    assert result.restorable_prefix_pages == lengths


def test_extra_pool_hit_pages():
    r = resolve_hits(PoolPresence([T] * 5), {PoolName.MAMBA: trailing([T] * 5, 2),
                                              PoolName.INDEXER: PoolPresence([T] * 5)})
    assert r.extra_pool_hit_pages == {PoolName.MAMBA: 2, PoolName.INDEXER: 5}
    r = resolve_hits(PoolPresence([T, F]), {PoolName.MAMBA: trailing([T, T], 2)})
    assert r.extra_pool_hit_pages == {PoolName.MAMBA: 1}


def test_ranks_intersect():
    rank0 = (PoolPresence([T] * 4), {PoolName.MAMBA: trailing([F, T, F, T])})
    rank1 = (PoolPresence([T, T, T, F]), {PoolName.MAMBA: trailing([F, T, F, T])})
    r = resolve_hits(*rank0, ranks=[rank1])
    assert r.kv_hit_pages == 2 and r.restorable_prefix_pages == [0, 2]


def test_not_min_of_maxima():
    # Per-pool maxima are 4 and 3, but no length other than 0 and 2 works for both.
    kv = PoolPresence([T] * 4)
    extra = {PoolName.MAMBA: trailing([F, T, T, F], 1), PoolName.SWA: trailing([F, T, F, T])}
    assert restorable_lengths(extra[PoolName.MAMBA]) == {0, 2, 3}
    assert resolve_hits(kv, extra).kv_hit_pages == 2


@pytest.mark.parametrize(("kw", "msg"), [({"policy": "bogus"}, "unknown hit policy"),
                                         ({"policy": TRAIL, "window": 0}, "window >= 1")])
def test_bad_policy(kw, msg):
    with pytest.raises(ValueError, match=msg):
        PoolPresence([T], **kw)


def test_length_mismatch():
    with pytest.raises(ValueError, match="pages"):
        resolve_hits(PoolPresence([T, T]), {PoolName.MAMBA: trailing([T])})


def test_trailing_ends_equal_a_check_of_every_window():
    rng = random.Random(7)
    for _ in range(500):
        n, window = rng.randint(0, 40), rng.randint(1, 45)
        row = bytes(int(rng.random() < 0.8) for _ in range(n))
        ends = trailing_ends(row, window).to_bytes(n, "little")
        assert list(ends) == [int(all(row[max(0, p - window + 1):p + 1])) for p in range(n)]
