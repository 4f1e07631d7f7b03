"""Set-ups shared by the vLLM peer plugin (``vllm_plugin``, ``vllm_worker_loop``: vLLM's
own tests against raykv) and the integration steps (tests/integration/vllm_steps.py):
the stand-in model's KV rule (``kv_of``, ``expected_kv``), vLLM's world of one rank in
this process, and raykv reads of chosen keys made to fail. vLLM is imported lazily; the
peer runs import this file from its folder."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

MOD = 65521  # KV values stay below 2**16: exact in float32


def kv_of(total: int, token: int) -> int:
    """The stand-in model's KV of a position holding ``token`` after positions whose KV
    add up to ``total``: it depends on every earlier position's KV."""
    return (31 * total + token + 7) % MOD


def expected_kv(tokens: list[int]) -> list[int]:
    """The KV of every position of ``tokens`` when every earlier position's KV is right."""
    out, total = [], 0
    for tok in tokens:
        v = kv_of(total, tok)
        out.append(v)
        total += v
    return out


def init_one_rank_world(vllm_config=None) -> None:
    """vLLM's world of one rank in this process (a worker-role connector asks for its TP
    and PP rank), once; ``vllm_config``: the config current meanwhile (None: vLLM's
    default)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vllm_config or VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        ensure_model_parallel_initialized(1, 1)


@contextlib.contextmanager
def failing_reads(client, keys: set[str], block_size: int, kv, stale) -> Iterator[None]:
    """Within: ``client``'s ``batch_get_v2`` reports the pages of ``keys`` not read and
    leaves their blocks of ``kv`` (indexed by block) holding ``stale``, as a read that did
    not complete (the block of a page: its first host index over ``block_size``)."""
    get = client.batch_get_v2

    def batch_get_v2(transfers):
        result = get(transfers)
        for t in transfers:
            ok = result[t.name]
            for i, key in enumerate(t.keys):
                if key in keys:
                    ok[i] = False
                    kv[int(t.host_indices[i * block_size]) // block_size] = stale
        return result

    client.batch_get_v2 = batch_get_v2  # over the class's method, for this block
    try:
        yield
    finally:
        del client.batch_get_v2
