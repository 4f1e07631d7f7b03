"""The premise of confirmed pages (``controllers.confirmed_pages``), on a real
``mooncake_master``: an object that ``batch_is_exist`` reported present is leased, so
the store's eviction does not take it before the lease ends, while it takes objects
nobody asked about."""

import time

import torch
from mooncake.store import MooncakeDistributedStore
from raykv.clusters.mooncake_master import MooncakeMaster, lease_ttl_s
from raykv.controllers.pool_layout import MiB

LEASE = ["-default_kv_lease_ttl=6000"]


def test_objects_reported_present_outlive_eviction_during_their_lease(uid):
    master = MooncakeMaster("127.0.0.1", extra_args=LEASE).start()
    store = MooncakeDistributedStore()
    try:
        assert store.setup("127.0.0.1", master.metadata_server, 16 * MiB, 16 * MiB, "tcp", "",
                           master.master_address) == 0
        buf = torch.ones(MiB, dtype=torch.uint8)
        assert store.register_buffer(buf.data_ptr(), MiB) == 0

        def put(keys):
            return store.batch_put_from(keys, [buf.data_ptr()] * len(keys),
                                        [MiB // 2] * len(keys))

        old = [f"{uid}-old-{i}" for i in range(28)]  # 14 MiB of a 16 MiB segment
        assert put(old) == [0] * 28
        asked = old[:14]
        start = time.monotonic()
        assert store.batch_is_exist(asked) == [1] * 14
        # Keep writing (10 MiB and more) until the store evicts to make room; Mooncake
        # evicts in the background, so give it until half the lease.
        i = 0
        while time.monotonic() - start < lease_ttl_s(LEASE) / 2:
            put([f"{uid}-new-{i}"])
            i += 1
            if i >= 20 and 0 in store.batch_is_exist(old[14:]):
                break
            time.sleep(0.05)
        survived = store.batch_is_exist(old)
        elapsed = time.monotonic() - start
        assert elapsed < lease_ttl_s(LEASE), f"took {elapsed:.1f} s: the lease ran out"
        assert survived[:14] == [1] * 14, survived      # leased: every one kept
        assert 0 in survived[14:], survived              # the others were evicted
    finally:
        store.close()
        master.stop()
