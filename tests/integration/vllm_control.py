"""The vLLM tests' control engine: an engine actor that can load random bytes instead of
the stored blocks (shows that loaded KV is really used). In a module of its own so that
Ray workers import it by name (``tests.integration.vllm_control``)."""

from __future__ import annotations

import ray
from raykv.integrations.vllm_actors import VLLMEngine


def _corrupt_loads(worker, on: bool) -> None:
    from dataclasses import replace

    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    c = get_kv_transfer_group()
    c.opts = replace(c.opts, debug_corrupt_loads=on)


@ray.remote(num_cpus=0)
class ControlEngine(VLLMEngine):
    """``VLLMEngine`` plus ``corrupt_loads``."""

    def corrupt_loads(self, on: bool) -> None:
        """Every worker connector loads random bytes (on) or the stored blocks (off)."""
        self.llm.collective_rpc(_corrupt_loads, args=(on,))
