"""Clearing one deployment's objects from the store (a node actor's ``clear_objects``).

The caller's owner claim is checked by the node actor (``NodeService.verify``: a
tenant's proof) and names the deployment; its objects are named by one key pattern
made from that claim (``cache_actors.node.clear_scope``: never another deployment's or
tenant's keys) and removed by the master, non-forced: Mooncake keeps an object that a
lease holds (a lookup or a read reported it within the master's
``default_kv_lease_ttl``, 10 s by default; raykv's own put confirms what it stored with
a lookup). A forced remove would free memory a reader may still be copying from, so a
clear waits the leases out instead:

1. remove every matching object no lease holds;
2. put a probe object of this call and look it up: it is now leased exactly as long as
   the master leases anything, so every lease granted before step 2 has ended once the
   probe can be removed without force; poll that every ``LEASE_POLL_S``;
3. remove every matching object again.

What a clear leaves: objects a reader looked up or read again while it ran (their new
lease outlives it), and objects written meanwhile after step 3. A clear takes about one
lease (step 2). One clear at a time per node actor; a call that cannot finish by its
deadline raises ``DeadlineExceededError`` (what it removed stays removed; the master's
own removal cannot be interrupted, so a pass under way when the deadline passes may
still remove objects afterwards).

Confirmed pages (``controllers.confirmed_pages``) stay valid: a confirmed page is
leased, and a clear never removes a leased object.

Threads: any thread may call ``clear`` (the node actor calls it off its event loops);
``_lock`` makes clears on one node actor take turns.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from raykv.cache_actors.errors import DeadlineExceededError
from raykv.cache_actors.node.clear_scope import clear_pattern
from raykv.cache_actors.node.node_store import NodeStore
from raykv.controllers.ownership import OwnerClaim
from raykv.controllers.result_codes import OBJECT_HAS_LEASE

log = logging.getLogger(__name__)

CLEAR_WAIT_S = 60.0
"""Longest a clear may take on the node actor, waiting for an earlier clear included,
in seconds (a master whose lease is longer than this cannot be cleared)."""
LEASE_POLL_S = 0.2
"""Seconds between two tries to remove the probe object."""
PROBE_PREFIX = "raykv-lease-probe-"
"""First characters of a probe object's key (it has no ``_``: no clear pattern of
``cache_actors.node.clear_scope`` matches it)."""


class DeploymentClear:
    """The clears of one node actor (module docstring): ``store`` its store,
    ``verify`` its check of an owner claim (``ValueError`` if refused)."""

    def __init__(self, store: NodeStore, verify: Callable[[OwnerClaim | None],
                                                          OwnerClaim | None],
                 node_id: str) -> None:
        self._store = store
        self._backend = store.backend
        self._verify = verify
        self._node = node_id[:12]
        self._lock = threading.Lock()

    def clear(self, claim: OwnerClaim | None) -> int:
        """Remove the objects of ``claim``'s deployment within ``CLEAR_WAIT_S``; the
        number removed. ``ValueError`` for a refused claim or a deployment that cannot
        be cleared (no key prefix), ``DeadlineExceededError`` past the deadline,
        ``StoreUnavailableError`` while ``mooncake_client`` is down (standalone),
        ``RuntimeError`` naming the code of any other store error."""
        checked = self._verify(claim)
        pattern = clear_pattern(checked)
        self._store.before_call()
        removed = self.run(pattern, time.monotonic() + CLEAR_WAIT_S)
        log.info("cleared %d objects of deployment %r", removed, checked.deployment_id)
        return removed

    def run(self, pattern: str, deadline: float) -> int:
        """Remove every object whose key ``pattern`` matches (module docstring) by
        ``deadline`` (``time.monotonic()`` seconds); the number removed. Errors as
        ``clear``."""
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise DeadlineExceededError("an earlier clear on this node did not end in time")
        try:
            removed = self._remove(pattern)
            self._wait_out_leases(deadline)
            return removed + self._remove(pattern)
        finally:
            self._lock.release()

    def _remove(self, pattern: str) -> int:
        n = self._backend.remove_matching(pattern)
        if n < 0:
            raise RuntimeError(f"the store did not remove the objects (code {n})")
        return n

    def _wait_out_leases(self, deadline: float) -> None:
        """Return once every lease the master granted before this call has ended (steps
        2 of the module docstring); the probe object is gone either way."""
        key = f"{PROBE_PREFIX}{self._node}-{uuid.uuid4().hex}"
        rc = self._backend.put_bytes(key, b"\0")
        if rc != 0:
            raise RuntimeError(f"the store did not take the lease probe (code {rc})")
        try:
            if self._backend.exists([key]) != [1]:
                raise RuntimeError("the store did not report the lease probe present")
            while (rc := self._backend.remove_unleased(key)) != 0:
                if rc != OBJECT_HAS_LEASE:
                    raise RuntimeError(f"the store did not remove the lease probe (code {rc})")
                if time.monotonic() >= deadline:
                    raise DeadlineExceededError("the store's leases did not end before the "
                                                "clear's deadline")
                time.sleep(LEASE_POLL_S)
        except BaseException:
            self._backend.remove([key])  # forced: nobody else knows the probe's key
            raise
