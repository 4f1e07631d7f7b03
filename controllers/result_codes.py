"""Per-object result codes: what every data op of the node actor answers, one code per
object, to the ranks, the integrations, the benches and the CLI. The one definition;
pure (no Mooncake import), so every process reads them.

Conventions (put, get, exists, remove, as Mooncake Store answers them; raykv's own
codes beside Mooncake's):

- put: 0 stored, ``ALREADY_PRESENT`` (1) existed already and was left as it was, negative
  an error; an object counts as stored if its code is >= 0 (``ObjectBatch.stored``).
- get: the object's size in bytes when read in full (``ObjectBatch.read_in_full``),
  negative an error (``OBJECT_NOT_FOUND`` a miss).
- exists: ``EXISTS`` (1) present, 0 absent, negative an error.
- remove: 0 removed, negative an error (``OBJECT_HAS_LEASE`` while a lease holds it).

Negative codes are Mooncake's errors (e.g. -704 object not found, -800 transfer failed,
-900 rpc failed) or raykv's own (-1 to -3, below).
"""

EXISTS = 1
"""An exists code: the store holds the object."""

ALREADY_PRESENT = 1
"""raykv's put code for an object that existed already and was left as it was."""

CLIENT_ERROR = -1
"""raykv's own code for an object whose call raised inside the Mooncake client."""

NOT_CONFIRMED = -2
"""raykv's put code for an object Mooncake accepted but did not report existing right
after (another client's put of the key still in flight): not known stored."""

NOT_OWNED = -3
"""raykv's code for an object refused before any byte moved: its pool is not the
caller's owner's, or its key lies outside the caller's key prefix
(``controllers.ownership``)."""

OBJECT_NOT_FOUND = -704
"""Mooncake's code for a key the store does not hold: a get's miss."""

OBJECT_HAS_LEASE = -706
"""Mooncake's code for a non-forced remove of an object a lease still holds."""

TRANSFER_FAIL = -800
"""Mooncake's code for an object whose bytes could not be moved: e.g. a put placed on the
segment of a client that died (``mooncake_backend`` retries those once)."""

RPC_FAIL = -900
"""Mooncake's code for a call that did not reach its server: e.g. a dummy client's call
sent on a connection to a ``mooncake_client`` that has since died
(``cache_actors.node.dummy_calls`` sends those again)."""

FILE_OPEN_FAIL = -1101
"""Mooncake's get code for an object on a disk tier whose bucket file is gone."""

FILE_READ_FAIL = -1102
"""Mooncake's get code for an object on a disk tier it could not read from its bucket
file (e.g. cut off by a truncation); Mooncake answers it for every object of the
batch read from that bucket, and keeps reporting the object existing."""

SEAL_MISMATCH = -4
"""raykv's get code for an object whose seal did not verify (``controllers.object_seal``:
damaged or truncated on disk, or sealed under another cluster's seal key): its bytes are
not served, the object is removed from the store, and the get counts as a miss."""


# An L2 pool's answers to ``reserve``, per key (``cache_actors.node.l2_index``), read by
# the ranks that write into L2 (``integrations.vllm.l2_blocks``): otherwise a page index.

PRESENT = -1
"""``reserve``'s answer for a key L2 holds already (ready)."""

FULL = -2
"""``reserve``'s answer for a key no page could be found for."""

WRITING = -3
"""``reserve``'s answer for a key another holder is writing now (not ready: not in L2
until that write's commit, which may fail)."""
