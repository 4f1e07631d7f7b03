"""A hung node actor under a real vLLM engine (CPU build, in-process in a Ray actor)
with raykv's connector, ``timeout_s`` = 1 s and ``kv_load_failure_policy="recompute"``:
the node actor of the engine's node is stopped with SIGSTOP (pid from ``health()``).

- Stopped before the engine's first request: the scheduler's lookup answers a miss
  within the deadline (its client was made at start-up, so no control call such as
  creating its pool waits on the stopped actor) and the request completes.
- Stopped with ``p``'s blocks stored: the lookup misses within the deadline and the
  request gives the cold run's greedy tokens.
- Stopped right after a lookup that hit (the engine actor stops it from inside the
  scheduler's ``get_num_new_matched_tokens``): the worker's load fails at the deadline,
  vLLM recomputes, the tokens are the cold run's.
- After SIGCONT a later request loads ``p``'s 7 blocks from raykv again.

Every ``generate`` is waited for at most ``HANG_S``; one still running then (an engine
held by a call without deadline) fails the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import ray
from raykv.clusters.demo.vllm_actors import ready, start_engine
from raykv.clusters.demo.vllm_model import make_llama

from tests.integration.process_stop import stop_process
from tests.integration.test_vllm import BLOCK, prompt
from tests.integration.vllm_deadline_engine import DeadlineEngine

TIMEOUT_S = 1.0
HANG_S = 60.0  # a generate still running after this long is taken as hung
FULL = 7 * BLOCK  # p's blocks raykv may serve (1000 tokens, the last one computed)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_llama(str(tmp_path_factory.mktemp("vllm") / "tiny-llama"))


def bounded(ref, what: str):
    try:
        return ray.get(ref, timeout=HANG_S)
    except ray.exceptions.GetTimeoutError:
        pytest.fail(f"{what}: the engine still runs after {HANG_S:g} s (held by a call to "
                    "the stopped node actor)", pytrace=False)


def last_lookup(engine) -> dict:
    return ray.get(engine.lookups.remote())[-1]


def loaded(engine) -> tuple[int, int]:
    (stats,) = ray.get(engine.worker_stats.remote())
    return stats["loaded"], stats["load_failed"]


def until_loaded(engine, p: list[int], want: list[int]) -> None:
    """Generate ``p`` until its 7 blocks load from raykv (the actor may first work
    through calls that expired while it was stopped); a run that loaded all or none of
    them gives the cold tokens."""
    deadline = time.monotonic() + 60
    while True:
        before = loaded(engine)[0]
        got = bounded(engine.generate.remote(p), "generate after SIGCONT")
        n = loaded(engine)[0] - before
        if n in (0, 7):
            assert got["tokens"] == want, f"{n} blocks loaded: {got}"
        if got["cached"] == FULL and n == 7:
            return
        assert time.monotonic() < deadline, f"never loaded the 7 blocks again: {got}"
        time.sleep(1)


def until_probed(engine) -> None:
    """Wait (bounded) until the engine's circuit breaker, opened by a deadline, let a
    trial through after its probe found the continued actor (until then its saves are
    skipped at once)."""
    deadline = time.monotonic() + 60
    while ray.get(engine.breaker.remote()) == "open":
        assert time.monotonic() < deadline, "the probe never found the node actor again"
        time.sleep(0.1)


def test_a_stopped_node_actor_never_stalls_vllm(cluster, model, uid):
    node = cluster.node_ids[1]
    e = start_engine(node, model, {"model_name": f"tiny-deadline-{uid}",
                                   "timeout_s": TIMEOUT_S}, actor_class=DeadlineEngine)
    pid = ray.get(cluster.node_actors[node].health.remote())["pid"]
    try:
        ready(e)
        # Before the first request: the lookup misses at the deadline.
        stop_process(pid)
        try:
            first = bounded(e.generate.remote(prompt(40)), "first request while stopped")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert first["cached"] == 0, first
        lookup = last_lookup(e)
        assert lookup["tokens"] == 0 and TIMEOUT_S * 0.9 <= lookup["seconds"] < HANG_S, \
            lookup
        until_probed(e)

        p = prompt(41)
        cold = bounded(e.generate.remote(p), "cold run")
        assert cold["cached"] == 0, cold
        warm = bounded(e.generate.remote(p), "warm run")  # control: raykv serves p
        assert warm["cached"] == FULL and warm["tokens"] == cold["tokens"], warm

        # Stopped with p stored: a miss at the deadline, the cold tokens.
        stop_process(pid)
        try:
            got = bounded(e.generate.remote(p), "lookup while stopped")
        finally:
            os.kill(pid, signal.SIGCONT)
        lookup = last_lookup(e)
        assert lookup["tokens"] == 0 and TIMEOUT_S * 0.9 <= lookup["seconds"] < HANG_S, \
            lookup
        assert got["tokens"] == cold["tokens"], got
        until_loaded(e, p, cold["tokens"])

        # Stopped after a lookup that hit: the load fails, vLLM recomputes.
        ok0, failed0 = loaded(e)
        ray.get(e.stop_after_lookup.remote(pid))
        try:
            got = bounded(e.generate.remote(p), "load while stopped")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert last_lookup(e)["tokens"] == FULL  # the lookup hit before the stop
        ok1, failed1 = loaded(e)
        assert (ok1 - ok0, failed1 - failed0) == (0, 7), (ok0, failed0, ok1, failed1)
        assert got["tokens"] == cold["tokens"], got

        # Continued: p loads from raykv again.
        until_loaded(e, p, cold["tokens"])
        print("lookups (seconds, tokens):", [(round(x["seconds"], 3), x["tokens"])
                                             for x in ray.get(e.lookups.remote())])
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)
        with contextlib.suppress(Exception):
            ray.get(e.close.remote(), timeout=60)
        ray.kill(e)
