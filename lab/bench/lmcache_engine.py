"""One vLLM engine with LMCache 0.5.6's multiprocess connector, driven over stdin and
stdout: the LMCache side of ``raykv_lab.bench.lmcache_h2h``.

A script, run by that module with the Python of a separate virtual environment that has
``lmcache`` installed (raykv never imports LMCache): ``python lmcache_engine.py MODEL
PORT LLM_KWARGS_JSON``. It starts vLLM's ``LLM`` (in-process, as the raykv engines run)
with ``LMCacheMPConnector`` talking to the LMCache server on ``tcp://127.0.0.1:PORT``,
prints ``READY``, then answers one JSON request per stdin line with one stdout line
``RESULT <json>``:

- ``{"op": "generate", "prompt": [ids], "max_tokens": n}``: greedy tokens;
  answers ``tokens``, ``cached`` (vLLM's ``num_cached_tokens``: what LMCache loaded,
  vLLM's prefix cache being off) and ``ttft_s`` (vLLM's ``first_token_latency``);
- ``{"op": "close"}``: shuts the engine down and exits.

vLLM's CPU build crashes at worker start when ``lmcache`` (through numba) has loaded
``llvmlite.binding`` before it: vLLM's triton dispatcher scans every loaded module and
trips over ``llvmlite.binding.ffi.lib``. ``hide_llvmlite_lib`` hides that one object
during the scan, and changes nothing else.
"""

from __future__ import annotations

import json
import sys


def hide_llvmlite_lib() -> None:
    """Wrap vLLM's kernel rebinding scan so it never sees ``llvmlite.binding.ffi.lib``."""
    import vllm.triton_utils.dispatcher as dispatcher

    scan = dispatcher._rebind_kernels

    def without_lib(overrides):
        ffi = sys.modules.get("llvmlite.binding.ffi")
        lib = ffi.__dict__.pop("lib", None) if ffi is not None else None
        try:
            return scan(overrides)
        finally:
            if lib is not None:
                ffi.lib = lib

    dispatcher._rebind_kernels = without_lib


def answer(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def main(model: str, port: int, llm_kwargs: dict) -> None:
    hide_llvmlite_lib()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=model, kv_transfer_config=KVTransferConfig(
        kv_connector="LMCacheMPConnector", kv_role="kv_both",
        kv_connector_extra_config={"lmcache.mp.host": "tcp://127.0.0.1",
                                   "lmcache.mp.port": port}), **llm_kwargs)
    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "close":
            llm.llm_engine.engine_core.shutdown()
            answer({"closed": True})
            return
        out = llm.generate({"prompt_token_ids": req["prompt"]},
                           SamplingParams(temperature=0, max_tokens=req["max_tokens"],
                                          ignore_eos=True), use_tqdm=False)[0]
        answer({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                "ttft_s": out.metrics.first_token_latency})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))
