"""Per-op converters from ONNX nodes to torch.fx nodes, and the runtime helpers they emit.

Each converter is a small function ``converter(ctx) -> list[value]`` registered under
``(domain, op_type)`` in :data:`CONVERTERS`. It reads its inputs and attributes from the
:class:`~popbert.lowering.lower.NodeContext` and emits torch calls through
``ctx.call(...)``; when every argument of a call is a lowering-time constant the call is
evaluated immediately (constant folding), so shape arithmetic never reaches the generated code.

The converters prefer fused torch kernels (``F.linear``, ``F.layer_norm``, ``F.gelu``,
``F.scaled_dot_product_attention``, ``F.cross_entropy``) because the lowered module is
benchmarked against Hugging Face BERT. The ``onnx_*`` helpers below are only emitted where
ONNX semantics need a little python at run time (shapes unknown at lowering time, negative
indices, integer division of unknown dtype); they are plain functions so ``torch.compile``
traces straight through them.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from popbert.lowering.lower import NodeContext

Converter = Callable[["NodeContext"], list[Any]]

#: ``(domain, op_type) -> converter``. The standard domain is ``""``; ``"ai.onnx"`` is
#: normalised to ``""`` by the lowering. Graphcore ops are registered under both
#: ``"ai.graphcore"`` and ``"com.graphcore"``.
CONVERTERS: dict[tuple[str, str], Converter] = {}

GRAPHCORE_DOMAINS = ("ai.graphcore", "com.graphcore")


def register_converter(
    op_type: str, domains: Sequence[str] = ("",)
) -> Callable[[Converter], Converter]:
    """Register ``fn`` as the converter of ``op_type`` in each of ``domains``.

    Public so that later dialects (the popart ``ai.graphcore`` ops) can add converters
    without touching the lowering itself.
    """

    def deco(fn: Converter) -> Converter:
        for domain in domains:
            CONVERTERS[(domain, op_type)] = fn
        return fn

    return deco


# ---------------------------------------------------------------------------------------------
# Runtime helpers (emitted into the fx graph where plain torch calls are not enough)
# ---------------------------------------------------------------------------------------------


def onnx_identity(x: torch.Tensor) -> torch.Tensor:
    """Identity that still shows up as an fx node, so its annotations survive lowering."""
    return x


def onnx_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ONNX Div when the dtype was unknown at lowering time: integers truncate toward zero."""
    if isinstance(a, torch.Tensor) and not a.is_floating_point():
        return torch.div(a, b, rounding_mode="trunc")
    return torch.div(a, b)


def _resolve_reshape(in_shape: Sequence[int], shape: Sequence[int], allowzero: int) -> list[int]:
    if allowzero:
        return [int(s) for s in shape]
    return [int(in_shape[i]) if int(s) == 0 else int(s) for i, s in enumerate(shape)]


def onnx_reshape(x: torch.Tensor, shape: Any, allowzero: int = 0) -> torch.Tensor:
    """ONNX Reshape with a 0 ("copy this dim") that could not be resolved at lowering time."""
    if isinstance(shape, torch.Tensor):
        shape = shape.tolist()
    return torch.reshape(x, _resolve_reshape(x.shape, shape, allowzero))


def onnx_shape(x: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
    """ONNX Shape for dynamic shapes: an int64 tensor on the input's device."""
    return torch.tensor(list(x.shape[start:end]), dtype=torch.int64, device=x.device)


def onnx_expand(x: torch.Tensor, shape: Any) -> torch.Tensor:
    """ONNX Expand is a bidirectional broadcast (a 1 in ``shape`` keeps the input's dim)."""
    if isinstance(shape, torch.Tensor):
        shape = shape.tolist()
    return torch.broadcast_to(x, torch.broadcast_shapes(x.shape, tuple(int(s) for s in shape)))


def onnx_gather(data: torch.Tensor, indices: torch.Tensor, axis: int) -> torch.Tensor:
    """ONNX Gather (negative indices allowed, any index rank) via advanced indexing."""
    axis = axis % data.dim()
    if indices.dtype not in (torch.int64, torch.int32):
        indices = indices.long()
    return data[(slice(None),) * axis + (indices,)]


def onnx_gather_elements(data: torch.Tensor, indices: torch.Tensor, axis: int) -> torch.Tensor:
    """ONNX GatherElements: torch.gather after wrapping negative indices."""
    indices = indices.long()
    indices = torch.where(indices < 0, indices + data.shape[axis], indices)
    return torch.gather(data, axis, indices)


def onnx_gather_nd(data: torch.Tensor, indices: torch.Tensor, batch_dims: int = 0) -> torch.Tensor:
    """ONNX GatherND (``batch_dims`` leading dims shared by data and indices)."""
    idx = indices.long()
    m = idx.shape[-1]
    if batch_dims == 0:
        out = data[tuple(idx.unbind(-1))] if m > 0 else data.expand(*idx.shape[:-1], *data.shape)
        return out
    batch_shape = data.shape[:batch_dims]
    nb = math.prod(batch_shape)
    flat_data = data.reshape(nb, *data.shape[batch_dims:])
    flat_idx = idx.reshape(nb, -1, m)
    rows = torch.arange(nb, device=data.device).unsqueeze(1).expand(nb, flat_idx.shape[1])
    out = flat_data[(rows,) + tuple(flat_idx.unbind(-1))]
    return out.reshape(*idx.shape[:-1], *data.shape[batch_dims + m :])


def onnx_unsqueeze(x: torch.Tensor, axes: Sequence[int]) -> torch.Tensor:
    """ONNX Unsqueeze when the input rank was unknown at lowering time."""
    out_rank = x.dim() + len(axes)
    for a in sorted(a % out_rank for a in axes):
        x = torch.unsqueeze(x, a)
    return x


def _as_ints(v: Any) -> list[int]:
    return [int(i) for i in (v.tolist() if isinstance(v, torch.Tensor) else v)]


def onnx_slice(
    x: torch.Tensor,
    starts: Sequence[int],
    ends: Sequence[int],
    axes: Sequence[int] | None = None,
    steps: Sequence[int] | None = None,
) -> torch.Tensor:
    """ONNX Slice with clamping and negative steps (torch slicing has no negative step)."""
    starts, ends = _as_ints(starts), _as_ints(ends)
    axes = list(range(len(starts))) if axes is None else _as_ints(axes)
    steps = [1] * len(starts) if steps is None else _as_ints(steps)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis = int(axis) % x.dim()
        dim = x.shape[axis]
        start, end, step = int(start), int(end), int(step)
        if step > 0:
            x = x[(slice(None),) * axis + (slice(start, end, step),)]
            continue
        # Negative step: clamp like ONNX, then slice the flipped tensor forwards.
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        start = max(-1, min(start, dim - 1))
        end = max(-1, min(end, dim - 1))
        flipped = torch.flip(x, (axis,))
        # index i in x is dim-1-i in flipped; going from start down to end (exclusive)
        f_start, f_end = dim - 1 - start, dim - 1 - end
        x = flipped[(slice(None),) * axis + (slice(f_start, f_end, -step),)]
    return x


def onnx_split_equal(x: torch.Tensor, num: int, axis: int) -> tuple[torch.Tensor, ...]:
    """ONNX Split into ``num`` parts of ceil(dim / num) (the last one smaller)."""
    dim = x.shape[axis]
    size = -(-dim // num)
    return torch.split(x, size, axis)


def onnx_constant_of_shape(shape: Any, value: float | int | bool, dtype: torch.dtype) -> Any:
    """ONNX ConstantOfShape; folded at lowering time whenever the shape is constant."""
    device = shape.device if isinstance(shape, torch.Tensor) else None
    dims = shape.tolist() if isinstance(shape, torch.Tensor) else list(shape)
    return torch.full([int(d) for d in dims], value, dtype=dtype, device=device)


def onnx_range(start: torch.Tensor, limit: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """ONNX Range, keeping the inputs' dtype and device."""
    return torch.arange(
        start.item(), limit.item(), delta.item(), dtype=start.dtype, device=start.device
    )


def onnx_argmax(x: torch.Tensor, axis: int, keepdims: bool, select_last: bool) -> torch.Tensor:
    """ONNX ArgMax/ArgMin helper for ``select_last_index=1`` (torch picks the first)."""
    axis = axis % x.dim()
    flipped = torch.argmax(torch.flip(x, (axis,)), dim=axis, keepdim=keepdims)
    return (x.shape[axis] - 1) - flipped if select_last else flipped


def onnx_reduce_all(x: torch.Tensor, op: str, keepdims: bool) -> torch.Tensor:
    """Reduce (``torch.<op>``) over every axis when the rank was unknown at lowering time."""
    return getattr(torch, op)(x, dim=tuple(range(x.dim())), keepdim=keepdims)


def onnx_transpose_reverse(x: torch.Tensor) -> torch.Tensor:
    """ONNX Transpose without ``perm``: reverse the axes."""
    return x.permute(*reversed(range(x.dim())))


def onnx_softmax_coerced(x: torch.Tensor, axis: int, log: bool) -> torch.Tensor:
    """Softmax/LogSoftmax before opset 13: flatten from ``axis`` to a 2-D matrix."""
    fn = F.log_softmax if log else F.softmax
    axis = axis % x.dim()
    if axis == x.dim() - 1:
        return fn(x, -1)
    return fn(x.flatten(axis), -1).reshape(x.shape)


def onnx_flatten(x: torch.Tensor, axis: int) -> torch.Tensor:
    """ONNX Flatten: a 2-D view split at ``axis``."""
    axis = axis % (x.dim() + 1) if axis < 0 else axis
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def onnx_layer_norm(
    x: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    axis: int,
    eps: float,
    stats: bool,
) -> Any:
    """ONNX LayerNormalization in general form (any axis, broadcast scale, Mean/InvStdDev)."""
    axis = axis % x.dim()
    dims = tuple(range(axis, x.dim()))
    if not stats:
        y = F.layer_norm(x, x.shape[axis:], None, None, eps)
        y = y * scale
        return y + bias if bias is not None else y
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    var, mean = torch.var_mean(xf, dim=dims, keepdim=True, correction=0)
    inv_std = torch.rsqrt(var + eps)
    y = ((xf - mean) * inv_std).to(x.dtype) * scale
    if bias is not None:
        y = y + bias
    return y, mean, inv_std


def onnx_group_norm_stats(
    x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, groups: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Graphcore GroupNormalization with its Mean/InvStdDev outputs (each [N * groups])."""
    n = x.shape[0]
    xg = x.reshape(n, groups, -1)
    var, mean = torch.var_mean(xg, dim=-1, keepdim=True, correction=0)
    inv_std = torch.rsqrt(var + eps)
    y = ((xg - mean) * inv_std).reshape(x.shape)
    shape = [1, -1] + [1] * (x.dim() - 2)
    y = y * scale.reshape(shape) + bias.reshape(shape)
    return y, mean.reshape(-1), inv_std.reshape(-1)


def onnx_causal_mask(mask: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """Combine an attention mask with ONNX's upper-left aligned causal mask."""
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return mask & causal
    return mask.masked_fill(~causal, float("-inf"))


def onnx_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    q_num_heads: int,
    kv_num_heads: int,
    scale: float | None,
    is_causal: bool,
    softcap: float,
) -> torch.Tensor:
    """ONNX Attention (opset 23) for 3-D or 4-D inputs; SDPA unless ``softcap`` is set."""
    three_d = q.dim() == 3
    if three_d:
        q = torch.unflatten(q, -1, (q_num_heads, -1)).transpose(1, 2)
        k = torch.unflatten(k, -1, (kv_num_heads, -1)).transpose(1, 2)
        v = torch.unflatten(v, -1, (kv_num_heads, -1)).transpose(1, 2)
    if is_causal and (attn_mask is not None or softcap):
        if attn_mask is None:
            attn_mask = torch.ones(
                q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device
            ).tril()
        else:
            attn_mask = onnx_causal_mask(attn_mask, q.shape[-2], k.shape[-2])
        is_causal = False
    gqa = q.shape[1] != k.shape[1]
    if softcap:
        if gqa:
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        scores = torch.matmul(q, k.transpose(-1, -2)) * s
        scores = softcap * torch.tanh(scores / softcap)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        y = torch.matmul(torch.softmax(scores, -1), v)
    else:
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
    if three_d:
        y = y.transpose(1, 2).flatten(2)
    return y


def onnx_nll_class_last(
    log_probs: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str
) -> torch.Tensor:
    """NLL over a class-last [..., C] tensor (Graphcore Nll's layout) via F.nll_loss."""
    flat = log_probs.reshape(-1, log_probs.shape[-1])
    loss = F.nll_loss(
        flat, labels.reshape(-1).long(), ignore_index=ignore_index, reduction=reduction
    )
    return loss.reshape(labels.shape) if reduction == "none" else loss


def onnx_dropout_dynamic(
    x: torch.Tensor, ratio: Any, training_mode: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropout whose ratio or training_mode is only known at run time."""
    p = float(ratio)
    if not bool(training_mode) or p == 0.0:
        return x, torch.ones_like(x, dtype=torch.bool)
    keep = torch.rand_like(x, dtype=torch.float32) >= p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p)), keep


class OnnxDropout(nn.Module):
    """ONNX Dropout as a module, so ``module.train()`` / ``module.eval()`` switch it.

    In eval mode it is the identity (ONNX inference semantics). ``return_mask`` adds the
    optional boolean mask output.
    """

    def __init__(self, p: float, return_mask: bool = False) -> None:
        super().__init__()
        self.p = float(p)
        self.return_mask = return_mask

    def forward(self, x: torch.Tensor) -> Any:
        if not self.return_mask:
            if not self.training or self.p == 0.0:
                return x
            return F.dropout(x, self.p, True)
        if not self.training or self.p == 0.0:
            return x, torch.ones_like(x, dtype=torch.bool)
        keep = torch.rand_like(x, dtype=torch.float32) >= self.p
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p)), keep

    def extra_repr(self) -> str:
        return f"p={self.p}, return_mask={self.return_mask}"


# ---------------------------------------------------------------------------------------------
# Converters
# ---------------------------------------------------------------------------------------------


def _attr_str(value: Any, default: str) -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else str(value)


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
    # Identity node (`__recompute_output_in_backward_pass`).
    return [ctx.call(onnx_identity, ctx.inputs[0])]


@register_converter("Constant")
def convert_constant(ctx: NodeContext) -> list[Any]:
    return [ctx.constant_attribute_value()]


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
    approximate = _attr_str(ctx.attrs.get("approximate"), "none")
    return [ctx.call(F.gelu, ctx.inputs[0], approximate=approximate)]


@register_converter("Gelu", GRAPHCORE_DOMAINS)
def convert_gc_gelu(ctx: NodeContext) -> list[Any]:
    # poplibs' GELU (what ai.graphcore::Gelu runs) is the tanh approximation.
    return [ctx.call(F.gelu, ctx.inputs[0], approximate="tanh")]


@register_converter("GeluErf", GRAPHCORE_DOMAINS)
def convert_gc_gelu_erf(ctx: NodeContext) -> list[Any]:
    return [ctx.call(F.gelu, ctx.inputs[0], approximate="none")]


@register_converter("Detach", GRAPHCORE_DOMAINS)
def convert_gc_detach(ctx: NodeContext) -> list[Any]:
    return [ctx.call(torch.Tensor.detach, ctx.inputs[0])]


@register_converter("Scale", GRAPHCORE_DOMAINS)
def convert_gc_scale(ctx: NodeContext) -> list[Any]:
    return [ctx.call(torch.mul, ctx.inputs[0], float(ctx.attrs.get("scale", 1.0)))]


@register_converter("MatMul")
def convert_matmul(ctx: NodeContext) -> list[Any]:
    return [ctx.call(torch.matmul, ctx.inputs[0], ctx.inputs[1])]


def emit_fused_linear(ctx: NodeContext, x: Any, weight: Any, bias: Any) -> Any:
    """MatMul(x, W[in, out]) + b as one ``F.linear`` (bias fused into the GEMM epilogue)."""
    w_t = ctx.call(torch.t, weight)
    return ctx.call(F.linear, x, w_t, bias)


@register_converter("Gemm")
def convert_gemm(ctx: NodeContext) -> list[Any]:
    alpha = float(ctx.attrs.get("alpha", 1.0))
    beta = float(ctx.attrs.get("beta", 1.0))
    trans_a = int(ctx.attrs.get("transA", 0))
    trans_b = int(ctx.attrs.get("transB", 0))
    a, b = ctx.inputs[0], ctx.inputs[1]
    c = ctx.input_or_none(2)
    if trans_a:
        a = ctx.call(torch.t, a)
    if alpha == 1.0 and (c is None or beta == 1.0):
        w = b if trans_b else ctx.call(torch.t, b)
        return [ctx.call(F.linear, a, w, c)]
    if trans_b:
        b = ctx.call(torch.t, b)
    if c is None or beta == 0.0:
        out = ctx.call(torch.mm, a, b)
        return [ctx.call(torch.mul, out, alpha) if alpha != 1.0 else out]
    return [ctx.call(torch.addmm, c, a, b, beta=beta, alpha=alpha)]


@register_converter("Softmax")
def convert_softmax(ctx: NodeContext) -> list[Any]:
    return [_softmax_like(ctx, F.softmax)]


@register_converter("LogSoftmax")
def convert_log_softmax(ctx: NodeContext) -> list[Any]:
    return [_softmax_like(ctx, F.log_softmax)]


def _softmax_like(ctx: NodeContext, fn: Callable[..., Any]) -> Any:
    if ctx.opset >= 13:
        return ctx.call(fn, ctx.inputs[0], int(ctx.attrs.get("axis", -1)))
    axis = int(ctx.attrs.get("axis", 1))
    rank = ctx.rank(0)
    if rank is not None and axis % rank == rank - 1:
        return ctx.call(fn, ctx.inputs[0], -1)
    return ctx.call(onnx_softmax_coerced, ctx.inputs[0], axis, fn is F.log_softmax)


@register_converter("LayerNormalization")
def convert_layer_norm(ctx: NodeContext) -> list[Any]:
    axis = int(ctx.attrs.get("axis", -1))
    eps = float(ctx.attrs.get("epsilon", 1e-5))
    x, scale = ctx.inputs[0], ctx.inputs[1]
    bias = ctx.input_or_none(2)
    stats = ctx.output_used(1) or ctx.output_used(2)
    rank = ctx.rank(0)
    x_shape = ctx.shape(0)
    norm_shape: tuple[int, ...] | None = None
    if rank is not None:
        axis_n = axis % rank
        if x_shape is not None and all(d is not None for d in x_shape[axis_n:]):
            norm_shape = tuple(int(d) for d in x_shape[axis_n:])  # type: ignore[arg-type]
    if norm_shape is None and axis == -1:
        s_shape = ctx.shape(1)
        if s_shape is not None and len(s_shape) >= 1 and s_shape[-1] is not None:
            norm_shape = (int(s_shape[-1]),)
    fits = (
        norm_shape is not None
        and ctx.shape(1) == norm_shape
        and (bias is None or ctx.shape(2) == norm_shape)
    )
    if not stats and fits:
        return [ctx.call(F.layer_norm, x, norm_shape, scale, bias, eps)]
    out = ctx.call(onnx_layer_norm, x, scale, bias, axis, eps, stats)
    if not stats:
        return [out]
    return [ctx.item(out, 0), ctx.item(out, 1), ctx.item(out, 2)]


@register_converter("GroupNormalization", GRAPHCORE_DOMAINS)
def convert_gc_group_norm(ctx: NodeContext) -> list[Any]:
    groups = int(ctx.attrs.get("num_groups", 1))
    eps = float(ctx.attrs.get("epsilon", 1e-5))
    x, scale, bias = ctx.inputs[0], ctx.inputs[1], ctx.inputs[2]
    if not (ctx.output_used(1) or ctx.output_used(2)):
        if groups == 1 and ctx.rank(0) == 2:
            c = ctx.shape(1)
            if c is not None and len(c) == 1 and c[0] is not None:
                return [ctx.call(F.layer_norm, x, (int(c[0]),), scale, bias, eps)]
        return [ctx.call(F.group_norm, x, groups, scale, bias, eps)]
    out = ctx.call(onnx_group_norm_stats, x, scale, bias, groups, eps)
    return [ctx.item(out, 0), ctx.item(out, 1), ctx.item(out, 2)]


@register_converter("Dropout")
def convert_dropout(ctx: NodeContext) -> list[Any]:
    x = ctx.inputs[0]
    want_mask = ctx.output_used(1)
    ratio: Any = float(ctx.attrs.get("ratio", 0.5))
    if ctx.has_input(1):
        ratio = float(ctx.const_scalar(1)) if ctx.is_static(1) else ctx.inputs[1]
    training: Any = True  # absent training_mode: follow module.train() / module.eval()
    if ctx.has_input(2):
        training = bool(ctx.const_scalar(2)) if ctx.is_static(2) else ctx.inputs[2]
    if ctx.attrs.get("is_test"):
        training = False
    if not isinstance(ratio, float) or not isinstance(training, bool):
        out = ctx.call(onnx_dropout_dynamic, x, ratio, training)
        return [ctx.item(out, 0), ctx.item(out, 1)]
    if not training or ratio == 0.0:
        y = ctx.call(onnx_identity, x)
        if not want_mask:
            return [y]
        return [y, ctx.call(torch.ones_like, x, dtype=torch.bool)]
    out = ctx.call_module(OnnxDropout(ratio, return_mask=want_mask), x)
    if not want_mask:
        return [out]
    return [ctx.item(out, 0), ctx.item(out, 1)]


@register_converter("Gather")
def convert_gather(ctx: NodeContext) -> list[Any]:
    axis = int(ctx.attrs.get("axis", 0))
    data, indices = ctx.inputs[0], ctx.inputs[1]
    d_shape = ctx.shape(0)
    if ctx.is_param(0) and d_shape is not None and len(d_shape) == 2 and axis in (0, -2):
        return [ctx.call(F.embedding, indices, data)]
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


@register_converter("Attention")
def convert_attention(ctx: NodeContext) -> list[Any]:
    if ctx.output_used(3):
        raise NotImplementedError(
            f"Attention node {ctx.name!r}: the qk_matmul_output output is not supported"
        )
    q_heads = ctx.attrs.get("q_num_heads")
    kv_heads = ctx.attrs.get("kv_num_heads")
    scale = ctx.attrs.get("scale")
    scale = None if scale is None else float(scale)
    is_causal = bool(int(ctx.attrs.get("is_causal", 0)))
    softcap = float(ctx.attrs.get("softcap", 0.0))
    if ctx.has_input(4) or ctx.has_input(5) or ctx.output_used(1) or ctx.output_used(2):
        raise NotImplementedError(
            f"Attention node {ctx.name!r}: past/present key-value caches are not supported"
        )
    q, k, v = ctx.inputs[0], ctx.inputs[1], ctx.inputs[2]
    mask = ctx.input_or_none(3)
    rank = ctx.rank(0)
    if rank is None and q_heads is not None:
        rank = 3
    if rank == 3 and (q_heads is None or kv_heads is None):
        raise ValueError(
            f"Attention node {ctx.name!r}: 3-D inputs need q_num_heads and kv_num_heads"
        )
    q_shape, k_shape = ctx.shape(0), ctx.shape(1)
    seq_axis = 1 if rank == 3 else 2
    q_len = q_shape[seq_axis] if q_shape is not None and rank is not None else None
    k_len = k_shape[seq_axis] if k_shape is not None and rank is not None else None
    if rank == 3:
        hq, hk = int(q_heads), int(kv_heads)  # type: ignore[arg-type]
    else:
        hq = q_shape[1] if q_shape is not None and len(q_shape) == 4 else None
        hk = k_shape[1] if k_shape is not None and len(k_shape) == 4 else None
    if (
        rank not in (3, 4)
        or softcap
        or hq is None
        or hk is None
        or (is_causal and mask is not None and (q_len is None or k_len is None))
    ):
        # Shapes unknown at lowering time (or softcap): the helper decides at run time.
        return [
            ctx.call(onnx_attention, q, k, v, mask, q_heads, kv_heads, scale, is_causal, softcap)
        ]
    if rank == 3:
        q, k, v = (
            ctx.call(torch.transpose, ctx.call(torch.unflatten, t, -1, (h, -1)), 1, 2)
            for t, h in ((q, hq), (k, hk), (v, hk))
        )
    if is_causal and mask is not None:
        mask = ctx.call(onnx_causal_mask, mask, int(q_len), int(k_len))  # type: ignore[arg-type]
        is_causal = False
    kwargs: dict[str, Any] = {"attn_mask": mask, "is_causal": is_causal, "scale": scale}
    if hq != hk:
        kwargs["enable_gqa"] = True
    y = ctx.call(F.scaled_dot_product_attention, q, k, v, **kwargs)
    if rank == 3:
        y = ctx.call(torch.flatten, ctx.call(torch.transpose, y, 1, 2), 2)
    return [y]


def _reduction_name(value: Any, default: str = "mean") -> str:
    if value is None:
        return default
    if isinstance(value, int):  # popart.ReductionType: Sum=0, Mean=1, NoReduction=2
        return {0: "sum", 1: "mean", 2: "none"}[value]
    name = _attr_str(value, default).lower()
    return {"noreduction": "none"}.get(name, name)


def _long_labels(ctx: NodeContext) -> Any:
    """Labels as int64 (torch's losses need it); no node when they are int64 already."""
    if ctx.dtype(1) == torch.int64:
        return ctx.inputs[1]
    return ctx.call(torch.Tensor.long, ctx.inputs[1])


def _class_weight(ctx: NodeContext) -> Any:
    """The optional class-weight input, detached: torch's NLL has no gradient for it."""
    weight = ctx.input_or_none(2)
    return None if weight is None else ctx.call(torch.Tensor.detach, weight)


@register_converter("SoftmaxCrossEntropyLoss")
def convert_softmax_cross_entropy(ctx: NodeContext) -> list[Any]:
    reduction = _reduction_name(ctx.attrs.get("reduction"))
    ignore = ctx.attrs.get("ignore_index")
    ignore_index = -100 if ignore is None else int(ignore)
    scores = ctx.inputs[0]
    labels = _long_labels(ctx)
    weight = _class_weight(ctx)
    if not ctx.output_used(1):
        return [
            ctx.call(
                F.cross_entropy,
                scores,
                labels,
                weight=weight,
                ignore_index=ignore_index,
                reduction=reduction,
            )
        ]
    log_prob = ctx.call(F.log_softmax, scores, 1)
    loss = ctx.call(
        F.nll_loss, log_prob, labels, weight=weight, ignore_index=ignore_index, reduction=reduction
    )
    return [loss, log_prob]


@register_converter("NegativeLogLikelihoodLoss")
def convert_nll(ctx: NodeContext) -> list[Any]:
    reduction = _reduction_name(ctx.attrs.get("reduction"))
    ignore = ctx.attrs.get("ignore_index")
    ignore_index = -100 if ignore is None else int(ignore)
    labels = _long_labels(ctx)
    return [
        ctx.call(
            F.nll_loss,
            ctx.inputs[0],
            labels,
            weight=_class_weight(ctx),
            ignore_index=ignore_index,
            reduction=reduction,
        )
    ]


@register_converter("Nll", GRAPHCORE_DOMAINS)
def convert_gc_nll(ctx: NodeContext) -> list[Any]:
    # Graphcore Nll: probabilities (class-last), loss = -log p[label]; Mean divides by the
    # number of non-ignored labels, as PopART does when ignoreIndex is set.
    reduction = _reduction_name(ctx.attrs.get("reduction"), "sum")
    ignore = ctx.attrs.get("ignoreIndex")
    ignore_index = -100 if ignore is None else int(ignore)
    probs = ctx.inputs[0]
    log_probs = (
        probs if int(ctx.attrs.get("inputIsLogProbability", 0)) else ctx.call(torch.log, probs)
    )
    return [ctx.call(onnx_nll_class_last, log_probs, ctx.inputs[1], ignore_index, reduction)]


@register_converter("Conv")
def convert_conv(ctx: NodeContext) -> list[Any]:
    w_shape = ctx.shape(1)
    if w_shape is None:
        raise NotImplementedError(f"Conv node {ctx.name!r}: the weight's shape must be known")
    nd = len(w_shape) - 2
    fns = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
    if nd not in fns:
        raise NotImplementedError(f"Conv node {ctx.name!r}: {nd}-D convolution")
    kernel = [int(k) for k in ctx.attrs.get("kernel_shape", w_shape[2:])]
    strides = [int(s) for s in ctx.attrs.get("strides", [1] * nd)]
    dilations = [int(d) for d in ctx.attrs.get("dilations", [1] * nd)]
    group = int(ctx.attrs.get("group", 1))
    auto_pad = _attr_str(ctx.attrs.get("auto_pad"), "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        x_shape = ctx.shape(0)
        pads_begin, pads_end = [], []
        for i in range(nd):
            in_len = None if x_shape is None else x_shape[2 + i]
            if strides[i] != 1 and in_len is None:
                raise NotImplementedError(
                    f"Conv node {ctx.name!r}: auto_pad {auto_pad} with strides needs static shape"
                )
            out_len = -(-int(in_len) // strides[i]) if in_len is not None else None
            total = (
                dilations[i] * (kernel[i] - 1)
                if out_len is None
                else max(
                    0, (out_len - 1) * strides[i] + dilations[i] * (kernel[i] - 1) + 1 - int(in_len)
                )  # type: ignore[arg-type]
            )
            small, big = total // 2, total - total // 2
            pads_begin.append(small if auto_pad == "SAME_UPPER" else big)
            pads_end.append(big if auto_pad == "SAME_UPPER" else small)
    elif auto_pad == "VALID":
        pads_begin, pads_end = [0] * nd, [0] * nd
    else:
        pads = [int(p) for p in ctx.attrs.get("pads", [0] * (2 * nd))]
        pads_begin, pads_end = pads[:nd], pads[nd:]
    x = ctx.inputs[0]
    padding: Any = tuple(pads_begin)
    if pads_begin != pads_end:
        torch_pad: list[int] = []
        for i in reversed(range(nd)):
            torch_pad += [pads_begin[i], pads_end[i]]
        x = ctx.call(F.pad, x, tuple(torch_pad))
        padding = 0
    return [
        ctx.call(
            fns[nd],
            x,
            ctx.inputs[1],
            ctx.input_or_none(2),
            tuple(strides),
            padding,
            tuple(dilations),
            group,
        )
    ]
