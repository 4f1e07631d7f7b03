"""raykv's vLLM connector with a real vLLM (CPU build) on a real two-node raykv cluster.

Engines run inside Ray actors pinned to nodes (``raykv_lab.engines.vllm_actors``),
in-process and eager (one engine in vLLM's default multiprocess mode), on a tiny
random Llama that a fixture makes (``raykv_lab.engines.vllm_model``, no download).
Block size 128: a 1000-token prompt has 7 full blocks that may come from raykv (the
last token is always computed).

The reference for an engine's tokens after it loaded blocks from raykv is the engine that
computed those blocks restoring them from its own prefix cache (``computed_then_restored``):
the same computation (the last tokens over the cached ones, same mode, one OMP thread) over
KV that must be the same bytes. A cold run of the prompt is not a reference: greedy tokens
of vLLM's CPU kernels depend on the OMP thread count (measured here: 2 threads instead of 1
changed the greedy tokens of 5 of 6 prompts, as much after vLLM's own prefix-cache restore
as after a raykv load) and on how a prefill is split (see test_partial_hit).
``test_loaded_blocks_are_the_bytes_the_other_engine_saved`` compares the KV bytes
themselves; ``test_corrupted_loads_change_the_output`` shows the loaded KV is used.

Every connector engine here runs with the load guard off (``"load_guard": "off"``):
these tests are about loads, and under ``auto`` this tiny model's prefill may beat a
load on a busy machine (a recompute measured here, an L3 hit of 7 blocks); the guard
is tested in test_vllm_load_guard.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from dataclasses import asdict

import pytest
import ray
from raykv import local_settings, start_local
from raykv_lab.engines.vllm_actors import ready, start_engine
from raykv_lab.engines.vllm_model import make_llama

from tests.integration.serve_llm import example as serve_example
from tests.integration.serve_llm import serve_llm
from tests.integration.vllm_control import ControlEngine

pytestmark = pytest.mark.engine("vllm")


BLOCK = 128


def prompt(seed: int, n: int = 1000) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 2000) for _ in range(n)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_llama(str(tmp_path_factory.mktemp("vllm") / "tiny-llama"))


@pytest.fixture(scope="module")
def vcluster():
    with start_local(settings=local_settings(global_segment_size=256 << 20), num_nodes=2) as c:
        yield c


@pytest.fixture(scope="module")
def engines(vcluster, model, uid_module):
    """Engine A on node 1 (raykv and vLLM's own prefix cache), engine B on node 2 (raykv,
    vLLM's prefix cache off, vLLM's KV events on, published nowhere), both
    ``kv_load_failure_policy="recompute"`` and both ``ControlEngine``s, and a baseline
    without the connector on node 1, with vLLM's own prefix cache (see
    test_partial_hit)."""
    n1, n2 = vcluster.node_ids
    conf = {"model_name": f"tiny-{uid_module}", "load_guard": "off"}
    a = start_engine(n1, model, conf, enable_prefix_caching=True, actor_class=ControlEngine)
    b = start_engine(n2, model, conf, actor_class=ControlEngine,
                     kv_events_config={"enable_kv_cache_events": True, "publisher": "null"})
    base = start_engine(n1, model, None, enable_prefix_caching=True)
    ready(a, b, base)
    yield a, b, base
    for e in (a, b, base):
        ray.kill(e)


@pytest.fixture(scope="module")
def uid_module() -> str:
    import uuid

    return uuid.uuid4().hex[:8]


def computed_then_restored(engine, p: list[int]) -> list[int]:
    """``engine`` (vLLM's prefix cache on) computes ``p`` (a connector engine saves its
    blocks), then serves it again with its 7 full blocks from its own prefix cache; the
    tokens of that second run: the reference of a raykv load of the same blocks."""
    ray.get(engine.generate.remote(p))
    restored = ray.get(engine.generate.remote(p))
    assert restored["cached"] == 7 * BLOCK, restored
    return restored["tokens"]


def test_second_node_loads_blocks_and_matches_own_prefix_cache(engines):
    a, b, base = engines
    p = prompt(1)
    want = computed_then_restored(a, p)
    got = ray.get(b.generate.remote(p))
    assert got["cached"] == 7 * BLOCK, got
    assert got["tokens"] == want


def test_loaded_blocks_are_the_bytes_the_other_engine_saved(engines):
    """Per block and layer, B's KV cache right after its load holds exactly the bytes
    A's KV cache held when A saved the block (SHA-256 of each). Control: with random
    bytes loaded, no loaded block of any layer matches (the comparison sees wrong
    bytes)."""
    a, b, base = engines

    def served_by_a_then_b(seed: int) -> tuple[dict, dict]:
        ray.get([a.record_blocks.remote(True), b.record_blocks.remote(True)])
        p = prompt(seed)
        ray.get(a.generate.remote(p))
        got = ray.get(b.generate.remote(p))
        assert got["cached"] == 7 * BLOCK, got
        saved = ray.get(a.recorded_blocks.remote())["saved"]
        loaded = ray.get(b.recorded_blocks.remote())["loaded"]
        assert len(loaded) == 7 and set(loaded) <= set(saved), (len(loaded), len(saved))
        return saved, loaded

    try:
        saved, loaded = served_by_a_then_b(5)
        assert {h: saved[h] for h in loaded} == loaded
        ray.get(b.corrupt_loads.remote(True))
        try:
            saved, loaded = served_by_a_then_b(6)
        finally:
            ray.get(b.corrupt_loads.remote(False))
        assert not any(s == d for h, layers in loaded.items()
                       for s, d in zip(saved[h], layers, strict=True))
    finally:
        ray.get([a.record_blocks.remote(False), b.record_blocks.remote(False)])


def test_partial_hit(engines):
    """A prompt sharing only its first 4 blocks (and part of the 5th) with one that A
    served: B loads 4 blocks and computes the rest. The reference is the baseline
    engine's own prefix cache (it served the first prompt too), which computes the same
    550 tokens over the same cached 512. A 1062-token prefill from scratch differed from
    B's output at token 5 here (bf16 results on vLLM's CPU kernels depend on the
    prefill's shape), so it cannot be the reference."""
    a, b, base = engines
    p = prompt(11)
    ray.get([a.generate.remote(p), base.generate.remote(p)])
    q = p[:4 * BLOCK + 50] + prompt(12, 500)
    want = ray.get(base.generate.remote(q))
    assert want["cached"] == 4 * BLOCK  # vLLM's own prefix cache
    got = ray.get(b.generate.remote(q))
    assert got["cached"] == 4 * BLOCK, got
    assert got["tokens"] == want["tokens"]
    # A has the first 4 blocks in its own prefix cache and B saved the next 4: A loads
    # only those from raykv (8 of q's 8 full blocks cached, 4 + 4).
    got = ray.get(a.generate.remote(q))
    assert got["cached"] == 8 * BLOCK, got
    assert got["tokens"] == want["tokens"]


def test_a_prompt_of_whole_blocks_loads_its_last_block_too(engines):
    """A prompt of 8 whole blocks that A computed: B loads all 8 and computes only the
    last token again (1023 tokens cached), with the tokens of stock vLLM restoring the
    prompt from its own prefix cache (which leaves the whole last block to compute: 896
    cached). Control: with random bytes loaded, B's tokens differ."""
    a, b, base = engines
    p, q = prompt(161, 8 * BLOCK), prompt(162, 8 * BLOCK)

    def stock_restored(x: list[int]) -> list[int]:
        ray.get(base.generate.remote(x))
        own = ray.get(base.generate.remote(x))
        assert own["cached"] == 7 * BLOCK, own
        return own["tokens"]

    ray.get(a.generate.remote(p))
    got = ray.get(b.generate.remote(p))
    assert got["cached"] == 8 * BLOCK - 1, got
    assert got["tokens"] == stock_restored(p)
    ray.get(a.generate.remote(q))
    want_q = stock_restored(q)
    ray.get(b.corrupt_loads.remote(True))
    try:
        bad = ray.get(b.generate.remote(q))
    finally:
        ray.get(b.corrupt_loads.remote(False))
    assert bad["cached"] == 8 * BLOCK - 1 and bad["tokens"] != want_q, bad


def test_corrupted_loads_change_the_output(engines):
    """Control: with random bytes loaded instead of the stored blocks, the output differs
    (so the equality above really depends on the loaded KV)."""
    a, b, base = engines
    p = prompt(3)
    want = computed_then_restored(a, p)
    ray.get(b.corrupt_loads.remote(True))
    try:
        got = ray.get(b.generate.remote(p))
    finally:
        ray.get(b.corrupt_loads.remote(False))
    assert got["cached"] == 7 * BLOCK, got
    assert got["tokens"] != want


def test_kv_events_name_the_blocks_raykv_stored(engines):
    """B (vLLM's KV events on) computes a prompt: its connector saves the 7 full blocks
    through the store, and B's scheduler publishes, with vLLM's own events, one
    ``BlockStored`` per block in raykv's L3 (medium ``STORAGE``, ownership
    ``raykv-l3``) in vLLM's block hashes, chained by parent, with the block's tokens.
    Control: A (events off) saves the 7 blocks of another prompt and publishes no
    event of raykv's tiers."""
    a, b, base = engines
    ray.get([a.record_events.remote(), b.record_events.remote()])
    p, q = prompt(171), prompt(172)  # seeds of their own: other tests check whose bytes load
    ray.get(b.generate.remote(p))
    want = ray.get(b.vllm_block_hashes.remote(p, BLOCK))[:7]
    events = ray.get(b.recorded_events.remote())
    assert [e["type"] for e in events] == ["BlockStored"] * 7, events
    assert {(e["medium"], e["ownership"]) for e in events} == {("STORAGE", "raykv-l3")}
    assert [e["block_hashes"] for e in events] == [[h] for h in want]
    assert [e["parent"] for e in events] == [None, *want[:6]]
    assert [e["token_ids"] for e in events] == [p[i * BLOCK:(i + 1) * BLOCK] for i in range(7)]
    (w0,) = ray.get(a.worker_stats.remote())
    ray.get(a.generate.remote(q))
    (w1,) = ray.get(a.worker_stats.remote())
    assert w1.counters.saved - w0.counters.saved == 7
    assert ray.get(a.recorded_events.remote()) == []


@pytest.fixture(scope="module")
def other_engines(vcluster, model, uid_module):
    """Engine C on node 2: B's configuration in a process whose ``PYTHONHASHSEED`` is
    12345 (A's is unset). Engine D on node 1: A's configuration but a float16 model,
    hence a float16 KV cache (A's is bfloat16), same block size and page bytes."""
    n1, n2 = vcluster.node_ids
    conf = {"model_name": f"tiny-{uid_module}", "load_guard": "off"}
    c = start_engine(n2, model, conf, env={"PYTHONHASHSEED": "12345"},
                     actor_class=ControlEngine)
    d = start_engine(n1, model, conf, dtype="float16", actor_class=ControlEngine)
    ready(c, d)
    yield c, d
    for e in (c, d):
        ray.kill(e)


def _counts(engine) -> tuple[int, int]:
    """``engine``'s blocks found by its hit queries and blocks loaded, so far."""
    hits = ray.get(engine.scheduler_stats.remote()).hit_blocks
    (worker,) = ray.get(engine.worker_stats.remote())
    return hits, worker.counters.loaded


def _served(engine, p: list[int], **kw) -> tuple[dict, tuple[int, int]]:
    """``engine``'s answer to ``p`` and its blocks found and loaded for it."""
    h0, l0 = _counts(engine)
    got = ray.get(engine.generate.remote(p, **kw))
    h1, l1 = _counts(engine)
    return got, (h1 - h0, l1 - l0)


def computed_then_restored_salted(engine, p: list[int], salt: str) -> list[int]:
    """``computed_then_restored`` under cache salt ``salt``."""
    ray.get(engine.generate.remote(p, cache_salt=salt))
    restored = ray.get(engine.generate.remote(p, cache_salt=salt))
    assert restored["cached"] == 7 * BLOCK, restored
    return restored["tokens"]


def test_cache_salt_isolates_requests(engines):
    """A serves a prompt under cache salt "tenant-a". B asked for the same prompt under
    another salt, or none, finds no block and loads none (the salt is in every page
    hash, through the first block's). Control: under the same salt B finds and loads all
    7 blocks and gives A's tokens."""
    a, b, base = engines
    p = prompt(41)
    want = computed_then_restored_salted(a, p, "tenant-a")
    for salt in ("tenant-b", None):
        got, (hit, loaded) = _served(b, p, cache_salt=salt)
        assert (got["cached"], hit, loaded) == (0, 0, 0), (salt, got)
    got, (hit, loaded) = _served(b, p, cache_salt="tenant-a")
    assert (got["cached"], hit, loaded) == (7 * BLOCK, 7, 7), got
    assert got["tokens"] == want


def test_engines_of_other_hash_seeds_share_blocks(engines, other_engines):
    """C (``PYTHONHASHSEED=12345``) loads the 7 blocks A (no ``PYTHONHASHSEED``) saved
    and gives A's tokens: raykv's page hashes do not depend on the seed. Control:
    vLLM's own hash of the prompt's first block (``request.block_hashes[0]``, the key of
    a connector keyed by vLLM's block hashes) differs between A and C, so such keys
    would have missed."""
    a, b, base = engines
    c, d = other_engines
    q = prompt(42)
    seed_a, vllm_a = ray.get(a.vllm_block_hash.remote(q, BLOCK))
    seed_c, vllm_c = ray.get(c.vllm_block_hash.remote(q, BLOCK))
    assert (seed_a, seed_c) == (None, "12345")
    assert vllm_a != vllm_c
    want = computed_then_restored(a, q)
    got, (hit, loaded) = _served(c, q)
    assert (got["cached"], hit, loaded) == (7 * BLOCK, 7, 7), got
    assert got["tokens"] == want


def test_other_kv_dtype_is_a_miss_never_a_load(engines, other_engines):
    """D (float16 KV) asks for a prompt whose bfloat16 blocks A saved: its key tag names
    its KV dtype, so its hit query finds nothing and it loads nothing. Re-keyed with A's
    tag, D's hit query is refused by raykv's deployment registry (one key prefix, two KV
    dtypes): still a miss. Control: D re-keyed with A's tag and claiming A's identity
    (and registering its blocks as bfloat16 ones: the registry also sees the dtype of
    the blocks' geometry) finds and loads A's 7 bfloat16 blocks into its float16 cache
    (the page hashes are the same, only the key space told them apart): what a key
    space without the dtype would have done."""
    a, b, base = engines
    c, d = other_engines
    r = prompt(43)
    ray.get(a.generate.remote(r))
    tag_a, tag_d = ray.get([a.key_tag.remote(), d.key_tag.remote()])
    assert (tag_a, tag_d) == ("vllm-tp1-bfloat16-b128-cpu.cpu-attn.lm1",
                              "vllm-tp1-float16-b128-cpu.cpu-attn.lm1")
    got, (hit, loaded) = _served(d, r)
    assert (got["cached"], hit, loaded) == (0, 0, 0), got
    id_a, id_d = ray.get([a.key_identity.remote(), d.key_identity.remote()])
    ray.get(d.rekey.remote(tag_a))
    try:
        refused, (hit_refused, loaded_refused) = _served(d, r)
        ray.get(d.rekey.remote(tag_a, id_a))
        got, (hit, loaded) = _served(d, r)
    finally:
        ray.get(d.rekey.remote(tag_d, id_d))
    assert (refused["cached"], hit_refused, loaded_refused) == (0, 0, 0), refused
    assert (got["cached"], hit, loaded) == (7 * BLOCK, 7, 7), got


def _gets(vcluster) -> dict[str, int]:
    """Objects each node actor has read from Mooncake so far."""
    return {n: ray.get(actor.stats.remote()).counters.get("get_objects", 0)
            for n, actor in vcluster.node_actors.items()}


def test_serve_example_hands_the_tenant_secret_to_the_replicas_only(monkeypatch):
    """The Serve example's tenant: the key in the connector's extra config, the path of
    the secret file in the replicas' runtime_env, never the secret (Ray shows a runtime
    env's variables to every job); no secret file, no app."""
    example = serve_example()
    monkeypatch.setenv("RAYKV_TENANT_SECRET", "s" * 32)  # never handed on
    monkeypatch.setenv("RAYKV_TENANT_SECRET_FILE", "/run/secrets/acme")
    config = example.raykv_llm_config("m", "src", replicas=1, cpu=True, prefix_caching=False,
                                      max_model_len=256, tenant="acme")
    extra = config.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra == {"model_name": "src", "tenant": "acme"}
    assert config.runtime_env["env_vars"]["RAYKV_TENANT_SECRET_FILE"] == "/run/secrets/acme"
    assert "s" * 32 not in repr(config.model_dump())
    plain = example.raykv_llm_config("m", "src", replicas=1, cpu=True, prefix_caching=False,
                                     max_model_len=256)
    assert "RAYKV_TENANT_SECRET_FILE" not in plain.runtime_env["env_vars"]  # control
    monkeypatch.delenv("RAYKV_TENANT_SECRET_FILE")
    with pytest.raises(ValueError, match="RAYKV_TENANT_SECRET_FILE"):
        example.raykv_llm_config("m", "src", replicas=1, cpu=True, prefix_caching=False,
                                 max_model_len=256, tenant="acme")


def test_the_examples_router_config_keys_blocks_as_its_engines_connector():
    """``examples/serve_llm_raykv.py`` with the router: the router's kwargs and the
    engines' connector config give the same key prefix and owner claim, whatever the
    engine's KV dtype or attention backend (control: without the shared tag, a
    connector on another attention backend keys blocks under another prefix, and the
    router would only ever see misses)."""
    from raykv.controllers.keys import KeyScheme
    from raykv.integrations.serve.route_keys import RouteKeys, RouteOptions
    from raykv.integrations.vllm.options import ConnectorOptions, KVIdentity

    example = serve_example()
    config = example.raykv_llm_config("m", "org/src", replicas=2, cpu=True,
                                      prefix_caching=True, max_model_len=256,
                                      router_block_size=32)
    routing = config.deployment_config["request_router_config"]
    assert routing["request_router_class"] == example.ROUTER
    assert config.engine_kwargs["block_size"] == 32
    extra = config.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]
    router = RouteKeys(RouteOptions.parse(routing["request_router_kwargs"]))

    def prefix(extra: dict, identity: KVIdentity) -> str:
        conn = ConnectorOptions.parse(extra, tp_size=1, pp_size=1, served_model="m",
                                      identity=identity)
        cfg = conn.storage_config(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        return KeyScheme.from_config(cfg).prefix

    flash = KVIdentity("float16", 32, "cuda.flash-attn.lm1")
    assert prefix(extra, flash) == KeyScheme.from_config(router.config).prefix
    plain = {k: v for k, v in extra.items() if k != "extra_backend_tag"}
    assert prefix(plain, flash) != KeyScheme.from_config(router.config).prefix


def _l2(vcluster, counter: str) -> dict[str, int]:
    """A per-pool ``counter`` of each node's L2, summed over its pools (``_l2_stats``)."""
    return {n: _l2_stats(vcluster, n).get(counter, 0) for n in vcluster.node_actors}


def test_serve_llm_replicas_load_saved_blocks_and_route_to_the_node_that_holds_them(
        vcluster, model, uid_module):
    """Ray Serve LLM: ``examples/serve_llm_raykv.py``'s config with ``RayKVRouter``
    (``router_block_size``) and each node's L2 (``l2_blocks``), vLLM's own prefix cache
    off (every cached token came from raykv), two CPU replicas, one on each of two nodes
    added for them (not the head). Each replica runs vLLM's default multiprocess engine,
    whose engine core and worker are processes of their own, not Ray workers: their
    connectors join Ray themselves and use the node actor of the replica's node, not the
    head node's Ray attaches them to. The replica's worker runs one OMP thread as A does
    (``VLLM_CPU_OMP_THREADS_BIND=nobind`` keeps the example's ``OMP_NUM_THREADS=1``;
    vLLM's default binding gave it both cores and other greedy tokens from index 2 on).

    Loads: a prompt whose 7 blocks an in-process engine A on the head node saved (with
    the routed replicas' key tag, ``ROUTED_TAG``) is
    served by a replica, which loads them through its own node's actor (7 Mooncake gets
    there, none elsewhere) and gives the tokens of A restoring them from its own prefix
    cache. Routing: a new 1000-token prompt is computed on some replica, whose node's L2
    takes its blocks; six more requests extending it each load the 7 blocks from that
    node's L2 (its L2 hits grow, the other nodes' do not, no node reads from Mooncake).
    Control: by power of two choices all six would land there with chance 1/64 (the
    first request, when no node held anything, went to the replica sent the fewest
    lately: the router's ``spread``). One app for both checks: a start takes 1-4 minutes
    here (``test_group.py`` checks the router's rules against plain Serve deployments)."""
    example = serve_example()
    # A as the ``engines`` fixture's A, keying blocks with the routed replicas' tag
    a = start_engine(vcluster.node_ids[0], model, {
        "model_name": f"tiny-{uid_module}", "extra_backend_tag": example.ROUTED_TAG,
        "load_guard": "off"},
        enable_prefix_caching=True)
    added = [vcluster.add_node(num_cpus=4, resources={"serve_llm": 1}) for _ in range(2)]
    config = example.raykv_llm_config(
        "tiny", model, replicas=2, cpu=True, prefix_caching=False, max_model_len=2048,
        model_name=f"tiny-{uid_module}", router_block_size=BLOCK, l2_blocks=64,
        placement_group_config={"bundles": [{"CPU": 1, "serve_llm": 1}]})
    # a patient view: this checks where requests go, on a loaded machine
    config.deployment_config["request_router_config"]["request_router_kwargs"][
        "stale_ms"] = 5000.0
    try:
        with serve_llm(config) as url:
            q = prompt(31)
            want = computed_then_restored(a, q)
            before = _gets(vcluster)
            got = example.complete(url, "tiny", q, len(want), return_token_ids=True,
                                   ignore_eos=True)
            after = _gets(vcluster)
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 7 * BLOCK, got
            assert got["choices"][0]["token_ids"] == want
            loads = {n: after[n] - before.get(n, 0) for n in after}
            assert sorted(loads.values()) == [0] * (len(loads) - 1) + [7], loads
            assert max(loads, key=loads.get) in added, loads  # one object per block

            p = prompt(32)
            written = _l2(vcluster, "written")
            example.complete(url, "tiny", p, 2)
            wrote = [n for n, k in _l2(vcluster, "written").items() if k - written[n] == 7]
            assert len(wrote) == 1 and wrote[0] in added, (written, wrote)
            time.sleep(1.0)  # the routers' views learn the blocks (a refresh: 100 ms)
            gets, hits = _gets(vcluster), _l2(vcluster, "hits")
            for i in range(6):
                got = example.complete(url, "tiny", p + [100 + i] * 8, 2)
                assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 7 * BLOCK
            now, hits_now = _gets(vcluster), _l2(vcluster, "hits")
            grew = {n: hits_now[n] - hits[n] for n in now}
            assert grew[wrote[0]] >= 6 * 7 and not any(
                grew[n] for n in now if n != wrote[0]), grew
            assert now == gets  # every load from the node's own L2, none from Mooncake
    finally:
        ray.kill(a)
        for node in added:
            vcluster.remove_node(node)


L2_BLOCKS = 12
"""Pages of the L2 engines' L2 pool: a prompt's 7 blocks fit, three prompts' do not."""


@pytest.fixture(scope="module")
def l2_engines(vcluster, model, uid_module):
    """Two engines on node 2 with a node-local L2 of ``L2_BLOCKS`` pages, in A's and B's
    deployment (same model name and tag: what either saves, the others find): E
    (vLLM's prefix cache on: the reference restores from it) and F (prefix cache off, so
    every cached token of F came through raykv)."""
    n2 = vcluster.node_ids[1]
    conf = {"model_name": f"tiny-{uid_module}", "l2_blocks": L2_BLOCKS, "load_guard": "off"}
    e = start_engine(n2, model, conf, enable_prefix_caching=True, actor_class=ControlEngine)
    f = start_engine(n2, model, conf, actor_class=ControlEngine)
    ready(e, f)
    yield e, f
    for x in (e, f):
        ray.kill(x)


def _l2_stats(vcluster, node: str) -> dict:
    """The node's L2 counters summed over its L2 pools, and its store gets."""
    stats = ray.get(vcluster.node_actors[node].stats.remote())
    l2 = stats.l2
    out = {"gets": stats.counters.get("get_objects", 0), "filled": l2.filled,
           "fill_failed": l2.fill_failed, "l3_put": l2.l3_put, "l3_put_failed": l2.l3_put_failed}
    for pool in l2.pools.values():
        for k, v in asdict(pool).items():
            out[k] = out.get(k, 0) + v
    return out


def _flushed(vcluster, node: str) -> dict:
    """The node's L2 counters once its write-behind has no dirty page left (10 s at
    most)."""
    deadline = time.monotonic() + 10
    while (s := _l2_stats(vcluster, node))["dirty"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s["dirty"] == 0, s
    return s


def test_l2_same_node_reuse_without_mooncake(engines, l2_engines, vcluster):
    """E computes a prompt: its 7 blocks land in node 2's L2 and reach L3 behind (the
    node actor's write-behind). A fresh engine F on the same node finds all 7 in L2 and
    loads them with no Mooncake get on its node (node counter), byte for byte what E
    saved (SHA-256 per block and layer), and gives E's tokens restoring the prompt from
    its own prefix cache. Control: engine A on node 1 (no L2) loads the same blocks from
    L3 (7 Mooncake gets on node 1): they were in L3, and the counter sees gets."""
    a, b, base = engines
    e, f = l2_engines
    n1, n2 = vcluster.node_ids
    p = prompt(51)
    ray.get([e.record_blocks.remote(True), f.record_blocks.remote(True)])
    try:
        want = computed_then_restored(e, p)
        before = _flushed(vcluster, n2)
        assert before["l3_put"] >= 7, before
        sched0 = ray.get(f.scheduler_stats.remote())
        got = ray.get(f.generate.remote(p))
        sched1 = ray.get(f.scheduler_stats.remote())
        after = _l2_stats(vcluster, n2)
        saved = ray.get(e.recorded_blocks.remote())["saved"]
        loaded = ray.get(f.recorded_blocks.remote())["loaded"]
    finally:
        ray.get([e.record_blocks.remote(False), f.record_blocks.remote(False)])
    assert got["cached"] == 7 * BLOCK, got
    assert got["tokens"] == want
    assert sched1.l2_hit_blocks - sched0.l2_hit_blocks == 7
    assert after["gets"] == before["gets"], (before, after)  # no Mooncake get
    assert after["hits"] - before["hits"] == 7
    assert len(loaded) == 7 and {h: saved[h] for h in loaded} == loaded
    gets = _gets(vcluster)[n1]
    got_a = ray.get(a.generate.remote(p))
    assert got_a["cached"] == 7 * BLOCK, got_a
    assert _gets(vcluster)[n1] - gets == 7


def _restored_recorded(e, f, p: list[int]) -> tuple[dict, dict, dict, dict, dict]:
    """F serves ``p`` (E and F recording blocks): ``(F's answer, F's worker counters
    before and after, E's saved digests, F's loaded digests)``."""
    (w0,) = ray.get(f.worker_stats.remote())
    got = ray.get(f.generate.remote(p))
    (w1,) = ray.get(f.worker_stats.remote())
    saved = ray.get(e.recorded_blocks.remote())["saved"]
    return got, w0, w1, saved, ray.get(f.recorded_blocks.remote())["loaded"]


@pytest.mark.parametrize("waited", [True, False], ids=["waited", "control-unwaited"])
def test_l2_loads_copied_behind_the_forward_are_waited_for_layer_by_layer(l2_engines,
                                                                        vcluster, waited):
    """F, whose forward has asked for every layer before (it served a prompt), loads a
    prompt E computed from the node's L2: its last block copied on the step, the other 6
    layer by layer behind the forward (``loaded_behind``), each layer waited for before
    its attention: E's tokens restoring the prompt from its own prefix cache, and each
    loaded block byte for byte what E saved. Control: the forward does not wait and the
    copies start late: other tokens (the wait is what makes the copies behind right)."""
    e, f = l2_engines
    n2 = vcluster.node_ids[1]
    ray.get(f.generate.remote(prompt(181 + waited, 200), 2))  # F's forward asks: learnt
    p = prompt(183 + waited)
    _l2_room(vcluster, n2, 9)  # E's 8 blocks stay in L2 until F loads them
    ray.get([e.record_blocks.remote(True), f.record_blocks.remote(True)])
    if not waited:
        ray.get(f.unwaited_layer_loads.remote(True))
    try:
        want = computed_then_restored(e, p)
        _flushed(vcluster, n2)
        got, w0, w1, saved, loaded = _restored_recorded(e, f, p)
    finally:
        ray.get([e.record_blocks.remote(False), f.record_blocks.remote(False),
                 f.unwaited_layer_loads.remote(False)])
    assert got["cached"] == 7 * BLOCK, got
    assert w1.counters.l2_loaded - w0.counters.l2_loaded == 7, (w0, w1, _l2_stats(vcluster, n2))
    assert w1.counters.loaded_behind - w0.counters.loaded_behind == 6
    assert len(loaded) == 7 and {h: saved[h] for h in loaded} == loaded  # once copied
    if waited:
        assert got["tokens"] == want
    else:
        assert got["tokens"] != want


def test_l2_eviction_under_pressure_never_wrong_bytes(l2_engines, vcluster):
    """Four prompts (28 blocks) through an L2 of 12 pages, both engines saving and
    loading: pages are evicted, and every block F loads (from L2, or from L3 through L2
    once evicted) is byte for byte what E, or F itself, saved under its key (F saves the
    blocks it recomputed where a load found no page: another prefill split, so other
    bf16 bytes of the same tokens); F's tokens are E's when it loaded all 7 blocks.
    Control: with random bytes loaded (``corrupt_loads``), the recorded digests differ
    (the check sees wrong bytes)."""
    e, f = l2_engines
    n2 = vcluster.node_ids[1]
    prompts = [prompt(70 + i) for i in range(4)]
    ray.get([e.record_blocks.remote(True), f.record_blocks.remote(True)])
    try:
        wants = [computed_then_restored(e, q) for q in prompts]
        s0 = _flushed(vcluster, n2)
        outs = [ray.get(f.generate.remote(q)) for q in prompts]
        saved = ray.get(e.recorded_blocks.remote())["saved_all"]
        loaded = ray.get(f.recorded_blocks.remote())["loaded"]
        saved_f = ray.get(f.recorded_blocks.remote())["saved_all"]
        s1 = _flushed(vcluster, n2)
        ray.get(f.record_blocks.remote(True))
        ray.get(f.corrupt_loads.remote(True))
        try:
            ray.get(f.generate.remote(prompts[0]))
        finally:
            ray.get(f.corrupt_loads.remote(False))
        corrupt = ray.get(f.recorded_blocks.remote())["loaded"]
    finally:
        ray.get([e.record_blocks.remote(False), f.record_blocks.remote(False)])
    print("L2 before", s0, "after", s1)
    assert s1["evicted"] > 0 and s1["pages"] == L2_BLOCKS, s1
    assert s1["filled"] - s0["filled"] > 0, (s0, s1)  # evicted blocks came from L3
    # every block F loaded holds the bytes of a save of its hash, by E or by F (a save
    # dropped for want of an L2 page is followed by another of the recomputed block)
    assert loaded and all(d in saved.get(h, []) + saved_f.get(h, []) for h, d in loaded.items())
    for got, want in zip(outs, wants, strict=True):
        if got["cached"] == 7 * BLOCK:
            assert got["tokens"] == want
    assert sum(o["cached"] == 7 * BLOCK for o in outs) >= 1, outs
    assert corrupt and not any(d in saved.get(h, []) + saved_f.get(h, [])
                               for h, d in corrupt.items())


def test_eviction_bench_check_passes_real_loads_and_catches_corrupted_ones(l2_engines,
                                                                          vcluster):
    """The eviction benchmark's byte check (``raykv_lab.bench.l2_eviction``: block
    digests recorded in the engines, ``check_loads``) on real loads: E computes three
    prompts (21 blocks through an L2 of 12 pages), then F serves them, reading the
    evicted ones back from L3 through L2: every block F loaded is one E or F saved
    under its key. Control (the benchmark's own, ``corrupt_control``): F loads random
    values for one prompt, and the check finds every one of those loads wrong."""
    from raykv_lab.bench.l2_eviction import (
        corrupt_control,
        digest_check,
        node_l2,
        worker_counts,
    )

    e, f = l2_engines
    n2 = vcluster.node_ids[1]
    ps = [prompt(110 + i) for i in range(3)]
    _l2_room(vcluster, n2, 8)
    ray.get([x.record.remote(True) for x in (e, f)])
    try:
        for p in ps:
            ray.get(e.generate.remote(p))
        _flushed(vcluster, n2)
        s0, (w0,) = node_l2(vcluster.node_actors[n2]), worker_counts([f])
        for p in ps:
            ray.get(f.generate.remote(p))
        s1, (w1,) = node_l2(vcluster.node_actors[n2]), worker_counts([f])
        check = digest_check([e, f])
        control = corrupt_control([e, f], f, ps[2:])
    finally:
        ray.get([x.record.remote(False) for x in (e, f)])
    assert check["checked"] == w1.loaded - w0.loaded > 0, (check, w0, w1)
    assert check["wrong"] == check["never_saved"] == 0, check
    assert s1["filled"] > s0["filled"] and s1["evicted"] > s0["evicted"], (s0, s1)
    assert control["checked"] > 0 and control["wrong"] == control["checked"], control


def _l2_room(vcluster, node: str, n: int) -> None:
    """Wait (12 s at most) until the node's L2 has ``n`` pages a fill or a save may take:
    neither held, nor leased by an earlier test's lookups (10 s), nor dirty."""
    deadline = time.monotonic() + 12
    while True:
        s = _l2_stats(vcluster, node)
        if s["pages"] - s["held"] - s["leased"] - s["dirty"] >= n:
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.2)


@contextlib.contextmanager
def _async_on(*engines):
    """``async_transfers`` on in ``engines`` (L2 engines) for the block's duration."""
    ray.get([x.async_transfers.remote(True) for x in engines])
    try:
        yield
    finally:
        ray.get([x.async_transfers.remote(False) for x in engines])


def test_async_transfers_load_l3_off_the_step_and_save_every_block(engines, l2_engines,
                                                                   vcluster):
    """``async_transfers`` on in E and F. Loads: A (node 1, no L2) computes a prompt, so
    its 7 blocks are in L3 and not in node 2's L2; F's lookup finds them in L3 and vLLM
    loads them asynchronously (the request parked, the worker's load thread reading
    L3 into L2 into vLLM's blocks): F gives A's tokens restoring the prompt from its own
    prefix cache. Saves: E decodes past the prompt (8 full blocks), each copied into L2
    pages on the step and put to L3 by the node behind: once flushed, A (whose prefix
    cache never saw them) reads all 8 from L3 and gives E's tokens restoring them from
    its own prefix cache. Control: the counters show the load was async (F's worker
    loaded 7 blocks off the step) and the saves went through L2 with none dropped."""
    a, b, base = engines
    e, f = l2_engines
    n2 = vcluster.node_ids[1]
    p = prompt(60)
    want = computed_then_restored(a, p)
    _l2_room(vcluster, n2, 8)  # an async load reads through L2 pages: room for all 7
    with _async_on(e, f):
        s0 = ray.get(f.scheduler_stats.remote())
        (w0,) = ray.get(f.worker_stats.remote())
        got = ray.get(f.generate.remote(p))
        s1 = ray.get(f.scheduler_stats.remote())
        (w1,) = ray.get(f.worker_stats.remote())
        q = prompt(61)
        (e0,) = ray.get(e.worker_stats.remote())
        out = ray.get(e.generate.remote(q, max_tokens=60))  # 1059 tokens computed: 8 blocks
        (e1,) = ray.get(e.worker_stats.remote())
    assert got["cached"] == 7 * BLOCK, got
    assert got["tokens"] == want
    assert s1.async_lookups - s0.async_lookups == 1, (s0, s1)
    assert w1.counters.async_loaded - w0.counters.async_loaded == 7, (w0, w1)
    assert e1.counters.l2_saved - e0.counters.l2_saved == 8
    assert e1.counters.save_dropped == e0.counters.save_dropped
    _flushed(vcluster, n2)
    q_ext = q + out["tokens"][:8 * BLOCK + 1 - len(q)]
    restored = ray.get(e.generate.remote(q_ext))
    assert restored["cached"] == 8 * BLOCK, restored
    from_l3 = ray.get(a.generate.remote(q_ext))
    assert from_l3["cached"] == 8 * BLOCK, from_l3
    assert from_l3["tokens"] == restored["tokens"]


@pytest.mark.parametrize("report", [True, False], ids=["reported", "control-passed-off"])
def test_async_load_failure_is_recomputed(engines, l2_engines, vcluster, report):
    """F's async load of a prompt's 7 blocks (from L3: A computed them) fails at block 3:
    vLLM hears of it (``get_block_ids_with_load_errors`` with the request's
    ``finished_recving``) and recomputes blocks 3-6 (F saves those 4 again), giving the
    tokens of the baseline computing the same blocks over the same 3 cached ones
    (vLLM's ``num_cached_tokens`` keeps the lookup's 7 blocks for an async load: its
    prefill stats are taken before the load ends). Control (``report`` False: a hook
    passes the failed load off as done): vLLM uses the block of random values, computes
    nothing of the prompt but its last token, and the tokens differ from A's restoring
    all 7."""
    a, b, base = engines
    e, f = l2_engines
    p = prompt(62 if report else 63)
    ray.get(a.generate.remote(p))  # its 7 blocks in L3
    if report:
        ray.get(base.generate.remote(p[:3 * BLOCK + 10]))
        want = ray.get(base.generate.remote(p))
        assert want["cached"] == 3 * BLOCK, want
    else:
        want = {"tokens": computed_then_restored(a, p)}
    _l2_room(vcluster, vcluster.node_ids[1], 7)
    with _async_on(f):
        (w0,) = ray.get(f.worker_stats.remote())
        ray.get(f.fail_next_async_load.remote(3, report))
        got = ray.get(f.generate.remote(p))
        (w1,) = ray.get(f.worker_stats.remote())
    assert w1.counters.async_loaded - w0.counters.async_loaded == (3 if report else 7), (w0, w1)
    if report:
        assert w1.counters.load_failed - w0.counters.load_failed == 4, (w0, w1)
        assert w1.counters.saved - w0.counters.saved == 4, (w0, w1)  # recomputed, then saved
        assert got["tokens"] == want["tokens"]
    else:
        assert w1.counters.saved == w0.counters.saved, (w0, w1)
        assert got["tokens"] != want["tokens"]


def test_l2_node_actor_killed_engines_serve_l2_comes_back_empty(engines, l2_engines,
                                                              vcluster):
    """Node 2's actor killed after E saved a prompt into its L2: once it is back its L2
    pools hold nothing; F serves the prompt (loading what L3 still has, or recomputing)
    with E's tokens when it loaded every block and a cold run's when it loaded none,
    every loaded block byte for byte E's; then E and F reopen the L2 and F loads a new
    prompt of E's from L2 again with no Mooncake get."""
    a, b, base = engines
    e, f = l2_engines
    n2 = vcluster.node_ids[1]
    p = prompt(80)
    cold = ray.get(base.generate.remote(p))["tokens"]
    ray.get([e.record_blocks.remote(True), f.record_blocks.remote(True)])
    try:
        restored = computed_then_restored(e, p)
        _flushed(vcluster, n2)
        actor = vcluster.node_actors[n2]
        pid = ray.get(actor.health.remote())["pid"]
        ray.kill(actor, no_restart=False)
        deadline = time.monotonic() + 60
        while True:  # until the restarted actor answers
            with contextlib.suppress(Exception):
                if ray.get(actor.health.remote(), timeout=5)["pid"] != pid:
                    break
            assert time.monotonic() < deadline, "node actor did not restart"
            time.sleep(0.5)
        emptied = _l2_stats(vcluster, n2)
        got, w0, w1, saved, loaded = _restored_recorded(e, f, p)
    finally:
        ray.get([e.record_blocks.remote(False), f.record_blocks.remote(False)])
    assert emptied.get("ready", 0) == 0 and emptied.get("hits", 0) == 0, emptied
    _check_b(got, w1.counters.loaded - w0.counters.loaded, cold, restored, "after the kill")
    assert all(saved[h] == d for h, d in loaded.items())
    deadline = time.monotonic() + 90
    for attempt in itertools.count():  # until the L2 is reopened and puts land again
        q = prompt(90 + attempt)
        want = computed_then_restored(e, q)
        s0 = _flushed(vcluster, n2)
        got = ray.get(f.generate.remote(q))
        s1 = _l2_stats(vcluster, n2)
        if got["cached"] == 7 * BLOCK and s1["hits"] - s0["hits"] == 7:
            assert s1["gets"] == s0["gets"] and got["tokens"] == want
            break
        assert time.monotonic() < deadline, (got, s1)
        time.sleep(1)


def _check_b(got: dict, loaded: int, cold: list[int], restored: list[int], what: str) -> None:
    """B's tokens after it loaded ``loaded`` of a prompt's 7 blocks: a cold run's when it
    loaded none, those of A restoring the 7 from its own prefix cache when it loaded all.
    A partial load is another split of the prompt's computation, which neither covers
    (bf16 numerics on vLLM's CPU kernels depend on the split, see test_partial_hit)."""
    if loaded == 0:
        assert got["tokens"] == cold, f"{what}: B loaded nothing"
    elif loaded == 7:
        assert got["tokens"] == restored, f"{what}: B loaded every block"


def test_node_actor_restart_recomputes_then_hits_again(engines, vcluster):
    a, b, base = engines
    n2 = vcluster.node_ids[1]
    p = prompt(4)
    cold = ray.get(base.generate.remote(p))["tokens"]
    restored = computed_then_restored(a, p)
    (before,) = ray.get(b.worker_stats.remote())
    ray.kill(vcluster.node_actors[n2], no_restart=False)
    got = ray.get(b.generate.remote(p))  # the actor is down or just back: never wrong
    (after,) = ray.get(b.worker_stats.remote())
    _check_b(got, after.counters.loaded - before.counters.loaded, cold, restored, "after the kill")
    print("B's worker connector before", before, "after", after)
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(vcluster.node_actors[n2].health.remote(), timeout=5)
            break
        except Exception:
            assert time.monotonic() < deadline, "node actor did not restart"
            time.sleep(0.5)
    # Puts that Mooncake placed on the dead actor's segment fail until the master expires
    # it (~10 s). Each attempt is a fresh prompt that A serves first, then B: until B
    # loads every block again. A fresh prompt each time, because B saves the blocks it
    # had to recompute, and those come from a prefill split elsewhere than A's one
    # prefill: loading them later would mix splits.
    deadline = time.monotonic() + 90
    for attempt in itertools.count():
        q = prompt(100 + attempt)
        cold = ray.get(base.generate.remote(q))["tokens"]
        restored = computed_then_restored(a, q)
        (s0,) = ray.get(b.worker_stats.remote())
        got = ray.get(b.generate.remote(q))
        (s1,) = ray.get(b.worker_stats.remote())
        loaded = s1.counters.loaded - s0.counters.loaded
        _check_b(got, loaded, cold, restored, f"attempt {attempt}")
        if got["cached"] == 7 * BLOCK and loaded == 7:
            break
        assert time.monotonic() < deadline, f"B never loaded all 7 blocks again: {got}, {s1}"
        time.sleep(2)


def test_tp2_each_rank_loads_its_own_blocks(vcluster, model, uid_module):
    """A TP=2 engine (its worker processes join Ray themselves) serves a prompt, saving
    each rank's blocks; asked again (vLLM's prefix cache is off) it loads 7 blocks on
    each rank from one group answer and produces the same tokens (TP=2 numerics differ
    from TP=1's, so the first, fully computed run is the reference). One engine: two
    TP=2 engines on this 2-core machine took 14 minutes."""
    conf = {"model_name": f"tiny-{uid_module}", "load_guard": "off"}
    e = start_engine(vcluster.node_ids[1], model, conf, tensor_parallel_size=2,
                     env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    try:
        ready(e)
        p = prompt(21)
        want = ray.get(e.generate.remote(p))
        assert want["cached"] == 0
        got = ray.get(e.generate.remote(p))
        assert got["cached"] == 7 * BLOCK, got
        assert got["tokens"] == want["tokens"]
        stats = ray.get(e.worker_stats.remote())
        assert sorted(s.tp_rank for s in stats) == [0, 1]
        assert [s.counters.loaded for s in stats] == [7, 7], stats
        assert [s.counters.saved for s in stats] == [7, 7], stats
        assert [s.counters.load_failed for s in stats] == [0, 0], stats
    finally:
        with contextlib.suppress(Exception):
            ray.get(e.close.remote(), timeout=60)
        ray.kill(e)
