"""matplotlib for the demo's and the benchmarks' figures, imported only when one is drawn.

matplotlib is a dependency of raykv's lab, not of raykv (``pip install -e ./lab`` in
raykv's clone installs it). Figures are drawn on ``matplotlib.figure.Figure``
directly (no pyplot), so no GUI backend is ever chosen."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class MissingMatplotlibError(ModuleNotFoundError):
    """matplotlib is not installed; the message says what installs it."""


MESSAGE = ("drawing figures needs matplotlib, which raykv's lab depends on: pip install -e "
           "./lab in raykv's clone (or pip install matplotlib)")


def require_matplotlib() -> None:
    """Raise ``MissingMatplotlibError`` unless matplotlib can be
    imported; cheap (nothing is imported), for a command to fail before a long run."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingMatplotlibError(MESSAGE, name="matplotlib")


def figure_class() -> type[Figure]:
    """``matplotlib.figure.Figure``, or ``MissingMatplotlibError``."""
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "matplotlib":
            raise
        raise MissingMatplotlibError(MESSAGE, name="matplotlib") from None
    return Figure
