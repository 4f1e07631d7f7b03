"""raykv's page hashes of vLLM blocks (pure: no vLLM needed)."""

import hashlib
import os
import subprocess
import sys

import msgpack
import pytest
from raykv.integrations.vllm.page_hash import (
    ROOT,
    PageHashChain,
    no_extra_keys,
    page_hash,
)

TOKENS = list(range(10))  # two full blocks of 4 tokens and 2 tokens more

# The page hashes of TOKENS in blocks of 4: any change of the scheme changes them, which
# strands every page stored before it (a miss, never a wrong load), so it must be a
# deliberate change of ROOT's version label.
GOLDEN = ["7131e370f5bbcdaa78d517dbbfb4c3a97d4a753ad79bf2dc101569ab431e7d71",
          "16aadee8d754687051331cb5da36648f4278a0a10491b00ccb260d68002e29f1"]


def chain(tokens=TOKENS, extra=no_extra_keys, block_size=4) -> list[bytes]:
    return list(PageHashChain(block_size).extend(tokens, len(tokens), extra))


def salted(salt):
    """vLLM's extra keys of a request with cache salt ``salt``: on its first block only."""
    def extra(start, end, mm_idx):
        return ((("cache_salt", salt),) if start == 0 else None), mm_idx
    return extra


def test_golden_value_and_its_definition():
    assert [h.hex() for h in chain()] == GOLDEN
    # The definition, spelled out: SHA-256 of msgpack (parent, tokens, extra keys).
    h0 = hashlib.sha256(msgpack.packb((ROOT, [0, 1, 2, 3], None), use_bin_type=True)).digest()
    h1 = hashlib.sha256(msgpack.packb((h0, [4, 5, 6, 7], None), use_bin_type=True)).digest()
    assert [h0.hex(), h1.hex()] == GOLDEN


def test_same_hashes_in_processes_of_any_hash_seed():
    """Other processes, with PYTHONHASHSEED unset, 0 and 12345, compute the same hashes
    (vLLM's own block hashes differ across such processes)."""
    code = ("from raykv.integrations.vllm.page_hash import PageHashChain, no_extra_keys; "
            "c = PageHashChain(4); t = list(range(10)); "
            "print(','.join(h.hex() for h in c.extend(t, 10, no_extra_keys)))")
    outs = set()
    for seed in (None, "0", "12345"):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True, timeout=60)
        outs.add(out.stdout.strip())
    assert outs == {",".join(GOLDEN)}


def test_chain_only_hashes_full_blocks_and_grows_incrementally():
    c = PageHashChain(4)
    calls = []

    def extra(start, end, mm_idx):
        calls.append((start, end, mm_idx))
        return None, mm_idx + 1  # a cursor that moves: passed on to the next block

    assert c.extend(TOKENS[:3], 3, extra) == []
    assert len(c.extend(TOKENS[:5], 5, extra)) == 1
    assert [h.hex() for h in c.extend(TOKENS, 10, extra)] == GOLDEN
    assert c.extend(TOKENS, 10, extra) is c.hashes  # nothing new: no hashing
    assert calls == [(0, 4, 0), (4, 8, 1)]  # each block hashed once, cursor carried


def test_salt_changes_only_the_first_blocks_own_input():
    """A salt is an extra key of block 0 only: block 0's hash changes, and every later
    block's hash changes through the chain alone (same tokens, no extra keys of its
    own). Two salts differ; the same salt gives the same hashes."""
    plain, a, b = chain(), chain(extra=salted("a")), chain(extra=salted("b"))
    assert a == chain(extra=salted("a"))
    assert len({plain[0], a[0], b[0]}) == 3 and len({plain[1], a[1], b[1]}) == 3
    assert a[0] == page_hash(None, [0, 1, 2, 3], (("cache_salt", "a"),))
    assert a[1] == page_hash(a[0], [4, 5, 6, 7], None)  # block 1 itself is unsalted


def test_extra_keys_and_tokens_change_the_hash():
    base = page_hash(None, [1, 2], None)
    variants = [
        page_hash(None, [1, 3], None),
        page_hash(b"\x00" * 32, [1, 2], None),
        page_hash(None, [1, 2], (("lora", "adapter", "/a"),)),
        page_hash(None, [1, 2], (("lora", "adapter", "/b"),)),
        page_hash(None, [1, 2], (("mm", "img-hash", 0),)),
        page_hash(None, [1, 2], (("mm", "img-hash", 1),)),
        page_hash(None, [1, 2], (("prompt_embeds", b"\x01" * 32),)),
        page_hash(None, [1, 2], (("cache_salt", ""),)),
    ]
    assert len(set(variants + [base])) == len(variants) + 1
    assert page_hash(None, (1, 2), None) == base  # a tuple of tokens is the same block


def test_refuses_types_without_canonical_bytes():
    class Opaque:
        pass

    with pytest.raises(TypeError, match="cannot hash a Opaque"):
        page_hash(None, [1], (("mm", Opaque(), 0),))
    with pytest.raises(ValueError, match="block_size"):
        PageHashChain(0)
