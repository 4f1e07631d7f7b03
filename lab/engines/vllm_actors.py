"""vLLM engines inside Ray actors pinned to nodes, with or without raykv's connector:
the engines of ``raykv demo --engine vllm`` and of the vLLM tests.

An engine is one vLLM ``LLM`` in the actor's process. ``ENV`` (set through the actor's
runtime env, so it holds before torch is imported there) runs it in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler and, at TP=1, worker in the actor),
with one OMP thread; ``env`` overrides it, e.g. ``{"VLLM_ENABLE_V1_MULTIPROCESSING":
"1"}`` for vLLM's default multiprocess engine, whose engine core and worker processes
join Ray themselves (see ``raykv.integrations.ray_join.join_ray``). One OMP thread in every
mode: vLLM's default CPU binding (``VLLM_CPU_OMP_THREADS_BIND=auto``) would give a
multiprocess engine's worker every core it finds instead, and greedy tokens of vLLM's CPU
kernels depend on the thread count (2 threads instead of 1 changed 5 of 6 prompts'
tokens here), so engines in different modes would not be comparable.

On a node with GPUs an engine actor asks Ray for one GPU per rank it runs
(``engine_gpus``); on a CPU node for none (vLLM's CPU build), as the tests run it.

Imports vLLM only inside the actor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv.integrations.vllm.connector_stats import ConnectorStats

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # keep OMP_NUM_THREADS in worker processes
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
}

# vLLM's LLM(...) arguments unless the caller gives them: eager (identical greedy
# output across processes and runs), vLLM's prefix cache off (so every cached token of
# a connector engine came from raykv), a 64 MiB KV cache (else vLLM wants 92% of RAM).
LLM_DEFAULTS = dict(dtype="bfloat16", max_model_len=2048, seed=0, enforce_eager=True,
                    enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20,
                    max_num_seqs=4, disable_log_stats=False)


@dataclass(frozen=True)
class WorkerStats:
    """One TP rank's worker connector as ``VLLMEngine.worker_stats`` reports it."""

    counters: ConnectorStats
    """Its counters (``RayKVConnector.stats``)."""
    tp_rank: int
    pid: int
    """The worker's process id."""


def _worker_stats(worker) -> WorkerStats:
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    c = get_kv_transfer_group()
    return WorkerStats(c.stats, c.tp_rank, os.getpid())


class VLLMEngine:
    """One vLLM ``LLM`` (the body of a Ray actor: ``start_engine``).

    ``connector``: raykv's ``kv_connector_extra_config`` (None: no connector);
    ``failure_policy``: vLLM's ``kv_load_failure_policy``; ``kv_role``: vLLM's
    ``kv_role`` of the connector (``kv_both``: loads and saves; ``kv_consumer``: only
    loads); ``llm_kwargs``: any other ``LLM(...)`` argument, over ``LLM_DEFAULTS``.
    """

    def __init__(self, model: str, connector: dict | None, *,
                 failure_policy: str = "recompute", kv_role: str = "kv_both",
                 **llm_kwargs) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kw = LLM_DEFAULTS | llm_kwargs
        if isinstance(kw.get("kv_events_config"), dict):  # e.g. from a Ray call
            from vllm.config import KVEventsConfig

            kw["kv_events_config"] = KVEventsConfig(**kw["kv_events_config"])
        if connector is not None:
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="RayKVConnector", kv_connector_module_path="raykv.integrations.vllm",
                kv_role=kv_role, kv_load_failure_policy=failure_policy,
                kv_connector_extra_config=connector)
        self.llm = LLM(model=model, **kw)

    def generate(self, prompt: list[int], max_tokens: int = 24,
                 cache_salt: str | None = None) -> dict:
        """Greedy ``max_tokens`` tokens after ``prompt`` (token ids; ``cache_salt``:
        vLLM's per-request cache salt, None for none): ``tokens``, ``cached`` (vLLM's
        ``num_cached_tokens``: its own prefix cache plus tokens a connector loaded) and
        ``ttft_s`` (vLLM's ``first_token_latency``: from the request's arrival to its
        first token; None with ``disable_log_stats``)."""
        from vllm import SamplingParams

        inputs: dict = {"prompt_token_ids": prompt}
        if cache_salt is not None:
            inputs["cache_salt"] = cache_salt
        out = self.llm.generate(inputs,
                                SamplingParams(temperature=0, max_tokens=max_tokens,
                                               ignore_eos=True), use_tqdm=False)[0]
        return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                "ttft_s": out.metrics.first_token_latency if out.metrics else None}

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's own prefix cache (as if vLLM had evicted every cached block): the
        next request finds nothing in it. False if vLLM refused (requests running)."""
        return self.llm.reset_prefix_cache()

    def worker_stats(self) -> list[WorkerStats]:
        """Each TP rank's worker connector counters, its TP rank and pid. Needs the
        callable to reach the workers: in-process engines, or
        ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` with the multiprocess engine."""
        return self.llm.collective_rpc(_worker_stats)

    def close(self) -> None:
        """Shut the engine down (its engine core and worker processes and their shared
        memory), so that killing the actor leaves nothing behind."""
        self.llm.llm_engine.engine_core.shutdown()

    def pid(self) -> int:
        return os.getpid()


Engine = ray.remote(num_cpus=0)(VLLMEngine)


def engine_gpus(node_gpus: float, llm_kwargs: dict) -> int:
    """GPUs an engine actor asks Ray for on a node with ``node_gpus`` GPUs: none on a
    CPU node (vLLM's CPU build), else one per rank (TP x PP) that vLLM runs in the
    actor's process tree (its default uniprocess / multiprocess executors), none with
    ``distributed_executor_backend="ray"`` (the ranks are Ray actors asking for their
    own GPUs)."""
    if node_gpus <= 0 or llm_kwargs.get("distributed_executor_backend") == "ray":
        return 0
    return (int(llm_kwargs.get("tensor_parallel_size", 1))
            * int(llm_kwargs.get("pipeline_parallel_size", 1)))


def node_gpus(node_id: str) -> float:
    """The GPUs Ray counts on the live node ``node_id`` (0 on a CPU node)."""
    for node in ray.nodes():
        if node["NodeID"] == node_id and node["Alive"]:
            return node["Resources"].get("GPU", 0)
    raise ValueError(f"no live Ray node {node_id}")


def start_engine(node_id: str, model: str, connector: dict | None, *,
                 env: dict | None = None, actor_class=Engine, **kw):
    """An engine actor (``actor_class``: ``Engine`` or another ``ray.remote`` subclass of
    ``VLLMEngine``) hard-pinned to ``node_id``, ``ENV | env`` in its environment, with
    the GPUs its ranks need when the node has GPUs (``engine_gpus``); it is starting
    when this returns (``ready`` waits for it)."""
    return actor_class.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        num_gpus=engine_gpus(node_gpus(node_id), kw),
        runtime_env={"env_vars": ENV | (env or {})}).remote(model, connector, **kw)


def ready(*engines) -> None:
    """Wait until every engine has started (they start in parallel)."""
    ray.get([e.pid.remote() for e in engines])
