"""The load guard against a shaped link, with real vLLM engines (CPU build, in-process in
Ray actors) on emulated hosts (``start_hosts(2)``: two network namespaces, a real
Ray node in each, a real ``mooncake_master``; links shaped with ``tc``).

Engine W on host 1 computes prompts; its connector saves their blocks into host 1's
segment (host 0 gives the store no memory). Engine R on host 0 (``kv_consumer``, vLLM's
prefix cache off, ``load_guard: "auto"``) asks for them: every block it is served comes
across host 1's link through host 0's node actor. R first computes each prompt it will
recompute under a cache salt nobody saved (its cold tokens, and the prefill estimate
its guard weighs).

- Unshaped (10 Gbit/s), once host 0's node has probed host 1's segment and R has loaded
  ``WARM_LOADS`` hits across it with the guard ``off``: R loads the next hit under
  ``auto`` (the guard's reason: the load is faster than prefill). CONTROL: a fixed threshold
  above the hit recomputes it (the same tokens as cold), so a load is a choice.
- Host 1's link shaped to 10 Mbit/s. CONTROL: with the guard ``off`` R loads two hits
  across it (the node's estimate of that link follows its gets). Then ``auto`` again:
  R recomputes the next hit, its tokens equal to its cold run, and the connector counts
  the skip with its reason.

Assertions are on the connector's counters, vLLM's cached tokens and the tokens; the
times are printed (``raykv bench-guard-links`` measures TTFT against cold and "always
load" per link rate: ``docs/benchmarks.md``). Root only (namespaces, links): skipped
otherwise.
"""

from __future__ import annotations

import os

import pytest
import ray
from raykv.controllers.pool_layout import MiB
from raykv_lab.bench.guard_summary import BLOCK, prompt_ids
from raykv_lab.engines.vllm_actors import Engine, ready, start_engine
from raykv_lab.engines.vllm_model import LlamaDims, make_llama
from raykv_lab.hosts import start_hosts

from tests.integration.test_host_links import link_of, wait_for
from tests.integration.test_vllm_load_guard import grown
from tests.integration.vllm_control import ControlEngine

pytestmark = [pytest.mark.engine("vllm"),
              pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root")]

MODEL = LlamaDims.of(512, 8)  # 1 MiB of KV a block: a 10 Mbit/s load takes seconds
TOKENS = 5 * BLOCK + 1  # a hit of 5 blocks (vLLM computes the last token itself)
HIT = 5 * BLOCK
WARM_LOADS = 8
"""Loads across the unshaped link before its hit is weighed: they move the node's
estimate of it (0.2 each) from its probe, whose 256 KiB read a busy 2-core machine can
slow to 10 MB/s, to what 5 MiB gets take."""
ENGINE = dict(block_size=BLOCK, max_model_len=TOKENS + 64)


def test_a_hit_across_a_10_mbit_link_is_recomputed_and_an_unshaped_one_loaded(tmp_path, uid):
    model = make_llama(str(tmp_path / "llama"), MODEL)
    conf = {"model_name": f"guard-links-{uid}", "timeout_s": 60.0}
    with start_hosts(2, link="10gbit", segment_sizes=[0, 128 * MiB], log_to_driver=False) as c:
        host0, host1 = sorted(c.node_ids, key=c.ray_nodes.host_of)
        w = start_engine(host1, model, conf, actor_class=Engine, **ENGINE)
        r = start_engine(host0, model, conf | {"explain": True}, kv_role="kv_consumer",
                         actor_class=ControlEngine, **ENGINE)
        try:
            ready(w, r)
            warm = [f"warm{i}" for i in range(WARM_LOADS)]
            p = {k: prompt_ids(f"{uid}-{k}", TOKENS)
                 for k in (*warm, "fast", "threshold", "off1", "off2", "slow")}
            for k in p:
                ray.get(w.generate.remote(p[k], 1))
            cold = {k: ray.get(r.generate.remote(p[k], 1, cache_salt="cold"))
                    for k in ("threshold", "slow")}
            segment = ray.get(c.node_actors[host1].health.remote())["segment"]
            wait_for(lambda: (v := link_of(c, host0, segment)) is not None
                     and v.probe_age_s is not None)

            def served(k: str) -> tuple[dict, dict]:
                before = ray.get(r.scheduler_stats.remote())
                got = ray.get(r.generate.remote(p[k], 1))
                print(k, "ttft_s", got["ttft_s"], "cached", got["cached"],
                      "link", link_of(c, host0, segment), flush=True)
                return got, grown(before, ray.get(r.scheduler_stats.remote()))

            ray.get(r.set_load_guard.remote("off"))  # the link's estimate from real gets
            for k in warm:
                assert served(k)[0]["cached"] == HIT
            ray.get(r.set_load_guard.remote("auto"))
            got, counted = served("fast")  # unshaped: loaded
            assert got["cached"] == HIT, got
            assert counted == {"guard_load_faster_than_prefill": 1, "l3_hit_tokens": HIT}
            ray.get(r.set_load_guard.remote(HIT + BLOCK))  # CONTROL: a threshold above
            got, counted = served("threshold")
            assert got["cached"] == 0 and got["tokens"] == cold["threshold"]["tokens"]
            assert counted == {"guard_recompute_below_threshold": 1,
                               "guard_skipped_l3_tokens": HIT}
            print("cold ttft_s", {k: v["ttft_s"] for k, v in cold.items()}, flush=True)

            c.ray_nodes.set_rate(1, "10mbit")
            ray.get(r.set_load_guard.remote("off"))  # CONTROL: off loads across it
            for k in ("off1", "off2"):
                got, counted = served(k)
                assert got["cached"] == HIT, got
                assert counted == {"guard_load_off": 1, "l3_hit_tokens": HIT}
            ray.get(r.set_load_guard.remote("auto"))
            print("estimates", ray.get(r.load_guard_estimates.remote()), flush=True)
            got, counted = served("slow")
            assert got["cached"] == 0 and got["tokens"] == cold["slow"]["tokens"]
            assert counted == {"guard_recompute_slower_than_prefill": 1,
                               "guard_skipped_l3_tokens": HIT}
        finally:
            c.ray_nodes.set_rate(1, "10gbit")
            for e in (w, r):
                ray.kill(e)
