"""Test helpers: the processes a cluster runs, and waiting on a restart."""

import os
import time

import ray
from raykv import NodeUnavailableError


def running_clients(cluster) -> set[int]:
    """Pids of this cluster's mooncake_client processes that run (zombies excluded)."""
    flag = f"-master_server_address={cluster.master_address}".encode()
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if flag in args and state != "Z":
            pids.add(int(pid))
    return pids


def wait_for(check, what: str, timeout_s: float = 90.0):
    """``check()`` until it returns a truthy value; retryable errors count as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            out = check()
            if out:
                return out
        except (NodeUnavailableError, ray.exceptions.RayActorError):
            pass
        assert time.monotonic() < deadline, f"{what} did not happen"
        time.sleep(0.5)
