"""Scheduler-side bookkeeping of the vLLM connector (pure: no vLLM needed)."""

from dataclasses import dataclass

import pytest
from raykv.integrations.vllm.page_hash import PageHashChain
from raykv.integrations.vllm.plan import (
    BlockTransfer,
    RequestBlocks,
    external_tokens,
    first_invalid_block,
    hash_hex,
    max_loadable_blocks,
    plan_load,
    plan_save,
)


@dataclass
class Req:  # the attributes of vLLM's Request the plan reads
    request_id: str


def test_one_token_is_always_left_to_compute():
    assert max_loadable_blocks(1000, 128) == 7
    assert max_loadable_blocks(1024, 128) == 7  # a whole last block: its last token computed
    assert max_loadable_blocks(1025, 128) == 8
    assert max_loadable_blocks(1, 128) == 0
    assert max_loadable_blocks(0, 128) == 0


def test_external_tokens_beyond_local_hit():
    assert external_tokens(7, 0, 128) == 896
    assert external_tokens(7, 256, 128) == 640
    assert external_tokens(2, 512, 128) == 0


def test_hash_hex():
    assert hash_hex(b"\x01\xab") == "01ab"
    assert hash_hex("abc") == "abc"


def test_plan_load_skips_local_hit_blocks():
    hashes = [bytes([i]) for i in range(6)]
    x = plan_load("r", [10, 11, 12, 13, 14, 15], hashes, local_hit_tokens=2 * 16,
                  num_external_tokens=3 * 16, block_size=16)
    assert x.block_ids == [12, 13, 14] and x.hashes == ["02", "03", "04"]
    assert plan_load("r", [1], hashes, 0, 0, 16) is None
    with pytest.raises(ValueError, match="3 blocks to load"):
        plan_load("r", [1, 2], hashes, 0, 3 * 16, 16)


def test_plan_save_only_newly_full_blocks():
    chain = PageHashChain(16)
    chain.hashes += [b"a", b"b"]  # as if extended over two full blocks
    st = RequestBlocks(Req("r"), chain, block_ids=[5, 6, 7], saved_blocks=0)
    assert plan_save(st, 15, 16) is None  # block 0 not full yet
    x = plan_save(st, 40, 16)  # blocks 0 and 1 full (2 hashes known)
    assert x.block_ids == [5, 6] and x.hashes == ["61", "62"] and st.saved_blocks == 2
    assert x.context == []
    assert plan_save(st, 47, 16) is None  # block 2 has no hash yet
    chain.hashes.append(b"c")
    x = plan_save(st, 48, 16)
    assert x.block_ids == [7] and st.saved_blocks == 3
    assert x.context == [5, 6]  # the blocks its KV was computed over


def test_a_save_is_computed_over_its_blocks_and_context():
    """A save over a failed block is one whose blocks or earlier blocks hold it (a block
    shared through vLLM's prefix cache is in the context of every request holding it);
    blocks after the saved ones are not read by them."""
    x = BlockTransfer("r2", [50, 51, 52], ["a", "b", "c"], context=[0, 1, 49])
    assert x.computed_over({49})
    assert x.computed_over({51, 700})
    assert not x.computed_over({53, 98})
    assert not x.computed_over(set())
    assert not BlockTransfer("r1", [98], ["d"]).computed_over({49})


def test_first_invalid_block():
    assert first_invalid_block([4, 5, 6], {6, 5}) == 1
    assert first_invalid_block([4, 5, 6], {9}) is None


def test_import_raykv_never_imports_vllm():
    import subprocess
    import sys

    code = ("import sys, raykv, raykv.integrations, raykv.integrations.vllm, "
            "raykv.integrations.vllm.plan, raykv.integrations.vllm.options, "
            "raykv.integrations.vllm.side, raykv.integrations.vllm.page_hash; "
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"
