"""The object key scheme, compatible with SGLang's Mooncake backend.

Every object key is ``P`` + page hash + a suffix naming the rank scope and the buffer
(``_{scope}_{buffer}``). A ``KeyScheme`` is the only place that tags, and it tags each
key exactly once: callers hand it raw page hashes, never keys it returned.

The prefix ``P`` is made from the rank's *identity* (``Identity``: what decides which
bytes an object holds):

- Without a tenant, as SGLang's MooncakeStore names objects (byte for byte, so both
  share objects): ``extra_backend_tag`` then ``model_name`` (``/`` -> ``-``), joined
  by ``_``, and a final ``_``; with neither set there is no prefix. This prefix is not
  injective (models ``org/m`` and ``org-m`` share it, so do tag ``a_b`` + model ``c``
  and tag ``a`` + model ``b_c``) and leaves out the revision, KV dtype, page size and
  parallel sizes, so the deployment registry refuses a rank whose identity differs from
  the deployment already registered under its prefix (``controllers.deployments``).
- With a tenant: ``t1``, then for each field of the identity, in the order ``tenant,
  extra_backend_tag, model_name, model_revision, kv_dtype, page_size, tp_size, pp_size,
  is_mla_model``, a ``.`` and the field, then a final ``_``. A field is ``~`` when
  absent, else ``<n>=<text>``: its text (ints in decimal, the MLA flag ``0``/``1``)
  with every UTF-8 byte outside ``A-Z a-z 0-9 . -`` written ``%XX``, and ``n`` the
  length of that escaped text. Every field is self-delimiting, so a prefix names one
  identity (``parse_prefix`` recovers it) and two identities never share a prefix; no
  ``_`` appears before the final one. The page hashes under it are *keyed page hashes*
  (``controllers.tenancy.keyed_page_hash``), keyed by the rank (``CacheClient``) before
  they reach a ``KeyScheme``: a scheme holds no secret.

Rank scopes: ``mha`` = ``"{tp}"`` or ``"{tp}_{pp}"`` when ``pp_size > 1`` (data sharded by
TP rank); ``mla`` = ``""`` or ``"{pp}"`` (data replicated across TP ranks).
"""

from __future__ import annotations

import dataclasses
import functools
import re
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
    """The prefix of every object key without a tenant (SGLang's): ``""`` or ``"P_"``."""
    parts = [p for p in (extra_backend_tag, (model_name or "").replace("/", "-")) if p]
    return "_".join(parts) + "_" if parts else ""


TENANT_PREFIX_VERSION = "t1"
"""First characters of every tenant key prefix (the version of its encoding)."""
_PLAIN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.-")
_FIELD = re.compile(r"\.(?:(~)|([0-9]+)=)")


@dataclass(frozen=True)
class Identity:
    """What decides the bytes a rank stores under a page hash, and whom they are for:
    the fields of a tenant's key prefix (module docstring), in their order. ``None``:
    not given. ``page_size`` counts tokens."""

    tenant: str | None
    extra_backend_tag: str | None
    model_name: str | None
    model_revision: str | None
    kv_dtype: str | None
    page_size: int | None
    tp_size: int
    pp_size: int
    is_mla_model: bool

    @classmethod
    def from_config(cls, config: StorageConfig) -> Identity:
        return cls(config.tenant, config.extra_backend_tag, config.model_name,
                   config.model_revision, config.kv_dtype, config.page_size,
                   config.tp_size, config.pp_size, config.is_mla_model)

    @property
    def prefix(self) -> str:
        """The key prefix: SGLang's (``key_prefix``) without a tenant, else the tenant
        encoding of every field (module docstring)."""
        if self.tenant is None:
            return key_prefix(self.model_name, self.extra_backend_tag)
        return TENANT_PREFIX_VERSION + "".join(
            "." + _field(v) for v in dataclasses.astuple(self)) + "_"

    @property
    def deployment_id(self) -> str:
        """The name of this identity's deployment, one per prefix: without a tenant its
        key prefix, or ``"default"`` for the empty one; with a tenant its prefix less the
        final ``_``. Every prefix without a tenant but the empty one ends in ``_``, so
        the three kinds of names never meet: a rank without a tenant can never take a
        tenant's deployment, even with a tag that makes its prefix the tenant's."""
        if self.tenant is not None:
            return self.prefix[:-1]
        return self.prefix or "default"

    def differences(self, other: Identity) -> list[str]:
        """``"field=mine (theirs: other's)"`` for every field that differs."""
        return [f"{f.name}={getattr(self, f.name)!r} (theirs: {getattr(other, f.name)!r})"
                for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]


def _field(value: str | int | bool | None) -> str:
    if value is None:
        return "~"
    text = str(int(value)) if isinstance(value, int) else value
    escaped = "".join(chr(b) if b in _PLAIN else f"%{b:02X}" for b in text.encode())
    return f"{len(escaped)}={escaped}"


def _unescape(escaped: str) -> str:
    return re.sub(rb"%([0-9A-F]{2})", lambda m: bytes([int(m[1], 16)]),
                  escaped.encode()).decode()


def parse_prefix(prefix: str) -> Identity:
    """The identity whose tenant key prefix is ``prefix``; ``ValueError`` if ``prefix``
    is not one (an SGLang prefix has no tenant and cannot be parsed back)."""
    if not prefix.startswith(TENANT_PREFIX_VERSION) or not prefix.endswith("_"):
        raise ValueError(f"{prefix!r} is not a tenant key prefix")
    fields: list[str | None] = []
    pos = len(TENANT_PREFIX_VERSION)
    for _ in dataclasses.fields(Identity):
        m = _FIELD.match(prefix, pos)
        if m is None:
            raise ValueError(f"{prefix!r} is not a tenant key prefix (at {pos})")
        if m[1]:
            fields.append(None)
            pos = m.end()
        else:
            pos = m.end() + int(m[2])
            try:
                fields.append(_unescape(prefix[m.end():pos]))
            except UnicodeDecodeError:
                raise ValueError(f"{prefix!r} is not a tenant key prefix (not UTF-8 at "
                                 f"{m.end()})") from None
    if pos != len(prefix) - 1 or None in fields[6:]:
        raise ValueError(f"{prefix!r} is not a tenant key prefix")
    try:
        page_size = None if fields[5] is None else int(fields[5])
        tp, pp, mla = (int(f) for f in fields[6:])
    except ValueError:
        raise ValueError(f"{prefix!r} is not a tenant key prefix (a size is no int)") from None
    identity = Identity(*fields[:5], page_size, tp, pp, bool(mla))
    if identity.prefix != prefix:  # e.g. "01" for 1, "%41" for "A", mla "2"
        raise ValueError(f"{prefix!r} is not the tenant key prefix of any identity")
    return identity


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
        return cls.for_rank(Identity.from_config(config), config.tp_rank, config.pp_rank)

    @classmethod
    def for_rank(cls, identity: Identity, tp_rank: int, pp_rank: int) -> KeyScheme:
        """The scheme of rank (``tp_rank``, ``pp_rank``) of ``identity``'s deployment."""
        return cls(
            prefix=identity.prefix,
            mha=mha_suffix(tp_rank, pp_rank, identity.pp_size),
            mla=mla_suffix(pp_rank, identity.pp_size),
            is_mla_model=identity.is_mla_model,
            tp_rank=tp_rank,
        )

    def tag(self, key: str) -> str:
        """``P`` + ``key``: for keys that carry their own suffix (legacy pointer API; with
        a tenant, ``key`` is the keyed hash of the whole pointer key)."""
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


@functools.lru_cache(maxsize=256)
def _suffixes(scheme: KeyScheme, pool: PoolName, kind: str,
              buffer_names: tuple[str, ...]) -> tuple[str, ...]:
    keys = scheme.pool_keys(pool, kind, list(buffer_names), "")
    return tuple(k[len(scheme.prefix):] for k in keys)
