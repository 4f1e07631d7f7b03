"""The engines' own test files, as their maintainers published them on the package index:
fetched when the peer suites run, never copied into this repository.

- vLLM 0.32.0: its source distribution (``vllm-0.32.0.tar.gz``) holds ``tests/``; the
  file is found on the package index (``$PIP_INDEX_URL``, else PyPI) through the index's
  JSON simple API, checked against ``VLLM_SDIST_SHA256`` and cached in pip's cache folder
  (``$PIP_CACHE_DIR``, else ``~/.cache/pip``) under ``raykv-peers/``; the test folders the
  peer suite runs are unpacked next to it once. ``pip download`` itself cannot fetch it:
  pip builds an sdist's metadata first, which for vLLM means a CUDA torch build.
  Offline: ``RAYKV_PEER_VLLM_SDIST`` names the tarball on disk (same checksum).
- SGLang 0.5.23: its wheel ships its storage backends' tests inside the package; the
  SGLang venv (``scripts/sglang-venv.sh``) installed that wheel, so they are read there.

Anything missing is a test failure with the way to fix it, never a skip.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import urllib.request
from pathlib import Path, PurePosixPath

VLLM_VERSION = "0.32.0"
VLLM_SDIST = f"vllm-{VLLM_VERSION}.tar.gz"
VLLM_SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
# The parts of vLLM's tests/ the peer suite imports (packages, their conftests, utils).
VLLM_TEST_DIRS = ("tests/__init__.py", "tests/v1/__init__.py", "tests/v1/kv_connector/__init__.py",
                  "tests/v1/kv_connector/unit/", "tests/v1/core/")
SGLANG_VERSION = "0.5.23"
FETCH_TIMEOUT_S = 120


class PeerSourceError(RuntimeError):
    """An engine's test files could not be had; the message says how to provide them."""


def cache_dir() -> Path:
    """``raykv-peers/`` in pip's cache folder (made if missing)."""
    root = os.environ.get("PIP_CACHE_DIR") or os.path.join(Path.home(), ".cache", "pip")
    path = Path(root) / "raykv-peers"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _sdist_url(index: str) -> str:
    """The URL of ``VLLM_SDIST`` on the simple index ``index`` (PEP 691 JSON)."""
    req = urllib.request.Request(index.rstrip("/") + "/vllm/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=FETCH_TIMEOUT_S) as r:
        files = json.load(r)["files"]
    for f in files:
        if f["filename"] == VLLM_SDIST:
            return f["url"]
    raise PeerSourceError(f"{index} lists no {VLLM_SDIST}")


def vllm_sdist() -> Path:
    """vLLM's sdist, from ``RAYKV_PEER_VLLM_SDIST``, the cache, or the package index
    (then cached); its checksum checked. ``PeerSourceError`` when none can be had."""
    local = os.environ.get("RAYKV_PEER_VLLM_SDIST")
    path = Path(local) if local else cache_dir() / VLLM_SDIST
    if not local and not path.exists():
        index = os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
        part = path.with_suffix(".part")
        try:
            url = _sdist_url(index)
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as r, \
                    open(part, "wb") as f:
                shutil.copyfileobj(r, f)
            part.replace(path)
        except Exception as e:
            part.unlink(missing_ok=True)
            raise PeerSourceError(
                f"vLLM's own tests come from its source distribution {VLLM_SDIST}, which "
                f"could not be fetched from {index} ({type(e).__name__}: {e}). On a machine "
                f"without the package index, download {VLLM_SDIST} from the package index "
                f"elsewhere and set RAYKV_PEER_VLLM_SDIST to its path, or put it in "
                f"{cache_dir()}") from e
    if not path.exists():
        raise PeerSourceError(f"RAYKV_PEER_VLLM_SDIST={local}: no such file")
    digest = _sha256(path)
    if digest != VLLM_SDIST_SHA256:
        if not local:
            path.unlink()
        raise PeerSourceError(f"{path} has SHA-256 {digest}, not {VLLM_SDIST}'s "
                              f"{VLLM_SDIST_SHA256}" + ("" if local else " (removed)"))
    return path


def vllm_tests() -> Path:
    """The root of vLLM's unpacked test folders (``VLLM_TEST_DIRS`` under it): unpacked
    from the sdist once per checksum."""
    sdist = vllm_sdist()
    root = cache_dir() / f"vllm-{VLLM_VERSION}-{VLLM_SDIST_SHA256[:12]}"
    done = root / ".unpacked"
    if done.exists():
        return root
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    prefix = f"vllm-{VLLM_VERSION}/"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name.removeprefix(prefix)
            if m.isfile() and any(rel == d or (d.endswith("/") and rel.startswith(d))
                                  for d in VLLM_TEST_DIRS):
                if ".." in PurePosixPath(rel).parts:
                    raise PeerSourceError(f"{sdist}: member {m.name!r} leaves its folder")
                m.name = rel
                members.append(m)
        # tarfile's extraction filters came in Python 3.11.4; before it, regular files
        # under the test folders (checked above) of the checksummed sdist are all we take
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp, members=members, **safe)
    shutil.rmtree(root, ignore_errors=True)
    tmp.replace(root)
    done.touch()
    return root


def sglang_python() -> str:
    """The SGLang venv's python, as the integration tests' SGLang drivers run it
    (``sglang_runs.SGLANG_PY``; ``RAYKV_SGLANG_PYTHON`` overrides it)."""
    from tests.integration.sglang_runs import SGLANG_PY

    return SGLANG_PY


def sglang_package() -> Path:
    """The installed ``sglang`` package of the SGLang venv (its wheel's files), checked
    to be version ``SGLANG_VERSION``."""
    py = sglang_python()
    if not os.path.exists(py):
        raise PeerSourceError(f"the SGLang venv is missing ({py}): SGLang's own tests ship "
                              "in its wheel, installed there by `scripts/sglang-venv.sh` (or "
                              "point RAYKV_SGLANG_PYTHON at a python with sglang=="
                              f"{SGLANG_VERSION} and raykv installed)")
    out = subprocess.run(
        [py, "-c", "import importlib.metadata as m, importlib.util as u, os; "
         "print(m.version('sglang')); "
         "print(os.path.dirname(u.find_spec('sglang').origin)); "
         "print(u.find_spec('pytest') is not None)"],
        capture_output=True, text=True, timeout=120)
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 3:
        raise PeerSourceError(f"{py} has no sglang package: {out.stderr[-1000:]}")
    if lines[0] != SGLANG_VERSION:
        raise PeerSourceError(f"{py} has sglang {lines[0]}, not {SGLANG_VERSION}")
    if lines[2] != "True":
        raise PeerSourceError(f"{py} has no pytest (SGLang's tests run in its venv): rerun "
                              "scripts/setup.sh, or `-m pip install pytest` there")
    return Path(lines[1])
