"""The vLLM deadline tests' engine: an engine actor whose scheduler-side lookups
(``get_num_new_matched_tokens``) are timed, and which can SIGSTOP a process right after
a lookup that hit (so the worker's load meets a node actor stopped after it answered).
In a module of its own so that Ray workers import it by name."""

from __future__ import annotations

import time

import ray
from raykv.clusters.demo.vllm_actors import VLLMEngine

from tests.integration.process_stop import stop_process


@ray.remote(num_cpus=0)
class DeadlineEngine(VLLMEngine):
    """``VLLMEngine`` (in-process: the scheduler runs in this actor) plus ``lookups``,
    ``stop_after_lookup`` and ``breaker``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lookups: list[dict] = []
        self._stop_pid: int | None = None
        connector = self.llm.llm_engine.engine_core.engine_core.scheduler.connector
        self._scheduler_side = connector.connector_scheduler
        lookup = connector.get_num_new_matched_tokens

        def timed(request, num_computed_tokens):
            t = time.perf_counter()
            out = lookup(request, num_computed_tokens)
            self._lookups.append({"seconds": time.perf_counter() - t, "tokens": out[0]})
            if self._stop_pid is not None and out[0]:
                stop_process(self._stop_pid)
                self._stop_pid = None
            return out
        connector.get_num_new_matched_tokens = timed

    def lookups(self) -> list[dict]:
        """Every lookup so far: its ``seconds`` and the external ``tokens`` it answered."""
        return list(self._lookups)

    def breaker(self) -> str:
        """The state of this process's circuit breaker on its node actor (shared by the
        scheduler's and the worker's clients): closed, open or trial."""
        return self._scheduler_side._client.breaker_counts()["state"]

    def stop_after_lookup(self, pid: int) -> None:
        """SIGSTOP ``pid`` as soon as a lookup answers a hit (once)."""
        self._stop_pid = pid
