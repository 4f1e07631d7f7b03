"""Runs in the driver's process (the ``raykv`` CLI, ``start_local``, the benchmarks and
demos): starting, watching and stopping a raykv cluster. Two of its classes run as
actors of their own: ``NodeReconciler`` (one node actor per alive node) and
``MasterSupervisor`` (the head node's ``mooncake_master``).

Internal: users import ``start_local`` and ``LocalCluster`` from ``raykv``; the
``raykv`` command is ``clusters.cli``."""
