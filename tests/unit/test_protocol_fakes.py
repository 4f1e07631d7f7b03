"""The Protocols of the product and their one shared fake each (tests/unit/fakes.py):
the product classes and the fakes both offer every member of their Protocol, methods
with the Protocol's parameters (names, kinds, defaults), so a fake cannot drift from
what the product does without this test failing."""

from __future__ import annotations

import inspect
import re

import pytest
from raykv.cache_actors.node.mooncake_backend import MooncakeBackend
from raykv.cache_actors.node.pool_memory import MemfdPoolMemory, PoolMemory, ShmPoolMemory
from raykv.cache_actors.node.store_backend import StoreBackend
from raykv.cache_actors.rank.node_link import NodeLink
from raykv.cache_actors.rank.node_route import NodeRoute

from tests.unit.fake_node import FakeNode
from tests.unit.fakes import FakeBackend, FakeMemory, FakeRoute

IMPLEMENTATIONS = [
    (StoreBackend, MooncakeBackend), (StoreBackend, FakeBackend),
    (PoolMemory, ShmPoolMemory), (PoolMemory, MemfdPoolMemory), (PoolMemory, FakeMemory),
    (NodeRoute, NodeLink), (NodeRoute, FakeRoute), (NodeRoute, FakeNode),
]


def members(protocol: type) -> tuple[dict[str, inspect.Signature], set[str]]:
    """The methods of ``protocol`` (name -> signature, ``self`` left out) and its data
    members (annotated attributes and properties)."""
    methods, data = {}, set(getattr(protocol, "__annotations__", {}))
    for name, value in vars(protocol).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            data.add(name)
        elif inspect.isfunction(value):
            methods[name] = strip_self(inspect.signature(value))
    return methods, data


def strip_self(sig: inspect.Signature) -> inspect.Signature:
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def shape(sig: inspect.Signature) -> list[tuple]:
    """What a caller relies on: each parameter's name, kind and whether it has a
    default (annotations are the Protocol's to state)."""
    return [(p.name, p.kind, p.default is inspect.Parameter.empty)
            for p in sig.parameters.values()]


def sets(cls: type, name: str) -> bool:
    """Whether ``cls`` has data member ``name``: a class attribute or property, or an
    attribute an ``__init__`` of it or its bases assigns (``self.name = ...``, also in a
    tuple)."""
    if any(name in vars(k) or name in getattr(k, "__annotations__", {})
           for k in cls.__mro__):
        return True
    inits = [vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k)
             and inspect.isfunction(vars(k)["__init__"])]
    return any(re.search(rf"self\.{name}\b[^=\n]*=", inspect.getsource(f)) for f in inits)


def mismatches(protocol: type, cls: type) -> list[str]:
    """Each member of ``protocol`` that ``cls`` lacks or offers with other parameters."""
    methods, data = members(protocol)
    out = [f"{cls.__name__}.{name}: missing" for name in sorted(data) if not sets(cls, name)]
    for name, want in methods.items():
        have = getattr(cls, name, None)
        if not callable(have):
            out.append(f"{cls.__name__}.{name}: missing")
        elif shape(strip_self(inspect.signature(have))) != shape(want):
            out.append(f"{cls.__name__}.{name}: {inspect.signature(have)} is not "
                       f"(self, {', '.join(map(str, want.parameters.values()))})")
    return out


@pytest.mark.parametrize(("protocol", "cls"), IMPLEMENTATIONS,
                         ids=[f"{p.__name__}-{c.__name__}" for p, c in IMPLEMENTATIONS])
def test_each_implementation_offers_its_protocol(protocol, cls):
    assert mismatches(protocol, cls) == []


def test_control_a_drifted_fake_is_caught():
    class NoRemove(FakeBackend):
        remove = None

    class OtherParameters(FakeBackend):
        def get(self, keys, pointers, sizes):  # renamed: a caller's keyword breaks
            return []

    class NoBudget:
        mode, epoch = "embedded", 0

        def __init__(self) -> None:
            self.pools = {}

    assert mismatches(StoreBackend, NoRemove) == ["NoRemove.remove: missing"]
    assert [m.split(":")[0] for m in mismatches(StoreBackend, OtherParameters)] == [
        "OtherParameters.get"]
    assert "NoBudget.budget: missing" in mismatches(PoolMemory, NoBudget)


def test_the_protocols_name_what_the_product_calls():
    """Every Protocol is non-trivial: the fakes are checked against real surfaces."""
    assert {"put", "get", "exists", "register", "alloc"} <= set(members(StoreBackend)[0])
    assert {"create", "readopt", "release", "renew"} <= set(members(PoolMemory)[0])
    assert {"call", "ask", "data", "claim", "bounded"} <= set(members(NodeRoute)[0])
    assert {"controller_attached", "stale", "owner"} <= members(NodeRoute)[1]
