"""A rank's route to its node's L2 cache (``cache_actors.node.l2_pools``): the L2 pool of
its deployment and rank, and the four L2 data ops, by page hash.

The rank names pages by page hash, as in every other call; this module keys them as
the client keys them (a tenant's keyed page hashes, the client's key scheme), so an
L2 object has the key of the same object in L3. The data ops go over the link as any
data op (deadline, budget, breaker: ``NodeLink.data``); ``open`` is a control call
(pool creation), made at start-up or on a background thread, never on an engine's step.

Holder: the calling thread (``ProcessIdentity`` of its thread id: the node checks that
it still runs as it checks a process; a process's main thread is the process itself);
a thread moves one L2 transfer at a time per pool (the node releases its earlier pages
at its next op), so threads of one process (a vLLM worker's step and its load thread)
never release each other's pages.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from raykv.cache_actors.data_ops import DataOp
from raykv.cache_actors.processes import ProcessIdentity
from raykv.controllers.contract import PoolName
from raykv.controllers.keys import mha_suffix

if TYPE_CHECKING:
    from raykv.cache_actors.host_pools import HostPool
    from raykv.cache_actors.rank.group_registration import GroupRegistration
    from raykv.cache_actors.rank.node_route import NodeRoute
    from raykv.cache_actors.rank.pool_lifecycle import PoolLifecycle
    from raykv.controllers.keyed_hashes import KeyedHashes
    from raykv.controllers.pool_layout import PoolLayout


class L2Link:
    """The L2 ops of a rank (``CacheClient.l2``) on its node, for its KV pool kind
    ``vllm`` (one object per page): over the rank's ``link``, keyed with its ``hashes``
    and ``group``'s key scheme, the pools mapped by its ``pools``."""

    def __init__(self, link: NodeRoute, hashes: KeyedHashes, group: GroupRegistration,
                 pools: PoolLifecycle) -> None:
        self._link, self._hashes, self._group, self._pools = link, hashes, group, pools
        self._local = threading.local()

    @property
    def holder(self) -> tuple[int, int]:
        """The calling thread, as the node's L2 names who holds a page."""
        me = getattr(self._local, "holder", None)
        if me is None:
            ident = ProcessIdentity.of(threading.get_native_id()) or ProcessIdentity.current()
            me = self._local.holder = tuple(dataclasses.astuple(ident))
        return me

    def _keys(self, page_hashes: Sequence[str], tp_rank: int | None = None) -> list[str]:
        """Object keys of ``page_hashes`` for TP rank ``tp_rank`` (default: the
        client's own)."""
        scheme, cfg = self._group.key_scheme, self._group.config
        if tp_rank is not None and tp_rank != scheme.tp_rank:
            scheme = dataclasses.replace(scheme, tp_rank=tp_rank,
                                         mha=mha_suffix(tp_rank, cfg.pp_rank, cfg.pp_size))
        (suffix,) = scheme.suffixes(PoolName.KV, "vllm", ["kv"])
        return [scheme.prefix + h + suffix for h in self._hashes.keys(list(page_hashes))]

    def open(self, layout: PoolLayout, pages: int) -> HostPool | None:
        """Map the L2 pool of this rank's deployment and rank on its node (made by the
        first engine there, of at most ``pages`` pages of ``layout``'s geometry and of
        one ``tp_size x pp_size``-th of the node's L2 bytes, so each rank of the group
        finds room); None if the node has no L2 room. A control call."""
        cfg = self._group.config
        rank, share = (cfg.tp_rank, cfg.pp_rank), cfg.tp_size * cfg.pp_size
        handle = self._link.call("l2_open", rank, layout, pages, share,
                                 claim=self._link.claim(None, "l2_open", rank, layout, pages,
                                                        share))
        return None if handle is None else self._pools.attach(handle.name)

    def lookup(self, page_hashes: Sequence[str], tp_size: int) -> int:
        """Leading pages whose objects of every TP rank (0 .. ``tp_size`` - 1) are in
        L2 on this node, leased until the ranks load them."""
        per_rank = [self._keys(page_hashes, r) for r in range(tp_size)]
        keys = [k for page in zip(*per_rank, strict=True) for k in page]
        return self._link.data(DataOp.L2_LOOKUP, keys, tp_size) if keys else 0

    def acquire(self, pool: str, page_hashes: Sequence[str], fill: bool) -> list[int]:
        """L2 pages holding the leading ``page_hashes`` (with ``fill``: read from L3
        first where L2 does not hold them), this process's until its next L2 op."""
        return self._link.data(DataOp.L2_ACQUIRE, self.holder, pool,
                               self._keys(page_hashes), fill)

    def reserve(self, pool: str, page_hashes: Sequence[str]) -> list[int]:
        """Per page hash: an L2 page to write it into, ``PRESENT``, ``WRITING`` or
        ``FULL`` (``cache_actors.node.l2_index``)."""
        return self._link.data(DataOp.L2_RESERVE, self.holder, pool, self._keys(page_hashes))

    def commit(self, pool: str, page_hashes: Sequence[str], pages: Sequence[int],
               ok: Sequence[bool], holder: tuple[int, int] | None = None) -> int:
        """The pages reserved for ``page_hashes`` were written (``ok``: in full); the
        node puts them to L3 behind. How many are now in L2. ``holder``: the thread that
        reserved them (default: the calling thread), which makes no other L2 op on the
        pool until this commit returned (its next op would release them)."""
        return self._link.data(DataOp.L2_COMMIT, holder or self.holder, pool,
                               self._keys(page_hashes), list(pages), list(ok))
