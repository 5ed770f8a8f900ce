"""The one rule for turning a device name into a ``torch.device``.

Configs, session options and pipeline device lists name devices by string ("auto", "cpu",
"cuda", "cuda:1"). Every place that needs the real device asks :func:`resolve_device`, so "auto"
means the same everywhere and a GPU that is not there is one line naming ``execution.device``
(before anything is written), not a CUDA traceback from deep inside the first step.
"""

from __future__ import annotations

import torch

from popbert.errors import ConfigError

__all__ = ["available_devices", "resolve_device"]


def available_devices() -> str:
    """What this machine offers, for error messages: "cpu" or "cpu, cuda:0..cuda:3"."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return "cpu only, no CUDA device"
    if count == 1:
        return "cpu, cuda:0"
    return f"cpu, cuda:0..cuda:{count - 1}"


def resolve_device(name: str | torch.device) -> torch.device:
    """``name`` as a device of this machine: "auto" is CUDA when present, else the CPU.

    A CUDA device that this machine lacks (no CUDA at all, or an index beyond
    ``torch.cuda.device_count()``) and a name torch does not know are a
    :class:`~popbert.errors.ConfigError` naming ``execution.device``, the value and what is
    available.
    """
    if isinstance(name, torch.device):
        device = name
    elif name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ConfigError(f"execution.device is {name!r}, which is not a device; expected "
                              f"auto, cpu, cuda or cuda:N (available: "
                              f"{available_devices()})") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index is not None and device.index >= count):
            raise ConfigError(f"execution.device is {str(name)!r} but this machine has no such "
                              f"device (available: {available_devices()})")
    return device
