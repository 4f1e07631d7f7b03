"""Ray Serve LLM with raykv: vLLM replicas that reuse the KV blocks any replica computed.

Every replica's vLLM engine loads ``RayKVConnector`` (``engine_kwargs`` ->
``kv_transfer_config``); a prompt whose prefix any replica on any node served before
loads those blocks from raykv (the node actor, Mooncake) instead of computing
them. Nothing else changes in the Serve app: routing, autoscaling and the OpenAI API are
Ray Serve LLM's.

On a Ray cluster with GPUs (untested on GPUs so far), install on every node, from a clone
of raykv's repository (it is not on the package index), raykv with vLLM 0.32.0's CUDA
build and Ray Serve for the cluster's Ray version (the same everywhere): ``pip install -e
'.[gpu]' 'ray[serve]==<this Ray's version>' pyarrow``. Then::

    raykv up --address auto                     # master, controller, an actor per node
    python examples/serve_llm_raykv.py --model Qwen/Qwen2.5-7B-Instruct --replicas 2

The script starts the app, sends a few requests that share a long prefix and prints, per
request, the prompt tokens vLLM reported as cached (its own prefix cache plus the blocks
raykv loaded; with ``--no-prefix-caching`` only raykv's). ``--cpu`` runs the replicas on
CPUs with vLLM's CPU build (``scripts/setup.sh`` installs it and Ray Serve; ``ray[llm]``
would pull vLLM's CUDA build over it); see docs/engines.md, "Ray Serve LLM".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import urllib.error
import urllib.request

import ray
from ray import serve
from ray.serve.llm import LLMConfig, build_openai_app
from raykv.controllers.tenancy import TENANT_SECRET_FILE_ENV

ROUTER = "raykv.integrations.serve.router:RayKVRouter"
ROUTED_TAG = "vllm-routed"
"""The key tag of routed replicas: set in both the connector's and the router's
config, so both key blocks alike whatever the engine's dtype or attention backend."""


def raykv_router_config(model_name: str, *, block_size: int, tp_size: int = 1,
                        tokenizer: str | None = None, tenant: str | None = None) -> dict:
    """The ``request_router_config`` of ``LLMConfig.deployment_config`` that routes by
    raykv's residency (``RayKVRouter``): the engines' model name, block size, TP size,
    tenant and key tag (``ROUTED_TAG``), and the tokenizer that turns text requests
    into token ids (the model source)."""
    kwargs = {"model_name": model_name, "block_size": block_size, "tp_size": tp_size,
              "extra_backend_tag": ROUTED_TAG, "tokenizer": tokenizer}
    if tenant:
        kwargs["tenant"] = tenant
    return {"request_router_class": ROUTER, "request_router_kwargs": kwargs}


def raykv_llm_config(model_id: str, model_source: str, *, replicas: int, cpu: bool,
                     prefix_caching: bool, max_model_len: int, model_name: str | None = None,
                     tenant: str | None = None, router_block_size: int | None = None,
                     l2_blocks: int = 0, **llm_config) -> LLMConfig:
    """A Ray Serve ``LLMConfig`` whose vLLM engines use raykv's connector.

    ``model_name``: the model part of raykv's keys (default ``model_source``): engines
    share blocks when it (and the TP size) match. ``tenant``: raykv's tenant of these
    replicas (default none); the path of its secret file, from this process's
    ``$RAYKV_TENANT_SECRET_FILE``, is handed to the replicas through their
    ``runtime_env``, never the secret (Ray shows a runtime environment's variables to
    every job of the cluster): the file must be on every node the replicas run on,
    readable by their user only (docs/deploy.md, "Tenants and quotas").
    ``router_block_size``: route requests with ``RayKVRouter`` (``raykv_router_config``)
    and run the engines with this vLLM block size (None: Serve's own router).
    ``l2_blocks``: the connector's ``l2_blocks``, blocks of each TP rank in the node's
    shared L2 cache (0: no L2, blocks come from Mooncake; docs/engines.md, "L2").
    ``llm_config``: any other ``LLMConfig`` field (e.g. ``placement_group_config``)."""
    engine_kwargs = dict(
        max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching,
        enable_prompt_tokens_details=True,  # usage.prompt_tokens_details.cached_tokens
        kv_transfer_config=dict(
            kv_connector="RayKVConnector",
            kv_connector_module_path="raykv.integrations.vllm",
            kv_role="kv_both",                   # load and save
            kv_load_failure_policy="recompute",  # a block that did not load is recomputed
            kv_connector_extra_config={"model_name": model_name or model_source}
            | ({"tenant": tenant} if tenant else {})
            | ({"l2_blocks": l2_blocks} if l2_blocks else {}),
        ),
    )
    env = {}
    if tenant:
        path = os.environ.get(TENANT_SECRET_FILE_ENV)
        if not path:
            raise ValueError(f"tenant {tenant!r}: set ${TENANT_SECRET_FILE_ENV} to the path "
                             "of its secret file on the replicas' nodes before starting "
                             "the app")
        env[TENANT_SECRET_FILE_ENV] = path
    deployment = dict(autoscaling_config=dict(min_replicas=replicas, max_replicas=replicas))
    if router_block_size:
        engine_kwargs["block_size"] = router_block_size
        engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"][
            "extra_backend_tag"] = ROUTED_TAG
        deployment["request_router_config"] = raykv_router_config(
            model_name or model_source, block_size=router_block_size, tokenizer=model_source,
            tenant=tenant)
    kw = dict(llm_config)
    if cpu:
        kw["accelerator_config"] = {"kind": "cpu"}
        engine_kwargs |= dict(dtype="bfloat16", enforce_eager=True,
                              kv_cache_memory_bytes=256 << 20)
        # nobind: else vLLM binds its worker to every core and OMP_NUM_THREADS=1 is lost
        env |= {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "HF_HUB_OFFLINE": "1"}
    return LLMConfig(
        model_loading_config=dict(model_id=model_id, model_source=model_source),
        deployment_config=deployment,
        engine_kwargs=engine_kwargs,
        runtime_env={"env_vars": env},
        **kw,
    )


def complete(url: str, model_id: str, prompt: str | list[int], max_tokens: int = 16,
             **extra) -> dict:
    """One greedy OpenAI completion through the Serve app (``prompt``: text or token ids;
    ``extra``: more request fields, e.g. vLLM's ``return_token_ids``); the response."""
    body = json.dumps({"model": model_id, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0} | extra).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:  # the app's own message says what was wrong
        raise RuntimeError(f"{e.code} from the app: {e.read().decode()[:2000]}") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF model id or local path")
    p.add_argument("--model-id", default="raykv-llm", help="name the app serves it as")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="CPU replicas (vLLM's CPU build)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="vLLM's own prefix cache off: every cached token came from raykv")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--address", default="auto", help="Ray cluster (raykv must be up there)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--port", type=int, default=8000, help="Serve's HTTP port")
    p.add_argument("--raykv-router", type=int, metavar="BLOCK_SIZE",
                   help="route by raykv's residency (RayKVRouter), vLLM blocks of this size")
    p.add_argument("--l2-blocks", type=int, default=1024,
                   help="blocks of each replica's node L2 cache, shared by the node's "
                        "replicas (0: none, every load from Mooncake)")
    p.add_argument("--tenant", help="raykv tenant of the replicas (its secret file: "
                   f"${TENANT_SECRET_FILE_ENV} of this process)")
    args = p.parse_args()

    ray.init(address=args.address)
    config = raykv_llm_config(args.model_id, args.model, replicas=args.replicas, cpu=args.cpu,
                              prefix_caching=not args.no_prefix_caching,
                              max_model_len=args.max_model_len, tenant=args.tenant,
                              router_block_size=args.raykv_router,
                              l2_blocks=args.l2_blocks)
    serve.start(http_options={"port": args.port})
    serve.run(build_openai_app({"llm_configs": [config]}), name="raykv-llm", route_prefix="/")
    url = f"http://127.0.0.1:{args.port}"
    # Prompts as token ids (any model's vocabulary has ids 100-1999): half the context
    # shared by every request, then a few ids of its own.
    rng = random.Random(0)
    shared = [rng.randrange(100, 2000) for _ in range(args.max_model_len // 2)]
    for i in range(args.requests):
        t0 = time.perf_counter()
        usage = complete(url, args.model_id, shared + [100 + i] * 8)["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        print(f"request {i}: {usage['prompt_tokens']} prompt tokens, {cached} cached, "
              f"{time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
