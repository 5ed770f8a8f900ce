"""`popbert.cpus`: the CPUs a process may use, from cgroup files laid out as the kernel writes
them (v2's unified tree, v1's cpu controller, a container's view of its own root)."""

from __future__ import annotations

import os
from pathlib import Path

from popbert.cpus import cpu_quota, usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text + "\n")


def test_a_v2_quota_bounds_the_count_rounded_up(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "kubepods" / "pod1", {"cpu.max": "150000 100000"})  # limits.cpu: 1.5
    _write(root / "kubepods", {"cpu.max": "max 100000"})
    own = tmp_path / "self"
    own.write_text("0::/kubepods/pod1\n")
    assert cpu_quota(root, own) == 1.5
    assert usable_cpus(root, own) == min(AFFINITY, 2)


def test_the_smallest_quota_on_the_way_to_the_root_counts(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "slice", {"cpu.max": "100000 100000"})
    _write(root / "slice" / "job", {"cpu.max": "400000 100000"})
    own = tmp_path / "self"
    own.write_text("0::/slice/job\n")
    assert cpu_quota(root, own) == 1.0 and usable_cpus(root, own) == 1


def test_a_container_sees_its_quota_at_its_own_root(tmp_path: Path) -> None:
    """Inside a cgroup namespace the path can name folders the container cannot see."""
    root = tmp_path / "cgroup"
    _write(root, {"cpu.max": "200000 100000"})
    own = tmp_path / "self"
    own.write_text("0::/../../kubepods/pod9\n")
    assert cpu_quota(root, own) == 2.0


def test_a_v1_cpu_controller_quota(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "cpu,cpuacct" / "docker" / "abc", {"cpu.cfs_quota_us": "50000",
                                                      "cpu.cfs_period_us": "100000"})
    _write(root / "cpu,cpuacct", {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"})
    own = tmp_path / "self"
    own.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cpu_quota(root, own) == 0.5
    assert usable_cpus(root, own) == 1  # half a CPU is still one thread's worth


def test_no_quota_leaves_the_affinity_mask(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root, {"cpu.max": "max 100000"})
    own = tmp_path / "self"
    own.write_text("0::/\n")
    assert cpu_quota(root, own) is None and usable_cpus(root, own) == AFFINITY
    # unreadable or odd files are no quota, never an error
    _write(root, {"cpu.max": "garbage"})
    assert cpu_quota(root, own) is None
    assert cpu_quota(root, tmp_path / "missing") is None
