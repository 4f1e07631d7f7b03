"""The object keys a router asks about: a request's pages, keyed exactly as raykv's vLLM
connector keys them (no Ray Serve, no vLLM import).

``RouteOptions`` holds the router's settings (``request_router_kwargs``); ``RouteKeys``
turns token ids into the keys of every TP rank's object of each full block the engine
could load (``max_loadable_blocks``), page after page, TP rank order within a page:
the page hashes of ``integrations.vllm.page_hash`` (no extra keys: requests without a
cache salt, LoRA or multimodal input), keyed for a tenant (``KeyedHashes``), under the
key scheme of the connector's ``StorageConfig`` (``ConnectorOptions.storage_config``).
A router of a tenant needs the tenant secret (``RAYKV_TENANT_SECRET``), as its engines do.

Requests share prefixes (a system prompt, a document, a conversation's earlier turns),
so ``RouteKeys`` remembers each block's keys by its parent's page hash and its tokens
(at most ``MEMO_BLOCKS`` blocks, forgotten all at once when full): a block seen before
costs a dict lookup, not a hash, an HMAC and the key strings.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raykv.controllers.contract import PoolName, StorageConfig
from raykv.controllers.keyed_hashes import KeyedHashes
from raykv.controllers.keys import KeyScheme
from raykv.controllers.naming import NAMESPACE
from raykv.controllers.tenancy import check_tenant, tenant_secret
from raykv.integrations.vllm.options import (
    ConnectorOptions,
    KVIdentity,
    default_backend_tag,
    kv_layout,
)
from raykv.integrations.vllm.page_hash import PageHashChain, no_extra_keys, page_hash
from raykv.integrations.vllm.request_blocks import hash_hex, max_loadable_blocks

DEVICE_BACKENDS = {"cpu": "CPU_ATTN"}
"""The attention backend vLLM runs on a device that has only one (for models without
MLA)."""
MEMO_BLOCKS = 16384
"""Blocks whose keys ``RouteKeys`` remembers, at most (a few MB)."""


@dataclass(frozen=True)
class RouteOptions:
    """``request_router_kwargs`` of ``RayKVRouter``.

    - ``model_name``, ``block_size`` (required), ``tp_size``, ``pp_size``, ``kv_dtype``,
      ``device``, ``attention_backend``, ``model_revision``, ``extra_backend_tag``,
      ``tenant``: what the engines' connector keys blocks by (``ConnectorOptions``;
      ``extra_backend_tag`` default: ``default_backend_tag`` of the others, as the
      connector's default). ``attention_backend`` is the backend the engines run, as
      vLLM names it (default on ``cpu``: ``CPU_ATTN``, vLLM's only one there; on another
      device it is needed unless ``extra_backend_tag`` is given). They must match the
      engines' or every answer is a miss (routing then degrades to power of two
      choices, never to a wrong load).
    - ``namespace``: raykv's Ray namespace.
    - ``refresh_ms``: how often the router asks each node's residency log what
      changed (100): its view of a node lags by about this much.
    - ``deadline_ms``: how long one such call may take (250); it runs beside the
      requests, never before one.
    - ``stale_ms``: a node not heard from for this long counts as not answering, and
      requests are routed as if raykv were not there (1000).
    - ``tokenizer``: the model (name or path) whose tokenizer and chat template turn a
      request's text into token ids (None: only requests that carry token ids are
      routed by residency).
    - ``text_memo_ids``: token ids the router's memo of text prefixes holds at most
      (4 Mi, 4 bytes each; 0: every text tokenized in full).
    - ``keys_wait_ms``: how long a request with no part known at once waits for its
      keys made on the router's keys thread (3): a text the router's memo holds
      nothing of (a request's known part: the leading text the memo holds, or its
      first 2048 token ids; with one, it is routed at once and the rest of its keys
      are made after, counted for the replica it went to). Past it the request goes
      as a new prefix. Raise it where several routers (ingress replicas) see the same
      documents, at the cost of their first tokenization's time.
    - ``weight_engine``, ``weight_l2``, ``weight_segment``, ``weight_l3``: what a page
      held in each tier is worth (1.05, 1.0, 0.8, 0.5; the engine tier: pages the
      router sent to the replica lately); ``weight_load``: what one queued request
      costs, in the same unit (share of the request's pages; 0.1); ``max_queue_gap``:
      a replica queued more than this many requests beyond the shortest queue is not
      preferred while another can get as much of the request from some tier (2).
      ``engine_blocks``: blocks the router remembers sending to each replica (4096;
      about what one engine's own cache holds; 0: no engine tier).
    - ``page_bytes`` (bytes one rank loads per block) and ``prefill_tokens_per_s`` (the
      engines' prefill speed): given both, a tier's pages on a node count only for the
      share of their prefill time a load from there would save, from the node's own
      load estimates (``ranking.Credit``): a replica whose node would load slowly ranks
      as if it held less (None: no credit, every page counts).
    """

    model_name: str
    block_size: int
    tp_size: int = 1
    pp_size: int = 1
    kv_dtype: str = "bfloat16"
    device: str = "cpu"
    attention_backend: str | None = None
    model_revision: str | None = None
    extra_backend_tag: str | None = None
    tenant: str | None = None
    namespace: str = NAMESPACE
    refresh_ms: float = 100.0
    deadline_ms: float = 250.0
    stale_ms: float = 1000.0
    tokenizer: str | None = None
    text_memo_ids: int = 4 << 20
    keys_wait_ms: float = 3.0
    weight_engine: float = 1.05
    weight_l2: float = 1.0
    weight_segment: float = 0.8
    weight_l3: float = 0.5
    weight_load: float = 0.1
    max_queue_gap: int = 2
    engine_blocks: int = 4096
    page_bytes: int | None = None
    prefill_tokens_per_s: float | None = None

    @classmethod
    def parse(cls, kwargs: Mapping[str, Any]) -> RouteOptions:
        """The options of ``kwargs``; ``ValueError`` naming an unknown key, a missing
        ``model_name`` or ``block_size``, or a value out of range."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"RayKVRouter: unknown request_router_kwargs {unknown}; "
                             f"known: {sorted(names)}")
        if not kwargs.get("model_name") or "block_size" not in kwargs:
            raise ValueError("RayKVRouter: request_router_kwargs need model_name and "
                             "block_size (those of the engines' RayKVConnector)")
        opts = cls(**kwargs)
        if min(opts.block_size, opts.tp_size, opts.pp_size) < 1 or \
                not min(opts.refresh_ms, opts.deadline_ms, opts.stale_ms) > 0 or \
                not min(opts.max_queue_gap, opts.engine_blocks, opts.text_memo_ids,
                        opts.keys_wait_ms) >= 0 or not math.isfinite(opts.keys_wait_ms):
            raise ValueError("RayKVRouter: block_size, tp_size, pp_size must be >= 1, "
                             "refresh_ms, deadline_ms, stale_ms > 0 and max_queue_gap, "
                             "text_memo_ids, engine_blocks, keys_wait_ms >= 0 (finite)")
        if (opts.page_bytes is None) != (opts.prefill_tokens_per_s is None) or (
                opts.page_bytes is not None and not (
                    type(opts.page_bytes) is int and opts.page_bytes > 0
                    and 0 < opts.prefill_tokens_per_s < math.inf)):
            raise ValueError("RayKVRouter: page_bytes (an int > 0) and prefill_tokens_per_s "
                             "(> 0, finite) go together (both or neither)")
        if opts.extra_backend_tag is None and opts.backend() is None:
            raise ValueError(f"RayKVRouter: on device {opts.device!r} give attention_backend "
                             "(the backend the engines run, e.g. FLASH_ATTN) or "
                             "extra_backend_tag")
        check_tenant(opts.tenant)
        return opts

    def backend(self) -> str | None:
        """``attention_backend``, else the one vLLM runs on ``device`` when it has one."""
        return self.attention_backend or DEVICE_BACKENDS.get(self.device)

    def connector_options(self) -> ConnectorOptions:
        """The engines' connector options these stand for."""
        backend = self.backend()
        identity = KVIdentity(self.kv_dtype, self.block_size, kv_layout(self.device, backend),
                              self.model_revision, backend)
        tag = self.extra_backend_tag or default_backend_tag(self.tp_size, self.pp_size,
                                                            identity)
        return ConnectorOptions(model_name=self.model_name, extra_backend_tag=tag,
                                identity=identity, namespace=self.namespace,
                                tenant=self.tenant)


class RouteKeys:
    """Keys of a request's pages for ``opts`` (see the module docstring). Holds the
    tenant's keyed hashes: never pickled."""

    def __init__(self, opts: RouteOptions) -> None:
        conn = opts.connector_options()
        self.block_size, self.per_page = opts.block_size, opts.tp_size
        self.configs = [conn.storage_config(tp_rank=r, tp_size=opts.tp_size, pp_rank=0,
                                            pp_size=opts.pp_size)
                        for r in range(opts.tp_size)]
        self.config: StorageConfig = self.configs[0]
        self._hashes = KeyedHashes(tenant_secret(opts.tenant) if opts.tenant else None)
        schemes = [KeyScheme.from_config(c) for c in self.configs]
        self._parts = [(s.prefix, s.suffixes(PoolName.KV, "vllm", ["kv"])[0])
                       for s in schemes]
        # (parent page hash, block tokens) -> (page hash, the block's keys); any thread
        self._memo: dict[tuple[bytes | None, tuple[int, ...]], tuple[bytes, list[str]]] = {}

    def __reduce__(self):
        raise TypeError("RouteKeys hold a tenant's keyed hashes: make them in each process")

    def page_hashes(self, token_ids: Sequence[int]) -> list[str]:
        """Hex page hashes of the blocks of ``token_ids`` an engine could load."""
        chain = PageHashChain(self.block_size)
        n = max_loadable_blocks(len(token_ids), self.block_size) * self.block_size
        return [hash_hex(h) for h in chain.extend(token_ids, n, no_extra_keys)]

    def keys(self, token_ids: Sequence[int]) -> list[str]:
        """The object keys of those pages, ``per_page`` (one per TP rank) a page (each
        block's from the memo when it was seen before; any thread may call)."""
        bs, memo = self.block_size, self._memo
        out: list[str] = []
        parent: bytes | None = None
        for i in range(max_loadable_blocks(len(token_ids), bs)):
            block = tuple(token_ids[i * bs:(i + 1) * bs])
            known = memo.get((parent, block))
            if known is None:
                h = page_hash(parent, block, None)
                (keyed,) = self._hashes.keys([hash_hex(h)])
                known = (h, [prefix + keyed + suffix for prefix, suffix in self._parts])
                if len(memo) >= MEMO_BLOCKS:
                    memo.clear()
                memo[(parent, block)] = known
            parent = known[0]
            out += known[1]
        return out
