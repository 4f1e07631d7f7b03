"""The vLLM tests' control engine: an engine actor that can load random bytes instead of
the stored blocks (shows that loaded KV is really used), and that can record the bytes
of the blocks its connector saves and loads (the loaded KV compared with the saved KV
byte for byte, which no numerical effect can blur), that reports its scheduler side's
counters, key tag and vLLM's own block hash, that can be re-keyed (a control for the
key tag), that can switch its load guard, that can fail one block of its next load and
restore the old rule of which saves to refuse after a failed load (a control), that can
let its forward run ahead of the copies behind it (a control), and that answers with
logprobs. In a
module of its own so that Ray workers import it by name
(``tests.integration.vllm_control``)."""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import replace

import ray
import torch
from raykv.integrations.vllm.connector_stats import ConnectorStats
from raykv_lab.bench.digest_engine import DigestRecorder, watch_blocks
from raykv_lab.engines.vllm_actors import VLLMEngine


def _connector():
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    return get_kv_transfer_group()


def _digests(c, block_ids: list[int]) -> list[list[str]]:
    """Per block, per layer (vLLM's layer order): SHA-256 of the block's bytes in vLLM's
    KV cache as they are now."""
    return [[hashlib.sha256(layer[b].contiguous().view(torch.uint8).numpy()).hexdigest()
             for layer in c.connector_worker._layers] for b in block_ids]


def _record_blocks(worker, on: bool) -> None:
    """Record anew (``watch_blocks``) the bytes of the blocks this worker's connector
    saves, as vLLM's KV cache holds them when it saves them, and of the blocks it
    loaded, right after the load; off: stop."""
    c = _connector()
    c._recorded = {"saved": {}, "saved_all": {}, "loaded": {}}

    def saved(h: str, b: int) -> None:
        (d,) = _digests(c, [b])
        c._recorded["saved"].setdefault(h, d)
        every = c._recorded["saved_all"].setdefault(h, [])
        if d not in every:
            every.append(d)

    def loaded(h: str, b: int) -> None:
        (c._recorded["loaded"][h],) = _digests(c, [b])

    watch_blocks(c, on, saved, loaded)


def _recorded(worker) -> dict:
    return getattr(_connector(), "_recorded", {"saved": {}, "saved_all": {}, "loaded": {}})


def _as_dtype(kv_cache_config, dtype: str):
    """``kv_cache_config`` with its KV cache spec's dtype ``dtype`` (a torch name)."""
    groups = [replace(g, kv_cache_spec=replace(g.kv_cache_spec, dtype=getattr(torch, dtype)))
              for g in kv_cache_config.kv_cache_groups]
    return replace(kv_cache_config, kv_cache_groups=groups)


def _rekey(side, tag: str, identity=None, scheduler: bool = False) -> None:
    """Re-attach one side of the connector with key tag ``tag`` (a new client and pool),
    and claiming ``identity`` (a ``KVIdentity``) if given: the ``scheduler`` side then
    also registers its blocks as of that identity's dtype (the geometry it registers
    is read from vLLM's KV cache spec)."""
    side.shutdown()
    side._closed = False  # the same side object attaches again, as a new one would
    side.opts = replace(side.opts, extra_backend_tag=tag,
                        identity=identity if identity is not None else side.opts.identity)
    if scheduler and identity is not None and side._kv_cache_config is not None:
        side._kv_cache_config = _as_dtype(side._kv_cache_config, identity.kv_dtype)
    side._attach()


def _rekey_worker(worker, tag: str, identity=None) -> None:
    _rekey(_connector().connector_worker, tag, identity)


def _fail_next_load(worker, index: int) -> None:
    """The worker connector's next raykv read of at least ``index + 1`` blocks fails for
    its block ``index``, which then holds random values (as after a read that did not
    complete); later reads are left alone."""
    w = _connector().connector_worker
    client = w._client
    get = client.batch_get_v2

    def batch_get_v2(transfers):
        result = get(transfers)
        for t in transfers:
            if len(t.keys) > index:
                del client.batch_get_v2  # once
                result[t.name][index] = False
                block = int(t.host_indices[index * w.block_size]) // w.block_size
                for layer in w._layers:
                    layer[block] = torch.randn(layer[block].shape).to(layer.dtype)
        return result

    client.batch_get_v2 = batch_get_v2


def _async_worker(worker, on: bool) -> None:
    w = _connector().connector_worker
    w.opts = replace(w.opts, async_transfers=on)


def _fail_next_async_load(worker, index: int, report: bool) -> None:
    """The worker's next L2 load of more than ``index`` blocks (the async loads' path)
    leaves its block ``index`` with random values (as after a read that did not
    complete) and reports the leading ``index`` blocks loaded, or, with ``report``
    False (a control: a hook that passes a failed load off as done), all of them."""
    w = _connector().connector_worker
    l2 = w._steps.l2
    load = l2.load

    def once(block_ids, hashes, behind=None):
        n, later = load(block_ids, hashes)  # never behind: the async path
        if n <= index:
            return n, later
        del l2.load
        for layer in w._layers:
            layer[block_ids[index]] = torch.randn(layer[block_ids[index]].shape).to(layer.dtype)
        return (index if report else n), later

    l2.load = once


def _unwaited_layer_loads(worker, on: bool) -> None:
    """Control: the forward no longer waits for the copies behind it (vLLM's asks are
    still seen) and those copies start only once the forward has ended (when vLLM calls
    ``wait_for_save``), so the forward reads vLLM's blocks before their layers are
    copied; off: the worker's own."""
    w = _connector().connector_worker
    if not on:
        for name in ("wait_for_layer_load", "wait_for_save"):
            w.__dict__.pop(name, None)
        w._steps.l2.__dict__.pop("_copy_layer", None)
        return
    copy_layer, wait_for_save = w._steps.l2._copy_layer, w.wait_for_save
    forward_ended = threading.Event()

    def late(staged, runs, layer) -> None:
        forward_ended.wait(60)
        copy_layer(staged, runs, layer)

    def after_forward(meta) -> None:
        forward_ended.set()
        wait_for_save(meta)
        forward_ended.clear()

    w.wait_for_layer_load, w.wait_for_save = w._steps.behind.waits.seen, after_forward
    w._steps.l2._copy_layer = late


def _old_save_rule(worker, on: bool) -> None:
    """Control: the worker refuses only the saves of a request whose own load failed in
    this step (the rule before shared blocks were considered); off: its own rule."""
    c = _connector()
    w = c.connector_worker
    if not on:
        w.__dict__.pop("refuses", None)
        return

    def refuses(x) -> bool:
        meta = c._get_connector_metadata()
        return x.req_id in {ld.req_id for ld in meta.loads
                            if not w._unsettled.isdisjoint(ld.block_ids)}

    w.refuses = refuses


@ray.remote(num_cpus=0)
class ControlEngine(DigestRecorder, VLLMEngine):
    """``VLLMEngine`` plus the block recorder, the benchmarks' digest recorder
    (``DigestRecorder``, with its ``corrupt_loads``), the scheduler side's view and ``rekey``
    (in-process, TP=1)."""

    def fail_next_load(self, index: int) -> None:
        """The next load of more than ``index`` blocks fails at its block ``index``
        (``_fail_next_load``)."""
        self.llm.collective_rpc(_fail_next_load, args=(index,))

    def async_transfers(self, on: bool) -> None:
        """Both sides of the connector switch ``async_transfers`` on or off (as if the
        engine had been configured so; its L2 must be open)."""
        side = self._scheduler_connector().connector_scheduler
        side.opts = replace(side.opts, async_transfers=on)
        self.llm.collective_rpc(_async_worker, args=(on,))

    def set_load_guard(self, value) -> None:
        """The scheduler side's load guard switches to ``value`` (``load_guard``'s
        values), its estimates kept (as if the engine had been configured so)."""
        from raykv.controllers.load_guard import GuardSettings

        guard = self._scheduler_connector().connector_scheduler._guard
        guard.settings = GuardSettings.parse(value, guard.settings.margin)

    def load_guard_estimates(self) -> dict:
        """The scheduler side's load guard estimates: ``prefill_s_per_token``,
        ``l2_s_per_byte``, ``l3_s_per_byte`` (None: unknown) and ``page_bytes``."""
        guard = self._scheduler_connector().connector_scheduler._guard
        rates = guard.rates.rates
        return {"prefill_s_per_token": guard.clock.rate.per_unit(),
                "l2_s_per_byte": rates["l2"].per_unit(),
                "l3_s_per_byte": rates["l3"].per_unit(), "page_bytes": guard.rates.page_bytes}

    def fail_next_async_load(self, index: int, report: bool = True) -> None:
        """``_fail_next_async_load``."""
        self.llm.collective_rpc(_fail_next_async_load, args=(index, report))

    def unwaited_layer_loads(self, on: bool) -> None:
        """Control: the forward reads blocks before their copy behind it (see
        ``_unwaited_layer_loads``)."""
        self.llm.collective_rpc(_unwaited_layer_loads, args=(on,))

    def old_save_rule(self, on: bool) -> None:
        """Control: the old rule of which saves to refuse (``_old_save_rule``)."""
        self.llm.collective_rpc(_old_save_rule, args=(on,))

    def generate_logprobs(self, prompts: list[list[int]], max_tokens: int = 8) -> list[dict]:
        """Greedy ``max_tokens`` tokens after each of ``prompts``, submitted together (one
        scheduler step sees them all): per prompt ``tokens``, ``logprobs`` (of each
        token) and ``cached`` (vLLM's ``num_cached_tokens``)."""
        from vllm import SamplingParams

        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True, logprobs=1),
                                 use_tqdm=False)
        return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                 "logprobs": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                              o.outputs[0].logprobs,
                                                              strict=True)]}
                for o in outs]

    def record_blocks(self, on: bool) -> None:
        """Start recording (anew) or stop recording the blocks the connector saves and
        loads (see ``recorded_blocks``)."""
        self.llm.collective_rpc(_record_blocks, args=(on,))

    def recorded_blocks(self) -> dict[str, dict[str, list[str]]]:
        """``{"saved": {page hash: [sha256 per layer]}, "saved_all": {page hash: [[sha256
        per layer], ...]}, "loaded": {...}}`` since ``record_blocks(True)``: a saved
        block's bytes when the connector saved it (first save of that hash; every
        distinct one in ``saved_all``: a save that was dropped is followed by another of
        the recomputed block), a loaded block's bytes right after its load."""
        (rec,) = self.llm.collective_rpc(_recorded)
        return rec

    def record_events(self) -> None:
        """Record (anew) every KV event batch vLLM's scheduler publishes (over its
        publisher, the null one when events are off), for ``recorded_events``."""
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        publisher = scheduler.kv_event_publisher
        self._events: list = []

        def publish(batch) -> None:
            self._events += batch.events
            type(publisher).publish(publisher, batch)

        publisher.publish = publish

    def recorded_events(self) -> list[dict]:
        """The events since ``record_events`` of raykv's tiers (``ownership``
        ``raykv-*``), each as ``type``, ``medium``, ``ownership``, ``block_hashes``,
        ``parent``, ``token_ids``."""
        return [{"type": type(e).__name__, "medium": e.medium, "ownership": e.ownership,
                 "block_hashes": list(e.block_hashes),
                 "parent": getattr(e, "parent_block_hash", None),
                 "token_ids": list(getattr(e, "token_ids", []))}
                for e in getattr(self, "_events", [])
                if (getattr(e, "ownership", None) or "").startswith("raykv-")]

    def vllm_block_hashes(self, prompt: list[int], block_size: int) -> list:
        """vLLM's block hashes of ``prompt``'s full blocks here, as its KV events carry
        them (``maybe_convert_block_hash``)."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

        algo = self.llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo
        fn, parent, out = get_hash_fn_by_name(algo), None, []
        for i in range(len(prompt) // block_size):
            parent = hash_block_tokens(fn, parent, prompt[i * block_size:(i + 1) * block_size],
                                       None)
            out.append(maybe_convert_block_hash(parent))
        return out

    def _scheduler_connector(self):
        return self.llm.llm_engine.engine_core.engine_core.scheduler.connector

    def scheduler_stats(self) -> ConnectorStats:
        """The scheduler side's counters (``queries``, ``hit_blocks``)."""
        return self._scheduler_connector().stats

    def key_tag(self) -> str:
        """The key tag (``extra_backend_tag``) the connector uses."""
        return self._scheduler_connector().connector_scheduler.opts.extra_backend_tag

    def key_identity(self):
        """The blocks' identity (``KVIdentity``) the connector hands raykv."""
        return self._scheduler_connector().connector_scheduler.opts.identity

    def rekey(self, tag: str, identity=None) -> None:
        """Control only: both sides of the connector re-attach with key tag ``tag`` (as
        if this engine had been configured with ``extra_backend_tag=tag``), claiming
        ``identity`` if given (else its own)."""
        _rekey(self._scheduler_connector().connector_scheduler, tag, identity,
               scheduler=True)
        self.llm.collective_rpc(_rekey_worker, args=(tag, identity))

    def vllm_block_hash(self, prompt: list[int], block_size: int) -> tuple[str | None, str]:
        """This process's ``PYTHONHASHSEED`` and vLLM's own block hash of ``prompt``'s
        first block here (what ``request.block_hashes[0]`` is for it): the key an
        engine keyed by vLLM's block hashes would use."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        algo = self.llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo
        h = hash_block_tokens(get_hash_fn_by_name(algo), None, prompt[:block_size], None)
        return os.environ.get("PYTHONHASHSEED"), bytes(h).hex()
