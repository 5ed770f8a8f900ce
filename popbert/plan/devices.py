"""The memory of the devices a plan can be checked against.

Capacities are the vendors' figures in decimal units (1 GB = 10⁹ bytes), which for the GPUs is
slightly less than what the card holds (an "80 GB" H100 has 80 GiB = 85.9·10⁹ bytes), a margin
for the CUDA context and the allocator's fragmentation that the plan does not model. The IPU's
figure is exact: the Mk2 GC200 has 1472 tiles of 624 KiB of SRAM (Graphcore quotes "900 MB"
In-Processor-Memory per IPU); the compiled program's code and exchange buffers also live there,
which a compile-only check on the real SDK would report and this plan cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

from popbert.errors import UsageError

__all__ = ["DEVICES", "Device", "custom_device", "device_named"]


@dataclass(frozen=True)
class Device:
    """A device's memory per chip, and its kind (what the optimizer step and dropout keep
    depends on it: ``gpu`` and ``ipu`` run whole-tensor optimizer steps, ``cpu`` tiles them)."""

    name: str
    description: str
    memory_bytes: int
    kind: str  # "ipu" | "gpu" | "cpu", or "" for the config's execution.device


IPU_MK2_TILES = 1472
IPU_MK2_TILE_BYTES = 624 * 1024

DEVICES: dict[str, Device] = {
    "ipu-mk2": Device("ipu-mk2", "Graphcore Mk2 IPU (GC200): 1472 tiles x 624 KiB "
                      "In-Processor-Memory", IPU_MK2_TILES * IPU_MK2_TILE_BYTES, "ipu"),
    "h100": Device("h100", "NVIDIA H100 80GB", 80 * 10**9, "gpu"),
    "a100-40gb": Device("a100-40gb", "NVIDIA A100 40GB", 40 * 10**9, "gpu"),
    "a100-80gb": Device("a100-80gb", "NVIDIA A100 80GB", 80 * 10**9, "gpu"),
}


def device_named(name: str) -> Device:
    """The device called ``name`` (case-insensitive); a UsageError lists the known names."""
    device = DEVICES.get(name.strip().lower())
    if device is None:
        raise UsageError(f"--device {name!r}: unknown device; expected one of "
                         f"{', '.join(DEVICES)} (or give --memory-gb)")
    return device


def custom_device(memory_gb: float, kind: str = "") -> Device:
    """A device with ``memory_gb`` × 10⁹ bytes (``--memory-gb``); its kind defaults to the
    config's ``execution.device`` (cpu, else a GPU)."""
    if not memory_gb > 0 or memory_gb != memory_gb or memory_gb == float("inf"):
        raise UsageError(f"--memory-gb must be a positive number, got {memory_gb}")
    return Device(f"{memory_gb:g} GB", f"{memory_gb:g} GB (--memory-gb)",
                  int(round(memory_gb * 10**9)), kind)
