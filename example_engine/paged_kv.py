"""Device-side pools of one rank (plain torch tensors standing in for GPU memory) and
the page copies between them and raykv's shared host pools.

The example engine runs one request at a time, so a request's page table is the
identity: token position ``p`` lives in device slot ``p`` (page ``p // page_size``).
Device buffers are layer-first, as on a GPU; host pools are ``page_first`` (a page is
contiguous across layers), so a page copy transposes the layer and slot dimensions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from raykv import HostPool
from raykv.example_engine.model import ShardedModel


def page_slots(pages: Sequence[int], page_size: int) -> torch.Tensor:
    """Token slots of ``pages``, ``page_size`` per page, page by page."""
    p = torch.as_tensor(list(pages), dtype=torch.long)
    return (p[:, None] * page_size + torch.arange(page_size)[None]).reshape(-1)


class DeviceKV:
    """Attention KV of one rank for ``max_tokens`` positions.

    MHA: ``k`` and ``v`` ``(attn_layers, max_tokens, heads/tp, head_dim)``;
    MLA: ``latent`` ``(attn_layers, max_tokens, latent_dim + rope_dim)``, the same on
    every TP rank.
    """

    def __init__(self, model: ShardedModel, max_tokens: int) -> None:
        c = model.cfg
        self.mla = c.attention == "mla"
        if self.mla:
            self.buffers = [torch.zeros(c.attn_layers, max_tokens, c.kv_cache_dim)]
        else:
            shape = (c.attn_layers, max_tokens, model.local_heads, c.head_dim)
            self.buffers = [torch.zeros(shape), torch.zeros(shape)]

    def host_pool_args(self, page_size: int, pages: int) -> dict:
        """``create_host_pool`` arguments of a host pool of ``pages`` pages that holds
        exactly these buffers' pages."""
        b = self.buffers[0]
        common = dict(page_size=page_size, size=pages * page_size, layer_num=b.shape[0],
                      dtype=b.dtype)
        if self.mla:
            return common | dict(kv_cache_dim=b.shape[2])
        return common | dict(head_num=b.shape[2], head_dim=b.shape[3])

    def write(self, layer: int, start: int, *values: torch.Tensor) -> None:
        """Store ``T`` tokens' ``(k, v)`` (MHA) or ``latent`` (MLA) at positions
        ``start..start+T-1``."""
        for buf, val in zip(self.buffers, values, strict=True):
            buf[layer, start:start + len(val)] = val

    def read(self, layer: int, end: int) -> list[torch.Tensor]:
        """Views of positions ``0..end-1`` of every buffer of ``layer``."""
        return [b[layer, :end] for b in self.buffers]

    @staticmethod
    def _host_views(pool: HostPool) -> list[torch.Tensor]:
        """The host pool's buffers as ``(slots, layers, ...)`` tensors."""
        buf = pool.kv_buffer
        return [buf[:, :, 0]] if buf.dim() == 4 else [buf[0], buf[1]]

    def to_host(self, pool: HostPool, pages: Sequence[int], host_pages: Sequence[int]) -> int:
        """Copy device ``pages`` into host pages ``host_pages``; returns bytes copied."""
        if not pages:
            return 0
        src, dst = page_slots(pages, pool.page_size), page_slots(host_pages, pool.page_size)
        moved = 0
        for dev, host in zip(self.buffers, self._host_views(pool), strict=True):
            part = dev.index_select(1, src).transpose(0, 1)
            host.index_copy_(0, dst, part)
            moved += part.numel() * part.element_size()
        return moved

    def from_host(self, pool: HostPool, host_pages: Sequence[int], pages: Sequence[int]) -> int:
        """Copy host pages ``host_pages`` into device ``pages``; returns bytes copied."""
        if not pages:
            return 0
        src, dst = page_slots(host_pages, pool.page_size), page_slots(pages, pool.page_size)
        moved = 0
        for dev, host in zip(self.buffers, self._host_views(pool), strict=True):
            part = host.index_select(0, src).transpose(0, 1)
            dev.index_copy_(1, dst, part)
            moved += part.numel() * part.element_size()
        return moved


class DeviceState:
    """Recurrent state of one rank: the running ``conv`` ``(ssm_layers, K-1,
    channels/tp)`` and ``temporal`` ``(ssm_layers, heads/tp, head_dim, ssm_state)``
    state, and per-page checkpoints of both (the state after a page's last token)
    taken during prefill, waiting to be offloaded."""

    def __init__(self, model: ShardedModel, max_pages: int) -> None:
        c = model.cfg
        self.conv = torch.zeros(c.ssm_layers, c.conv_kernel - 1,
                                c.ssm_channels // model.tp_size)
        self.temporal = torch.zeros(c.ssm_layers, model.local_ssm_heads, c.ssm_head_dim,
                                    c.ssm_state)
        self.ckpt_conv = torch.zeros(max_pages, *self.conv.shape)
        self.ckpt_temporal = torch.zeros(max_pages, *self.temporal.shape)

    def host_pool_args(self, slots: int) -> dict:
        """``create_host_pool("mamba", ...)`` arguments: one checkpoint per slot."""
        return dict(size=slots, temporal_shape=tuple(self.temporal.shape),
                    temporal_dtype=self.temporal.dtype, conv_shapes=[tuple(self.conv.shape)],
                    conv_dtypes=[self.conv.dtype])

    def reset(self) -> None:
        self.conv.zero_()
        self.temporal.zero_()

    def to_host(self, pool: HostPool, pages: Sequence[int], slots: Sequence[int]) -> int:
        """Copy the checkpoints of ``pages`` into host ``slots``; returns bytes copied."""
        if not pages:
            return 0
        src, dst = torch.as_tensor(list(pages)), torch.as_tensor(list(slots))
        pool.temporal_buffer.index_copy_(0, dst, self.ckpt_temporal.index_select(0, src))
        pool.conv_buffer[0].index_copy_(0, dst, self.ckpt_conv.index_select(0, src))
        return len(pages) * (self.temporal.nbytes + self.conv.nbytes)

    def from_host(self, pool: HostPool, slot: int) -> int:
        """Make the checkpoint in host ``slot`` the running state; returns bytes copied."""
        self.temporal.copy_(pool.temporal_buffer[slot])
        self.conv.copy_(pool.conv_buffer[0][slot])
        return self.temporal.nbytes + self.conv.nbytes
