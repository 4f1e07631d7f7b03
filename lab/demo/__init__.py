"""Runs in the driver's process (``raykv demo``, ``raykv demo --engine vllm``): a
multi-turn chat on a 2-node cluster, with raykv and without.

``chat`` holds what both share (cluster, chat loop, long prompt, report, figure);
``example_demo`` runs the example engine, ``vllm_demo`` real vLLM engines (from
``raykv_lab.engines``). Importing this package imports none of them.
"""
