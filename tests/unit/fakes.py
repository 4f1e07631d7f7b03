"""Stand-ins shared by the unit tests: one fake per Protocol of the product
(``FakeBackend``: ``StoreBackend``; ``FakeMemory``: ``PoolMemory``; ``FakeRoute``:
``NodeRoute``), each kept in step with its Protocol by tests/unit/test_protocol_fakes.py,
smaller stand-ins of the node actor's other parts, and a node actor's stats
(``node_stats``) for what reads them."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import threading
import uuid
from dataclasses import dataclass, replace
from itertools import count
from typing import Any

from raykv.cache_actors.data_ops import DataOp
from raykv.cache_actors.host_pools import HostPool, PoolHandle
from raykv.cache_actors.node.pool_memory import PoolBudget
from raykv.cache_actors.shared_memory import unlink_shm_file
from raykv.controllers.contract import PoolTransferResult
from raykv.controllers.deployments import Registration
from raykv.controllers.keys import KeyScheme
from raykv.controllers.node_records import (
    GroupQueryStats,
    L2EvictionStats,
    L2Stats,
    LoadStats,
    MergedCallStats,
    NodeStats,
    RateView,
    ResidencyStats,
    TenantUse,
    WarmupStats,
)
from raykv.controllers.owner_sessions import Challenges
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.result_codes import ALREADY_PRESENT, EXISTS, OBJECT_NOT_FOUND

IDLE_RATE = RateView(mb_per_s=None, fixed_ms=0.0, samples=0)
IDLE_NODE = NodeStats(
    mode="embedded", host_pool_bytes=0, host_pool_used=0, exposed_ports=[],
    mooncake_endpoint="10.0.0.1:15000", own_segment=None, node_id="n" * 56, uptime_s=1.0,
    global_segment_size=1 << 30, pools={}, tenants={}, untenanted=TenantUse(),
    counters={}, group_queries=GroupQueryStats(0, 0, 0, 0, 0, 0, 0.0), confirmed_pages=0,
    merged_calls=MergedCallStats(0, 0, 0),
    l2=L2Stats(l2_bytes=0, used=0, pools={}, filled=0, fill_failed=0, warmed=0,
               warm_failed=0, l3_put_submitted=0, l3_put=0, l3_put_retried=0,
               l3_put_failed=0, l3_put_pending=0),
    warnings=[], residency=ResidencyStats(0, 0, 0, 0, 0.0),
    warmup=WarmupStats(warm_bytes=0, warm_s=0.0, pages=0, bytes=0, running=0, warmups={}),
    l2_evictions=L2EvictionStats(0, 0),
    loads=LoadStats(links={}, l3_disk=IDLE_RATE, overall=IDLE_RATE, queue_wait_s=0.0,
                    located_keys=0))
"""A node actor's stats with nothing counted: an embedded node, 1 GiB segment, no pools."""


def node_stats(**fields: Any) -> NodeStats:
    """``IDLE_NODE`` with ``fields`` over it (what ``raykv status`` and its rates read)."""
    return replace(IDLE_NODE, **fields)


class Counts:
    """Counts what ``GroupQueries`` and ``TransferMerger`` report, as ``NodeMetrics``
    does (``record_group_query``, ``record_group_store_call``, ``record_merged_call``),
    without Ray: group queries by how they were answered (``recent``, ``inflight``,
    ``confirmed``, ``looked_up``) and their ``store_calls``; merged ``calls``, the
    ``batches`` they carried and the ``largest`` call."""

    def __init__(self) -> None:
        self.recent = self.inflight = self.confirmed = self.looked_up = 0
        self.store_calls = 0
        self.calls = self.batches = self.largest = 0

    def record_group_query(self, how: str) -> None:
        setattr(self, how, getattr(self, how) + 1)

    def record_group_store_call(self, seconds: float) -> None:
        self.store_calls += 1

    def record_merged_call(self, batches: int) -> None:
        self.calls += 1
        self.batches += batches
        self.largest = max(self.largest, batches)


class FakeBackend:
    """A ``StoreBackend`` over a dict of object sizes (no byte moves: pointers may be
    made up). Put-if-absent; a get reads an object's size, or misses; a lookup answers
    from ``objects`` unless ``exists_codes`` holds queued answers (one per call, for
    probes); ``during`` runs once inside the next put or get (a race); ``registered``
    holds the registered pointers (unregistering one that is not is a bug: KeyError);
    ``alloc`` hands out memfd mappings as the dummy client does."""

    def __init__(self, objects: dict[str, int] | None = None) -> None:
        self.objects: dict[str, int] = dict(objects or {})
        self.registered: set[int] = set()
        self.removed: list[str] = []
        self.probes: list[list[str]] = []
        self.exists_codes: list[int] = []
        self.during = None
        self.health = 0
        self.closed = False
        self.own_segment: str | None = "10.213.0.2:12345"
        self.prefers_own = True
        self.can_locate = True
        self.steered: str | None = None
        self.moves: list[tuple[str, str, str]] = []  # started: (key, source, target)
        self.move_states: dict[int, str] = {}  # task -> state ("done" when not set)
        self._maps: list[tuple[int, mmap.mmap]] = []

    def _race(self) -> None:
        if self.during is not None:
            self.during, during = None, self.during
            during()

    def exists(self, keys: list[str]) -> list[int]:
        self.probes.append(list(keys))
        if self.exists_codes:
            return [self.exists_codes.pop(0) for _ in keys]
        return [EXISTS if k in self.objects else 0 for k in keys]

    def put(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self._race()
        codes = [ALREADY_PRESENT if k in self.objects else 0 for k in keys]
        for k, s in zip(keys, sizes, strict=True):
            self.objects.setdefault(k, s)
        return codes

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self._race()
        return [s if k in self.objects else OBJECT_NOT_FOUND
                for k, s in zip(keys, sizes, strict=True)]

    def remove(self, keys: list[str]) -> list[int]:
        self.removed += keys
        return [0 if self.objects.pop(k, None) is not None else OBJECT_NOT_FOUND
                for k in keys]

    def remove_matching(self, pattern: str) -> int:
        return len(self.remove([k for k in self.objects if re.fullmatch(pattern, k)]))

    def remove_unleased(self, key: str) -> int:
        return self.remove([key])[0]

    def put_bytes(self, key: str, data: bytes) -> int:
        self.objects[key] = len(data)
        return 0

    def alloc(self, nbytes: int) -> int:
        fd = os.memfd_create("raykv-test-pool")
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
        self._maps.append((fd, mm))  # kept open and mapped, as the dummy client does
        return ctypes.addressof(ctypes.c_char.from_buffer(mm))

    def register(self, ptr: int, nbytes: int) -> None:
        self.registered.add(ptr)

    def unregister(self, ptr: int) -> None:
        self.registered.remove(ptr)

    def healthy(self) -> bool:
        return self.health == 0

    def endpoint(self) -> str:
        return "10.213.0.2:12345"

    def locate(self, keys: list[str]) -> list[tuple[str, ...]] | None:
        """Every object present lies on this node's own segment."""
        return [(self.own_segment,) if k in self.objects else () for k in keys]

    def steer(self, segment: str | None) -> None:
        self.steered, self.prefers_own = segment, segment is None

    def start_move(self, key: str, source: str, target: str) -> tuple[object, int]:
        """A task per move of a present object (its id: the count of moves started)."""
        if key not in self.objects:
            return None, OBJECT_NOT_FOUND
        self.moves.append((key, source, target))
        return len(self.moves), 0

    def move_state(self, task: object) -> str:
        return self.move_states.get(task, "done")

    def tier_stats(self) -> None:
        """No seals: a fake store has no disk tier."""
        return None

    def close(self) -> None:
        self.closed = True


@dataclass
class FakePool:
    """A pool of ``FakeMemory``: a handle and a made-up base address, nothing mapped."""

    handle: PoolHandle
    base_ptr: int

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def nbytes(self) -> int:
        return self.handle.layout.nbytes

    def check(self) -> None:
        """Fake memory never shrinks."""


class FakeMemory:
    """A ``PoolMemory`` of made-up addresses, standalone-like: a new epoch per
    ``renew``; ``create`` may be held at ``gate`` (``creating`` is set on entry)."""

    mode = "standalone"

    def __init__(self) -> None:
        self.epoch = 1
        self.budget = PoolBudget(0)
        self.gate = threading.Event()
        self.gate.set()
        self.creating = threading.Event()
        self._addresses = count(1 << 20, 1 << 12)

    def create(self, name: str, layout: PoolLayout) -> FakePool:
        self.creating.set()
        self.gate.wait()
        self.budget.reserve(name, layout.nbytes)
        return FakePool(PoolHandle(name, f"fake-{name}", layout, self.epoch),
                        next(self._addresses))

    def readopt(self, handle: PoolHandle) -> FakePool:
        return self.create(handle.name, handle.layout)

    def release(self, pool: FakePool, remove: bool = True) -> None:
        self.budget.release(pool.nbytes)

    def renew(self) -> None:
        self.epoch += 1


class FakeRoute:
    """A ``NodeRoute`` (made as ``NodeLink`` is, so a test may put it in its place):
    control calls make and find real shared-memory pools; data ops are recorded in
    ``data_ops`` and answered (every object exists, is stored, is read in full; a group
    query: ``HIT``); controller calls are recorded in ``asked``, registrations in
    ``registered`` (their proofs in ``proofs``, over ``challenges``), answered with
    deployment ``DEPLOYMENT`` at home node ``HOME``, a new version each; control calls
    of a named node's actor in ``asked_at``, routes opened in ``prepared``; ``bounds`` holds
    each ``bounded`` block (call, seconds), ``register_depths`` how many were open at
    each registration. ``made``: every route made, the latest last."""

    DEPLOYMENT = "org"
    HOME = "h" * 40
    HIT = PoolTransferResult(kv_hit_pages=1, restorable_prefix_pages=[0, 1])
    made: list[FakeRoute] = []

    def __init__(self, node_id: str = "n" * 40, namespace: str = "raykv", remap=None,
                 timeout_s: float = 5.0, owner=None) -> None:
        self.node_id, self.namespace, self.timeout_s = node_id, namespace, timeout_s
        self.owner = owner
        self.remap = remap
        self.stale = False
        self.controller_attached = False
        self.calls: list[tuple] = []
        self.data_ops: list[tuple] = []
        self.asked: list[tuple] = []
        self.asked_at: list[tuple] = []
        self.prepared: list[str] = []
        self.registered: list[tuple] = []
        self.proofs: list[object] = []
        self.challenges = Challenges()  # the controller's
        self.bounds: list[tuple[str, float]] = []
        self.depth = 0
        self.register_depths: list[int] = []
        self.handles: dict[str, PoolHandle] = {}
        self.mode = "embedded"
        FakeRoute.made.append(self)

    def call(self, method: str, *args, **kwargs):
        self.calls.append((method, *args))
        if method == "create_pool":
            name, layout = args[:2]
            handle = PoolHandle(name, f"raykv-test-{uuid.uuid4().hex[:12]}", layout)
            HostPool.create(handle).close()
            self.handles[name] = handle
            return handle
        if method == "get_pool":
            return self.handles[args[0]]
        if method == "health":
            return {"mode": self.mode}
        if method == "stats":
            return {"counters": {}}
        raise AssertionError(f"unexpected control call {method}")

    def ask(self, method: str, *args, **kwargs):
        return self.call(method, *args, **kwargs)

    def claim(self, node_id: str | None, method: str, *args):
        return None if self.owner is None else self.owner.base

    @contextlib.contextmanager
    def bounded(self, limit_s: float, what: str):
        self.bounds.append((what, limit_s))
        self.depth += 1
        try:
            yield limit_s
        finally:
            self.depth -= 1

    def data(self, op: DataOp, *args, node_id: str | None = None):
        self.data_ops.append((op, node_id, *args))
        if op == DataOp.EXISTS:
            return [EXISTS] * len(args[0])
        if op == DataOp.PUT:
            return [0] * len(args[0])
        if op == DataOp.GET:
            return list(args[0].sizes)
        return self.HIT

    def ask_at(self, node_id: str, method: str, *args):
        self.asked_at.append((node_id, method, *args))

    def prepare(self, node_id: str) -> None:
        self.prepared.append(node_id)

    def ask_controller(self, method: str, *args):
        self.asked.append((method, *args))
        if method == "challenge":
            return self.challenges.issue()
        assert method == "register_rank"
        config, specs, node_id, proof = args
        self.registered.append((config, specs, node_id))
        self.register_depths.append(self.depth)
        self.proofs.append(proof)
        self.controller_attached = True
        return Registration(self.DEPLOYMENT, KeyScheme.from_config(config), self.HOME,
                            len(self.registered))

    def close(self) -> None:
        for handle in self.handles.values():
            unlink_shm_file(handle.path)


@dataclass
class ShmStore:
    """A ``NodeStore`` of embedded mode for ``NodePools``: real ``/dev/shm`` pool memory
    (a ``ShmPoolMemory``), registrations only remembered."""

    memory: Any
    backend: FakeBackend
    mode: str = "embedded"

    def before_call(self) -> int:
        return 0


class ServiceStore:
    """The calls a ``NodeService`` makes on its ``NodeStore`` beyond ``memory`` and
    ``backend`` (which a subclass sets, with ``mode``): epochs pass through, codes come
    back as they are, the supervisor's re-allocation hook is kept as ``reallocate``."""

    process = None

    def before_call(self) -> int:
        return self.memory.epoch

    def after_call(self, epoch: int, codes: list[int]) -> list[int]:
        return codes

    def supervise(self, reallocate) -> None:
        self.reallocate = reallocate

    def close(self) -> None:
        pass


class NoMetrics:
    """``NodeMetrics`` as a ``NodeService`` calls it, recording nothing."""

    def record_move(self, *args) -> None:
        pass

    def record_exists(self, *args) -> None:
        pass

    def pool_size(self, name: str, nbytes: int, owner=None) -> None:
        pass

    def watch_l2(self, counters) -> None:
        pass

    def record_group_store_call(self, seconds: float) -> None:
        pass

    def record_group_query(self, how: str) -> None:
        pass

    def record_deployment_fetch(self) -> None:
        pass

    def record_merged_call(self, batches: int) -> None:
        pass

    def close(self) -> None:
        pass


class FakeDistributedStore:
    """``mooncake.store.MooncakeDistributedStore`` (the ``fake_mooncake`` fixture puts it
    in place): ``setup`` records its arguments and answers ``rc``; ``setup_dummy``
    answers each of ``dummy_rcs`` in turn."""

    rc = 0
    dummy_rcs: list[int] = []
    made: list[FakeDistributedStore] = []

    def __init__(self) -> None:
        self.args: tuple = ()
        FakeDistributedStore.made.append(self)

    def setup(self, *args) -> int:
        self.args = args
        return FakeDistributedStore.rc

    def setup_dummy(self, *args) -> int:
        self.args = args
        return FakeDistributedStore.dummy_rcs.pop(0)

    def get_hostname(self) -> str:
        return f"{self.args[0]}:12345"


class FakeReplicateConfig:
    preferred_segment = ""
