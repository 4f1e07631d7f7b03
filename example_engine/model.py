"""A small decoder-only transformer, sharded for tensor parallelism (example engine).

Seeded random weights (float32). Blocks use a *parallel residual* (GPT-J / PaLM):
``x + mixer(norm(x)) + mlp(norm(x))``, so one TP layer needs one sum of the ranks'
partial outputs. A mixer is attention (MHA with RoPE, or MLA: one latent vector per
token, up-projected per head) or, in hybrid models, a Mamba-like recurrent layer (a
causal depthwise conv and a diagonal linear state space recurrence).

Sharding over ``tp_size`` ranks: attention heads, MLP columns and recurrent channels
are split; the embedding, LM head, MLA down-projections and the recurrent ``B``/``C``
projections are replicated. A rank's partial output of a block, summed over ranks,
is the block's contribution to the residual stream.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN, SSM = "attention", "recurrent"


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a model. Sizes are per model (all TP ranks together).

    ``attention``: ``"mha"`` (K and V per head are cached) or ``"mla"`` (one latent of
    ``latent_dim + rope_dim`` floats per token is cached, identical on every TP rank).
    ``ssm_every``: every ``ssm_every``-th layer (layers ``ssm_every-1, 2*ssm_every-1,
    ...``) is recurrent; 0 means none (a pure transformer). ``branch_scale`` scales the
    initial std of every block's output projections, so the residual stream changes
    gradually over layers. Weights depend on ``name``, ``seed`` and shapes only: a
    model with the same name and dimensions but fewer layers is the target's first
    layers (a self-speculative draft).
    """

    name: str
    vocab: int = 512
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    head_dim: int = 32
    mlp: int = 1024
    attention: str = "mha"
    latent_dim: int = 64
    rope_dim: int = 16
    ssm_every: int = 0
    ssm_heads: int = 8
    ssm_head_dim: int = 32
    ssm_state: int = 16
    conv_kernel: int = 4
    branch_scale: float = 0.2
    seed: int = 0

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        n = self.ssm_every
        return tuple(SSM if n and (i + 1) % n == 0 else ATTN for i in range(self.layers))

    @property
    def attn_layers(self) -> int:
        return self.layer_kinds.count(ATTN)

    @property
    def ssm_layers(self) -> int:
        return self.layer_kinds.count(SSM)

    @property
    def kv_cache_dim(self) -> int:
        """MLA: floats cached per token and layer (latent then RoPE key)."""
        return self.latent_dim + self.rope_dim

    @property
    def ssm_channels(self) -> int:
        return self.ssm_heads * self.ssm_head_dim


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Row-wise RMS norm of ``(T, d)`` (no weight)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``(T, heads, dim)`` at integer ``positions``
    ``(T,)``. Element-wise per position, so a token's result never depends on the
    other rows of the call."""
    half = x.shape[-1] // 2
    inv = base ** (-torch.arange(half, dtype=torch.float32) / half)
    ang = positions.to(torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     start: int) -> torch.Tensor:
    """Attention of ``T`` query rows at positions ``start..start+T-1`` over keys
    ``0..start+T-1``. ``q`` ``(T, h, dq)``, ``k`` ``(E, h, dq)``, ``v`` ``(E, h, dv)``
    with ``E = start + T``; returns ``(T, h * dv)``. Masked keys get weight exactly 0."""
    t, h, dq = q.shape
    scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) * dq ** -0.5
    rows = torch.arange(start, start + t)[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None] > rows, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.transpose(0, 1))
    return out.transpose(0, 1).reshape(t, -1)


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:7],
                          "little")


@dataclass
class ShardedModel:
    """Weights of one TP rank's shard. ``w[layer][name]`` holds layer tensors; every
    full tensor is drawn from its own seeded generator, then sliced, so ranks agree."""

    cfg: ModelConfig
    tp_rank: int
    tp_size: int
    w: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        c, n = self.cfg, self.tp_size
        for what, size in (("heads", c.heads), ("mlp", c.mlp), ("ssm_heads", c.ssm_heads)):
            if size % n:
                raise ValueError(f"{c.name}: {what}={size} does not split over tp_size={n}")
        d, out = c.hidden, c.branch_scale
        self.embed = self._param("embed", (c.vocab, d), 1.0)
        self.lm_head = self._param("lm_head", (d, c.vocab), d ** -0.5)
        for i, kind in enumerate(c.layer_kinds):
            p = dict(mlp_gate=self._param(f"{i}.gate", (d, c.mlp), d ** -0.5, 1),
                     mlp_up=self._param(f"{i}.up", (d, c.mlp), d ** -0.5, 1),
                     mlp_down=self._param(f"{i}.down", (c.mlp, d), out * c.mlp ** -0.5, 0))
            hd = c.heads * c.head_dim
            if kind == SSM:
                ch = c.ssm_channels
                p |= dict(u=self._param(f"{i}.u", (d, ch), d ** -0.5, 1),
                          z=self._param(f"{i}.z", (d, ch), d ** -0.5, 1),
                          conv=self._param(f"{i}.conv", (c.conv_kernel, ch), 0.5, 1),
                          a_log=self._param(f"{i}.a_log", (c.ssm_heads,), 1.0, 0),
                          b=self._param(f"{i}.b", (d, c.ssm_state), d ** -0.5),
                          c=self._param(f"{i}.c", (d, c.ssm_state), d ** -0.5),
                          out=self._param(f"{i}.out", (ch, d), out * ch ** -0.5, 0))
            elif c.attention == "mla":
                r = c.latent_dim
                p |= dict(dkv=self._param(f"{i}.dkv", (d, r), d ** -0.5),
                          kr=self._param(f"{i}.kr", (d, c.rope_dim), d ** -0.5),
                          q=self._param(f"{i}.q", (d, hd), d ** -0.5, 1),
                          qr=self._param(f"{i}.qr", (d, c.heads * c.rope_dim), d ** -0.5, 1),
                          uk=self._param(f"{i}.uk", (r, hd), r ** -0.5, 1),
                          uv=self._param(f"{i}.uv", (r, hd), r ** -0.5, 1),
                          o=self._param(f"{i}.o", (hd, d), out * hd ** -0.5, 0))
            else:
                p |= dict(qkv=torch.cat([self._param(f"{i}.{m}", (d, hd), d ** -0.5, 1)
                                         for m in "qkv"], dim=1),
                          o=self._param(f"{i}.o", (hd, d), out * hd ** -0.5, 0))
            self.w.append(p)

    def _param(self, name: str, shape: tuple[int, ...], std: float,
               shard_dim: int | None = None) -> torch.Tensor:
        """A seeded normal tensor of std ``std``, this rank's slice along ``shard_dim``
        (replicated if None)."""
        g = torch.Generator().manual_seed(_seed(self.cfg.name, self.cfg.seed, name, shape))
        full = torch.randn(shape, generator=g) * std
        if shard_dim is None:
            return full
        return full.chunk(self.tp_size, dim=shard_dim)[self.tp_rank].contiguous()

    @property
    def local_heads(self) -> int:
        return self.cfg.heads // self.tp_size

    @property
    def local_ssm_heads(self) -> int:
        return self.cfg.ssm_heads // self.tp_size

    # ---------------------------------------------------------------- pieces
    def mlp(self, layer: int, xn: torch.Tensor) -> torch.Tensor:
        p = self.w[layer]
        return (F.silu(xn @ p["mlp_gate"]) * (xn @ p["mlp_up"])) @ p["mlp_down"]

    def mha_qkv(self, layer: int, xn: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Local heads' ``q, k, v`` ``(T, heads/tp, head_dim)``, RoPE applied to q and k."""
        h, hd = self.local_heads, self.cfg.head_dim
        q, k, v = (xn @ self.w[layer]["qkv"]).view(len(xn), 3, h, hd).unbind(1)
        return rope(q, positions), rope(k, positions), v

    def mla_latent(self, layer: int, xn: torch.Tensor, positions: torch.Tensor
                   ) -> torch.Tensor:
        """The cached MLA vector per token, ``(T, latent_dim + rope_dim)``: the latent,
        then the shared RoPE key. Replicated weights: identical on every rank."""
        p = self.w[layer]
        k_rope = rope((xn @ p["kr"])[:, None], positions)[:, 0]
        return torch.cat([xn @ p["dkv"], k_rope], dim=-1)

    def mla_attention(self, layer: int, xn: torch.Tensor, positions: torch.Tensor,
                      latents: torch.Tensor, start: int) -> torch.Tensor:
        """Local heads' attention output ``(T, heads/tp * head_dim)`` over the cached
        ``latents`` ``(start+T, kv_cache_dim)``."""
        c, p, h = self.cfg, self.w[layer], self.local_heads
        t, e = len(xn), len(latents)
        lat, k_rope = latents[:, :c.latent_dim], latents[:, c.latent_dim:]
        q = torch.cat([(xn @ p["q"]).view(t, h, c.head_dim),
                       rope((xn @ p["qr"]).view(t, h, c.rope_dim), positions)], dim=-1)
        k = torch.cat([(lat @ p["uk"]).view(e, h, c.head_dim),
                       k_rope[:, None].expand(e, h, c.rope_dim)], dim=-1)
        return causal_attention(q, k, (lat @ p["uv"]).view(e, h, c.head_dim), start)

    def ssm(self, layer: int, xn: torch.Tensor, conv_state: torch.Tensor,
            state: torch.Tensor, keep: set[int]) -> tuple[torch.Tensor, dict[int, tuple]]:
        """Recurrent mixer over ``T`` rows, updating ``conv_state`` ``(K-1, channels/tp)``
        and ``state`` ``(heads/tp, head_dim, ssm_state)`` in place, token by token.

        Returns the mixer output ``(T, channels/tp)`` (before the output projection) and
        ``{i: (conv_state, state)}`` copies taken after row ``i`` for every ``i`` in
        ``keep`` (checkpoints and rollback points)."""
        c, p = self.cfg, self.w[layer]
        t, k = len(xn), c.conv_kernel
        u = torch.cat([conv_state, xn @ p["u"]])             # (K-1+T, ch)
        conv = F.silu((u.unfold(0, k, 1) * p["conv"].T[None]).sum(-1))  # (T, ch)
        b, cc = xn @ p["b"], xn @ p["c"]                      # (T, N)
        decay = torch.exp(-F.softplus(p["a_log"]))[:, None, None]
        x = conv.view(t, self.local_ssm_heads, c.ssm_head_dim)
        ys, snaps = [], {}
        for i in range(t):
            state.mul_(decay).add_(x[i][:, :, None] * b[i])
            ys.append(state @ cc[i])
            if i in keep:
                snaps[i] = (u[i + 1:i + k].clone(), state.clone())
        conv_state.copy_(u[t:])
        y = torch.stack(ys).reshape(t, -1) * F.silu(xn @ p["z"])
        return y, snaps

    def ssm_out(self, layer: int, y: torch.Tensor) -> torch.Tensor:
        return y @ self.w[layer]["out"]

    def attn_out(self, layer: int, o: torch.Tensor) -> torch.Tensor:
        return o @ self.w[layer]["o"]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``(T, vocab)`` logits of final hidden rows ``x`` ``(T, d)``."""
        return rms_norm(x) @ self.lm_head
