"""Many ranks of one node moving pages at the same time through its node actor, whose
store calls merge the ranks' concurrent batches (``cache_actors.node.transfer_merger``):
each rank still gets its own per-page results and bytes, put-if-absent has exactly one
first writer per object, and a bad batch fails only the rank that sent it. Raw data ops
name objects by their whole keys, in the key space (key prefix) of the rank's
deployment: the node actor refuses any other (``NOT_OWNED``)."""

import pytest
import ray
import torch
from raykv.controllers import StorageConfig
from raykv.controllers.node_records import MergedCallStats
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.result_codes import ALREADY_PRESENT

from tests.integration.ranks import MLA, indices, start_rank

RANKS = 6
PAGES = 8


def mla(name: str) -> StorageConfig:
    return StorageConfig(model_name=name, is_mla_model=True)


@pytest.fixture(scope="module")
def ranks(cluster):
    """``RANKS`` MLA ranks on node 1, each with its own pool and model name (own keys)."""
    node1 = cluster.node_ids[0]
    return [start_rank(node1, mla(f"own{i}"), kind="mla", pool_name=f"conc{i}")
            for i in range(RANKS)]


@pytest.fixture(scope="module")
def one_deployment(cluster):
    """``RANKS`` MLA ranks on node 1 of one deployment (one key space), each with its
    own pool."""
    node1 = cluster.node_ids[0]
    return [start_rank(node1, mla("same"), kind="mla", pool_name=f"same{i}")
            for i in range(RANKS)]


def merged_calls(cluster) -> MergedCallStats:
    actor = cluster.node_actors[cluster.node_ids[0]]
    return ray.get(actor.stats.remote()).merged_calls


def test_concurrent_ranks_round_trip_their_own_bytes(cluster, ranks, uid):
    before = merged_calls(cluster)
    ray.get([r.fill.remote(seed) for seed, r in enumerate(ranks)])
    for rnd in range(4):
        keys = [f"{uid}-{rnd}-{i}" for i in range(PAGES)]
        puts = ray.get([r.call.remote("batch_set_v1", keys, indices(0, PAGES))
                        for r in ranks])
        assert puts == [[True] * PAGES] * RANKS
        gets = ray.get([r.call.remote("batch_get_v1", keys, indices(32, PAGES))
                        for r in ranks])
        assert gets == [[True] * PAGES] * RANKS
        for i, r in enumerate(ranks):
            wrote, read = ray.get([r.pages.remote(0, PAGES), r.pages.remote(32, PAGES)])
            assert torch.equal(wrote.view(torch.uint8), read.view(torch.uint8)), i
    # The four rounds' batches went through the merger (several per store call when
    # they met in its queue; how many did is up to timing).
    after = merged_calls(cluster)
    assert after.batches - before.batches == 4 * 2 * RANKS
    assert after.calls - before.calls <= 4 * 2 * RANKS


def object_batch(rank, start: int, keys: list[str], pool: str) -> ObjectBatch:
    """The ObjectBatch for ``keys`` at the pages from slot ``start`` of ``rank``'s pool
    (one object per MLA page; offsets from the rank's own page meta)."""
    (base,), _ = ray.get(rank.kv_meta.remote(0, 1))
    ptrs, sizes = ray.get(rank.kv_meta.remote(start, len(keys)))
    batch = ObjectBatch()
    for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
        batch.add(key, pool, ptr - base, size)
    return batch


def test_concurrent_puts_of_the_same_objects_have_one_first_writer(cluster, one_deployment,
                                                                    uid):
    """Every rank of one deployment puts the same objects at once: per object exactly one
    rank stores it (code 0), every other sees it already present; the bytes read are
    that rank's."""
    ranks = one_deployment
    ray.get([r.fill.remote(100 + seed) for seed, r in enumerate(ranks)])
    keys = [f"same_{uid}-same-{i}" for i in range(PAGES)]
    codes = ray.get([r.data.remote("put", object_batch(r, 0, keys, f"same{i}"))
                     for i, r in enumerate(ranks)])
    for k in range(PAGES):
        column = [c[k] for c in codes]
        assert sorted(column) == [0] + [ALREADY_PRESENT] * (RANKS - 1), column
    reader = ranks[0]
    got = ray.get(reader.data.remote("get", object_batch(reader, 32, keys, "same0")))
    assert all(c > 0 for c in got)
    read = ray.get(reader.pages.remote(32, PAGES)).view(torch.uint8)
    for k in range(PAGES):
        winner = ranks[[c[k] for c in codes].index(0)]
        wrote = ray.get(winner.pages.remote(k * MLA["page_size"], 1)).view(torch.uint8)
        assert torch.equal(read[k * MLA["page_size"]:(k + 1) * MLA["page_size"]], wrote), k


def test_bad_offset_in_one_rank_fails_only_that_rank(cluster, ranks, uid):
    ray.get([r.fill.remote(200 + seed) for seed, r in enumerate(ranks)])
    keys = {i: [f"own{i}_{uid}-bad-{i}-{p}" for p in range(PAGES)] for i in range(RANKS)}
    batches = {i: object_batch(r, 0, keys[i], f"conc{i}") for i, r in enumerate(ranks)}
    batches[2].offsets[3] = 1 << 40  # far outside the pool
    refs = {i: r.data.remote("put", batches[i]) for i, r in enumerate(ranks)}
    for i, ref in refs.items():
        if i == 2:
            with pytest.raises(ValueError, match="do not lie inside pool"):
                try:
                    ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    raise e.cause from None
        else:
            assert ray.get(ref) == [0] * PAGES
    # Nothing of the bad batch was stored; the others read back their own bytes.
    exists = ray.get(ranks[2].data.remote("exists", keys[2]))
    assert exists == [0] * PAGES
    for i in (0, 5):
        got = ray.get(ranks[i].data.remote("get",
                                           object_batch(ranks[i], 32, keys[i], f"conc{i}")))
        assert all(c > 0 for c in got)
        assert torch.equal(ray.get(ranks[i].pages.remote(0, PAGES)).view(torch.uint8),
                           ray.get(ranks[i].pages.remote(32, PAGES)).view(torch.uint8))
