"""``staging_pools`` without Ray: an engine buffer described as a raykv layout (the same
bytes at the same offsets), the page-run copy and staged rounds on plain mappings."""

import mmap
import os
import time

import pytest
import torch
from raykv.cache_actors.errors import DeadlineExceededError, QuarantinedPagesError
from raykv.cache_actors.host_pools import HostPool, PoolHandle
from raykv.cache_actors.node.ticket_desk import TicketDesk
from raykv.cache_actors.rank.quarantine import Quarantine
from raykv.cache_actors.rank.staging_pools import (
    EngineMemory,
    StagedPool,
    describe_kv_buffer,
    page_runs,
    staged_call,
    staging_layout,
)
from raykv.cache_actors.tickets import TicketBook, process_book
from raykv.controllers.contract import PoolName, PoolTransfer, StorageConfig
from raykv.controllers.keys import KeyScheme
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.transfer_plan import PlanPool, check_transfers

from tests.unit.memfds import memfd_pool_handle, node_may_release

PAGE = 4


def host_pool(layout: PoolLayout, name: str = "staging") -> HostPool:
    return HostPool(PoolHandle(name, "seg", layout), mmap.mmap(-1, layout.nbytes), owner=False)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize(("shape", "order", "kind", "size"), [
    ((2, 32, 3, 2, 8), "page_first", "mha", 32),
    ((2, 8, 3, PAGE, 2, 8), "page_first_direct", "mha", 32),
    ((32, 3, 1, 16), "page_first", "mla", 32),
    ((8, 3, PAGE, 1, 16), "page_first_direct", "mla", 32),
])
def test_described_buffers_hold_each_page_object_at_the_layouts_offset(shape, order, kind,
                                                                       size):
    buf = torch.randn(shape).to(torch.bfloat16)
    memory = describe_kv_buffer(buf, PAGE, order)
    layout = memory.layout
    assert (layout.kind, layout.size, layout.page_size) == (kind, size, PAGE)
    assert layout.nbytes == buf.numel() * buf.element_size()
    offsets = layout.object_offsets([2 * PAGE])
    for obj, (off, n) in enumerate(zip(offsets, layout.object_sizes, strict=True)):
        assert torch.equal(memory.pages[obj][2], raw(buf)[off:off + n])


@pytest.mark.parametrize(("buf", "order", "match"), [
    (torch.zeros(3, 32, 3, 2, 8), "page_first", "neither MHA nor MLA"),
    (torch.zeros(32, 3, 1, 16), "page_first_direct", "neither MHA nor MLA"),
    (torch.zeros(2, 32, 3, 4, 8)[:, :, :, :2], "page_first", "not contiguous"),
])
def test_describe_refuses_what_is_not_one_run_per_page(buf, order, match):
    with pytest.raises(ValueError, match=match):
        describe_kv_buffer(buf, PAGE, order)


def test_page_runs_are_maximal_on_both_sides():
    assert page_runs([4, 5, 9], [0, 1, 2]) == [(4, 0, 2), (9, 2, 1)]
    assert page_runs([1, 2, 3], [5, 3, 4]) == [(1, 5, 1), (2, 3, 2)]
    assert page_runs([], []) == []


def test_staging_layout_keeps_the_page_geometry():
    layout = describe_kv_buffer(torch.zeros(2, 32, 3, 2, 8), PAGE).layout
    small = staging_layout(layout, 3)
    assert small.size == 3 * PAGE and small.buffers == layout.buffers
    assert small.object_sizes == layout.object_sizes


class Store:
    """A store of object bytes for ``staged_call``'s data calls on the given pools."""

    def __init__(self, *pools: HostPool) -> None:
        self.pools = {p.name: p for p in pools}
        self.objects: dict[str, bytes] = {}
        self.calls = 0

    def __call__(self, write: bool):
        def call(batch):
            self.calls += 1
            codes = []
            for key, pool, off, size in zip(batch.keys, batch.pools, batch.offsets,
                                            batch.sizes, strict=True):
                view = self.pools[pool]._bytes[off:off + size]
                if write:
                    self.objects[key] = view.numpy().tobytes()
                    codes.append(0)
                elif key in self.objects:
                    view.copy_(torch.frombuffer(bytearray(self.objects[key]),
                                                dtype=torch.uint8))
                    codes.append(size)
                else:
                    codes.append(-1)
            return codes
        return call


def move(staged: StagedPool, keys, block_ids, write: bool, store: Store):
    return move_with(staged, keys, block_ids, write, store(write))


def test_vllm_layers_staged_one_block_per_page_in_rounds():
    """vLLM's per-layer block tensors staged into a ``vllm`` pool (a page: every layer's
    block, layer after layer), one window shared by both directions."""
    layers, blocks, block = 3, 10, (2, PAGE, 8)
    kv = [torch.randn(blocks, *block).to(torch.bfloat16) for _ in range(layers)]
    layout = PoolLayout.vllm(page_size=PAGE, size=blocks * PAGE, layer_num=layers,
                             head_num=2, head_dim=8, dtype="bfloat16", itemsize=2)
    pool = host_pool(staging_layout(layout, 2))

    def per_layer(p: HostPool):
        pages = p.kv_buffer.view(p.kv_buffer.shape[0], layers, -1)
        return [pages[:, i].view(-1, *block) for i in range(layers)]

    staged = StagedPool(EngineMemory(layout, kv), pool, 2, shared=True, stage=per_layer)
    store = Store(pool)
    ids, keys = [7, 1, 2, 5, 9], [f"b{i}" for i in range(5)]
    assert move(staged, keys, ids, True, store) == [True] * 5 and store.calls == 3
    (b0,) = [v for k, v in store.objects.items() if "b0" in k]  # block 7, layer by layer
    assert b0 == torch.cat([raw(t[7]) for t in kv]).numpy().tobytes()
    want = [t[ids].clone() for t in kv]
    for t in kv:
        t.zero_()
    assert move(staged, keys + ["missing"], [0, 3, 4, 6, 8, 2], False, store) == [True] * 5 + [
        False]
    for t, w in zip(kv, want, strict=True):
        assert torch.equal(t[[0, 3, 4, 6, 8]], w)
        assert torch.count_nonzero(t[[1, 2, 5, 7, 9]]) == 0


def test_windowed_puts_and_gets_use_their_own_halves():
    buf = torch.randn(2, 8 * PAGE, 1, 1, 4)
    memory = describe_kv_buffer(buf, PAGE)
    staged = StagedPool(memory, host_pool(staging_layout(memory.layout, 4)), 2)
    assert staged.staging_pages([5, 6], write=True) == [0, 1]
    assert staged.staging_pages([5, 6], write=False) == [2, 3]
    assert (staged.rounds(5), staged.chunk(2, 5)) == (3, (4, 5))
    mirror = StagedPool(memory, host_pool(memory.layout), None)
    assert mirror.staging_pages([5, 6], write=False) == [5, 6] and mirror.rounds(99) == 1


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "CONTROL-no-quarantine"])
def test_a_staged_call_failing_under_a_running_store_call_quarantines_its_pages(
        fixed, monkeypatch):
    """The call's ticket is held by a store call (a node actor's desk here) when the call
    fails: ``staged_call`` returns at once, and the next put through those staging pages
    fails before copying anything, until the store call ended. CONTROL: with nothing
    quarantined, the next put copies other bytes into the page the store call reads."""
    if not fixed:
        monkeypatch.setattr(Quarantine, "add", lambda self, tickets, pages: None)
    buf = torch.randn(2, 8 * PAGE, 1, 1, 4)
    memory = describe_kv_buffer(buf, PAGE)
    staged = StagedPool(memory, host_pool(staging_layout(memory.layout, 4)), 2)
    desk = TicketDesk(outlived_by_store=False)
    started = []

    def late(batch):  # the node starts the ticket, then the rank's deadline passes
        (ticket,) = started_tickets
        started.append(desk.ticket(ticket, time.monotonic() + 30))
        assert started[-1].start()
        raise DeadlineExceededError("deadline")

    book = process_book()
    started_tickets: list = []

    def call(batch):
        with book.held() as ticket:
            started_tickets[:] = [ticket]
            return late(batch)

    with pytest.raises(DeadlineExceededError):
        move_with(staged, ["a"], [5], True, call)
    before = staged.pool._bytes.clone()
    buf.add_(1)
    if not fixed:
        move_with(staged, ["b"], [6], True, Store(staged.pool)(True))
        assert not torch.equal(staged.pool._bytes, before)  # the late call reads these
        started[-1].end()
        return
    assert staged.quarantine.held() == {0}
    with pytest.raises(QuarantinedPagesError):
        move_with(staged, ["b"], [6], True, Store(staged.pool)(True))
    assert torch.equal(staged.pool._bytes, before)  # nothing copied into page 0
    started[-1].end()  # the store call ended: the page is the rank's again
    store = Store(staged.pool)
    assert move_with(staged, ["b"], [6], True, store(True)) == [True]


def move_with(staged: StagedPool, keys, block_ids, write: bool, call, epoch: int = 0):
    slots = (torch.tensor(block_ids)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    checked = check_transfers([PoolTransfer(PoolName.KV, keys, slots)],
                              {PoolName.KV: PlanPool(staged.name, staged.layout)},
                              KeyScheme.from_config(StorageConfig()), write=write)
    return staged_call(checked, {PoolName.KV: staged}, write=write, epoch=epoch,
                       call=call)[PoolName.KV]


def test_one_failed_round_of_two_staged_pools_frees_its_late_ticket_once(tmp_path):
    """A round that names two staging pools (KV and a draft pool) fails while its store
    call runs: both pools quarantine their page under the one ticket, both let go once
    the store call ended, and the ticket's slot is freed once: the next two calls get two
    slots and the node starts both. The old book freed it per pool: the next two tickets
    shared the slot, and the node refused the first (another serial)."""
    book = TicketBook(str(tmp_path))
    desk = TicketDesk(outlived_by_store=False, directory=str(tmp_path))
    staged, plan_pools, engine = {}, {}, {}
    for role in (PoolName.KV, PoolName.DRAFT):
        engine[role] = torch.randn(2, 8 * PAGE, 1, 1, 4)
        memory = describe_kv_buffer(engine[role], PAGE)
        sp = StagedPool(memory, host_pool(staging_layout(memory.layout, 4), f"staging-{role}"),
                        2)
        sp.quarantine = Quarantine(lambda: book)
        staged[role], plan_pools[role] = sp, PlanPool(sp.name, sp.layout)
    started = []

    def late(batch):  # the node starts the ticket, then the rank's deadline passes
        with book.held() as ticket:
            started.append(desk.ticket(ticket, time.monotonic() + 30))
            assert started[-1].start()
            raise DeadlineExceededError("deadline")

    slots = torch.arange(5 * PAGE, 6 * PAGE)
    checked = check_transfers([PoolTransfer(role, ["a"], slots) for role in staged],
                              plan_pools, KeyScheme.from_config(StorageConfig()), write=True)
    with pytest.raises(DeadlineExceededError):
        staged_call(checked, staged, write=True, epoch=0, call=late)
    assert len(started) == 1  # one round, one call, one ticket for both pools
    assert [sp.quarantine.held() for sp in staged.values()] == [{0}, {0}]
    started[0].end()  # the store call ended
    assert [sp.quarantine.held() for sp in staged.values()] == [set(), set()]
    first, second = book.issue(), book.issue()
    assert first.slot != second.slot
    assert desk.ticket(first, time.monotonic() + 30).start()
    assert desk.ticket(second, time.monotonic() + 30).start()
    book.close()


def test_a_get_copies_out_of_the_mapping_it_held_whatever_a_remap_meanwhile():
    """A staged get: the node reads the object into the staging pool's memory (epoch 1),
    then another thread of the rank re-maps that pool (the node allocated it anew:
    epoch 2, zeros) before this call copies the page out. The call holds the old memory
    from before its call until after its copy (the node does not give it back
    meanwhile: ``HostPool.held``) and copies out of it: the engine gets the bytes read.
    Control (the old copy, through the pool as mapped now): the new memory's zeros,
    reported loaded."""
    memory = describe_kv_buffer(torch.zeros(2, 4 * PAGE, 2, 1, 8), PAGE)
    pool = HostPool.attach(memfd_pool_handle("staging", memory.layout, 1))
    staged = StagedPool(memory, pool)
    node_fd = os.open(pool.handle.path, os.O_RDWR)  # the node's own file of epoch 1
    data = torch.randint(1, 255, (memory.layout.nbytes,), dtype=torch.uint8)
    seen = []

    def get(batch):
        for off, size in zip(batch.offsets, batch.sizes, strict=True):  # the node's read
            os.pwrite(node_fd, data[off:off + size].numpy().tobytes(), off)
        seen.append((batch.epoch, node_may_release(node_fd)))
        pool.remap(memfd_pool_handle("staging", memory.layout, 2))  # another thread's
        return list(batch.sizes)

    assert move_with(staged, ["a"], [2], False, get, epoch=1) == [True]
    offsets = memory.layout.object_offsets([2 * PAGE])
    for obj, (off, n) in enumerate(zip(offsets, memory.layout.object_sizes, strict=True)):
        assert torch.equal(memory.pages[obj][2], data[off:off + n]), "not the bytes read"
    assert seen == [(1, False)]  # held during the call
    assert node_may_release(node_fd)  # the hold ended with the call
    os.close(node_fd)
    pool.close()


@pytest.mark.parametrize(("mapped", "told", "sent"), [(3, 3, 3), (3, 5, 3), (5, 3, 3)])
def test_a_call_whose_staging_mapping_is_of_another_epoch_carries_the_older(mapped, told,
                                                                             sent):
    """The client's epoch (``told``) and a staging pool's mapping (``mapped``) disagree
    while another thread re-maps: the call carries the older of the two, which the node
    refuses as stale (the client re-maps, the caller retries), so no byte moves between
    the node's memory and a mapping of another generation."""
    memory = describe_kv_buffer(torch.zeros(2, 4 * PAGE, 2, 1, 8), PAGE)
    pool = HostPool.attach(memfd_pool_handle("staging", memory.layout, mapped))
    epochs = []

    def call(batch):
        epochs.append(batch.epoch)
        return [0] * len(batch)

    move_with(StagedPool(memory, pool), ["a"], [1], True, call, epoch=told)
    assert epochs == [sent]
    pool.close()
