"""The user's side of test_autoscaler.py, in a process of its own (one that joined an
auth-disabled cluster must not start another): a rank on a worker the autoscaler adds
writes pages and ends; the driver waits for the autoscaler to remove that worker (or
for ``--hold`` seconds), then reads the pages from the head node. Prints one JSON line:
``worker``, ``removed_after_s`` (None: still there), ``read`` (per page: hit or not)
and ``exact`` (every hit byte-exact)."""

import json
import sys
import time

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv.controllers import StorageConfig

from tests.integration.ranks import Rank, indices

PAGES = 16


def alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def main(address: str, uid: str, wait_s: float) -> None:
    ray.init(address=address, namespace="autoscaler-test", log_to_driver=False)
    head = ray.get_runtime_context().get_node_id()
    keys = [f"{uid}-{i}" for i in range(PAGES)]
    writer = Rank.options(resources={"engine_slot": 1}).remote(StorageConfig())
    worker = ray.get(writer.node_id.remote(), timeout=180)  # the autoscaler adds it
    assert worker != head
    ray.get(writer.fill.remote(7))
    assert ray.get(writer.call.remote("batch_set_v1", keys, indices(0, PAGES))) == [True] * PAGES
    wrote = ray.get(writer.pages.remote(0, PAGES))
    ray.kill(writer)
    ended = time.monotonic()
    while alive(worker) and time.monotonic() - ended < wait_s:
        time.sleep(0.5)
    removed = None if alive(worker) else round(time.monotonic() - ended, 1)
    reader = Rank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        head, soft=False)).remote(StorageConfig())
    read = ray.get(reader.call.remote("batch_get_v1", keys, indices(0, PAGES)))
    got = ray.get(reader.pages.remote(0, PAGES))
    exact = all(torch.equal(got[:, 4 * p:4 * p + 4], wrote[:, 4 * p:4 * p + 4])
                for p, ok in enumerate(read) if ok)
    print(json.dumps({"worker": worker, "removed_after_s": removed, "read": read,
                      "exact": exact}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
