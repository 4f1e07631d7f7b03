"""Who owns a node's pools, and who may use them (pure: no Ray, no Mooncake).

Every pool a node actor holds has an *owner*: the deployment whose rank made it (or
adopted its engine memory into it), and that deployment's tenant, if any (``Owner``). A
rank tells the node actor who it is with every pool call and data call, or once per
channel connection: its *owner claim* (``OwnerClaim``: deployment id, tenant, the
tenant's owner proof, the deployment's key prefix). The node actor checks the claim
(``OwnerBindings.verify``) and then serves only the claimant's own pools and keys:

- A tenant's owner proof (``controllers.tenancy.owner_proof``) is bound per node actor
  on the first claim of that tenant name (trust on first use), unless the cluster's
  settings bound it in advance (``NodeSettings.tenant_digests``: the digest
  ``tenant_digest`` prints, so a process that claims the name first cannot take it); a
  later claim of the tenant with another proof is refused. So is a claim of a deployment
  under another tenant than its first claim named. Only the SHA-256 of a proof is kept (a proof is a
  bearer token; its digest is what pool records hold, so the binding outlives a restart
  of the actor for as long as a record of the tenant does).
- A pool answers only calls whose claim names its owner (same deployment id and tenant);
  any other create of its name, attach, destroy, adoption and lookup is refused with a
  ``ValueError`` naming the owner (never the proof); data calls on it fail per object.
- Keys outside the claim's key prefix are refused per object where the prefix is not
  empty (a deployment of neither model name nor tag has none: its keys cannot be told
  apart from another such deployment's).
- A pool without an owner (made by an older raykv, or by a caller that sent no claim:
  *legacy*) is reachable only by callers that send no claim; a caller without a claim
  reaches no owned pool.

What this is and is not. Without a tenant, a claim is what the rank says it is: it keeps
deployments that share a node from using each other's pools by accident (two deployments
that pick the same pool name no longer share it silently), not against a caller that
lies. With a tenant, the claim needs the tenant secret (through its proof), and the
tenant's keys are keyed page hashes only its processes can compute: that is the
boundary between tenants. Processes of the node actor's own uid can map every pool's
shared memory anyway (the files are theirs), as before.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from raykv.controllers.contract import StorageConfig
from raykv.controllers.deployments import deployment_id
from raykv.controllers.keys import KeyScheme
from raykv.controllers.tenancy import check_tenant, owner_proof, tenant_secret

MAX_TENANTS = 1024
"""Tenants one node actor binds at most (their proofs are kept for its life)."""
MAX_DEPLOYMENTS = 4096
"""Deployments one node actor binds at most; when full, deployments that own no pool
here are forgotten first (oldest first)."""
MAX_ID_CHARS = 512
"""Longest deployment id or key prefix a claim may carry."""
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Owner:
    """What a pool belongs to: a deployment id and its tenant (None: no tenant)."""

    deployment_id: str
    tenant: str | None = None

    def __str__(self) -> str:
        return (f"deployment {self.deployment_id!r}" +
                (f" of tenant {self.tenant!r}" if self.tenant else ""))


@dataclass(frozen=True)
class OwnerClaim:
    """What a rank tells the node actor it is: its deployment, tenant and the tenant's
    owner proof (64 hex digits; None without a tenant), and the key prefix of its
    deployment's keys (``KeyScheme.prefix``; ``""`` when it has none)."""

    deployment_id: str
    tenant: str | None = None
    proof: str | None = field(default=None, repr=False)
    key_prefix: str = ""

    @property
    def owner(self) -> Owner:
        return Owner(self.deployment_id, self.tenant)

    def check(self) -> OwnerClaim:
        """This claim if its fields are well formed, else ``ValueError`` naming the
        problem (never the proof)."""
        for what, value in (("deployment id", self.deployment_id),
                            ("key prefix", self.key_prefix)):
            if type(value) is not str or len(value) > MAX_ID_CHARS:
                raise ValueError(f"an owner claim's {what} must be a str of at most "
                                 f"{MAX_ID_CHARS} characters")
        if not self.deployment_id:
            raise ValueError("an owner claim needs a deployment id")
        check_tenant(self.tenant)
        if self.tenant is None:
            if self.proof is not None:
                raise ValueError("an owner claim without a tenant carries no proof")
        elif type(self.proof) is not str or not _HEX64.fullmatch(self.proof):
            raise ValueError(f"tenant {self.tenant!r}: the owner claim needs the tenant's "
                             "owner proof (64 hex digits, from its tenant secret)")
        return self


def claim_of(config: StorageConfig, environ: Mapping[str, str] = os.environ) -> OwnerClaim:
    """The owner claim of a rank of ``config``: ``deployment_id(config)``, its tenant
    with the proof of the tenant secret in ``environ`` (``ValueError`` naming the fix if
    the secret is missing), and its key prefix."""
    tenant = config.tenant
    proof = owner_proof(tenant_secret(tenant, environ)) if tenant else None
    return OwnerClaim(deployment_id(config), tenant, proof,
                      KeyScheme.from_config(config).prefix)


def proof_digest(proof: str) -> str:
    """What is kept of a proof: its SHA-256, 64 hex digits."""
    return hashlib.sha256(proof.encode()).hexdigest()


def tenant_digest(tenant: str, environ: Mapping[str, str] = os.environ) -> str:
    """The digest a node binds for ``tenant`` whose secret is in ``environ`` (what
    ``raykv tenant-digest`` prints for ``raykv up --tenant-digest``); ``ValueError``
    naming the fix if the secret is missing. Reveals nothing of the secret or the proof."""
    return proof_digest(owner_proof(tenant_secret(check_tenant(tenant), environ)))


def bind_tenant_proof(digests: dict[str, str], tenant: str, proof: object, *,
                      binder: str, max_tenants: int = MAX_TENANTS) -> None:
    """Bind ``tenant`` to the digest of ``proof`` in ``digests`` (tenant -> digest, what
    ``binder``, e.g. "the controller", has bound: in advance or at first use), or check
    it against the bound one. ``ValueError`` without a proof, with another proof, or
    when ``max_tenants`` are bound already. Not thread-safe (the caller serialises)."""
    if not isinstance(proof, str) or not _HEX64.fullmatch(proof):
        raise ValueError(f"tenant {tenant!r}: {binder} needs the tenant's owner proof")
    digest = proof_digest(proof)
    if tenant not in digests and len(digests) >= max_tenants:
        raise ValueError(f"{binder} has bound {max_tenants} tenants; tenant {tenant!r} is "
                         "refused")
    if digests.setdefault(tenant, digest) != digest:
        raise ValueError(f"tenant {tenant!r}: the owner proof differs from the one {binder} "
                         "bound for that tenant (another tenant secret)")


def check_tenant_digests(digests: object) -> dict[str, str]:
    """``digests`` as a dict of tenant name -> proof digest (64 lowercase hex digits),
    else ``ValueError`` naming the bad entry."""
    if not isinstance(digests, Mapping):
        raise ValueError(f"tenant digests must be a mapping of tenant -> digest, got "
                         f"{type(digests).__name__}")
    for tenant, digest in digests.items():
        check_tenant(tenant)
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ValueError(f"the digest of tenant {tenant!r} must be 64 hex digits (what "
                             f"`raykv tenant-digest` prints), got {digest!r}")
    return dict(digests)


def check_access(name: str, owner: Owner | None, caller: Owner | None, what: str) -> None:
    """``ValueError`` unless ``caller`` (None: a caller without a claim) may ``what``
    ("attach", "destroy", ...) pool ``name`` of ``owner`` (None: legacy)."""
    if owner == caller:
        return
    if owner is None:
        raise ValueError(f"pool {name!r} on this node has no owner (made by an older raykv "
                         f"or a caller without an owner claim): only such callers may {what} "
                         f"it, not {caller}")
    by = "a caller without an owner claim" if caller is None else str(caller)
    raise ValueError(f"pool {name!r} on this node belongs to {owner}: {by} may not {what} "
                     "it (pick another pool name)")


class OwnerBindings:
    """What one node actor has bound (see the module docstring): per tenant the digest
    of its proof, per deployment its tenant. Thread-safe (one lock, held for dict work
    only). ``keep(deployment_id)``: whether a deployment owns a pool here (never
    forgotten when the deployment table is full)."""

    def __init__(self, keep: Callable[[str], bool] = lambda d: True, *,
                 digests: Mapping[str, str] | None = None, max_tenants: int = MAX_TENANTS,
                 max_deployments: int = MAX_DEPLOYMENTS) -> None:
        """``digests``: tenant -> the digest of its proof (``proof_digest``), bound from
        the start (checked by ``check_tenant_digests``); other tenants bind on first use."""
        self._keep = keep
        self._max_tenants = max_tenants
        self._max_deployments = max_deployments
        self._lock = threading.Lock()
        self._proofs: dict[str, str] = check_tenant_digests(digests or {})  # tenant -> digest
        self._tenants: dict[str, str | None] = {}  # deployment id -> its tenant

    def verify(self, claim: OwnerClaim | None) -> OwnerClaim | None:
        """``claim`` once it is well formed and agrees with what was bound (binding
        what was not bound yet); None stays None (a caller without a claim).
        ``ValueError`` naming the conflict otherwise."""
        if claim is None:
            return None
        if type(claim) is not OwnerClaim:
            raise ValueError(f"an owner claim must be an OwnerClaim, got "
                             f"{type(claim).__name__}")
        claim.check()
        digest = proof_digest(claim.proof) if claim.proof is not None else None
        self.bind(claim.owner, digest)
        return claim

    def bind(self, owner: Owner, digest: str | None) -> None:
        """Bind ``owner``'s tenant to proof ``digest`` and its deployment to its tenant,
        or check them against what was bound (``ValueError`` on a conflict). Pool
        records call this at restart with the digest they hold."""
        tenant, dep = owner.tenant, owner.deployment_id
        with self._lock:
            if tenant is not None:
                bound = self._proofs.get(tenant)
                if bound is None:
                    if len(self._proofs) >= self._max_tenants:
                        raise ValueError(f"this node actor has bound {self._max_tenants} "
                                         f"tenants; tenant {tenant!r} is refused")
                elif bound != digest:
                    raise ValueError(f"tenant {tenant!r}: the owner proof differs from the "
                                     "one this node actor bound for that tenant (another "
                                     "tenant secret)")
            if dep in self._tenants:
                if self._tenants[dep] != tenant:
                    was = self._tenants[dep]
                    raise ValueError(
                        f"deployment {dep!r} was claimed on this node " +
                        (f"by tenant {was!r}" if was else "without a tenant") +
                        (f", not by tenant {tenant!r}" if tenant else
                         ", not without one"))
            else:
                self._make_room()
                self._tenants[dep] = tenant
            if tenant is not None:
                self._proofs[tenant] = digest

    def _make_room(self) -> None:
        """With the lock held: forget the oldest deployments that own no pool here
        until one more fits; ``ValueError`` if none can go."""
        while len(self._tenants) >= self._max_deployments:
            old = next((d for d in self._tenants if not self._keep(d)), None)
            if old is None:
                raise ValueError(f"this node actor has bound {self._max_deployments} "
                                 "deployments that all own pools here")
            del self._tenants[old]

    def claimed(self, deployment: str) -> bool:
        """Whether a claim of ``deployment`` was bound here."""
        with self._lock:
            return deployment in self._tenants

    def digest(self, tenant: str | None) -> str | None:
        """The proof digest bound for ``tenant`` (None: none, or no tenant)."""
        if tenant is None:
            return None
        with self._lock:
            return self._proofs.get(tenant)
