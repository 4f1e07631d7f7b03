"""Scheduler-side bookkeeping of the vLLM connector (pure: no vLLM needed)."""

from dataclasses import dataclass

import pytest
from raykv.integrations.vllm.page_hash import PageHashChain
from raykv.integrations.vllm.request_blocks import (
    BlockTransfer,
    RequestBlocks,
    blocks_to_load,
    blocks_to_save,
    external_tokens,
    first_invalid_block,
    hash_hex,
    mark_failed,
    max_loadable_blocks,
    restart,
)


@dataclass
class Req:  # the attributes of vLLM's Request the bookkeeping reads
    request_id: str


def test_every_full_block_may_load_and_one_token_is_left_to_compute():
    assert max_loadable_blocks(1000, 128) == 7
    assert max_loadable_blocks(1024, 128) == 8  # the last block too
    assert max_loadable_blocks(1025, 128) == 8
    assert max_loadable_blocks(1, 128) == 0
    assert max_loadable_blocks(0, 128) == 0
    assert external_tokens(8, 0, 128, 1024) == 1023  # its last token computed again
    assert external_tokens(8, 896, 128, 1024) == 127  # vLLM's own hit of 7 blocks
    assert external_tokens(8, 0, 128, 1025) == 1024


def test_external_tokens_beyond_local_hit():
    assert external_tokens(7, 0, 128, 1000) == 896
    assert external_tokens(7, 256, 128, 1000) == 640
    assert external_tokens(2, 512, 128, 1000) == 0


def test_hash_hex():
    assert hash_hex(b"\x01\xab") == "01ab"
    assert hash_hex("abc") == "abc"


def test_plan_load_skips_local_hit_blocks():
    hashes = [bytes([i]) for i in range(6)]
    x = blocks_to_load("r", [10, 11, 12, 13, 14, 15], hashes, local_hit_tokens=2 * 16,
                  num_external_tokens=3 * 16, block_size=16)
    assert x.block_ids == [12, 13, 14] and x.hashes == ["02", "03", "04"]
    assert blocks_to_load("r", [1], hashes, 0, 0, 16) is None
    # a prompt of 6 whole blocks, all hit: its last block loads whole, one token short
    x = blocks_to_load("r", [10, 11, 12, 13, 14, 15], hashes, local_hit_tokens=5 * 16,
                       num_external_tokens=15, block_size=16)
    assert x.block_ids == [15] and x.hashes == ["05"]
    assert len(blocks_to_load("r", [10, 11, 12, 13, 14, 15], hashes, 0, 95, 16).block_ids) == 6
    with pytest.raises(ValueError, match="3 blocks to load"):
        blocks_to_load("r", [1, 2], hashes, 0, 3 * 16, 16)


def test_plan_save_only_newly_full_blocks():
    chain = PageHashChain(16)
    chain.hashes += [b"a", b"b"]  # as if extended over two full blocks
    st = RequestBlocks(Req("r"), chain, block_ids=[5, 6, 7], saved_blocks=0)
    assert blocks_to_save(st, 15, 16) is None  # block 0 not full yet
    x = blocks_to_save(st, 40, 16)  # blocks 0 and 1 full (2 hashes known)
    assert x.block_ids == [5, 6] and x.hashes == ["61", "62"] and st.saved_blocks == 2
    assert x.context == []
    assert blocks_to_save(st, 47, 16) is None  # block 2 has no hash yet
    chain.hashes.append(b"c")
    x = blocks_to_save(st, 48, 16)
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
            "raykv.integrations.vllm.request_blocks, raykv.integrations.vllm.options, "
            "raykv.integrations.vllm.side, raykv.integrations.vllm.page_hash; "
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


def _state(block_ids, own_start, saved):
    chain = PageHashChain(16)
    chain.hashes += [bytes([i]) for i in range(len(block_ids))]
    return RequestBlocks(Req("r"), chain, block_ids=list(block_ids), saved_blocks=saved,
                         own_start=own_start)


def test_a_request_sharing_a_failed_block_saves_again_once_restarted():
    """vLLM's shared-blocks recovery: request 2 holds shared block 49 (index 49, before
    its own blocks from 50) which failed to load; vLLM restarts it at its block 50, so
    it rewrites every block it computed over the failure and saves them anew from 50
    (block 49 is saved by the request that recomputes it). Blocks without a failed one
    are left alone."""
    r2 = _state(range(100, 160), own_start=50, saved=53)
    mark_failed(r2, {149})
    assert r2.dirty_from == 50
    assert blocks_to_save(r2, 55 * 16, 16) is None  # dirty: nothing saved
    restart(r2, 50 * 16, 16)
    assert (r2.dirty_from, r2.own_start, r2.saved_blocks) == (None, 50, 50)
    assert blocks_to_save(r2, 53 * 16, 16).block_ids == [150, 151, 152]
    other = _state(range(300, 310), own_start=0, saved=5)
    mark_failed(other, {149})
    assert other.dirty_from is None


def test_a_request_whose_own_load_failed_recomputes_from_the_failed_block():
    r1 = _state(range(0, 100), own_start=99, saved=100)
    mark_failed(r1, set(range(49, 99)))
    assert r1.dirty_from == 99
    restart(r1, 49 * 16, 16)  # vLLM truncates it to its first failed block
    assert (r1.dirty_from, r1.own_start, r1.saved_blocks) == (None, 49, 49)


def test_a_request_vllm_keeps_computing_past_the_failure_never_saves_again():
    """vLLM's recovery under async scheduling counts the next step's tokens, computed
    over the failed block, as computed: restarted past its first dirty block, the
    request stays dirty and saves nothing (control: restarted at it, it saves)."""
    r2 = _state(range(100, 160), own_start=50, saved=56)
    mark_failed(r2, {149})
    restart(r2, 50 * 16 + 63, 16)
    assert r2.dirty_from == 50
    assert blocks_to_save(r2, 58 * 16, 16) is None
    restart(r2, 50 * 16, 16)
    assert blocks_to_save(r2, 58 * 16, 16).block_ids == list(range(150, 158))
