"""docs/configuration.md against the code: every node setting, ``raykv up`` option,
``start_local`` argument, engine config key, router kwarg and environment variable a
user can set is in the reference, and nothing else is (each table compared with the
code's own list, both ways; a control shows a drift is caught)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
from pathlib import Path

from raykv.clusters.cli import main
from raykv.clusters.local import start_local
from raykv.controllers.node_settings import NodeSettings
from raykv.integrations.serve.route_keys import RouteOptions
from raykv.integrations.sglang.config import CONFIG_KEYS
from raykv.integrations.vllm.options import KNOWN_KEYS

from tests.unit.test_docs_once import ROOT

REFERENCE = (ROOT / "docs" / "configuration.md").read_text()
INTERNAL_VARIABLES = {
    "RAYKV_CLIENT_LOG": "a mooncake_client's log file, set by its node actor",
    "RAYKV_VERSION": "a Python name, not a variable",
    "RAYKV_TEST_": "the tree rule's pattern of test switches (none exists)",
    "RAYKV_TEST_STORE_DELAY_S": "that rule's control",
}
"""``RAYKV_*`` names in the tree that a user never sets; ``RAYKV_PEER_*`` too (the
engines' own test suites' peers, set by raykv's tests)."""


def rows(doc: str, heading: str) -> list[list[str]]:
    """The cells of each row of the table under ``## heading`` in ``doc``."""
    section = doc.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split(" | ")]
            for line in section.splitlines() if line.startswith("| `")]


def name(cell: str) -> str | None:
    """The first backticked word of ``cell`` (``-``: None)."""
    found = re.search(r"`([^`\s]+)", cell)
    return found.group(1) if found else None


def drift(documented: list[str | None], actual: set[str]) -> dict[str, list[str]]:
    """What the reference lacks, names that are not the code's, and names it lists twice
    (empty lists: none)."""
    listed = [n for n in documented if n is not None]
    return {"missing": sorted(actual - set(listed)), "unknown": sorted(set(listed) - actual),
            "twice": sorted({n for n in listed if listed.count(n) > 1})}


CLEAN = {"missing": [], "unknown": [], "twice": []}


def test_node_settings_raykv_up_and_start_local_are_each_listed_once():
    node = rows(REFERENCE, "Node settings")
    assert drift([name(r[0]) for r in node],
                 {f.name for f in dataclasses.fields(NodeSettings)}) == CLEAN
    up = {p.opts[0] for p in main.commands["up"].params}
    assert drift([name(r[1]) for r in node] + [name(r[0]) for r in rows(
        REFERENCE, "The rest of `raykv up`")], up) == CLEAN
    local = set(inspect.signature(start_local).parameters)
    assert drift([name(r[0]) for r in rows(REFERENCE, "The rest of `start_local`")],
                 local) == CLEAN
    # CONTROL: an option the reference lacks, one it invents and one listed twice
    assert drift(["--address", "--address", "--made-up"], {"--address", "--link"}) == {
        "missing": ["--link"], "unknown": ["--made-up"], "twice": ["--address"]}


def test_the_engines_keys_and_the_routers_kwargs_are_each_listed_once():
    engines = (ROOT / "docs" / "engines.md").read_text()
    keys = rows(engines, "Config keys of both engines")
    assert drift([name(r[0]) for r in keys], set(KNOWN_KEYS) | set(CONFIG_KEYS)) == CLEAN
    assert "(engines.md#config-keys-of-both-engines)" in REFERENCE
    router = rows(REFERENCE, "Ray Serve's router")
    assert drift([name(r[0]) for r in router],
                 {f.name for f in dataclasses.fields(RouteOptions)}) == CLEAN


def variables(text: str) -> set[str]:
    return set(re.findall(r"RAYKV_[A-Z0-9_]*", text))


def test_every_raykv_environment_variable_is_listed():
    tree = subprocess.run(["git", "grep", "-h", "-o", "-E", "RAYKV_[A-Z0-9_]*", "--", "*.py",
                           "*.sh", ".ci/run", f":!{Path(__file__).relative_to(ROOT)}"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout
    used = {v for v in variables(tree)
            if v not in INTERNAL_VARIABLES and not v.startswith("RAYKV_PEER_")}
    listed = [name(r[0]) for r in rows(REFERENCE, "Environment variables")]
    assert drift([n for n in listed if n.startswith("RAYKV_")], used) == CLEAN
    assert {"RAYKV_TENANT_SECRET", "RAYKV_NO_ENGINES"} <= used
    # CONTROL: a variable a module reads and the reference does not name is caught
    assert drift(listed, used | {"RAYKV_MERGE_MAX_INFLIGHT"})["missing"] == [
        "RAYKV_MERGE_MAX_INFLIGHT"]
