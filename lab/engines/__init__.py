"""Engines the lab drives: vLLM engines inside Ray actors pinned to nodes
(``vllm_actors``) and a random-weight Llama made locally (``vllm_model``), for the demo,
the benchmarks and the tests. Importing this package imports none of them.
"""
