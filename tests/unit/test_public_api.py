"""One door: every name a user needs imports from ``raykv``, and ``docs/api.md`` shows
that surface and nothing else. Its table of public names lists exactly ``raykv``'s
exports, its code imports only from ``raykv``, and it names no internal module path
(``controllers.pool_layout``, ``raykv.cache_actors.rank...``)."""

import ast
import re
from pathlib import Path

import raykv

ROOT = Path(__file__).resolve().parents[2]
API = (ROOT / "docs" / "api.md").read_text()
INTERNAL = re.compile(r"`(?:raykv\.)?(?:controllers|cache_actors|clusters|example_engine)"
                      r"\.[\w.]+")


def public_table() -> set[str]:
    """The backticked names of the first column of api.md's table of public names."""
    section = API.split("## The public API: `raykv`", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for row in section.splitlines():
        if row.startswith("| `"):
            names |= set(re.findall(r"`(\w+)`", row.split("|")[1]))
    return names


def test_every_export_imports_from_raykv():
    for name in raykv.__all__:
        assert getattr(raykv, name) is not None, name


def test_the_docs_list_exactly_the_public_names():
    assert public_table() == set(raykv.__all__)


def test_the_docs_import_only_from_raykv():
    imports = [node for block in re.findall(r"```python\n(.*?)```", API, re.S)
               for node in ast.walk(ast.parse(block)) if isinstance(node, ast.ImportFrom)]
    ours = [i for i in imports if i.module.split(".")[0] == "raykv"]
    assert ours and {i.module for i in ours} == {"raykv"}
    assert {a.name for i in ours for a in i.names} <= set(raykv.__all__)


def test_the_docs_name_no_internal_path():
    assert INTERNAL.findall(API) == []
    # CONTROL: the pattern catches the paths the docs used before
    assert INTERNAL.findall("a `PoolLayout` (`controllers.pool_layout`) and "
                            "`cache_actors.rank.staging_pools.StagedPool`")
