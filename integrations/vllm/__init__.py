"""raykv as a vLLM KV connector: ``RayKVConnector`` (a ``KVConnectorBase_V1``).

Loaded by stock vLLM, which imports this package and takes ``RayKVConnector`` from it
(exported lazily: importing this package, ``request_blocks`` or ``options`` never imports vLLM;
only ``connector``, ``metadata``, ``scheduler`` and ``worker`` do)::

    KVTransferConfig(kv_connector="RayKVConnector",
                     kv_connector_module_path="raykv.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={...})

Keys: one Mooncake object per vLLM block per TP rank, ``P_{page hash}_{tp}_kv``, with
``P`` = ``extra_backend_tag`` (default ``options.default_backend_tag``: TP/PP sizes, KV
dtype, block size, layout, model revision) and the model name, as raykv's other keys.
The page hash is raykv's own chained SHA-256 over each block's tokens and vLLM's
per-block extra keys (``page_hash``): the same in every process whatever its
``PYTHONHASHSEED`` or vLLM's hash algorithm.

Modules:

- ``connector``: ``RayKVConnector``, the thin ``KVConnectorBase_V1`` that vLLM calls;
  it delegates to one of the two sides below.
- ``scheduler``: the scheduler side (one per engine): ONE raykv group query per lookup
  about every TP rank's objects, so ranks never load different prefixes; decides each
  step's loads and saves.
- ``worker``: the worker side (one per TP rank): moves blocks between vLLM's KV cache
  and the rank's shared host pool, and that pool to and from the store; a failed load
  is reported, never raised, and recomputed by vLLM.
- ``side``: what both sides share: the raykv client, its pool, counters.
- ``connector_stats``: the counters as typed records, and their one edge to vLLM's
  connector stats dicts (pure).
- ``metadata``: what the scheduler side sends the workers each step.
- ``request_blocks``: the scheduler side's pure block bookkeeping.
- ``page_hash``: the page hashes of a request's blocks (pure).
- ``options``: ``kv_connector_extra_config`` (``ConnectorOptions``).
- ``load_choice``: the scheduler side's load guard: which leading blocks of a hit are
  worth loading, from the engine's measured prefill and the workers' measured loads
  (pure).
"""

from typing import TYPE_CHECKING

from raykv import lazy_getattr

if TYPE_CHECKING:
    from raykv.integrations.vllm.connector import RayKVConnector as RayKVConnector
    from raykv.integrations.vllm.metadata import RayKVConnectorMetadata as RayKVConnectorMetadata
    from raykv.integrations.vllm.options import ConnectorOptions as ConnectorOptions

_EXPORTS = {"RayKVConnector": "raykv.integrations.vllm.connector",
            "RayKVConnectorMetadata": "raykv.integrations.vllm.metadata",
            "ConnectorOptions": "raykv.integrations.vllm.options"}

if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
