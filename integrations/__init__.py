"""Engine integrations: raykv behind an engine's own plug-in point.

Each module imports its engine lazily (only when the engine loads it):
``raykv.integrations.sglang`` (SGLang HiCache storage backend) and
``raykv.integrations.vllm`` (vLLM KV connector).
"""
