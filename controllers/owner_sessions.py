"""A verifier's side of owner challenges and sessions (pure: no Ray, no Mooncake).

``Challenges``: the challenges a node actor or the controller handed out and not yet
taken back, each good for one answer within ``CHALLENGE_TTL_S``, at most
``MAX_CHALLENGES`` (the oldest is dropped for a new one). ``OwnerSessions``: a node
actor's open owner sessions and the call numbers each accepted (``CallWindow``), at
most ``MAX_SESSIONS_PER_TENANT`` per tenant (a tenant's least recently used session
closes for its new one, so only a tenant's own sessions push each other out). The
protocol: ``controllers.owner_keys``. Neither class is thread-safe: the caller holds
its lock (``OwnerBindings``, the controller's single thread).
"""

from __future__ import annotations

import hmac
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from raykv.controllers.owner_keys import CALL_PROOF, Challenge, Ephemeral, call_tag, fresh_nonce

MAX_CHALLENGES = 1024
"""Challenges one verifier keeps open at most."""
CHALLENGE_TTL_S = 60.0
"""Seconds a challenge can be answered."""
MAX_SESSIONS_PER_TENANT = 256
"""Owner sessions one node actor keeps open per tenant (a rank holds one per node actor
it calls: its own node's, and the home nodes of its group queries)."""
CALL_WINDOW = 4096
"""How far below the highest call number of a session a call may come (calls of one
session run concurrently and may arrive out of order); each number is accepted once."""


class UnknownSessionError(LookupError):
    """A call proof names a session this node actor does not hold (it restarted, or the
    session was closed to make room): the rank opens a new one."""


class Challenges:
    """Open challenges: nonce -> (the verifier's ephemeral key, when it expires)."""

    def __init__(self, max_open: int = MAX_CHALLENGES, ttl_s: float = CHALLENGE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._open: OrderedDict[str, tuple[Ephemeral, float]] = OrderedDict()
        self._max = max_open
        self._ttl = ttl_s
        self._clock = clock

    def issue(self) -> Challenge:
        """A fresh challenge, kept until answered, expired or pushed out."""
        now = self._clock()
        while self._open and (len(self._open) >= self._max
                              or next(iter(self._open.values()))[1] <= now):
            self._open.popitem(last=False)
        nonce, mine = fresh_nonce(), Ephemeral()
        self._open[nonce] = (mine, now + self._ttl)
        return Challenge(nonce, mine.public)

    def take(self, nonce: object) -> Ephemeral:
        """The ephemeral key of challenge ``nonce``, which is then gone (one answer per
        challenge, right or wrong); ``ValueError`` if it is unknown, answered already or
        expired."""
        entry = self._open.pop(nonce, None) if isinstance(nonce, str) else None
        if entry is None or entry[1] <= self._clock():
            raise ValueError("the challenge is unknown, answered already or expired: ask "
                             "for a new one")
        return entry[0]

    def __len__(self) -> int:
        return len(self._open)


class CallWindow:
    """The call numbers one session accepted: a number is accepted once, if it is above
    the highest seen or at most ``size`` below it."""

    def __init__(self, size: int = CALL_WINDOW) -> None:
        self._size = size
        self._high = 0
        self._seen: set[int] = set()

    def accept(self, number: int) -> bool:
        if number <= self._high - self._size or number in self._seen:
            return False
        self._seen.add(number)
        if number > self._high:
            self._high = number
            if len(self._seen) > 2 * self._size:
                self._seen = {n for n in self._seen if n > self._high - self._size}
        return True


@dataclass
class _Session:
    deployment_id: str
    tenant: str
    key_prefix: str
    key: bytes = field(repr=False)
    window: CallWindow = field(default_factory=CallWindow)


class OwnerSessions:
    """Open owner sessions by id (see the module docstring)."""

    def __init__(self, max_per_tenant: int = MAX_SESSIONS_PER_TENANT) -> None:
        self._max = max_per_tenant
        self._by_tenant: dict[str, OrderedDict[str, _Session]] = {}
        self._sessions: dict[str, _Session] = {}

    def open(self, deployment_id: str, tenant: str, key_prefix: str, key: bytes) -> str:
        """A new session of that claim with session key ``key``; returns its id (32 hex
        digits)."""
        mine = self._by_tenant.setdefault(tenant, OrderedDict())
        while len(mine) >= self._max:
            old, _ = mine.popitem(last=False)
            del self._sessions[old]
        session_id = os.urandom(16).hex()
        mine[session_id] = self._sessions[session_id] = _Session(deployment_id, tenant,
                                                                key_prefix, key)
        return session_id

    def check(self, deployment_id: str, tenant: str, key_prefix: str, proof: str,
              purpose: str) -> None:
        """Accept call ``proof`` of a claim of these fields, for a call of ``purpose``
        (``call_purpose``, as the verifier computed it from the call), once;
        ``ValueError`` if it is malformed, of another claim, forged, made for another
        purpose or shown before, ``UnknownSessionError`` if its session is not open
        here."""
        m = CALL_PROOF.fullmatch(proof)
        if m is None:
            raise ValueError(f"tenant {tenant!r}: the owner claim needs a call proof of an "
                             "owner session")
        session_id, number, tag = m[1], int(m[2]), m[3]
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSessionError(f"tenant {tenant!r}: this node actor holds no such "
                                      "owner session (it restarted or closed it): open one "
                                      "again")
        if (session.deployment_id, session.tenant, session.key_prefix) != (
                deployment_id, tenant, key_prefix):
            raise ValueError(f"tenant {tenant!r}: the call proof is of another owner "
                             "session's claim")
        if not hmac.compare_digest(call_tag(session.key, session_id, number, purpose), tag):
            raise ValueError(f"tenant {tenant!r}: the call proof does not verify (not made "
                             "with the owner session's key, or for another call)")
        if not session.window.accept(number):
            raise ValueError(f"tenant {tenant!r}: the call proof was shown before (a "
                             "replay) or is too old")
        self._by_tenant[tenant].move_to_end(session_id)

    def __len__(self) -> int:
        return len(self._sessions)
