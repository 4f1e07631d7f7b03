"""The load guard under a real vLLM engine (CPU build, in-process in a Ray actor) with
raykv's connector on a real one-node raykv cluster (real ``mooncake_master``).

Engine A computes prompts; its connector saves their blocks to the store. Engine B
(vLLM's prefix cache off, ``l2_blocks``: its loads go through the node's L2, where
they stay) measures its prefill per token on a prompt no one saved; then every store
get of the node actor waits ``DELAY_S`` (``set_store_delay``: injected into the node
actor's process from the test side). B's first hit in L3 is priced by the node's probe
of its link and loaded (the load measures the delay, ``DELAY_S`` and more; if a delayed
store call already counted in the node's estimate, it is recomputed); its next hit in
L3 is recomputed (the L3 estimate, about ``DELAY_S``, exceeds the prefill estimate of a
thousand tokens of this tiny model by far: the two differ by an order of magnitude even
on a loaded machine), and its tokens equal B's cold run of the prompt (the same prompt under
another cache salt: a run raykv cannot serve). The first prompt again is an L2 hit
and is loaded under ``auto``. CONTROL: with the guard ``off``, an L3 hit of another
prompt A saved is loaded (the counters show its L3 tokens loaded). With
``async_transfers`` (lookups on their own thread, L3 loads parked), ``auto`` again: a
third prompt's L3 hit is recomputed, and no request is parked for a load. Assertions are on
the connector's counters and vLLM's cached tokens, not on times.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import ray
from raykv import local_settings, start_local
from raykv.integrations.vllm.connector_stats import ConnectorStats
from raykv_lab.engines.vllm_actors import Engine, ready, start_engine
from raykv_lab.engines.vllm_model import make_llama

from tests.integration.conftest import set_store_delay
from tests.integration.test_vllm import BLOCK, prompt
from tests.integration.vllm_control import ControlEngine

pytestmark = pytest.mark.engine("vllm")

DELAY_S = 5.0
FULL = 7 * BLOCK  # a 1000-token prompt's tokens raykv may serve (the last one computed)


def grown(before: ConnectorStats, after: ConnectorStats) -> dict[str, int]:
    """The guard's and the hit counters that grew between two looks, by name."""
    then, now = asdict(before), asdict(after)
    return {k: now[k] - then[k] for k in now
            if now[k] != then[k] and (k.startswith("guard_") or k.endswith("hit_tokens"))}


def test_the_guard_recomputes_a_slow_l3_hit_loads_l2_and_off_loads(tmp_path, uid):
    model = make_llama(str(tmp_path / "tiny-llama"))
    conf = {"model_name": f"tiny-guard-{uid}", "timeout_s": 60.0}
    with start_local(settings=local_settings(global_segment_size=128 << 20),
                     num_nodes=1) as cluster:
        (node,) = cluster.node_ids
        a = start_engine(node, model, conf, actor_class=Engine)
        b = start_engine(node, model, conf | {"l2_blocks": 64, "explain": True},
                         actor_class=ControlEngine)
        try:
            ready(a, b)
            for seed in (1, 2, 4, 5):
                ray.get(a.generate.remote(prompt(seed)))
            cold = ray.get(b.generate.remote(prompt(2), cache_salt="cold"))["tokens"]
            s0 = ray.get(b.scheduler_stats.remote())
            assert grown(ConnectorStats(), s0) == {}  # no hit yet; prefill measured
            set_store_delay(cluster, DELAY_S)
            try:
                # L3: priced by the node's probe of its link (fast) or, where a delayed
                # store call already counts in its estimate, slow; either way measured
                got = ray.get(b.generate.remote(prompt(1)))
                s1 = ray.get(b.scheduler_stats.remote())
                if got["cached"]:
                    assert got["cached"] == FULL, got
                    assert grown(s0, s1) in (
                        {"guard_load_faster_than_prefill": 1, "l3_hit_tokens": FULL},
                        {"guard_load_no_estimate": 1, "l3_hit_tokens": FULL})
                else:
                    assert grown(s0, s1) == {"guard_recompute_slower_than_prefill": 1,
                                             "guard_skipped_l3_tokens": FULL}
                est = ray.get(b.load_guard_estimates.remote())
                print("the scheduler's estimates before the recompute:", est)
                got = ray.get(b.generate.remote(prompt(2)))  # L3, slow: recomputed
                s2 = ray.get(b.scheduler_stats.remote())
                assert got["cached"] == 0, got
                assert got["tokens"] == cold
                assert grown(s1, s2) == {"guard_recompute_slower_than_prefill": 1,
                                         "guard_skipped_l3_tokens": FULL}
                got = ray.get(b.generate.remote(prompt(1)))  # now in L2: loaded
                s3 = ray.get(b.scheduler_stats.remote())
                assert got["cached"] == FULL, got
                assert grown(s2, s3) == {"guard_load_faster_than_prefill": 1,
                                         "l2_hit_tokens": FULL}
                ray.get(b.set_load_guard.remote("off"))  # CONTROL: off loads L3
                got = ray.get(b.generate.remote(prompt(4)))
                s4 = ray.get(b.scheduler_stats.remote())
                assert got["cached"] == FULL, got
                assert grown(s3, s4) == {"guard_load_off": 1, "l3_hit_tokens": FULL}
                # async_transfers: the lookup thread's answer goes through the guard too
                ray.get([b.set_load_guard.remote("auto"), b.async_transfers.remote(True)])
                got = ray.get(b.generate.remote(prompt(5)))
                s5 = ray.get(b.scheduler_stats.remote())
                assert got["cached"] == 0, got
                assert grown(s4, s5) == {"guard_recompute_slower_than_prefill": 1,
                                         "guard_skipped_l3_tokens": FULL}
                assert s5.async_lookups == s4.async_lookups  # nothing parked
            finally:
                set_store_delay(cluster, 0)
        finally:
            for e in (a, b):
                ray.get(e.close.remote())
                ray.kill(e)
