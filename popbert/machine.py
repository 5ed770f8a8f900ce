"""What this machine lets this process use: CPUs (its affinity mask, bounded by the CPU quota
of its cgroup) and memory (the kernel's available memory, bounded by its cgroup's memory
limit): a container's limits, Kubernetes' `limits.cpu` and `limits.memory`, `docker run
--cpus/--memory`.

Runtimes size their thread pools from the machine's cores and ignore quotas, so in a container
limited to 2 CPUs on a 64-core node they start 64 threads, which the kernel then throttles.
The defaults that start threads or processes (`popbert serve`'s threads per worker,
`prepare-data`'s workers, torch's threads in training) take their count from here instead,
and work that would need more memory than there is asks here before it starts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")
# cgroup v1 reports "no memory limit" as a huge page-rounded number; anything this large is none.
NO_LIMIT = 2**60

T = TypeVar("T")


def usable_cpus(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int:
    """The CPUs this process may use: the affinity mask's count, at most its cgroup's CPU
    quota rounded down (a quota of 1.5 CPUs keeps one thread busy without being throttled; two
    would be, each period), and 1 at least."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = cpu_quota(root, self_cgroup)
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)


def quota_threads(processes: int = 1, root: Path = CGROUP_ROOT,
                  self_cgroup: Path = SELF_CGROUP) -> int | None:
    """Threads for each of `processes` processes on this machine under a cgroup CPU quota;
    None without a quota, where a runtime's own default (the machine's cores) is right."""
    if cpu_quota(root, self_cgroup) is None:
        return None
    return max(1, usable_cpus(root, self_cgroup) // max(1, processes))


def cpu_quota(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> float | None:
    """The CPU quota (CPUs' worth of time per period) of this process's cgroup and the ones
    above it, the smallest of them; None without one (or off Linux)."""
    return _smallest(root, self_cgroup, ("cpu", "cpu,cpuacct", "cpuacct,cpu"), _v2_quota,
                     _v1_quota)


def available_memory(root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP,
                     meminfo: Path = MEMINFO) -> int | None:
    """Bytes this process may still allocate: the kernel's `MemAvailable`, at most what its
    cgroup's memory limit leaves (the limit less the cgroup's use); None where neither is
    known (off Linux)."""
    known = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                known.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    room = _smallest(root, self_cgroup, ("memory",), _v2_memory_room, _v1_memory_room)
    if room is not None:
        known.append(max(0, room))
    return min(known) if known else None


def _smallest(root: Path, self_cgroup: Path, v1_mounts: tuple[str, ...],
              v2: Callable[[Path], T | None], v1: Callable[[Path], T | None]) -> T | None:
    """The smallest value `v2` (cgroup v2's unified tree) or `v1` (the v1 controller mounted
    at one of `v1_mounts`) reads in this process's cgroup and the ones above it."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    values = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" and line.startswith("0::"):
            values += [v2(folder) for folder in _folders(root, path)]
        elif any(name in controllers.split(",") for name in v1_mounts[0].split(",")):
            for mount in (root / name for name in v1_mounts):
                if mount.is_dir():
                    values += [v1(folder) for folder in _folders(mount, path)]
                    break
    found = [value for value in values if value is not None]
    return min(found) if found else None  # type: ignore[type-var]


def _folders(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder under `mount` and each one above it. Inside a container the path
    is often one the container cannot see ("/../.."), and its own limits sit at the root."""
    parts = [part for part in path.strip("/").split("/") if part and part != ".."]
    folders = [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [folder for folder in folders if folder.is_dir()]


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _v2_quota(folder: Path) -> float | None:
    """`cpu.max`: "max 100000" (no quota) or "QUOTA PERIOD" in microseconds."""
    try:
        fields = (folder / "cpu.max").read_text().split()
        if len(fields) == 2 and fields[0] != "max" and int(fields[1]) > 0:
            return int(fields[0]) / int(fields[1])
    except (OSError, ValueError):
        pass
    return None


def _v1_quota(folder: Path) -> float | None:
    """`cpu.cfs_quota_us` (-1: no quota) over `cpu.cfs_period_us`."""
    quota, period = _read_int(folder / "cpu.cfs_quota_us"), _read_int(folder / "cpu.cfs_period_us")
    if quota is not None and period and quota > 0 and period > 0:
        return quota / period
    return None


def _v2_memory_room(folder: Path) -> int | None:
    """`memory.max` ("max": none) less `memory.current`."""
    return _memory_room(folder / "memory.max", folder / "memory.current")


def _v1_memory_room(folder: Path) -> int | None:
    """`memory.limit_in_bytes` less `memory.usage_in_bytes`."""
    return _memory_room(folder / "memory.limit_in_bytes", folder / "memory.usage_in_bytes")


def _memory_room(limit_file: Path, used_file: Path) -> int | None:
    """A cgroup's memory limit less its use; None without a limit (or an unreadable one)."""
    limit, used = _read_int(limit_file), _read_int(used_file)
    if limit is None or limit >= NO_LIMIT:
        return None
    return limit - (used or 0)


__all__ = ["available_memory", "cpu_quota", "quota_threads", "usable_cpus"]
