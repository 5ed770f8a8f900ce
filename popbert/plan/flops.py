"""Training FLOPs of a graph, counted from its matmuls and convolutions: what MFU divides.

The convention of Kaplan et al. 2020 and of MLPerf/Megatron MFU figures: 2·M·N·K per matmul, a
training step 3× the forward pass, other ops not counted. The convention in full, and what it
gives for BERT: docs/design.md, section "popbert.plan.flops".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from popbert.plan.shapes import TensorShape, infer_tensor_shapes

__all__ = ["BACKWARD_FACTOR", "forward_flops_by_node", "graph_batch_size",
           "training_flops_per_sequence"]

# Training FLOPs = forward FLOPs × this (forward + backward's two matmuls per forward matmul).
BACKWARD_FACTOR = 3

COUNTED_OPS = ("MatMul", "Gemm", "Attention", "Conv")


def _dims(shapes: dict[str, TensorShape], name: str) -> tuple[int, ...] | None:
    s = shapes.get(name)
    return None if s is None else s.shape


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(onnx.helper.get_attribute_value(a))
    return default


def node_forward_flops(node: onnx.NodeProto, shapes: dict[str, TensorShape]) -> int:
    """Forward FLOPs of one node (0 for ops that are not matmuls or convolutions); raises
    ValueError when a counted op's shapes are unknown, since silently counting 0 would make MFU
    meaningless."""
    if node.op_type not in COUNTED_OPS:
        return 0
    if node.op_type == "Conv":
        weight, out = _dims(shapes, node.input[1]), _dims(shapes, node.output[0])
        if weight is None or out is None or len(weight) < 3:
            raise ValueError(f"Conv {node.name!r}: shapes unknown, cannot count its FLOPs")
        # Each output element is a dot product over (input channels of its group) × kernel.
        return 2 * int(np.prod(out, dtype=np.int64)) * int(np.prod(weight[1:], dtype=np.int64))
    if node.op_type == "MatMul":
        a, out = _dims(shapes, node.input[0]), _dims(shapes, node.output[0])
        if a is None or out is None or not a:
            raise ValueError(f"MatMul {node.name!r}: shapes unknown, cannot count its FLOPs")
        return 2 * int(np.prod(out, dtype=np.int64)) * int(a[-1])
    if node.op_type == "Gemm":
        a, out = _dims(shapes, node.input[0]), _dims(shapes, node.output[0])
        if a is None or out is None or len(a) != 2:
            raise ValueError(f"Gemm {node.name!r}: shapes unknown, cannot count its FLOPs")
        k = a[0] if _attr(node, "transA", 0) else a[1]
        return 2 * int(np.prod(out, dtype=np.int64)) * int(k)
    q, k, v = (_dims(shapes, node.input[i]) for i in range(3))
    if q is None or k is None or v is None or len(q) not in (3, 4):
        raise ValueError(f"Attention {node.name!r}: shapes unknown, cannot count its FLOPs")
    if len(q) == 3:  # [B, S, heads·d]: the head split does not change the count
        batch, s_q, qk_width = q[0], q[1], q[2]
        s_kv, v_width = k[1], v[2]
    else:  # [B, heads, S, d]
        batch, s_q, qk_width = q[0], q[2], q[1] * q[3]
        s_kv, v_width = k[2], v[1] * v[3]
    return 2 * batch * s_q * s_kv * (qk_width + v_width)


def graph_batch_size(model: onnx.ModelProto) -> int:
    """The batch the graph was built for: the first graph input's first dimension (1 when it is
    symbolic, since shapes are then inferred at batch 1)."""
    for vi in model.graph.input:
        dims = vi.type.tensor_type.shape.dim
        if dims:
            return int(dims[0].dim_value) if dims[0].HasField("dim_value") else 1
    return 1


def forward_flops_by_node(model: onnx.ModelProto,
                          shapes: dict[str, TensorShape] | None = None) -> list[int]:
    """Forward FLOPs of each node of the graph at the graph's own batch size (symbolic: 1)."""
    if shapes is None:
        shapes = infer_tensor_shapes(model, graph_batch_size(model))
    return [node_forward_flops(node, shapes) for node in model.graph.node]


def training_flops_per_sequence(model: onnx.ModelProto,
                                flops_by_node: Sequence[int] | None = None) -> int:
    """Training FLOPs (forward + backward) per sequence of a training graph.

    3 × the forward matmul FLOPs (2·M·N·K each, attention score and context matmuls included)
    divided by the graph's batch size; see the module docstring for the convention. For BERT
    pre-training this is the number MFU divides: achieved = this × sequences/s, over the
    device's peak FLOP/s.
    """
    if flops_by_node is None:
        flops_by_node = forward_flops_by_node(model)
    total = BACKWARD_FACTOR * sum(flops_by_node)
    batch = graph_batch_size(model)
    return total // batch if total % batch == 0 else round(total / batch)
