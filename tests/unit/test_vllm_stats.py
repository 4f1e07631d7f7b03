"""raykv's counters in vLLM's own connector stats: a side hands vLLM what grew since it
last asked; vLLM's real ``KVConnectorLogging`` (what ``vllm serve`` logs) and
``KVConnectorProm`` (its Prometheus endpoint) resolve raykv's connector class, sum the
workers' and the scheduler's stats and show them; a dict vLLM hands back is read with
every key checked. vLLM's scheduler asking a real connector:
``tests/integration/test_metrics_export.py``. The records themselves (no vLLM):
``tests/unit/test_connector_stats.py``."""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM's connector stats need vLLM")
from prometheus_client import CollectorRegistry, Counter  # noqa: E402
from raykv.integrations.vllm.connector import RayKVConnector  # noqa: E402
from raykv.integrations.vllm.connector_stats import SHOWN, ConnectorStats  # noqa: E402
from raykv.integrations.vllm.vllm_stats import (  # noqa: E402
    RayKVConnectorStats,
    StatsDelta,
)
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorProm,
)

TRANSFER = KVTransferConfig(kv_connector="RayKVConnector", kv_role="kv_both",
                            kv_connector_module_path="raykv.integrations.vllm")


def test_a_side_hands_vllm_what_grew_since_it_last_asked():
    stats = ConnectorStats()
    delta = StatsDelta(stats)
    assert delta.take() is None  # nothing yet
    stats.loaded += 4
    stats.load_us += 900  # not a SHOWN counter: stays raykv's
    stats.l3_hit_tokens += 64
    assert delta.take().data == {"loaded": 4, "l3_hit_tokens": 64}
    assert delta.take() is None  # CONTROL: each growth handed over once
    stats.loaded += 1
    assert delta.take().data == {"loaded": 1}


def test_vllms_logging_and_prometheus_show_the_summed_counters():
    workers = [RayKVConnectorStats(data={"loaded": 4, "save_refused": 1}),
               RayKVConnectorStats(data={"loaded": 4})]  # two TP ranks
    scheduler = RayKVConnectorStats(data={"asked_tokens": 96, "l3_hit_tokens": 64})
    summed = workers[0].aggregate(workers[1]).aggregate(scheduler)
    assert summed.data == {"loaded": 8, "save_refused": 1, "asked_tokens": 96,
                           "l3_hit_tokens": 64}
    logging = KVConnectorLogging(TRANSFER)
    logging.observe(summed.to_dict())
    logging.observe({"loaded": 2})  # the next step's, before the log interval ends
    lines = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    assert line.startswith("KV Transfer metrics: queries=0, ")
    assert "loaded=10," in line and "save_refused=1," in line and "asked_tokens=96," in line
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1  # CONTROL: an empty interval logs nothing
    registry = CollectorRegistry()

    class Prom(KVConnectorProm):
        _counter_cls = partial(Counter, registry=registry)

    prom = Prom(SimpleNamespace(kv_transfer_config=TRANSFER), ["model_name", "engine"],
                {0: ["m", "0"]})
    prom.observe(summed.to_dict(), 0)
    prom.observe({"loaded": 2, "l3_load_us": 5}, 0)

    def value(counter: str) -> float | None:
        return registry.get_sample_value("vllm:raykv_connector_total", {
            "model_name": "m", "engine": "0", "counter": counter})

    assert value("loaded") == 10 and value("l3_hit_tokens") == 64
    assert value("load_failed") == 0  # declared, never grown
    assert value("l3_load_us") is None  # CONTROL: only SHOWN counters are exported
    assert set(SHOWN) <= set(asdict(ConnectorStats()))


def test_vllm_hands_back_its_dict_read_with_every_key_checked():
    """What vLLM rebuilds from the dict it carried (``build_kv_connector_stats``) is the
    growth the worker handed it; a dict with a key raykv has no counter for is refused
    by name, where a dict would have taken it as a new counter (CONTROL)."""
    data = RayKVConnectorStats(data={"loaded": 3, "l2_load_bytes": 4096}).to_dict()
    assert RayKVConnector.build_kv_connector_stats(data).data == data
    assert RayKVConnector.build_kv_connector_stats(None).data == {}
    with pytest.raises(ValueError, match=r"no counter \['loadd'\]"):
        RayKVConnector.build_kv_connector_stats({"loadd": 3})
    with pytest.raises(ValueError, match="no counter"):
        RayKVConnectorStats(data={"loaded": 1}).aggregate(
            RayKVConnectorStats(data={"load_us": 5}))  # a raykv counter vLLM never sees
