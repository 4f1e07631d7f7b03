"""``CacheClient``: what an inference rank (driver or any Ray actor) calls.

A facade over the pieces that do the work: ``node_link`` (the route to the node actor:
local channel or Ray, retry, re-attach, re-map), ``pool_lifecycle`` (the pools this rank
mapped and registered), ``staging_pools`` (engine memory served through staging pools,
in rounds), ``controllers.transfer_plan`` (pure: transfers to object batches and codes
back to pages), ``group_registration`` (the controller and group hit queries) and
``pointer_api`` (the legacy pointer calls, ``PointerCalls``). Pools are shared memory
owned by the node actor and mapped here as torch tensors; calls carry keys and offsets,
and the actor moves the bytes between the pools and Mooncake. With a tenant, every page
hash (and pointer-API key) is replaced by its keyed page hash
(``controllers.keyed_hashes``) once, where it enters a public method, before any object
key is made of it. Every input is validated here, before any byte moves, and bad input
raises ``ValueError`` naming the problem.

Return conventions (SGLang HiCache): ``batch_exists`` -> leading pages whose objects all
exist; ``batch_set_v1`` / ``batch_get_v1`` -> one bool per page, True only if every
object of the page was stored / read in full; ``batch_set`` -> True if every object was
stored; ``batch_get`` -> number of leading objects read in full (SGLang's backend
turns it into pages); ``objects_exist`` -> one bool per object.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray
import torch
from raykv.cache_actors.data_ops import DataOp
from raykv.cache_actors.host_pools import HostPool
from raykv.cache_actors.rank.call_budget import Budget
from raykv.cache_actors.rank.group_registration import GroupRegistration
from raykv.cache_actors.rank.l2_link import L2Link
from raykv.cache_actors.rank.node_guard import guard_of
from raykv.cache_actors.rank.node_link import NodeLink
from raykv.cache_actors.rank.pointer_api import PointerCalls
from raykv.cache_actors.rank.pool_lifecycle import PoolLifecycle, pool_layout
from raykv.cache_actors.rank.rank_owner import RankOwner
from raykv.cache_actors.rank.staging_pools import StagedPool, staged_call
from raykv.controllers.contract import PoolName, PoolTransfer, PoolTransferResult, StorageConfig
from raykv.controllers.group_search import search
from raykv.controllers.keyed_hashes import KeyedHashes
from raykv.controllers.keys import KeyScheme
from raykv.controllers.naming import NAMESPACE
from raykv.controllers.node_records import NodeStats
from raykv.controllers.owner_keys import OwnerKey
from raykv.controllers.ownership import OwnerClaim, claim_of
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.tenancy import tenant_secret
from raykv.controllers.transfer_plan import (
    check_hit_query,
    check_transfers,
    exists_families,
    pool_role,
)


def check_mode(extra_config: dict | None, mode: str) -> None:
    """``ValueError`` if ``extra_config["standalone_storage"]`` (``MooncakeStore``'s key) is set
    and contradicts ``mode``, the mode of the node actor serving the rank."""
    want = (extra_config or {}).get("standalone_storage")
    if want is not None and bool(want) != (mode == "standalone"):
        raise ValueError(f"extra_config['standalone_storage'] is {want!r} but this node's "
                         f"actor runs in {mode} mode; the mode is a cluster setting: "
                         "local_settings(standalone=...) / `raykv up --standalone`")


class CacheClient:
    """A rank's handle on the raykv cache of its node.

    ``config`` carries the rank's place in its deployment (TP/PP rank, MLA, model name,
    ``extra_config["extra_backend_tag"]``; with ``extra_config["tenant"]`` also the
    tenant and the identity of its bytes, ``controllers.keys``), which decides the object
    keys (``key_scheme``). A rank with a tenant reads the tenant secret from
    ``$RAYKV_TENANT_SECRET`` here (``ValueError`` if it is missing or short) and keys
    every page hash with it; the secret never leaves this process.
    If ``extra_config["standalone_storage"]`` is set it must match the node actor's mode,
    else ``ValueError``. ``NodeUnavailableError`` (retryable) while the node's actor or
    store is down; after one, the next call first re-maps every pool of this client
    whose memory the node actor replaced (standalone mode, after a restart): the
    ``HostPool`` objects stay the same, their tensors point to the new memory.

    Owner: the client's pools belong to its deployment (``deployment_id(config)``) and
    tenant; the node actor refuses its pool calls on another owner's pools, and fails
    the objects of its data calls that are not its own (``controllers.ownership``).

    Secrets: a client is never pickled (``pickle``, Ray's serialisation, ``copy``:
    ``TypeError``), so its tenant secret and owner key never reach Ray's object store or
    another process; make a client in each process, from its own environment.

    Threads: batch calls may come from several threads of the rank at once; pool
    management and registration from one thread, not during batch calls on those pools.
    """

    def __init__(
        self,
        config: StorageConfig | None = None,
        *,
        node_id: str | None = None,
        namespace: str = NAMESPACE,
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("CacheClient needs a connected Ray: call ray.init(...) or "
                               "start raykv with raykv.start_local() first")
        self.config = config or StorageConfig()
        tenant = self.config.tenant
        secret = tenant_secret(tenant) if tenant is not None else None
        self._hashes = KeyedHashes(secret)
        owner = RankOwner(claim_of(self.config),
                          None if secret is None else OwnerKey.of_secret(secret))
        del secret
        self.node_id = node_id or ray.get_runtime_context().get_node_id()
        self._namespace = namespace
        self._link = NodeLink(self.node_id, namespace, remap=lambda: self._pools.remap(),
                              timeout_s=self.config.timeout_s, owner=owner)
        self._pools = PoolLifecycle(self._link)
        self._group = GroupRegistration(self._link, self.config)
        self._pointers = PointerCalls(self._hashes, self._pools, self._link)
        if "standalone_storage" in (self.config.extra_config or {}):
            check_mode(self.config.extra_config, self._link.call("health")["mode"])

    def __reduce__(self):
        raise TypeError("a CacheClient is never pickled (it holds the tenant secret and "
                        "mapped pools): make one in each process")

    def owner_claim(self, node_id: str | None = None, method: str = "",
                    *args: object) -> OwnerClaim | None:
        """The owner claim for one call of this client's to the node actor of
        ``node_id`` (default: its own node), as ``NodeLink.claim`` makes it: a tenant's
        carries a fresh call proof, good once, for a call of ``method`` with positional
        ``args`` (those before the claim) only; for tools that call a node actor."""
        return self._link.claim(node_id, method, *args)

    # ----------------------------------------------------------------- pools
    def create_host_pool(
        self,
        kind: str | PoolLayout,
        *,
        size: int | None = None,
        page_size: int | None = None,
        layer_num: int = 0,
        head_num: int = 0,
        head_dim: int = 0,
        kv_cache_dim: int = 0,
        index_head_dim: int = 0,
        dtype: torch.dtype | str = torch.bfloat16,
        temporal_shape: Sequence[int] | None = None,
        temporal_dtype: torch.dtype | str | None = None,
        conv_shapes: Sequence[Sequence[int]] = (),
        conv_dtypes: Sequence[torch.dtype | str] | None = None,
        order: str = "page_first",
        name: str | None = None,
        per_process: bool = False,
    ) -> HostPool:
        """Create a shared host pool on this node and map it here.

        Kinds: ``"mha"`` (``page_size, layer_num, head_num, head_dim``), ``"mla"``
        (``page_size, layer_num, kv_cache_dim``), ``"indexer"`` (``page_size, layer_num,
        index_head_dim``), ``"vllm"`` (``page_size`` = vLLM block size, ``layer_num,
        head_num, head_dim``: one vLLM block of every layer per page, see
        ``PoolLayout.vllm``), ``"mamba"`` (``temporal_shape`` and ``conv_shapes`` per slot,
        e.g. ``(layers, heads, head_dim, state)``; dtypes default to ``dtype``; an empty
        ``temporal_shape`` means a conv-only model). ``size`` and ``page_size`` count
        token slots (Mamba: checkpoints, page_size 1). With ``name`` of a pool that exists
        with the same shape and owner (this client's deployment and tenant), that pool is
        attached instead (how a restarted rank finds its pool again); a name another
        owner holds is refused (``ValueError`` naming that owner's deployment).
        ``per_process``: the pool serves this process alone (an engine's staging pool):
        the node removes it once this process exited; by default a pool outlives every
        rank. Raises ``ValueError`` for a bad shape, or a pool that does not fit in the
        node's budget, its tenant's quota or shared memory.

        ``kind`` may also be a ``PoolLayout`` (then give no shape arguments, only ``name``
        and ``per_process``): a pool of exactly that layout.
        """
        if isinstance(kind, PoolLayout):
            return self._pools.create(kind, name, per_process)
        if size is None:
            raise ValueError(f"a {kind} pool needs size")
        return self._pools.create(pool_layout(
            str(kind).lower(), size=size, page_size=page_size, layer_num=layer_num,
            head_num=head_num, head_dim=head_dim, kv_cache_dim=kv_cache_dim,
            index_head_dim=index_head_dim, dtype=dtype, temporal_shape=temporal_shape,
            temporal_dtype=temporal_dtype, conv_shapes=conv_shapes, conv_dtypes=conv_dtypes,
            order=order), name, per_process)

    def attach_host_pool(self, name: str) -> HostPool:
        """Map the existing pool ``name`` of this node; ``ValueError`` if there is none
        or it is another owner's."""
        return self._pools.attach(name)

    def adopt_engine_pool(self, name: str, path: str, layout: PoolLayout,
                          inode: Sequence[int]) -> HostPool:
        """Serve an engine's own memfd ``path`` (``/proc/<pid>/fd/<fd>``, ``inode`` its
        ``(st_dev, st_ino)`` as the engine sees it) as this node's pool ``name`` with no
        copy, and map it here. ``ValueError`` for anything that is not such a memfd."""
        return self._pools.adopt_engine(name, path, layout, inode)

    def destroy_host_pool(self, pool: HostPool | str) -> bool:
        """Remove a pool of this client's owner from this node for every rank; False if
        it did not exist, ``ValueError`` if it is another owner's."""
        return self._pools.destroy(pool)

    def register_mem_pool_host(self, pool: HostPool | StagedPool) -> None:
        """Make ``pool`` this rank's KV pool (v1 API and the v2 anchor): a pool of this
        client, or engine memory served through a staging pool of this client
        (``staging_pools.StagedPool``).

        Raises ``ValueError`` if the pool was not mapped by this client or its kind does
        not match ``config.is_mla_model``.
        """
        self._pools.register_kv(pool, self.config.is_mla_model)

    def register_mem_host_pool_v2(self, pool, name: PoolName | str) -> None:
        """Register ``pool`` as pool ``name`` for the v2 API. A draft pool may also be
        one the engine allocated (any object with a contiguous ``kv_buffer`` tensor, MHA
        ``(2, size, layers, heads, dim)`` or MLA ``(size, layers, 1, dim)``, and
        ``page_size``): served through a shared staging pool and a copy (one that cannot
        be served disables draft offload with one warning). Other pools come from this
        client, are engine memory served through its staging pool (``StagedPool``), or
        are a ``PoolLayout`` alone: a rank that only asks group queries registers its
        geometry and allocates nothing (a transfer of it is refused before any byte
        moves)."""
        self._pools.register(pool, pool_role(name), self.config.is_mla_model)

    @property
    def key_scheme(self) -> KeyScheme:
        """How this rank's pages are keyed (``GroupRegistration.key_scheme``)."""
        return self._group.key_scheme

    def l2(self) -> L2Link:
        """This rank's route to its node's L2 cache (``cache_actors.rank.l2_link``)."""
        return L2Link(self._link, self._hashes, self._group, self._pools)

    # -------------------------------------------------------- batches of pages
    def _transfer(self, transfers: Sequence[PoolTransfer],
                  write: bool) -> dict[PoolName, list[bool]]:
        """Check ``transfers`` once, then move their pages: one round trip, or one per
        round of a staged pool smaller than the call (``staging_pools.staged_call``)."""
        pools = self._pools
        checked = check_transfers(self._hashes.transfers(transfers), pools.plan_pools,
                                  self.key_scheme, write=write, disabled=pools.disabled)
        op = DataOp.PUT if write else DataOp.GET
        return staged_call(checked, pools.staged, write=write, epoch=pools.epoch,
                           call=lambda batch: self._link.data(op, batch))

    def batch_set_v2(self, transfers: Sequence[PoolTransfer]) -> dict[PoolName, list[bool]]:
        """Store the pages of every pool in one round trip (lookup and put of
        the missing objects happen together in the node actor). Every TP rank puts its
        replicated pools' objects too (put-if-absent: the group's first put stores them,
        the others find them present), so a page is True only if the store holds it."""
        return self._transfer(transfers, write=True)

    def batch_get_v2(self, transfers: Sequence[PoolTransfer]) -> dict[PoolName, list[bool]]:
        """Read the pages of every pool in one round trip; a page is True only if every
        one of its objects was read in full."""
        return self._transfer(transfers, write=False)

    def batch_exists_v2(self, keys: Sequence[str],
                        transfers: Sequence[PoolTransfer] = ()) -> PoolTransferResult:
        """The longest prefix of ``keys`` that KV and every pool in ``transfers`` can
        restore together, for this rank, from one lookup of all their objects.

        A ``trailing_pages`` transfer's window is the number of its keys (1 if none).
        """
        pools = self._pools
        keys, queries = check_hit_query(self._hashes.keys(keys), transfers, pools.plan_pools,
                                        pools.disabled)
        families = exists_families(queries, pools.plan_pools, self.key_scheme,
                                   (self.config.tp_rank, self.config.pp_rank))
        return search(families, keys, lambda names: self._link.data(DataOp.EXISTS, names))

    # ------------------------------------------------------------ group hits
    def register_deployment(self) -> str:
        """Register this rank and its pools with the controller, adopt the key scheme it
        hands back and ready the lookup home (``group_registration``): call it when the
        engine starts, so that no group query pays for it. Returns the deployment id.
        ``ValueError`` if this rank contradicts its group (parallel sizes, MLA, pools)."""
        return self._group.register(self._pools.specs).deployment_id

    def group_exists(self, keys: Sequence[str],
                     transfers: Sequence[PoolTransfer] = ()) -> PoolTransferResult:
        """The hit of this rank's whole TP/PP group: the intersection of restorable
        prefixes over every rank and pool, from one lookup by the node actor
        of the group's home node (the controller names it at registration). Every rank
        of the group asking about the same keys and pools gets the identical answer (a
        rank asking again gets a fresh one), so no all-reduce among ranks is needed."""
        pools = self._pools
        keys, queries = check_hit_query(self._hashes.keys(keys), transfers, pools.plan_pools,
                                        pools.disabled)
        # a registration first (a control call) shares the query's deadline
        with self._link.bounded(self.config.timeout_s, "group_exists"):
            if self._group.outdated(pools.specs):
                self.register_deployment()
            return self._group.exists(keys, queries)

    # ------------------------------------------------------------ v1 (pages)
    def batch_exists(self, keys: Sequence[str]) -> int:
        """Number of leading pages whose KV objects all exist in the store."""
        return self.batch_exists_v2(keys).kv_hit_pages

    def batch_set_v1(self, keys: Sequence[str], host_indices) -> list[bool]:
        """Store the KV pages at ``host_indices`` under ``keys`` (put-if-absent).

        On an MLA model every TP rank puts the one copy (put-if-absent, as SGLang's
        MooncakeStore does): a page is True only if the store holds it.
        """
        return self.batch_set_v2([PoolTransfer(PoolName.KV, keys, host_indices)])[PoolName.KV]

    def batch_get_v1(self, keys: Sequence[str], host_indices) -> list[bool]:
        """Read the KV pages under ``keys`` into the pool at ``host_indices``."""
        return self.batch_get_v2([PoolTransfer(PoolName.KV, keys, host_indices)])[PoolName.KV]

    # ---------------------------------------------------- legacy pointer API
    def batch_set(self, keys: Sequence[str], target_locations=None, target_sizes=None) -> bool:
        """Store each ``target_sizes[i]`` bytes at pointer ``target_locations[i]`` under
        ``keys[i]`` (tagged with the model prefix; with a tenant, each whole key is keyed
        first). True if every object was stored."""
        return self._pointers.set(keys, target_locations, target_sizes, self.key_scheme)

    def batch_get(self, keys: Sequence[str], target_locations=None, target_sizes=None) -> int:
        """Read objects into the given pointers; the number of leading objects read in full."""
        return self._pointers.get(keys, target_locations, target_sizes, self.key_scheme)

    # ------------------------------------------------------ budget, breaker
    def budget(self, seconds: float | None = None) -> Budget:
        """A budget of ``seconds`` (default: ``timeout_s``) for an engine's step: every
        call this client (or any other) makes on a thread while it is entered (``with
        budget: ...``, as often as needed) waits at most what is left of it, and spends
        it; with nothing left, a call fails at once (``DeadlineExceededError``, nothing
        sent). See ``cache_actors.rank.call_budget``."""
        return Budget(self.config.timeout_s if seconds is None else seconds)

    def breaker_counts(self) -> dict:
        """This process's circuit breaker on this client's node actor
        (``node_guard``): ``state`` (closed, open, trial), ``in_a_row`` deadlines
        missed, and counters of calls ``admitted``, ``rejected`` (failed at once),
        ``failed``, ``succeeded``, times ``opened``, ``trials``, probe ``answers``."""
        return guard_of(self._namespace, self.node_id).breaker.counts()

    def objects_exist(self, keys: Sequence[str]) -> list[bool]:
        """Whether each object ``keys[i]``, named as ``batch_set`` names it (tagged with
        the model prefix; with a tenant, keyed first), is in the store."""
        return self._pointers.exist(keys, self.key_scheme)

    # --------------------------------------------------------------- control
    def clear_objects(self) -> int:
        """Remove this client's deployment's objects from the store (every rank's; never
        another deployment's or tenant's), waiting out the store's leases on them (about
        one lease, 10 s by default); the number removed. Objects a reader looks up or
        reads again meanwhile, or written meanwhile, may stay. ``ValueError`` if the
        deployment has no key prefix (no tenant, model name or tag), ``DeadlineExceededError``
        or ``RuntimeError`` if the node actor could not finish
        (``cache_actors.node.deployment_clear``)."""
        return self._link.call("clear_objects", self.owner_claim(None, "clear_objects"))

    def health(self) -> dict:
        return self._link.call("health")

    def stats(self) -> NodeStats:
        return self._link.call("stats")

    def close(self) -> None:
        """Unmap every pool of this client and close its channel; the pools stay on
        the node."""
        self._link.close()
        self._pools.close()
