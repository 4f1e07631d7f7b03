"""A tenant's owner key and the owner sessions it opens (pure: no Ray, no Mooncake).

An owner proves it holds its tenant's secret by answering a fresh challenge, never by
a token that could be shown twice:

- The **owner key** is an Ed25519 key pair derived from the tenant secret
  (``OwnerKey.of_secret``: the same secret gives the same key in every process; its
  seed is the secret's owner-key sub-key, ``tenancy.sub_key``, which no other use of
  the secret can yield). Its
  public half, 64 hex digits, is the **tenant digest**: what node actors and the
  controller bind for the tenant (``raykv tenant-digest`` prints it). It reveals nothing
  of the secret; the private half never leaves the rank process.
- A verifier (a node actor, the controller) hands out a **challenge**: a fresh random
  nonce and an ephemeral X25519 public key (``Challenge``), good for one answer.
- The rank answers with its own ephemeral X25519 public key and its owner key's
  signature over the **transcript**: purpose, nonce, both ephemeral keys and the claim
  (deployment id, tenant, key prefix), every field length-prefixed. A node actor that
  verifies it opens an **owner session**: both ends derive the session key from the
  X25519 exchange and the transcript (``session_key``); the key never travels.
- Each later call of the session names it with a **call proof** (``call_proof``): the
  session id, a call number and an HMAC under the session key of both and of the call's
  **purpose** (``call_purpose``: the method called and a digest of its positional
  arguments, not of a data call's ticket or deadline, which travel by keyword; a
  channel connection's bind is method ``channel``, without arguments). The verifier
  computes the purpose from the call it received, never takes it from the caller
  (``OwnerClaim.for_call``). A call number is accepted once
  (``CallWindow``), so a proof seen on the wire is worth nothing to whoever saw it:
  not for another call, nor, spent first, for another method or other positional
  arguments (a proof of a ``put`` is no proof of a ``destroy_pool``); nobody without the session
  key can make another.

The controller uses challenges without sessions: a registration carries the signature
of a transcript over the controller's nonce (``RegistrationProof``).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import re
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)
from raykv.controllers.tenancy import OWNER_KEY, sub_key

_TRANSCRIPT_LABEL = b"raykv/owner-transcript/v1"
HEX64 = re.compile(r"[0-9a-f]{64}")
"""A public key or nonce: 32 bytes as 64 lowercase hex digits."""
SIGNATURE = re.compile(r"[0-9a-f]{128}")
"""An Ed25519 signature: 64 bytes as 128 lowercase hex digits."""
CALL_PROOF = re.compile(r"([0-9a-f]{32})\.([0-9]{1,18})\.([0-9a-f]{32})")
"""A call proof: session id, call number, tag."""
SESSION = "session"
"""The purpose of a transcript that opens an owner session (node actors)."""
REGISTER = "register"
"""The purpose of a transcript that registers a rank (the controller)."""


class OwnerKey:
    """A tenant's owner key (see the module docstring). Never pickled: it would carry
    what the secret gives to whoever reads the pickle."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public = private.public_key().public_bytes_raw().hex()
        """The tenant digest: the public key, 64 hex digits."""

    @classmethod
    def of_secret(cls, secret: bytes) -> OwnerKey:
        """The owner key of a tenant secret: Ed25519 seeded with the secret's
        ``OWNER_KEY`` sub-key (``tenancy.sub_key``; deterministic, and the seed reveals
        nothing of the secret nor of its other sub-keys)."""
        return cls(Ed25519PrivateKey.from_private_bytes(sub_key(secret, OWNER_KEY)))

    def sign(self, message: bytes) -> str:
        """The signature of ``message``, 128 hex digits."""
        return self._private.sign(message).hex()

    def __reduce__(self):
        raise TypeError("an OwnerKey is never pickled (it holds what the tenant secret "
                        "gives); derive it in each process from $RAYKV_TENANT_SECRET")

    def __repr__(self) -> str:
        return f"OwnerKey(public={self.public[:12]}...)"


def signature_valid(public: str, message: bytes, signature: str) -> bool:
    """Whether ``signature`` (128 hex digits) is ``public``'s (64 hex digits) over
    ``message``; False for anything malformed."""
    if (type(public) is not str or not HEX64.fullmatch(public)
            or type(signature) is not str or not SIGNATURE.fullmatch(signature)):
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public)).verify(
            bytes.fromhex(signature), message)
    except (InvalidSignature, ValueError):
        return False
    return True


def transcript(purpose: str, nonce: str, verifier_key: str, rank_key: str,
               deployment_id: str, tenant: str, key_prefix: str) -> bytes:
    """What a rank signs: every field UTF-8, each after its length (4 bytes, big
    endian), after a fixed label, so no two field lists give one transcript."""
    out = [_TRANSCRIPT_LABEL]
    for value in (purpose, nonce, verifier_key, rank_key, deployment_id, tenant,
                  key_prefix):
        raw = value.encode()
        out.append(struct.pack(">I", len(raw)) + raw)
    return b"".join(out)


@dataclass(frozen=True)
class Challenge:
    """What a verifier hands out: a fresh ``nonce`` and its ephemeral X25519 public
    ``key`` (64 hex digits each), good for one answer."""

    nonce: str
    key: str


class Ephemeral:
    """One side's ephemeral X25519 key: ``public`` (64 hex digits) and the shared secret
    with another side's public key (``shared``; ``ValueError`` if it is malformed)."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes_raw().hex()

    def shared(self, other: str) -> bytes:
        if type(other) is not str or not HEX64.fullmatch(other):
            raise ValueError("an ephemeral key must be 64 hex digits")
        return self._private.exchange(X25519PublicKey.from_public_bytes(bytes.fromhex(other)))

    def __reduce__(self):
        raise TypeError("an ephemeral key is never pickled")


def session_key(shared: bytes, signed: bytes) -> bytes:
    """The key of an owner session: HMAC-SHA256 of the signed transcript under the X25519
    shared secret (both ends compute it; it never travels)."""
    return hmac.new(shared, signed, hashlib.sha256).digest()


def call_purpose(method: str, *args: object) -> str:
    """What one call does, for its proof: ``method`` and a SHA-256 digest of the
    ``repr`` of its positional arguments (those before the owner claim, as the verifier
    receives them: plain data, whose ``repr`` is the same in both processes)."""
    digest = hashlib.sha256(repr(args).encode()).hexdigest()[:32]
    return f"{method}:{digest}"


def call_tag(key: bytes, session_id: str, number: int, purpose: str) -> str:
    """The tag of call ``number`` of a session for ``purpose`` (``call_purpose``):
    HMAC-SHA256 under its key, 32 hex digits (128 bits)."""
    return hmac.new(key, f"{session_id}.{number}.{purpose}".encode(),
                    hashlib.sha256).hexdigest()[:32]


class RankSession:
    """A rank's end of one owner session: its id, its key and the next call number.
    ``call_proof()`` is thread-safe (``next`` on a counter is atomic under the GIL)."""

    def __init__(self, session_id: str, key: bytes) -> None:
        self.session_id = session_id
        self._key = key
        self._numbers = itertools.count(1)

    def call_proof(self, purpose: str) -> str:
        """A proof for one call of ``purpose`` (``call_purpose``): ``"<session id>.<call
        number>.<tag>"``, never the same twice."""
        n = next(self._numbers)
        return f"{self.session_id}.{n}.{call_tag(self._key, self.session_id, n, purpose)}"

    def __reduce__(self):
        raise TypeError("an owner session is never pickled")

    def __repr__(self) -> str:
        return f"RankSession({self.session_id[:8]}...)"


@dataclass(frozen=True)
class SessionRequest:
    """A rank's answer to a node actor's challenge: the challenge's ``nonce``, the
    rank's ephemeral public key and its tenant digest (``public``), and the owner key's
    ``signature`` over the transcript. Names no secret: seen on the wire, it opens
    nothing (its nonce is good once)."""

    nonce: str
    ephemeral: str
    public: str
    signature: str


def answer_challenge(key: OwnerKey, challenge: Challenge, deployment_id: str, tenant: str,
                     key_prefix: str) -> tuple[SessionRequest, bytes]:
    """The rank's answer to ``challenge`` and the key of the session it opens once the
    node actor accepts it."""
    mine = Ephemeral()
    signed = transcript(SESSION, challenge.nonce, challenge.key, mine.public,
                        deployment_id, tenant, key_prefix)
    request = SessionRequest(challenge.nonce, mine.public, key.public, key.sign(signed))
    return request, session_key(mine.shared(challenge.key), signed)


@dataclass(frozen=True)
class RegistrationProof:
    """A registration's proof for the controller: its challenge's ``nonce``, the tenant
    digest (``public``) and the signature of the ``REGISTER`` transcript (no ephemeral
    keys: a registration opens no session)."""

    nonce: str
    public: str
    signature: str


def prove_registration(key: OwnerKey, nonce: str, deployment_id: str, tenant: str,
                       key_prefix: str) -> RegistrationProof:
    """The proof of one registration of a rank of ``tenant`` over the controller's
    ``nonce``."""
    signed = transcript(REGISTER, nonce, "", "", deployment_id, tenant, key_prefix)
    return RegistrationProof(nonce, key.public, key.sign(signed))


def fresh_nonce() -> str:
    """32 random bytes, 64 hex digits."""
    return os.urandom(32).hex()
