"""The wheel built from a clean copy of the repository (its tracked and new files, none
of a build's leftovers) holds the whole package, ``py.typed`` and the license, declares
matplotlib only for the extras that draw, and imports from where it is unpacked: with
the test venv's site-packages for raykv's dependencies, but neither the repository nor
the editable install of it (``python -S``: no ``.pth`` hooks)."""

import subprocess
import sys
import sysconfig
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a clean copy of the working tree."""
    tmp = tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    src = tmp / "src"
    for name in filter(None, files):
        if (ROOT / name).is_file():  # a file deleted but not yet staged is listed too
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(src), "-w", str(tmp / "dist")],
                   check=True, capture_output=True, timeout=120)
    (built,) = (tmp / "dist").glob("raykv-*.whl")
    return built


def test_wheel_holds_every_module_py_typed_and_the_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):  # every sub-package is listed
            sub = init.parent.relative_to(ROOT / folder).parts
            assert ".".join((package, *sub)) in setuptools["packages"], init
    for package in setuptools["packages"]:
        folder = ROOT / setuptools["package-dir"][package]
        in_wheel = package.replace(".", "/")
        for module in folder.glob("*.py"):
            assert f"{in_wheel}/{module.name}" in names, f"{package}.{module.stem} missing"
    assert "raykv/py.typed" in names
    (dist_info,) = {n.split("/")[0] for n in names if ".dist-info/" in n}
    license_text = zipfile.ZipFile(wheel).read(f"{dist_info}/licenses/LICENSE").decode()
    assert "Apache License" in license_text and "Version 2.0" in license_text
    metadata = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist: matplotlib"):
            assert "extra ==" in line, line
    assert "raykv = raykv.clusters.cli:main" in zipfile.ZipFile(wheel).read(
        f"{dist_info}/entry_points.txt").decode()


CHILD = textwrap.dedent('''
    import sys
    from importlib.metadata import version
    from pathlib import Path

    unpacked, repo = Path(sys.argv[1]), sys.argv[2]
    import raykv
    import raykv.clusters.cli
    from raykv import CacheClient, PoolName, StorageConfig, start_local
    from raykv.controllers import KeyScheme
    from raykv.integrations.vllm import ConnectorOptions

    assert raykv.__version__ == version("raykv")
    loaded = [m.__file__ for n, m in sys.modules.items()
              if n.startswith("raykv") and getattr(m, "__file__", None)]
    assert len(loaded) > 10 and all(f.startswith(str(unpacked)) for f in loaded), loaded
    assert not any(Path(p or ".").resolve() == Path(repo) for p in sys.path), sys.path
    print("imported", len(loaded))
''')


def test_wheel_imports_outside_the_repository(wheel, tmp_path):
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    (tmp_path / "cwd").mkdir()
    deps = sysconfig.get_paths()["purelib"]  # this venv's packages, without their .pth
    out = subprocess.run([sys.executable, "-S", "-P", "-c", CHILD, str(unpacked), str(ROOT)],
                         cwd=tmp_path / "cwd", capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": f"{unpacked}:{deps}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0 and "imported" in out.stdout, out.stderr[-3000:]
