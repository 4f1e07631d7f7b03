"""``python -m raykv.clusters.ray_start ARGS``: Ray's own ``ray start ARGS``, patient on
a loaded machine. Runs inside each emulated host (``clusters.hosts``).

``ray start`` gives a new raylet a fixed 30 s to register with the GCS and fails the
node after that; with several emulated hosts starting on a busy machine that happens.
Here each of Ray's own lookups of the new node waits up to ``PATIENCE_S`` for it
(retrying every 0.5 s) before it reports the node missing, so a slow start is waited
out instead of failed. Nothing else of ``ray start`` changes.
"""

from __future__ import annotations

import time

PATIENCE_S = 120.0


def _patient(get_node):
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


def main() -> None:
    import ray._private.services as services
    from ray.scripts.scripts import main as ray_main

    services.get_node = _patient(services.get_node)
    ray_main()


if __name__ == "__main__":
    main()
