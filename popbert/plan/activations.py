"""Activation memory of one micro-batch, read off the graph: what autograd keeps, region by region.

Per op, a rule of what torch's autograd keeps for the backward pass (:data:`SAVES`; an op without
a rule is over-estimated, never under-estimated), summed per recompute region as the runtime
forms them. The model, the backward pass's peak and recomputation: docs/design.md, section
"popbert.plan.activations".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto

from popbert.graph.annotations import (
    RECOMPUTE,
    RecomputeType,
    node_annotation,
    trainable_initializers,
)
from popbert.plan.shapes import TensorShape

__all__ = ["ActivationModel", "PeakActivations", "Precision", "RegionMemory", "SAVES",
           "activation_model", "peak_of_regions", "region_keys"]

FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)

# Ops whose outputs are views of their first input (torch returns views for them; the lowering
# turns a Slice with constant bounds, as ModernBERT's rotary halves, into basic indexing).
VIEW_OPS = frozenset({"Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten",
                      "Split", "Slice", "Expand", "Detach"})
# Ops that keep nothing for the backward pass, or whose outputs carry no gradient.
KEEPS_NOTHING = frozenset({"Add", "Sub", "Neg", "Concat", "Cast", "ReduceSum", "ReduceMean",
                           "Gather", "GatherND", "Where", "Equal", "Not", "And", "Or", "Greater",
                           "Less", "ArgMax", "ArgMin", "Shape", "Max", "Min", "Scale"})
NO_GRADIENT = frozenset({"Equal", "Not", "And", "Or", "Greater", "Less", "ArgMax", "ArgMin",
                         "Shape", "Detach"})

# Suffix of the storage name of the contiguous copy torch.matmul makes of a permuted operand.
CONTIGUOUS_COPY = "#contiguous"

# What an op keeps: a function of (node, needs_grad of its inputs) -> [("in"|"out", index)] and
# extra bytes-per-output-element (statistics) handled below. Only activations are charged.
Saved = list[tuple[str, int]]


def _matmul(node: onnx.NodeProto, grads: Sequence[bool]) -> Saved:
    # d(a@b)/da needs b and d/db needs a: each input is kept when the *other* needs a gradient.
    kept = []
    if len(grads) > 1 and grads[1]:
        kept.append(("in", 0))
    if grads and grads[0]:
        kept.append(("in", 1))
    return kept


def _input0(node: onnx.NodeProto, grads: Sequence[bool]) -> Saved:
    return [("in", 0)]


def _output0(node: onnx.NodeProto, grads: Sequence[bool]) -> Saved:
    return [("out", 0)]


def _div(node: onnx.NodeProto, grads: Sequence[bool]) -> Saved:
    return [("in", 1)] + ([("out", 0)] if len(grads) > 1 and grads[1] else [])


def _attention(node: onnx.NodeProto, grads: Sequence[bool]) -> Saved:
    # scaled_dot_product_attention keeps q, k, v, the mask, the output (and a small logsumexp).
    return [("in", 0), ("in", 1), ("in", 2), ("in", 3), ("out", 0)]


SAVES: dict[str, Callable[[onnx.NodeProto, Sequence[bool]], Saved]] = {
    "MatMul": _matmul, "Gemm": _matmul, "Mul": _matmul, "Div": _div,
    "LayerNormalization": _input0, "GroupNormalization": _input0, "Gelu": _input0,
    "GeluErf": _input0, "Erf": _input0, "Relu": _output0, "Softmax": _output0,
    "LogSoftmax": _output0, "Tanh": _output0, "Sigmoid": _output0, "Exp": _output0,
    "Attention": _attention,
    # Nll (ai.graphcore) reads the probabilities Softmax already keeps.
    "Nll": lambda node, grads: [("in", 0)],
}


@dataclass
class RegionMemory:
    """Bytes of one recompute region for one micro-batch."""

    stage: int
    region: int
    kept: set[str] = field(default_factory=set)  # storages kept for backward (view bases)
    inputs: set[str] = field(default_factory=set)  # activations read from outside the region
    produced: set[str] = field(default_factory=set)  # activations its nodes produce
    extra_bytes: int = 0  # statistics and masks that are no graph tensor (LayerNorm, Dropout)
    largest: int = 0  # bytes of the largest activation it produces
    recomputed: bool = False


@dataclass
class ActivationModel:
    """The graph's activations: tensor sizes, view bases and the regions of each stage."""

    nbytes: dict[str, int]
    base: dict[str, str]
    regions: list[RegionMemory]
    graph_inputs: set[str]
    graph_outputs: set[str]

    def bytes_of(self, names: set[str]) -> int:
        """Bytes of the distinct storages behind ``names``."""
        return sum(self.nbytes.get(b, 0) for b in {self.base.get(n, n) for n in names})


def region_keys(model: onnx.ModelProto, stage_of: Sequence[int]) -> list[tuple[int, int]]:
    """(stage, region) of each node: checkpoints close a region within their stage (the rule
    of ``popbert.runtime.partition._assign_regions``)."""
    counter: dict[int, int] = {}
    keys = []
    for node, stage in zip(model.graph.node, stage_of):
        region = counter.get(stage, 0)
        keys.append((stage, region))
        value = node_annotation(node, RECOMPUTE)
        if value is not None and int(value) == RecomputeType.Checkpoint:
            counter[stage] = region + 1
    return keys


@dataclass(frozen=True)
class Precision:
    """How wide the float activations are.

    ``autocast`` None: every float activation is ``width`` bytes (FP32 compute, or the IPU
    computing in FP16 throughout). ``"cpu"`` / ``"cuda"``: torch's autocast to a ``width``-byte
    type: matmuls and attention produce half outputs and keep half copies of FP32 inputs, the
    device's FP32 ops (CUDA: LayerNorm, softmax, the loss; CPU: the loss) produce FP32, and
    elementwise ops promote to the widest input (an FP32 weight of rank >= 1 included).
    ``dropout_mask``: bytes per element of a dropout mask; None = the input's width (torch's
    CPU dropout keeps its scaled noise; CUDA keeps a 1-byte mask).
    """

    width: int = 4
    autocast: str | None = None
    dropout_mask: int | None = 1


LOWER_PRECISION_OPS = frozenset({"MatMul", "Gemm", "Attention"})
FP32_OPS = {"cuda": frozenset({"LayerNormalization", "GroupNormalization", "Softmax",
                               "LogSoftmax", "SoftmaxCrossEntropyLoss", "Nll", "Exp", "Pow",
                               "ReduceSum"}),
            "cpu": frozenset({"SoftmaxCrossEntropyLoss", "Nll"})}


def activation_model(model: onnx.ModelProto, shapes: dict[str, TensorShape],
                     stage_of: Sequence[int], precision: Precision | None = None
                     ) -> ActivationModel:
    """Charge every node's kept tensors to its (stage, region).

    ``stage_of``: the stage of each node (all 0 for a run without pipelining: its regions then
    span the whole graph). ``precision``: the width of float activations (default FP32); ids
    and statistics keep their own widths.
    """
    precision = precision or Precision()
    g = model.graph
    trainable = set(trainable_initializers(model))  # constants (scales, ratios) need no grad
    graph_inputs = {vi.name for vi in g.input} - {t.name for t in g.initializer}
    needs_grad: dict[str, bool] = {name: True for name in trainable}
    activation = set(graph_inputs)  # tensors that depend on the batch
    base: dict[str, str] = {}
    nbytes: dict[str, int] = {}
    width: dict[str, int] = {}  # bytes per element of each float activation
    producer_op: dict[str, str] = {}
    use_count: dict[str, int] = {}
    for node in g.node:
        for i in node.input:
            use_count[i] = use_count.get(i, 0) + 1
    half = precision.width

    def numel(name: str) -> int:
        s = shapes.get(name)
        return int(s.numel or 0) if s is not None else 0

    def is_float(name: str) -> bool:
        s = shapes.get(name)
        return s is not None and s.elem_type in FLOAT_TYPES

    def batched(node: onnx.NodeProto) -> bool:
        """Both operands of a MatMul have batch dimensions (rank >= 3)."""
        ranks = [shapes.get(i) for i in node.input[:2]]
        return all(s is not None and s.shape is not None and len(s.shape) >= 3 for s in ranks)

    def weight_like(name: str) -> bool:
        """An FP32 weight (or its view) of rank >= 1: promotes elementwise ops under autocast."""
        s = shapes.get(name)
        return (name not in activation and is_float(name) and s is not None
                and s.shape is not None and len(s.shape) >= 1)

    def out_width(node: onnx.NodeProto, inputs: list[str]) -> int:
        if precision.autocast is None:
            return precision.width
        op = node.op_type
        if op in LOWER_PRECISION_OPS:
            return half
        if op in FP32_OPS.get(precision.autocast, ()):
            return 4
        if op == "Cast" or op in ("Gather", "GatherND"):
            return 4  # an explicit FLOAT cast; a gather from an FP32 table
        if op in VIEW_OPS or op == "Dropout":
            return width.get(inputs[0], 4)
        if (op == "Add" and len(inputs) == 2 and any(
                producer_op.get(i) == "MatMul" and use_count.get(i) == 1 for i in inputs)
                and any(i in trainable for i in inputs)):
            return half  # MatMul + bias: lowered to one F.linear
        widths = [width[i] for i in inputs if i in width]
        widths += [4 for i in inputs if weight_like(i)]
        return max(widths, default=4)

    for name in graph_inputs:
        s = shapes.get(name)
        nbytes[name] = s.nbytes or 0 if s is not None else 0
    keys = region_keys(model, stage_of)
    regions: dict[tuple[int, int], RegionMemory] = {}
    producer_key: dict[str, tuple[int, int]] = {}
    for node, key in zip(g.node, keys):
        region = regions.setdefault(key, RegionMemory(*key))
        inputs = [i for i in node.input if i]
        if not any(i in activation for i in inputs):
            continue  # weight-only (the tied projection's transpose): no batch memory
        grads = [needs_grad.get(i, False) for i in node.input]
        out_grad = any(grads) and node.op_type not in NO_GRADIENT
        w = out_width(node, inputs)
        for out in node.output:
            if not out:
                continue
            activation.add(out)
            region.produced.add(out)
            producer_op[out] = node.op_type
            needs_grad[out] = out_grad and is_float(out)
            producer_key[out] = key
            if is_float(out):
                width[out] = w
            if node.op_type in VIEW_OPS and inputs:
                base[out] = base.get(inputs[0], inputs[0])
            else:
                s = shapes.get(out)
                nbytes[out] = numel(out) * w if is_float(out) else (
                    s.nbytes or 0 if s is not None else 0)
                region.largest = max(region.largest, nbytes[out])
        for i in inputs:
            if i in activation and producer_key.get(i) != key:
                region.inputs.add(i)
        if precision.autocast is not None and node.op_type in FP32_OPS[precision.autocast]:
            # It runs on an FP32 copy of its input, so its input's gradient is FP32 too.
            region.largest = max(region.largest, numel(inputs[0]) * 4)
        if not out_grad:
            continue
        if node.op_type == "Dropout" and _dropout_active(node):
            mask = precision.dropout_mask
            region.extra_bytes += numel(inputs[0]) * (
                width.get(inputs[0], 4) if mask is None else mask)
            continue
        if node.op_type in ("LayerNormalization", "GroupNormalization"):
            s = shapes.get(inputs[0])
            if s is not None and s.shape:  # mean and 1/std, FP32
                region.extra_bytes += 2 * 4 * (numel(inputs[0]) // max(s.shape[-1], 1))
        if node.op_type == "SoftmaxCrossEntropyLoss":
            region.extra_bytes += numel(inputs[0]) * 4  # the FP32 log-probabilities
            continue
        if node.op_type in KEEPS_NOTHING or node.op_type in VIEW_OPS:
            continue
        rule = SAVES.get(node.op_type)
        saved = rule(node, grads) if rule is not None else (
            [("in", k) for k in range(len(node.input))]
            + [("out", k) for k in range(len(node.output))])
        for where, index in saved:
            names = node.input if where == "in" else node.output
            if index >= len(names) or names[index] not in activation:
                continue
            name = names[index]
            if (where == "in" and precision.autocast is not None
                    and node.op_type in LOWER_PRECISION_OPS and width.get(name, half) > half):
                region.extra_bytes += numel(name) * half  # autocast keeps its half copy
            elif (where == "in" and node.op_type == "MatMul"
                  and producer_op.get(name) == "Transpose" and batched(node)):
                # torch.matmul flattens a batched operand's leading dims by reshape: a permuted
                # view (attention's heads-first Q, K, V) becomes a contiguous copy, and that
                # copy, not the view's base, is what bmm keeps for the backward pass.
                copy = f"{name}{CONTIGUOUS_COPY}"
                nbytes[copy] = numel(name) * width.get(name, half)
                region.kept.add(copy)
            else:
                region.kept.add(name)

    ordered = [regions[k] for k in sorted(regions)]
    if ordered:
        for r in ordered[:-1]:
            r.recomputed = True  # every partition but the graph's last one (partition.py)
    graph_outputs = {vi.name for vi in g.output} & activation
    return ActivationModel(nbytes, base, ordered, graph_inputs, graph_outputs)


def _dropout_active(node: onnx.NodeProto) -> bool:
    """Dropout keeps a mask unless its ratio attribute is 0 (opset < 12; from opset 12 the
    ratio is an input, and the builder emits no Dropout for a ratio of 0)."""
    for attr in node.attribute:
        if attr.name == "ratio" and attr.f == 0.0:
            return False
    return True


@dataclass
class PeakActivations:
    """Activation bytes of one micro-batch over a set of regions (a stage, or a whole run)."""

    kept: int  # alive from the forward pass to the backward pass
    peak: int  # kept + the backward pass's largest transient


def peak_of_regions(model: ActivationModel, regions: Sequence[RegionMemory],
                    recompute: bool) -> PeakActivations:
    """Kept and peak activation bytes of one micro-batch through ``regions``.

    Without recomputation every region's kept tensors stay alive until its backward pass. With
    it, a recomputed region keeps only its inputs until its backward pass recomputes it, so one
    region's kept tensors are alive at a time, next to every region's inputs and the last
    region's kept tensors.
    """
    if not regions:
        return PeakActivations(0, 0)
    stage_inputs = set().union(*(r.inputs for r in regions))
    outputs = model.graph_outputs & set().union(*(r.produced for r in regions))
    if not recompute or not any(r.recomputed for r in regions):
        names = set().union(*(r.kept for r in regions)) | stage_inputs | outputs
        kept = model.bytes_of(names) + sum(r.extra_bytes for r in regions)
        return PeakActivations(kept, kept + 2 * max(r.largest for r in regions))
    plain = [r for r in regions if not r.recomputed]
    names = stage_inputs | outputs | set().union(*(r.kept for r in plain), set())
    kept = model.bytes_of(names) + sum(r.extra_bytes for r in plain)
    boundary = model.bytes_of(stage_inputs | outputs)
    live = max((model.bytes_of(r.kept - stage_inputs - outputs) + r.extra_bytes + 2 * r.largest
                for r in regions), default=0)
    return PeakActivations(kept, max(kept + 2 * max((r.largest for r in plain), default=0),
                                     boundary + live))

