"""matplotlib for the demo's and the benchmarks' figures, imported only when one is drawn.

matplotlib is not a dependency of raykv: the ``demo`` and ``bench`` extras bring it
(``pip install -e '.[demo]'`` in raykv's clone: raykv is not on the package index).
Figures are drawn on ``matplotlib.figure.Figure``
directly (no pyplot), so no GUI backend is ever chosen."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class MissingExtraError(ModuleNotFoundError):
    """matplotlib is not installed; the message names the extra that installs it."""


def _message(extra: str) -> str:
    return (f"drawing figures needs matplotlib: pip install -e '.[{extra}]' in raykv's clone "
            "(or pip install matplotlib)")


def require_matplotlib(extra: str) -> None:
    """Raise ``MissingExtraError`` (naming the extra ``extra``) unless matplotlib can be
    imported; cheap (nothing is imported), for a command to fail before a long run."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingExtraError(_message(extra), name="matplotlib")


def figure_class(extra: str) -> type[Figure]:
    """``matplotlib.figure.Figure``, or ``MissingExtraError`` naming the extra ``extra``."""
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "matplotlib":
            raise
        raise MissingExtraError(_message(extra), name="matplotlib") from None
    return Figure
