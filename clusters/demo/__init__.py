"""Demos (``raykv demo``, ``raykv demo --engine vllm``): a multi-turn chat on a 2-node
cluster, with raykv and without.

``chat`` holds what both share (cluster, chat loop, long prompt, report, figure);
``example_demo`` runs the example engine, ``vllm_demo`` real vLLM engines
(``vllm_actors``: vLLM engines in Ray actors; ``vllm_model``: a random-weight Llama made
locally; both also serve the vLLM tests). Importing this package imports none of them.
"""
