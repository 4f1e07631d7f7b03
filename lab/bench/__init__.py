"""Runs in the driver's process (``raykv bench``, ``bench --engine sglang``,
``bench-group``, ``bench-ranks``), except ``sglang_runner``, which SGLang's own python
runs: benchmarks measuring raykv against raw Mooncake (or SGLang's own backend) on one
store in one run.

``toolkit`` holds what they share (statistics, the raw Mooncake client, the run's set-up,
tables, plots, JSON/PNG files); ``dataplane``, ``group``, ``ranks`` and ``sglang`` are
the benchmarks; ``sglang_runner`` is the SGLang side of ``sglang``; ``verdict`` decides
whether runs met their targets (``--check``). Importing this package imports none of
them.
"""
