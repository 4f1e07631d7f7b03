"""vLLM KV events for raykv's tiers (no vLLM import but in ``to_vllm``).

With vLLM's ``kv_events_config.enable_kv_cache_events`` on, the connector publishes,
next to vLLM's own events for its device blocks, a ``BlockStored`` when a block lands
in one of raykv's tiers and a ``BlockRemoved`` when raykv tells the connector it is
gone, in vLLM's hashes (``request.block_hashes``, the ones vLLM's own events carry),
with the block's token ids, parent hash and extra keys, so a consumer can join them
with vLLM's device events. A tier is named by vLLM's ``medium`` vocabulary and, in
``ownership`` (vLLM's "secondary tier identifier"), by raykv's word:

- ``raykv-l2``: the node's L2 pool (medium ``CPU``, locality ``LOCAL``);
- ``raykv-l3``: the Mooncake store across nodes (medium ``STORAGE``, locality unset:
  the object may be on any node's segment).

Who learns what, and when:

- The workers (``LandedBlocks``, one per TP rank) report the blocks whose save
  landed: in L2 (a save into the node's L2 pages, committed), in L3 (a save through
  the store that the store confirmed). A block of an L2 save whose outcome is not
  known per block (a partly failed commit) is not reported. The node actor's
  write-behind puts L2 pages to L3 after the step, unseen by the engine: no
  ``raykv-l3`` event is published for them.
- The scheduler side (``KVEventBook``) knows each saved block's vLLM hash, tokens and
  extra keys (recorded when it sends the save), and publishes a block as stored in a
  tier once every TP rank reported it there (a group's hit needs every rank's object).
- Removals: a node actor evicts L2 pages and Mooncake evicts objects without telling
  engines, so the connector learns of a removal only from its own lookups: a lookup
  whose answer stops at a block this engine published in that tier (the first block
  the L2 lookup or the group query did not find) publishes that block removed from
  that tier. Later blocks of the chain are not named (the lookup answers a leading
  prefix), which is all a prefix-matching consumer needs: a chain is usable up to its
  first missing block.

Bounds: ``KVEventBook`` keeps at most ``PENDING_CAP`` blocks sent but not yet reported
(oldest dropped: never published) and ``PUBLISHED_CAP`` published blocks (oldest
forgotten: never published removed), and publishes a block stored in a tier once until
it is removed.

Threads: ``LandedBlocks`` on vLLM's worker thread; ``KVEventBook.saving``,
``landed`` and ``take`` on vLLM's scheduler thread, ``missing`` on it or the lookup
thread (``async_transfers``): the book holds a lock.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

L2 = "raykv-l2"
L3 = "raykv-l3"
TIERS = (L2, L3)
MEDIUM = {L2: "CPU", L3: "STORAGE"}  # vLLM's MEDIUM_CPU, MEDIUM_STORAGE
LOCALITY = {L2: "LOCAL", L3: None}

PENDING_CAP = 8192
"""Blocks sent to the workers for saving whose reports are awaited, at most."""
PUBLISHED_CAP = 65536
"""Published (tier, block) pairs remembered for removals, at most."""


@dataclass(frozen=True)
class BlockFacts:
    """What vLLM's ``BlockStored`` says of one block: vLLM's hash of it and of its
    parent (None: the first block), its token ids, its extra keys (as vLLM publishes
    them, None: none) and LoRA."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[Any, ...] | None = None
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True)
class Stored:
    """Blocks now in ``tier``, in chain order."""

    tier: str
    blocks: tuple[BlockFacts, ...]


@dataclass(frozen=True)
class Removed:
    """vLLM hashes of blocks no longer in ``tier``."""

    tier: str
    block_hashes: tuple[bytes, ...]


class LandedBlocks:
    """A worker's reports of the blocks (page hashes, hex) whose save landed in a tier
    this step, for ``get_kv_connector_kv_cache_events``; records nothing when
    ``enabled`` is False."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._reports: list[tuple[str, str]] = []

    def l2_saved(self, hashes: Sequence[str], saved: int, full: Sequence[int]) -> None:
        """An L2 save of ``hashes`` answered ``(saved, full)`` (``L2Blocks.save``): the
        blocks not in ``full`` landed when every other block was saved; else which did
        is unknown, and none is reported."""
        if self.enabled and saved + len(full) == len(hashes):
            skip = set(full)
            self._reports += [(L2, h) for i, h in enumerate(hashes) if i not in skip]

    def l3_saved(self, hashes: Sequence[str], ok: Sequence[bool]) -> None:
        """A save of ``hashes`` through the store answered ``ok`` per block."""
        if self.enabled:
            self._reports += [(L3, h) for h, good in zip(hashes, ok, strict=True) if good]

    def take(self) -> list[tuple[str, str]]:
        """The ``(tier, page hash)`` reports since the last call."""
        out, self._reports = self._reports, []
        return out


class KVEventBook:
    """The scheduler side's events of raykv's tiers for an engine of ``tp_size`` ranks
    (see the module docstring)."""

    def __init__(self, tp_size: int, *, pending_cap: int = PENDING_CAP,
                 published_cap: int = PUBLISHED_CAP) -> None:
        if tp_size < 1 or pending_cap < 1 or published_cap < 1:
            raise ValueError("KVEventBook: tp_size and caps must be >= 1")
        self.tp_size = tp_size
        self._pending_cap, self._published_cap = pending_cap, published_cap
        self._pending: OrderedDict[str, BlockFacts] = OrderedDict()  # page hash -> facts
        self._reports: Counter[tuple[str, str]] = Counter()  # ranks that reported so far
        self._published: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._events: list[Stored | Removed] = []
        self._lock = threading.Lock()

    def saving(self, page_hash: str, facts: BlockFacts) -> None:
        """The workers are told to save the block ``page_hash`` (hex), whose facts
        are ``facts``."""
        with self._lock:
            self._pending[page_hash] = facts
            self._pending.move_to_end(page_hash)
            while len(self._pending) > self._pending_cap:
                old, _ = self._pending.popitem(last=False)
                for tier in TIERS:
                    self._reports.pop((tier, old), None)

    def landed(self, reports: Iterable[tuple[str, str]]) -> None:
        """Workers' ``(tier, page hash)`` reports (one per rank that saw it land):
        a block every rank reported in a tier is stored there (one ``Stored`` per
        tier per call, in report order); unknown tiers and blocks are ignored."""
        stored: dict[str, list[BlockFacts]] = {}
        with self._lock:
            for tier, page_hash in reports:
                facts = self._pending.get(page_hash)
                if tier not in MEDIUM or facts is None:
                    continue
                key = (tier, page_hash)
                self._reports[key] += 1
                if self._reports[key] < self.tp_size:
                    continue
                del self._reports[key]
                if key in self._published:
                    continue  # published once until removed
                self._remember(key, facts.block_hash)
                stored.setdefault(tier, []).append(facts)
            self._events += [Stored(t, tuple(b)) for t, b in stored.items()]

    def _remember(self, key: tuple[str, str], block_hash: bytes) -> None:
        self._published[key] = block_hash
        while len(self._published) > self._published_cap:
            self._published.popitem(last=False)

    def missing(self, tier: str, page_hash: str) -> None:
        """A lookup found the block ``page_hash`` absent from ``tier``: removed, if this
        engine published it stored there."""
        with self._lock:
            block_hash = self._published.pop((tier, page_hash), None)
            if block_hash is not None:
                self._events.append(Removed(tier, (block_hash,)))

    def take(self) -> list[Stored | Removed]:
        """The events since the last call, in order."""
        with self._lock:
            out, self._events = self._events, []
        return out


def record_saving(book: KVEventBook, req: Any, hashes: Sequence[str], first: int,
                  block_size: int) -> None:
    """Record in ``book`` the facts vLLM's ``BlockStored`` gives of a save of the
    blocks ``first..`` of vLLM request ``req`` (page hashes ``hashes``), in vLLM's
    hashes (a block vLLM has no hash for is not recorded: never published)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    bs, lora = block_size, req.lora_request
    for i, page_hash in enumerate(hashes, start=first):
        if i >= len(req.block_hashes):
            break
        extra, _ = generate_block_hash_extra_keys(req, i * bs, (i + 1) * bs, 0)
        keys = to_event_extra_keys([extra])
        book.saving(page_hash, BlockFacts(
            block_hash=bytes(req.block_hashes[i]),
            parent_hash=bytes(req.block_hashes[i - 1]) if i else None,
            token_ids=tuple(req.all_token_ids[i * bs:(i + 1) * bs]),
            extra_keys=None if keys is None else tuple(keys),
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None))


def to_vllm(events: Iterable[Stored | Removed], block_size: int) -> list:
    """``events`` as vLLM's ``BlockStored`` / ``BlockRemoved`` (hashes converted as
    vLLM's own events convert them)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    out: list = []
    for e in events:
        if isinstance(e, Removed):
            out.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(h)
                                                  for h in e.block_hashes],
                                    medium=MEDIUM[e.tier], locality=LOCALITY[e.tier],
                                    ownership=e.tier))
            continue
        for b in e.blocks:  # one event per block: each names its own parent
            out.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(b.block_hash)],
                parent_block_hash=(None if b.parent_hash is None
                                   else maybe_convert_block_hash(b.parent_hash)),
                token_ids=list(b.token_ids), block_size=block_size, lora_id=b.lora_id,
                medium=MEDIUM[e.tier], lora_name=b.lora_name,
                extra_keys=None if b.extra_keys is None else list(b.extra_keys),
                locality=LOCALITY[e.tier], ownership=e.tier))
    return out
