"""Deployments and their TP/PP groups, as the controller records them (pure logic).

A deployment is one key space: the model name and ``extra_backend_tag`` (its key
prefix), its parallel sizes, MLA or MHA, and the pools every rank registers. Ranks of
one deployment must agree on all of it; a rank that contradicts its group is refused
with an error naming the conflict. From the spec alone the controller can name every
rank's objects, so a *group* existence query covers ranks that never asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from controllers.contract import PoolHitPolicy, PoolName, StorageConfig
from controllers.hit_resolution import PoolPresence, resolve_hits
from controllers.keys import KeyPlan, check_key_rule, is_replicated, key_prefix


@dataclass(frozen=True)
class PoolSpec:
    """What the key rules need of a pool: its role, kind and buffer names in key order."""

    name: PoolName
    kind: str
    buffers: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", PoolName(self.name))
        object.__setattr__(self, "buffers", tuple(self.buffers))
        check_key_rule(self.name, self.kind)


@dataclass
class Deployment:
    """One deployment's group spec and the ranks that registered (``"tp,pp"`` -> node)."""

    deployment_id: str
    model_name: str | None
    extra_backend_tag: str | None
    tp_size: int
    pp_size: int
    is_mla_model: bool
    pools: dict[PoolName, PoolSpec] = field(default_factory=dict)
    ranks: dict[str, str] = field(default_factory=dict)

    def plan(self, tp_rank: int, pp_rank: int) -> KeyPlan:
        """The key plan of rank (``tp_rank``, ``pp_rank``)."""
        return KeyPlan.from_config(StorageConfig(
            tp_rank=tp_rank, tp_size=self.tp_size, pp_rank=pp_rank, pp_size=self.pp_size,
            is_mla_model=self.is_mla_model, model_name=self.model_name,
            extra_config={"extra_backend_tag": self.extra_backend_tag}))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["pools"] = [asdict(p) | {"name": p.name.value} for p in self.pools.values()]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Deployment:
        pools = {PoolName(p["name"]): PoolSpec(**p) for p in d["pools"]}
        return cls(**(d | {"pools": pools}))


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
        pools = {p.name: p for p in pools}
        if PoolName.KV not in pools:
            raise ValueError(f"deployment {dep_id!r}: a rank must register a kv pool")
        dep = self.deployments.get(dep_id)
        if dep is None:
            dep = Deployment(dep_id, config.model_name, config.extra_backend_tag,
                             config.tp_size, config.pp_size, config.is_mla_model, pools)
        else:
            for what, mine, theirs in (("tp_size", config.tp_size, dep.tp_size),
                                       ("pp_size", config.pp_size, dep.pp_size),
                                       ("is_mla_model", config.is_mla_model, dep.is_mla_model)):
                if mine != theirs:
                    raise ValueError(f"deployment {dep_id!r}: rank tp={config.tp_rank} "
                                     f"pp={config.pp_rank} says {what}={mine} but its group "
                                     f"registered {what}={theirs}")
            for name, spec in pools.items():
                known = dep.pools.get(name)
                if known is not None and known != spec:
                    raise ValueError(f"deployment {dep_id!r}: pool {name.value!r} is "
                                     f"{spec.kind} {list(spec.buffers)} on this rank but "
                                     f"{known.kind} {list(known.buffers)} in its group")
            dep.pools.update(pools)
        dep.ranks[f"{config.tp_rank},{config.pp_rank}"] = node_id
        self.deployments[dep_id] = dep
        return dep

    def get(self, dep_id: str) -> Deployment:
        dep = self.deployments.get(dep_id)
        if dep is None:
            raise ValueError(f"deployment {dep_id!r} is not registered; registered: "
                             f"{sorted(self.deployments)}")
        return dep


@dataclass(frozen=True)
class PoolQuery:
    """One pool of a group query: hit policy and trailing window (pages)."""

    name: PoolName
    policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    window: int = 1


def group_objects(dep: Deployment, page_hashes: Sequence[str],
                  queries: Sequence[PoolQuery]) -> tuple[list[str], dict]:
    """Every object of every rank and queried pool, deduplicated (replicated pools are
    stored once, by TP rank 0, so they are named once).

    Returns ``(objects, layout)`` where ``layout[(tp, pp)][pool]`` is, per page, the
    indices into ``objects`` of that page's objects.
    """
    for q in queries:
        if q.name not in dep.pools:
            raise ValueError(f"deployment {dep.deployment_id!r} registered no {q.name.value!r} "
                             f"pool (it has {[p.value for p in dep.pools]})")
    names = [PoolName.KV, *(q.name for q in queries if q.name != PoolName.KV)]
    objects: dict[str, int] = {}
    layout: dict[tuple[int, int], dict[PoolName, list[list[int]]]] = {}
    for pp in range(dep.pp_size):
        for tp in range(dep.tp_size):
            plan = dep.plan(tp, pp)
            per_pool = {}
            for name in names:
                spec = dep.pools[name]
                owner = dep.plan(0, pp) if is_replicated(name, spec.kind) else plan
                per_pool[name] = [
                    [objects.setdefault(o, len(objects))
                     for o in owner.pool_keys(name, spec.kind, list(spec.buffers), h)]
                    for h in page_hashes]
            layout[(tp, pp)] = per_pool
    return list(objects), layout


def group_hits(layout: dict, queries: Sequence[PoolQuery], exists: Sequence[int]):
    """The ``PoolTransferResult`` of the whole group from ``batch_is_exist`` codes of
    the objects ``group_objects`` named: the intersection over every rank and pool."""
    policy = {q.name: q for q in queries if q.name != PoolName.KV}

    def presence(pages: list[list[int]], q: PoolQuery | None) -> PoolPresence:
        flags = [all(exists[i] == 1 for i in page) for page in pages]
        return PoolPresence(flags) if q is None else PoolPresence(flags, q.policy, q.window)

    ranks = [(presence(pools[PoolName.KV], None),
              {n: presence(p, policy[n]) for n, p in pools.items() if n != PoolName.KV})
             for pools in layout.values()]
    first, *rest = ranks
    return resolve_hits(first[0], first[1], ranks=rest)
