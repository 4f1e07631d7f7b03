"""Engine processes joining Ray (``integrations.ray_join.join_ray``) against a real Ray.

Engines seed Python's ``random`` alike in every process (vLLM and SGLang do), and
``ray.init`` draws its GCS subscriber ids from it: before ``join_ray`` reseeded for
``ray.init``, every engine process of a cluster subscribed to Ray's error channel under
one id, and the GCS answered each long poll at once to serve the next one (thousands
of polls a second, a busy core). The GCS's own counters tell: it prints how many polls
it served (``event_stats_print_interval_ms``). Control: two seeded processes joining
with a plain ``ray.init`` (what ``join_ray`` did) make the GCS spin.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHILD = """
import random, sys, time
random.seed(0)
expected = random.Random(0).random()
if sys.argv[2] == "join_ray":
    from raykv.integrations.ray_join import join_ray
    join_ray(sys.argv[1], "raykv-test-join")
else:
    import ray
    ray.init(address=sys.argv[1], log_to_driver=False)
print("untouched" if random.random() == expected else "drawn", flush=True)
time.sleep(300)
"""
WINDOW_S = 3.0


@pytest.fixture(scope="module")
def ray_head():
    """A one-node Ray whose GCS prints its handlers' counts every half second:
    ``(GCS address, session dir)``."""
    import ray
    from raykv.clusters import ray_auth

    ray_auth.settle()
    # "local": a Ray of its own, never one that `ray start` left running (another test's
    # `raykv up`), which ray.init without an address would join
    ctx = ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
                   _system_config={"event_stats_print_interval_ms": 500})
    try:
        yield ctx.address_info["gcs_address"], Path(ctx.address_info["session_dir"])
    finally:
        ray.shutdown()


def _polls_served(session: Path) -> int:
    """The GCS's count of subscriber polls served so far (its last printed stats)."""
    text = (session / "logs" / "gcs_server.out").read_text(errors="replace")
    counts = re.findall(r"GcsSubscriberPoll - (\d+) total", text)
    return int(counts[-1]) if counts else 0


def _polls_while_joined(ray_head, how: str) -> tuple[int, list[str]]:
    """Two processes that seed ``random`` alike join Ray ``how``; the polls the GCS
    served in ``WINDOW_S`` s while both sat idle, and what each said of its ``random``."""
    address, session = ray_head
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, address, how],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        said = [p.stdout.readline().strip() for p in procs]
        time.sleep(1.0)  # both subscribed and polling
        before = _polls_served(session)
        time.sleep(WINDOW_S)
        time.sleep(1.0)  # the GCS printed its counts at least once since
        return _polls_served(session) - before, said
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_seeded_engine_processes_join_without_sharing_a_subscriber(ray_head):
    polls, said = _polls_while_joined(ray_head, "join_ray")
    assert said == ["untouched", "untouched"]  # joining drew nothing from the seeded stream
    assert polls < 100, f"the GCS served {polls} polls in {WINDOW_S} s of idle processes"


def test_control_plain_ray_init_from_seeded_processes_makes_the_gcs_spin(ray_head):
    polls, said = _polls_while_joined(ray_head, "ray.init")
    assert said == ["drawn", "drawn"]
    assert polls > 1000, f"only {polls} polls: the control no longer shows the loop"
