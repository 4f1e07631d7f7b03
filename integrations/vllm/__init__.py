"""raykv as a vLLM KV connector: ``RayKVConnector`` (a ``KVConnectorBase_V1``).

Loaded by stock vLLM, which imports this package and takes ``RayKVConnector`` from it
(exported lazily: importing this package, ``plan`` or ``options`` never imports vLLM;
only ``connector``, ``metadata``, ``scheduler`` and ``worker`` do)::

    KVTransferConfig(kv_connector="RayKVConnector",
                     kv_connector_module_path="raykv.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={...})

Keys: one Mooncake object per vLLM block per TP rank, ``P_{block hash}_{tp}_kv``, with
``P`` = ``extra_backend_tag`` (default ``vllm-tp{TP}``) and the model name, as raykv's
other keys. The block hash is vLLM's own chained block hash (``request.block_hashes``).

Modules:

- ``connector``: ``RayKVConnector``, the thin ``KVConnectorBase_V1`` that vLLM calls;
  it delegates to one of the two sides below.
- ``scheduler``: the scheduler side (one per engine): ONE raykv group query per lookup
  about every TP rank's objects, so ranks never load different prefixes; plans each
  step's loads and saves.
- ``worker``: the worker side (one per TP rank): moves blocks between vLLM's KV cache
  and the rank's shared host pool, and that pool to and from the store; a failed load
  is reported, never raised, and recomputed by vLLM.
- ``side``: what both sides share: the raykv client, its pool, counters.
- ``metadata``: what the scheduler side sends the workers each step.
- ``plan``: the scheduler side's pure block bookkeeping.
- ``options``: ``kv_connector_extra_config`` (``ConnectorOptions``).
"""

from raykv import lazy_getattr

_EXPORTS = {"RayKVConnector": "raykv.integrations.vllm.connector",
            "RayKVConnectorMetadata": "raykv.integrations.vllm.metadata",
            "ConnectorOptions": "raykv.integrations.vllm.options"}

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
