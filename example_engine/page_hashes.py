"""Chained page hashes over token ids: the raykv keys of a prompt's pages.

Page ``i``'s key is ``sha256(key_{i-1} + token ids of page i)`` (``key_{-1}`` is
empty), as hex, so equal keys mean equal prefixes: the leading run of stored keys is
the cached prefix. Token ids are hashed as little-endian int32. Only full pages have
keys; a prompt's partial last page is never cached.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def page_hashes(tokens: Sequence[int], page_size: int) -> list[str]:
    """Keys of every full page of ``tokens`` (``len(tokens) // page_size`` of them)."""
    ids = np.asarray(tokens, dtype="<i4")
    keys, prev = [], b""
    for start in range(0, len(ids) - page_size + 1, page_size):
        digest = hashlib.sha256(prev + ids[start:start + page_size].tobytes())
        keys.append(digest.hexdigest())
        prev = digest.digest()
    return keys
