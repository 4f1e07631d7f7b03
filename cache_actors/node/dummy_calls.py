"""A standalone node's data calls through its dummy client, sent again when they failed on
a connection to a ``mooncake_client`` that has died.

Mooncake 0.3.13's dummy client keeps a pool of RPC connections to its
``mooncake_client``, one per call it had in flight at once. When that process dies and
is restarted on the same port (``client_supervisor``), the dummy's ping thread
reconnects, but the connections left in the pool still lead to the dead process: each
fails the next call that draws it ("End of file" in the dummy's log, the whole call
``RPC_FAIL``), then is dropped. Without a retry, a node call minutes after the restart
reported such a failure as the objects' own codes: a put's existence check answered -1
for every key, and the put counted its pages not stored (``NOT_CONFIRMED``).

So a call whose every object failed the way a broken call fails (exists: every key
-1 or ``RPC_FAIL``; put, get, remove: every object ``RPC_FAIL``), that failed at once
(a dead connection answers at once; a call that failed slowly is not sent again: the
server may be alive and busy) and while ``mooncake_client`` is up (``up``: while it is
down or being reconnected every call fails so, and the node's own probes expect that)
is sent again, up to ``REDIALS`` times: each retry draws another connection, and the
pool holds no more dead ones than the calls it had in flight at once. A call to a dead
connection never reached a live server, so sending it again moves nothing twice.
Threads: any (the wrapped client is thread-safe).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from raykv.controllers.result_codes import RPC_FAIL

log = logging.getLogger(__name__)

REDIALS = 16
"""Retries of one call: more than the calls one node's threads have in flight at once
(the dead connections a pool can hold)."""
AT_ONCE_S = 1.0
"""A failed call that took longer than this is not sent again (not a dead connection)."""
EXISTS_BROKEN = (-1, RPC_FAIL)
"""What a dummy's ``batch_is_exist`` answers for every key when its call broke."""


def broken(codes: Sequence[int], signs: Sequence[int]) -> bool:
    """Whether ``codes`` are a broken call's: not empty, every one of ``signs``."""
    return bool(codes) and all(int(c) in signs for c in codes)


class DummyCalls:
    """``store`` (a dummy ``MooncakeDistributedStore``) whose batch calls are sent again
    while they failed as a dead connection fails and ``up()`` says ``mooncake_client`` is
    up (module docstring); every other attribute is the store's own. ``redials``: the
    retries of one call."""

    def __init__(self, store, up: Callable[[], bool], redials: int = REDIALS) -> None:
        self._store = store
        self._up = up
        self._redials = redials

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def _call(self, fn: Callable[[], Sequence[int]], signs: Sequence[int],
              name: str) -> list[int]:
        sent = 0
        while True:
            t = time.monotonic()
            codes = list(fn())
            if not broken(codes, signs) or time.monotonic() - t > AT_ONCE_S or \
                    not self._up() or sent == self._redials:
                break
            sent += 1
        if sent:
            log.warning("%s failed on %d dead connections to mooncake_client; sent "
                        "again", name, sent)
        return codes

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self._call(lambda: self._store.batch_is_exist(keys), EXISTS_BROKEN,
                          "batch_is_exist")

    def batch_put_from(self, *args) -> list[int]:
        return self._call(lambda: self._store.batch_put_from(*args), (RPC_FAIL,),
                          "batch_put_from")

    def batch_get_into(self, *args) -> list[int]:
        return self._call(lambda: self._store.batch_get_into(*args), (RPC_FAIL,),
                          "batch_get_into")

    def batch_remove(self, *args) -> list[int]:
        return self._call(lambda: self._store.batch_remove(*args), (RPC_FAIL,),
                          "batch_remove")
