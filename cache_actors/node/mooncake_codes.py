"""raykv's own per-object codes beside Mooncake Store's (negative: Mooncake's errors,
e.g. -704 object not found, -800 transfer failed, -900 rpc failed)."""

ALREADY_PRESENT = 1
"""raykv's put code for an object that existed already and was left as it was."""

CLIENT_ERROR = -1
"""raykv's own code for an object whose call raised inside the Mooncake client."""

NOT_CONFIRMED = -2
"""raykv's put code for an object Mooncake accepted but did not report existing right
after (another client's put of the key still in flight): not known stored."""

OBJECT_NOT_FOUND = -704
"""Mooncake's code for a key the store does not hold: a get's miss."""

OBJECT_HAS_LEASE = -706
"""Mooncake's code for a non-forced remove of an object a lease still holds."""

NOT_OWNED = -3
"""raykv's code for an object refused before any byte moved: its pool is not the
caller's owner's, or its key lies outside the caller's key prefix
(``controllers.ownership``)."""

TRANSFER_FAIL = -800
"""Mooncake's code for an object whose bytes could not be moved: e.g. a put placed on the
segment of a client that died (``mooncake_backend`` retries those once)."""
