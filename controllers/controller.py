"""``CacheController``: the one global, detached, named actor of a raykv cluster.

It is off the byte path. It records where the store is and which node actors serve
which Ray nodes, keeps the deployments (their TP/PP groups and pools) and hands each
rank its key plan, and answers *group* existence queries: one ``batch_is_exist`` over
every rank's and pool's objects, intersected into one ``PoolTransferResult`` that every
rank of the group receives identically (queries for the same keys within
``group_window_s`` share one answer), so ranks never need an all-reduce and can never
disagree. Its registry is checkpointed to the GCS internal KV on every change; a
restarted controller resumes from it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import ray
from ray.experimental import internal_kv
from ray.util import metrics

from controllers.contract import PoolTransferResult, StorageConfig
from controllers.deployments import (
    Deployment,
    DeploymentRegistry,
    PoolQuery,
    PoolSpec,
    group_hits,
    group_objects,
)
from controllers.keys import KeyPlan
from controllers.naming import node_actor_name

log = logging.getLogger(__name__)


def checkpoint_key(namespace: str) -> str:
    return f"raykv/{namespace}/controller"


@ray.remote(num_cpus=0, max_restarts=-1)
class CacheController:
    """Registry of store addresses, node actors and deployments; group hit queries.

    ``exists_backend`` is a zero-argument callable returning an object with
    ``exists(keys) -> list[int]`` (1 / 0 / negative per key), e.g. a pure-consumer
    Mooncake client; it is called once, at start.
    """

    def __init__(self, info: dict, namespace: str, exists_backend: Callable[[], object],
                 group_window_s: float = 2.0) -> None:
        self._info = dict(info)
        self._namespace = namespace
        self._nodes: dict[str, str] = {}
        self._registry = DeploymentRegistry()
        self._window = group_window_s
        self._recent: OrderedDict[tuple, tuple[float, PoolTransferResult]] = OrderedDict()
        self._inflight: dict[tuple, asyncio.Future] = {}
        self._pending: list[tuple] = []
        self._draining = False
        self._executor = ThreadPoolExecutor(2, thread_name_prefix="raykv-group")
        self._store = exists_backend()
        self._queries = metrics.Counter("raykv_group_queries", "Group existence queries",
                                        tag_keys=("shared",))
        self._latency = metrics.Histogram(
            "raykv_group_exists_seconds", "Latency of group existence checks in the store",
            boundaries=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1])
        self._hit_pages = metrics.Counter("raykv_group_hit_pages", "Pages hit by group queries",
                                          tag_keys=("deployment",))
        self._restore()

    # ------------------------------------------------------------ checkpoint
    def _save(self) -> None:
        state = {"info": self._info, "nodes": self._nodes,
                 "deployments": [d.to_dict() for d in self._registry.deployments.values()]}
        internal_kv._internal_kv_put(checkpoint_key(self._namespace), json.dumps(state),
                                     overwrite=True)

    def _restore(self) -> None:
        raw = internal_kv._internal_kv_get(checkpoint_key(self._namespace))
        if raw is None:
            self._save()
            return
        state = json.loads(raw)
        self._nodes = state["nodes"]
        for d in state["deployments"]:
            dep = Deployment.from_dict(d)
            self._registry.deployments[dep.deployment_id] = dep
        log.info("controller resumed: %d nodes, %d deployments", len(self._nodes),
                 len(self._registry.deployments))

    # ----------------------------------------------------------------- nodes
    def info(self) -> dict:
        """Store addresses, ``cluster_tag``, settings, and the node ids."""
        return self._info | {"node_ids": sorted(self._nodes)}

    def register_node(self, node_id: str) -> str:
        """Record that ``node_id`` has a cache actor; returns that actor's name."""
        self._nodes[node_id] = node_actor_name(node_id)
        self._save()
        return self._nodes[node_id]

    def retire_node(self, node_id: str) -> bool:
        """Forget ``node_id``; False if it was not registered."""
        gone = self._nodes.pop(node_id, None) is not None
        self._save()
        return gone

    def nodes(self) -> dict[str, str]:
        """Node id -> name of its cache actor."""
        return dict(self._nodes)

    # ----------------------------------------------------------- deployments
    def register_rank(self, config: StorageConfig, pools: Sequence[PoolSpec],
                      node_id: str) -> tuple[str, KeyPlan]:
        """Record a rank of a deployment; returns ``(deployment_id, key plan)``.

        ``ValueError`` naming the conflict if the rank contradicts its group.
        """
        dep = self._registry.register_rank(config, pools, node_id)
        self._save()
        return dep.deployment_id, dep.plan(config.tp_rank, config.pp_rank)

    def deployments(self) -> dict[str, dict]:
        return {k: d.to_dict() for k, d in self._registry.deployments.items()}

    async def group_exists(self, deployment_id: str, keys: list[str],
                           queries: list[PoolQuery]) -> PoolTransferResult:
        """The hit of the whole TP/PP group for ``keys``: identical for every rank that
        asks about the same keys and pools within the window. Distinct queries that
        arrive while a store check runs are batched into the next single check."""
        dep = self._registry.get(deployment_id)
        qkey = (deployment_id, tuple(keys), tuple(queries))
        now = time.monotonic()
        while self._recent and next(iter(self._recent.values()))[0] < now - self._window:
            self._recent.popitem(last=False)
        if qkey in self._recent:
            self._queries.inc(tags={"shared": "recent"})
            return self._recent[qkey][1]
        if qkey in self._inflight:
            self._queries.inc(tags={"shared": "inflight"})
            return await asyncio.shield(self._inflight[qkey])
        plan = group_objects(dep, keys, queries)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[qkey] = fut
        self._pending.append((qkey, plan, queries, fut))
        if not self._draining:
            self._draining = True
            asyncio.get_running_loop().create_task(self._drain())
        self._queries.inc(tags={"shared": "no"})
        return await asyncio.shield(fut)

    async def _drain(self) -> None:
        """Answer pending queries, each round with one ``batch_is_exist`` over the union
        of their objects (no key twice)."""
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                if len(batch) == 1:
                    union = None
                    names = batch[0][1].objects
                else:
                    union = {}
                    for _, plan, _, _ in batch:
                        for o in plan.objects:
                            union.setdefault(o, len(union))
                    names = list(union)
                t = time.perf_counter()
                try:
                    codes = await loop.run_in_executor(self._executor, self._store.exists,
                                                       names)
                except Exception as e:  # answer every waiter, keep serving
                    codes, error = None, e
                self._latency.observe(time.perf_counter() - t)
                for qkey, plan, queries, fut in batch:
                    self._inflight.pop(qkey, None)
                    if codes is None:
                        fut.set_exception(error)
                        continue
                    mine = codes if union is None else [codes[union[o]] for o in plan.objects]
                    result = group_hits(plan, queries, mine)
                    if result.kv_hit_pages:
                        self._hit_pages.inc(result.kv_hit_pages,
                                            tags={"deployment": qkey[0]})
                    self._recent[qkey] = (time.monotonic(), result)
                    fut.set_result(result)
        finally:
            self._draining = False
