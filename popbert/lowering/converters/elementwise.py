"""Converters of the elementwise ops: math, comparisons, logic, Where/Clip, Identity and casts.

The ops here map one-to-one onto torch functions (``Add`` -> ``torch.add``, ``Gelu`` -> ``F.gelu``);
what the converters decide is how to pass their inputs: a one-element constant that cannot
change the result's rank is passed as a python number (:meth:`NodeContext.scalarish`), so the
generated code multiplies by ``0.125`` instead of reading a one-element buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from popbert.lowering.context import Converter, NodeContext, register_converter
from popbert.lowering.functional import onnx_div, onnx_identity


def _unary(fn: Callable[..., Any]) -> Converter:
    def convert(ctx: NodeContext) -> list[Any]:
        return [ctx.call(fn, ctx.inputs[0])]

    convert.__name__ = f"convert_{getattr(fn, '__name__', 'unary')}"
    return convert


for _op, _fn in {
    "Neg": torch.neg,
    "Exp": torch.exp,
    "Log": torch.log,
    "Sqrt": torch.sqrt,
    "Tanh": torch.tanh,
    "Erf": torch.erf,
    "Relu": F.relu,
    "Sigmoid": torch.sigmoid,
    "Abs": torch.abs,
    "Reciprocal": torch.reciprocal,
    "Floor": torch.floor,
    "Ceil": torch.ceil,
    "Not": torch.logical_not,
}.items():
    register_converter(_op)(_unary(_fn))


def _binary(fn: Callable[..., Any], scalar_first: bool = True) -> Converter:
    # Comparisons and logical ops only take a python number as their second argument.
    def convert(ctx: NodeContext) -> list[Any]:
        a = ctx.scalarish(0, 1) if scalar_first else ctx.inputs[0]
        return [ctx.call(fn, a, ctx.scalarish(1, 0))]

    convert.__name__ = f"convert_{getattr(fn, '__name__', 'binary')}"
    return convert


for _op, _fn in {
    "Add": torch.add,
    "Sub": torch.sub,
    "Mul": torch.mul,
    "Pow": torch.pow,
}.items():
    register_converter(_op)(_binary(_fn))

for _op, _fn in {
    "Equal": torch.eq,
    "Less": torch.lt,
    "Greater": torch.gt,
    "LessOrEqual": torch.le,
    "GreaterOrEqual": torch.ge,
    "And": torch.logical_and,
    "Or": torch.logical_or,
    "Xor": torch.logical_xor,
}.items():
    register_converter(_op)(_binary(_fn, scalar_first=False))


@register_converter("Div")
def convert_div(ctx: NodeContext) -> list[Any]:
    a, b = ctx.scalarish(0, 1), ctx.scalarish(1, 0)
    dtype = ctx.dtype(0) or ctx.dtype(1)
    if dtype is None:
        return [ctx.call(onnx_div, a, b)]
    if dtype.is_floating_point:
        return [ctx.call(torch.div, a, b)]
    return [ctx.call(torch.div, a, b, rounding_mode="trunc")]


def _variadic(fn: Callable[..., Any]) -> Converter:
    def convert(ctx: NodeContext) -> list[Any]:
        vals = [v for v in ctx.inputs if v is not None]
        out = vals[0]
        for v in vals[1:]:
            out = ctx.call(fn, out, v)
        if len(vals) == 1:
            out = ctx.call(onnx_identity, out)
        return [out]

    return convert


register_converter("Max")(_variadic(torch.maximum))
register_converter("Min")(_variadic(torch.minimum))
register_converter("Sum")(_variadic(torch.add))


@register_converter("Identity")
def convert_identity(ctx: NodeContext) -> list[Any]:
    # Emitted (not aliased) so the node keeps its annotations: PopART marks checkpoints on an
    # Identity node (popbert.graph.annotations.RECOMPUTE).
    return [ctx.call(onnx_identity, ctx.inputs[0])]


@register_converter("Cast")
def convert_cast(ctx: NodeContext) -> list[Any]:
    dtype = ctx.torch_dtype(int(ctx.attrs["to"]))
    return [ctx.call(torch.Tensor.to, ctx.inputs[0], dtype)]


@register_converter("CastLike")
def convert_cast_like(ctx: NodeContext) -> list[Any]:
    dtype = ctx.dtype(1)
    if dtype is None:
        return [ctx.call(torch.Tensor.type_as, ctx.inputs[0], ctx.inputs[1])]
    return [ctx.call(torch.Tensor.to, ctx.inputs[0], dtype)]


@register_converter("Gelu")
def convert_gelu(ctx: NodeContext) -> list[Any]:
    approximate = ctx.str_attr("approximate", "none")
    return [ctx.call(F.gelu, ctx.inputs[0], approximate=approximate)]


@register_converter("Where")
def convert_where(ctx: NodeContext) -> list[Any]:
    cond = ctx.inputs[0]
    x = ctx.scalarish(1, 2, 0) if ctx.is_node(2) else ctx.inputs[1]
    y = ctx.scalarish(2, 1, 0) if ctx.is_node(1) else ctx.inputs[2]
    return [ctx.call(torch.where, cond, x, y)]


@register_converter("Clip")
def convert_clip(ctx: NodeContext) -> list[Any]:
    lo: Any = ctx.attrs.get("min")
    hi: Any = ctx.attrs.get("max")
    if ctx.has_input(1):
        lo = ctx.const_scalar(1) if ctx.is_const(1) else ctx.inputs[1]
    if ctx.has_input(2):
        hi = ctx.const_scalar(2) if ctx.is_const(2) else ctx.inputs[2]
    if lo is None and hi is None:
        return [ctx.call(onnx_identity, ctx.inputs[0])]
    return [ctx.call(torch.clamp, ctx.inputs[0], lo, hi)]
