"""Converters of the ops that move data without computing: shapes, views, indexing, constants.

These are where lowering-time folding matters most: a shape-like input (Reshape's shape, Slice's
bounds, Unsqueeze's axes, Split's sizes, Expand's shape) known at lowering time becomes a python
constant, so ONNX's shape arithmetic never reaches the generated code. Only when a shape is
unknown until run time do they emit a :mod:`popbert.lowering.functional` helper.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from popbert.lowering.context import NodeContext, register_converter
from popbert.lowering.embedding import embedding
from popbert.lowering.functional import (
    onnx_constant_of_shape,
    onnx_expand,
    onnx_flatten,
    onnx_gather,
    onnx_gather_elements,
    onnx_gather_nd,
    onnx_range,
    onnx_reshape,
    onnx_shape,
    onnx_slice,
    onnx_split_equal,
    onnx_transpose_reverse,
    onnx_unsqueeze,
)


@register_converter("Constant")
def convert_constant(ctx: NodeContext) -> list[Any]:
    return [ctx.constant_attribute_value()]


@register_converter("Gather")
def convert_gather(ctx: NodeContext) -> list[Any]:
    axis = int(ctx.attrs.get("axis", 0))
    data, indices = ctx.inputs[0], ctx.inputs[1]
    d_shape = ctx.shape(0)
    if ctx.is_param(0) and d_shape is not None and len(d_shape) == 2 and axis in (0, -2):
        return [ctx.call(embedding, indices, data)]
    if ctx.is_const(1) and ctx.const_value(1).dim() == 0:
        return [ctx.call(torch.select, data, axis, int(ctx.const_value(1).item()))]
    return [ctx.call(onnx_gather, data, indices, axis)]


@register_converter("GatherElements")
def convert_gather_elements(ctx: NodeContext) -> list[Any]:
    axis = int(ctx.attrs.get("axis", 0))
    return [ctx.call(onnx_gather_elements, ctx.inputs[0], ctx.inputs[1], axis)]


@register_converter("GatherND")
def convert_gather_nd(ctx: NodeContext) -> list[Any]:
    batch_dims = int(ctx.attrs.get("batch_dims", 0))
    return [ctx.call(onnx_gather_nd, ctx.inputs[0], ctx.inputs[1], batch_dims)]


@register_converter("Reshape")
def convert_reshape(ctx: NodeContext) -> list[Any]:
    allowzero = int(ctx.attrs.get("allowzero", 0))
    x = ctx.inputs[0]
    if not ctx.is_const(1):
        return [ctx.call(onnx_reshape, x, ctx.inputs[1], allowzero)]
    shape = ctx.const_ints(1)
    if not allowzero and 0 in shape:
        x_shape = ctx.shape(0)
        if x_shape is None or any(
            s == 0 and (i >= len(x_shape) or x_shape[i] is None) for i, s in enumerate(shape)
        ):
            return [ctx.call(onnx_reshape, x, shape, allowzero)]
        shape = [int(x_shape[i]) if s == 0 else s for i, s in enumerate(shape)]  # type: ignore
    return [ctx.call(torch.reshape, x, tuple(shape))]


@register_converter("Flatten")
def convert_flatten(ctx: NodeContext) -> list[Any]:
    return [ctx.call(onnx_flatten, ctx.inputs[0], int(ctx.attrs.get("axis", 1)))]


@register_converter("Transpose")
def convert_transpose(ctx: NodeContext) -> list[Any]:
    perm = ctx.attrs.get("perm")
    if perm is None:
        rank = ctx.rank(0)
        if rank is None:
            return [ctx.call(onnx_transpose_reverse, ctx.inputs[0])]
        perm = list(reversed(range(rank)))
    return [ctx.call(torch.permute, ctx.inputs[0], tuple(int(p) for p in perm))]


def _axes(ctx: NodeContext, index: int) -> list[int] | None:
    """Axes from input ``index`` (opset >= 13) or the ``axes`` attribute (older opsets)."""
    if ctx.has_input(index):
        return ctx.const_ints(index, what="axes")
    axes = ctx.attrs.get("axes")
    return None if axes is None else [int(a) for a in axes]


@register_converter("Unsqueeze")
def convert_unsqueeze(ctx: NodeContext) -> list[Any]:
    axes = _axes(ctx, 1) or []
    rank = ctx.rank(0)
    if rank is None:
        return [ctx.call(onnx_unsqueeze, ctx.inputs[0], axes)]
    out_rank = rank + len(axes)
    x = ctx.inputs[0]
    for a in sorted(a % out_rank for a in axes):
        x = ctx.call(torch.unsqueeze, x, a)
    return [x]


@register_converter("Squeeze")
def convert_squeeze(ctx: NodeContext) -> list[Any]:
    axes = _axes(ctx, 1)
    if not axes:
        return [ctx.call(torch.squeeze, ctx.inputs[0])]
    return [ctx.call(torch.squeeze, ctx.inputs[0], tuple(axes))]


@register_converter("Concat")
def convert_concat(ctx: NodeContext) -> list[Any]:
    vals = [v for v in ctx.inputs if v is not None]
    return [ctx.call(torch.cat, vals, int(ctx.attrs["axis"]))]


@register_converter("Split")
def convert_split(ctx: NodeContext) -> list[Any]:
    axis = int(ctx.attrs.get("axis", 0))
    n = ctx.num_outputs
    if ctx.has_input(1):
        sizes: list[int] | None = ctx.const_ints(1, what="split")
    else:
        split_attr = ctx.attrs.get("split")
        sizes = None if split_attr is None else [int(s) for s in split_attr]
    if sizes is not None:
        parts = ctx.call(torch.split, ctx.inputs[0], sizes, axis)
    else:
        num = int(ctx.attrs.get("num_outputs", n))
        shape = ctx.shape(0)
        dim = None if shape is None else shape[axis]
        if dim is not None:
            size = -(-int(dim) // num)
            parts = ctx.call(torch.split, ctx.inputs[0], size, axis)
        else:
            parts = ctx.call(onnx_split_equal, ctx.inputs[0], num, axis)
    return [ctx.item(parts, i) for i in range(n)]


@register_converter("Slice")
def convert_slice(ctx: NodeContext) -> list[Any]:
    x = ctx.inputs[0]
    if ctx.opset < 10:
        starts = [int(s) for s in ctx.attrs["starts"]]
        ends = [int(e) for e in ctx.attrs["ends"]]
        axes_attr = ctx.attrs.get("axes")
        axes = list(range(len(starts))) if axes_attr is None else [int(a) for a in axes_attr]
        steps = [1] * len(starts)
    else:
        if not all(ctx.is_const(i) for i in range(1, 5) if ctx.has_input(i)):
            dyn = [ctx.input_or_none(i) for i in range(1, 5)]
            return [ctx.call(onnx_slice, x, *dyn)]
        starts = ctx.const_ints(1, what="starts")
        ends = ctx.const_ints(2, what="ends")
        axes = ctx.const_ints(3, what="axes") if ctx.has_input(3) else list(range(len(starts)))
        steps = ctx.const_ints(4, what="steps") if ctx.has_input(4) else [1] * len(starts)
    rank = ctx.rank(0)
    if rank is not None:
        axes = [a % rank for a in axes]
    if rank is None or any(s < 0 for s in steps):
        return [ctx.call(onnx_slice, x, starts, ends, axes, steps)]
    index: list[Any] = [slice(None)] * (max(axes) + 1 if axes else 0)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        index[axis] = slice(start, end, step)
    return [ctx.call(operator.getitem, x, tuple(index))]


@register_converter("Shape")
def convert_shape(ctx: NodeContext) -> list[Any]:
    start = int(ctx.attrs.get("start", 0))
    end_attr = ctx.attrs.get("end")
    end = None if end_attr is None else int(end_attr)
    shape = ctx.shape(0)
    if shape is not None and ctx.static_shapes:
        dims = list(shape)[start:end]
        if all(d is not None for d in dims):
            return [torch.tensor(dims, dtype=torch.int64)]
    return [ctx.call(onnx_shape, ctx.inputs[0], start, end)]


@register_converter("Expand")
def convert_expand(ctx: NodeContext) -> list[Any]:
    x = ctx.inputs[0]
    if not ctx.is_const(1):
        return [ctx.call(onnx_expand, x, ctx.inputs[1])]
    shape = ctx.const_ints(1)
    x_shape = ctx.shape(0)
    if x_shape is not None and all(d is not None for d in x_shape):
        out = torch.broadcast_shapes(tuple(int(d) for d in x_shape), tuple(shape))  # type: ignore
        return [ctx.call(torch.Tensor.expand, x, tuple(out))]
    return [ctx.call(onnx_expand, x, shape)]


@register_converter("ConstantOfShape")
def convert_constant_of_shape(ctx: NodeContext) -> list[Any]:
    value = ctx.attrs.get("value")
    if value is None:
        fill: float | int | bool = 0.0
        dtype = torch.float32
    else:
        t = ctx.tensor_from_numpy(value)
        fill, dtype = t.reshape(-1)[0].item(), t.dtype
    shape = ctx.inputs[0]
    return [ctx.call(onnx_constant_of_shape, shape, fill, dtype)]


@register_converter("Range")
def convert_range(ctx: NodeContext) -> list[Any]:
    return [ctx.call(onnx_range, ctx.inputs[0], ctx.inputs[1], ctx.inputs[2])]
