"""A random-weight Llama and a byte-level BPE tokenizer for vLLM, made locally (no
download): the model of ``raykv demo --engine vllm`` and of the vLLM tests.

Imports ``transformers`` and ``tokenizers`` (installed with vLLM) only when called.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass

VOCAB = 2048  # tokens of the tokenizer and the model; ids 0-2 are <s>, </s>, <pad>


@dataclass(frozen=True)
class LlamaDims:
    """A Llama's geometry: ``hidden = heads * head_dim``; grouped-query attention with
    ``kv_heads`` KV heads; MLP width ``intermediate``."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512

    @classmethod
    def of(cls, hidden: int, layers: int, head_dim: int = 64) -> LlamaDims:
        """A model of width ``hidden``: ``hidden / head_dim`` heads, half as many KV
        heads (at least 1), an MLP 3x as wide."""
        if hidden % head_dim:
            raise ValueError(f"hidden {hidden} is not a multiple of head_dim {head_dim}")
        heads = hidden // head_dim
        return cls(hidden=hidden, layers=layers, heads=heads, kv_heads=max(1, heads // 2),
                   head_dim=head_dim, intermediate=3 * hidden)

    @property
    def params(self) -> int:
        """Parameters (embeddings and LM head included)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp + 2 * self.hidden) + 2 * VOCAB * self.hidden \
            + self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of one token over all layers."""
        return self.layers * self.kv_heads * self.head_dim * 2 * 2


MARKER = "raykv_dims.json"
"""The file of a made model's folder that holds its dims and seed, written last."""
FORMAT = 1
"""The version of what ``_build`` writes: raise it when the model or tokenizer it makes
changes, so that no cached copy of the old one is used."""


def cache_root() -> str:
    """Where made models are kept for later calls: ``$XDG_CACHE_HOME/raykv/models``
    (default ``~/.cache/raykv/models``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "raykv", "models")


def make_llama(out: str, dims: LlamaDims = LlamaDims(), seed: int = 0) -> str:
    """Write a bf16 Llama of ``dims`` with seeded random weights (normal, std 0.05, so
    greedy output is not degenerate) and a tokenizer trained on Python's own sources
    to ``out``, and return ``out``. A folder that already holds a model of ``dims`` is
    kept as it is. The model is made once per machine and user (the default dims take
    ~10 CPU-s, mostly the tokenizer) and kept under ``cache_root()``, by its dims, seed,
    ``FORMAT`` and Python version; later calls copy it (a few MB). Processes making the
    same model at once each make it; the first to finish is kept."""
    marker = os.path.join(out, MARKER)
    want = asdict(dims) | {"seed": seed}
    if os.path.exists(marker) and os.path.exists(os.path.join(out, "config.json")):
        with open(marker) as f:
            if json.load(f) == want:
                return out
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    key = json.dumps(want | {"format": FORMAT, "vocab": VOCAB, "python": python},
                     sort_keys=True)
    cached = os.path.join(cache_root(), hashlib.sha256(key.encode()).hexdigest()[:16])
    if not os.path.exists(os.path.join(cached, MARKER)):
        os.makedirs(cache_root(), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".making-", dir=cache_root())
        try:
            _build(tmp, dims, seed, want)
            try:
                os.rename(tmp, cached)  # atomic; another process's copy may be there first
            except OSError:
                if not os.path.exists(os.path.join(cached, MARKER)):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(cached, out, dirs_exist_ok=True)
    return out


def _build(out: str, dims: LlamaDims, seed: int, want: dict) -> None:
    """Make the model and tokenizer of ``make_llama`` in folder ``out`` (its ``MARKER``,
    holding ``want``, last)."""
    marker = os.path.join(out, MARKER)
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:60]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"the tokenizer learnt {tok.get_vocab_size()} tokens, not {VOCAB}")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(out)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=dims.hidden,
                      intermediate_size=dims.intermediate, num_hidden_layers=dims.layers,
                      num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
                      head_dim=dims.head_dim, max_position_embeddings=16384, bos_token_id=0,
                      eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
                      torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    with open(marker, "w") as f:
        json.dump(want, f)
