"""Standalone mode on real parts: a real mooncake_master, a real mooncake_client per node
supervised by its node actor, real Ray (and unit tests of the budget, the process record
and the mode switch).

Node 2 contributes no memory (a pure consumer), so every object lives in node 1's
mooncake_client: what node 2 reads after node 1's actor or client died comes from there.
"""

import os
import signal
import threading
from collections import Counter

import pytest
import ray
import torch
from raykv import CacheClient, NodeUnavailableError, local_settings, start_local
from raykv.cache_actors.data_ops import DataOp
from raykv.cache_actors.node.client_supervisor import ClientRecord
from raykv.cache_actors.node.pool_memory import PoolBudget
from raykv.cache_actors.rank.channel_client import ChannelClient
from raykv.cache_actors.rank.client import check_mode
from raykv.cache_actors.rank.staging_pools import (
    StagedPool,
    buffer_pages,
    describe_kv_buffer,
    staging_layout,
)
from raykv.controllers import PoolHitPolicy, PoolName, PoolTransfer, StorageConfig
from raykv.controllers.node_records import NodeStats
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.pool_layout import PoolLayout
from raykv.integrations.vllm.l2_blocks import L2Blocks
from raykv.integrations.vllm.layer_loads import LayerLoads

from tests.integration.processes import running_clients, wait_for
from tests.integration.ranks import HYBRID, indices, start_hybrid
from tests.integration.sglang_runs import PAGE, run_driver, scenario, steps

KV, MAMBA, DRAFT = PoolName.KV, PoolName.MAMBA, PoolName.DRAFT
POOLS = {"kv": HYBRID["kv"], "mamba": HYBRID["mamba"]}
BUDGET = 1 << 20
CFG = StorageConfig(model_name="stand/alone", extra_config={"standalone_storage": True})


@pytest.fixture(scope="module")
def cluster():
    with start_local(settings=local_settings(standalone=True, host_pool_bytes=BUDGET), num_nodes=2,
                     segment_sizes=[256 << 20, 0]) as c:
        yield c


def stats(cluster, node: str) -> NodeStats:
    return ray.get(cluster.node_actors[node].stats.remote())


def write(rank, keys, first_slot: int) -> dict:
    return ray.get(rank.call.remote("batch_set_v2", [
        PoolTransfer(KV, keys, indices(first_slot, len(keys))),
        PoolTransfer(MAMBA, keys[-1:], torch.tensor([first_slot // 4]),
                     PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(DRAFT, None, None, indices_from_pool=KV)]))


def read_back_equal(writer, reader, keys, first_slot: int) -> None:
    """``reader`` reads what ``writer`` wrote from ``first_slot``; bit-exact per pool."""
    n = len(keys)
    got = ray.get(reader.call.remote("batch_get_v2", [
        PoolTransfer(KV, keys, indices(0, n)),
        PoolTransfer(MAMBA, keys[-1:], torch.tensor([0]), PoolHitPolicy.TRAILING_PAGES),
        PoolTransfer(DRAFT, None, None, indices_from_pool=KV)]))
    assert got == {KV: [True] * n, MAMBA: [True], DRAFT: [True] * n}
    slots = list(range(first_slot, first_slot + 4 * n))
    for name, src, dst in [("kv", slots, list(range(4 * n))),
                           ("draft", slots, list(range(4 * n))),
                           ("mamba", [first_slot // 4], [0])]:
        wrote = ray.get(writer.slots.remote(name, src))
        back = ray.get(reader.slots.remote(name, dst))
        for a, b in zip(wrote, back, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def hybrid_pair(cluster):
    """A writer on node 1 and a reader on node 2, each with KV, Mamba and draft pools."""
    node1, node2 = cluster.node_ids
    ranks = [start_hybrid(node, CFG, POOLS | {"draft": HYBRID["draft"]})
             for node in (node1, node2)]
    ray.get(ranks[0].fill.remote(7))
    return ranks


def test_budget_counts_every_buffer_once_and_refuses_what_does_not_fit(cluster, uid):
    node1, node2 = cluster.node_ids
    used_before = stats(cluster, node1).host_pool_used
    writer, reader = (start_hybrid(n, CFG, POOLS) for n in (node1, node2))
    # A draft pool registered after the rank (and the node) started.
    for rank in (writer, reader):
        ray.get(rank.add_pool.remote("draft", "mha", HYBRID["draft"][1]))
    handles = ray.get(writer.handles.remote())
    st = stats(cluster, node1)
    assert st.mode == "standalone" and st.host_pool_bytes == BUDGET
    distinct = sum(h.layout.nbytes for h in handles.values())
    assert distinct == sum(sum(b.slot_bytes for b in h.layout.buffers) * h.layout.size
                           for h in handles.values())  # K+V, temporal + both conv, draft
    assert st.host_pool_used - used_before == distinct
    # What was requested from mooncake_client: one memfd per pool, of exactly its size.
    assert len({h.path for h in handles.values()}) == len(handles)
    assert sum(os.stat(h.path).st_size for h in handles.values()) == distinct

    ray.get(writer.fill.remote(3))
    keys = [f"{uid}-{i}" for i in range(3)]
    assert write(writer, keys, 8) == {KV: [True] * 3, MAMBA: [True], DRAFT: [True] * 3}
    read_back_equal(writer, reader, keys, 8)

    left = BUDGET - st.host_pool_used
    with pytest.raises(ValueError, match=rf"needs {left + 1} bytes .* host_pool_bytes={BUDGET}"):
        ray.get(writer.call.remote("create_host_pool", "mla", page_size=1, size=left + 1,
                                   layer_num=1, kv_cache_dim=1, dtype=torch.uint8,
                                   name=f"big-{uid}"))
    after = stats(cluster, node1)
    assert after.host_pool_used == st.host_pool_used and f"big-{uid}" not in after.pools


def test_killed_node_actor_keeps_l3_and_adopts_its_client(cluster, uid):
    node1 = cluster.node_ids[0]
    writer, reader = hybrid_pair(cluster)
    keys = [f"{uid}-{i}" for i in range(4)]
    assert write(writer, keys, 0) == {KV: [True] * 4, MAMBA: [True], DRAFT: [True] * 4}
    before = stats(cluster, node1)
    actor_pid = ray.get(cluster.node_actors[node1].health.remote())["pid"]

    ray.kill(cluster.node_actors[node1], no_restart=False)
    wait_for(lambda: ray.get(cluster.node_actors[node1].health.remote())["pid"] != actor_pid,
             "the node actor's restart")
    after = stats(cluster, node1)
    assert after.mooncake_client.pid == before.mooncake_client.pid
    assert after.mooncake_client.adopted
    assert len(running_clients(cluster)) == 2  # one per node, no second one on node 1
    assert after.host_pool_used == before.host_pool_used  # pools made again
    read_back_equal(writer, reader, keys, 0)  # L3 survived in node 1's mooncake_client

    # The writer's mappings are of the dead actor's memory: one retryable error, then
    # it works on the re-mapped pools.
    more = [f"{uid}-more-{i}" for i in range(2)]
    with pytest.raises(NodeUnavailableError):
        write(writer, more, 0)
    ray.get(writer.call.remote("health"))  # the first call after the error re-maps
    ray.get(writer.fill.remote(8))
    assert write(writer, more, 0) == {KV: [True] * 2, MAMBA: [True], DRAFT: [True] * 2}
    read_back_equal(writer, reader, more, 0)


def test_killed_mooncake_client_fails_clearly_then_recovers(cluster, uid):
    node1 = cluster.node_ids[0]
    writer, reader = hybrid_pair(cluster)
    before = stats(cluster, node1).mooncake_client
    os.kill(before.pid, signal.SIGKILL)
    wait_for(lambda: before.pid not in running_clients(cluster), "mooncake_client's death")

    keys = [f"{uid}-{i}" for i in range(3)]
    with pytest.raises(NodeUnavailableError, match="mooncake_client|allocated anew"):
        write(writer, keys, 0)
    after = wait_for(lambda: (s := stats(cluster, node1).mooncake_client).alive and s,
                     "mooncake_client's restart")
    assert after.restarts == before.restarts + 1 and after.pid != before.pid
    assert after.port == before.port
    assert len(running_clients(cluster)) == 2
    # The next call re-maps the writer's pools (allocated anew, empty), then data moves.
    assert ray.get(writer.call.remote("health"))["store_healthy"]
    ray.get(writer.fill.remote(9))
    # Until the master expires the dead client's segment, puts may be placed there.
    wait_for(lambda: all(all(v) for v in write(writer, keys, 0).values()), "a full write")
    read_back_equal(writer, reader, keys, 0)


def test_data_calls_racing_a_reallocation_fail_only_retryably(cluster, uid):
    """Puts and gets from many threads, over the local channel and over Ray, while node
    1's mooncake_client dies and its pools are allocated anew: every call either works
    or raises a retryable NodeUnavailableError (StalePoolsError once its mappings are of
    the old pools), never a ValueError from a pool table caught half-replaced."""
    node1 = cluster.node_ids[0]
    actor = cluster.node_actors[node1]
    layout = PoolLayout.mla(page_size=1, size=64, layer_num=1, kv_cache_dim=64,
                            dtype="uint8", itemsize=1)
    names = [f"race{i}-{uid}" for i in range(3)]  # several pools: a longer re-allocation
    handles = [ray.get(actor.create_pool.remote(n, layout)) for n in names]
    batch = ObjectBatch(epoch=handles[0].epoch)
    for name in names:
        batch.extend([f"{uid}-{name}-{j}" for j in range(64)], name,
                     [64 * j for j in range(64)], [64] * 64)
    channel = ChannelClient(ray.get(actor.channel_path.remote()))
    calls = [lambda: channel.call(DataOp.PUT, batch, None),
             lambda: channel.call(DataOp.GET, batch, None),
             lambda: ray.get(actor.put.remote(batch)),
             lambda: ray.get(actor.get.remote(batch))]
    stop = threading.Event()
    outcomes: Counter[str] = Counter()
    wrong: list[BaseException] = []

    def hammer(call) -> None:
        while not stop.is_set():
            try:
                call()
                outcomes["ok"] += 1
            except NodeUnavailableError as e:
                outcomes[type(e).__name__.removeprefix("RayTaskError(").rstrip(")")] += 1
            except Exception as e:  # what the test looks for
                wrong.append(e)

    threads = [threading.Thread(target=hammer, args=(calls[i % len(calls)],))
               for i in range(12)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: outcomes["ok"] >= 20, "data calls before the kill")
        before = stats(cluster, node1).mooncake_client
        os.kill(before.pid, signal.SIGKILL)
        wait_for(lambda: stats(cluster, node1).mooncake_client.restarts >
                 before.restarts and outcomes["StalePoolsError"] >= 20,
                 "the re-allocation, then stale calls")
    finally:
        stop.set()
        for t in threads:
            t.join()
        channel.close()
    assert not wrong, f"{len(wrong)} calls failed otherwise, first: {wrong[0]!r}; {outcomes}"
    # Until the master expires the killed client's segment, puts may be placed there and
    # fail (-800): wait for whole puts again, so the next test finds a whole store.
    pool = ray.get(actor.get_pool.remote(names[0]))
    probes = iter(range(1 << 30))

    def whole_put() -> bool:
        n = next(probes)
        probe = ObjectBatch(epoch=pool.epoch)
        probe.extend([f"{uid}-probe-{n}-{j}" for j in range(64)], names[0],
                     [64 * j for j in range(64)], [64] * 64)
        return all(c == 0 for c in ray.get(actor.put.remote(probe)))
    wait_for(whole_put, "whole puts after the client's restart")
    assert all(ray.get(actor.destroy_pool.remote(n)) for n in names)


class Gate:
    """Stops the first copy after ``arm`` until the test says ``go``: ``copying`` is set
    once that copy is waiting."""

    def __init__(self) -> None:
        self.armed = False
        self.copying, self.go = threading.Event(), threading.Event()

    def wait_here(self) -> None:
        if self.armed and not self.copying.is_set():
            self.copying.set()
            assert self.go.wait(120), "the test never let the copy go on"


def kill_client_and_wait_for_new_pools(cluster, client: CacheClient, pool: str,
                                       epoch: int) -> None:
    """Kill the ``mooncake_client`` of ``client``'s node, then wait until the node
    allocated its pools anew (``pool``'s handle is of another epoch than ``epoch``): by
    then the old memory was given back, unless a rank still holds it."""
    actor = cluster.node_actors[client.node_id]
    pid = stats(cluster, client.node_id).mooncake_client.pid
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: ray.get(actor.get_pool.remote(pool, client.owner_claim())).epoch != epoch,
             "the pools allocated anew after mooncake_client's restart")


def whole_puts_again(client: CacheClient, uid: str) -> None:
    """Wait until ``client`` stores whole pages again (through a KV pool of its own,
    removed after), so the next test finds a whole store: until the master expires the
    killed client's segment, puts may be placed there and fail."""
    pool = client.create_host_pool("mha", page_size=PAGE_SLOTS, size=PAGE_SLOTS,
                                   layer_num=1, head_num=1, head_dim=4, dtype=torch.uint8)
    client.register_mem_pool_host(pool)
    probes = iter(range(1 << 30))
    wait_for(lambda: all(client.batch_set_v1([f"{uid}-probe-{next(probes)}"],
                                             torch.arange(PAGE_SLOTS))),
             "whole puts after mooncake_client's restart")
    client.destroy_host_pool(pool)


PAGE_SLOTS = 4


def test_a_copy_out_held_across_a_client_restart_loads_the_bytes_read(cluster, uid):
    """A rank's get through a staging pool returned its pages read; while the rank copies
    them out to the engine (held here), node 1's mooncake_client dies and the node
    allocates every pool anew. The rank holds the staging pool's memory from before its
    get until its copy ended (``HostPool.held``), so the node gives that memory back only
    afterwards: every page reported loaded holds the bytes stored. Control (the old
    release, holes punched once the node's own calls ended): zeros copied out and the
    pages reported loaded."""
    client = CacheClient(StorageConfig(model_name=f"stand/held-{uid}"))
    n = 3
    engine = torch.randn(2, 4 * n * PAGE_SLOTS, 2, 1, 8).to(torch.float16)
    memory = describe_kv_buffer(engine, PAGE_SLOTS)
    staging = client.create_host_pool(memory.layout, per_process=True)
    gate = Gate()

    def stage(pool):
        gate.wait_here()  # only the get's copy out is armed
        return buffer_pages(pool)

    client.register_mem_pool_host(StagedPool(memory, staging, stage=stage))
    keys = [f"{uid}-{i}" for i in range(n)]
    assert client.batch_set_v1(keys, indices(0, n)) == [True] * n
    want = engine[:, :n * PAGE_SLOTS].clone()
    got: list = []
    gate.armed = True
    reader = threading.Thread(target=lambda: got.append(client.batch_get_v1(
        keys, indices(n * PAGE_SLOTS, n))))
    reader.start()
    try:
        assert gate.copying.wait(60), "the get never reached its copy out"
        kill_client_and_wait_for_new_pools(cluster, client, staging.name,
                                           staging.handle.epoch)
    finally:
        gate.go.set()
        reader.join()
    assert got == [[True] * n]  # the get ended before the restart
    assert torch.equal(engine[:, n * PAGE_SLOTS:2 * n * PAGE_SLOTS], want), \
        "pages reported loaded do not hold the bytes stored"
    whole_puts_again(client, uid)
    client.destroy_host_pool(staging)
    client.close()


def test_an_l2_load_copied_behind_across_a_client_restart_loads_the_bytes_saved(cluster,
                                                                                 uid):
    """A vLLM worker's L2 load of 4 blocks copied layer by layer behind the forward
    (``L2Blocks.load`` with ``LayerLoads``; vLLM-shaped host blocks, the real node L2):
    the copy thread is held before its first layer while node 1's mooncake_client dies
    and the node allocates every pool anew (L2 included). The load holds the L2 pool's
    memory until ``release`` after the copies, so every block loaded holds the bytes
    saved. Control (the old load and release): zeros copied into the blocks behind,
    and the copies reported done."""
    client = CacheClient(StorageConfig(model_name=f"stand/l2-{uid}"))
    geom = dict(page_size=PAGE_SLOTS, layer_num=2, head_num=2, head_dim=8,
                dtype="float16", itemsize=2)
    blocks = 8
    layout = PoolLayout.vllm(size=blocks * PAGE_SLOTS, **geom)
    block = (geom["head_num"], PAGE_SLOTS, geom["head_dim"])
    layers = [torch.randn(blocks, *block).to(torch.float16) for _ in range(2)]

    def views(pool):
        buf = pool.kv_buffer
        pages = buf.view(buf.shape[0], buf.shape[1], -1)
        return [pages[:, i].view(buf.shape[0], *block) for i in range(buf.shape[1])]

    l2 = L2Blocks.open(client, layers, views, staging_layout(layout, 1), blocks)
    assert l2 is not None
    hashes = [f"{uid}-h{i}" for i in range(4)]
    assert l2.save([0, 1, 2, 3], hashes) == (4, [])
    want = [layer[:4].clone() for layer in layers]
    for layer in layers:
        layer[4:].zero_()
    gate = Gate()

    class HeldLoads(LayerLoads):
        def start(self, copy, n):
            def held(i):
                gate.wait_here()
                copy(i)
            super().start(held, n)

    loads = HeldLoads()
    gate.armed = True
    try:
        assert l2.load([4, 5, 6, 7], hashes, loads) == (4, [4, 5, 6])
        assert gate.copying.wait(60), "the copies behind never started"
        kill_client_and_wait_for_new_pools(cluster, client, l2.pool.name,
                                           l2.pool.handle.epoch)
    finally:
        gate.go.set()
    assert loads.finish() is True
    l2.release()
    loads.close()
    for layer, saved in zip(layers, want, strict=True):
        assert torch.equal(layer[4:], saved), "blocks loaded do not hold the bytes saved"
    whole_puts_again(client, uid)
    client.close()


@pytest.mark.engine("sglang")
def test_sglang_memory_is_staged_in_standalone_mode(cluster, tmp_path, uid):
    """SGLang 0.5.23's own controller and host pools (``allocator: shm``) on this
    standalone cluster: the store's buffers are mooncake_client's, which cannot map
    SGLang's memfds, so RayKVStore serves them through staging pools allocated from
    mooncake_client's memory (counted in the node's budget), with one warning naming
    standalone mode. Pages SGLang backs up through node 1 load byte-identical through
    node 2 (one SGLang driver process, one scenario per node)."""
    extra = {"staging_pages": 2}  # 2 pages per direction: 5 pages move in 3 rounds
    out = run_driver(tmp_path, cluster, 0, [
        scenario("writer", "mha", "shm", [
            {"op": "write", "seed": f"st-{uid}", "n_pages": 5},
            {"op": "stats"}], model_name=f"stand/sglang-{uid}", node=0, extra=extra),
        scenario("reader", "mha", "shm", [
            {"op": "prefetch", "seed": f"st-{uid}", "n_pages": 5},
            {"op": "prefetch", "seed": f"never-{uid}", "n_pages": 3},
            {"op": "stats"}], model_name=f"stand/sglang-{uid}", node=1, extra=extra),
    ])["scenarios"]
    written, w_stats = steps(out["writer"])
    assert written["completed"] == [5 * PAGE]
    pre, never, r_stats = steps(out["reader"])
    assert pre["hit_pages"] == 5 and pre["kv_match"] == [True] * 5
    assert never["hit_pages"] == 0
    # 2 x 2 staging pages of K and V, 2 layers x 16 tokens x 2 heads x 64 x bf16 each.
    staging_bytes = 4 * 2 * (2 * 16 * 2 * 64 * 2)
    for st, sc in ((w_stats, out["writer"]), (r_stats, out["reader"])):
        assert st["mode"] == "standalone" and st["node"]["mode"] == "standalone"
        assert st["pools"]["kv"]["zero_copy"] is False and st["pools"]["kv"]["memfd"]
        assert st["counters"]["staged_bytes"] >= 5 * staging_bytes // 4
        assert st["node_pools"][st["pools"]["kv"]["raykv_pool"]]["bytes"] == staging_bytes
        assert st["node"]["host_pool_used"] >= staging_bytes
        staging = [m for m in sc["warnings"] if "staging copy" in m]
        assert len(staging) == 1 and "standalone Mooncake mode" in staging[0], sc["warnings"]
        assert all(sc["threads"].values())


def test_budget_refuses_before_counting():
    budget = PoolBudget(100)
    budget.reserve("a", 60)
    with pytest.raises(ValueError, match=r"pool 'b' needs 41 bytes .* use 60 of "
                                         r"host_pool_bytes=100 \(40 left\)"):
        budget.reserve("b", 41)
    assert budget.used == 60
    budget.reserve("b", 40)
    budget.release(60)
    assert budget.used == 40
    unlimited = PoolBudget(0)
    unlimited.reserve("c", 1 << 50)
    with pytest.raises(ValueError, match="host_pool_bytes must be >= 0, got -1"):
        PoolBudget(-1)


def test_record_matches_only_the_recorded_process():
    me = os.getpid()
    with open(f"/proc/{me}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    assert not ClientRecord(me, 1234, ticks).running()  # alive, but not mooncake_client
    assert not ClientRecord(me, 1234, ticks + 1).running()
    assert not ClientRecord(2**22 + 1, 1234, ticks).running()  # no such pid


def test_mode_switch_must_match_the_node():
    check_mode(None, "embedded")
    check_mode({"standalone_storage": True}, "standalone")
    check_mode({"standalone_storage": False}, "embedded")
    with pytest.raises(ValueError, match="is True but this node's actor runs in "
                                         "embedded mode"):
        check_mode({"standalone_storage": True}, "embedded")
