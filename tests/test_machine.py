"""`popbert.machine`: the CPUs and memory a process may use, from cgroup files laid out as
the kernel writes them (v2's unified tree, v1's controllers, a container's view of its own
root)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from popbert.machine import available_memory, cpu_quota, quota_threads, usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


def _write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text + "\n")


def test_a_v2_quota_bounds_the_count_rounded_down(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root / "kubepods" / "pod1", {"cpu.max": "250000 100000"})  # limits.cpu: 2.5
    _write(root / "kubepods", {"cpu.max": "max 100000"})
    own = tmp_path / "self"
    own.write_text("0::/kubepods/pod1\n")
    assert cpu_quota(root, own) == 2.5
    assert usable_cpus(root, own) == min(AFFINITY, 2)  # a third thread would be throttled


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


def test_quota_threads_split_between_processes(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _write(root, {"cpu.max": "400000 100000"})
    own = tmp_path / "self"
    own.write_text("0::/\n")
    assert quota_threads(1, root, own) == min(AFFINITY, 4)
    assert quota_threads(2, root, own) == max(1, min(AFFINITY, 4) // 2)
    _write(root, {"cpu.max": "max 100000"})
    assert quota_threads(2, root, own) is None  # no quota: the runtime's default stands


def test_training_sizes_torch_to_the_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch counts the machine's cores; under a container's quota the trainer lowers its
    threads to the quota's share (torchrun's processes split it), never raises them."""
    import torch

    from popbert.train import trainer

    before = torch.get_num_threads()
    calls: list[int] = []
    monkeypatch.setattr(trainer, "quota_threads", lambda processes: calls.append(processes) or 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    try:
        trainer._threads_within_quota()
        assert calls == [2] and torch.get_num_threads() == 1
        monkeypatch.setattr(trainer, "quota_threads", lambda processes: None)
        torch.set_num_threads(before)
        trainer._threads_within_quota()
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_available_memory_is_the_kernels_within_the_cgroups_limit(tmp_path: Path) -> None:
    gib = 2**30
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {64 * gib // 1024} kB\nMemAvailable: {8 * gib // 1024} kB\n")
    root = tmp_path / "cgroup"
    _write(root / "pod", {"memory.max": str(2 * gib), "memory.current": str(gib // 2)})
    own = tmp_path / "self"
    own.write_text("0::/pod\n")
    assert available_memory(root, own, meminfo) == 3 * gib // 2  # limits.memory: 2Gi, 0.5 used
    _write(root / "pod", {"memory.max": "max"})
    assert available_memory(root, own, meminfo) == 8 * gib  # no limit: the kernel's figure
    # cgroup v1 writes "no limit" as a huge number
    v1 = tmp_path / "v1"
    _write(v1 / "memory" / "docker" / "c1", {"memory.limit_in_bytes": "9223372036854771712",
                                             "memory.usage_in_bytes": "123"})
    own.write_text("4:memory:/docker/c1\n")
    assert available_memory(v1, own, meminfo) == 8 * gib
    _write(v1 / "memory" / "docker" / "c1", {"memory.limit_in_bytes": str(gib)})
    assert available_memory(v1, own, meminfo) == gib - 123
    assert available_memory(v1, tmp_path / "missing", tmp_path / "none") is None
