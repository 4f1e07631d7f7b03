"""One Ray Serve LLM set-up for the tests that run real Serve LLM replicas
(``test_vllm.py``): ``examples/serve_llm_raykv.py`` loaded
from its file, and ``serve_llm``: Ray Serve on a free loopback port running one
``LLMConfig`` as Ray Serve LLM's OpenAI app, shut down after."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
from collections.abc import Iterator
from pathlib import Path


def example(name: str = "serve_llm_raykv"):
    """A module of ``examples/``, loaded from its file (examples are scripts, not a
    package)."""
    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def serve_llm(config) -> Iterator[str]:
    """Ray Serve (HTTP on a free port of 127.0.0.1) running ``config`` (an
    ``LLMConfig``) as Ray Serve LLM's OpenAI app named ``raykv-llm`` at ``/``; yields
    its URL; Serve is shut down on the way out, whatever happened."""
    from ray import serve
    from ray.serve.llm import build_openai_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_openai_app({"llm_configs": [config]}), name="raykv-llm",
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
