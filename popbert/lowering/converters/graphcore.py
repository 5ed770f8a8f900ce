"""Converters of PopART's own ``ai.graphcore`` ops, which the Builder's ``popart`` dialect emits.

They follow what PopART runs on the IPU: ``Gelu`` is poplibs' tanh approximation, ``GeluErf`` the
exact erf form (what the popart dialect emits for BERT), ``Nll`` takes probabilities with the
class axis last (fed by a Softmax, the pair lowers to ``log_softmax`` + NLL, as PopART fuses its
gradient). Each is registered under every spelling of the domain in
:data:`~popbert.lowering.context.GRAPHCORE_DOMAINS`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from popbert.distributed.gather import gather_rows
from popbert.lowering.context import GRAPHCORE_DOMAINS, NodeContext, register_converter
from popbert.lowering.converters.nn import loss_reduction
from popbert.lowering.functional import onnx_group_norm_stats, onnx_nll_class_last


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


@register_converter("ReplicatedAllGather", GRAPHCORE_DOMAINS)
def convert_gc_replicated_all_gather(ctx: NodeContext) -> list[Any]:
    return [ctx.call(gather_rows, ctx.inputs[0])]


@register_converter("Scale", GRAPHCORE_DOMAINS)
def convert_gc_scale(ctx: NodeContext) -> list[Any]:
    return [ctx.call(torch.mul, ctx.inputs[0], float(ctx.attrs.get("scale", 1.0)))]


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


@register_converter("Nll", GRAPHCORE_DOMAINS)
def convert_gc_nll(ctx: NodeContext) -> list[Any]:
    # Graphcore Nll: probabilities (class-last), loss = -log p[label]; Mean divides by the
    # number of non-ignored labels, as PopART does when ignoreIndex is set.
    reduction = loss_reduction(ctx.attrs.get("reduction"), "sum")
    ignore = ctx.attrs.get("ignoreIndex")
    ignore_index = -100 if ignore is None else int(ignore)
    probs = ctx.inputs[0]
    if int(ctx.attrs.get("inputIsLogProbability", 0)):
        log_probs = probs
    else:
        logits = _softmax_logits(probs)
        log_probs = (
            ctx.call(torch.log, probs) if logits is None else ctx.call(F.log_softmax, logits, -1)
        )
    return [ctx.call(onnx_nll_class_last, log_probs, ctx.inputs[1], ignore_index, reduction)]


def _softmax_logits(probs: Any) -> Any:
    """The logits when ``probs`` is a last-axis Softmax node's output, else None.

    Softmax + Nll is how PopART spells a cross-entropy (Graphcore's BERT does), and PopART
    fuses the pair's gradient into ``p - onehot`` (its NlllWithSoftmaxGradDirect pattern). The
    lowering does the same with ``log_softmax``: ``log(softmax(x))`` is -inf once a probability
    underflows and its gradient divides by ``p``, while ``log_softmax`` is stable and equals
    the fused onnx ``SoftmaxCrossEntropyLoss`` bit for bit. The Softmax node itself is left to
    dead-code elimination when nothing else reads it.
    """
    if not isinstance(probs, fx.Node) or probs.op != "call_function":
        return None
    if probs.meta.get("onnx", {}).get("op_type") != "Softmax" or probs.target is not F.softmax:
        return None
    if len(probs.args) != 2 or probs.args[1] != -1 or probs.kwargs:
        return None
    return probs.args[0]
