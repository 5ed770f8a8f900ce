"""Unit tests of `popbert.Builder`: op helpers, context managers, annotations, build-time errors."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from popbert.graph.annotations import (
    AVAILABLE_MEMORY,
    IPU_NUMBER,
    PIPELINE_STAGE,
    RECOMPUTE,
    SERIALIZE_FACTOR,
    SERIALIZE_MODE,
    constant_initializers,
    strip_annotations,
    trainable_initializers,
)
from popbert.graph.builder import Builder, BuilderError, TensorInfo


def attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def producer(model: onnx.ModelProto, tensor: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if tensor in n.output)


def run_ort(builder: Builder, feeds: dict) -> list[np.ndarray]:
    model = strip_annotations(builder.getModel())
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString()).run(None, feeds)


def test_matmul_add_gelu_layernorm_run_in_onnx_runtime() -> None:
    b = Builder()
    x = b.addInputTensor(TensorInfo("FLOAT", ["batch", 4]), "x")
    w = b.addInitializedInputTensor(np.eye(4, 3, dtype=np.float32), "W")
    bias = b.addInitializedInputTensor(np.ones(3, np.float32), "B")
    y = b.aiOnnx.add([b.aiOnnx.matmul([x, w]), bias])
    g = b.aiOnnx.gelu([y])
    gamma = b.addInitializedInputTensor(np.ones(3, np.float32), "Gamma")
    beta = b.addInitializedInputTensor(np.zeros(3, np.float32), "Beta")
    out = b.aiOnnx.layernormalization([g, gamma, beta], axis=-1, epsilon=1e-5)
    b.addOutputTensor(out)
    assert b.getTensorShape(out) == ["batch", 3]
    data = np.arange(8, dtype=np.float32).reshape(2, 4)
    (result,) = run_ort(b, {"x": data})
    from math import erf, sqrt

    h = data[:, :3] + 1
    h = h * 0.5 * (1 + np.vectorize(erf)(h / sqrt(2)))
    expected = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(result, expected, atol=1e-5)


def test_split_returns_one_name_per_output_and_getModelProto_is_bytes() -> None:
    b = Builder()
    x = b.addInputTensor(TensorInfo("FLOAT", [2, 6]), "x")
    parts = b.aiOnnx.split([x], axis=1, num_outputs=3)
    assert len(parts) == 3 and all(b.getTensorShape(p) == [2, 2] for p in parts)
    for p in parts:
        b.addOutputTensor(p)
    raw = b.getModelProto()
    assert isinstance(raw, bytes)
    assert len(onnx.load_from_string(raw).graph.output) == 3


def test_name_scopes_nest_and_prefix_tensor_names() -> None:
    b = Builder()
    with b.nameScope("Layer3"), b.nameScope("Attention"):
        w = b.addInitializedInputTensor(np.zeros((2, 2), np.float32), "QKV")
        t = b.aiOnnx.relu([w], "Act")
    with b.nameScope("Layer3"):
        u = b.aiOnnx.relu([t], "Act")
    assert w == "Layer3/Attention/QKV"
    assert t == "Layer3/Attention/Act"
    assert u == "Layer3/Act"
    # Names stay unique even when the same debug name is reused.
    with b.nameScope("Layer3"):
        assert b.aiOnnx.relu([t], "Act") != u


def test_virtual_graph_and_pipeline_stage_contexts_annotate_and_nest() -> None:
    b = Builder()
    x = b.addInputTensor(TensorInfo("FLOAT", [2]), "x")
    with b.virtualGraph(0), b.pipelineStage(0):
        a = b.aiOnnx.relu([x])
        with b.virtualGraph(2), b.pipelineStage(1):
            c = b.aiOnnx.neg([a])
        d = b.aiOnnx.abs([a])
    e = b.aiOnnx.sigmoid([d])
    b.addOutputTensor(e)
    b.addOutputTensor(c)
    model = b.getModel()
    assert attrs(producer(model, a)) == {IPU_NUMBER: 0, PIPELINE_STAGE: 0}
    assert attrs(producer(model, c)) == {IPU_NUMBER: 2, PIPELINE_STAGE: 1}
    assert attrs(producer(model, d)) == {IPU_NUMBER: 0, PIPELINE_STAGE: 0}
    assert attrs(producer(model, e)) == {}
    # The setter form annotates an existing tensor's producer.
    b.virtualGraph(e, 3)
    b.pipelineStage(e, 2)
    assert attrs(producer(b.getModel(), e)) == {IPU_NUMBER: 3, PIPELINE_STAGE: 2}


def test_checkpoint_recompute_memory_and_serialise_annotations() -> None:
    b = Builder()
    x = b.addInputTensor(TensorInfo("FLOAT", [2, 4]), "x")
    w = b.addInitializedInputTensor(np.ones((4, 4), np.float32), "W")
    y = b.aiOnnx.matmul([x, w], "MM")
    (kept,) = b.checkpointOutput([y])
    z = b.aiOnnx.relu([kept])
    b.recomputeOutputInBackwardPass(z)
    b.setAvailableMemoryProportion(y, 0.3)
    b.setSerializeMatMul({y}, "output_channels", 5)
    b.addOutputTensor(z)
    model = b.getModel()
    checkpoint = producer(model, kept)
    assert checkpoint.op_type == "Identity" and attrs(checkpoint)[RECOMPUTE] == 1
    assert attrs(producer(model, z))[RECOMPUTE] == 2
    mm = attrs(producer(model, y))
    assert mm[AVAILABLE_MEMORY] == pytest.approx(0.3)
    assert mm[SERIALIZE_MODE] == b"output_channels" and mm[SERIALIZE_FACTOR] == 5
    onnx.checker.check_model(model, full_check=True)
    # Annotated graphs still compute the same thing in ONNX Runtime once stripped.
    (out,) = run_ort(b, {"x": np.ones((2, 4), np.float32)})
    np.testing.assert_allclose(out, np.full((2, 4), 4.0))


def test_constants_are_frozen_initializers_not_weights() -> None:
    b = Builder()
    x = b.addInputTensor(TensorInfo("FLOAT", [2, 3]), "x")
    w = b.addInitializedInputTensor(np.ones(3, np.float32), "W")
    shape = b.addConstant(np.array([3, 2], np.int64), "shape")
    half = b.addConstant(np.array(0.5, np.float32), "half")
    y = b.aiOnnx.reshape([b.aiOnnx.mul([b.aiOnnx.mul([x, w]), half]), shape])
    b.addOutputTensor(y)
    assert b.getTensorShape(y) == [3, 2]
    model = b.getModel()
    assert constant_initializers(model) == {shape, half}
    assert trainable_initializers(model) == [w]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda b, x: b.aiOnnx.notanop([x]), "aiOnnx.notanop"),
        (lambda b, x: b.aiGraphcore.notanop([x]), "aiGraphcore.notanop"),
        (lambda b, x: b.aiOnnx.add([x]), "expected 2..2 inputs, got 1"),
        (lambda b, x: b.aiOnnx.relu(["ghost"]), "'ghost' is not in the graph"),
        (lambda b, x: b.aiOnnx.softmax([x], axes=1), "unknown attribute"),
        (
            lambda b, x: b.aiOnnx.add([x, b.addInitializedInputTensor(np.ones((5,), np.float32))]),
            "Add",
        ),
        (lambda b, x: b.aiOnnx.split([x], axis=0), "num_outputs"),
        (lambda b, x: b.setAvailableMemoryProportion(x, 0.5), "graph input"),
        (lambda b, x: b.setAvailableMemoryProportion(b.aiOnnx.relu([x]), 1.5), "proportion"),
        (
            lambda b, x: b.setSerializeMatMul([b.aiOnnx.relu([x])], "output_channels", 2),
            "not MatMul",
        ),
    ],
)
def test_misuse_fails_at_build_time_naming_op_or_tensor(call, message) -> None:
    b = Builder()
    x = b.addInputTensor(TensorInfo("FLOAT", [2, 3]), "x")
    with pytest.raises(BuilderError, match=message):
        call(b, x)


def test_pipeline_stage_going_backwards_is_rejected() -> None:
    b = Builder()
    x = b.addInputTensor(TensorInfo("FLOAT", [2]), "x")
    with b.pipelineStage(2):
        late = b.aiOnnx.relu([x], "Late")
    with b.pipelineStage(1), pytest.raises(BuilderError, match="stage goes backwards.*Late"):
        b.aiOnnx.neg([late])


def test_graphcore_dialect_ops() -> None:
    b = Builder(dialect="popart")
    assert b.opset == 11
    x = b.addInputTensor(TensorInfo("FLOAT", [4, 8]), "x")
    gamma = b.addInitializedInputTensor(np.ones(8, np.float32), "Gamma")
    beta = b.addInitializedInputTensor(np.zeros(8, np.float32), "Beta")
    y, mean, inv_std = b.aiGraphcore.groupnormalization(
        [x, gamma, beta], num_groups=1, epsilon=1e-3
    )
    g = b.aiGraphcore.gelu([y])
    b.addOutputTensor(g)
    assert b.getTensorShape(g) == [4, 8] and b.getTensorShape(mean) == [4]
    model = b.getModel()
    assert {o.domain: o.version for o in model.opset_import} == {"": 11, "ai.graphcore": 1}
    assert producer(model, g).domain == "ai.graphcore"


def test_model_without_outputs_is_an_error() -> None:
    b = Builder()
    b.addInputTensor(TensorInfo("FLOAT", [1]), "x")
    with pytest.raises(BuilderError, match="no outputs"):
        b.getModel()
