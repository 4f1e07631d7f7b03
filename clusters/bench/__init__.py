"""Benchmarks (``raykv bench``, ``bench --engine sglang``, ``bench-group``,
``bench-ranks``), each measuring raykv against raw Mooncake on one store in one run.

``toolkit`` holds what they share (statistics, the raw Mooncake client, the run's set-up,
tables, plots, JSON/PNG files); ``dataplane``, ``group``, ``ranks`` and ``sglang`` are
the benchmarks; ``sglang_runner`` is the SGLang side of ``sglang``, run by SGLang's own
python. Importing this package imports none of them.
"""
