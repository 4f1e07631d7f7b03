"""Rules of the tree (docs/architecture.md, "The tree"): no product class over 300 lines
(the developer guide's limit), counted from its ``class`` line to its last line,
decorators aside; the per-object result codes defined once (``controllers.result_codes``),
every other module imports them; no product module reads a ``RAYKV_TEST_*`` switch
(tests inject their hooks); ``cache_actors/rank`` and ``cache_actors/node`` never import
each other; the integrations never import ``cache_actors/node``; pure modules import no
Ray, Mooncake, torch or engine; no import circle; ``controllers/`` holds only what more
than one process uses. Each rule has a control."""

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
    return [] if other is None else imports_of(tree, name, other)


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


def walked(tree: ast.AST, typing: bool) -> list[ast.AST]:
    """``ast.walk(tree)``; without ``typing``, ``if TYPE_CHECKING:`` blocks left out."""
    nodes, stack = [], [tree]
    while stack:
        node = stack.pop()
        nodes.append(node)
        if not typing and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack += node.orelse
        else:
            stack += ast.iter_child_nodes(node)
    return nodes


def imported(tree: ast.Module, typing: bool = True) -> list[str]:
    """Every module ``tree`` imports, wherever (functions included; type-checking blocks
    with ``typing``), absolute imports as written; ``from X import Y`` gives ``X.Y`` too
    where that is a raykv module."""
    found = []
    for node in walked(tree, typing):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module] + [m for a in node.names
                                      if module_file(m := f"{node.module}.{a.name}")]
    return found


def imports_of(tree: ast.Module, name: str, package: str) -> list[str]:
    """``"file -> module"`` for each import in ``tree`` (of the package file ``name``) of
    ``package`` or a module in it (type-checking imports included)."""
    return sorted({f"{name} -> {m}" for m in imported(tree)
                   if m == package or m.startswith(package + ".")})


def node_imports(tree: ast.Module, name: str) -> list[str]:
    """``imports_of`` ``cache_actors/node``: the node actor's modules run in its process
    only."""
    return imports_of(tree, name, "raykv.cache_actors.node")


def test_integrations_never_import_the_node_actors_modules():
    files = [f for f in modules() if f.startswith("integrations/")]
    assert len(files) > 30
    assert [c for f in files for c in node_imports(parsed(f), f)] == []
    # CONTROL: the import of L2's reserve answers that l2_blocks had is caught
    assert node_imports(ast.parse(
        "from raykv.cache_actors.node.l2_index import FULL, PRESENT\n"),
        "integrations/vllm/l2_blocks.py") == [
        "integrations/vllm/l2_blocks.py -> raykv.cache_actors.node.l2_index"]


HEAVY = ("ray", "torch", "mooncake", "vllm", "sglang")
"""What a pure module never imports: the runtime, the store, the device, the engines."""


def module_file(module: str) -> str | None:
    """The package file of the ``raykv`` or ``raykv_lab`` module ``module`` (None: not
    theirs)."""
    parts = module.split(".")
    if parts[0] not in ("raykv", "raykv_lab"):
        return None
    top = "lab/" if parts[0] == "raykv_lab" else ""
    base = top + "/".join(parts[1:]) if len(parts) > 1 else {"raykv": "raykv",
                                                               "raykv_lab": "lab"}[parts[0]]
    for name in (f"{base}.py", f"{base}/__init__.py"):
        if (ROOT / name).is_file():
            return name
    return None


def top_imports(tree: ast.Module) -> list[str]:
    """The modules ``tree`` imports when it is imported: module-level statements
    (inside ``if``/``try``/``with`` too), ``if TYPE_CHECKING:`` blocks aside."""
    found: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                found.extend(imported(ast.Module(body=[node], type_ignores=[])))
            elif isinstance(node, ast.If | ast.Try | ast.With):
                for part in ("body", "orelse", "finalbody"):
                    visit(getattr(node, part, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return found


def heavy_chain(module: str, read=lambda f: parsed(f), seen=None) -> list[str]:
    """The import chain by which importing ``module`` loads one of ``HEAVY`` (its
    packages' ``__init__`` included), or []."""
    seen = set() if seen is None else seen
    if module.split(".")[0] in HEAVY:
        return [module]
    file = module_file(module)
    if file is None or module in seen:
        return []
    seen.add(module)
    parts = module.split(".")
    for m in [".".join(parts[:i]) for i in range(1, len(parts))] + top_imports(read(file)):
        if m != module and (chain := heavy_chain(m, read, seen)):
            return [module, *chain]
    return []


def declares_pure(tree: ast.Module) -> bool:
    """Whether the first paragraph of the module's docstring calls it pure."""
    doc = ast.get_docstring(tree) or ""
    return re.search(r"\bpure\b", doc.split("\n\n")[0], re.IGNORECASE) is not None


def impure(tree: ast.Module, name: str, read=lambda f: parsed(f)) -> list[str]:
    """``"file: a -> b -> ray"`` for the first import of ``tree`` (anywhere in it but a
    type-checking block) that is, or loads, one of ``HEAVY``."""
    for m in imported(tree, typing=False):
        if chain := heavy_chain(m, read):
            return [f"{name}: {' -> '.join(chain)}"]
    return []


def test_pure_modules_import_no_ray_mooncake_torch_or_engine():
    """Pure: ``controllers/`` (but the controller actor, ``controller.py``) and every
    module whose docstring says so in its first paragraph."""
    pure = [f for f in modules() if declares_pure(parsed(f))
            or (f.startswith("controllers/") and f != "controllers/controller.py")]
    assert len(pure) > 80
    assert [i for f in pure for i in impure(parsed(f), f)] == []
    # CONTROL: a direct import, one inside a function, and one through a raykv module
    # (the node actor's, which imports Ray when imported) are each caught
    assert impure(ast.parse("import torch\n"), "x.py") == ["x.py: torch"]
    assert impure(ast.parse("def f():\n    from vllm import LLM\n"), "x.py") == [
        "x.py: vllm"]
    (chain,) = impure(ast.parse("from raykv.cache_actors.node import node_actor\n"), "x.py")
    assert chain.startswith("x.py: raykv.cache_actors.node.node_actor -> ") \
        and chain.rsplit(" -> ", 1)[1].split(".")[0] == "ray", chain
    # ... and a type-checking import is not
    assert impure(ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                            "    import torch\n"), "x.py") == []


def module_name(file: str) -> str:
    """The import name of the package file ``file``."""
    parts = file[:-3].split("/")
    if parts[0] == "lab":
        return ".".join(["raykv_lab", *parts[1:]])
    return ".".join(parts if parts[0] == "raykv" else ["raykv", *parts])


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (module -> the modules it imports): each strongly
    connected group of more than one module, sorted."""
    order, low, stack, found = {}, {}, [], []

    def visit(v: str) -> None:  # Tarjan's, iteratively deep enough for ~200 modules
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                found.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return sorted(found)


def test_no_module_imports_itself_back():
    """No circle of imports among the product's modules, wherever an import sits (inside
    a function, under type checking): data flows down."""
    files = modules()
    graph = {module_name(f): {m for m in imported(parsed(f))
                              if module_file(m) and not module_file(m).endswith("__init__.py")}
             for f in files}
    assert circles(graph) == []
    # CONTROL: the rank's client and its L2 link, which imported each other (the link
    # under type checking), are caught, as is a longer circle
    assert circles({"client": {"l2_link"}, "l2_link": {"client"}}) == [["client", "l2_link"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def processes(file: str) -> set[str]:
    """The processes whose code ``file`` is (``controllers/``: none of its own)."""
    if file.startswith(("cache_actors/rank/", "integrations/", "example_engine/", "raykv/")):
        return {"rank"}
    if file.startswith("cache_actors/node/"):
        return {"node"}
    if file.startswith("cache_actors/"):
        return {"rank", "node"}  # shared by both sides' code
    return {"clusters"} if file.startswith(("clusters/", "lab/")) else set()


def single_process(users: dict[str, set[str]]) -> list[str]:
    """The ``controllers/`` modules of ``users`` (module file -> the files importing it)
    that one process alone reaches, directly or through other ``controllers/`` modules
    (the controller actor aside)."""
    def reach(file: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out: set[str] = set()
        for user in users.get(file, ()):
            if user.startswith("controllers/") and user not in seen:
                out |= reach(user, seen | {file})
            else:
                out |= processes(user)
        return out

    return sorted(f for f in users if f.startswith("controllers/")
                  and f != "controllers/controller.py" and len(reach(f)) < 2)


def test_controllers_hold_only_what_more_than_one_process_uses():
    """docs/architecture.md, the rule of where a module lives: logic that one process
    alone runs lives with that process, pure or not."""
    users: dict[str, set[str]] = {}
    for f in modules():
        for m in imported(parsed(f)):
            if (file := module_file(m)) and file != f and not file.endswith("__init__.py"):
                users.setdefault(file, set()).add(f)
    assert single_process(users) == []
    # CONTROL: the rank's breaker where it was (controllers/, used by the rank alone),
    # and a module the node reaches only through another controllers module
    assert single_process({"controllers/circuit_breaker.py": {"cache_actors/rank/node_guard.py"},
                           "controllers/a.py": {"controllers/b.py"},
                           "controllers/b.py": {"cache_actors/node/x.py", "clusters/y.py"},
                           "controllers/c.py": {"controllers/d.py"},
                           "controllers/d.py": {"cache_actors/node/x.py"}}) == [
        "controllers/c.py", "controllers/circuit_breaker.py", "controllers/d.py"]


def lab_imports(tree: ast.Module, name: str) -> list[str]:
    """``"file -> module"`` for each import of the lab (``raykv_lab``) in ``tree``, a
    product module's (type-checking imports included)."""
    return imports_of(tree, name, "raykv_lab")


def test_the_product_never_imports_the_lab():
    """docs/architecture.md, the product and the lab: what nodes and engines install
    (``raykv``) runs without the lab (``raykv_lab``), which imports raykv, never back."""
    product = [f for f in modules() if not f.startswith("lab/")]
    assert len(product) > 100
    assert [i for f in product for i in lab_imports(parsed(f), f)] == []
    # CONTROL: the local cluster's import of the emulated hosts, as it was, is caught
    assert lab_imports(ast.parse("from raykv_lab.hosts import EmulatedHosts\n"),
                       "clusters/local.py") == ["clusters/local.py -> raykv_lab.hosts"]


def demo_imports(source: str, name: str) -> list[str]:
    """``"file -> module"`` for each import of a demo module (``raykv_lab.demo``) in the
    test file ``name``."""
    return imports_of(ast.parse(source), name, "raykv_lab.demo")


def test_only_the_demos_tests_import_demo_modules():
    """Test fixtures use the lab's engines (``raykv_lab.engines``), not the demo's code:
    only tests of the demo itself (``test_demo*``) import it."""
    tests = sorted(p for p in (ROOT / "tests").rglob("*.py")
                   if not p.name.startswith("test_demo"))
    assert len(tests) > 100
    assert [i for p in tests for i in demo_imports(p.read_text(), p.name)] == []
    # CONTROL: a fixture importing the vLLM engines from the demo, as before, is caught
    assert demo_imports("from raykv_lab.demo.vllm_actors import start_engine\n",
                        "conftest.py") == ["conftest.py -> raykv_lab.demo.vllm_actors"]
