"""The object key scheme, compatible with SGLang's Mooncake backend.

Every object key is ``P_`` + page hash + a suffix naming the rank scope and the buffer.
``P`` is ``extra_backend_tag`` then ``model_name`` (``/`` -> ``-``), joined by ``_``; with
neither set there is no prefix. A ``KeyScheme`` is the only place that tags, and it tags
each key exactly once: callers hand it raw page hashes, never keys it returned.

Rank scopes: ``mha`` = ``"{tp}"`` or ``"{tp}_{pp}"`` when ``pp_size > 1`` (data sharded by
TP rank); ``mla`` = ``""`` or ``"{pp}"`` (data replicated across TP ranks).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from raykv.controllers.contract import PoolName, StorageConfig

# The (pool, pool kind) pairs that have a key rule; everything else is refused.
KEY_RULES = frozenset({
    (PoolName.KV, "mha"), (PoolName.KV, "mla"),
    (PoolName.SWA, "mha"), (PoolName.SWA, "mla"),
    (PoolName.DRAFT, "mha"), (PoolName.DRAFT, "mla"),
    (PoolName.INDEXER, "indexer"),
    (PoolName.MAMBA, "mamba"),
    (PoolName.KV, "vllm"),
})


def check_key_rule(pool: PoolName, kind: str) -> None:
    """Raise ``ValueError`` unless a ``kind`` pool can be stored as ``pool``."""
    if (pool, kind) not in KEY_RULES:
        allowed = sorted(k for p, k in KEY_RULES if p == pool)
        raise ValueError(f"pool kind {kind!r} has no key rule as pool {pool.value!r} "
                         f"(allowed kinds: {allowed})")


def is_replicated(pool: PoolName, kind: str) -> bool:
    """Whether ``pool`` data is identical on every TP rank (stored once, by TP rank 0):
    MLA-kind KV, SWA and draft pools, and the DSA indexer. Mamba is always sharded."""
    return kind in ("mla", "indexer") and pool != PoolName.MAMBA


def key_prefix(model_name: str | None, extra_backend_tag: str | None) -> str:
    """The tag prepended to every object key: ``""`` or ``"P_"``."""
    parts = [p for p in (extra_backend_tag, (model_name or "").replace("/", "-")) if p]
    return "_".join(parts) + "_" if parts else ""


def mha_suffix(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Scope of TP-sharded data: ``"{tp}"``, or ``"{tp}_{pp}"`` when ``pp_size > 1``."""
    return f"{tp_rank}_{pp_rank}" if pp_size > 1 else f"{tp_rank}"


def mla_suffix(pp_rank: int, pp_size: int) -> str:
    """Scope of TP-replicated data: ``""``, or ``"{pp}"`` when ``pp_size > 1``."""
    return f"{pp_rank}" if pp_size > 1 else ""


@dataclass(frozen=True)
class KeyScheme:
    """Tagging rules of one rank: turns raw page hashes into Mooncake object keys.

    Every method returns the keys of one page in the pointer order of that pool's
    page meta (K before V; temporal before conv buffers).
    """

    prefix: str
    mha: str
    mla: str
    is_mla_model: bool
    tp_rank: int

    @classmethod
    def from_config(cls, config: StorageConfig) -> KeyScheme:
        return cls(
            prefix=key_prefix(config.model_name, config.extra_backend_tag),
            mha=mha_suffix(config.tp_rank, config.pp_rank, config.pp_size),
            mla=mla_suffix(config.pp_rank, config.pp_size),
            is_mla_model=config.is_mla_model,
            tp_rank=config.tp_rank,
        )

    def tag(self, key: str) -> str:
        """``P_`` + ``key``: for keys that carry their own suffix (legacy pointer API)."""
        return self.prefix + key

    def _sharded(self, page_hash: str, *names: str) -> list[str]:
        return [f"{self.prefix}{page_hash}_{self.mha}_{n}" for n in names]

    def _replicated(self, page_hash: str, *names: str) -> list[str]:
        return [f"{self.prefix}{page_hash}_{self.mla}_{n}" for n in names]

    def kv_keys(self, page_hash: str) -> list[str]:
        """MHA: ``P_h_{mha}_k``, ``P_h_{mha}_v``; MLA: ``P_h_{mla}_k``."""
        if self.is_mla_model:
            return self._replicated(page_hash, "k")
        return self._sharded(page_hash, "k", "v")

    def mamba_keys(self, page_hash: str, num_conv: int, has_temporal: bool = True) -> list[str]:
        """``P_h_{mha}_temporal`` (unless the temporal state is empty), ``P_h_{mha}_conv_{i}``.

        Mamba state is always TP-sharded, in MLA models too.
        """
        names = (["temporal"] if has_temporal else []) + [f"conv_{i}" for i in range(num_conv)]
        return self._sharded(page_hash, *names)

    def indexer_keys(self, page_hash: str) -> list[str]:
        """``P_h_{mla}_indexer``: the DSA indexer is replicated across TP ranks."""
        return self._replicated(page_hash, "indexer")

    def draft_keys(self, page_hash: str, draft_is_mla: bool) -> list[str]:
        """MHA draft: ``P_h_{mha}_draft_k``, ``_draft_v``; MLA draft: ``P_h_{mla}_draft_k``."""
        if draft_is_mla:
            return self._replicated(page_hash, "draft_k")
        return self._sharded(page_hash, "draft_k", "draft_v")

    def swa_keys(self, page_hash: str, swa_is_mla: bool) -> list[str]:
        """MHA SWA: ``P_h_{mha}_swa_k``, ``_swa_v``; MLA SWA: ``P_h_{mla}_swa``."""
        if swa_is_mla:
            return self._replicated(page_hash, "swa")
        return self._sharded(page_hash, "swa_k", "swa_v")

    def pool_keys(self, pool: PoolName, kind: str, buffer_names: list[str],
                  page_hash: str) -> list[str]:
        """Object keys of one page of a ``kind`` pool registered as ``pool``, one per
        buffer in ``buffer_names`` order. ``ValueError`` if the pair has no key rule."""
        check_key_rule(pool, kind)
        mla = kind == "mla"
        if pool == PoolName.KV and kind == "vllm":
            keys = self._sharded(page_hash, "kv")  # P_h_{mha}_kv: a whole vLLM block
        elif pool == PoolName.KV:
            keys = self.kv_keys(page_hash)
        elif pool == PoolName.SWA:
            keys = self.swa_keys(page_hash, swa_is_mla=mla)
        elif pool == PoolName.DRAFT:
            keys = self.draft_keys(page_hash, draft_is_mla=mla)
        elif pool == PoolName.INDEXER:
            keys = self.indexer_keys(page_hash)
        else:
            num_conv = sum(n.startswith("conv_") for n in buffer_names)
            keys = self.mamba_keys(page_hash, num_conv, "temporal" in buffer_names)
        if len(keys) != len(buffer_names):
            raise ValueError(f"pool {pool.value!r} has buffers {buffer_names} but its key rule "
                             f"gives {len(keys)} objects per page")
        return keys

    def suffixes(self, pool: PoolName, kind: str, buffer_names: Sequence[str]) -> list[str]:
        """What follows the page hash in each object key of a page of this pool, so a
        key is ``prefix + page_hash + suffix`` (worked out once per scheme and pool)."""
        return list(_suffixes(self, pool, kind, tuple(buffer_names)))

    @property
    def writes_replicated(self) -> bool:
        """Whether this rank stores TP-replicated pools (only TP rank 0 does)."""
        return self.tp_rank == 0


@functools.lru_cache(maxsize=256)
def _suffixes(scheme: KeyScheme, pool: PoolName, kind: str,
              buffer_names: tuple[str, ...]) -> tuple[str, ...]:
    keys = scheme.pool_keys(pool, kind, list(buffer_names), "")
    return tuple(k[len(scheme.prefix):] for k in keys)
