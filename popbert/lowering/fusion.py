"""The MatMul + Add -> ``F.linear`` fusion: which ONNX node pairs fuse, and the call they become.

BERT's dense layers are ``MatMul(x, W) + b`` in ONNX; one ``F.linear`` runs them as a single
GEMM with the bias added in its epilogue. Deciding which pairs fuse needs the whole ONNX graph
(who consumes the MatMul's output) and the lowering's static information, not one node, so it is
a pass of its own: the lowerer (:mod:`popbert.lowering.lower`) runs :func:`find_linear_fusions`
before converting, skips the fused MatMuls and lowers their Add with :func:`emit_fused_linear`
instead of the Add converter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import onnx
import torch
import torch.nn.functional as F
from torch import nn

from popbert.lowering.context import STANDARD_DOMAINS, NodeContext, ValueInfo

__all__ = ["emit_fused_linear", "find_linear_fusions"]


def find_linear_fusions(
    nodes: Sequence[onnx.NodeProto],
    *,
    use_count: Mapping[str, int],
    params: Mapping[str, nn.Parameter],
    value_info: Mapping[str, ValueInfo],
) -> dict[int, int]:
    """Map Add-node index -> MatMul-node index for the ``MatMul(x, W) + b`` pairs to fuse.

    A pair fuses when the Add is the MatMul's only consumer, ``b`` is a 1-D parameter, ``W`` is
    2-D with a known shape matching ``b`` (a parameter, or e.g. the tied MLM projection's
    Transpose of the embedding) and both nodes carry the same annotations, so the fused node
    stays on one device and stage.

    Args:
        nodes: the ONNX graph's nodes, in graph order (the indices refer to it).
        use_count: how many nodes (or graph outputs) read each tensor.
        params: the float initializers, by ONNX name.
        value_info: the static shapes and dtypes from shape inference.
    """
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    pairs: dict[int, int] = {}
    for j, add in enumerate(nodes):
        if add.op_type != "Add" or add.domain not in STANDARD_DOMAINS or len(add.input) != 2:
            continue
        for mm_pos in (0, 1):
            mm_out, bias = add.input[mm_pos], add.input[1 - mm_pos]
            i = producer.get(mm_out)
            if i is None or use_count.get(mm_out, 0) != 1:
                continue
            mm = nodes[i]
            if mm.op_type != "MatMul" or mm.domain not in STANDARD_DOMAINS:
                continue
            # W: a 2-D parameter, or any 2-D value of known shape (e.g. the tied MLM
            # projection's Transpose of the embedding); b: a 1-D parameter.
            b = params.get(bias)
            w = params.get(mm.input[1])
            w_shape, w_dtype = (
                (tuple(w.shape), w.dtype)
                if w is not None
                else value_info.get(mm.input[1], (None, None))
            )
            if b is None or b.dim() != 1 or w_shape is None or len(w_shape) != 2:
                continue
            if w_shape[1] != b.shape[0] or w_dtype != b.dtype:
                continue
            ann = sorted((a.name, a.SerializeToString()) for a in mm.attribute)
            ann_add = sorted((a.name, a.SerializeToString()) for a in add.attribute)
            if ann != ann_add:
                continue
            pairs[j] = i
            break
    return pairs


def emit_fused_linear(ctx: NodeContext, matmul: onnx.NodeProto) -> Any:
    """Lower the Add node of ``ctx`` together with its input ``matmul`` as one ``F.linear``.

    ``MatMul(x, W[in, out]) + b`` becomes ``F.linear(x, W.t(), b)`` (bias fused into the GEMM
    epilogue); the fx node's ``meta["onnx"]["fused"]`` names the MatMul, so both ONNX nodes stay
    traceable.
    """
    mm_pos = 0 if ctx.node.input[0] == matmul.output[0] else 1
    bias = ctx.inputs[1 - mm_pos]
    x = ctx.lookup(matmul.input[0])
    weight = ctx.lookup(matmul.input[1])
    ctx.meta["fused"] = [
        {"op_type": matmul.op_type, "name": matmul.name, "outputs": list(matmul.output)}
    ]
    w_t = ctx.call(torch.t, weight)
    return ctx.call(F.linear, x, w_t, bias)
