"""A tiny random-weight Llama and a byte-level BPE tokenizer for vLLM tests, made
locally (no download): 4 layers, hidden 256, 4 heads, 2 KV heads, head_dim 64, vocab
2048, bf16 (3.4 M parameters). The tokenizer is trained on Python's own sources."""

from __future__ import annotations

import glob
import os


def make_tiny_llama(out: str) -> str:
    """Write the model and tokenizer to ``out`` (once; ~10 s) and return ``out``."""
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:60]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(
        vocab_size=2048, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=4096, bos_token_id=0,
                      eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
                      torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # a larger init std, so greedy output is not degenerate
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    import sys

    print(make_tiny_llama(sys.argv[1]))
