"""The suite's own scheduling (``tests/conftest.py``): the files it moves to the front
exist, so a renamed file cannot silently drop out of ``LONGEST_FIRST``."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FIRST

REPO = Path(__file__).resolve().parents[2]


def test_every_longest_first_file_exists_once():
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    missing = [path for path in LONGEST_FIRST if not (REPO / path).is_file()]
    assert not missing, missing
