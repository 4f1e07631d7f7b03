"""A vLLM engine actor that records the digests of the blocks raykv's connector saves
and loads (``raykv.clusters.bench.block_digests`` says what a digest is and checks
them). Imports vLLM and torch inside the actor only."""

from __future__ import annotations

from collections.abc import Callable

import ray
from raykv.clusters.demo.vllm_actors import VLLMEngine


def _connector():
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    return get_kv_transfer_group()


def _digest(layers, block: int) -> str:
    import hashlib

    import torch

    h = hashlib.sha256()
    for layer in layers:
        h.update(layer[block].contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def watch_blocks(c, on: bool, saved: Callable[[str, int], None],
                 loaded: Callable[[str, int], None]) -> None:
    """Wrap connector ``c`` (instance attributes over the class's methods, which is what
    vLLM calls): ``wait_for_save`` first calls ``saved(page hash, vLLM block id)`` for
    each block it is about to save, while vLLM's KV cache holds the saved bytes;
    ``start_load_kv`` calls ``loaded(page hash, block id)`` for each block it loaded,
    right after the load, and for each block it copies behind the forward once
    ``wait_for_save`` has ended those copies (not for blocks whose load failed: vLLM
    recomputes them). Off: the class's methods again."""
    if not on:
        for name in ("wait_for_save", "start_load_kv"):
            c.__dict__.pop(name, None)
        return
    cls = type(c)
    worker = c.connector_worker
    behind: list[tuple[str, int]] = []  # loaded blocks whose copy ends in wait_for_save

    def wait_for_save() -> None:
        for x in getattr(c._get_connector_metadata(), "saves", ()):
            for h, b in zip(x.hashes, x.block_ids, strict=True):
                saved(h, b)
        cls.wait_for_save(c)
        for h, b in behind:
            if b not in worker._load_errors:
                loaded(h, b)
        behind.clear()

    def start_load_kv(forward_context, **kwargs) -> None:
        cls.start_load_kv(c, forward_context, **kwargs)
        failed = worker._load_errors  # not yet handed to vLLM
        later = set(worker._steps.behind.blocks) if worker._steps.behind is not None else set()
        for x in getattr(c._get_connector_metadata(), "loads", ()):
            for h, b in zip(x.hashes, x.block_ids, strict=True):
                if b in later:
                    behind.append((h, b))
                elif b not in failed:
                    loaded(h, b)

    c.wait_for_save, c.start_load_kv = wait_for_save, start_load_kv


def _record(worker, on: bool) -> None:
    """Record digests anew (``watch_blocks``); off: stop. Loaded digests go in a list,
    one entry per load."""
    c = _connector()
    c._digests = {"saved": {}, "loaded": []}

    def saved(h: str, b: int) -> None:
        digests = c._digests["saved"].setdefault(h, [])
        d = _digest(c.connector_worker._layers, b)
        if d not in digests:
            digests.append(d)

    def loaded(h: str, b: int) -> None:
        c._digests["loaded"].append([h, _digest(c.connector_worker._layers, b)])

    watch_blocks(c, on, saved, loaded)


def _recorded(worker) -> dict:
    return getattr(_connector(), "_digests", {"saved": {}, "loaded": []})


def _corrupt(worker, on: bool) -> None:
    from dataclasses import replace

    w = _connector().connector_worker
    w.opts = replace(w.opts, debug_corrupt_loads=on)


class DigestRecorder:
    """What a ``VLLMEngine`` subclass (in-process, TP=1, raykv's connector) needs to
    record the digests of the blocks its connector saves and loads."""

    def record(self, on: bool) -> None:
        """Start recording anew (on) or stop."""
        self.llm.collective_rpc(_record, args=(on,))

    def recorded(self) -> dict:
        """``{"saved": {page hash: [digests]}, "loaded": [[page hash, digest], ...]}``
        since ``record(True)``."""
        (rec,) = self.llm.collective_rpc(_recorded)
        return rec

    def corrupt_loads(self, on: bool) -> None:
        """Control: every load copies random values instead of the stored bytes
        (``debug_corrupt_loads``), so ``check_loads`` must find them wrong."""
        self.llm.collective_rpc(_corrupt, args=(on,))


@ray.remote(num_cpus=0)
class DigestEngine(DigestRecorder, VLLMEngine):
    """``VLLMEngine`` with ``DigestRecorder``."""
