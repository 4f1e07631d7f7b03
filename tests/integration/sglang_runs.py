"""Running ``sglang_driver.py`` (SGLang's own controller and host pools, in the SGLang
venv) against a raykv cluster of this process; shared by the SGLang test modules.

Without the SGLang venv the tests that use it fail, or skip under ``RAYKV_NO_ENGINES=1``
(``tests/engines.py``): set RAYKV_SGLANG_PYTHON or run ``scripts/sglang-venv.sh``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest
from raykv_lab.bench.sglang import sglang_env

from tests import engines

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_driver.py")
SGLANG_PY = engines.SGLANG_PY
PAGE = 16
DSA_PAGE = 64
FAILURE_ENV = "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"


def require_sglang() -> None:
    """Fail the test when the SGLang venv's python is missing (skip it under
    ``RAYKV_NO_ENGINES=1``): ``engines.require``."""
    engines.require("sglang")


def run_driver(tmp_path, cluster, node: int, scenarios: list, *, tp_rank: int = 0,
               tp_size: int = 1, gloo_port: int = 0, timeout: int = 420) -> dict:
    """Run one SGLang driver process whose scenarios use node ``node``'s node actor
    (unless a scenario names its own ``node``); its JSON result."""
    import ray

    require_sglang()
    spec = {"ray_address": ray.get_runtime_context().gcs_address,
            "namespace": cluster.namespace, "node_ids": list(cluster.node_ids), "node": node,
            "tp_rank": tp_rank, "tp_size": tp_size, "gloo_port": gloo_port,
            "scenarios": scenarios}
    path = tmp_path / f"spec-{node}-{tp_rank}-{os.urandom(3).hex()}.json"
    path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    env |= sglang_env(SGLANG_PY)
    proc = subprocess.run([SGLANG_PY, DRIVER, str(path)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(tmp_path))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"SGLang driver failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}",
                    pytrace=False)
    out = json.loads(lines[-1])
    out["stderr"] = proc.stderr
    return out


def scenario(name, model, allocator, steps, model_name=None, **kw) -> dict:
    """One driver scenario: a fresh SGLang controller + backend for ``steps``."""
    return {"name": name, "model": model, "allocator": allocator,
            "model_name": model_name or f"org/{name}", "steps": steps, **kw}


def steps(sc: dict) -> list[dict]:
    """The steps of a scenario's result; asserts none of them raised."""
    for s in sc["steps"]:
        assert "error" not in s, s
    return sc["steps"]


def mooncake_config(cluster) -> dict:
    """Extra config for SGLang's built-in MooncakeStore on ``cluster``'s master (a
    consumer: it contributes no segment)."""
    return {"master_server_address": cluster.master_address,
            "metadata_server": cluster.metadata_server, "local_hostname": "127.0.0.1",
            "protocol": "tcp", "global_segment_size": 0, "check_server": False}


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
