"""``raykv why`` names the right reason, on a real cluster (Ray, ``mooncake_master``,
one node with a small L2): a vLLM deployment's rank writes prompts' blocks through its
L2 pool of 4 pages (the write-behind puts them to L3), and ``clusters.why.why`` is asked
about them as an operator would.

Cases, each with its control (a prompt that IS there, reported held in the right tier):
never saved; evicted from L2 (a second prompt took the pool's 4 pages: the first one is
held in L3 only, and the node's eviction record says when L2 dropped it); evicted from
L3 (such a prompt then removed from the store: the node's journal says it stored it,
and its eviction record that L2 dropped it); another
identity (a deployment of another KV dtype asks about blocks the first one saved: the
differing fields named); another tenant (tenant ``alice`` asks about blocks saved
without a tenant: ``tenant`` named; the deployment without a tenant asking about
alice's blocks learns nothing of them); skipped by the load guard (a threshold longer
than the prompt at a given prefill rate; control: a shorter one loads them). The CLI
is run once, in this process, for its JSON.
"""

from __future__ import annotations

import json
import time

import pytest
import ray
import torch
from click.testing import CliRunner
from raykv import local_settings, start_local
from raykv.cache_actors.rank.client import CacheClient
from raykv.clusters.cli import main
from raykv.clusters.why import keys_of, page_hashes, why
from raykv.controllers import StorageConfig
from raykv.controllers.deployments import Deployment
from raykv.controllers.miss_reasons import (
    EVICTED_L2,
    EVICTED_L3,
    NEVER_SAVED,
    OTHER_IDENTITY,
    SKIPPED_BY_GUARD,
)
from raykv.controllers.pool_layout import MiB, PoolLayout
from raykv.controllers.tenancy import TENANT_SECRET_ENV

PAGE = 4
LAYOUT = PoolLayout.vllm(page_size=PAGE, size=PAGE, layer_num=2, head_num=1, head_dim=16,
                         dtype="bfloat16", itemsize=2)
BLOCKS = 4  # blocks per prompt, and pages of each L2 pool
WAIT_S = 90.0  # a loaded 2-core host is slow; each wait ends as soon as its event is seen
SECRET = "s" * 32


@pytest.fixture(scope="module")
def cluster():
    with start_local(settings=local_settings(global_segment_size=64 * MiB, l2_bytes=16 * MiB),
                     num_nodes=1) as c:
        yield c


def prompt(seed: int) -> list[int]:
    """A prompt of ``BLOCKS`` full blocks (and two tokens more)."""
    return [seed * 1000 + i for i in range(BLOCKS * PAGE + 2)]


def engine(model: str, **extra) -> tuple[CacheClient, object]:
    """A rank of a vLLM deployment of ``model`` (``extra``: its extra config) with its
    KV pool registered and an L2 pool of ``BLOCKS`` pages."""
    client = CacheClient(StorageConfig(model_name=model, extra_config={
        "page_size": PAGE, **extra}))
    client.register_mem_pool_host(client.create_host_pool(LAYOUT))
    client.register_deployment()
    return client, client.l2().open(LAYOUT, BLOCKS)


def save(client: CacheClient, pool, tokens: list[int]) -> None:
    """``tokens``' blocks written into the L2 pool as a vLLM worker saves them, then
    waited for in L3 (the write-behind)."""
    link = client.l2()
    hashes = page_hashes("vllm", tokens, PAGE)
    before = client.stats().l2.l3_put
    pages = link.reserve(pool.name, hashes)
    assert all(p >= 0 for p in pages), pages
    buf = pool.kv_buffer.view(torch.uint8).view(pool.layout.num_pages, -1)
    buf[pages] = torch.randint(0, 255, (len(pages), buf.shape[1]), dtype=torch.uint8)
    assert link.commit(pool.name, hashes, pages, [True] * len(pages)) == len(pages)
    deadline = time.monotonic() + WAIT_S
    while client.stats().l2.l3_put < before + len(pages):
        assert time.monotonic() < deadline, client.stats().l2
        time.sleep(0.1)


def reasons(report: dict) -> list[list[str]]:
    return [[r for r, _ in b["reasons"]] for b in report["blocks"]]


def tiers(report: dict) -> list[str | None]:
    return [b["tier"] for b in report["blocks"]]


@pytest.fixture(scope="module")
def saved(cluster):
    """Deployment A (bfloat16) saved prompt 1, then prompt 2, which evicted prompt 1
    from its L2 pool; deployment B (float16) registered and saved nothing; tenant
    alice's deployment saved prompt 3. Yields the deployment ids, the node's and B's
    client and L2 pool."""
    mp = pytest.MonkeyPatch()
    uid = f"{time.time_ns() % 10**9}"
    model = f"why/m{uid}"
    a, pool_a = engine(model, extra_backend_tag="bf16", kv_dtype="bfloat16")
    b, pool_b = engine(model, extra_backend_tag="f16", kv_dtype="float16")
    save(a, pool_a, prompt(1))
    save(a, pool_a, prompt(2))  # its 4 pages: prompt 1's go (flushed, not held)
    mp.setenv(TENANT_SECRET_ENV, SECRET)
    t, pool_t = engine(model, extra_backend_tag="bf16", kv_dtype="bfloat16",
                       tenant="alice")
    save(t, pool_t, prompt(3))
    ids = {"a": a.register_deployment(), "b": b.register_deployment(),
           "t": t.register_deployment(), "node": a.node_id, "b_client": (b, pool_b)}
    yield ids
    for client in (a, b, t):
        client.close()
    mp.undo()


def test_never_saved_and_held_in_l2(saved):
    report = why(prompt(9), saved["a"])
    assert report["failed_nodes"] == {}, report
    assert report["blocks_in_prompt"] == BLOCKS and report["hashes"] == "vllm"
    assert reasons(report) == [[NEVER_SAVED]] * BLOCKS
    # control: prompt 2 is in the node's L2 (and in L3)
    held = why(prompt(2), saved["a"])
    assert tiers(held) == ["l2"] * BLOCKS and reasons(held) == [[]] * BLOCKS
    assert all(b["held"]["l2"] == [saved["node"]] and "l3" in b["held"]
               for b in held["blocks"])


def test_evicted_from_l2_is_named_with_its_node(saved):
    report = why(prompt(1), saved["a"])
    assert tiers(report) == ["l3"] * BLOCKS
    assert reasons(report) == [[EVICTED_L2]] * BLOCKS
    assert all(saved["node"][:12] in b["reasons"][0][1] for b in report["blocks"])
    # control: prompt 2, never evicted, has no such record
    assert all(EVICTED_L2 not in r for r in reasons(why(prompt(2), saved["a"])))
    stats = ray.get(ray.get_actor(f"raykv-node-{saved['node']}", namespace="raykv")
                    .stats.remote(), timeout=30)
    assert stats.l2_evictions.evictions >= BLOCKS


def test_evicted_from_l3_is_named_when_a_node_stored_it(saved, cluster):
    """B saves prompt 5, then prompt 6 (its 4 L2 pages: prompt 5 leaves L2); prompt 5's
    objects are then removed from the store behind the node's back (as Mooncake's own
    eviction does), injected from here."""
    client, pool = saved["b_client"]
    save(client, pool, prompt(5))
    save(client, pool, prompt(6))
    dep = Deployment.from_dict(ray.get(cluster.controller.deployments.remote(),
                                       timeout=30)[saved["b"]])
    keys, _ = keys_of(dep, page_hashes("vllm", prompt(5), PAGE))
    actor = cluster.node_actors[saved["node"]]
    assert ray.get(actor.__ray_call__.remote(
        lambda node: node._service._store.backend.remove(keys)), timeout=30) == [0] * BLOCKS
    report = why(prompt(5), saved["b"])
    assert tiers(report) == [None] * BLOCKS
    assert reasons(report) == [[EVICTED_L2, EVICTED_L3]] * BLOCKS
    # control: prompt 6, still held, has no such record
    assert tiers(why(prompt(6), saved["b"])) == ["l2"] * BLOCKS


def test_another_dtype_is_named(saved):
    report = why(prompt(2), saved["b"])
    assert tiers(report) == [None] * BLOCKS
    assert reasons(report) == [[OTHER_IDENTITY]] * BLOCKS
    detail = report["blocks"][0]["reasons"][0][1]
    assert saved["a"] in detail and "kv_dtype='float16' (theirs: 'bfloat16')" in detail
    assert "extra_backend_tag" in detail and "tenant" not in detail
    # control: the same blocks asked of the deployment that saved them are held
    assert tiers(why(prompt(2), saved["a"])) == ["l2"] * BLOCKS


def test_another_tenant_is_named_to_a_holder_of_its_secret_only(saved, monkeypatch):
    monkeypatch.setenv(TENANT_SECRET_ENV, SECRET)
    report = why(prompt(2), saved["t"])
    assert reasons(report) == [[OTHER_IDENTITY]] * BLOCKS
    detail = report["blocks"][0]["reasons"][0][1]
    assert saved["a"] in detail and "tenant='alice' (theirs: None)" in detail
    # control: alice's own prompt is held in her L2
    assert tiers(why(prompt(3), saved["t"])) == ["l2"] * BLOCKS
    # the deployment without a tenant learns nothing of alice's blocks
    plain = why(prompt(3), saved["a"])
    assert reasons(plain) == [[NEVER_SAVED]] * BLOCKS
    assert saved["t"] in plain["not_checked"]
    # and without alice's secret her deployment cannot be asked at all
    monkeypatch.delenv(TENANT_SECRET_ENV)
    with pytest.raises(ValueError, match="alice"):
        why(prompt(3), saved["t"])


def test_the_load_guard_skips_a_hit_below_its_threshold(saved):
    report = why(prompt(2), saved["a"], prefill_tokens_per_s=1000.0, guard="100")
    assert report["guard"]["load_pages"] == 0
    assert report["guard"]["estimates_from"] in ("none", "group answer")
    assert reasons(report) == [[SKIPPED_BY_GUARD]] * BLOCKS
    # control: a threshold the hit reaches loads all of it
    report = why(prompt(2), saved["a"], prefill_tokens_per_s=1000.0, guard="8")
    assert report["guard"]["load_pages"] == BLOCKS
    assert reasons(report) == [[]] * BLOCKS


def test_the_cli_prints_the_same_report(saved):
    tokens = ",".join(map(str, prompt(2)))
    run = CliRunner().invoke(main, ["why", "--deployment", saved["a"], "--tokens", tokens,
                                    "--json"])
    assert run.exit_code == 0, run.output
    report = json.loads(run.output[run.output.index("{"):])
    assert tiers(report) == ["l2"] * BLOCKS
    run = CliRunner().invoke(main, ["why", "--deployment", saved["a"], "--tokens",
                                    ",".join(map(str, prompt(9)))])
    assert run.exit_code == 0, run.output
    assert f"blocks 0-{BLOCKS - 1}: missing (never_saved" in run.output
    # control: a deployment that is not registered is an error listing the others
    run = CliRunner().invoke(main, ["why", "--deployment", "nope", "--tokens", tokens])
    assert run.exit_code == 1 and saved["a"] in run.output
