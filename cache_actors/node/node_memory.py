"""How much memory this node has: its physical memory, or the memory limit of the
cgroup it runs in where that is lower (a container's)."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max",  # cgroup v2
                 "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v1
"""Where a process reads its cgroup's memory limit ("max" or a huge number: none)."""


def node_memory_bytes() -> int:
    """This node's memory in bytes: the smaller of its physical memory and its cgroup's
    memory limit, if it has one."""
    limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits)
