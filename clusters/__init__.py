"""Runs in the driver's process (the ``raykv`` CLI, ``start_local``, the benchmarks and
demos): starting, watching and stopping a raykv cluster. Two of its classes run as
actors of their own: ``NodeReconciler`` (one cache actor per alive node) and
``MasterSupervisor`` (the head node's ``mooncake_master``).

Exports are lazy (``raykv.lazy_getattr``), so the ``raykv`` command starts without
importing Ray; the ``TYPE_CHECKING`` imports name them for a type checker."""

from typing import TYPE_CHECKING

from raykv import lazy_getattr

if TYPE_CHECKING:
    from raykv.clusters.local import LocalCluster as LocalCluster
    from raykv.clusters.local import start_local as start_local

_EXPORTS = {"LocalCluster": "raykv.clusters.local", "start_local": "raykv.clusters.local"}

if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
