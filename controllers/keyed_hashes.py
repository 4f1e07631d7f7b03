"""A rank's page hashes as its object keys hold them (pure: no Ray, no Mooncake).

Without a tenant a page hash is used as the engine gave it (SGLang-compatible keys).
With one, every page hash is replaced by its *keyed page hash*
(``tenancy.keyed_page_hash`` under the tenant secret's page-hash sub-key) where it enters
the rank's ``CacheClient``, once, before a ``KeyScheme`` tags it: only keyed hashes leave
the rank process, so neither the controller nor a node actor ever holds the secret.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from raykv.controllers.contract import PoolTransfer
from raykv.controllers.tenancy import keyed_page_hash, page_key
from raykv.controllers.transfer_plan import check_keys


class KeyedHashes:
    """Maps page hashes (and the keys of ``PoolTransfer``s) to the ones object keys are
    made of: keyed under the page-hash sub-key of the tenant secret ``secret``
    (``tenancy.page_key``: it holds that sub-key, not the secret), or unchanged when
    ``secret`` is None (no tenant).

    Stateless after construction: any thread may call it. Its ``repr`` never shows the
    key, and it is never pickled (``TypeError``): the key stays in its process.
    """

    def __init__(self, secret: bytes | None) -> None:
        self._key = None if secret is None else page_key(secret)

    def __repr__(self) -> str:
        return f"KeyedHashes(keyed={self._key is not None})"

    def __reduce__(self):
        raise TypeError("KeyedHashes are never pickled (they hold a key of the tenant "
                        "secret): make them in each process from $RAYKV_TENANT_SECRET")

    @property
    def keyed(self) -> bool:
        """Whether page hashes are keyed (the rank serves a tenant)."""
        return self._key is not None

    def keys(self, page_hashes: Sequence[str]) -> Sequence[str]:
        """``page_hashes`` as keys hold them. With a secret they are checked first
        (``ValueError`` naming the bad or repeated hash, as ``check_keys``), so errors
        name what the caller gave; without one they are returned as they are."""
        if self._key is None:
            return page_hashes
        return [keyed_page_hash(self._key, h) for h in check_keys(page_hashes)]

    def transfers(self, transfers: Sequence[PoolTransfer]) -> Sequence[PoolTransfer]:
        """``transfers`` with each one's ``keys`` mapped by ``keys`` (a sidecar without
        keys takes its source's, already mapped). Anything that is not a list of
        ``PoolTransfer`` is returned as it is, for the planner to refuse."""
        if self._key is None or isinstance(transfers, PoolTransfer) or \
                not isinstance(transfers, Sequence) or \
                not all(isinstance(t, PoolTransfer) for t in transfers):
            return transfers
        return [t if t.keys is None else dataclasses.replace(t, keys=self.keys(t.keys))
                for t in transfers]
