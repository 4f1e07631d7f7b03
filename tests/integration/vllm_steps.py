"""vLLM's own scheduler driving raykv's vLLM connector, step by step, with a stand-in
forward: the scenarios of vLLM's KV-connector tests (a load that fails for one block
while other requests share it through vLLM's prefix cache) run against
``RayKVConnector`` and a real raykv cluster, without a model's numerics in the way.

``StepEngine`` is one engine: vLLM's ``Scheduler`` (or ``AsyncScheduler``) with
``RayKVConnector`` as its connector (scheduler role), one worker-role
``RayKVConnector`` over a KV cache tensor of this process (one layer, one KV head, two
values per token), and ``forward``, which writes each scheduled token's KV as a pure
function of its token and of the KV of every earlier token of its request, read from
the KV cache through the request's block table, as attention reads it. So a token
computed over a block that holds the wrong KV gets the wrong KV, and so does every
later token; ``vllm_world.expected_kv`` is the right KV of every token of a prompt. A block's
KV is right when it equals ``expected_kv`` there, wherever it came from.

Each engine is in this process (vLLM's distributed state: one rank, gloo, made once);
the raykv client of each side joins the Ray cluster this process is connected to.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from raykv.integrations.vllm.connector_stats import StatsGrowth, growth_from_vllm

from tests.peers.vllm_world import MOD, failing_reads, init_one_rank_world, kv_of

SAMPLED = 5  # the token the stand-in model always samples


class StepEngine:
    """One engine of ``model`` (a model folder: vLLM reads its config only) whose
    connector keys blocks under ``model_name``: ``block_size``-token blocks, ``budget``
    tokens per step (chunked prefill), vLLM's prefix cache on,
    ``kv_load_failure_policy=policy``; ``async_scheduling``: vLLM's ``AsyncScheduler``,
    driven as vLLM's engine core drives it with two batches in flight (step N+1 is
    scheduled before step N's output reaches the scheduler); ``extra``: more
    ``kv_connector_extra_config`` keys (the load guard off unless ``extra`` says
    otherwise: the stepped tests are about loads). ``fail_loads``, when set, is asked each step
    for the keys whose reads fail in it (given the step's connector metadata)."""

    def __init__(self, model: str, model_name: str, *, policy: str = "recompute",
                 block_size: int = 16, num_blocks: int = 1000, budget: int = 64,
                 async_scheduling: bool = False, extra: dict | None = None) -> None:
        from raykv.integrations.vllm import RayKVConnector
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        config = VllmConfig(
            model_config=ModelConfig(model=model, dtype="float32", seed=0),
            scheduler_config=SchedulerConfig(
                max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=2048,
                enable_chunked_prefill=True, is_encoder_decoder=False),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="RayKVConnector",
                kv_connector_module_path="raykv.integrations.vllm", kv_role="kv_both",
                kv_load_failure_policy=policy,
                kv_connector_extra_config={"model_name": model_name,
                                           "load_guard": "off"} | (extra or {})),
            device_config=DeviceConfig("cpu"))
        config.cache_config.num_gpu_blocks = num_blocks
        kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))])
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self.block_size = block_size
        self.async_scheduling = async_scheduling
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = cls(vllm_config=config, kv_cache_config=kv_config, log_stats=True,
                             structured_output_manager=StructuredOutputManager(config),
                             block_size=block_size)
        init_one_rank_world(config)
        self.connector = RayKVConnector(config, KVConnectorRole.WORKER, kv_config)
        self.kv = torch.zeros(num_blocks, 1, block_size, 2)
        self.connector.register_kv_caches({"layer.0": self.kv})
        self.loaded: dict[str, list[int]] = {}  # request id -> block ids it loaded
        self.fail_loads: Callable[[object], set[str]] | None = None
        self.vllm_stats = StatsGrowth()  # vLLM's sums of the connector's stats
        self._count = 0

    @property
    def worker(self):
        """The worker side of this engine's connector (``RayKVConnectorWorker``)."""
        return self.connector.connector_worker

    def add(self, tokens: list[int], max_tokens: int = 2):
        """A request for ``tokens`` (greedy ``max_tokens`` tokens), added to the
        scheduler; vLLM's ``Request``."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self._count += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(request_id=f"r{self._count}", prompt_token_ids=list(tokens),
                      sampling_params=params, pooling_params=None,
                      block_hasher=self._hasher)
        self.scheduler.add_request(req)
        return req

    def run(self, max_steps: int = 500) -> int:
        """Step until no request is left (each step: schedule, the worker connector and
        the forward, the scheduler's update; with async scheduling the update of step N
        after step N+1 ran); the steps taken."""
        pending = None  # (scheduler output, model output) not yet given to the scheduler
        for n in range(max_steps):
            if not self.scheduler.has_requests():
                if pending is None:
                    return n
                self._update(*pending)
                pending = None
                continue
            out = self.scheduler.schedule()
            result = self.execute(out)
            if pending is not None:
                self._update(*pending)
                pending = None
            if self.async_scheduling:
                pending = (out, result)
            else:
                self._update(out, result)
        raise AssertionError(f"requests left after {max_steps} steps")

    def _update(self, out, result) -> None:
        """The scheduler's update from a step's output; the connector stats of vLLM's
        scheduler stats summed into ``vllm_stats`` (what ``vllm serve`` logs)."""
        for outputs in self.scheduler.update_from_output(out, result).values():
            stats = outputs.scheduler_stats
            if stats and stats.kv_connector_stats:  # vLLM's dict, read back
                self.vllm_stats += growth_from_vllm(stats.kv_connector_stats)

    def execute(self, out):
        """One step of the model runner: vLLM's connector calls around ``forward``, in
        the order vLLM's model runner makes them; its ``ModelRunnerOutput``."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        c = self.connector
        c.bind_connector_metadata(out.kv_connector_metadata)
        for x in out.kv_connector_metadata.loads:
            self.loaded.setdefault(x.req_id, []).extend(x.block_ids)
        fail = self.fail_loads(out.kv_connector_metadata) if self.fail_loads else set()
        with set_forward_context(None, self.scheduler.vllm_config):
            with self._failing(fail):
                c.start_load_kv(None)
            sampled = self.forward(out)
            c.wait_for_save()
        invalid = c.get_block_ids_with_load_errors()
        c.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled.get(r, []) for r in ids],
            kv_connector_output=KVConnectorOutput(
                invalid_block_ids=invalid, kv_connector_stats=c.get_kv_connector_stats()))

    def _failing(self, keys: set[str]) -> contextlib.AbstractContextManager[None]:
        """Within: the worker's raykv reads of ``keys`` fail, and their blocks hold
        stale KV (a value no forward writes), as after a read that did not complete."""
        return failing_reads(self.worker._client, keys, self.block_size, self.kv, MOD + 1)

    def forward(self, out) -> dict[str, list[int]]:
        """The stand-in forward: each scheduled request's tokens in scheduling order, each
        token's KV from its token and every earlier token's KV in the cache; the token
        sampled for each request whose prompt is complete."""
        sched = self.scheduler
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts |= dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled = {}
        for rid, start in starts.items():
            req = sched.requests[rid]
            (table,) = sched.kv_cache_manager.get_block_ids(rid)
            end = start + out.num_scheduled_tokens[rid]
            tokens = list(req.all_token_ids) + [SAMPLED] * (end - len(req.all_token_ids))
            before = torch.arange(start)
            slots = torch.tensor(table)[before // self.block_size] * self.block_size \
                + before % self.block_size
            total = int(self.kv.view(-1, 2)[slots, 0].double().sum())
            for p in range(start, end):
                v = kv_of(total, tokens[p])
                self.kv[table[p // self.block_size], 0, p % self.block_size] = v
                total += v
            if end >= req.num_prompt_tokens:
                sampled[rid] = [SAMPLED]
        return sampled

    def stored(self, tokens: list[int]) -> list[list[int] | None]:
        """Per full block of ``tokens``: the KV values raykv holds under its key (read
        through this engine's worker connector into its cache's last block: call it on
        an idle engine kept for reading), None where raykv holds no such object."""
        from raykv.controllers.contract import PoolName, PoolTransfer
        from raykv.integrations.vllm.page_hash import PageHashChain
        from raykv.integrations.vllm.request_blocks import hash_hex
        from vllm import SamplingParams
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
        from vllm.v1.request import Request

        req = Request(request_id="stored", prompt_token_ids=list(tokens),
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None)
        hashes = PageHashChain(self.block_size).extend(
            list(tokens), len(tokens), functools.partial(generate_block_hash_extra_keys, req))
        scratch = self.kv.shape[0] - 1
        out: list[list[int] | None] = []
        for h in hashes:
            (ok,) = self.worker._client.batch_get_v2([PoolTransfer(
                PoolName.KV, [hash_hex(h)], self.worker._slots([scratch]))])[PoolName.KV]
            out.append(self.block_kv(scratch) if ok else None)
        return out

    def block_kv(self, block_id: int) -> list[int]:
        """The KV values of the tokens of block ``block_id`` in this engine's cache."""
        return [int(v) for v in self.kv[block_id, 0, :, 0]]

    def close(self) -> None:
        self.connector.shutdown()
        self.scheduler.connector.shutdown()
