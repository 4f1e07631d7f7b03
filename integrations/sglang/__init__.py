"""raykv as an SGLang HiCache storage backend (SGLang 0.5.23).

Stock SGLang loads it as a ``dynamic`` storage backend by module path: the launch line
is the README's (*Production: three steps*), every key of the extra config
``docs/engines.md``.

``RayKVStore`` (module ``store``, the only one that imports SGLang; exported here
lazily, so importing this package or its other modules never needs SGLang) joins the
raykv cluster over Ray, talks to the node actor of its node through a ``CacheClient``
and speaks SGLang's v1 and v2 storage API on SGLang's own host pools:

- **Zero-copy** (``"allocator": "shm"``, embedded Mooncake mode): SGLang's KV-like host
  pools (KV, SWA, draft, DSA indexer; MHA or MLA, ``page_first``) are memfds in the
  scheduler process. The node actor maps them through ``/proc/<pid>/fd/<fd>``, registers
  them with its Mooncake client (``cache_actors.node.engine_memory``), and pages move
  straight between SGLang's tensors and the store.
- **Staging** (any other allocator, Mamba pools, standalone mode): a raykv host pool of
  the same page geometry per SGLang pool (``cache_actors.rank.staging_pools.StagedPool``);
  pages are copied into it before a put and out of it after a get (one warning names the
  reason and what would make it zero-copy). In standalone mode the store's buffers are
  ``mooncake_client``'s shared memory, which only ``mooncake_client`` can register and
  which cannot map SGLang's memfds, so every pool is staged there; the staging pools are
  allocated from that memory and count against the node's ``host_pool_bytes`` (``2 *
  staging_pages`` pages per pool).

Hit queries (``batch_exists``, ``batch_exists_v2``) go through raykv's group query: every
TP rank of the deployment gets the same answer, so SGLang's MIN all-reduce never shrinks
it. Keys are those of SGLang's built-in ``MooncakeStore`` (tag once, same suffixes), unless
the extra config names a ``tenant``: then they are that tenant's (``controllers.keys``).

Failures never crash SGLang: a node actor restart or a store outage turns into misses /
failed pages with a warning (rate-limited), never success, and the backend re-attaches
by itself (zero-copy pools are registered again with the restarted actor).
``batch_set_v2`` never raises (a raise would drop a whole backup).

Modules: ``config`` (SGLang's config and extra-config keys in raykv terms), ``pools``
(SGLang's host pools described as raykv layouts), ``transfers`` (SGLang's transfers and
hit queries as raykv's), ``serving`` (adopting or staging the pools through a client),
``store`` (``RayKVStore``).
"""

from raykv import lazy_getattr

_EXPORTS = {"RayKVStore": "raykv.integrations.sglang.store"}

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
