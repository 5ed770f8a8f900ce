"""Converters of the neural-network ops: MatMul/Gemm, softmax, norms, attention, dropout, losses.

Convolution is here too. They prefer torch's fused kernels (``F.linear``, ``F.layer_norm``,
``F.scaled_dot_product_attention``, ``F.cross_entropy``) because the lowered module is
benchmarked against Hugging Face BERT, and fall back to a :mod:`popbert.lowering.functional`
helper only where static shapes are unknown or ONNX asks for more than the kernel gives
(LayerNormalization's Mean/InvStdDev outputs, Attention's softcap). The MatMul + Add fusion is a
pass of its own (:mod:`popbert.lowering.fusion`), and so is attention over packed rows'
block-diagonal mask (:mod:`popbert.lowering.block_attention`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from popbert.lowering.block_attention import BlockDiagonalAttention
from popbert.lowering.context import NodeContext, register_converter
from popbert.lowering.functional import (
    OnnxDropout,
    onnx_attention,
    onnx_causal_mask,
    onnx_dropout_dynamic,
    onnx_identity,
    onnx_layer_norm,
    onnx_softmax_coerced,
)


@register_converter("MatMul")
def convert_matmul(ctx: NodeContext) -> list[Any]:
    return [ctx.call(torch.matmul, ctx.inputs[0], ctx.inputs[1])]


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
    segments = ctx.block_segments(3)
    if segments is not None and not is_causal and hq == hk:
        y = ctx.call_module(BlockDiagonalAttention(scale), q, k, v, segments)
        if rank == 3:
            y = ctx.call(torch.flatten, ctx.call(torch.transpose, y, 1, 2), 2)
        return [y]
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


def loss_reduction(value: Any, default: str = "mean") -> str:
    """A loss's ``reduction`` attribute as torch spells it: ONNX's string or PopART's enum."""
    if value is None:
        return default
    if isinstance(value, int):  # popart.ReductionType: Sum=0, Mean=1, NoReduction=2
        return {0: "sum", 1: "mean", 2: "none"}[value]
    name = str(value).lower()
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
    reduction = loss_reduction(ctx.attrs.get("reduction"))
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
    reduction = loss_reduction(ctx.attrs.get("reduction"))
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
    auto_pad = ctx.str_attr("auto_pad", "NOTSET")
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
