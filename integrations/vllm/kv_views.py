"""vLLM's per-layer KV cache views as raykv reads them (torch only, no vLLM).

vLLM 0.32 hands a connector's ``register_kv_caches`` one logical ``[B, H, N, C]`` view
per layer (``vllm.v1.kv_cache_interface.create_kv_cache_views``): B kernel blocks of N
tokens, H KV head slots, C bytes-worth of content per head and token, strided over its
own physical layout (``CacheConfig.kv_cache_layout``). The block axis is therefore
the first, by that contract, whatever the physical layout; a block of vLLM's block
manager is ``B / num_blocks`` consecutive kernel blocks (vLLM splits a block when its
attention kernels want smaller ones). raykv copies each block as that logical view, so
the bytes of a page are the same for every physical layout of the same logical block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def kernel_split(shape: Sequence[int], num_blocks: int, block_size: int) -> int:
    """How many kernel blocks of ``shape`` (a layer's ``[B, H, N, C]`` view) make one
    of the ``num_blocks`` blocks of ``block_size`` tokens; ``ValueError`` naming the
    problem for a shape that is not such a view."""
    if len(shape) != 4:
        raise ValueError(f"RayKVConnector: a layer's KV cache view {tuple(shape)} is not "
                         "vLLM's [blocks, heads, tokens, content]")
    b, _, n, _ = shape
    if num_blocks < 1 or b % num_blocks or (b // num_blocks) * n != block_size:
        raise ValueError(f"RayKVConnector: a layer's KV cache view {tuple(shape)} does not "
                         f"hold {num_blocks} blocks of {block_size} tokens as "
                         "[blocks, heads, tokens, content]")
    return b // num_blocks


def block_views(tensors: Sequence[torch.Tensor], num_blocks: int,
                block_size: int) -> list[torch.Tensor]:
    """Per layer a view whose first axis counts vLLM's ``num_blocks`` blocks: the
    layer's view itself, or with its kernel blocks grouped per block
    (``(num_blocks, split, H, N, C)``). ``ValueError`` as ``kernel_split``."""
    split = kernel_split(tuple(tensors[0].shape), num_blocks, block_size)
    return [t if split == 1 else t.unflatten(0, (num_blocks, split)) for t in tensors]


def block_geometry(spec: object, layers: int) -> dict:
    """The ``PoolLayout.vllm`` arguments (all but ``size``) of one block of ``layers``
    layers of vLLM's KV cache spec ``spec`` (an ``AttentionSpec``: ``block_size``,
    ``num_kv_heads``, ``page_size_bytes`` per block and layer, ``dtype``): what the
    scheduler side registers, so that the deployment's bytes per page are the workers'
    real ones. ``head_dim`` is the content per head and token (K and V together);
    ``ValueError`` if the block's bytes are no whole number of those."""
    itemsize = spec.dtype.itemsize
    heads = int(getattr(spec, "num_heads", None) or spec.num_kv_heads)
    per_layer = int(spec.page_size_bytes)
    slots = spec.block_size * heads * itemsize
    if per_layer % slots:
        raise ValueError(f"RayKVConnector: a block of {per_layer} bytes per layer is no "
                         f"whole number of {spec.block_size} tokens x {heads} heads of "
                         f"{itemsize}-byte values")
    return {"page_size": spec.block_size, "layer_num": layers, "head_num": heads,
            "head_dim": per_layer // slots, "dtype": str(spec.dtype).removeprefix("torch."),
            "itemsize": itemsize}


def config_geometry(kv_cache_config: object | None) -> dict | None:
    """``block_geometry`` of one rank's block of vLLM's ``KVCacheConfig`` (its first
    group's spec, every layer of the group); None without a config."""
    if kv_cache_config is None:
        return None
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    spec = getattr(spec, "kv_cache_specs", {}).get(group.layer_names[0], spec)
    return block_geometry(spec, len(group.layer_names))


def geometry_bytes(geometry: dict | None) -> int:
    """Bytes of one block of ``geometry`` (``block_geometry``'s; None: 0)."""
    if geometry is None:
        return 0
    return math.prod(geometry[k] for k in ("page_size", "layer_num", "head_num",
                                           "head_dim", "itemsize"))


def block_slots(block_ids: Sequence[int], block_size: int) -> torch.Tensor:
    """Host indices (token slots) of vLLM's blocks ``block_ids`` of ``block_size``
    tokens, block after block."""
    ids = torch.tensor(list(block_ids), dtype=torch.long)
    return (ids[:, None] * block_size + torch.arange(block_size)).reshape(-1)


def pool_dims(block_shape: Sequence[int], block_size: int) -> tuple[int, int]:
    """``head_num, head_dim`` of a raykv pool of blocks ``block_shape`` (one layer's
    block): vLLM's CPU block ``(heads, block_size, 2 * head_size)`` as it is; any other
    block shape as ``(1, elements / block_size)`` (same bytes per page, which is all the
    store sees)."""
    if len(block_shape) == 3 and block_shape[1] == block_size:
        return block_shape[0], block_shape[2]
    return 1, math.prod(block_shape) // block_size


def pool_block_views(kv_buffer: torch.Tensor, block_shape: Sequence[int]) -> list[torch.Tensor]:
    """A raykv vLLM pool's pages per layer (``kv_buffer``: ``(pages, layers, ...)``), as
    ``(pages, *block_shape)`` views lining up with ``block_views``' (a page holds every
    layer's block, layer after layer)."""
    pages = kv_buffer.view(kv_buffer.shape[0], kv_buffer.shape[1], -1)
    return [pages[:, layer].view(kv_buffer.shape[0], *block_shape)
            for layer in range(kv_buffer.shape[1])]

