"""Rules of the tree: no product class over 300 lines (the developer guide's limit),
counted from its ``class`` line to its last line, decorators aside; the per-object
result codes defined once (``controllers.result_codes``), every other module imports
them; no product module reads a ``RAYKV_TEST_*`` switch (tests inject their hooks,
docs/architecture.md "Test hooks"); ``cache_actors/rank`` and ``cache_actors/node``
never import each other (docs/architecture.md "The tree")."""

import ast
import functools
import re

from raykv.controllers import result_codes

from tests.unit.test_docs_once import ROOT, modules

LIMIT = 300
CODES = "controllers/result_codes.py"
CODE_NAMES = frozenset(n for n in vars(result_codes) if n.isupper())


@functools.cache
def parsed(name: str) -> ast.Module:
    """The syntax tree of the package file ``name`` (parsed once for every rule)."""
    return ast.parse((ROOT / name).read_text())


def oversized(tree: ast.Module, name: str) -> list[str]:
    """``"file:Class (N lines)"`` for each class in ``tree`` longer than ``LIMIT``."""
    return [f"{name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > LIMIT]


def test_no_product_class_exceeds_300_lines():
    files = modules()
    assert len(files) > 100
    assert [o for f in files for o in oversized(parsed(f), f)] == []
    # CONTROL: a class one line over the limit is caught, one at the limit is not
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT - 1))
    big = ast.parse(f"class Big:\n{body}\n    y = 0\n")
    assert oversized(big, "big.py") == ["big.py:Big (301 lines)"]
    assert oversized(ast.parse(f"class Fits:\n{body}\n"), "fits.py") == []


def code_definitions(tree: ast.Module, name: str) -> list[str]:
    """``"file:NAME"`` for each module-level assignment in ``tree`` of a name that
    ``controllers.result_codes`` defines."""
    return [f"{name}:{t.id}" for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name) and t.id in CODE_NAMES]


def test_result_codes_are_defined_once():
    files = [f for f in modules() if f != CODES]
    assert [d for f in files for d in code_definitions(parsed(f), f)] == []
    assert len(code_definitions(parsed(CODES), CODES)) >= 8
    # CONTROL: a module that defines a code of its own is caught
    assert code_definitions(ast.parse("NOT_OWNED = -3\n"), "x.py") == ["x.py:NOT_OWNED"]


def switch_names(source: str) -> list[str]:
    """The ``RAYKV_TEST_*`` names ``source`` mentions."""
    return re.findall(r"RAYKV_TEST_\w*", source)


def test_no_product_module_reads_a_test_switch():
    found = {f: switch_names((ROOT / f).read_text()) for f in modules()}
    assert {f: h for f, h in found.items() if h} == {}
    # CONTROL: the hook the store backend read before is caught
    assert switch_names('os.environ.get("RAYKV_TEST_STORE_DELAY_S")') == [
        "RAYKV_TEST_STORE_DELAY_S"]


SIDES = {"cache_actors/rank/": "raykv.cache_actors.node", "cache_actors/node/":
         "raykv.cache_actors.rank"}


def crossings(tree: ast.Module, name: str) -> list[str]:
    """``"file -> module"`` for each import in ``tree`` (of the package file ``name``) of
    a module of the other side: a rank module of ``node/``, a node module of ``rank/``
    (type-checking imports included)."""
    other = next((o for side, o in SIDES.items() if name.startswith(side)), None)
    if other is None:
        return []
    def crosses(module: str) -> bool:
        return module == other or module.startswith(other + ".")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if crosses(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module] if crosses(node.module) else [
                m for a in node.names if crosses(m := f"{node.module}.{a.name}")]
    return sorted(f"{name} -> {m}" for m in found)


def test_rank_and_node_never_import_each_other():
    files = [f for f in modules() if f.startswith(tuple(SIDES))]
    assert len(files) > 30
    assert [c for f in files for c in crossings(parsed(f), f)] == []
    # CONTROL: either direction is caught, also as ``from ... import node``
    assert crossings(ast.parse("from raykv.cache_actors.node.channel_server import X\n"),
                     "cache_actors/rank/x.py") == [
        "cache_actors/rank/x.py -> raykv.cache_actors.node.channel_server"]
    assert crossings(ast.parse("from raykv.cache_actors import rank\n"),
                     "cache_actors/node/x.py") == [
        "cache_actors/node/x.py -> raykv.cache_actors.rank"]
    assert crossings(ast.parse("import raykv.cache_actors.node_x\n"),
                     "cache_actors/rank/x.py") == []
