"""The node actors and the ranks' route to them. ``rank/`` runs in engine (rank)
processes, ``node/`` in each node actor; the modules here run in both: the
local channel's shared part and its wire, the data-op names, errors, shared memory, host
pools.

Internal: users import the public names from ``raykv`` (``CacheClient``, ``HostPool``,
``PoolHandle``, ``StagedPool``, the errors); these modules may move between releases."""
