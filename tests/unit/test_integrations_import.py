"""``import raykv`` never needs an engine: the SGLang backend imports SGLang itself."""

import importlib.util
import subprocess
import sys

import pytest


def test_import_raykv_does_not_import_sglang(fresh_imports):
    assert "sglang" not in fresh_imports["integrations"], "raykv imported sglang"


def test_sglang_benchmark_modules_import_without_sglang(fresh_imports):
    """``raykv bench --engine sglang`` runs in raykv's venv; only its SGLang side, run by
    SGLang's python, imports SGLang (inside its functions)."""
    assert "sglang" not in fresh_imports["sglang benchmarks"], \
        "a benchmark module imported sglang"


def test_sglang_package_imports_without_sglang(fresh_imports):
    """The backend's package and its pure modules (config, pools, transfers, serving)
    never import SGLang; only ``RayKVStore`` (module ``store``) does, on first use."""
    import raykv.integrations.sglang as s

    assert "sglang" not in fresh_imports["sglang package"], \
        "the sglang package imported sglang"
    assert s.__all__ == ["RayKVStore"]


def test_sglang_backend_needs_sglang_only_when_imported():
    if importlib.util.find_spec("sglang") is not None:
        return  # this venv has SGLang: nothing to check here
    r = subprocess.run([sys.executable, "-c",
                        "from raykv.integrations.sglang import RayKVStore"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "sglang" in r.stderr


@pytest.mark.engine("ray.serve")
def test_serve_routing_modules_import_without_ray_serve_or_vllm():
    """``import raykv`` and the router's pure parts never import Ray Serve or vLLM; only
    ``raykv.integrations.serve.router`` imports Ray Serve (control: it does)."""
    code = ("import sys, raykv, raykv.integrations.serve.route_keys, "
            "raykv.integrations.serve.ranking, raykv.integrations.serve.prompt_tokens, "
            "raykv.integrations.serve.node_answers; "
            "assert not any(m.startswith('ray.serve') for m in sys.modules), 'Ray Serve'; "
            "assert 'vllm' not in sys.modules, 'vLLM'; "
            "import raykv.integrations.serve.router; "
            "assert 'ray.serve' in sys.modules and 'vllm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
