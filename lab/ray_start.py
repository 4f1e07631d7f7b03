"""``python -m raykv_lab.ray_start ARGS``: Ray's own ``ray start ARGS``, patient on
a loaded machine. Runs inside each emulated host (``lab.hosts``).

Two of ``ray start``'s waits are fixed and fail a node that a busy machine (several
emulated hosts starting at once) starts slowly:

- the new raylet waits ~20 s for its agents to write their ports to files in the
  session folder, then exits. ``lab.hosts`` gives every agent port explicitly, so
  here they are written to those files as soon as the raylet is started (the agents
  write the same numbers when they are up; the raylet's clients retry until they
  answer);
- ``ray start`` gives the raylet 30 s to register with the GCS. Here each of its
  lookups of the new node waits up to ``PATIENCE_S`` for it first.

Nothing else of ``ray start`` changes.
"""

from __future__ import annotations

import functools
import inspect
import time

PATIENCE_S = 120.0


def _patient(get_node):
    @functools.wraps(get_node)
    def patient_get_node(gcs_address, node_id):
        deadline = time.monotonic() + PATIENCE_S
        while True:
            try:
                return get_node(gcs_address, node_id)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    return patient_get_node


def _ports_written(start_raylet):
    signature = inspect.signature(start_raylet)

    @functools.wraps(start_raylet)
    def start_raylet_and_write_ports(*args, **kwargs):
        import ray._raylet as raylet

        info = start_raylet(*args, **kwargs)
        given = signature.bind(*args, **kwargs).arguments
        ports = {raylet.METRICS_AGENT_PORT_NAME: given.get("metrics_agent_port"),
                 raylet.METRICS_EXPORT_PORT_NAME: given.get("metrics_export_port"),
                 raylet.DASHBOARD_AGENT_LISTEN_PORT_NAME:
                     given.get("dashboard_agent_listen_port"),
                 raylet.RUNTIME_ENV_AGENT_PORT_NAME: given.get("runtime_env_agent_port")}
        if all(ports.values()):
            for name, port in ports.items():
                raylet.persist_port(given["session_dir"], given["node_id"], name, port)
        return info
    return start_raylet_and_write_ports


def main() -> None:
    import ray._private.services as services
    from ray.scripts.scripts import main as ray_main

    services.get_node = _patient(services.get_node)
    services.start_raylet = _ports_written(services.start_raylet)
    ray_main()


if __name__ == "__main__":
    main()
