"""The metrics reference said once and kept true: every metric the product code defines
(``metrics.Counter`` / ``Gauge`` / ``Histogram`` of ``ray.util.metrics``, and vLLM's
counter of ``vllm_stats``) is in docs/metrics.md's table with its type and labels, and
nothing else is; the Grafana dashboard queries documented metrics only, under the
names Ray's export gives them (``ray_`` prefix, ``_total`` / ``_bucket`` / ``_sum`` /
``_count``), with labels they have. Ray's real export of them:
``tests/integration/test_metrics_export.py``."""

from __future__ import annotations

import ast
import json
import re

from tests.unit.test_docs_once import ROOT, modules

DOC = ROOT / "docs" / "metrics.md"
DASHBOARD = ROOT / "docs" / "grafana" / "raykv.json"
KINDS = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram"}
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
VLLM_LABELS = "vLLM's engine labels"
"""How the table names the labels vLLM adds to its own metrics (not in raykv's code)."""


def defined(tree: ast.Module) -> dict[str, tuple[str, frozenset[str]]]:
    """Metric name -> (type, label names) of each metric ``tree`` makes: a call of
    ``Counter`` / ``Gauge`` / ``Histogram`` (or vLLM's ``_counter_cls``) whose name
    (first argument or ``name=``) is a string starting ``raykv_`` or ``vllm:raykv_``;
    its labels are the strings of ``tag_keys`` / ``labelnames``, a name of a tuple of
    strings assigned in ``tree`` (``*owner_keys``) included."""
    tuples = {t.id: node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name)
              and isinstance(node.value, ast.Tuple)}

    def strings(value: ast.AST) -> set[str]:
        found = set()
        for c in ast.walk(value):
            if isinstance(c, ast.Constant) and isinstance(c.value, str):
                found.add(c.value)
            elif isinstance(c, ast.Starred) and isinstance(c.value, ast.Name):
                found |= strings(tuples[c.value.id]) if c.value.id in tuples else set()
        return found

    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
            node.func, "id", "")
        kind = KINDS.get(func) or {"_counter_cls": "counter", "_gauge_cls": "gauge",
                                   "_histogram_cls": "histogram"}.get(func)
        kw = {k.arg: k.value for k in node.keywords}
        name = node.args[0] if node.args else kw.get("name")
        if kind is None or not isinstance(name, ast.Constant) or not str(
                name.value).startswith(("raykv_", "vllm:raykv_")):
            continue
        keys = kw.get("tag_keys") or kw.get("labelnames")
        labels = frozenset(strings(keys)) if keys is not None else frozenset()
        out[name.value] = (kind, labels)
    return out


def in_code() -> dict[str, tuple[str, frozenset[str]]]:
    """Every metric the product modules define (``defined``)."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for f in modules():
        text = (ROOT / f).read_text()
        if "raykv_" in text:
            out |= defined(ast.parse(text))
    return out


def documented(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Metric name -> (type, label names) of each row of ``text``'s reference table
    (``| `name` | type | `label`, ... | from | meaning |``); vLLM's own labels, named
    in words, are left out."""
    out = {}
    for row in re.findall(r"^\| `((?:vllm:)?raykv_\w+)` \| (\w+) \| ([^|]*) \|", text, re.M):
        name, kind, labels = row
        out[name] = (kind, frozenset(re.findall(r"`(\w+)`", labels)))
    return out


def queried(dashboard: dict) -> list[tuple[str, str]]:
    """``(exported name, expression)`` of each metric each panel query names."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    return [(m, e) for e in exprs for m in re.findall(r"\b(?:ray_raykv_\w+|vllm:raykv_\w+)", e)]


def unknown(dashboard: dict, docs: dict[str, tuple[str, frozenset[str]]]) -> list[str]:
    """The exported names ``dashboard`` queries that are no documented metric under
    the name Ray's export gives it, or that it groups or filters by a label the metric
    does not have."""
    exported = {}
    for name, (kind, labels) in docs.items():
        base = name if name.startswith("vllm:") else f"ray_{name}"
        for suffix in SUFFIXES[kind]:
            exported[base + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    bad = []
    for metric, expr in queried(dashboard):
        if metric not in exported:
            bad.append(metric)
            continue
        selector = re.search(rf"{re.escape(metric)}\{{([^}}]*)\}}", expr)
        used = set(re.findall(r"(\w+)\s*=~?", selector.group(1))) if selector else set()
        for grouped in re.finditer(rf"by \(([^)]*)\) \((?:\w+\()?{re.escape(metric)}\b",
                                   expr):  # an aggregation right around the metric
            used |= {x.strip() for x in grouped.group(1).split(",")}
        if not used <= exported[metric]:
            bad.append(f"{metric} by {sorted(used - exported[metric])}")
    return bad


def test_the_reference_names_every_metric_the_code_defines_and_no_other():
    code = in_code()
    docs = documented(DOC.read_text())
    assert len(code) >= 20
    assert sorted(code) == sorted(docs)
    for name, (kind, labels) in code.items():
        doc_kind, doc_labels = docs[name]
        assert doc_kind == kind, name
        if name.startswith("vllm:"):  # vLLM's own labels are named in words
            assert labels == {"counter"} <= doc_labels, name
            assert VLLM_LABELS in DOC.read_text()
        else:
            assert doc_labels == labels, (name, labels ^ doc_labels)
    # CONTROL: a metric the code would add, or a label it would drop, is caught
    extra = defined(ast.parse('m.Counter("raykv_new", "", tag_keys=("node", "x"))'))
    assert extra == {"raykv_new": ("counter", frozenset({"node", "x"}))}
    assert sorted(code | extra) != sorted(docs)
    wrong = documented("| `raykv_objects` | counter | `node`, `op` | node actor | x |\n")
    assert wrong["raykv_objects"] != code["raykv_objects"]


def test_the_dashboard_queries_documented_metrics_only():
    dashboard = json.loads(DASHBOARD.read_text())
    docs = documented(DOC.read_text())
    names = {m for m, _ in queried(dashboard)}
    assert {"ray_raykv_hit_tokens_total", "ray_raykv_asked_tokens_total",
            "ray_raykv_load_seconds_bucket", "ray_raykv_load_bytes_bucket",
            "ray_raykv_l2_pages_total", "ray_raykv_l2_write_behind_objects",
            "ray_raykv_connector_total"} <= names
    assert unknown(dashboard, docs) == []
    # CONTROL: an undocumented name, Ray's name without its suffix, and a label the
    # metric does not have are caught
    bad = {"panels": [{"targets": [
        {"expr": "rate(ray_raykv_no_such_total[5m])"},
        {"expr": "rate(ray_raykv_hit_tokens[5m])"},
        {"expr": 'sum by (pool) (rate(ray_raykv_asked_tokens_total{tenant="a"}[5m]))'}]}],
        "templating": {"list": []}}
    assert unknown(bad, docs) == ["ray_raykv_no_such_total", "ray_raykv_hit_tokens",
                                  "ray_raykv_asked_tokens_total by ['pool']"]
