"""Whether benchmark runs met their targets: what ``raykv bench* --check`` exits on
(pure: no Ray, no torch)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def missed_targets(runs: Iterable[Mapping[str, bool | None]]) -> list[str]:
    """The targets of ``runs`` (each a benchmark result's ``targets``: name -> met,
    None when that run had no case to judge it on) that were not met, in order.
    A target no run could judge is not missed."""
    return [name for targets in runs for name, met in targets.items() if met is False]


def check_message(missed: list[str]) -> str:
    """The one line ``--check`` fails with, naming every missed target."""
    return f"{len(missed)} target(s) not met: " + "; ".join(missed)
