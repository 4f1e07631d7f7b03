"""Processes that run no rank never import torch: the CLI and the controller, reconciler
and supervisor actors (each a process Ray starts) would pay ~3 s each on a small
machine. The public names still import from ``raykv`` as before."""

import subprocess
import sys


def run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_control_plane_and_cli_do_not_import_torch():
    run("import sys, raykv, raykv.clusters.cli, raykv.clusters.control_plane, "
        "raykv.controllers.controller, raykv.clusters.master_supervisor, "
        "raykv.cache_actors.node.node_actor; "
        "assert 'torch' not in sys.modules, 'torch was imported'")


def test_public_names_still_import_and_bring_torch_with_the_client():
    run("import sys, raykv; from raykv import StorageConfig, PoolName, start_local; "
        "assert 'torch' not in sys.modules; "
        "from raykv import CacheClient, HostPool; assert 'torch' in sys.modules; "
        "from raykv import PoolHandle, PoolLayout, StagedPool; "
        "assert sorted(dir(raykv)) == sorted(raykv.__all__); "
        "import pytest; pytest.raises(AttributeError, lambda: raykv.nothing_here)")
