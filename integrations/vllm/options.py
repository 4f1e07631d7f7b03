"""``kv_connector_extra_config`` of raykv's vLLM connector, parsed and checked (pure: no
vLLM, no Ray; the connector passes in the few values of vLLM's config it needs)."""

from __future__ import annotations

import difflib
import hashlib
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raykv.controllers.contract import DEFAULT_TIMEOUT_S, StorageConfig
from raykv.controllers.load_guard import DEFAULT_MARGIN, GuardSettings
from raykv.controllers.naming import NAMESPACE
from raykv.controllers.tenancy import check_tenant

KNOWN_KEYS = frozenset({"model_name", "extra_backend_tag", "namespace", "ray_address",
                        "pool_blocks", "l2_blocks", "async_transfers", "timeout_s", "tenant",
                        "load_guard", "load_guard_margin", "explain"})

PAGE_LAYOUT = "lm1"
"""The page layout raykv stores for vLLM, versioned: one page per vLLM block holding
that block of every layer, layer after layer, each in the attention backend's own block
layout (``PoolLayout.vllm``). A change of layout changes this label, hence every key."""

_TAG_PART = re.compile(r"[A-Za-z0-9.-]{1,40}")

L2_NODE_ROOM = 1 << 31
"""``l2_blocks`` when ``async_transfers`` is on and ``l2_blocks`` is not given: a cap no
pool reaches, so the L2 pool holds as many blocks as fit in what is left of the node's
L2 capacity (``raykv up --l2-size``, default 1 GiB per node)."""

TYPO_CUTOFF = 0.8
"""An unknown key at least this similar (``difflib`` ratio) to one of ``KNOWN_KEYS`` is
refused as a misspelling of it; any other unknown key is ignored."""

log = logging.getLogger("vllm." + __name__)  # shows up with vLLM's own log lines


@dataclass(frozen=True)
class KVIdentity:
    """What, beyond the model name, TP/PP sizes and the page hash, decides which bytes a
    vLLM block's page holds; read from vLLM's config by the connector.

    - ``kv_dtype``: the KV cache dtype (vLLM's ``cache_dtype``, ``auto`` resolved to the
      model's dtype, e.g. ``bfloat16``, ``fp8_e4m3``).
    - ``page_size``: tokens per vLLM block (``block_size``).
    - ``layout``: the device and attention backend whose block layout the page holds,
      and raykv's ``PAGE_LAYOUT`` (``kv_layout``: e.g. ``cpu.cpu-attn.lm1``,
      ``cuda.flash-attn.lm1``).
    - ``model_revision``: vLLM's ``model_config.revision`` (None when unset).
    - ``attn_backend``: the attention backend ``layout`` names, as vLLM names it
      (``CPU_ATTN``, ``FLASH_ATTN``; None: none named), which the worker checks against
      the backend its layers run (``check_attention_backends``).
    """

    kv_dtype: str
    page_size: int
    layout: str
    model_revision: str | None = None
    attn_backend: str | None = None


def kv_layout(device: str, attn_backend: str | None) -> str:
    """``KVIdentity.layout`` of blocks of ``device`` (vLLM's ``device_type``) written by
    the attention backend ``attn_backend`` (vLLM's name, ``CPU_ATTN``; None: not named):
    ``{device}[.{backend}].{PAGE_LAYOUT}``, the backend in lower case with ``-`` for
    ``_`` (``cpu.cpu-attn.lm1``)."""
    parts = [device]
    if attn_backend:
        parts.append(attn_backend.lower().replace("_", "-"))
    return ".".join([*parts, PAGE_LAYOUT])


def check_attention_backends(named: str | None, running: Mapping[str, str]) -> bool:
    """A worker's check that its blocks are the bytes its key tag names: every attention
    layer it registered (``running``: layer name -> the name of the backend vLLM runs it
    with) runs ``named``, the backend of the tag. ``ValueError`` naming the layers and
    both backends otherwise: the blocks would be stored under another layout's keys.
    False when no registered layer is one of vLLM's attention layers (a harness that
    registers KV caches of its own, as vLLM's own connector tests do): nothing to check
    against, the tag's backend (vLLM's selector's choice) stands; True once checked."""
    if not running:
        return False
    other = sorted({b for b in running.values() if b != named})
    if other:
        layers = sorted(n for n, b in running.items() if b != named)
        raise ValueError(
            f"RayKVConnector: the key tag names attention backend {named or 'none'} but "
            f"vLLM runs {', '.join(other)} (layers {', '.join(layers[:3])}"
            f"{', ...' if len(layers) > 3 else ''}); blocks of that layout would be keyed "
            "as another's. Choose the attention backend explicitly (vLLM's "
            "attention_config.backend, --attention-backend) so that the scheduler and the "
            "workers agree, or set extra_backend_tag")
    return True


def _tag_part(value: str) -> str:
    """``value`` as one part of a key tag: itself when it is 1-40 letters, digits, ``.``
    or ``-``, else ``h`` + 16 hex digits of its SHA-256 (two different values never give
    the same part by rewriting characters)."""
    if _TAG_PART.fullmatch(value):
        return value
    return "h" + hashlib.sha256(value.encode()).hexdigest()[:16]


def misspelt_keys(keys: list[str]) -> dict[str, str]:
    """Which of ``keys`` (not in ``KNOWN_KEYS``) look like a misspelling of a known key:
    ``{key: known key}`` for those at least ``TYPO_CUTOFF`` similar to one (``pool_block``,
    ``tennant``, ``timeout``)."""
    typos = {}
    for key in keys:
        close = difflib.get_close_matches(key, KNOWN_KEYS, n=1, cutoff=TYPO_CUTOFF)
        if close:
            typos[key] = close[0]
    return typos


def default_backend_tag(tp_size: int, pp_size: int, identity: KVIdentity) -> str:
    """``vllm-tp{TP}[-pp{PP}]-{kv_dtype}-b{page_size}-{layout}[-rev.{revision}]`` (PP
    only when > 1, revision only when set): blocks of another TP or PP size, KV dtype,
    block size, layout or model revision are other bytes, so they get other keys (a
    miss, never a load)."""
    parts = [f"vllm-tp{tp_size}"]
    if pp_size > 1:
        parts.append(f"pp{pp_size}")
    parts += [_tag_part(identity.kv_dtype.replace("_", "-")), f"b{identity.page_size}",
              _tag_part(identity.layout)]
    if identity.model_revision:
        parts.append("rev." + _tag_part(identity.model_revision))
    return "-".join(parts)


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` of ``RayKVConnector`` (every key optional).

    - ``model_name``: the model part of the key prefix (default: vLLM's served model
      name). Engines that must share blocks need the same model name and tag.
    - ``extra_backend_tag``: the first part of the key prefix (default
      ``default_backend_tag``: TP and PP sizes, KV dtype, block size, layout and model
      revision, so that blocks of other bytes get other keys). A tag given here replaces
      it entirely: engines that set the same tag must store the same bytes.
    - ``namespace``: the Ray namespace raykv runs in (default ``raykv``).
    - ``ray_address``: the Ray cluster to join from a process that is not a Ray worker
      (vLLM's multiprocess engine core and TP worker processes); default
      ``$RAY_ADDRESS``, else the cluster of the Ray actor that started the engine, else
      ``auto`` (see ``raykv.integrations.ray_join.join_ray``).
    - ``pool_blocks``: blocks in each TP rank's shared staging pool (default 64); larger
      loads and saves go through it in chunks of this many blocks.
    - ``l2_blocks``: blocks of each TP rank in its node's L2 cache (default 0: none),
      a pool every engine of this deployment on the node shares (the first one makes
      it, as large as the node's ``l2_bytes`` leaves room for; counted in the tenant's
      quota). With it, saves copy blocks into L2 and the node actor puts them to L3
      afterwards, loads copy from L2 (read from L3 into L2 first where needed), and
      the scheduler's lookup counts blocks in L2 before asking L3.
    - ``async_transfers``: transfers off vLLM's step (default False; uses L2: without
      ``l2_blocks``, as many blocks as the node's L2 capacity has room for,
      ``L2_NODE_ROOM``; with ``l2_blocks`` 0, refused). Saves: ``wait_for_save`` copies the
      step's newly full blocks into L2 pages in one batch and returns (the node actor puts
      them to L3 behind); a block L2 has no page for is dropped and counted
      (``save_dropped``), never saved on the step. Loads: a hit that needs L3 is loaded
      asynchronously (vLLM parks the request until a worker thread has read it, L3 into L2
      into vLLM's blocks); a hit all in L2 is copied on the step (a memcpy). Lookups: asked
      on a thread of their own, waited for at most a few ms per scheduler step, cached per
      request.
    - ``timeout_s``: the deadline of each call to raykv, in seconds (default
      ``DEFAULT_TIMEOUT_S``, 5): a hung or stopped node actor then costs a failed load
      (recomputed under ``kv_load_failure_policy="recompute"``) or a lost save, and the
      scheduler's hit query a miss, never a stalled engine.
    - ``tenant``: the tenant this engine serves (``StorageConfig.tenant``; its secret
      in ``RAYKV_TENANT_SECRET``); default none.
    - ``load_guard``: the load guard (``controllers.load_guard``): ``"auto"`` (the
      default: load a hit's leading pages only where their load is estimated to arrive
      sooner than the engine would compute them, ``load_choice``), ``"off"`` (load
      every hit) or a number of tokens (a fixed threshold: a hit shorter than that is
      recomputed whole).
    - ``load_guard_margin``: how many times faster than computing a load must be
      estimated to be chosen (default ``DEFAULT_MARGIN``, 1.1; 0.5 to 10).
    - ``explain``: log one line per lookup (``load_choice.explain``:
      the tokens asked, which tier serves which, what the guard skipped and both
      estimates); default false.

    ``kv_events`` is not a key: the connector sets it from vLLM's own switch,
    ``kv_events_config.enable_kv_cache_events`` (then it publishes vLLM KV events for
    raykv's tiers: ``raykv.integrations.vllm.kv_events``).

    Any other key is ignored (vLLM's convention: a wrapper connector, such as a recording
    connector around this one, shares its ``kv_connector_extra_config`` and passes its
    own keys through) and logged once, unless it looks like a misspelt key of this
    list (``misspelt_keys``), which is refused: a typo of ``tenant`` or
    ``extra_backend_tag`` would otherwise put this engine's blocks in another key space.
    """

    model_name: str
    extra_backend_tag: str
    identity: KVIdentity
    namespace: str = NAMESPACE
    ray_address: str | None = None
    pool_blocks: int = 64
    l2_blocks: int = 0
    async_transfers: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    tenant: str | None = None
    kv_events: bool = False
    load_guard: GuardSettings = GuardSettings()
    explain: bool = False

    @classmethod
    def parse(cls, extra_config: Mapping[str, Any] | None, *, tp_size: int, pp_size: int,
              served_model: str, identity: KVIdentity) -> ConnectorOptions:
        """The options of ``extra_config`` (vLLM's ``kv_connector_extra_config``; None:
        all defaults) for an engine of ``tp_size`` x ``pp_size`` ranks serving
        ``served_model`` (vLLM's served model name, else its model) whose blocks are
        ``identity``. ``ValueError`` on a misspelt key (``misspelt_keys``),
        ``pool_blocks`` < 1, ``l2_blocks`` < 0, ``async_transfers`` with ``l2_blocks``
        0, a bad ``timeout_s``, tenant name, ``load_guard``, ``load_guard_margin``
        or ``explain``;
        other unknown keys are ignored (logged)."""
        extra = dict(extra_config or {})
        unknown = sorted(set(extra) - KNOWN_KEYS)
        typos = misspelt_keys(unknown)
        if typos:
            raise ValueError(f"RayKVConnector: kv_connector_extra_config keys {typos} look "
                             f"misspelt; raykv's keys: {sorted(KNOWN_KEYS)}")
        if unknown:
            log.warning("RayKVConnector: ignoring kv_connector_extra_config keys %s (not "
                        "raykv's: %s)", unknown, sorted(KNOWN_KEYS))
        extra = {k: v for k, v in extra.items() if k in KNOWN_KEYS}
        model = extra.get("model_name") or served_model
        pool_blocks = int(extra.get("pool_blocks", 64))
        if pool_blocks < 1:
            raise ValueError(f"RayKVConnector: pool_blocks must be >= 1, got {pool_blocks}")
        async_transfers = extra.get("async_transfers", False)
        if not isinstance(async_transfers, bool):
            raise ValueError("RayKVConnector: async_transfers must be true or false, got "
                             f"{async_transfers!r}")
        l2_blocks = int(extra.get("l2_blocks", L2_NODE_ROOM if async_transfers else 0))
        if l2_blocks < 0:
            raise ValueError(f"RayKVConnector: l2_blocks must be >= 0, got {l2_blocks}")
        if async_transfers and not l2_blocks:
            raise ValueError("RayKVConnector: async_transfers needs l2_blocks > 0 (saves "
                             "and loads go through the node's L2 pages)")
        margin = extra.get("load_guard_margin", DEFAULT_MARGIN)
        if isinstance(margin, bool) or not isinstance(margin, int | float):
            raise ValueError(f"RayKVConnector: load_guard_margin must be a number, got "
                             f"{margin!r}")
        try:
            guard = GuardSettings.parse(extra.get("load_guard"), float(margin))
        except ValueError as e:
            raise ValueError(f"RayKVConnector: {e}") from None
        explain = extra.get("explain", False)
        if not isinstance(explain, bool):
            raise ValueError(f"RayKVConnector: explain must be true or false, got "
                             f"{explain!r}")
        tag = extra["extra_backend_tag"] if "extra_backend_tag" in extra else \
            default_backend_tag(tp_size, pp_size, identity)
        return cls(model_name=str(model), extra_backend_tag=str(tag), identity=identity,
                   namespace=str(extra.get("namespace", NAMESPACE)),
                   ray_address=extra.get("ray_address"), pool_blocks=pool_blocks,
                   l2_blocks=l2_blocks, async_transfers=async_transfers,
                   timeout_s=StorageConfig(extra_config=extra).timeout_s,  # validated
                   tenant=check_tenant(extra.get("tenant") or None),
                   load_guard=guard, explain=explain)

    def storage_config(self, *, tp_rank: int, tp_size: int, pp_rank: int,
                       pp_size: int) -> StorageConfig:
        """The ``StorageConfig`` of one rank's (or, rank 0, the scheduler's) raykv
        client: these options' model, key tag, deadline, tenant (when set) and the
        blocks' identity (``kv_dtype``, ``page_size``, ``model_revision`` when set); its
        group queries go to its own node's actor (``lookup_home="node"``: the
        scheduler asks them alone, for every TP rank, so one engine never gets two
        answers, and replicas on other nodes ask their own nodes)."""
        extra: dict[str, Any] = {"extra_backend_tag": self.extra_backend_tag,
                                 "lookup_home": "node",  # the scheduler alone asks
                                 "timeout_s": self.timeout_s,
                                 "kv_dtype": self.identity.kv_dtype,
                                 "page_size": self.identity.page_size}
        if self.identity.model_revision:
            extra["model_revision"] = self.identity.model_revision
        if self.tenant:
            extra["tenant"] = self.tenant
        return StorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                             pp_size=pp_size, model_name=self.model_name, extra_config=extra)
