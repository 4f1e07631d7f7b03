"""A user's rank on a `raykv up` cluster, in a process of its own, for the master restart
test: ``python -m tests.integration.master_restart_rank ADDRESS UID``. It writes four
pages and reads them back, prints ``written``, then waits for a line on stdin (the test
restarts the master meanwhile) and makes data calls again: gets of the old pages (each
a miss or exact bytes), then puts of four new pages until all are stored (the store
takes them again once this node's segment is mounted on the new master) and gets of
them; it prints one JSON line of what it saw."""

import json
import sys
import time

import ray
import torch
from raykv import CacheClient, StorageConfig

from tests.integration.ranks import MHA, indices

PAGES = 4
PUT_WAIT_S = 120.0


def main(address: str, uid: str) -> None:
    ray.init(address=address, namespace="raykv", log_to_driver=False)
    client = CacheClient(StorageConfig(model_name=f"master/{uid}"))
    pool = client.create_host_pool("mha", name=f"m{uid}", **MHA)
    client.register_mem_pool_host(pool)
    buf = pool.kv_buffer  # MHA: (2, slots, layers, heads, dim); a page is 4 slots
    buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(1)).half())

    def slots(start: int) -> torch.Tensor:
        return buf[:, start:start + PAGES * 4].clone()

    def read(keys: list[str], src: int, dst: int) -> tuple[list[bool], int]:
        """Get ``keys`` into the slots from ``dst`` (zeroed first); the results and how
        many pages reported got differ from the pages written from ``src``."""
        buf[:, dst:dst + PAGES * 4] = 0
        got = client.batch_get_v1(keys, indices(dst, PAGES))
        wrong = sum(ok and not torch.equal(buf[:, dst + 4 * i:dst + 4 * i + 4],
                                           buf[:, src + 4 * i:src + 4 * i + 4])
                    for i, ok in enumerate(got))
        return got, wrong

    old = [f"{uid}-old-{i}" for i in range(PAGES)]
    assert client.batch_set_v1(old, indices(0, PAGES)) == [True] * PAGES
    assert read(old, 0, 32) == ([True] * PAGES, 0)
    written = slots(0)
    print("written", flush=True)
    sys.stdin.readline()

    old_got, old_wrong = read(old, 0, 32)
    assert torch.equal(slots(0), written)
    new = [f"{uid}-new-{i}" for i in range(PAGES)]
    tries, deadline = 0, time.monotonic() + PUT_WAIT_S
    while True:
        tries += 1
        if client.batch_set_v1(new, indices(16, PAGES)) == [True] * PAGES \
                or time.monotonic() > deadline:
            break
        time.sleep(1)
    new_got, new_wrong = read(new, 16, 48)
    print(json.dumps({"old_got": old_got, "old_wrong": old_wrong, "put_tries": tries,
                      "new_got": new_got, "new_wrong": new_wrong}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
