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

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from popbert.errors import UsageError
from popbert.export.agreement import check_agreement
from popbert.serve.openvino_ir import INSTALL, IR_FILE, RT_INFO, compile_model, openvino, run

# BF16 keeps 8 significant bits (relative step 7.8e-3). OpenVINO runs the GEMMs, attention and
# GELU in BF16 with FP32 accumulation; over a dozen layers the logits of a model with outputs of
# O(1-10) move by about 1e-2 of their scale. A wrong or missing weight moves them by O(1).
BF16_TOLERANCE = 6e-2


def convert(onnx_model: Path) -> Any:
    """The ONNX file `onnx_model` as an OpenVINO model (`openvino.convert_model`), with the
    fused projections split (`split_fused_projections`) and the NaN guards after attention
    dropped (`drop_nan_guards`): the same function, in the form OpenVINO's CPU plugin runs
    fastest."""
    model = openvino().convert_model(str(onnx_model))
    split_fused_projections(model)
    drop_nan_guards(model)
    return model


def split_fused_projections(model: Any) -> int:
    """Replace each `Split(MatMul(x, W) [+ b])` into equal parts along the last axis (popbert's
    fused Q/K/V projection; ModernBERT's GeGLU input projection) by one MatMul (and bias) per
    part, on the matching slices of the constant `W` and `b`; returns how many were split.

    popbert fuses them for ONNX Runtime, which runs one wide GEMM faster than three. OpenVINO
    copies each part out of the wide output instead. With `drop_nan_guards`, INT8 calls at batch
    32 ran 1.03-1.08x faster on an AMD EPYC, batch 1 1.00-1.06x (benchmarks/openvino_rewrite.py,
    RESULTS_inference.md). The slices hold the same numbers, so the outputs do not change."""
    import openvino.opset13 as opset

    split_count = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Split":
            continue
        parts = len(op.outputs())
        axis = op.input_value(1).get_node()
        rank = op.get_output_partial_shape(0).rank
        if (axis.get_type_name() != "Constant" or not rank.is_static
                or int(axis.get_data()) % rank.get_length() != rank.get_length() - 1):
            continue
        source = op.input_value(0)
        bias = None
        if source.get_node().get_type_name() == "Add":
            add = source.get_node()
            constants = [i for i in range(2)
                         if add.input_value(i).get_node().get_type_name() == "Constant"]
            if len(constants) != 1 or len(add.output(0).get_target_inputs()) != 1:
                continue
            bias = add.input_value(constants[0]).get_node().get_data()
            source = add.input_value(1 - constants[0])
        matmul = source.get_node()
        if (matmul.get_type_name() != "MatMul" or len(source.get_target_inputs()) != 1
                or matmul.input_value(1).get_node().get_type_name() != "Constant"):
            continue
        weight = matmul.input_value(1).get_node().get_data()
        transpose_a = matmul.get_attributes()["transpose_a"]
        transpose_b = matmul.get_attributes()["transpose_b"]
        out_axis = 0 if transpose_b else weight.ndim - 1
        if weight.ndim != 2 or weight.shape[out_axis] % parts or (
                bias is not None and bias.shape[-1] != weight.shape[out_axis]):
            continue
        weights = np.split(weight, parts, axis=out_axis)
        biases = np.split(bias, parts, axis=-1) if bias is not None else [None] * parts
        for index, (part, part_bias) in enumerate(zip(weights, biases)):
            output = opset.matmul(matmul.input_value(0),
                                  opset.constant(np.ascontiguousarray(part)),
                                  transpose_a, transpose_b)
            output.set_friendly_name(f"{matmul.get_friendly_name()}/part{index}")
            if part_bias is not None:
                output = opset.add(output, opset.constant(np.ascontiguousarray(part_bias)))
            for target in list(op.output(index).get_target_inputs()):
                target.replace_source_output(output.output(0))
        split_count += 1
    if split_count:
        model.validate_nodes_and_infer_types()
    return split_count


def drop_nan_guards(model: Any) -> int:
    """Remove `Select(IsNaN(a), 0, a)` after every `ScaledDotProductAttention` whose mask is
    additive floats; returns how many were removed.

    OpenVINO's ONNX converter zeroes NaN attention outputs, which appear only when a query's
    every key is masked with -inf. popbert's masks add a finite -10000 (`MASK_VALUE` in the
    builders), so a row of masked keys averages them instead and the guard is dead, but it
    costs a pass over every layer's attention output and stands between the attention and the
    quantized output projection (with `split_fused_projections`: benchmarks/openvino_rewrite.py).
    """
    float_types = {"f32", "f16", "bf16"}
    dropped = 0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Select":
            continue
        guarded = op.input_value(2)
        check = op.input_value(0).get_node()
        attention = guarded.get_node()
        if (check.get_type_name() != "IsNaN" or check.input_value(0) != guarded
                or attention.get_type_name() != "ScaledDotProductAttention"
                or attention.get_input_size() < 4
                or attention.input_value(3).get_element_type().get_type_name()
                not in float_types):
            continue
        for target in list(op.output(0).get_target_inputs()):
            target.replace_source_output(guarded)
        dropped += 1
    if dropped:
        model.validate_nodes_and_infer_types()
    return dropped


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
    `BF16_TOLERANCE` at bf16, `int8_tolerance` relative RMS for INT8;
    `popbert.export.inference` passes its own ONNX checks' values)."""
    import onnx

    from popbert.atomic import atomic_directory, reported

    ov = openvino()
    model = convert(onnx_model)
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
    if calibration is not None:
        runtime, tolerance = "OpenVINO (INT8)", int8_tolerance
    else:
        runtime = f"OpenVINO ({precision})"
        tolerance = f32_tolerance if precision == "f32" else BF16_TOLERANCE
    worst = max(check_agreement(reference, run(compiled, batch), runtime, tolerance,
                                relative_rms=calibration is not None)
                for reference, batch in zip(references, batches))
    with reported(output), atomic_directory(output) as tmp:
        ov.save_model(model, str(tmp / IR_FILE), compress_to_fp16=False)
    return worst


__all__ = ["BF16_TOLERANCE", "convert", "drop_nan_guards", "quantize",
           "split_fused_projections", "write_ir"]
