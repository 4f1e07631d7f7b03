"""``CacheController``: the one global, detached, named actor of a raykv cluster.

It is off the byte path and off the query path. It records where the store is and
which node actors serve which Ray nodes, keeps the deployments (their TP/PP groups and
pools), hands each rank its key scheme and names its *lookup home*
(``deployments.lookup_home``): that node's actor answers the group's existence queries
(one ``batch_is_exist`` over every rank's and pool's objects, shared by every rank that
asks within a window), so ranks never need an all-reduce and can never disagree, and
query load spreads over the nodes instead of meeting in one actor: replicas of a model
on different nodes ask their own nodes. Its registry is checkpointed to the GCS internal
KV on every change; a restarted controller resumes from it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import ray
from ray.experimental import internal_kv
from raykv.controllers.contract import StorageConfig
from raykv.controllers.deployments import (
    Deployment,
    DeploymentRegistry,
    PoolSpec,
    Registration,
    lookup_home,
)
from raykv.controllers.naming import node_actor_name
from raykv.controllers.owner_keys import Challenge
from raykv.controllers.owner_sessions import Challenges
from raykv.controllers.ownership import (
    check_tenant_digests,
    claim_of,
    verify_registration,
)

log = logging.getLogger(__name__)


def checkpoint_key(namespace: str) -> str:
    return f"raykv/{namespace}/controller"


@ray.remote(num_cpus=0, max_restarts=-1)
class CacheController:
    """Registry of store addresses, node actors and deployments."""

    def __init__(self, info: dict, namespace: str,
                 tenant_digests: dict[str, str] | None = None,
                 bound_tenants_only: bool = False) -> None:
        """``tenant_digests``: tenant -> its tenant digest (public owner key), bound from
        the start (``NodeSettings.tenant_digests``); other tenants bind at their first
        registration, unless ``bound_tenants_only``, and those bindings are
        checkpointed with the deployments (dropped at restore with
        ``bound_tenants_only``)."""
        self._info = dict(info)
        self._namespace = namespace
        self._nodes: dict[str, str] = {}
        self._registry = DeploymentRegistry()
        self._bound = check_tenant_digests(tenant_digests or {})  # tenant -> key
        self._bound_only = bound_tenants_only
        self._keys = dict(self._bound)  # tenant -> public owner key, bound or first used
        self._challenges = Challenges()
        self._restore()

    # ------------------------------------------------------------ checkpoint
    def _save(self) -> None:
        state = {"info": self._info, "nodes": self._nodes,
                 "deployments": [d.to_dict() for d in self._registry.deployments.values()],
                 "tenant_keys": self._keys}
        internal_kv._internal_kv_put(checkpoint_key(self._namespace), json.dumps(state),
                                     overwrite=True)

    def _restore(self) -> None:
        raw = internal_kv._internal_kv_get(checkpoint_key(self._namespace))
        if raw is None:
            self._save()
            return
        state = json.loads(raw)
        self._nodes = state["nodes"]
        if not self._bound_only:
            self._keys = check_tenant_digests(state.get("tenant_keys", {})) | self._bound
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
        """Record that ``node_id`` has a node actor; returns that actor's name."""
        self._nodes[node_id] = node_actor_name(node_id)
        self._save()
        return self._nodes[node_id]

    def retire_node(self, node_id: str) -> bool:
        """Forget ``node_id``; False if it was not registered."""
        gone = self._nodes.pop(node_id, None) is not None
        self._registry.retire_node(node_id)
        self._save()
        return gone

    def nodes(self) -> dict[str, str]:
        """Node id -> name of its node actor."""
        return dict(self._nodes)

    # ----------------------------------------------------------- deployments
    def challenge(self) -> Challenge:
        """A fresh challenge for a tenant's registration (good once, for 60 s)."""
        return self._challenges.issue()

    def register_rank(self, config: StorageConfig, pools: Sequence[PoolSpec],
                      node_id: str, proof: object = None) -> Registration:
        """Record a rank of a deployment; returns its key scheme and its group's home.

        ``proof``: with a tenant, a ``RegistrationProof`` over a challenge of this
        controller signed by the tenant's owner key (``controllers.owner_keys``): the
        controller binds each tenant's key as node actors do (first registration, or
        the cluster's tenant digests; with ``bound_tenants_only`` the latter only) and
        refuses another, so a process without the secret cannot register a tenant's
        deployment, and a proof seen once cannot be shown again. ``ValueError`` naming
        the conflict if the rank contradicts its group.
        """
        if config.tenant is not None:
            verify_registration(self._challenges, self._keys, claim_of(config), proof,
                                bound_only=self._bound_only)
        dep = self._registry.register_rank(config, pools, node_id)
        self._save()
        return Registration(dep.deployment_id, dep.key_scheme(config.tp_rank, config.pp_rank),
                            lookup_home(dep, config, node_id), dep.version)

    def deployment(self, deployment_id: str) -> Deployment:
        """The deployment as registered; ``ValueError`` if there is none of that id."""
        return self._registry.get(deployment_id)

    def deployments(self) -> dict[str, dict]:
        return {k: d.to_dict() for k, d in self._registry.deployments.items()}
