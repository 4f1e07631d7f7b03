"""A vLLM engine actor that records the digests of the blocks raykv's connector saves
and loads (``raykv_lab.bench.block_digests`` says what a digest is and checks
them). Imports vLLM and torch inside the actor only."""

from __future__ import annotations

from collections.abc import Callable

import ray
from raykv_lab.engines.vllm_actors import VLLMEngine


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


def randomize(layers, block_ids: list[int]) -> None:
    """Random values into vLLM's ``block_ids`` of every layer (vLLM's KV cache: host
    memory on CPU, else a GPU's)."""
    import torch

    ids = torch.tensor(block_ids, dtype=torch.long, device=layers[0].device)
    for blocks in layers:
        noise = torch.randn((len(block_ids), *blocks.shape[1:])).to(blocks.dtype)
        blocks.index_copy_(0, ids, noise.to(blocks.device))


def corrupt_loads(worker, on: bool) -> None:
    """Control, injected into raykv's vLLM worker connector (``RayKVConnectorWorker``)
    from outside (the connector holds no such switch): every block it loads is
    overwritten with random values right after its load, each copy made on the step
    (none behind the forward, which would land after the overwrite); off: its own
    loads. Instance attributes over the class's methods, which is what it calls."""
    for name in ("_load", "_load_async"):
        worker.__dict__.pop(name, None)
    worker._steps.__dict__.pop("layer_loads", None)
    if not on:
        return
    load, load_async = worker._load, worker._load_async

    def _load(x, behind=None) -> int:
        n = load(x, None)
        if n:
            randomize(worker._layers, x.block_ids[:n])
        return n

    def _load_async(x) -> int:
        n = load_async(x)
        if n:
            randomize(worker._layers, x.block_ids[:n])
        return n

    worker._load, worker._load_async = _load, _load_async
    worker._steps.layer_loads = lambda: None


def _corrupt(worker, on: bool) -> None:
    corrupt_loads(_connector().connector_worker, on)


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
        """Control: every load leaves random values instead of the stored bytes
        (``corrupt_loads``), so ``check_loads`` must find them wrong."""
        self.llm.collective_rpc(_corrupt, args=(on,))


@ray.remote(num_cpus=0)
class DigestEngine(DigestRecorder, VLLMEngine):
    """``VLLMEngine`` with ``DigestRecorder``."""
