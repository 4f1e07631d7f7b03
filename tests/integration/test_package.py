"""raykv is one import package: folders named like its sub-packages in a user's working
directory (or a Ray job's ``working_dir``) never shadow it. Each decoy package raises
when imported, so any import of a bare ``controllers`` / ``clusters`` / ``cache_actors``
fails the test."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ray

from tests.integration.conftest import two_nodes

DECOYS = ("controllers", "clusters", "cache_actors", "example_engine")


def child_env() -> dict[str, str]:
    """The environment of a child process, read when called (never at import: the
    cluster a child joins may change this process's ``RAY_AUTH_MODE``).

    Without ``PYTHONPATH``: only the installed raykv may be found. When this process is
    connected to a Ray cluster, ``RAY_AUTH_MODE`` is the mode it uses with that
    cluster: the cluster's processes were started from this process's environment, and
    a driver that joins by address never turns token authentication on by itself
    (``ray.init`` does that only for a cluster it starts or finds with ``auto``). The
    token itself, if any, is found where this process found it (same ``HOME``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if ray.is_initialized():
        from ray._raylet import AuthenticationMode, get_authentication_mode

        token = get_authentication_mode() == AuthenticationMode.TOKEN
        env["RAY_AUTH_MODE"] = "token" if token else "disabled"
    return env


@pytest.fixture
def cluster_and_env():
    """A two-node embedded cluster and the environment of a driver that joins it,
    computed once the cluster runs (its auth mode is only known then)."""
    with two_nodes("embedded") as cluster:
        yield cluster, child_env()


@pytest.fixture
def decoy_dir(tmp_path: Path) -> Path:
    for name in DECOYS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('decoy {name} imported: raykv was shadowed')\n")
    return tmp_path


def run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=child_env())


def test_decoys_are_proven_to_shadow(decoy_dir):
    """Control: the decoys do shadow a bare import from that directory."""
    out = run([sys.executable, "-c", "import controllers"], decoy_dir)
    assert out.returncode != 0 and "decoy controllers imported" in out.stderr


def test_public_api_and_cli_import_beside_decoys(decoy_dir):
    out = run([sys.executable, "-c",
               "import raykv; from raykv import CacheClient, start_local, StorageConfig, "
               "PoolName, PoolTransfer, PoolHitPolicy; print(sorted(raykv.__all__))"],
              decoy_dir)
    assert out.returncode == 0, out.stderr
    assert "CacheClient" in out.stdout and "NodeUnavailableError" in out.stdout
    out = run([str(Path(sys.executable).parent / "raykv"), "--help"], decoy_dir)
    assert out.returncode == 0, out.stderr
    assert "demo" in out.stdout


DRIVER = textwrap.dedent('''
    import sys
    import ray
    import torch

    ray.init(address=sys.argv[1], namespace=sys.argv[2],
             runtime_env={"working_dir": sys.argv[3]})

    @ray.remote(num_cpus=0)
    def move_pages():
        import os

        import raykv
        from raykv import CacheClient, StorageConfig

        assert os.path.isdir("controllers"), "the task does not run in the working_dir"
        client = CacheClient(StorageConfig(tp_rank=0, tp_size=1, model_name="decoy/m"))
        pool = client.create_host_pool("mha", page_size=4, size=32, layer_num=2,
                                       head_num=2, head_dim=8, dtype=torch.float16)
        client.register_mem_pool_host(pool)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).half())
        sent = pool.kv_buffer[:, 0:8].clone()
        keys = [sys.argv[4] + "-0", sys.argv[4] + "-1"]
        assert client.batch_set_v1(keys, torch.arange(0, 8)) == [True, True]
        assert client.batch_exists(keys) == 2
        assert client.batch_get_v1(keys, torch.arange(16, 24)) == [True, True]
        assert torch.equal(pool.kv_buffer[:, 16:24], sent)
        return raykv.__file__

    print("RESULT", ray.get(move_pages.remote()))
''')


def test_ray_job_with_decoys_in_working_dir_moves_pages(decoy_dir, uid, cluster_and_env):
    (decoy_dir / "driver.py").write_text(DRIVER)
    cluster, env = cluster_and_env
    out = subprocess.run(
        [sys.executable, "driver.py", cluster.address, cluster.namespace,
         str(decoy_dir), uid], cwd=decoy_dir, capture_output=True, text=True,
        timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "RESULT" in out.stdout
