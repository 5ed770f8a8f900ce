"""Reading and running an OpenVINO IR (`popbert predict`, `popbert serve`): the IR file of an
export's directory, the `popbert.*` metadata in its runtime info, and the model compiled for the
CPU at the precision it was verified at. The conversion that writes an IR is
`popbert.export.openvino`. OpenVINO is an optional extra (`pip install 'popbert[openvino]'`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from popbert.errors import UsageError

IR_FILE = "model.xml"
PRECISIONS = ("auto", "f32", "bf16")
RT_INFO = "popbert"  # the runtime-info section holding the metadata
INSTALL = "pip install 'popbert[openvino]'"


def openvino() -> Any:
    """The `openvino` module, or one line saying how to install it."""
    try:
        import openvino as ov
    except ImportError:
        raise UsageError(f"OpenVINO is not installed: {INSTALL}") from None
    return ov


def resolve_precision(precision: str) -> str:
    """`f32` or `bf16`: `auto` is BF16 where this CPU computes in it (AVX512-BF16, AMX)."""
    if precision not in PRECISIONS:
        raise UsageError(f"--precision: expected one of {', '.join(PRECISIONS)}, "
                         f"got {precision!r}")
    if precision != "auto":
        return precision
    capabilities = openvino().Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    return "bf16" if "BF16" in capabilities else "f32"


def is_ir(path: Path) -> bool:
    """Whether `path` names an OpenVINO IR: its directory, or its `.xml` file."""
    path = Path(path)
    return (path / IR_FILE).is_file() if path.is_dir() else path.suffix.lower() == ".xml"


def ir_file(path: Path) -> Path:
    path = Path(path)
    return path / IR_FILE if path.is_dir() else path


def metadata(model: Any) -> dict[str, str]:
    """The `popbert.*` metadata stored in an IR's runtime info."""
    if not model.has_rt_info([RT_INFO]):
        return {}
    section = model.get_rt_info([RT_INFO]).value
    return {f"{RT_INFO}.{key}": str(value) for key, value in section.items()}


def compile_model(model: Any, precision: str, threads: int | None = None) -> Any:
    """`model` compiled for the CPU at `precision` (`f32`/`bf16`) with `threads` threads,
    not pinned to cores: OpenVINO pins a process's threads from the first core on, whatever
    other processes run there, so two `popbert serve` workers of one thread each shared one
    core (4.6 s of wall time for 2.3 s of CPU each, on 2 cores); alone, pinning made no
    measurable difference."""
    ov = openvino()
    config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": precision,
                              "ENABLE_CPU_PINNING": False}
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    return ov.Core().compile_model(model, "CPU", config)


def run(compiled: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of `compiled` on `feeds`, by name."""
    result = compiled(dict(feeds))
    return {port.get_any_name(): np.asarray(result[port]) for port in compiled.outputs}


__all__ = ["INSTALL", "IR_FILE", "PRECISIONS", "RT_INFO", "compile_model", "ir_file", "is_ir",
           "metadata", "openvino", "resolve_precision", "run"]
