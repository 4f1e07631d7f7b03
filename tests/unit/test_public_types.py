"""A type checker sees raykv's public API: the lazily exported names are declared in
``TYPE_CHECKING`` imports (the same names and modules as ``_EXPORTS``), and mypy, run
as a user's project would run it, accepts real uses of them and rejects a name raykv
does not export or a wrong use of a real one."""

import ast
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAZY_PACKAGES = ("raykv/__init__.py", "integrations/vllm/__init__.py")

GOOD = textwrap.dedent('''
    from raykv import (CacheClient, HostPool, LocalCluster, NodeUnavailableError,
                       PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult,
                       StalePoolsError, StorageConfig, StoreUnavailableError, __version__,
                       start_local)
    from raykv import PoolHandle, PoolLayout, StagedPool
    from raykv.integrations.vllm import ConnectorOptions

    version: str = __version__
    config: StorageConfig = StorageConfig(model_name="m", tp_size=2)
    policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    kv: PoolName = PoolName.KV
    errors: tuple[type[Exception], ...] = (NodeUnavailableError, StalePoolsError,
                                           StoreUnavailableError)

    def use(client: CacheClient, pool: HostPool, handle: PoolHandle,
            cluster: LocalCluster, result: PoolTransferResult,
            transfer: PoolTransfer, options: ConnectorOptions, staged: StagedPool,
            layout: PoolLayout) -> int:
        client.register_mem_pool_host(staged)
        client.create_host_pool(layout, name="p")
        return client.batch_exists(["k"])

    with start_local() as running:
        pass
''')

BAD = textwrap.dedent('''
    from raykv import NotAnExport, StorageConfig

    wrong: int = StorageConfig()
''')

MYPY_INI = textwrap.dedent('''
    [mypy]
    # raykv's dependencies are not what is checked here: Any where they are missing
    ignore_missing_imports = True
    follow_imports = silent
    [mypy-raykv,raykv.*]
    ignore_missing_imports = False
''')


def exported_names(init: Path) -> tuple[dict[str, str], dict[str, str]]:
    """``(_EXPORTS, TYPE_CHECKING imports)`` of a package's ``__init__``, name -> module."""
    tree = ast.parse(init.read_text())
    exports, declared = {}, {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_EXPORTS":
            exports = ast.literal_eval(node.value)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom), ast.dump(imp)
                for alias in imp.names:
                    assert alias.asname == alias.name, "re-export as `import X as X`"
                    declared[alias.name] = imp.module
    return exports, declared


@pytest.mark.parametrize("init", LAZY_PACKAGES)
def test_type_checking_imports_declare_every_lazy_export(init):
    exports, declared = exported_names(ROOT / init)
    assert exports and declared == exports
    assert hidden_getattr(ROOT / init), \
        "a module __getattr__ visible to a type checker would accept any name"


def hidden_getattr(init: Path) -> bool:
    """Whether the module's ``__getattr__`` is assigned under ``if not TYPE_CHECKING:``
    only."""
    def assigns_getattr(nodes: list[ast.stmt]) -> bool:
        return any(isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") ==
                   "__getattr__" for n in nodes)

    tree = ast.parse(init.read_text())
    hidden = [n for n in tree.body if isinstance(n, ast.If)
              and isinstance(n.test, ast.UnaryOp) and isinstance(n.test.op, ast.Not)
              and getattr(n.test.operand, "id", "") == "TYPE_CHECKING"]
    return any(assigns_getattr(n.body) for n in hidden) and not assigns_getattr(tree.body)


def source_tree(tmp_path: Path) -> Path:
    """The package as it installs (pyproject's package-dir), as symlinks into the repo,
    so mypy reads raykv where a user's site-packages would hold it."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
        "setuptools"]["package-dir"]
    top = tmp_path / "site"
    for package, folder in sorted(package_dir.items()):
        target = top.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for path in (ROOT / folder).iterdir():
            if path.suffix == ".py" or path.name == "py.typed":
                (target / path.name).symlink_to(path)
    return top


@pytest.fixture(scope="module")
def mypy_run(tmp_path_factory) -> subprocess.CompletedProcess:
    """mypy, run once as a user's project would run it, over ``good.py`` (``GOOD``) and
    ``bad.py`` (``BAD``): each file's errors are the lines naming it."""
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    tmp_path = tmp_path_factory.mktemp("mypy")
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "bad.py").write_text(BAD)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-site-packages",
         "--cache-dir", str(tmp_path / "cache"), "good.py", "bad.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"MYPYPATH": str(source_tree(tmp_path)), "PATH": "/usr/bin:/bin"})


def errors_of(out: subprocess.CompletedProcess, name: str) -> list[str]:
    return [line for line in out.stdout.splitlines() if line.startswith(f"{name}:")]


def test_mypy_accepts_the_public_api(mypy_run):
    assert errors_of(mypy_run, "good.py") == [], mypy_run.stdout + mypy_run.stderr
    assert not mypy_run.stderr, mypy_run.stderr


def test_mypy_rejects_what_raykv_does_not_export(mypy_run):
    bad = "\n".join(errors_of(mypy_run, "bad.py"))
    assert mypy_run.returncode == 1, mypy_run.stdout + mypy_run.stderr
    assert 'Module "raykv" has no attribute "NotAnExport"' in bad, mypy_run.stdout
    assert 'expression has type "StorageConfig", variable has type "int"' in bad
