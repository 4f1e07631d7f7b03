"""A hung node actor under a real vLLM engine (CPU build, in-process in a Ray actor)
with raykv's connector, ``timeout_s`` = 1 s and ``kv_load_failure_policy="recompute"``:
the node actor of the engine's node is stopped with SIGSTOP (pid from ``health()``).

- Stopped before the engine's first request: the scheduler's lookup answers a miss
  within the deadline (the step's budget, ``timeout_s``, held by ``deadline_bound``;
  its client was made at start-up, so no control call such as creating its pool waits
  on the stopped actor) and the request completes.
- Stopped with ``p``'s blocks stored: the lookup misses within the deadline and the
  request gives the cold run's greedy tokens.
- Stopped right after a lookup that hit (the engine actor stops it from inside the
  scheduler's ``get_num_new_matched_tokens``): the worker's load fails at the deadline,
  vLLM recomputes, the tokens are the cold run's.
- After SIGCONT a later request loads ``p``'s 7 blocks from raykv again.

Store calls slower than the deadline (the node actors hold every put and get
``DELAY_S`` > ``timeout_s`` inside the store call: ``set_store_delay``), two prompts
submitted together (their saves follow each other in one worker step): the engine's
output equals a run raykv cannot serve (the same prompts under another cache salt), and
no object holding wrong bytes lands in the store: every block the store holds afterwards
is read back by the engine's next loads and its bytes equal those vLLM's KV cache held
when the connector saved it (SHA-256 per layer). The engine stages its blocks through 2
staging pages (``pool_blocks``): the first save's first put outlives the deadline, and
the next save would copy its blocks into the same staging pages (quarantined: it fails
at once). CONTROL (``old_return``): the ranks return from the failed put at the deadline
and reuse the staging pages (no ticket wait, no quarantine): the late store call stores
the other prompt's blocks under the first one's keys, and the next load reads them.

Every ``generate`` is waited for at most ``HANG_S``; one still running then (an engine
held by a call without deadline) fails the test. One engine serves the module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import ray
from raykv_lab.engines.vllm_actors import ready, start_engine
from raykv_lab.engines.vllm_model import make_llama

from tests.integration.conftest import set_store_delay
from tests.integration.deadline_bound import within
from tests.integration.process_stop import stop_process
from tests.integration.test_vllm import BLOCK, prompt
from tests.integration.vllm_deadline_engine import DeadlineEngine

pytestmark = pytest.mark.engine("vllm")

TIMEOUT_S = 1.0
DELAY_S = 2.0  # a slow store call: the node actors hold each put and get this long
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


def waited_one_budget(seconds: float) -> bool:
    """A scheduler step's lookups on the stopped actor: they waited for it (at least
    most of one deadline) and no longer than the step's one budget, ``timeout_s``
    (docs/engines.md, ``timeout_s``), within the documented bound's margin."""
    return seconds >= TIMEOUT_S * 0.9 and within(seconds, TIMEOUT_S)


def last_lookup(engine) -> dict:
    return ray.get(engine.lookups.remote())[-1]


def loaded(engine) -> tuple[int, int]:
    (stats,) = ray.get(engine.worker_stats.remote())
    return stats.counters.loaded, stats.counters.load_failed


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


@pytest.fixture(scope="module")
def engine(cluster, model):
    """The module's engine, on node 2: ``timeout_s`` = ``TIMEOUT_S``, 2 staging pages."""
    e = start_engine(cluster.node_ids[1], model, {
        "model_name": f"tiny-deadline-{os.urandom(4).hex()}", "timeout_s": TIMEOUT_S,
        "load_guard": "off",
        "pool_blocks": 2}, actor_class=DeadlineEngine)
    ready(e)
    yield e
    with contextlib.suppress(Exception):
        ray.get(e.close.remote(), timeout=60)
    ray.kill(e)


def test_a_stopped_node_actor_never_stalls_vllm(cluster, engine):
    node = cluster.node_ids[1]
    e = engine
    pid = ray.get(cluster.node_actors[node].health.remote())["pid"]
    try:
        # Before the first request: the lookup misses at the deadline.
        stop_process(pid)
        try:
            first = bounded(e.generate.remote(prompt(40)), "first request while stopped")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert first["cached"] == 0, first
        lookup = last_lookup(e)
        assert lookup["tokens"] == 0 and waited_one_budget(lookup["seconds"]), lookup
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
        assert lookup["tokens"] == 0 and waited_one_budget(lookup["seconds"]), lookup
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


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "CONTROL-old-return"])
def test_store_calls_past_the_deadline_never_change_what_vllm_computes(cluster, engine, uid,
                                                                       fixed):
    e = engine
    prompts = [prompt(50), prompt(51)] if fixed else [prompt(52), prompt(53)]
    # Runs raykv cannot serve (another cache salt: other keys): computed whole.
    refs = bounded(e.generate_many.remote(prompts, f"ref-{uid}"), "reference run")
    assert [r["cached"] for r in refs] == [0, 0], refs
    saves0 = ray.get(e.worker_stats.remote())[0].counters
    ray.get(e.record_blocks.remote(True))
    ray.get(e.old_return.remote(not fixed))
    try:
        set_store_delay(cluster, DELAY_S)
        try:
            slow = bounded(e.generate_many.remote(prompts), "run with slow store calls")
        finally:
            set_store_delay(cluster, 0)
        time.sleep(DELAY_S)  # every late store call has ended
        saved = ray.get(e.recorded_blocks.remote())["saved"]
        hashes = list(saved)  # both prompts' 7 blocks
        stored = dict(zip(hashes, ray.get(e.stored.remote(hashes)), strict=True))
        saves = ray.get(e.worker_stats.remote())[0].counters
        assert len(hashes) == 14 and saves.save_failed > saves0.save_failed, saves
        assert [s["tokens"] for s in slow] == [r["tokens"] for r in refs], slow
        assert [s["cached"] for s in slow] == [0, 0], slow
        until_probed(e)
        # Every block the store holds is read back by the next loads (per prompt a
        # leading run: the saves after a failed put failed without a store call).
        ray.get(e.record_blocks.remote(True))
        for p in prompts:
            bounded(e.generate.remote(p), "read back")
        loaded = ray.get(e.recorded_blocks.remote())["loaded"]
    finally:
        ray.get([e.old_return.remote(False), e.record_blocks.remote(False)])
    assert any(stored.values()) and set(loaded) == {h for h, s in stored.items() if s}, \
        (stored, list(loaded))
    wrong = sorted(hashes.index(h) for h in loaded if loaded[h] != saved[h])
    if not fixed:
        assert wrong, "CONTROL: the late put stored the bytes it was meant to"
        return
    assert wrong == [], f"blocks {wrong} hold other bytes than vLLM saved"
