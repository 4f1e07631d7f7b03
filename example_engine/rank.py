"""``EngineRank``: one tensor-parallel rank of the example engine, a Ray actor.

A rank holds its shard of the target model (and of the draft model, if any), its
device pools, and a ``CacheClient`` with raykv host pools on its node: ``kv`` (MHA:
its heads; MLA: the replicated latents), ``mamba`` (its recurrent checkpoints) and
``draft`` (its draft heads, sharing the KV pool's slots). KV bytes move only between
its device pools, the shared host pools and Mooncake; Ray calls carry token ids, page
keys, slot numbers, small activations (a block's partial output) and logits.

A forward pass is driven by the engine, one ``layer`` call per layer per rank: each
call first adds the previous layer's partial outputs of all ranks (in rank order, so
every rank holds the same residual stream), then returns this rank's partial output.

**Exactness.** A prefill always runs in page-sized chunks at page-aligned positions
(the last chunk padded with token 0 to a full page), every chunk's attention reads
the keys of positions ``0..chunk end``, and the ranks run single-threaded with
deterministic algorithms. So every operation on a chunk has the same shapes and inputs
whether the pages before it were computed in this call or restored from raykv, and a
restored prefix gives bit-identical results to recomputing it. Only pages computed by
prefill chunks are offloaded (pages written by decode steps are not: a decode step
computes one row, whose rounding differs from the same row inside a chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
import torch
from raykv import (
    CacheClient,
    HostPool,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    StorageConfig,
)
from raykv.example_engine.model import ATTN, ModelConfig, ShardedModel, causal_attention, rms_norm
from raykv.example_engine.paged_kv import DeviceKV, DeviceState, page_slots

TARGET, DRAFT = "target", "draft"
TRAIL = PoolHitPolicy.TRAILING_PAGES


@dataclass
class _Pass:
    """A forward pass in progress: hidden rows ``x`` ``(T, d)`` at positions
    ``start..start+T-1``, processed in ``blocks`` of rows; ``head_rows`` want logits.

    Recurrent bookkeeping: ``ckpt_rows[i]`` = the page whose checkpoint is taken after
    row ``i``; ``final_row``, if set, is the last real row (its state becomes the
    running state, discarding padding); ``snaps[layer][i]`` keeps states after each row
    of a multi-row decode ``step``, for ``commit``."""

    x: torch.Tensor
    start: int
    blocks: list[tuple[int, int]]
    head_rows: list[int]
    step: bool = False
    ckpt_rows: dict[int, int] = field(default_factory=dict)
    final_row: int | None = None
    snaps: dict[int, dict[int, tuple]] = field(default_factory=dict)


@ray.remote(num_cpus=0)
class EngineRank:
    """TP rank ``tp_rank`` of ``tp_size`` serving ``target`` (and ``draft``).

    ``max_tokens``: device capacity in token positions; ``host_pages``: pages of the
    host KV (and draft) pool; ``state_slots``: checkpoints of the host Mamba pool.
    ``pool_tag`` names the engine: its host pools (``{pool_tag}-tp{rank}-{pool}``), so a
    restarted rank finds them again, and its ranks' ``engine_id``, so they share group
    answers with each other and not with another engine of the same model. The ranks
    of an engine run on one node, so their lookup home is that node's actor
    (``lookup_home="node"``: group queries over the local channel); a rank registers
    its deployment when it starts, so no request pays for that. A rank
    computes on one thread and reserves no Ray CPU, so several engines fit on a small
    node (the engine runs one forward at a time).
    """

    def __init__(self, target: ModelConfig, draft: ModelConfig | None, tp_rank: int,
                 tp_size: int, page_size: int, max_tokens: int, host_pages: int,
                 state_slots: int, pool_tag: str) -> None:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        if draft is not None and (draft.ssm_layers or draft.attention != "mha"):
            raise ValueError("the draft model must be a pure MHA transformer")
        self.page_size = page_size
        self.tp_rank = tp_rank
        self.models = {TARGET: ShardedModel(target, tp_rank, tp_size)}
        self.kv = {TARGET: DeviceKV(self.models[TARGET], max_tokens)}
        self.state = (DeviceState(self.models[TARGET], max_tokens // page_size)
                      if target.ssm_layers else None)
        if draft is not None:
            self.models[DRAFT] = ShardedModel(draft, tp_rank, tp_size)
            self.kv[DRAFT] = DeviceKV(self.models[DRAFT], max_tokens)
        self.client = CacheClient(StorageConfig(
            tp_rank=tp_rank, tp_size=tp_size, is_mla_model=target.attention == "mla",
            model_name=target.name,
            extra_config={"engine_id": pool_tag, "lookup_home": "node"}))
        kind = "mla" if target.attention == "mla" else "mha"
        name = f"{pool_tag}-tp{tp_rank}"
        self.pools: dict[PoolName, HostPool] = {PoolName.KV: self.client.create_host_pool(
            kind, name=f"{name}-kv", **self.kv[TARGET].host_pool_args(page_size, host_pages))}
        if self.state is not None:
            self.pools[PoolName.MAMBA] = self.client.create_host_pool(
                "mamba", name=f"{name}-mamba", **self.state.host_pool_args(state_slots))
        if draft is not None:
            self.pools[PoolName.DRAFT] = self.client.create_host_pool(
                "mha", name=f"{name}-draft",
                **self.kv[DRAFT].host_pool_args(page_size, host_pages))
        for pool_name, pool in self.pools.items():
            self.client.register_mem_host_pool_v2(pool, pool_name)
        self.client.register_deployment()  # now, not at the first request's group query
        self.passes: dict[str, _Pass] = {}

    def page_bytes(self) -> dict[str, int]:
        """Bytes of one page (KV, draft) or one checkpoint (Mamba) per host pool."""
        return {n.value: sum(p.handle.layout.object_sizes) for n, p in self.pools.items()}

    # ------------------------------------------------------------ raykv I/O
    def _side_queries(self, keys: list[str]) -> list[PoolTransfer]:
        out = []
        if PoolName.MAMBA in self.pools:
            out.append(PoolTransfer(PoolName.MAMBA, keys[-1:], None, TRAIL))
        if PoolName.DRAFT in self.pools:
            out.append(PoolTransfer(PoolName.DRAFT, keys, None))
        return out

    def group_hit(self, keys: list[str]) -> PoolTransferResult:
        """The TP group's restorable prefix of ``keys`` in L3: KV, the Mamba checkpoint
        after the last page (``trailing_pages``, window 1) and the draft KV, over both
        ranks, from one query of their node's actor (every rank gets the same answer)."""
        return self.client.group_exists(keys, self._side_queries(keys))

    def fetch(self, keys: list[str], host_pages: list[int], state_key: str | None,
              state_slot: int | None) -> dict[str, list[bool]]:
        """Read KV (and draft) pages ``keys`` from L3 into host pages ``host_pages``,
        and the checkpoint ``state_key`` into Mamba slot ``state_slot``; one bool per
        page per pool."""
        transfers = []
        if keys:
            transfers.append(PoolTransfer(PoolName.KV, keys,
                                          page_slots(host_pages, self.page_size)))
            if PoolName.DRAFT in self.pools:
                transfers.append(PoolTransfer(PoolName.DRAFT, None, None,
                                              indices_from_pool=PoolName.KV))
        if state_key is not None:
            transfers.append(PoolTransfer(PoolName.MAMBA, [state_key],
                                          torch.tensor([state_slot]), TRAIL))
        if not transfers:
            return {}
        return {k.value: v for k, v in self.client.batch_get_v2(transfers).items()}

    def offload(self, first_page: int, keys: list[str], host_pages: list[int],
                copy: list[bool], state_pages: list[int], state_slots: list[int]
                ) -> dict[str, list[bool]]:
        """Offload pages ``first_page..`` (keys ``keys``): copy device -> host pages
        where ``copy`` (the rest already hold these bytes), then store them with the
        checkpoints of ``state_pages`` (copied into ``state_slots``) in L3, one
        ``batch_set_v2`` (put-if-absent). One bool per page per pool."""
        pages = [first_page + i for i in range(len(keys))]
        dev = [p for p, c in zip(pages, copy, strict=True) if c]
        host = [h for h, c in zip(host_pages, copy, strict=True) if c]
        self.kv[TARGET].to_host(self.pools[PoolName.KV], dev, host)
        transfers = [PoolTransfer(PoolName.KV, keys, page_slots(host_pages, self.page_size))]
        if PoolName.DRAFT in self.pools:
            self.kv[DRAFT].to_host(self.pools[PoolName.DRAFT], dev, host)
            transfers.append(PoolTransfer(PoolName.DRAFT, None, None,
                                          indices_from_pool=PoolName.KV))
        if state_pages:
            self.state.to_host(self.pools[PoolName.MAMBA], state_pages, state_slots)
            transfers.append(PoolTransfer(PoolName.MAMBA, [keys[p - first_page]
                                                           for p in state_pages],
                                          torch.tensor(state_slots), TRAIL))
        return {k.value: v for k, v in self.client.batch_set_v2(transfers).items()}

    # -------------------------------------------------------------- forward
    def start_prefill(self, tokens: list[int], hit_pages: int, host_pages: list[int],
                      state_slot: int | None) -> None:
        """Restore pages ``0..hit_pages-1`` from host pages ``host_pages`` (and the
        Mamba checkpoint in ``state_slot``) into the device pools, and set up the
        prefill of the remaining tokens for every model of this rank."""
        ps = self.page_size
        pages = list(range(hit_pages))
        for name, kv in self.kv.items():
            pool = self.pools[PoolName.KV if name == TARGET else PoolName.DRAFT]
            kv.from_host(pool, host_pages, pages)
        if self.state is not None:
            if hit_pages:
                self.state.from_host(self.pools[PoolName.MAMBA], state_slot)
            else:
                self.state.reset()
        start = hit_pages * ps
        rest = tokens[start:]
        n = -(-len(rest) // ps) * ps
        ids = torch.tensor(rest + [0] * (n - len(rest)))
        full = len(rest) // ps
        ckpt = {i * ps + ps - 1: hit_pages + i for i in range(full)}
        final = None if len(rest) % ps == 0 else len(rest) - 1
        for name, model in self.models.items():
            self.passes[name] = _Pass(model.embed[ids], start,
                                      [(i, i + ps) for i in range(0, n, ps)],
                                      [len(rest) - 1], ckpt_rows=ckpt, final_row=final)

    def start_step(self, model: str, tokens: list[int], start: int) -> None:
        """Set up a decode step of ``tokens`` at positions ``start..``: one block, logits
        for every row."""
        t = len(tokens)
        self.passes[model] = _Pass(self.models[model].embed[torch.tensor(tokens)], start,
                                   [(0, t)], list(range(t)), step=True)

    def layer(self, model: str, layer: int, *partials: torch.Tensor) -> torch.Tensor:
        """Add the previous layer's ``partials`` (one per rank, in rank order) to the
        residual stream, then return this rank's partial output of ``layer`` ``(T, d)``."""
        p, m = self.passes[model], self.models[model]
        for part in partials:
            p.x = p.x + part
        kinds = m.cfg.layer_kinds
        idx = kinds[:layer].count(kinds[layer])  # index among layers of its kind
        out = torch.empty_like(p.x)
        for r0, r1 in p.blocks:
            xn = rms_norm(p.x[r0:r1])
            pos = torch.arange(p.start + r0, p.start + r1)
            if kinds[layer] == ATTN:
                mixed = self._attention(model, layer, idx, xn, pos, p.start + r0)
            else:
                mixed = self._recurrent(p, layer, idx, xn, r0)
            out[r0:r1] = mixed + m.mlp(layer, xn)
        return out

    def _attention(self, model: str, layer: int, idx: int, xn: torch.Tensor,
                   pos: torch.Tensor, start: int) -> torch.Tensor:
        m, kv = self.models[model], self.kv[model]
        end = start + len(xn)
        if kv.mla:
            kv.write(idx, start, m.mla_latent(layer, xn, pos))
            (latents,) = kv.read(idx, end)
            o = m.mla_attention(layer, xn, pos, latents, start)
        else:
            q, k, v = m.mha_qkv(layer, xn, pos)
            kv.write(idx, start, k, v)
            keys, values = kv.read(idx, end)
            o = causal_attention(q, keys, values, start)
        return m.attn_out(layer, o)

    def _recurrent(self, p: _Pass, layer: int, idx: int, xn: torch.Tensor,
                   r0: int) -> torch.Tensor:
        st, m = self.state, self.models[TARGET]
        rows = range(r0, r0 + len(xn))
        if p.step:
            keep = set(range(len(xn))) if len(xn) > 1 else set()
        else:
            keep = {r - r0 for r in rows if r in p.ckpt_rows or r == p.final_row}
        y, snaps = m.ssm(layer, xn, st.conv[idx], st.temporal[idx], keep)
        for i, (conv, temporal) in snaps.items():
            row = r0 + i
            if row in p.ckpt_rows:
                st.ckpt_conv[p.ckpt_rows[row], idx] = conv
                st.ckpt_temporal[p.ckpt_rows[row], idx] = temporal
            if row == p.final_row:
                st.conv[idx], st.temporal[idx] = conv, temporal
            if p.step:
                p.snaps.setdefault(idx, {})[row] = (conv, temporal)
        return m.ssm_out(layer, y)

    def head(self, model: str, *partials: torch.Tensor) -> torch.Tensor:
        """Add the last layer's partials; logits ``(len(head_rows), vocab)``."""
        p = self.passes[model]
        x = p.x
        for part in partials:
            x = x + part
        return self.models[model].logits(x[p.head_rows])

    def commit(self, rows: int) -> None:
        """Keep the target's recurrent state after the first ``rows`` rows of the last
        multi-row decode step (speculative tokens after them were rejected)."""
        p = self.passes[TARGET]
        for idx, snaps in p.snaps.items():
            self.state.conv[idx], self.state.temporal[idx] = snaps[rows - 1]
