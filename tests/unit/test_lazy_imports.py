"""Processes that run no rank never import torch: the CLI and the controller, reconciler
and supervisor actors (each a process Ray starts) would pay ~3 s each on a small
machine. The public names still import from ``raykv`` as before."""

import subprocess
import sys


def run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_control_plane_and_cli_do_not_import_torch(fresh_imports):
    assert "torch" not in fresh_imports["control plane"], "torch was imported"
    # CONTROL: the check sees an import (the demo's engine imports torch)
    assert "torch" in fresh_imports["drawing commands"]


def test_public_names_still_import_and_bring_torch_with_the_client():
    run("import sys, raykv; from raykv import StorageConfig, PoolName, start_local; "
        "assert 'torch' not in sys.modules; "
        "from raykv import CacheClient, HostPool; assert 'torch' in sys.modules; "
        "from raykv import PoolHandle, PoolLayout, StagedPool; "
        "assert sorted(dir(raykv)) == sorted(raykv.__all__); "
        "import pytest; pytest.raises(AttributeError, lambda: raykv.nothing_here)")
