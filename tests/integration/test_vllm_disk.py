"""A fresh vLLM engine after a whole-cluster restart loads a prompt's blocks from the
disk tier (real vLLM, CPU build, raykv's connector; real Ray, real ``mooncake_master``;
one embedded node with a 24 MiB segment and a disk tier under ``disk_dir``).

An engine computes a prompt (its connector saves the 7 full blocks), restores it from
vLLM's own prefix cache (the reference tokens: ``test_vllm.computed_then_restored``),
then computes other prompts until the node's disk slot holds several offload buckets:
the prompt's blocks, the oldest (Mooncake evicts by lease expiry), were evicted from
memory to disk. The whole cluster is
shut down (engine, node actor, master, Ray) and started again on the same ``disk_dir``;
a fresh engine (vLLM's prefix cache off) serves the prompt with all 7 blocks loaded
from raykv, every object from the disk tier (memory is empty after the restart), and
the reference tokens. Control: a plain cluster (no disk tier) started in between, with
a fresh engine of the same deployment, finds none of the prompt's blocks.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import ray
from raykv import local_settings, start_local
from raykv.controllers.node_records import TierStats
from raykv.controllers.pool_layout import MiB
from raykv_lab.engines.vllm_actors import ready, start_engine
from raykv_lab.engines.vllm_model import make_llama

from tests.integration.test_vllm import BLOCK, computed_then_restored, prompt

pytestmark = pytest.mark.engine("vllm")

SEGMENT = 24 * MiB
MASTER_ARGS = ["-default_kv_lease_ttl=2500"]  # puts wait out one lease
FILLER_TOKENS = 1900  # 14 full blocks, 3.5 MiB of KV per filler prompt
ON_DISK = 16 * MiB  # two offload buckets: the oldest objects went to disk
FILL_S = 240.0


@contextlib.contextmanager
def engine_on(cluster, model: str, conf: dict, **kw):
    """An engine with raykv's connector on ``cluster``'s node, shut down and killed at
    the end."""
    (node,) = cluster.node_ids
    e = start_engine(node, model, conf, **kw)
    ready(e)
    try:
        yield e
    finally:
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(e.close.remote())
        ray.kill(e)


def tiers(cluster) -> TierStats:
    (actor,) = cluster.node_actors.values()
    return ray.get(actor.stats.remote()).tiers


def test_a_fresh_engine_after_a_cluster_restart_loads_from_disk(tmp_path, uid):
    model = make_llama(str(tmp_path / "tiny-llama"))
    disk_dir = str(tmp_path / "disk")
    conf = {"model_name": f"tiny-disk-{uid}", "load_guard": "off"}
    p = prompt(1)
    with (start_local(1, local_settings(global_segment_size=SEGMENT, disk_dir=disk_dir,
                                          disk_bytes=1 << 30), master_args=MASTER_ARGS)
          as cluster, engine_on(cluster, model, conf, enable_prefix_caching=True) as a):
        want = computed_then_restored(a, p)
        deadline = time.monotonic() + FILL_S
        seed = 1000
        while (used := tiers(cluster).used_bytes) < ON_DISK:
            assert time.monotonic() < deadline, f"{used} bytes on disk"
            seed += 1
            ray.get(a.generate.remote(prompt(seed, FILLER_TOKENS), 1))
        print(f"{seed - 1000} filler prompts, {used / MiB:.0f} MiB on disk")

    with (start_local(1, local_settings(global_segment_size=SEGMENT)) as cluster,
          engine_on(cluster, model, conf) as c):
        got = ray.get(c.generate.remote(p))
        assert got["cached"] == 0, got  # CONTROL: a restart without a disk tier loses all

    with (start_local(1, local_settings(global_segment_size=SEGMENT, disk_dir=disk_dir,
                                          disk_bytes=1 << 30), master_args=MASTER_ARGS)
          as cluster, engine_on(cluster, model, conf) as b):
        got = ray.get(b.generate.remote(p))
        served = tiers(cluster).served
        assert got["cached"] == 7 * BLOCK, (got, served)
        assert got["tokens"] == want
        assert served.get("l3_disk", 0) >= 7 and "l3_memory" not in served, served
