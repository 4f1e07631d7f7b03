"""Which of Mooncake's two wheels are installed, and the warning when both are.

``mooncake-transfer-engine-non-cuda`` (CPU nodes, TCP; raykv's ``cpu`` extra) and
``mooncake-transfer-engine`` (CUDA; the ``gpu`` extra) ship the same ``mooncake``
module: with both installed, its files are whichever wheel wrote them last, a mix that
may fail to load or run the wrong build. Uninstalling one of the two removes the shared
files too, so the fix is to uninstall both and install the one the node needs.
Reads package metadata only (``importlib.metadata``): never imports ``mooncake``."""

from __future__ import annotations

from collections.abc import Collection
from importlib.metadata import PackageNotFoundError, distribution

CPU_WHEEL = "mooncake-transfer-engine-non-cuda"
CUDA_WHEEL = "mooncake-transfer-engine"


def installed_wheels() -> frozenset[str]:
    """The Mooncake wheels (``CPU_WHEEL``, ``CUDA_WHEEL``) installed in this Python
    environment."""
    found = set()
    for name in (CPU_WHEEL, CUDA_WHEEL):
        try:
            distribution(name)
        except PackageNotFoundError:
            continue
        found.add(name)
    return frozenset(found)


def conflict_warning(installed: Collection[str]) -> str | None:
    """The warning to show when ``installed`` (distribution names) holds both Mooncake
    wheels, naming the fix; None otherwise."""
    if CPU_WHEEL not in installed or CUDA_WHEEL not in installed:
        return None
    return (f"both Mooncake wheels are installed ({CUDA_WHEEL} and {CPU_WHEEL}); they "
            "ship the same `mooncake` module, so its files are a mix of both. Keep one: "
            f"pip uninstall -y {CUDA_WHEEL} {CPU_WHEEL}, then pip install {CUDA_WHEEL} "
            f"(GPU nodes) or {CPU_WHEEL} (CPU nodes)")


def environment_warning() -> str | None:
    """``conflict_warning`` for this Python environment."""
    return conflict_warning(installed_wheels())
