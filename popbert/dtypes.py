"""The floating-point formats a run may store weights and compute in: the one table of them,
and the one rule for when weight updates are stochastically rounded.

Config values (`execution.weight_dtype`, `execution.compute_dtype`) and `SessionOptions` name a
format by string; :func:`torch_dtype` gives the tensor type. torch is imported only when asked,
so reading a config stays light.
"""

from __future__ import annotations

from typing import Any

FLOAT_FORMATS = ("float32", "float16", "bfloat16")
HALF_FORMATS = ("float16", "bfloat16")


def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` of a format name from :data:`FLOAT_FORMATS`."""
    if name not in FLOAT_FORMATS:
        raise ValueError(f"unknown floating-point format {name!r}; expected one of "
                         f"{', '.join(FLOAT_FORMATS)}")
    import torch

    return getattr(torch, name)


def is_half(weights: Any) -> bool:
    """Whether a format (a name of :data:`FLOAT_FORMATS`, or a ``torch.dtype``) is half."""
    return str(weights).removeprefix("torch.") in HALF_FORMATS


def rounds_stochastically(setting: bool | None, weights: Any) -> bool:
    """Whether updates of weights in format ``weights`` (a name or a ``torch.dtype``) are
    stochastically rounded: as ``setting`` says, or, when it is None, exactly when the weights are
    half precision (`execution.stochastic_rounding`, an optimizer group's `stochastic_rounding`)."""
    return is_half(weights) if setting is None else bool(setting)
