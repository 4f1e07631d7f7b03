"""raykv's own page hashes of vLLM blocks (pure: no vLLM, no Ray).

A page hash names one full block of a request: SHA-256 over the canonical bytes of
(parent page hash, the block's token ids, the block's extra keys), chained from a fixed
root. The extra keys are vLLM's own per-block extra keys
(``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys``: the cache salt on the
first block, the LoRA adapter, multimodal item hashes and offsets, prompt-embedding
hashes), so a block's hash covers what vLLM's prefix cache covers. Unlike vLLM's own
block hashes, nothing here depends on ``PYTHONHASHSEED`` or on vLLM's
``prefix_caching_hash_algo``: every process computes the same bytes for the same block.

Canonical bytes: ``msgpack`` of ``(parent, tokens, extra_keys)``: tuples and lists as
arrays, ``str`` as UTF-8 strings, ``bytes`` as binary, ints, floats (64-bit), bools and
None as themselves (subclasses as their base type); any other type (an object with only
a ``repr``, a numpy scalar) raises ``TypeError`` rather than hashing something
process-dependent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

ROOT = hashlib.sha256(b"raykv/vllm/page-hash/v1").digest()
"""The parent of a request's first block (a version label: a change of this scheme
changes every hash, so old pages are misses, never loads)."""

ExtraKeys = tuple[Any, ...] | None
"""vLLM's extra keys of one block (None: none)."""
ExtraKeysFn = Callable[[int, int, int], tuple[ExtraKeys, int]]
"""``(start_token, end_token, start_mm_idx) -> (extra keys, next mm index)``: the
signature of vLLM's ``generate_block_hash_extra_keys`` with the request bound."""


def _strict(obj: Any) -> Any:
    """msgpack's fallback: only the types listed in the module docstring are hashed."""
    raise TypeError(f"page hash: cannot hash a {type(obj).__name__} canonically: {obj!r}")


def page_hash(parent: bytes | None, tokens: Sequence[int], extra_keys: ExtraKeys) -> bytes:
    """The 32-byte page hash of one block: its ``tokens`` (exactly one block's token ids),
    its vLLM ``extra_keys``, and ``parent`` (the previous block's page hash; None for a
    request's first block, which chains from ``ROOT``)."""
    payload = msgpack.packb((parent or ROOT, list(tokens), extra_keys), use_bin_type=True,
                            default=_strict)
    return hashlib.sha256(payload).digest()


class PageHashChain:
    """The page hashes of one request's full blocks of ``block_size`` tokens, extended
    as the request grows (prompt, then decoded tokens): each call hashes only the blocks
    completed since the last one. Used by one thread (vLLM's scheduler)."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.hashes: list[bytes] = []
        self._mm_idx = 0  # vLLM's multimodal cursor: first item not behind the next block

    def extend(self, tokens: Sequence[int], num_tokens: int,
               extra_keys: ExtraKeysFn) -> list[bytes]:
        """Hash the full blocks of ``tokens[:num_tokens]`` not hashed yet (``tokens``:
        the request's token ids so far, a prefix of what earlier calls saw) and return
        all of the request's page hashes (``self.hashes``, one per full block)."""
        bs = self.block_size
        while (len(self.hashes) + 1) * bs <= num_tokens:
            start = len(self.hashes) * bs
            keys, self._mm_idx = extra_keys(start, start + bs, self._mm_idx)
            parent = self.hashes[-1] if self.hashes else None
            self.hashes.append(page_hash(parent, tokens[start:start + bs], keys))
        return self.hashes


def no_extra_keys(start: int, end: int, mm_idx: int) -> tuple[ExtraKeys, int]:
    """``ExtraKeysFn`` of a request with no salt, LoRA, multimodal input or embeddings."""
    return None, mm_idx
