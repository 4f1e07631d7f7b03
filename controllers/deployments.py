"""Deployments and their TP/PP groups, as the controller records them (pure logic).

A deployment is one key space, named by its key prefix (``deployment_id``): the
*identity* of its ranks (``controllers.keys.Identity``: tenant, ``extra_backend_tag``,
model name and revision, KV dtype, page size, parallel sizes, MLA or MHA) and the pools
every rank registers, with what makes their bytes (``PoolSpec``: dtypes, page size,
order; per rank, the bytes of each page object). Ranks of one deployment must agree on
all of it; a rank that contradicts its deployment is refused with an error naming the
conflict. Without a tenant the key prefix is SGLang's, which several identities share
(``controllers.keys``): the second identity to register under one prefix is refused,
as its objects would be read as the first's. The record is kept after its ranks leave:
their objects stay in the store. From the spec alone every rank's objects can be named
(``controllers.families``), so a *group* existence query covers ranks that never asked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from raykv.controllers.contract import PoolHitPolicy, PoolName, StorageConfig, check_parallel
from raykv.controllers.keys import Identity, KeyScheme, check_key_rule
from raykv.controllers.object_batch import MAX_BATCH_OBJECTS


@dataclass(frozen=True)
class PoolSpec:
    """What the key rules need of a pool (its role, kind and buffer names in key order),
    and what its bytes are: each buffer's dtype, tokens per page, page order, and the
    bytes of each buffer's object of one page (``page_bytes``; may differ between ranks,
    e.g. PP stages of unequal layer counts, so it is compared rank by rank). Empty
    ``dtypes``/``order``, zero ``page_size`` and empty ``page_bytes``: not recorded (a
    checkpoint of an older raykv, or a spec built for key rules only), never in
    conflict."""

    role: PoolName
    kind: str
    buffers: tuple[str, ...]
    dtypes: tuple[str, ...] = ()
    page_size: int = 0
    order: str = ""
    page_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", PoolName(self.role))
        object.__setattr__(self, "buffers", tuple(self.buffers))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        object.__setattr__(self, "page_bytes", tuple(self.page_bytes))
        check_key_rule(self.role, self.kind)

    @property
    def group_spec(self) -> PoolSpec:
        """This spec less what may differ between the ranks of a group (``page_bytes``)."""
        return dataclasses.replace(self, page_bytes=())

    def conflict(self, known: PoolSpec) -> str | None:
        """What of this pool contradicts ``known``, the group's spec of the same role
        (kind and buffers; dtypes, page size and order where both recorded), or None."""
        problems = []
        if (self.kind, self.buffers) != (known.kind, known.buffers):
            problems.append(f"{self.kind} {list(self.buffers)} on this rank but "
                            f"{known.kind} {list(known.buffers)} in its group")
        for what in ("dtypes", "page_size", "order"):
            mine, theirs = getattr(self, what), getattr(known, what)
            if mine and theirs and mine != theirs:
                problems.append(f"{what} {mine!r} on this rank but {theirs!r} in its group")
        return "; ".join(problems) or None


@dataclass
class Deployment:
    """One deployment's group spec and the ranks that registered (``"tp,pp"`` -> node).

    The identity fields (``identity``) are those of every rank. ``pools``: per role, the
    group's ``PoolSpec`` (``group_spec``); ``page_bytes``: per rank (``"tp,pp"``) and
    role value, the bytes of each buffer's object of one page, kept after the rank left.
    ``home_node`` is the node whose node actor answers the group's existence queries
    (the node of the first rank that registered; moved when that node leaves), so every
    rank's query meets the same window of shared answers. ``version`` grows whenever
    the pools change, so cached copies can tell they are stale.
    """

    deployment_id: str
    model_name: str | None
    extra_backend_tag: str | None
    tp_size: int
    pp_size: int
    is_mla_model: bool
    pools: dict[PoolName, PoolSpec] = field(default_factory=dict)
    ranks: dict[str, str] = field(default_factory=dict)
    home_node: str | None = None
    version: int = 1
    tenant: str | None = None
    model_revision: str | None = None
    kv_dtype: str | None = None
    page_size: int | None = None
    page_bytes: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    @property
    def identity(self) -> Identity:
        return Identity(self.tenant, self.extra_backend_tag, self.model_name,
                        self.model_revision, self.kv_dtype, self.page_size, self.tp_size,
                        self.pp_size, self.is_mla_model)

    def check_rank(self, rank: object) -> tuple[int, int]:
        """``rank`` as ``(tp, pp)`` if it is a pair of ints naming a rank of this group;
        else ``ValueError``."""
        if (not isinstance(rank, tuple | list) or len(rank) != 2
                or any(type(r) is not int for r in rank)
                or not (0 <= rank[0] < self.tp_size and 0 <= rank[1] < self.pp_size)):
            raise ValueError(f"rank {rank!r} is no (tp, pp) of deployment "
                             f"{self.deployment_id!r} (tp_size {self.tp_size}, pp_size "
                             f"{self.pp_size})")
        return (rank[0], rank[1])

    def key_scheme(self, tp_rank: int, pp_rank: int) -> KeyScheme:
        """The key scheme of rank (``tp_rank``, ``pp_rank``)."""
        return KeyScheme.for_rank(self.identity, tp_rank, pp_rank)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["pools"] = [asdict(p) | {"role": p.role.value} for p in self.pools.values()]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Deployment:
        """The deployment ``to_dict`` gave. A checkpoint of an older raykv is read as
        well (a controller restarted after an upgrade keeps its deployments): pools'
        role named ``name``, no identity beyond model and tag, no byte fields, and the
        deployment named by its prefix less its final ``_`` (renamed here to
        ``Identity.deployment_id``)."""
        specs = [PoolSpec(**{("role" if k == "name" else k): v for k, v in p.items()})
                 for p in d["pools"]]
        dep = cls(**(d | {"pools": {s.role: s for s in specs}}))
        dep.deployment_id = dep.identity.deployment_id
        return dep


@dataclass(frozen=True)
class Registration:
    """What a registered rank is told: its deployment, key scheme, and where (its
    ``lookup_home``, in ``home_node``) and at which deployment version its group's
    existence queries are answered."""

    deployment_id: str
    key_scheme: KeyScheme
    home_node: str
    version: int


def lookup_home(dep: Deployment, config: StorageConfig, node_id: str) -> str:
    """The node whose actor answers the group queries of the rank ``config`` on
    ``node_id``: its *lookup home*. Every node actor can answer any deployment's, and
    ranks that ask one actor the same question get one answer (``group_queries``), so
    an engine's ranks agree when they ask the same actor. ``lookup_home="node"``: the
    rank's own node; for an engine whose ranks all run on one node (or whose group
    queries one process asks, as vLLM's scheduler does), so replicas on other nodes
    ask their own nodes. ``"deployment"``: the deployment's home node, one actor for
    every replica; for a TP/PP group spread over nodes. Not given: ``"node"`` for a
    group of one rank (nothing to agree on), else ``"deployment"``."""
    mode = config.lookup_home or ("node" if dep.tp_size * dep.pp_size == 1 else "deployment")
    return node_id if mode == "node" else dep.home_node


def deployment_id(config: StorageConfig) -> str:
    """A deployment is named by its exact key prefix (``Identity.deployment_id``:
    ``"default"`` for the empty one, a tenant's without its final ``_``): no two
    prefixes give one id, and no rank without a tenant gets a tenant's."""
    return Identity.from_config(config).deployment_id


def _identity_conflict(dep_id: str, config: StorageConfig, dep: Deployment) -> str:
    return (f"deployment {dep_id!r}: rank tp={config.tp_rank} pp={config.pp_rank} has "
            f"another identity than the deployment registered under the same key prefix: "
            f"{', '.join(Identity.from_config(config).differences(dep.identity))}; their "
            f"objects would be read as each other's. Give one of them a tenant "
            f"(extra_config['tenant']) or its own extra_config['extra_backend_tag']")


class DeploymentRegistry:
    """Deployments by id. Not thread-safe; the controller actor serialises calls."""

    def __init__(self) -> None:
        self.deployments: dict[str, Deployment] = {}

    def register_rank(self, config: StorageConfig, pools: Sequence[PoolSpec],
                      node_id: str) -> Deployment:
        """Record a rank and its pools. ``ValueError`` naming the conflict if the rank
        contradicts what its deployment registered: parallel sizes, MLA flag, another
        identity under the same key prefix (only possible without a tenant), a pool's
        kind, buffers, dtypes, page size or order, or (against the same rank's earlier
        registration) its bytes per page object; a config that is no ``StorageConfig``
        or whose parallel sizes are out of range (``check_parallel``: it came through
        Ray, unchecked) before anything is recorded."""
        if not isinstance(config, StorageConfig):
            raise ValueError(f"a rank registers a StorageConfig, not a {type(config).__name__}")
        check_parallel(config)
        dep_id = deployment_id(config)
        identity = Identity.from_config(config)
        rank = f"{config.tp_rank},{config.pp_rank}"
        pools = {p.role: p for p in pools}
        if PoolName.KV not in pools:
            raise ValueError(f"deployment {dep_id!r}: a rank must register a kv pool")
        dep = self.deployments.get(dep_id)
        if dep is None:
            dep = Deployment(dep_id, config.model_name, config.extra_backend_tag,
                             config.tp_size, config.pp_size, config.is_mla_model,
                             home_node=node_id, tenant=config.tenant,
                             model_revision=config.model_revision, kv_dtype=config.kv_dtype,
                             page_size=config.page_size)
        else:
            for what, mine, theirs in (("tp_size", config.tp_size, dep.tp_size),
                                       ("pp_size", config.pp_size, dep.pp_size),
                                       ("is_mla_model", config.is_mla_model, dep.is_mla_model)):
                if mine != theirs:
                    raise ValueError(f"deployment {dep_id!r}: rank tp={config.tp_rank} "
                                     f"pp={config.pp_rank} says {what}={mine} but its group "
                                     f"registered {what}={theirs}")
            if identity != dep.identity:
                raise ValueError(_identity_conflict(dep_id, config, dep))
        for role, spec in pools.items():
            known = dep.pools.get(role)
            problem = spec.conflict(known) if known is not None else None
            before = dep.page_bytes.get(rank, {}).get(role.value)
            if problem is None and before and spec.page_bytes and \
                    spec.page_bytes != tuple(before):
                problem = (f"{list(spec.page_bytes)} bytes per page object on this rank but "
                           f"{before} when this rank registered before")
            if problem:
                raise ValueError(f"deployment {dep_id!r}: pool {role.value!r} is {problem} "
                                 f"(rank tp={config.tp_rank} pp={config.pp_rank}); its "
                                 f"objects would be read as the group's. Bytes of another "
                                 f"kind need their own key space: their own "
                                 f"extra_config['extra_backend_tag'], or a tenant "
                                 f"(extra_config['tenant']) with the 'kv_dtype' and "
                                 f"'page_size' they hold")
        if dep.pools and any(role not in dep.pools for role in pools):
            dep.version += 1
        dep.pools.update({role: spec.group_spec for role, spec in pools.items()})
        dep.page_bytes.setdefault(rank, {}).update(
            {role.value: list(spec.page_bytes) for role, spec in pools.items()
             if spec.page_bytes})
        if dep.home_node is None:
            dep.home_node = node_id
        dep.ranks[rank] = node_id
        self.deployments[dep_id] = dep
        return dep

    def retire_node(self, node_id: str) -> None:
        """Forget ``node_id``'s ranks; a deployment homed there moves to the node of
        another of its ranks (or to the next rank that registers)."""
        for dep in self.deployments.values():
            dep.ranks = {r: n for r, n in dep.ranks.items() if n != node_id}
            if dep.home_node == node_id:
                dep.home_node = min(dep.ranks.values(), default=None)

    def get(self, dep_id: str) -> Deployment:
        dep = self.deployments.get(dep_id)
        if dep is None:
            raise ValueError(f"deployment {dep_id!r} is not registered; registered: "
                             f"{sorted(self.deployments)}")
        return dep


@dataclass(frozen=True)
class PoolQuery:
    """One extra pool of a hit query, by role: hit policy and trailing window (pages)."""

    role: PoolName
    policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    window: int = 1


def check_group_query(dep: Deployment, rank: object, queries: object
                      ) -> tuple[tuple[int, int], list[PoolQuery]]:
    """The asking ``rank`` (``Deployment.check_rank``) and the extra pools' ``queries``
    of a group query of ``dep``, checked: a list of ``PoolQuery``, one per role at most,
    each window an int in ``[1, MAX_BATCH_OBJECTS]``; else ``ValueError``. (Whether
    ``dep`` registered each pool: ``families.group_families``.)"""
    rank = dep.check_rank(rank)
    if not isinstance(queries, list | tuple) or len(queries) > len(PoolName):
        raise ValueError(f"a group query names at most {len(PoolName)} extra pools, as a "
                         f"list of PoolQuery; got {type(queries).__name__}")
    for q in queries:
        if (type(q) is not PoolQuery or not isinstance(q.role, PoolName)
                or not isinstance(q.policy, PoolHitPolicy) or type(q.window) is not int
                or not 1 <= q.window <= MAX_BATCH_OBJECTS):
            raise ValueError(f"{q!r} is no PoolQuery with a window of 1 to "
                             f"MAX_BATCH_OBJECTS={MAX_BATCH_OBJECTS} pages")
    return rank, list(queries)
