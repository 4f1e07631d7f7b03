"""Deployments and their TP/PP groups, as the controller records them (pure logic).

A deployment is one key space: the model name and ``extra_backend_tag`` (its key
prefix), its parallel sizes, MLA or MHA, and the pools every rank registers. Ranks of
one deployment must agree on all of it; a rank that contradicts its group is refused
with an error naming the conflict. From the spec alone every rank's objects can be named
(``controllers.families``), so a *group* existence query covers ranks that never asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from raykv.controllers.contract import PoolHitPolicy, PoolName, StorageConfig
from raykv.controllers.keys import KeyScheme, check_key_rule, key_prefix


@dataclass(frozen=True)
class PoolSpec:
    """What the key rules need of a pool: its role, kind and buffer names in key order."""

    role: PoolName
    kind: str
    buffers: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", PoolName(self.role))
        object.__setattr__(self, "buffers", tuple(self.buffers))
        check_key_rule(self.role, self.kind)


@dataclass
class Deployment:
    """One deployment's group spec and the ranks that registered (``"tp,pp"`` -> node).

    ``home_node`` is the node whose cache actor answers the group's existence queries
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

    def key_scheme(self, tp_rank: int, pp_rank: int) -> KeyScheme:
        """The key scheme of rank (``tp_rank``, ``pp_rank``)."""
        return KeyScheme.from_config(StorageConfig(
            tp_rank=tp_rank, tp_size=self.tp_size, pp_rank=pp_rank, pp_size=self.pp_size,
            is_mla_model=self.is_mla_model, model_name=self.model_name,
            extra_config={"extra_backend_tag": self.extra_backend_tag}))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["pools"] = [asdict(p) | {"role": p.role.value} for p in self.pools.values()]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Deployment:
        """The deployment ``to_dict`` gave; a checkpoint of an older raykv names each
        pool's role ``name`` and is read as well (a controller restarted after an
        upgrade keeps its deployments)."""
        specs = [PoolSpec(**{("role" if k == "name" else k): v for k, v in p.items()})
                 for p in d["pools"]]
        return cls(**(d | {"pools": {s.role: s for s in specs}}))


@dataclass(frozen=True)
class Registration:
    """What a registered rank is told: its deployment, key scheme, and where (and at which
    deployment version) its group's existence queries are answered."""

    deployment_id: str
    key_scheme: KeyScheme
    home_node: str
    version: int


def deployment_id(config: StorageConfig) -> str:
    """A deployment is named by its key prefix (tag and model); ``"default"`` if none."""
    return key_prefix(config.model_name, config.extra_backend_tag).rstrip("_") or "default"


class DeploymentRegistry:
    """Deployments by id. Not thread-safe; the controller actor serialises calls."""

    def __init__(self) -> None:
        self.deployments: dict[str, Deployment] = {}

    def register_rank(self, config: StorageConfig, pools: Sequence[PoolSpec],
                      node_id: str) -> Deployment:
        """Record a rank and its pools. ``ValueError`` naming the conflict if the rank
        contradicts what its group registered (parallel sizes, MLA flag, pool kinds)."""
        dep_id = deployment_id(config)
        pools = {p.role: p for p in pools}
        if PoolName.KV not in pools:
            raise ValueError(f"deployment {dep_id!r}: a rank must register a kv pool")
        dep = self.deployments.get(dep_id)
        if dep is None:
            dep = Deployment(dep_id, config.model_name, config.extra_backend_tag,
                             config.tp_size, config.pp_size, config.is_mla_model, pools,
                             home_node=node_id)
        else:
            for what, mine, theirs in (("tp_size", config.tp_size, dep.tp_size),
                                       ("pp_size", config.pp_size, dep.pp_size),
                                       ("is_mla_model", config.is_mla_model, dep.is_mla_model)):
                if mine != theirs:
                    raise ValueError(f"deployment {dep_id!r}: rank tp={config.tp_rank} "
                                     f"pp={config.pp_rank} says {what}={mine} but its group "
                                     f"registered {what}={theirs}")
            for role, spec in pools.items():
                known = dep.pools.get(role)
                if known is not None and known != spec:
                    raise ValueError(f"deployment {dep_id!r}: pool {role.value!r} is "
                                     f"{spec.kind} {list(spec.buffers)} on this rank but "
                                     f"{known.kind} {list(known.buffers)} in its group")
            if any(role not in dep.pools for role in pools):
                dep.version += 1
            dep.pools.update(pools)
        if dep.home_node is None:
            dep.home_node = node_id
        dep.ranks[f"{config.tp_rank},{config.pp_rank}"] = node_id
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

