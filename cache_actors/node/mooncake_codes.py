"""Mooncake Store return codes and what raykv makes of them."""

ALREADY_PRESENT = 1
"""raykv's put code for an object that existed already and was left as it was."""

CLIENT_ERROR = -1
"""raykv's own code for an object whose call raised inside the Mooncake client."""

NOT_CONFIRMED = -2
"""raykv's put code for an object Mooncake accepted but did not report existing right
after (another client's put of the key still in flight): not known stored."""

NAMES = {
    CLIENT_ERROR: "client error",
    NOT_CONFIRMED: "put not confirmed (another writer's put of the key in flight)",
    -200: "no space (store full)",
    -600: "invalid params",
    -704: "object not found",
    -706: "object has lease",
    -800: "transfer failed",
    -900: "rpc failed (client unreachable)",
}


def describe(code: int) -> str:
    """Human-readable meaning of a negative Mooncake code."""
    return NAMES.get(code, f"mooncake error {code}")
