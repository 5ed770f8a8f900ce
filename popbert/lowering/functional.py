"""The python the lowered graph calls at run time, where one torch call is not ONNX enough.

Converters (:mod:`popbert.lowering.converters`) prefer emitting plain torch calls; these
``onnx_*`` functions are emitted only where ONNX semantics need a little python at run time
(shapes unknown at lowering time, negative indices or steps, integer division of unknown dtype,
the stats outputs of the normalisations). They live apart from the converters because they are
the lowered module's run-time code, not lowering-time logic: plain functions with stable names,
so ``torch.compile`` traces straight through them and the generated ``forward`` reads well.
:class:`OnnxDropout` is the one module: it follows ``module.train()`` / ``module.eval()``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from popbert.lowering.dropout import dropout


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
            return dropout(x, self.p)
        if not self.training or self.p == 0.0:
            return x, torch.ones_like(x, dtype=torch.bool)
        keep = torch.rand_like(x, dtype=torch.float32) >= self.p
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p)), keep

    def extra_repr(self) -> str:
        return f"p={self.p}, return_mask={self.return_mask}"
