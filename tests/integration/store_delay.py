"""Slow and failing store calls, injected into running node actors (the product has no
delay or failure hook).

``delay_store_calls(actors, s)``: from now on every put and get of ``MooncakeBackend`` in
each node actor's process waits ``s`` seconds at the start of its store call, after the
node actor resolved its pointers (0: the plain calls again). The change lives in the
actor's process: a node actor that restarts comes back with plain calls. Used by the
pytest side (``conftest.slow_two_nodes`` / ``set_store_delay``) and by
``sglang_driver.py`` (its ``store_delay`` step), which imports this file from its folder.

``fail_store_puts(actor, calls)``: the next ``calls`` puts of ``MooncakeBackend`` in the
node actor's process fail (``CLIENT_ERROR`` for every object, nothing sent); the plain
put after that.
"""

from __future__ import annotations


def delay_store_calls(actors, seconds: float) -> None:
    """Set the delay in each of ``actors`` (node actor handles) and wait for all."""
    import ray

    def set_delay(actor, s: float) -> None:  # runs in the node actor's process
        import functools
        import time

        from raykv.cache_actors.node.mooncake_backend import MooncakeBackend

        plain = MooncakeBackend.__dict__.get("_plain_calls")
        if plain is None:
            plain = {op: getattr(MooncakeBackend, op) for op in ("put", "get")}
            MooncakeBackend._plain_calls = plain
        for op, call in plain.items():
            if not s:
                setattr(MooncakeBackend, op, call)
                continue

            @functools.wraps(call)
            def slow(self, *args, _call=call, **kwargs):
                time.sleep(s)
                return _call(self, *args, **kwargs)

            setattr(MooncakeBackend, op, slow)

    ray.get([a.__ray_call__.remote(set_delay, seconds) for a in actors], timeout=60)


def fail_store_puts(actor, calls: int) -> None:
    """Make the next ``calls`` store puts in ``actor``'s process fail (see the module
    docstring); waits until set."""
    import ray

    def set_failures(_actor, n: int) -> None:  # runs in the node actor's process
        import functools

        from raykv.cache_actors.node.mooncake_backend import MooncakeBackend
        from raykv.controllers.result_codes import CLIENT_ERROR

        plain = MooncakeBackend.__dict__.get("_unfailed_put") or MooncakeBackend.put
        MooncakeBackend._unfailed_put = plain
        left = [n]

        @functools.wraps(plain)
        def failing(self, keys, *args, **kwargs):
            if left[0] > 0:
                left[0] -= 1
                return [CLIENT_ERROR] * len(keys)
            return plain(self, keys, *args, **kwargs)

        MooncakeBackend.put = failing

    ray.get(actor.__ray_call__.remote(set_failures, calls), timeout=60)
