"""A rank's owner: the claim it names itself with, and the owner sessions behind it.

A rank without a tenant names itself with its owner claim as is (``claim_of``). A rank
with a tenant holds the tenant's owner key (``controllers.owner_keys``, derived from
``$RAYKV_TENANT_SECRET`` once, when its ``CacheClient`` is made) and opens one owner
session per node actor it calls (its own node's; the home nodes of its group queries)
at its first call there: the actor's challenge, then the signed answer (two Ray calls,
~1 ms of signing and key exchange). Every later call, and every channel connection,
carries a fresh call proof of that session, good once and for that call's method and
arguments only. After a re-attach (the actor may
have restarted) the sessions are forgotten and opened again. A registration with the
controller signs the controller's own challenge (``registration_proof``).

Threads: any thread of the rank may ask for a claim; two threads that find no session
for one actor at once each open one (both stay valid).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from raykv.controllers.contract import StorageConfig
from raykv.controllers.owner_keys import (
    Challenge,
    OwnerKey,
    RankSession,
    RegistrationProof,
    answer_challenge,
    prove_registration,
)
from raykv.controllers.ownership import OwnerClaim, claim_of, owner_key

Ask = Callable[..., Any]
"""``ask(method, *args)``: one call of an actor's ``method``, its result."""


class RankOwner:
    """The owner claim of one rank (``claim``), and with a tenant its owner key and
    sessions. Never pickled (it holds what the tenant secret gives)."""

    def __init__(self, base: OwnerClaim, key: OwnerKey | None = None) -> None:
        self.base = base
        self._key = key
        self._sessions: dict[str, RankSession] = {}
        self._lock = threading.Lock()

    @classmethod
    def of_config(cls, config: StorageConfig,
                  environ: Mapping[str, str] = os.environ) -> RankOwner:
        """The owner of a rank of ``config``; with a tenant its owner key from the
        tenant secret in ``environ`` (``ValueError`` naming the fix if it is missing)."""
        tenant = config.tenant
        return cls(claim_of(config), owner_key(tenant, environ) if tenant else None)

    def claim(self, actor: str, ask: Ask, purpose: str) -> OwnerClaim:
        """The claim for one call of ``purpose`` (``owner_keys.call_purpose``: the
        method and its arguments) to ``actor`` (a name for its session): the base claim
        without a tenant; with one, a fresh call proof of the session with that actor
        for that call, the session opened first through ``ask`` if there is none
        (``ValueError`` if the actor refuses it)."""
        if self._key is None:
            return self.base
        return replace(self.base, proof=self.session(actor, ask).call_proof(purpose))

    def session(self, actor: str, ask: Ask) -> RankSession | None:
        """The owner session with ``actor``, opened through ``ask`` if there is none
        (``ValueError`` if the actor refuses it); None without a tenant."""
        if self._key is None:
            return None
        session = self._sessions.get(actor)
        if session is None:
            session = self._open(ask)
            with self._lock:
                self._sessions[actor] = session
        return session

    def _open(self, ask: Ask) -> RankSession:
        assert self._key is not None
        challenge = ask("challenge")
        if type(challenge) is not Challenge:
            raise ValueError(f"the node actor answered a challenge with "
                             f"{type(challenge).__name__}")
        b = self.base
        request, key = answer_challenge(self._key, challenge, b.deployment_id,
                                        str(b.tenant), b.key_prefix)
        return RankSession(ask("open_session", b, request), key)

    def registration_proof(self, ask: Ask) -> RegistrationProof | None:
        """The proof of one registration with the controller (``ask``: a call of it),
        over its fresh challenge; None without a tenant."""
        if self._key is None:
            return None
        challenge = ask("challenge")
        b = self.base
        return prove_registration(self._key, challenge.nonce, b.deployment_id,
                                  str(b.tenant), b.key_prefix)

    def forget(self) -> None:
        """Drop every session (they are opened again at the next call)."""
        with self._lock:
            self._sessions.clear()

    def __reduce__(self):
        raise TypeError("a rank's owner is never pickled (it holds what the tenant "
                        "secret gives)")
