"""Python as an environment ``scripts/setup.sh --no-engines`` made sees it: with this
folder on ``PYTHONPATH``, every Python process (the test's and the ones it starts) finds
no vLLM, transformers, SGLang or Ray Serve, as if they were not installed. For
``tests/integration/test_no_engines.py`` only; nothing of raykv imports it."""

from __future__ import annotations

import importlib.machinery
import sys

ABSENT = ("vllm", "transformers", "sglang", "ray.serve")
"""What ``--no-engines`` leaves out (Ray's ``serve`` ships in Ray's wheel, without the
packages it needs)."""


def _absent(name: str) -> bool:
    return any(name == a or name.startswith(a + ".") for a in ABSENT)


class _PathFinderWithoutEngines(importlib.machinery.PathFinder):
    """Python's path finder, which finds nothing of ``ABSENT``: ``import vllm`` raises
    ``ModuleNotFoundError`` and ``importlib.util.find_spec("vllm")`` is None."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if _absent(fullname):
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [_PathFinderWithoutEngines if f is importlib.machinery.PathFinder else f
                    for f in sys.meta_path]
