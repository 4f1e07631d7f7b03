"""``ConnectorMetrics``: a connector side's counters exported as what grew since the last
look, once each, with declared labels only (Ray's real export:
``tests/integration/test_metrics_export.py``)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from raykv.integrations.vllm.connector_metrics import ConnectorMetrics
from raykv.integrations.vllm.side import new_stats


class FakeCounter:
    """Records ``inc`` calls; refuses tags that are not exactly its ``tag_keys`` with its
    default tags, as Ray's metric objects do."""

    def __init__(self, name: str, description: str = "", tag_keys: tuple = ()) -> None:
        self.name, self.tag_keys, self.defaults, self.calls = name, set(tag_keys), {}, []

    def set_default_tags(self, tags: dict) -> None:
        self.defaults = dict(tags)

    def inc(self, value: float, tags: dict) -> None:
        assert set(tags | self.defaults) == self.tag_keys, tags
        self.calls.append((tags["counter"], value))


@pytest.fixture
def made(monkeypatch):
    made: list[FakeCounter] = []

    def counter(*args, **kwargs):
        made.append(FakeCounter(*args, **kwargs))
        return made[-1]

    import ray.util

    fake = SimpleNamespace(Counter=counter)
    monkeypatch.setattr(ray.util, "metrics", fake, raising=False)
    monkeypatch.setitem(sys.modules, "ray.util.metrics", fake)
    return made


def test_counters_are_exported_as_they_grow_once_each(made):
    stats = new_stats()
    m = ConnectorMetrics(stats, {"role": "worker", "tp_rank": "0", "model": "org/m"},
                         export_s=3600.0)  # exported by hand below
    (counter,) = made
    assert counter.name == "raykv_connector"
    m.export()
    assert counter.calls == []  # nothing counted yet
    stats["saved"] += 3
    stats["loaded"] += 2
    m.export()
    stats["saved"] += 1
    m.export()
    m.export()
    assert sorted(counter.calls) == [("loaded", 2), ("saved", 1), ("saved", 3)]
    stats["load_failed"] += 1
    m.close()  # what is left goes out
    assert counter.calls[-1] == ("load_failed", 1)
