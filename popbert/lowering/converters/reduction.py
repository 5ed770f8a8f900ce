"""Converters of the reductions (``ReduceSum``/``Mean``/``Max``/``Min``) and ``ArgMax``.

They share one concern, where the axes come from: an attribute before the opset that moved them
to an input (13 for ReduceSum, 18 for the others), an empty list meaning every axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from popbert.lowering.context import Converter, NodeContext, register_converter
from popbert.lowering.functional import onnx_argmax, onnx_identity, onnx_reduce_all


def _reduction(fn: Callable[..., Any], axes_input_since: int) -> Converter:
    def convert(ctx: NodeContext) -> list[Any]:
        keepdims = bool(int(ctx.attrs.get("keepdims", 1)))
        noop = int(ctx.attrs.get("noop_with_empty_axes", 0))
        if ctx.opset >= axes_input_since:
            axes = ctx.const_ints(1, what="axes") if ctx.has_input(1) else []
        else:
            axes = [int(a) for a in ctx.attrs.get("axes", [])]
        x = ctx.inputs[0]
        if not axes:
            if noop:
                return [ctx.call(onnx_identity, x)]
            rank = ctx.rank(0)
            if rank is None:
                return [ctx.call(onnx_reduce_all, x, fn.__name__, keepdims)]
            axes = list(range(rank))
        return [ctx.call(fn, x, dim=tuple(axes), keepdim=keepdims)]

    return convert


register_converter("ReduceSum")(_reduction(torch.sum, 13))
register_converter("ReduceMean")(_reduction(torch.mean, 18))
register_converter("ReduceMax")(_reduction(torch.amax, 18))
register_converter("ReduceMin")(_reduction(torch.amin, 18))


@register_converter("ArgMax")
def convert_argmax(ctx: NodeContext) -> list[Any]:
    axis = int(ctx.attrs.get("axis", 0))
    keepdims = bool(int(ctx.attrs.get("keepdims", 1)))
    if int(ctx.attrs.get("select_last_index", 0)):
        return [ctx.call(onnx_argmax, ctx.inputs[0], axis, keepdims, True)]
    return [ctx.call(torch.argmax, ctx.inputs[0], dim=axis, keepdim=keepdims)]
