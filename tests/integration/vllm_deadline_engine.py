"""The vLLM deadline tests' engine: an engine actor whose scheduler-side lookups
(``get_num_new_matched_tokens``) are timed, and which can SIGSTOP a process right after
a lookup that hit (so the worker's load meets a node actor stopped after it answered),
record the bytes of the blocks its connector saves and loads, tell which blocks the
store holds, and (a control) return from a failed put or get at its deadline whatever
store call of it still runs, as ranks did before tickets.
In a module of its own so that Ray workers import it by name."""

from __future__ import annotations

import time

import ray
from raykv_lab.engines.vllm_actors import VLLMEngine

from tests.integration.process_stop import stop_process
from tests.integration.vllm_control import _record_blocks, _recorded


def _old_return(book, ticket) -> bool:
    """CONTROL: a failed call's ticket freed at once, whatever store call of it runs."""
    book.free(ticket, answered=False)
    return True


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

    def generate_many(self, prompts: list[list[int]], cache_salt: str | None = None,
                      max_tokens: int = 24) -> list[dict]:
        """Greedy ``max_tokens`` tokens after each of ``prompts``, submitted together (one
        scheduler step sees them all, so their saves follow each other in one worker
        step): per prompt ``tokens`` and ``cached``."""
        from vllm import SamplingParams

        inputs = [{"prompt_token_ids": p} | ({} if cache_salt is None else
                                             {"cache_salt": cache_salt}) for p in prompts]
        outs = self.llm.generate(inputs, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                        ignore_eos=True), use_tqdm=False)
        return [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens}
                for o in outs]

    def record_blocks(self, on: bool) -> None:
        """Start recording (anew) or stop recording the bytes of the blocks the
        connector saves and loads (``vllm_control._record_blocks``)."""
        self.llm.collective_rpc(_record_blocks, args=(on,))

    def recorded_blocks(self) -> dict[str, dict[str, list[str]]]:
        """``{"saved": {page hash: [sha256 per layer]}, "loaded": {...}}``."""
        (rec,) = self.llm.collective_rpc(_recorded)
        return rec

    def stored(self, hashes: list[str]) -> list[bool]:
        """Whether the store holds each block ``hashes[i]`` (a hit query per block). A
        query that runs into the connector's 1 s deadline on a loaded machine (or finds
        the breaker open after one) is asked again, for up to 60 s."""
        from raykv.cache_actors.errors import CircuitOpenError, DeadlineExceededError

        client = self._scheduler_side._cache()

        def exists(h: str) -> bool:
            end = time.monotonic() + 60.0
            while True:
                try:
                    return client.batch_exists([h]) == 1
                except (DeadlineExceededError, CircuitOpenError):
                    if time.monotonic() > end:
                        raise
                    time.sleep(0.5)

        return [exists(h) for h in hashes]

    def old_return(self, on: bool) -> None:
        """CONTROL (on): this process's ranks (scheduler and worker: one process) free a
        failed put's or get's ticket at once, neither waiting for its store call nor
        quarantining its staging pages; off: the tickets' own rules."""
        from raykv.cache_actors.tickets import TicketBook

        if not hasattr(self, "_ticket_rules"):
            self._ticket_rules = (TicketBook.settle, TicketBook.try_settle)
        if on:
            TicketBook.settle = TicketBook.try_settle = _old_return
        else:
            TicketBook.settle, TicketBook.try_settle = self._ticket_rules

    def stop_after_lookup(self, pid: int) -> None:
        """SIGSTOP ``pid`` as soon as a lookup answers a hit (once)."""
        self._stop_pid = pid
