"""How many CPUs this process may really use: its affinity mask, bounded by the CPU quota of
its cgroup (a container's CPU limit: Kubernetes' `limits.cpu`, `docker run --cpus`).

Runtimes size their thread pools from the machine's cores and ignore quotas, so in a container
limited to 2 CPUs on a 64-core node they start 64 threads, which the kernel then throttles.
The defaults that start threads or processes (`popbert serve`'s threads per worker,
`prepare-data`'s workers, torch's threads in training) take their count from here instead.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


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
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" and line.startswith("0::"):  # cgroup v2: one unified tree
            quotas += [_v2_quota(folder) for folder in _folders(root, path)]
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's tree
            for mount in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
                if mount.is_dir():
                    quotas += [_v1_quota(folder) for folder in _folders(mount, path)]
                    break
    found = [quota for quota in quotas if quota is not None]
    return min(found) if found else None


def _folders(mount: Path, path: str) -> list[Path]:
    """The cgroup's folder under `mount` and each one above it. Inside a container the path
    is often one the container cannot see ("/../.."), and its own quota sits at the root."""
    parts = [part for part in path.strip("/").split("/") if part and part != ".."]
    folders = [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [folder for folder in folders if folder.is_dir()]


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
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        if quota > 0 and period > 0:
            return quota / period
    except (OSError, ValueError):
        pass
    return None


__all__ = ["cpu_quota", "quota_threads", "usable_cpus"]
