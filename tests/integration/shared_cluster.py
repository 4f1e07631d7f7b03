"""One two-node embedded cluster per test process, shared by the test modules that take
``conftest``'s ``cluster`` fixture: starting a cluster costs ~15 s of both cores, and
those modules need nothing of a cluster of their own (their keys and models are their
own: ``uid``). It starts when the first such module asks, stays while such modules
follow one another, and stops before a module that starts Ray itself and at the end of
the session (``tests/conftest.py``)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import pytest

_held: dict[str, Any] = {}  # "cluster": the running cluster, "stack": what stops it


def get(start: Callable[[], contextlib.AbstractContextManager]) -> Any:
    """The running shared cluster, started with ``start()`` if there is none."""
    if "cluster" not in _held:
        stack = contextlib.ExitStack()
        _held["cluster"] = stack.enter_context(start())
        _held["stack"] = stack
    return _held["cluster"]


def release() -> None:
    """Stop the shared cluster, if one runs."""
    stack = _held.pop("stack", None)
    _held.pop("cluster", None)
    if stack is not None:
        stack.close()


OWN_RAY = ("start_local(", "start_hosts(", "two_nodes(", "ray.init(")
"""Calls by which a module's tests start Ray themselves: such a module never shares."""


def shares(module: Any, items: list[pytest.Item]) -> bool:
    """Whether ``module``'s tests (of the session's ``items``) take the shared cluster:
    one of them asks for ``cluster``, and the module defines no ``cluster`` fixture of
    its own and starts no Ray itself (``OWN_RAY``: a test of it that did so beside the
    shared cluster would find Ray initialised)."""
    if hasattr(module, "cluster"):
        return False
    source = inspect.getsource(module)
    if any(call in source for call in OWN_RAY):
        return False
    return any(item.module is module and "cluster" in item.fixturenames
               for item in items if isinstance(item, pytest.Function))
