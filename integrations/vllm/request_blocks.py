"""Scheduler-side bookkeeping of raykv's vLLM connector (pure: no vLLM, no Ray).

Which blocks each worker loads before a step and saves after it, decided from what the
scheduler knows: the request's page hashes (``page_hash.PageHashChain``), its block ids,
its computed tokens. The
connector's scheduler side (``raykv.integrations.vllm.scheduler``) feeds vLLM's objects in;
this module only sees ints, lists and strings, so it is unit-tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from raykv.integrations.vllm.page_hash import PageHashChain


def hash_hex(block_hash) -> str:
    """A page hash (bytes) as it appears in raykv keys (hex)."""
    return block_hash.hex() if isinstance(block_hash, bytes | bytearray) else str(block_hash)


def max_loadable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks that may come from outside: every full block of the request's tokens,
    the last one included (``external_tokens`` leaves its last token to compute)."""
    return max(0, num_tokens // block_size)


def external_tokens(hit_blocks: int, num_computed_tokens: int, block_size: int,
                    num_tokens: int) -> int:
    """Tokens to load beyond vLLM's local hit, given the leading blocks raykv holds: at
    most ``num_tokens - 1`` in all, so one token is left to compute (vLLM needs a
    forward to produce the next token's logits). A hit of every block of a prompt that
    ends on a block boundary thus loads the last block too, whose last token's KV the
    forward then writes again, instead of computing that whole block."""
    return max(0, min(hit_blocks * block_size, num_tokens - 1) - num_computed_tokens)


@dataclass
class BlockTransfer:
    """Blocks of one request that a worker moves in one direction: vLLM block ids and
    the page hashes (hex) of the same blocks, in order. A save also names ``context``:
    the request's blocks before these, whose KV the saved blocks' KV was computed over
    (the worker refuses a save over a block whose load failed). A load names
    ``l2_blocks``: of its leading blocks, how many the lookup found in the node's L2
    (the tier of its ``raykv_load_seconds``, ``load_times.load_tier``)."""

    req_id: str
    block_ids: list[int]
    hashes: list[str]
    context: list[int] = field(default_factory=list)
    l2_blocks: int = 0

    def computed_over(self, blocks: set[int]) -> bool:
        """Whether any of ``blocks`` is one of these blocks or their ``context``."""
        return not blocks.isdisjoint(self.context) or not blocks.isdisjoint(self.block_ids)


@dataclass
class RequestBlocks:
    """What the scheduler side tracks per running request: ``chain`` holds its page
    hashes, which the scheduler side extends (from vLLM's request) before each decision."""

    request: object  # vLLM's Request (live object: its tokens grow with decoding)
    chain: PageHashChain
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # leading blocks known stored (loaded, saved or to be saved)
    local_hit_tokens: int = 0  # vLLM's own hit, from get_num_new_matched_tokens
    l2_hit_blocks: int = 0  # of raykv's hit past it, the leading blocks in the node's L2
    pending_load: BlockTransfer | None = None
    own_start: int = 0  # first block it computed itself (before: prefix cache or loaded)
    dirty_from: int | None = None  # its blocks from here on may be computed over a failure
    load_async: bool = False  # its last lookup's hit is loaded asynchronously
    async_sent: bool = False  # its async load went out (it never gets another)


def mark_failed(state: RequestBlocks, invalid: set[int]) -> None:
    """``invalid`` blocks did not load: if ``state``'s request holds one, the blocks it
    computed itself from the first such block on may hold KV computed over it (dirty
    from there; a block before ``own_start`` is recomputed by the request vLLM makes
    recompute it, which holds it from its own ``own_start`` on or truncates to it)."""
    first = first_invalid_block(state.block_ids, invalid)
    if first is None:
        return
    dirty = max(first, state.own_start)
    state.dirty_from = dirty if state.dirty_from is None else min(state.dirty_from, dirty)


def restart(state: RequestBlocks, computed_before: int, block_size: int) -> None:
    """The request is scheduled with ``computed_before`` tokens computed: a dirty request
    that vLLM restarted at or before its first dirty block rewrites every block computed
    over the failure, so it is clean again and saves its blocks anew from the restart
    (it computes them itself). A dirty request that vLLM kept computing past that block
    (vLLM counts as computed KV that read a failed block) stays dirty: it never saves
    again."""
    if state.dirty_from is not None and computed_before <= state.dirty_from * block_size:
        state.dirty_from = None
        state.own_start = computed_before // block_size
        state.saved_blocks = min(state.saved_blocks, state.own_start)


def blocks_to_load(req_id: str, block_ids: Sequence[int], hashes: Sequence, local_hit_tokens: int,
              num_external_tokens: int, block_size: int) -> BlockTransfer | None:
    """The blocks to load for ``num_external_tokens`` beyond the local hit (a whole
    block for a last token or tokens of a block, as ``external_tokens`` counts them):
    ``block_ids`` are all of the request's blocks (local-hit blocks first)."""
    if num_external_tokens <= 0:
        return None
    first = local_hit_tokens // block_size
    n = -(-(local_hit_tokens + num_external_tokens) // block_size) - first
    ids = list(block_ids[first:first + n])
    keys = [hash_hex(h) for h in hashes[first:first + n]]
    if len(ids) != n or len(keys) != n:
        raise ValueError(f"request {req_id}: {n} blocks to load from block {first} but it "
                         f"has {len(block_ids)} block ids and {len(hashes)} hashes")
    return BlockTransfer(req_id, ids, keys)


def blocks_to_save(state: RequestBlocks, computed_after_step: int, block_size: int) -> \
        BlockTransfer | None:
    """Newly completed full blocks of a request (their KV exists once this step's
    forward ran), beyond those already stored, with the request's earlier blocks as
    their ``context``; advances ``state.saved_blocks``. Blocks past ``state.chain``'s
    hashes wait until the chain is extended; a dirty request saves nothing."""
    if state.dirty_from is not None:
        return None
    hashes = state.chain.hashes
    full = min(computed_after_step // block_size, len(hashes), len(state.block_ids))
    if full <= state.saved_blocks:
        return None
    first, state.saved_blocks = state.saved_blocks, full
    return BlockTransfer(state.request.request_id, state.block_ids[first:full],
                         [hash_hex(h) for h in hashes[first:full]],
                         context=state.block_ids[:first])


def first_invalid_block(block_ids: Sequence[int], invalid: set[int]) -> int | None:
    """Index of the first of ``block_ids`` that is in ``invalid`` (None if none is)."""
    for i, b in enumerate(block_ids):
        if b in invalid:
            return i
    return None
