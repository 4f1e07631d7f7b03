"""raykv's lab: what a developer runs to measure and show raykv, installed apart from it.

An operator installs ``raykv`` (the package every node and engine process imports, and
the ``raykv`` command's operator commands: ``up``, ``status``, ``drain``, ``why``,
``down``, ``tenant-digest``). The lab (``raykv-lab``, this package) adds ``raykv demo``,
the benchmarks (``bench*``), the simulator (``sim*``) and emulated hosts
(``emulate-hosts``, ``clean-hosts``) to the same command, and holds the code behind them:

- ``demo``: the chat of ``raykv demo`` (example engine or vLLM);
- ``bench``: benchmarks against raw Mooncake, memcpy or an engine's own path;
- ``sim``: the trace-driven simulator of a cluster on raykv's own policy code;
- ``engines``: vLLM engines in Ray actors and a random-weight Llama, for the demo, the
  benchmarks and the tests;
- ``hosts``, ``host_plan``, ``ray_start``: emulated hosts (a network namespace per host);
- ``plotting``, ``install_hints``: figures and install hints;
- ``cli``: the commands.

The lab imports raykv; raykv never imports the lab (a test keeps it so). Importing this
package imports none of its modules.
"""
