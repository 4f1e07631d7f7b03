"""A standalone node's data calls through its dummy client, sent again when they failed on
a connection to a ``mooncake_client`` that has died.

Mooncake 0.3.13's dummy client keeps a pool of RPC connections to its
``mooncake_client``, one per call it had in flight at once, and a ping thread that
pings it every second through that pool. When the process dies and is restarted on the
same port (``client_supervisor``), the connections left in the pool still lead to the
dead one: each fails the next call that draws it ("End of file" in the dummy's log, the
whole call ``RPC_FAIL``), then is dropped; when the ping thread draws one, the dummy
counts itself disconnected and fails every call at once ("Dummy Client not connected")
until its reconnection loop got through again (it retries every 2 s). The node's own
reconnection wait (``NodeStore``) needs only one call to get through, so for seconds
after it the node's calls could still fail this way, and the node reported that as the
objects' own codes: a put's existence check answered -1 for every key, and the put
counted its pages not stored (``NOT_CONFIRMED``).

So a call whose every object failed the way a broken call fails (exists: every key
-1 or ``RPC_FAIL``; put, get, remove: every object ``RPC_FAIL``), that failed at once
(a dead connection or a disconnected dummy answers at once; a call that failed slowly
is not sent again: the server may be alive and busy) and while ``mooncake_client`` is
up (``up``: while it is down or being reconnected by the node every call fails so, and
the node's own probes expect that) is sent again, after a pause that doubles from
``FIRST_PAUSE_S``, until ``REDIAL_S`` after the first attempt: longer than the dummy's
reconnection interval. A call that broke never reached a live server (its connection
led to a dead process, or it was refused before being sent), so sending it again moves
nothing twice.
Threads: any (the wrapped client is thread-safe).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from raykv.controllers.result_codes import RPC_FAIL

log = logging.getLogger(__name__)

REDIAL_S = 5.0
"""How long after its first attempt a broken call is still sent again: more than the
dummy's 2 s between reconnection attempts, twice."""
FIRST_PAUSE_S = 0.02
"""The pause before the first retry; each next one doubles, up to ``MAX_PAUSE_S``."""
MAX_PAUSE_S = 0.5
AT_ONCE_S = 1.0
"""A failed call that took longer than this is not sent again (not a dead connection)."""
EXISTS_BROKEN = (-1, RPC_FAIL)
"""What a dummy's ``batch_is_exist`` answers for every key when its call broke."""


def broken(codes: Sequence[int], signs: Sequence[int]) -> bool:
    """Whether ``codes`` are a broken call's: not empty, every one of ``signs``."""
    return bool(codes) and all(int(c) in signs for c in codes)


class DummyCalls:
    """``store`` (a dummy ``MooncakeDistributedStore``) whose batch calls are sent again
    while they failed as a broken call fails and ``up()`` says ``mooncake_client`` is up
    (module docstring); every other attribute is the store's own. ``redial_s``: how long
    a broken call is sent again."""

    def __init__(self, store, up: Callable[[], bool], redial_s: float = REDIAL_S) -> None:
        self._store = store
        self._up = up
        self._redial_s = redial_s

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def _call(self, fn: Callable[[], Sequence[int]], signs: Sequence[int],
              name: str) -> list[int]:
        first = time.monotonic()
        sent, pause = 0, FIRST_PAUSE_S
        while True:
            t = time.monotonic()
            codes = list(fn())
            if not broken(codes, signs) or time.monotonic() - t > AT_ONCE_S or \
                    not self._up() or t - first + pause > self._redial_s:
                break
            time.sleep(pause)
            sent, pause = sent + 1, min(2 * pause, MAX_PAUSE_S)
        if sent:
            log.warning("%s broke on its connection to mooncake_client; sent again %d "
                        "times, %s", name, sent,
                        "then failed" if broken(codes, signs) else "then answered")
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
