"""raykv's worker side in the loop of vLLM's scheduler tests (runs in the vLLM peer
run, imported by ``vllm_plugin``).

vLLM's scheduler tests drive a real ``Scheduler`` and hand it scripted model outputs
(``update_from_output``), with no worker. ``WorkerLoop`` is the worker those steps lack,
for a scheduler whose connector is raykv's: before each scripted output reaches the
scheduler, it runs the step's connector metadata through a worker-role
``RayKVConnector`` over a KV cache tensor of this process, as vLLM's model runner calls
it (bind, ``start_load_kv``, the forward, ``wait_for_save``,
``get_block_ids_with_load_errors``), with a stand-in forward: each token's KV is a pure
function of its token and of the KV of every earlier token of its request, read through
the request's block table as attention reads it (``expected_kv``). So KV computed over a
block that holds the wrong values is wrong, and so is every later token's.

What it checks (an ``AssertionError`` fails the test that drove the step):

- blocks raykv loads hold the KV their request's tokens give;
- raykv reports every block the test scripts as failed (``invalid_block_ids``): those
  loads are made to fail in raykv's client, their blocks left holding stale values, as
  after a read that did not complete;
- ``check_store``, after the test: every object raykv holds for a request the test ran
  holds that request's right KV (a block computed over a failed load must never stay
  stored).

``seed`` makes raykv hold a request's blocks (written by a second worker-role connector,
the seeder), so that raykv's own hit query gives what a test scripts for it.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial

import torch
from vllm_world import MOD, expected_kv, kv_of  # this file's folder

STALE = float(MOD + 1)  # what a block whose load failed holds (no forward writes it)
SEEDER_BLOCKS = 128
SEED_S = 60.0


def page_hashes(request, block_size: int) -> list[str]:
    """raykv's keys (page hashes, hex) of every full block of ``request`` so far."""
    from raykv.integrations.vllm.page_hash import PageHashChain
    from raykv.integrations.vllm.request_blocks import hash_hex
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    chain = PageHashChain(block_size)
    hashes = chain.extend(request.all_token_ids, request.num_tokens,
                          partial(generate_block_hash_extra_keys, request))
    return [hash_hex(h) for h in hashes]


def _kv_config(num_blocks: int, block_size: int):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))])


class _Worker:
    """A worker-role connector (class ``connector_cls``) of ``vllm_config`` over a KV
    tensor of ``num_blocks`` blocks in vLLM's CPU layout ``(blocks, heads, block_size,
    2 * head_size)``."""

    def __init__(self, connector_cls, vllm_config, num_blocks: int) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        bs = vllm_config.cache_config.block_size
        self.block_size = bs
        self.connector = connector_cls(vllm_config, KVConnectorRole.WORKER,
                                       _kv_config(num_blocks, bs))
        self.kv = torch.zeros(num_blocks, 1, bs, 2)
        self.connector.register_kv_caches({"layer": self.kv})

    def values(self, block: int) -> list[int]:
        return [int(v) for v in self.kv[block, 0, :, 0]]

    def step(self, meta, forward=None) -> set[int]:
        """One model-runner step of ``meta`` (raykv's connector metadata); the blocks
        the connector reports as not loaded."""
        from vllm.config import set_current_vllm_config

        c = self.connector
        c.bind_connector_metadata(meta)
        try:
            with set_current_vllm_config(c._vllm_config):
                c.start_load_kv(None)
                if forward is not None:
                    forward()
                c.wait_for_save()
            return c.get_block_ids_with_load_errors()
        finally:
            c.clear_connector_metadata()

    def close(self) -> None:
        self.connector.shutdown()


class WorkerLoop:
    """The worker of one scheduler whose connector (scheduler role) is ``connector``."""

    def __init__(self, connector) -> None:
        cfg = connector._vllm_config
        self.connector_cls = type(connector)
        self.block_size = cfg.cache_config.block_size
        self.worker = _Worker(self.connector_cls, cfg, connector._kv_cache_config.num_blocks)
        self.seeder = _Worker(self.connector_cls, cfg, SEEDER_BLOCKS)
        self.requests: dict[str, object] = {}  # every request seen, by id
        self.steps: set[int] = set()  # id() of the scheduler outputs run

    # -- seeding ------------------------------------------------------------------
    def seed(self, request, first: int, n: int) -> None:
        """Make raykv hold blocks ``first .. first + n - 1`` of ``request``, with the
        KV its tokens give."""
        from raykv.integrations.vllm.metadata import RayKVConnectorMetadata
        from raykv.integrations.vllm.request_blocks import BlockTransfer

        self.requests[request.request_id] = request
        bs = self.block_size
        want = expected_kv(list(request.all_token_ids))
        keys = page_hashes(request, bs)
        for lo in range(first, first + n, SEEDER_BLOCKS):
            ids = list(range(min(SEEDER_BLOCKS, first + n - lo)))
            for slot, j in enumerate(range(lo, lo + len(ids))):
                self.seeder.kv[slot, 0, :, 0] = torch.tensor(want[j * bs:(j + 1) * bs],
                                                            dtype=torch.float32)
            meta = RayKVConnectorMetadata()
            meta.saves.append(BlockTransfer(request.request_id, ids, keys[lo:lo + len(ids)]))
            self._seed_step(meta)

    def _seed_step(self, meta) -> None:
        """Run the seeder's step of ``meta`` (saves only) until none of its saves fails:
        seeding sets a test up, so a save that failed on a loaded machine (its deadline,
        then the breaker's back-off) is made again, for up to ``SEED_S`` s (a put of
        blocks raykv holds already keeps them)."""
        stats = self.seeder.connector.stats
        deadline = time.monotonic() + SEED_S
        while True:
            failed = stats.save_failed
            self.seeder.step(meta)
            if stats.save_failed == failed:
                return
            assert time.monotonic() < deadline, \
                f"raykv did not store the seeded blocks in {SEED_S:g} s ({stats})"
            time.sleep(1.0)

    # -- one step -----------------------------------------------------------------
    def run(self, scheduler, out, scripted_invalid: set[int]) -> None:
        """The worker's part of scheduler output ``out`` (once per output), the loads
        of ``scripted_invalid`` blocks failing."""
        from raykv.integrations.vllm.metadata import RayKVConnectorMetadata

        meta = out.kv_connector_metadata
        if id(out) in self.steps or not isinstance(meta, RayKVConnectorMetadata):
            return
        self.steps.add(id(out))
        for r in out.scheduled_new_reqs:
            self.requests[r.req_id] = scheduler.requests[r.req_id]
        loaded = {b: x.req_id for x in meta.loads for b in x.block_ids}
        failing = {h for x in meta.loads for b, h in zip(x.block_ids, x.hashes, strict=True)
                   if b in scripted_invalid}
        with self._failing(failing):
            reported = self.worker.step(meta, partial(self._forward, scheduler, out))
        self._check_loaded(meta, reported)
        missing = scripted_invalid & (set(loaded) - reported)
        assert not missing, (f"vLLM's test scripts the loads of blocks {sorted(missing)} as "
                             f"failed; raykv reported only {sorted(reported)}")
        assert reported <= set(loaded), \
            f"raykv reports blocks {sorted(reported - set(loaded))} it did not load"

    def _check_loaded(self, meta, failed: set[int]) -> None:
        """Every block raykv loaded (reported no error for) holds its right KV (the
        forward writes only the positions it computes, never a loaded block)."""
        bs = self.block_size
        for x in meta.loads:
            req = self.requests[x.req_id]
            keys = page_hashes(req, bs)
            want = expected_kv(list(req.all_token_ids))
            for b, h in zip(x.block_ids, x.hashes, strict=True):
                if b in failed:
                    continue
                j = keys.index(h)
                assert self.worker.values(b) == want[j * bs:(j + 1) * bs], \
                    f"request {x.req_id}: block {j} loaded from raykv holds the wrong KV"

    def _forward(self, scheduler, out) -> None:
        """The stand-in forward of every scheduled request's tokens (see the module)."""
        bs, kv = self.block_size, self.worker.kv
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts |= dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for rid, start in starts.items():
            req = scheduler.requests.get(rid)
            if req is None:
                continue
            self.requests[rid] = req
            (table,) = scheduler.kv_cache_manager.get_block_ids(rid)
            tokens = list(req.all_token_ids)
            end = min(start + out.num_scheduled_tokens.get(rid, 0), len(tokens),
                      len(table) * bs)
            pos = torch.arange(start)
            slots = torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs
            total = int(kv.view(-1, 2)[slots, 0].double().sum())
            for p in range(start, end):
                v = kv_of(total, tokens[p])
                kv[table[p // bs], 0, p % bs, 0] = v
                total += v

    def _failing(self, keys: set[str]) -> contextlib.AbstractContextManager[None]:
        """Within: the worker's raykv reads of ``keys`` fail and leave their blocks
        holding ``STALE``, as a read that did not complete."""
        from vllm_world import failing_reads  # this file's folder

        client = self.worker.connector.connector_worker._cache()
        return failing_reads(client, keys, self.block_size, self.worker.kv, STALE)

    # -- after the test -----------------------------------------------------------
    def check_store(self) -> None:
        """Every object raykv holds for a request this loop saw holds the KV of that
        request's tokens (read back one block per transfer through the seeder)."""
        from raykv.integrations.vllm.metadata import RayKVConnectorMetadata
        from raykv.integrations.vllm.request_blocks import BlockTransfer

        bs, bad = self.block_size, []
        for rid, req in self.requests.items():
            keys = page_hashes(req, bs)
            want = expected_kv(list(req.all_token_ids))
            for lo in range(0, len(keys), SEEDER_BLOCKS):
                idx = range(lo, min(lo + SEEDER_BLOCKS, len(keys)))
                meta = RayKVConnectorMetadata()
                for slot, j in enumerate(idx):
                    self.seeder.kv[slot] = STALE
                    meta.loads.append(BlockTransfer(rid, [slot], [keys[j]]))
                missed = self.seeder.step(meta)
                for slot, j in enumerate(idx):
                    if slot in missed:
                        continue  # raykv holds no such object
                    got = self.seeder.values(slot)
                    if got != want[j * bs:(j + 1) * bs]:
                        wrong = sum(a != b for a, b in zip(got, want[j * bs:], strict=False))
                        bad.append(f"request {rid} block {j}: {wrong} of {bs} positions")
        assert not bad, ("raykv stores blocks with the wrong KV (computed over a failed "
                         "load?): " + "; ".join(bad))

    def close(self) -> None:
        self.worker.close()
        self.seeder.close()
