"""Model variants of the example engine, at any size.

``mha``: a transformer with multi-head attention. ``mla``: multi-head latent attention
(one cached latent per token, replicated over TP ranks; raykv stores it once). ``hybrid``:
every second layer is a Mamba-like recurrent layer (KV pool + Mamba pool). A ``-draft``
suffix adds a self-speculative draft model: the target's first ``draft_layers`` layers as
an MHA model with its own KV (raykv's ``draft`` pool).
"""

from __future__ import annotations

from raykv.example_engine.model import ModelConfig

VARIANTS = ("mha", "mla", "hybrid", "mha-draft", "mla-draft", "hybrid-draft")


def build(variant: str, name: str, *, hidden: int = 256, layers: int = 4, head_dim: int = 32,
          vocab: int = 512, draft_layers: int = 1, seed: int = 0
          ) -> tuple[ModelConfig, ModelConfig | None]:
    """``(target, draft or None)`` for ``variant`` (one of ``VARIANTS``). ``name`` is the
    model name raykv keys carry; heads = ``hidden // head_dim``; MLP = 4 x hidden."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    base, _, draft = variant.partition("-")
    heads = hidden // head_dim
    common = dict(vocab=vocab, hidden=hidden, heads=heads, head_dim=head_dim, mlp=4 * hidden,
                  seed=seed)
    target = ModelConfig(
        name=name, layers=layers, attention="mla" if base == "mla" else "mha",
        latent_dim=2 * head_dim, rope_dim=head_dim // 2, ssm_every=2 if base == "hybrid" else 0,
        ssm_heads=heads, ssm_head_dim=head_dim, ssm_state=16, **common)
    if not draft:
        return target, None
    return target, ModelConfig(name=name, layers=draft_layers, **common)
