"""Runs in an engine's rank process (a driver or any Ray actor): ``CacheClient`` and its
route to the node actor, the pools it maps, its group registration."""
