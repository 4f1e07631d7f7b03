"""raykv under Ray's real autoscaler (its monitor and the fake multi-node provider: every
worker a real raylet on this machine). A rank on a worker the autoscaler added writes
pages and ends: the autoscaler removes the idle worker within its idle timeout plus the
node actor's idle period and drain, and every page reads back byte-exact from the head
node after (the node actor drained them there before it stopped). Controls: with a node
actor kept on every node (what raykv did before), the worker is never removed; with
drains off, it is removed and its pages are lost.

The head is started with ``ray start --head --autoscaling-config`` on ports of its own and
stopped by its process group, never with ``ray stop`` (which would kill every Ray on the
machine)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from raykv.cache_actors.local_ports import free_port

from tests.integration.test_cli_cluster import ENV, ROOT, raykv

IDLE_TIMEOUT_S = 15.0
"""The autoscaler's ``idle_timeout_minutes`` (0.25)."""
RETIRE_S = 2.0
DRAIN_S = 20.0
WAIT_S = IDLE_TIMEOUT_S + RETIRE_S + DRAIN_S + 60.0
"""How long the worker may take to go: the node actor's idle period, its drain, the
autoscaler's idle timeout, then a margin for a loaded 2-core machine."""
HELD_S = 2 * IDLE_TIMEOUT_S
"""How long the control watches a worker that must stay."""


def config(gcs_address: str) -> dict:
    """An autoscaler config for the fake multi-node provider (Ray 2.60's
    ``AutoscalingCluster`` would read an example file its wheel lacks)."""
    return {
        "cluster_name": "raykv-autoscaler-test", "max_workers": 1, "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_TIMEOUT_S / 60,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "gcs_address": gcs_address},
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {},
                                 "max_workers": 0},
            "raykv.worker": {"resources": {"CPU": 1, "engine_slot": 1}, "node_config": {},
                             "min_workers": 0, "max_workers": 1},
        },
    }


@pytest.fixture(scope="module")
def autoscaled_head(tmp_path_factory):
    from ray._private.services import get_node_ip_address

    tmp_path = tmp_path_factory.mktemp("autoscaled")
    port = free_port()
    address = f"{get_node_ip_address()}:{port}"
    cfg = tmp_path / "autoscaler.json"
    cfg.write_text(json.dumps(config(address)))
    env = ENV | {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    ray_cli = str(Path(sys.executable).parent / "ray")
    with open(tmp_path / "head.log", "w") as log:
        head = subprocess.Popen(
            [ray_cli, "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
             "--include-dashboard=false", "--disable-usage-stats",
             f"--autoscaling-config={cfg}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while subprocess.run([ray_cli, "status", f"--address={address}"], env=ENV,
                         capture_output=True).returncode != 0:
        assert head.poll() is None and time.monotonic() < deadline, "ray head did not start"
        time.sleep(1)
    yield address
    try:
        raykv("down", f"--address={address}", check=False)
    finally:
        stop_cluster(head, address)


def stop_cluster(head: subprocess.Popen, address: str) -> None:
    """Stop the head's process group, then any process of this cluster outside it (the
    fake provider's worker raylets, started by the head's monitor)."""
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
    port = address.rpartition(":")[2].encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read()
        except OSError:
            continue
        if b":" + port in args and int(pid) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def scenario(address: str, uid: str, wait_s: float, *up_args: str) -> dict:
    raykv("up", f"--address={address}", "--segment-size=64M", "--mooncake-host=127.0.0.1",
          f"--retire-idle={RETIRE_S}", f"--drain-timeout={DRAIN_S}", *up_args)
    try:
        out = subprocess.run([sys.executable, "-m", "tests.integration.autoscaler_driver",
                              address, uid, str(wait_s)], cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=wait_s + 300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        raykv("down", f"--address={address}")


def test_the_autoscaler_removes_an_idle_worker_and_its_pages_survive(autoscaled_head, uid):
    got = scenario(autoscaled_head, f"{uid}-drained", WAIT_S)
    assert got["removed_after_s"] is not None, got  # raykv let the node go
    assert got["exact"] and got["read"] == [True] * len(got["read"]), got


def test_control_without_drains_the_worker_goes_and_its_pages_with_it(autoscaled_head, uid):
    lost = scenario(autoscaled_head, f"{uid}-lost", WAIT_S, "--no-drain")
    assert lost["removed_after_s"] is not None, lost
    assert lost["exact"] and not any(lost["read"]), lost


def test_control_a_node_actor_on_every_node_keeps_the_worker(autoscaled_head, uid):
    kept = scenario(autoscaled_head, f"{uid}-kept", HELD_S, "--keep-nodes=all")
    assert kept["removed_after_s"] is None, kept  # raykv before: kept for good
