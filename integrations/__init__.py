"""Runs inside an engine's own processes (SGLang's scheduler, vLLM's scheduler and
workers): raykv behind the engine's own plug-in point.

Each package imports its engine lazily (only when the engine loads it):
``raykv.integrations.sglang`` (SGLang HiCache storage backend) and
``raykv.integrations.vllm`` (vLLM KV connector); ``ray_join`` joins the raykv cluster's
Ray from an engine process.
"""
