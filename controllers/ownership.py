"""Who owns a node's pools, and who may use them (pure: no Ray, no Mooncake).

Every pool a node actor holds has an *owner*: the deployment whose rank made it (or
adopted its engine memory into it), and that deployment's tenant, if any (``Owner``). A
rank tells the node actor who it is with every pool call and data call, or once per
channel connection: its *owner claim* (``OwnerClaim``: deployment id, tenant, a call
proof of the tenant's owner session, the deployment's key prefix). The node actor checks
the claim (``OwnerBindings.verify``) and then serves only the claimant's own pools and
keys:

- A claim's fields agree with each other (``OwnerClaim.check``): a deployment id is the
  one its key prefix names (``controllers.keys.Identity.deployment_id``), a tenant's key
  prefix names that tenant, and only the default deployment (no tenant, model name or
  tag) has an empty key prefix. So a tenant's deployment ids can be claimed only as the
  tenant's, and no claim can empty the key prefix of a deployment that has one.
- A tenant's claim carries a *call proof* of an owner session it opened by answering
  the node actor's challenge with a signature of the tenant's owner key
  (``controllers.owner_keys``): a proof is good for one call or one channel connection,
  and nobody without the session's key can make another. The node actor binds each
  tenant's public owner key (the *tenant digest*) on the first session of that tenant
  name (trust on first use), unless the cluster's settings bound it in advance
  (``NodeSettings.tenant_digests``); with ``bound_only`` (``raykv up
  --bound-tenants-only``) it binds no tenant on first use at all, so nobody can fill its
  tenant table. Deployments are bound in one table per kind (``MAX_DEPLOYMENTS``):
  claims without a tenant and of tenants bound on first use, which anyone can make,
  never take the room of the tenants bound in advance. A session under another key is
  refused, so is a claim of a deployment under another tenant than its first claim
  named. The binding outlives a restart of
  the actor for as long as a pool record of the tenant does (records hold the key).
- A pool answers only calls whose claim names its owner (same deployment id and tenant);
  any other create of its name, attach, destroy, adoption and lookup is refused with a
  ``ValueError`` naming the owner (never a proof); data calls on it fail per object.
- Keys outside the claim's key prefix are refused per object; a caller with no key
  prefix (the default deployment, or no claim) is refused every tenant's keys (those
  that start with ``t1.``) and reaches the others.
- A pool without an owner (made by an older raykv, or by a caller that sent no claim:
  *legacy*) is reachable only by callers that send no claim; a caller without a claim
  reaches no owned pool.

What this is and is not. Without a tenant, a claim is what the rank says it is: it keeps
deployments that share a node from using each other's pools by accident (two deployments
that pick the same pool name no longer share it silently), not against a caller that
lies. With a tenant, the claim needs the tenant secret (through its owner key), and the
tenant's keys are keyed page hashes only its processes can compute: that is the
boundary between tenants. Processes of the node actor's own uid can map every pool's
shared memory anyway (the files are theirs), as before.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from raykv.controllers.contract import StorageConfig
from raykv.controllers.deployments import deployment_id
from raykv.controllers.keys import TENANT_PREFIX_VERSION, KeyScheme, parse_prefix
from raykv.controllers.owner_keys import (
    HEX64,
    REGISTER,
    SESSION,
    Challenge,
    OwnerKey,
    RegistrationProof,
    SessionRequest,
    call_purpose,
    session_key,
    signature_valid,
    transcript,
)
from raykv.controllers.owner_sessions import Challenges, OwnerSessions
from raykv.controllers.tenancy import check_tenant, tenant_secret

MAX_TENANTS = 1024
"""Tenants one node actor (or the controller) binds at most (their keys are kept for
its life)."""
MAX_DEPLOYMENTS = 4096
"""Deployments one node actor binds at most of each kind (``kind_of``): without a
tenant, of tenants bound on first use, of tenants bound in advance. Each kind has a
table of its own, so claims that need no secret fill only theirs, never the room of the
tenants the operator bound. When a kind's table is full, its deployments that own no
pool here are forgotten first (oldest first)."""
UNTENANTED = "without a tenant"
FIRST_USE = "of tenants bound on first use"
IN_ADVANCE = "of tenants bound in advance"
MAX_ID_CHARS = 512
"""Longest deployment id or key prefix a claim may carry."""
TENANT_KEYS = TENANT_PREFIX_VERSION + "."
"""How every key of a tenant starts (its key prefix's version and first field)."""
DEFAULT_DEPLOYMENT = "default"
"""The one deployment without a key prefix (no tenant, model name or tag)."""


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
    """What a rank tells the node actor it is: its deployment, tenant, a call proof of
    the tenant's owner session (``controllers.owner_keys``; None without a tenant, and
    in a session's own request), and the key prefix of its deployment's keys
    (``KeyScheme.prefix``; ``""`` for the default deployment only)."""

    deployment_id: str
    tenant: str | None = None
    proof: str | None = field(default=None, repr=False)
    key_prefix: str = ""
    purpose: str = field(default="", init=False, repr=False, compare=False)
    """The call the verifier received the claim with (``call_purpose``), set by the
    verifier (``for_call``), never sent: it does not travel (neither pickled nor on the
    channel), so a claim no entry point bound to its call verifies for no call."""

    def __reduce__(self):
        return OwnerClaim, (self.deployment_id, self.tenant, self.proof, self.key_prefix)

    def for_call(self, purpose: str) -> OwnerClaim:
        """This claim as received with a call of ``purpose`` (the verifier's side)."""
        bound = OwnerClaim(self.deployment_id, self.tenant, self.proof, self.key_prefix)
        object.__setattr__(bound, "purpose", purpose)
        return bound

    @property
    def owner(self) -> Owner:
        return Owner(self.deployment_id, self.tenant)

    def without_proof(self) -> OwnerClaim:
        return OwnerClaim(self.deployment_id, self.tenant, None, self.key_prefix)

    def check_fields(self) -> OwnerClaim:
        """This claim if its deployment id, tenant and key prefix are well formed and
        agree (see the module docstring), else ``ValueError`` naming the problem. A
        tenant's prefix is parsed (``parse_prefix``): call it when a session opens, not
        per call."""
        self._check_shape()
        dep, prefix = self.deployment_id, self.key_prefix
        if self.tenant is None:
            if not prefix:
                if dep != DEFAULT_DEPLOYMENT:
                    raise ValueError(f"deployment {dep!r}: an owner claim cannot empty its "
                                     "key prefix (only the default deployment has none)")
            elif dep != prefix or not prefix.endswith("_") or prefix.startswith(TENANT_KEYS):
                raise ValueError(f"an owner claim without a tenant names deployment "
                                 f"{dep!r} by another key prefix than its own, or a "
                                 "tenant's")
            return self
        try:
            tenant = parse_prefix(prefix).tenant
        except ValueError:
            tenant = None
        if tenant != self.tenant or dep != prefix[:-1]:
            raise ValueError(f"tenant {self.tenant!r}: the owner claim's key prefix is not "
                             f"the tenant's key prefix of deployment {dep!r}")
        return self

    def _check_shape(self) -> None:
        for what, value in (("deployment id", self.deployment_id),
                            ("key prefix", self.key_prefix)):
            if type(value) is not str or len(value) > MAX_ID_CHARS:
                raise ValueError(f"an owner claim's {what} must be a str of at most "
                                 f"{MAX_ID_CHARS} characters")
        if not self.deployment_id:
            raise ValueError("an owner claim needs a deployment id")
        check_tenant(self.tenant)
        if self.tenant is None and self.proof is not None:
            raise ValueError("an owner claim without a tenant carries no proof")
        if self.proof is not None and (type(self.proof) is not str or len(self.proof) > 100):
            raise ValueError(f"tenant {self.tenant!r}: an owner claim's proof must be a "
                             "call proof of an owner session")


def for_call(claim: object, method: str, *args: object) -> object:
    """``claim`` (an ``OwnerClaim``; anything else as it is, for the verifier to refuse)
    bound to the call of ``method`` with positional ``args`` it came with (a node
    actor's entry points: ``OwnerClaim.for_call``, ``call_purpose``). A claim without a
    tenant carries no proof to check, so it is returned as it is (no digest of ``args``
    on the data path)."""
    if type(claim) is not OwnerClaim or claim.tenant is None:
        return claim
    return claim.for_call(call_purpose(method, *args))


def claim_of(config: StorageConfig) -> OwnerClaim:
    """The owner claim of a rank of ``config``, without a proof: ``deployment_id(config)``,
    its tenant and its key prefix."""
    return OwnerClaim(deployment_id(config), config.tenant, None,
                      KeyScheme.from_config(config).prefix)


def owner_key(tenant: str, environ: Mapping[str, str] = os.environ) -> OwnerKey:
    """The owner key of ``tenant`` from its secret in ``environ``; ``ValueError`` naming
    the fix if the secret is missing."""
    return OwnerKey.of_secret(tenant_secret(check_tenant(tenant), environ))


def tenant_digest(tenant: str, environ: Mapping[str, str] = os.environ) -> str:
    """The tenant digest of ``tenant`` whose secret is in ``environ``: its public owner
    key, 64 hex digits (what ``raykv tenant-digest`` prints for ``raykv up
    --tenant-digest``); ``ValueError`` naming the fix if the secret is missing. Reveals
    nothing of the secret."""
    return owner_key(tenant, environ).public


def bind_tenant_key(keys: dict[str, str], tenant: str, public: str, *, binder: str,
                    max_tenants: int = MAX_TENANTS, bound_only: bool = False) -> None:
    """Bind ``tenant`` to public owner key ``public`` in ``keys`` (tenant -> key, what
    ``binder``, e.g. "the controller", has bound: in advance or at first use), or check
    it against the bound one. ``ValueError`` with another key, when ``max_tenants`` are
    bound already, or, with ``bound_only``, for a tenant not bound in advance. Not
    thread-safe (the caller serialises)."""
    bound = keys.get(tenant)
    if bound is None:
        if bound_only:
            raise ValueError(f"tenant {tenant!r} is not bound on this cluster and {binder} "
                             "binds no tenant on first use (`raykv up --tenant-digest`)")
        if len(keys) >= max_tenants:
            raise ValueError(f"{binder} has bound {max_tenants} tenants; tenant {tenant!r} "
                             "is refused")
        keys[tenant] = public
    elif bound != public:
        raise ValueError(f"tenant {tenant!r}: the owner key differs from the one {binder} "
                         "bound for that tenant (another tenant secret)")


def verify_registration(challenges: Challenges, keys: dict[str, str], claim: OwnerClaim,
                        proof: object, *, bound_only: bool = False,
                        max_tenants: int = MAX_TENANTS) -> None:
    """The controller's check of a tenant's registration: ``proof`` must be a
    ``RegistrationProof`` over one of ``challenges`` (taken: good once) signed by the
    tenant's owner key, bound as ``bind_tenant_key`` does. ``ValueError`` otherwise;
    nothing is bound then."""
    claim.check_fields()
    if type(proof) is not RegistrationProof:
        raise ValueError(f"tenant {claim.tenant!r}: the controller needs a registration "
                         "proof signed with the tenant's owner key")
    challenges.take(proof.nonce)
    signed = transcript(REGISTER, proof.nonce, "", "", claim.deployment_id,
                        str(claim.tenant), claim.key_prefix)
    if not signature_valid(proof.public, signed, proof.signature):
        raise ValueError(f"tenant {claim.tenant!r}: the registration's signature does not "
                         "verify")
    bind_tenant_key(keys, str(claim.tenant), proof.public, binder="the controller",
                    max_tenants=max_tenants, bound_only=bound_only)


def check_tenant_digests(digests: object) -> dict[str, str]:
    """``digests`` as a dict of tenant name -> tenant digest (64 lowercase hex digits),
    else ``ValueError`` naming the bad entry."""
    if not isinstance(digests, Mapping):
        raise ValueError(f"tenant digests must be a mapping of tenant -> digest, got "
                         f"{type(digests).__name__}")
    for tenant, digest in digests.items():
        check_tenant(tenant)
        if not isinstance(digest, str) or not HEX64.fullmatch(digest):
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
    """What one node actor has bound (see the module docstring): per tenant its public
    owner key, per deployment its tenant, the open challenges and owner sessions.
    Thread-safe (one lock, held for dict work only, never for a signature check).
    ``keep(deployment_id)``: whether a deployment owns a pool here (never forgotten
    when its kind's deployment table is full, ``MAX_DEPLOYMENTS``)."""

    def __init__(self, keep: Callable[[str], bool] = lambda d: True, *,
                 digests: Mapping[str, str] | None = None, bound_only: bool = False,
                 max_tenants: int = MAX_TENANTS,
                 max_deployments: int = MAX_DEPLOYMENTS) -> None:
        """``digests``: tenant -> its tenant digest, bound from the start (checked by
        ``check_tenant_digests``); other tenants bind on first use, unless
        ``bound_only``."""
        self._keep = keep
        self._bound_only = bound_only
        self._max_tenants = max_tenants
        self._max_deployments = max_deployments
        self._lock = threading.Lock()
        self._keys: dict[str, str] = check_tenant_digests(digests or {})  # tenant -> key
        self._in_advance = frozenset(self._keys)
        self._tenants: dict[str, str | None] = {}  # deployment id -> its tenant
        self._counts = dict.fromkeys((UNTENANTED, FIRST_USE, IN_ADVANCE), 0)  # per kind
        self._challenges = Challenges()
        self._sessions = OwnerSessions()

    def challenge(self) -> Challenge:
        """A fresh challenge for ``open_session`` (anyone may ask; at most
        ``MAX_CHALLENGES`` are open, the oldest dropped)."""
        with self._lock:
            return self._challenges.issue()

    def open_session(self, claim: OwnerClaim, request: SessionRequest) -> str:
        """Open an owner session of a tenant's ``claim`` (without a proof) answering one
        of this node's challenges; returns its id. ``ValueError`` if the challenge is
        unknown, used or expired (each is taken by its first answer), the signature is
        not the tenant's owner key's over it, or the key or deployment contradicts what
        was bound; nothing is bound then."""
        if type(claim) is not OwnerClaim or claim.tenant is None or claim.proof is not None:
            raise ValueError("an owner session is opened by a tenant's owner claim "
                             "without a proof")
        if type(request) is not SessionRequest:
            raise ValueError(f"an owner session needs a SessionRequest, got "
                             f"{type(request).__name__}")
        claim.check_fields()
        with self._lock:
            mine = self._challenges.take(request.nonce)
        signed = transcript(SESSION, request.nonce, mine.public, request.ephemeral,
                            claim.deployment_id, claim.tenant, claim.key_prefix)
        if not signature_valid(request.public, signed, request.signature):
            raise ValueError(f"tenant {claim.tenant!r}: the owner session's signature does "
                             "not verify")
        key = session_key(mine.shared(request.ephemeral), signed)
        with self._lock:
            self._bind(claim.owner, request.public)
            return self._sessions.open(claim.deployment_id, claim.tenant, claim.key_prefix,
                                       key)

    def verify(self, claim: OwnerClaim | None) -> OwnerClaim | None:
        """``claim`` once it is well formed, its call proof (a tenant's) is accepted
        (once) and its deployment agrees with what was bound (binding it if it was
        not); None stays None (a caller without a claim). ``ValueError`` naming the
        conflict otherwise, ``UnknownSessionError`` for a session not open here."""
        if claim is None:
            return None
        if type(claim) is not OwnerClaim:
            raise ValueError(f"an owner claim must be an OwnerClaim, got "
                             f"{type(claim).__name__}")
        if claim.tenant is None:
            claim.check_fields()
        else:
            claim._check_shape()
            if claim.proof is None:
                raise ValueError(f"tenant {claim.tenant!r}: the owner claim needs a call "
                                 "proof of an owner session")
        with self._lock:
            if claim.tenant is not None:  # the session's claim was checked at its opening
                self._sessions.check(claim.deployment_id, claim.tenant, claim.key_prefix,
                                     claim.proof, claim.purpose)
            self._bind(claim.owner, self._keys.get(claim.tenant) if claim.tenant else None)
        return claim

    def bind(self, owner: Owner, key: str | None) -> None:
        """Bind ``owner``'s tenant to public owner ``key`` and its deployment to its
        tenant, or check them against what was bound (``ValueError`` on a conflict).
        Pool records call this at restart with the key they hold (bound even with
        ``bound_only``: the tenant had it before)."""
        with self._lock:
            self._bind(owner, key, restart=True)

    def _bind(self, owner: Owner, key: str | None, restart: bool = False) -> None:
        tenant, dep = owner.tenant, owner.deployment_id
        if tenant is not None:
            if key is None:
                raise ValueError(f"tenant {tenant!r}: no owner key bound")
            bind_tenant_key(self._keys, tenant, key, binder="this node actor",
                            max_tenants=self._max_tenants,
                            bound_only=self._bound_only and not restart)
        if dep in self._tenants:
            if self._tenants[dep] != tenant:
                was = self._tenants[dep]
                raise ValueError(
                    f"deployment {dep!r} was claimed on this node " +
                    (f"by tenant {was!r}" if was else "without a tenant") +
                    (f", not by tenant {tenant!r}" if tenant else ", not without one"))
        else:
            kind = self.kind_of(tenant)
            self._make_room(kind)
            self._tenants[dep] = tenant
            self._counts[kind] += 1

    def kind_of(self, tenant: str | None) -> str:
        """Which deployment table a deployment of ``tenant`` (None: none) counts in:
        ``UNTENANTED``, ``IN_ADVANCE`` (its tenant is in the digests this node started
        with) or ``FIRST_USE``."""
        if tenant is None:
            return UNTENANTED
        return IN_ADVANCE if tenant in self._in_advance else FIRST_USE

    def _make_room(self, kind: str) -> None:
        """With the lock held: forget the oldest deployments of ``kind`` that own no
        pool here until one more fits in its table; ``ValueError`` if none can go."""
        while self._counts[kind] >= self._max_deployments:
            old = next((d for d, t in self._tenants.items()
                        if self.kind_of(t) == kind and not self._keep(d)), None)
            if old is None:
                raise ValueError(f"this node actor has bound {self._max_deployments} "
                                 f"deployments {kind} that all own pools here; no other "
                                 f"deployment {kind} is bound until one of their pools "
                                 "is destroyed")
            del self._tenants[old]
            self._counts[kind] -= 1

    def claimed(self, deployment: str) -> bool:
        """Whether a claim of ``deployment`` was bound here."""
        with self._lock:
            return deployment in self._tenants

    def digest(self, tenant: str | None) -> str | None:
        """The tenant digest (public owner key) bound for ``tenant`` (None: none, or no
        tenant)."""
        if tenant is None:
            return None
        with self._lock:
            return self._keys.get(tenant)
