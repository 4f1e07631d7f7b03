"""vLLM engines inside Ray actors for the vLLM connector tests.

Each engine runs vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler
and, at TP=1, the worker live in the actor's process), eager mode, one OMP thread, a
64 MiB KV cache. Env vars go in through the actor's runtime env so they hold before
torch is imported there.
"""

from __future__ import annotations

import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def _worker_stats(worker) -> dict:
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    c = get_kv_transfer_group()
    return dict(c.stats, tp_rank=c.tp_rank, pid=os.getpid())


def _corrupt_loads(worker, on: bool) -> None:
    from dataclasses import replace

    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    c = get_kv_transfer_group()
    c.opts = replace(c.opts, debug_corrupt_loads=on)


@ray.remote(num_cpus=0)
class Engine:
    """One vLLM ``LLM``; ``connector`` is the raykv ``kv_connector_extra_config`` (None:
    no connector, the baseline)."""

    def __init__(self, model: str, connector: dict | None, *, tp: int = 1,
                 prefix_caching: bool = False, failure_policy: str = "recompute") -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        if tp > 1:  # the TP workers are processes of their own that join Ray themselves
            os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        kw = dict(model=model, dtype="bfloat16", max_model_len=2048, seed=0,
                  enforce_eager=True, enable_prefix_caching=prefix_caching,
                  kv_cache_memory_bytes=64 << 20, tensor_parallel_size=tp, max_num_seqs=4)
        if connector is not None:
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="RayKVConnector", kv_connector_module_path="raykv.integrations.vllm",
                kv_role="kv_both", kv_load_failure_policy=failure_policy,
                kv_connector_extra_config=connector)
        self.llm = LLM(**kw)

    def generate(self, prompt: list[int], max_tokens: int = 24) -> dict:
        from vllm import SamplingParams

        out = self.llm.generate({"prompt_token_ids": prompt},
                                SamplingParams(temperature=0, max_tokens=max_tokens,
                                               ignore_eos=True), use_tqdm=False)[0]
        return {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}

    def worker_stats(self) -> list[dict]:
        """Each TP rank's worker connector counters (in the worker processes at TP > 1)."""
        return self.llm.collective_rpc(_worker_stats)

    def corrupt_loads(self, on: bool) -> None:
        """Test only: make every worker connector load random bytes instead of the
        stored ones (the control that shows loaded KV is really used)."""
        self.llm.collective_rpc(_corrupt_loads, args=(on,))

    def close(self) -> None:
        """Shut the engine down (its TP worker processes and their shared memory), so
        that killing the actor leaves nothing behind."""
        self.llm.llm_engine.engine_core.shutdown()

    def pid(self) -> int:
        return os.getpid()


def start_engine(node_id: str, model: str, connector: dict | None, *, env: dict | None = None,
                 **kw):
    """An ``Engine`` hard-pinned to ``node_id`` (starting: ``ready`` waits for it)."""
    return Engine.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        runtime_env={"env_vars": ENV | (env or {})}).remote(model, connector, **kw)


def ready(*engines) -> None:
    """Wait until every engine has started (they start in parallel)."""
    ray.get([e.pid.remote() for e in engines])
