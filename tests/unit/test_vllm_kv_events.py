"""The pure building of vLLM KV events for raykv's tiers (``integrations.vllm.kv_events``):
what the workers report, when the scheduler side publishes a block stored or removed,
the bounds, and the vLLM events they become."""

import pytest
from raykv.integrations.vllm.kv_events import (
    L2,
    L3,
    BlockFacts,
    KVEventBook,
    LandedBlocks,
    Removed,
    Stored,
    to_vllm,
)


def facts(i: int) -> BlockFacts:
    return BlockFacts(block_hash=bytes([i]) * 4, parent_hash=bytes([i - 1]) * 4 if i else None,
                      token_ids=(i, i + 1), extra_keys=(None,))


def test_landed_blocks_report_what_landed_and_nothing_when_off():
    on = LandedBlocks(True)
    on.l2_saved(["a", "b", "c"], saved=2, full=[1])  # b had no page: a, c landed
    on.l3_saved(["b"], [True])
    on.l2_saved(["d", "e"], saved=1, full=[])  # one failed, which is unknown: none
    on.l3_saved(["f", "g"], [False, True])
    assert on.take() == [(L2, "a"), (L2, "c"), (L3, "b"), (L3, "g")]
    assert on.take() == []
    # CONTROL: off, the same saves report nothing
    off = LandedBlocks(False)
    off.l2_saved(["a", "b", "c"], saved=2, full=[1])
    off.l3_saved(["b"], [True])
    assert off.take() == []


def test_a_block_is_stored_once_every_rank_reported_it():
    book = KVEventBook(tp_size=2)
    for i, h in enumerate("abc"):
        book.saving(h, facts(i))
    book.landed([(L2, "a"), (L2, "b"), (L3, "c")])  # rank 0
    assert book.take() == []  # CONTROL: one rank of two is not the group
    book.landed([(L2, "a"), (L2, "b"), (L3, "c"), (L3, "zz"), ("gpu", "a")])  # rank 1
    assert book.take() == [Stored(L2, (facts(0), facts(1))), Stored(L3, (facts(2),))]
    book.landed([(L2, "a"), (L2, "a")])  # saved again: published once until removed
    assert book.take() == []


def test_a_lookup_that_stops_at_a_published_block_removes_it():
    book = KVEventBook(tp_size=1)
    book.saving("a", facts(0))
    book.landed([(L2, "a"), (L3, "a")])
    book.take()
    book.missing(L2, "b")  # never published: nothing
    book.missing(L2, "a")
    assert book.take() == [Removed(L2, (facts(0).block_hash,))]
    book.missing(L2, "a")  # removed once
    assert book.take() == []
    book.landed([(L2, "a")])  # lands again: stored again
    assert book.take() == [Stored(L2, (facts(0),))]


def test_bounds_drop_the_oldest():
    book = KVEventBook(tp_size=2, pending_cap=2, published_cap=1)
    for i, h in enumerate("abc"):
        book.saving(h, facts(i))  # "a" dropped: more than 2 pending
    book.landed([(L3, "a"), (L3, "a"), (L3, "b"), (L3, "b"), (L3, "c"), (L3, "c")])
    assert book.take() == [Stored(L3, (facts(1), facts(2)))]
    book.missing(L3, "b")  # forgotten: only "c" is remembered
    book.missing(L3, "c")
    assert book.take() == [Removed(L3, (facts(2).block_hash,))]
    with pytest.raises(ValueError):
        KVEventBook(tp_size=0)


@pytest.mark.engine("vllm")
def test_to_vllm_names_the_tier_in_vllms_words():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as vllm_hash

    stored, removed = to_vllm([Stored(L2, (facts(1),)), Removed(L3, (b"\x09" * 4,))], 16)
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert (stored.medium, stored.locality, stored.ownership) == ("CPU", "LOCAL", L2)
    assert stored.block_hashes == [vllm_hash(b"\x01" * 4)]  # as vLLM's own events
    assert stored.parent_block_hash == vllm_hash(b"\x00" * 4)
    assert (stored.token_ids, stored.block_size, stored.extra_keys) == ([1, 2], 16, [None])
    assert (removed.medium, removed.locality, removed.ownership) == ("STORAGE", None, L3)
    assert removed.block_hashes == [vllm_hash(b"\x09" * 4)]


class Hits:
    """A client whose node's L2 holds the leading ``l2`` pages asked, and L3 the
    leading ``l3`` pages after those."""

    def __init__(self, l2: int, l3: int) -> None:
        self.l2_hits, self.l3_hits = l2, l3

    def l2(self):
        return self

    def lookup(self, keys, tp_size: int) -> int:
        return min(self.l2_hits, len(keys))

    def group_exists(self, keys):
        from types import SimpleNamespace

        return SimpleNamespace(kv_hit_pages=min(self.l3_hits, len(keys)), load_runs=[])


@pytest.mark.parametrize("events", [True, False])
@pytest.mark.engine("vllm")
def test_the_schedulers_lookup_removes_the_first_published_block_it_misses(events):
    """The scheduler side's lookup (``_query``) over pages a, b, c, all published in L2
    and L3, finds a in L2 and nothing after in L3: b is removed from both tiers (c,
    behind it, is not named). CONTROL: events off, the same lookup publishes nothing."""
    from dataclasses import replace

    from raykv.integrations.vllm.options import ConnectorOptions, KVIdentity
    from raykv.integrations.vllm.scheduler import RayKVConnectorScheduler
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as vllm_hash

    opts = ConnectorOptions.parse({"l2_blocks": 4}, tp_size=1, pp_size=1, served_model="m",
                                  identity=KVIdentity("bfloat16", 16, "cpu.lm1"))
    side = RayKVConnectorScheduler(replace(opts, kv_events=events), do_load=False,
                                   do_save=True, block_size=16, tp_size=1, pp_size=1)
    side._client = Hits(l2=1, l3=0)
    if events:
        for i, h in enumerate("abc"):
            side._events.saving(h, facts(i))
        side._events.landed([(t, h) for t in (L2, L3) for h in "abc"])
        assert len(side.take_events()) == 6
    assert side._query(["a", "b", "c"]) == (1, 1, [])
    got = [(e.ownership, e.block_hashes) for e in side.take_events()]
    assert got == ([(L2, [vllm_hash(facts(1).block_hash)]),
                    (L3, [vllm_hash(facts(1).block_hash)])] if events else [])
