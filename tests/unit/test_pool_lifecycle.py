"""``PoolLifecycle`` without Ray: create / attach / destroy / remap / register, an engine's
own draft pool served through staging, and staged transfers, on a fake node link."""

import logging

import pytest
import torch
from raykv.cache_actors.processes import ProcessIdentity
from raykv.cache_actors.rank.pool_lifecycle import PoolLifecycle
from raykv.cache_actors.rank.staging_pools import (
    EngineMemory,
    StagedPool,
    describe_kv_buffer,
    page_views,
    staged_call,
    staging_layout,
)
from raykv.controllers.contract import PoolName, PoolTransfer, StorageConfig
from raykv.controllers.keys import KeyScheme
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.transfer_plan import check_hit_query, check_transfers

from tests.unit.fake_node import FakeNode

PAGE = 4
KV, DRAFT, MAMBA = PoolName.KV, PoolName.DRAFT, PoolName.MAMBA


def mha(size: int = 16 * PAGE) -> PoolLayout:
    return PoolLayout.mha(page_size=PAGE, size=size, layer_num=2, head_num=1, head_dim=8,
                          dtype="float16", itemsize=2)


def slots(*pages: int) -> torch.Tensor:
    return torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)])


@pytest.fixture
def node(tmp_path):
    return FakeNode(tmp_path)


@pytest.fixture
def pools(node):
    lifecycle = PoolLifecycle(node)
    yield lifecycle
    lifecycle.close()


class EngineDraft:
    """A draft pool the engine allocated itself: MHA ``(2, size, layers, heads, dim)``."""

    page_size = PAGE

    def __init__(self, size: int = 16 * PAGE) -> None:
        self.kv_buffer = torch.randn(2, size, 2, 1, 8).to(torch.float16)


def transfer(node, pools, transfers, write: bool, scheme: KeyScheme | None = None):
    """What ``CacheClient.batch_set_v2`` / ``batch_get_v2`` do, on the fake node."""
    scheme = scheme or KeyScheme.from_config(StorageConfig())
    checked = check_transfers(transfers, pools.plan_pools, scheme, write=write,
                              disabled=pools.disabled)
    return staged_call(checked, pools.staged, write=write, epoch=pools.epoch,
                       call=lambda batch: node.move(pools.mapped(), write, batch))


# ------------------------------------------------------------------ mapping
def test_create_maps_the_nodes_memory(node, pools):
    pool = pools.create(mha(), "kv-a")
    assert pool.layout == mha() and node.pools["kv-a"].layout == mha()
    pool.kv_buffer[1, 5].fill_(2.0)
    with open(node.pools["kv-a"].path, "rb") as f:
        raw = torch.frombuffer(bytearray(f.read()), dtype=torch.float16)
    assert raw.sum().item() == 2.0 * 16  # V of slot 5: layers * heads * dim values
    assert pools.mapped() == [pool] and node.processes["kv-a"] is None


def test_create_names_a_pool_and_per_process_names_its_process(node, pools):
    pool = pools.create(mha(), per_process=True)
    assert pool.name.startswith("mha-")
    assert node.processes[pool.name] == ProcessIdentity.current()
    with pytest.raises(ValueError, match="pool name"):
        pools.create(mha(), "bad name")


def test_attach_maps_an_existing_pool_once(node, pools):
    node.create_pool("shared", mha())
    pool = pools.attach("shared")
    assert pools.attach("shared") is pool
    with pytest.raises(ValueError, match="no pool 'other'"):
        pools.attach("other")


def test_destroy_unmaps_unregisters_and_removes(node, pools):
    pool = pools.create(mha(), "kv-a")
    pools.register_kv(pool, is_mla_model=False)
    assert pools.destroy(pool) is True
    assert pools.mapped() == [] and "kv-a" not in node.pools
    assert pools.plan_pools == {} and pools.specs == ()
    assert pools.destroy("kv-a") is False


def test_a_newer_epoch_marks_other_mappings_stale_and_remap_maps_the_new_memory(node, pools):
    a = pools.create(mha(), "a")
    a.kv_buffer.fill_(1.0)
    node.reallocate()
    b = pools.create(mha(), "b")  # a handle of the new epoch
    assert node.stale and pools.epoch == 1
    pools.remap()
    assert pools.attach("a") is a and a.handle == node.pools["a"]
    assert torch.count_nonzero(a.kv_buffer) == 0  # the node's new (zeroed) memory
    node.destroy_pool("b")
    pools.remap()  # a pool destroyed meanwhile is left as it is
    assert pools.attach("b") is b


# ------------------------------------------------------------- registration
def test_register_needs_this_clients_pools_of_the_right_kind(node, pools):
    pool = pools.create(mha(), "kv-a")
    with pytest.raises(ValueError, match="is MHA but the config says is_mla_model=True"):
        pools.register_kv(pool, is_mla_model=True)
    with pytest.raises(ValueError, match="needs a pool returned by this client"):
        pools.register(EngineDraft(), KV, is_mla_model=False)
    other = PoolLifecycle(node).attach("kv-a")
    with pytest.raises(ValueError, match="needs a pool returned by this client"):
        pools.register_kv(other, is_mla_model=False)
    pools.register(pool, KV, is_mla_model=False)
    assert pools.plan_pools[KV].pool_name == "kv-a" and pools.plan_pools[KV].layout == mha()
    assert [s.role for s in pools.specs] == [KV] and pools.staged == {}


def test_a_layout_registers_its_geometry_and_allocates_nothing(node, pools):
    """A rank that only asks group queries (vLLM's scheduler) registers the KV pool's
    geometry: the same spec as a pool of that layout, no pool on the node, its group
    queries are planned, and a transfer naming it is refused before any byte moves.
    CONTROL: a pool of the layout registered instead makes a pool on the node, with the
    same spec."""
    pools.register(mha(), KV, is_mla_model=False)
    described = pools.specs
    keys, queries = check_hit_query(["p0", "p1"], (), pools.plan_pools, pools.disabled)
    assert keys == ["p0", "p1"] and queries == []
    assert node.pools == {} and pools.mapped() == []
    with pytest.raises(ValueError, match="is MHA but the config says is_mla_model=True"):
        pools.register(mha(), KV, is_mla_model=True)
    with pytest.raises(ValueError, match="registered as a layout alone"):
        transfer(node, pools, [PoolTransfer(KV, ["k0"], slots(0))], write=True)
    other = PoolLifecycle(node)
    other.register(other.create(mha(), "kv-b"), KV, is_mla_model=False)
    assert list(node.pools) == ["kv-b"] and other.specs == described
    other.close()


def test_an_engine_draft_pool_is_staged_through_a_mirror_pool(node, pools):
    draft = EngineDraft()
    pools.register(draft, DRAFT, is_mla_model=False)
    staged = pools.staged[DRAFT]
    assert isinstance(staged, StagedPool) and staged.window is None
    assert staged.layout == mha() and staged.pool.layout == mha()
    assert node.processes[staged.pool.name] == ProcessIdentity.current()
    assert pools.plan_pools[DRAFT].pool_name == staged.pool.name
    assert pools.disabled == frozenset()


def test_an_unservable_draft_is_disabled_with_one_warning(pools, caplog):
    class SplitHeads:
        page_size = PAGE
        kv_buffer = torch.zeros(2, 64, 1, 4, 8)[:, :, :, :2]

    with caplog.at_level(logging.WARNING, logger="raykv.cache_actors.rank.pool_lifecycle"):
        pools.register(SplitHeads(), DRAFT, is_mla_model=False)
        pools.register(SplitHeads(), DRAFT, is_mla_model=False)
    assert len(caplog.records) == 1 and "not contiguous" in caplog.text
    assert pools.disabled == frozenset({DRAFT}) and DRAFT not in pools.plan_pools


# ----------------------------------------------------------------- staging
def test_staged_draft_pages_round_trip_byte_for_byte(node, pools):
    kv = pools.create(mha(), "kv-a")
    pools.register_kv(kv, is_mla_model=False)
    kv.kv_buffer.copy_(torch.randn(kv.kv_buffer.shape).to(torch.float16))
    draft = EngineDraft()
    pools.register(draft, DRAFT, is_mla_model=False)
    keys = ["h0", "h1", "h2"]
    put = transfer(node, pools, [PoolTransfer(KV, keys, slots(0, 1, 2)),
                                 PoolTransfer(DRAFT, None, None, indices_from_pool=KV)], True)
    assert put == {KV: [True] * 3, DRAFT: [True] * 3} and node.data_calls == 1
    expected = draft.kv_buffer[:, 0:3 * PAGE].clone()
    draft.kv_buffer.zero_()
    got = transfer(node, pools, [PoolTransfer(DRAFT, keys + ["missing"], slots(4, 5, 6, 7))],
                   False)
    assert got == {DRAFT: [True, True, True, False]}
    assert torch.equal(draft.kv_buffer[:, 4 * PAGE:7 * PAGE], expected)
    assert torch.count_nonzero(draft.kv_buffer[:, :4 * PAGE]) == 0
    assert torch.count_nonzero(draft.kv_buffer[:, 7 * PAGE:]) == 0  # the miss: untouched


def test_a_staged_pool_smaller_than_a_call_goes_in_rounds(node, pools):
    engine = EngineDraft(size=16 * PAGE)
    memory = describe_kv_buffer(engine.kv_buffer, PAGE)
    staging = pools.create(staging_layout(memory.layout, 2 * 3), "staging")
    pools.register_kv(StagedPool(memory, staging, 3), is_mla_model=False)
    keys = [f"h{i}" for i in range(8)]
    pages = [9, 10, 11, 2, 3, 4, 5, 0]
    assert transfer(node, pools, [PoolTransfer(KV, keys, slots(*pages))], True) == {
        KV: [True] * 8}
    assert node.data_calls == 3  # rounds of at most 3 pages
    expected = engine.kv_buffer.clone()
    engine.kv_buffer.zero_()
    assert transfer(node, pools, [PoolTransfer(KV, keys, slots(*pages))], False) == {
        KV: [True] * 8}
    for p in pages:
        assert torch.equal(engine.kv_buffer[:, p * PAGE:(p + 1) * PAGE],
                           expected[:, p * PAGE:(p + 1) * PAGE])
    assert pools.staged[KV].copied_bytes == 2 * 8 * sum(memory.layout.object_sizes)


def test_mamba_engine_pages_in_rounds(node, pools):
    layout = PoolLayout.mamba(size=8, temporal=((2, 3), "float32", 4),
                              convs=[((2, 5), "float32", 4)])
    temporal, conv = torch.randn(8, 2, 3), torch.randn(8, 2, 5)
    memory = EngineMemory(layout, [page_views(temporal, 8), page_views(conv, 8)])
    kv = pools.create(mha(), "kv-a")
    pools.register_kv(kv, is_mla_model=False)
    staging = pools.create(staging_layout(layout, 2), "mamba-staging")
    pools.register(StagedPool(memory, staging, 1), MAMBA, is_mla_model=False)
    keys = ["m0", "m1"]
    assert transfer(node, pools, [PoolTransfer(MAMBA, keys, torch.tensor([6, 1]))], True) == {
        MAMBA: [True, True]}
    want = temporal[[6, 1]].clone(), conv[[6, 1]].clone()
    temporal.zero_(), conv.zero_()
    assert transfer(node, pools, [PoolTransfer(MAMBA, keys, torch.tensor([2, 3]))], False) == {
        MAMBA: [True, True]}
    assert torch.equal(temporal[[2, 3]], want[0]) and torch.equal(conv[[2, 3]], want[1])


def test_a_closed_staged_pool_fails_the_call_before_any_copy(node, pools):
    memory = describe_kv_buffer(EngineDraft().kv_buffer, PAGE)
    staged = StagedPool(memory, pools.create(staging_layout(memory.layout, 4), "s"), 2)
    pools.register_kv(staged, is_mla_model=False)
    with staged.closing():
        pass
    with pytest.raises(ValueError, match=r"staged pools \['kv'\] were closed"):
        transfer(node, pools, [PoolTransfer(KV, ["a"], slots(0))], True)
    assert node.data_calls == 0 and staged.copied_bytes == 0


def test_close_forgets_everything(node, pools):
    pools.register_kv(pools.create(mha(), "kv-a"), is_mla_model=False)
    pools.register(EngineDraft(), DRAFT, is_mla_model=False)
    pools.close()
    assert pools.mapped() == [] and pools.plan_pools == {} and pools.staged == {}
