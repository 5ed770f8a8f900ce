"""OpenVINO IR export: popbert's verified FP32 ONNX export, converted by OpenVINO's own
converter into `model.xml` + `model.bin`, and verified again against the torch backend.

Why a second runtime: ONNX Runtime's CPU provider has no BF16 arithmetic and leaves everything
outside its GEMMs in FP32, while OpenVINO's CPU plugin fuses bias, GELU, residual and LayerNorm
into its kernels and runs BF16 where the CPU has it (AVX512-BF16, AMX). OpenVINO cannot read the
contrib operators of popbert's INT8 ONNX file, so the IR is converted from the plain FP32 graph.

The IR stores the same `popbert.*` metadata as the ONNX exports (task, vocabulary, labels, window
sizes), in its runtime info, and the precision to run at (`popbert.precision`: `f32` or `bf16`,
OpenVINO's inference precision hint), so `popbert predict` serves it as it was verified.
OpenVINO is an optional extra (`pip install 'popbert[openvino]'`); training never needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from popbert.errors import UsageError

log = logging.getLogger(__name__)

IR_FILE = "model.xml"
RUNTIMES = ("onnxruntime", "openvino")
PRECISIONS = ("auto", "f32", "bf16")
RT_INFO = "popbert"  # the runtime-info section holding the metadata
# BF16 keeps 8 significant bits (relative step 7.8e-3). OpenVINO runs the GEMMs, attention and
# GELU in BF16 with FP32 accumulation; over a dozen layers the logits of a model with outputs of
# O(1-10) move by about 1e-2 of their scale. A wrong or missing weight moves them by O(1).
BF16_TOLERANCE = 6e-2
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
    """`model` compiled for the CPU at `precision` (`f32`/`bf16`) with `threads` threads."""
    ov = openvino()
    config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": precision}
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    return ov.Core().compile_model(model, "CPU", config)


def run(compiled: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of `compiled` on `feeds`, by name."""
    result = compiled(dict(feeds))
    return {port.get_any_name(): np.asarray(result[port]) for port in compiled.outputs}


def quantize(model: Any, calibration: list[Mapping[str, np.ndarray]]) -> Any:
    """`model` with static INT8 weights and activations by NNCF's post-training quantization
    (its transformer preset, SmoothQuant as NNCF chooses), its ranges calibrated on the rows of
    `calibration`."""
    try:
        import nncf
    except ImportError:
        raise UsageError(f"--quantize int8 with --runtime openvino needs NNCF: {INSTALL}"
                         ) from None
    return nncf.quantize(model, nncf.Dataset(list(calibration)),
                         model_type=nncf.ModelType.TRANSFORMER, subset_size=len(calibration))


def write_ir(onnx_model: Path, output: Path, precision: str,
             batches: list[Mapping[str, np.ndarray]],
             references: list[Mapping[str, np.ndarray]],
             calibration: list[Mapping[str, np.ndarray]] | None = None, *,
             f32_tolerance: float = 1e-4, int8_tolerance: float = 0.5) -> float:
    """Convert the verified ONNX file `onnx_model` to an IR directory `output` (written whole),
    INT8 by `quantize` when `calibration` rows are given, store its metadata and `precision`,
    and check it on `batches` against the torch backend's `references`; returns the largest
    difference (RuntimeError beyond the tolerance: `f32_tolerance` of the largest output at f32,
    `BF16_TOLERANCE` at bf16, `int8_tolerance` relative RMS for INT8; `popbert.io.export` passes
    its own ONNX checks' values)."""
    import onnx

    from popbert.atomic import atomic_directory, reported

    ov = openvino()
    model = ov.convert_model(str(onnx_model))
    if calibration is not None:
        model = quantize(model, calibration)
    props = {p.key: p.value for p in onnx.load(str(onnx_model), load_external_data=False)
             .metadata_props}
    props[f"{RT_INFO}.precision"] = precision
    if calibration is not None:
        props[f"{RT_INFO}.quantized"] = f"int8 (NNCF, {len(calibration)} calibration rows)"
    for key, value in props.items():
        if key.startswith(f"{RT_INFO}."):
            model.set_rt_info(value, [RT_INFO, key.split(".", 1)[1]])
    compiled = compile_model(model, precision)
    if calibration is None:
        def measure(reference, outputs):
            return _compare(reference, outputs, precision, f32_tolerance)
    else:
        def measure(reference, outputs):
            return _compare_int8(reference, outputs, int8_tolerance)
    worst = max(measure(reference, run(compiled, batch))
                for reference, batch in zip(references, batches))
    with reported(output), atomic_directory(output) as tmp:
        ov.save_model(model, str(tmp / IR_FILE), compress_to_fp16=False)
    return worst


def _compare(reference: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray],
             precision: str, f32_tolerance: float) -> float:
    worst = 0.0
    for name, expected in reference.items():
        difference = float(np.abs(expected - theirs[name]).max())
        scale = max(1.0, float(np.abs(expected).max()))
        allowed = (f32_tolerance if precision == "f32" else BF16_TOLERANCE) * scale
        worst = max(worst, difference / scale)
        if not difference <= allowed:
            raise RuntimeError(f"export check failed: output {name!r} differs between OpenVINO "
                               f"({precision}) and the torch backend by {difference:.3g} "
                               f"(> {allowed:.3g})")
    return worst


def _compare_int8(reference: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray],
                  tolerance: float) -> float:
    """Static INT8 moves each output by a share of its size, as ONNX Runtime's INT8 export does
    (RMS difference over the output's RMS, at most `tolerance`)."""
    worst = 0.0
    for name, expected in reference.items():
        rms = float(np.sqrt(np.mean(np.square(expected, dtype=np.float64))))
        difference = float(np.sqrt(np.mean(np.square(expected - theirs[name],
                                                      dtype=np.float64)))) / max(1.0, rms)
        worst = max(worst, difference)
        if not difference <= tolerance:
            raise RuntimeError(f"export check failed: output {name!r} of the INT8 IR differs "
                               f"from the torch backend by {difference:.3g} relative RMS "
                               f"(> {tolerance})")
    return worst


__all__ = ["BF16_TOLERANCE", "INSTALL", "IR_FILE", "PRECISIONS", "RUNTIMES", "compile_model",
           "ir_file", "is_ir", "metadata", "openvino", "quantize", "resolve_precision", "run",
           "write_ir"]
