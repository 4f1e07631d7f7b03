"""``raykv why``: for a prompt's blocks, which tier holds each and why each other one is
not served, asked of a running cluster.

``why`` takes the prompt's token ids and a deployment (its id, key prefix or model
name, among those the controller registered), names the prompt's full blocks by their
page hashes as the deployment's engine does (``HASHES``: vLLM's connector,
``integrations.vllm.page_hash``, for a deployment whose KV pool is of kind ``vllm``; the
example engine's, ``example_engine.page_hashes``, for the others; SGLang hashes pages
itself and is not supported), and every object of each block (``controllers.families``),
then asks every node actor for its facts of them (``NodeCacheActor.why``: its L2, its L2
evictions, its touch journal; one node also the store), and the same of every other
deployment this caller may name, for ``OTHER_IDENTITY``. ``controllers.miss_reasons``
turns the answers into reasons; with a prefill rate the load guard is applied to the
leading held blocks with the estimates of a group answer of the deployment's lookup home
(``load_runs``; none: "no estimate").

Tenants: a tenant's object keys are keyed page hashes only the tenant secret computes,
and node actors answer a tenant's keys only to the tenant's claim. So asking about a
tenant's deployment needs that tenant's secret (``RAYKV_TENANT_SECRET``, as its
engines), and the other deployments looked at are those without a tenant and those of
the caller's own tenant: another tenant's presence is never seen, by anyone without
that tenant's secret. The report says how many deployments it could not look at.

Bounds: at most ``MAX_PAGES`` blocks and one call's keys (``MAX_BATCH_OBJECTS``; the
rest of the prompt is not looked at, and the report says how many blocks were),
``MAX_OTHERS`` other deployments, and every Ray call bounded by the deadline.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import ray
from raykv.controllers.contract import PoolName
from raykv.controllers.deployments import Deployment
from raykv.controllers.families import group_families
from raykv.controllers.keyed_hashes import KeyedHashes
from raykv.controllers.load_guard import GuardSettings, LoadRun
from raykv.controllers.miss_reasons import (
    OtherHolding,
    covered,
    explain,
    guard_view,
    held_blocks,
    load_runs,
)
from raykv.controllers.naming import NAMESPACE, node_actor_name
from raykv.controllers.object_batch import MAX_BATCH_OBJECTS
from raykv.controllers.owner_keys import call_purpose
from raykv.controllers.ownership import OwnerClaim, owner_key
from raykv.controllers.tenancy import tenant_secret

HASHES = ("vllm", "example")
"""The page-hash schemes ``why`` computes."""
MAX_PAGES = 2048
"""Blocks of a prompt ``why`` looks at, at most."""
MAX_OTHERS = 16
"""Other deployments ``why`` asks about, at most (those of the same model name first)."""
DEADLINE_S = 10.0
"""Default of how long every Ray call may take, in seconds."""


def page_hashes(scheme: str, tokens: Sequence[int], page_size: int) -> list[str]:
    """The hex page hashes of ``tokens``' full blocks as ``scheme``'s engine makes them
    (vLLM's: no cache salt, LoRA or multimodal input)."""
    if scheme == "vllm":
        from raykv.integrations.vllm.page_hash import PageHashChain, no_extra_keys

        n = len(tokens) // page_size * page_size
        return [h.hex() for h in PageHashChain(page_size).extend(list(tokens), n,
                                                                  no_extra_keys)]
    if scheme == "example":
        from raykv.example_engine.page_hashes import page_hashes as example_hashes

        return example_hashes(tokens, page_size)
    raise ValueError(f"page hashes {scheme!r}: supported are {list(HASHES)}")


def scheme_of(dep: Deployment) -> str:
    """The page-hash scheme of ``dep``'s engine, from its KV pool's kind."""
    kv = dep.pools.get(PoolName.KV)
    return "vllm" if kv is not None and kv.kind == "vllm" else "example"


def pick(deployments: dict[str, Deployment], name: str | None) -> Deployment:
    """The deployment ``name`` names (its id, key prefix or model name); ``ValueError``
    listing the registered ones if it names none or several."""
    listed = "; ".join(f"{d.deployment_id} (model {d.model_name}, tenant {d.tenant})"
                       for d in deployments.values()) or "none"
    if name:
        for how in (lambda d: d.deployment_id == name, lambda d: d.identity.prefix == name,
                    lambda d: d.model_name == name):
            found = [d for d in deployments.values() if how(d)]
            if len(found) == 1:
                return found[0]
            if len(found) > 1:
                raise ValueError(f"{name!r} names {len(found)} deployments; give one's id. "
                                 f"Registered: {listed}")
        raise ValueError(f"no deployment {name!r} is registered. Registered: {listed}")
    if len(deployments) == 1:
        return next(iter(deployments.values()))
    raise ValueError(f"give --deployment (its id, key prefix or model name). "
                     f"Registered: {listed}")


class _Asker:
    """Calls of ``NodeCacheActor.why`` / ``group_exists`` with a deployment's claim (a
    tenant's: a fresh call proof per call, its owner session opened first)."""

    def __init__(self, dep: Deployment, namespace: str, deadline_s: float) -> None:
        from raykv.cache_actors.rank.rank_owner import RankOwner

        claim = OwnerClaim(dep.deployment_id, dep.tenant, None, dep.identity.prefix)
        self.owner = RankOwner(claim, owner_key(dep.tenant) if dep.tenant else None)
        self.namespace, self.deadline_s = namespace, deadline_s

    def claim(self, node: str, method: str, *args: object) -> tuple[object, OwnerClaim]:
        name = node_actor_name(node)
        actor = ray.get_actor(name, namespace=self.namespace)

        def ask(m: str, *a):
            return ray.get(getattr(actor, m).remote(*a), timeout=self.deadline_s)
        return actor, self.owner.claim(name, ask, call_purpose(method, *args))

    def facts(self, nodes: Sequence[str], keys: list[str]) -> tuple[list, dict[str, str]]:
        """Every node's facts of ``keys`` (the first node's with the store's); the
        nodes that did not answer, with why."""
        calls, failed = {}, {}
        for i, node in enumerate(nodes):
            try:
                actor, claim = self.claim(node, "why", keys, i == 0)
                calls[node] = actor.why.remote(keys, i == 0, claim)
            except Exception as e:
                failed[node] = _line(e)
        out = []
        for node, ref in calls.items():
            try:
                out.append(ray.get(ref, timeout=self.deadline_s))
            except Exception as e:
                failed[node] = _line(e)
        return out, failed


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]


def keys_of(dep: Deployment, hashes: Sequence[str]) -> tuple[list[str], int]:
    """Every object key of pages ``hashes`` (already keyed for a tenant) of every rank
    and pool of ``dep``, page by page; and the keys a page."""
    fams = group_families(dep, [])
    suffixes = [s for f in fams.families for s in f.suffixes]
    return [fams.prefix + h + s for h in hashes for s in suffixes], len(suffixes)


def why(tokens: Sequence[int], deployment: str | None, *, namespace: str = NAMESPACE,
        hashes: str | None = None, prefill_tokens_per_s: float | None = None,
        guard: str = "auto", node: str | None = None,
        deadline_s: float = DEADLINE_S) -> dict:
    """The report of ``tokens`` for ``deployment`` on the running cluster this driver
    is connected to (``ray.init`` done): a dict ``render`` prints and ``--json`` shows
    (see the module docstring). ``hashes``: the page-hash scheme (default: the
    deployment's engine's); ``node``: the engine's node, for the L2 run of the load
    guard (an id or its head; default: the deployment's lookup home). ``ValueError``
    for a deployment not found, a tenant's without its secret, or bad input."""
    from raykv.clusters.deploy import controller

    ctl = controller(namespace)
    if ctl is None:
        raise ValueError(f"raykv is not running in namespace {namespace!r}")
    deps = {k: Deployment.from_dict(d) for k, d in
            ray.get(ctl.deployments.remote(), timeout=deadline_s).items()}
    dep = pick(deps, deployment)
    if not dep.page_size:
        raise ValueError(f"deployment {dep.deployment_id!r} recorded no page size")
    nodes = sorted(ray.get(ctl.nodes.remote(), timeout=deadline_s))
    scheme = hashes or scheme_of(dep)
    tokens = list(tokens)
    whole = len(tokens) // dep.page_size
    raw = page_hashes(scheme, tokens[:MAX_PAGES * dep.page_size], dep.page_size)
    keyed = KeyedHashes(tenant_secret(dep.tenant) if dep.tenant else None)
    hashed = list(keyed.keys(raw)) if raw else []
    keys, per_page = keys_of(dep, hashed)
    if len(keys) > MAX_BATCH_OBJECTS:  # one call's worth of keys: fewer pages
        raw = raw[:MAX_BATCH_OBJECTS // per_page]
        hashed, keys = hashed[:len(raw)], keys[:len(raw) * per_page]
    asker = _Asker(dep, namespace, deadline_s)
    facts, failed = asker.facts(nodes, keys) if keys else ([], {})
    others, unseen = _others(deps, dep, tokens, nodes, scheme, namespace, deadline_s)
    blocks = explain(raw, keys, per_page, facts, others, time.time())
    report = {"deployment": dep.deployment_id, "model": dep.model_name,
              "tenant": dep.tenant, "page_size": dep.page_size, "hashes": scheme,
              "tokens": len(tokens), "blocks_in_prompt": whole, "blocks": [],
              "nodes": nodes, "failed_nodes": failed, "not_checked": unseen,
              "guard": None}
    if prefill_tokens_per_s is not None and blocks:
        home = _node(nodes, node) or dep.home_node
        settings = GuardSettings.parse(guard)
        try:
            runs, estimated = _group_runs(asker, dep, home, hashed, deadline_s)
        except Exception as e:  # the guard is then shown without the node's estimates
            runs, estimated, failed[f"{home} (group query)"] = [], False, _line(e)
        runs = runs if estimated else load_runs(blocks, home)
        choice = guard_view(blocks, runs, dep.page_size, prefill_tokens_per_s, settings)
        report["guard"] = {"node": home, "setting": settings.describe(),
                           "prefill_tokens_per_s": prefill_tokens_per_s,
                           "runs": [dataclasses.astuple(r) for r in runs],
                           "estimates_from": "group answer" if estimated else "none",
                           "load_pages": choice.pages, "load_s": choice.load_s,
                           "prefill_s": choice.prefill_s, "reason": choice.reason}
    report["blocks"] = [{"index": b.index, "page_hash": b.page_hash, "held": b.held,
                         "tier": b.nearest, "reasons": [list(r) for r in b.reasons]}
                        for b in blocks]
    return report


def _node(nodes: Sequence[str], head: str | None) -> str | None:
    if not head:
        return None
    found = [n for n in nodes if n.startswith(head)]
    if len(found) != 1:
        raise ValueError(f"--node {head!r} names {len(found)} of the nodes {nodes}")
    return found[0]


def _group_runs(asker: _Asker, dep: Deployment, home: str | None, hashed: list[str],
                deadline_s: float) -> tuple[list[LoadRun], bool]:
    """The lookup home's group answer's ``load_runs`` (and whether it had any)."""
    if home is None:
        return [], False
    args = (dep.deployment_id, dep.version, (0, 0), "raykv-why", hashed[:MAX_PAGES], [])
    actor, claim = asker.claim(home, "group_exists", *args)
    answer = ray.get(actor.group_exists.remote(*args, claim), timeout=deadline_s)
    runs = [LoadRun(t, p, s) for t, p, s in answer.load_runs]
    return runs, bool(runs)


def _others(deps: dict[str, Deployment], dep: Deployment, tokens: list[int],
            nodes: list[str], scheme: str, namespace: str, deadline_s: float
            ) -> tuple[list[OtherHolding], list[str]]:
    """What the other deployments this caller may name hold of the prompt, and the
    ids of those it may not (another tenant's) or did not (past ``MAX_OTHERS``)."""
    mine = dep.identity
    seen = [d for d in deps.values() if d.deployment_id != dep.deployment_id]
    seen.sort(key=lambda d: d.model_name != dep.model_name)
    out, unseen = [], []
    for other in seen:
        if other.tenant not in (None, dep.tenant) or len(out) >= MAX_OTHERS or \
                not other.page_size:
            unseen.append(other.deployment_id)
            continue
        ps = other.page_size
        theirs = scheme if scheme_of(other) == scheme_of(dep) else scheme_of(other)
        raw = page_hashes(theirs, tokens[:MAX_PAGES * dep.page_size], ps)
        if not raw:
            continue
        keyed = KeyedHashes(tenant_secret(other.tenant) if other.tenant else None)
        keys, per_page = keys_of(other, list(keyed.keys(raw)))
        facts, _ = _Asker(other, namespace, deadline_s).facts(nodes, keys)
        blocks = min(len(tokens), MAX_PAGES * dep.page_size) // dep.page_size
        held = covered(dep.page_size, blocks, ps, held_blocks(facts, per_page))
        if any(held):
            out.append(OtherHolding(other.deployment_id, mine.differences(other.identity),
                                    held))
    return out, unseen


def render(report: dict) -> list[str]:
    """``report`` as lines for a person: one a run of blocks with the same answer."""
    lines = [f"deployment {report['deployment']} (model {report['model']}, tenant "
             f"{report['tenant']}, page {report['page_size']} tokens, {report['hashes']} "
             f"page hashes): {report['tokens']} tokens, {report['blocks_in_prompt']} full "
             f"block(s), {len(report['blocks'])} looked at"]
    runs: list[tuple[int, int, str]] = []
    for b in report["blocks"]:
        text = _answer(b)
        if runs and runs[-1][2] == text and runs[-1][1] == b["index"] - 1:
            runs[-1] = (runs[-1][0], b["index"], text)
        else:
            runs.append((b["index"], b["index"], text))
    for first, last, text in runs:
        where = f"block {first}" if first == last else f"blocks {first}-{last}"
        lines.append(f"  {where}: {text}")
    for node, error in report["failed_nodes"].items():
        lines.append(f"  node {node[:12]} did not answer: {error}")
    if report["not_checked"]:
        lines.append(f"  not looked at: {len(report['not_checked'])} other deployment(s) "
                     "(another tenant's keys need that tenant's secret): "
                     + ", ".join(report["not_checked"]))
    g = report["guard"]
    if g is not None:
        lines.append(f"  load guard {g['setting']} at {g['prefill_tokens_per_s']:g} "
                     f"tokens/s on node {str(g['node'])[:12]} (estimates: "
                     f"{g['estimates_from']}): loads {g['load_pages']} leading block(s)"
                     + (f", skips the rest ({g['reason']})" if g["reason"] else ""))
    return lines


def _answer(block: dict) -> str:
    held = block["held"]
    parts = []
    for tier in ("l2", "l3", "l3_disk"):
        if tier in held:
            where = {"l2": "on node", "l3": "on segment"}.get(tier, "")
            names = ", ".join(n[:12] if tier == "l2" else n for n in held[tier])
            parts.append(f"{tier} {where} {names}".strip() if names else tier)
    text = "held in " + "; ".join(parts) if parts else "missing"
    reasons = "; ".join(f"{r}: {d}" for r, d in block["reasons"])
    return f"{text} ({reasons})" if reasons else text
