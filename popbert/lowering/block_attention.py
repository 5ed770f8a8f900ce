"""Attention within each packed sequence, without the dense ``[B, 1, S, S]`` mask; and the
explicit attention chain run as one call.

The lowering finds the block-diagonal mask of packed rows and the attention that reads it, and
runs each sequence's attention on its own (about Σ len² work instead of B · S²), with the same
result for every real token. How, and when it falls back to the dense mask: docs/design.md,
section "popbert.lowering.block_attention". The explicit ``MatMul → Mul → Add(mask) → Softmax →
MatMul`` chain (the popart dialect's attention) runs as the fused ``Attention`` op does, so both
dialects lower to the same kernels and compute the same bits.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import Tensor, nn

from popbert.graph.annotations import ANNOTATION_PREFIX
from popbert.lowering.context import STANDARD_DOMAINS, NodeContext
from popbert.lowering.dropout import dropout

log = logging.getLogger(__name__)

__all__ = [
    "BUCKET",
    "MAX_MASK_VALUE",
    "MAX_WORK_FRACTION",
    "BlockDiagonalAttention",
    "Bucket",
    "BucketPlan",
    "AttentionChain",
    "attention_scale",
    "bucket_plan",
    "dense_attention",
    "emit_attention_chain",
    "find_attention_chains",
    "find_block_diagonal_masks",
]

#: Sequences are grouped by length rounded up to a multiple of this many tokens: at most
#: ``S / BUCKET`` attention calls per layer, each padded by less than BUCKET tokens.
BUCKET = 32
#: Attend per sequence only when the buckets' ``Σ n·L²`` is at most this fraction of the dense
#: ``B·S²``: gathering and scattering the tokens costs about what 10% of the attention does
#: (L4 H256 on CPU, dropout 0.1: at 0.99 and 0.92 per-sequence steps were 7% and 4% slower, at
#: 0.89 5% faster, at 0.21 1.66x faster; `benchmarks/packing_throughput.py`).
MAX_WORK_FRACTION = 0.9
#: The mask's "drop" value must be at most this (an exact zero after softmax in FP32).
MAX_MASK_VALUE = -1e4


# -- recognising the graph's block-diagonal mask ------------------------------------------------


class _Graph:
    """Producers, consumers and constant values of an ONNX graph, for pattern matching."""

    def __init__(self, nodes: Sequence[onnx.NodeProto], initializers: Mapping[str, np.ndarray],
                 use_count: Mapping[str, int]) -> None:
        self.nodes = nodes
        self.producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
        self.initializers = initializers
        self.use_count = use_count

    def node(self, tensor: str, op_type: str) -> onnx.NodeProto | None:
        i = self.producer.get(tensor)
        if i is None:
            return None
        node = self.nodes[i]
        ok = node.op_type == op_type and node.domain in STANDARD_DOMAINS
        return node if ok else None

    def constant(self, tensor: str) -> np.ndarray | None:
        if tensor in self.initializers:
            return self.initializers[tensor]
        node = self.node(tensor, "Constant")
        if node is None:
            return None
        for attr in node.attribute:
            if attr.name == "value":
                return numpy_helper.to_array(attr.t)
            if attr.name in ("value_float", "value_int"):
                return np.array(onnx.helper.get_attribute_value(attr))
        return None

    def scalar(self, tensor: str) -> float | None:
        value = self.constant(tensor)
        return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None

    def unsqueezed(self, tensor: str, axis: int) -> str | None:
        """The input of ``Unsqueeze(x, [axis])`` producing ``tensor`` (axes from opset 13 as an
        input, before as an attribute)."""
        node = self.node(tensor, "Unsqueeze")
        if node is None:
            return None
        axes = None
        if len(node.input) > 1 and node.input[1]:
            value = self.constant(node.input[1])
            axes = None if value is None else [int(a) for a in value.reshape(-1)]
        else:
            for attr in node.attribute:
                if attr.name == "axes":
                    axes = list(attr.ints)
        return node.input[0] if axes == [axis] else None

    def single_use(self, tensor: str) -> bool:
        return self.use_count.get(tensor, 0) == 1


def _segments_of_allowed(graph: _Graph, allowed: str) -> str | None:
    """``And(Equal(idx[:, :, None], idx[:, None, :]), Greater(idx[:, None, :], 0))`` → idx."""
    node = graph.node(allowed, "And")
    if node is None:
        return None
    for same_name, real_name in (node.input, reversed(node.input)):
        same, real = graph.node(same_name, "Equal"), graph.node(real_name, "Greater")
        if same is None or real is None:
            continue
        if graph.scalar(real.input[1]) != 0:
            continue
        keys = graph.unsqueezed(real.input[0], 1)
        a, b = graph.unsqueezed(same.input[0], 2), graph.unsqueezed(same.input[1], 1)
        if a is None or b is None:  # Equal is symmetric
            a, b = graph.unsqueezed(same.input[1], 2), graph.unsqueezed(same.input[0], 1)
        if keys is not None and a == b == keys:
            return keys
    return None


def find_block_diagonal_masks(nodes: Sequence[onnx.NodeProto],
                              initializers: Mapping[str, np.ndarray],
                              use_count: Mapping[str, int]) -> dict[str, str]:
    """Map each additive block-diagonal mask tensor → the ``sequence_index`` tensor it is made
    of, for masks built as ``popbert.builders.layers.packed_attention_mask`` builds them:
    ``Unsqueeze((1 - Cast(And(Equal(i[:, :, None], i[:, None, :]), i[:, None, :] > 0))) · c,
    [1])`` with a constant ``c ≤ -1e4``."""
    graph = _Graph(nodes, initializers, use_count)
    masks: dict[str, str] = {}
    for node in nodes:
        if node.op_type != "Unsqueeze" or node.domain not in STANDARD_DOMAINS:
            continue
        mask = node.output[0]
        scaled = graph.node(graph.unsqueezed(mask, 1) or "", "Mul")
        if scaled is None:
            continue
        for inverted_name, big_name in (scaled.input, reversed(scaled.input)):
            big = graph.scalar(big_name)
            inverted = graph.node(inverted_name, "Sub")
            if big is None or big > MAX_MASK_VALUE or inverted is None:
                continue
            if graph.scalar(inverted.input[0]) != 1.0:
                continue
            cast = graph.node(inverted.input[1], "Cast")
            if cast is None:
                continue
            segments = _segments_of_allowed(graph, cast.input[0])
            if segments is not None:
                masks[mask] = segments  # int32/int64 (the popart dialect casts its UINT32)
                break
    return masks


@dataclass(frozen=True)
class AttentionChain:
    """``MatMul(q, kᵀ) · scale + mask → Softmax → [Dropout] → MatMul(·, v)`` in ONNX nodes."""

    nodes: tuple[int, ...]  # node indices, the last is the output MatMul
    q: str  # [B, heads, S, d]
    k_transposed: str  # [B, heads, d, S]
    v: str  # [B, heads, S, d]
    mask: str  # the additive mask
    segments: str | None  # the sequence_index a block-diagonal mask is made of, else None
    scale: float
    dropout: float


def _annotations(node: onnx.NodeProto) -> list[tuple[str, bytes]]:
    return sorted((a.name, a.SerializeToString()) for a in node.attribute
                  if a.name.startswith(ANNOTATION_PREFIX))


def _scaled_scores(graph: _Graph, name: str) -> tuple[onnx.NodeProto, onnx.NodeProto, str,
                                                      float] | None:
    """(the Mul, the MatMul, the MatMul's output, the scale) when ``name`` is
    ``MatMul(q, kᵀ) · scale`` with a constant scalar scale; else None."""
    mul = graph.node(name, "Mul")
    if mul is None:
        return None
    for scores_name, scale_name in (mul.input, reversed(mul.input)):
        scale = graph.scalar(scale_name)
        scores = graph.node(scores_name, "MatMul")
        if scale is not None and scores is not None:
            return mul, scores, scores_name, float(scale)
    return None


def find_attention_chains(nodes: Sequence[onnx.NodeProto],
                          initializers: Mapping[str, np.ndarray],
                          use_count: Mapping[str, int],
                          block_masks: Mapping[str, str]) -> dict[int, AttentionChain]:
    """The explicit attention chains to run as one call, by output MatMul index: those over a
    block-diagonal mask (one of ``block_masks``, which maps it to its ``sequence_index``), and
    those over any other additive mask without dropout (with dropout they stay separate ops, so
    the random stream is the Dropout converter's).

    Every intermediate tensor must have that one consumer and every node the same device /
    stage / recompute annotations, so the chain can run as one call without changing what the
    backward pass keeps or where the work is placed.
    """
    graph = _Graph(nodes, initializers, use_count)
    chains: dict[int, AttentionChain] = {}
    for index, context in enumerate(nodes):
        if context.op_type != "MatMul" or context.domain not in STANDARD_DOMAINS:
            continue
        probs_name, v = context.input
        dropout, ratio = graph.node(probs_name, "Dropout"), 0.0
        softmax_name = probs_name
        if dropout is not None:
            if len(dropout.input) > 2 and dropout.input[2]:
                continue  # a training_mode input: leave it to the Dropout converter
            ratio_value = (graph.scalar(dropout.input[1]) if len(dropout.input) > 1
                           and dropout.input[1] else next(
                               (a.f for a in dropout.attribute if a.name == "ratio"), 0.5))
            if ratio_value is None or (len(dropout.output) > 1 and dropout.output[1]
                                       and use_count.get(dropout.output[1], 0)):
                continue
            ratio, softmax_name = float(ratio_value), dropout.input[0]
        softmax = graph.node(softmax_name, "Softmax")
        if softmax is None:
            continue
        axis = next((a.i for a in softmax.attribute if a.name == "axis"), -1)
        if axis not in (-1, 3):
            continue
        add = graph.node(softmax.input[0], "Add")
        if add is None:
            continue
        for scaled_name, mask_name in (add.input, reversed(add.input)):  # noqa: B007
            if mask_name not in block_masks and ratio != 0.0:
                continue
            found = _scaled_scores(graph, scaled_name)
            if found is not None:
                mul, scores, scores_name, scale = found
                break
        else:
            continue
        chain = [scores, mul, add, softmax] + ([dropout] if dropout is not None else [])
        inner = [scores_name, scaled_name, softmax.input[0], softmax_name] + (
            [probs_name] if dropout is not None else [])
        if not all(graph.single_use(t) for t in inner):
            continue
        if any(_annotations(n) != _annotations(context) for n in chain):
            continue
        chains[index] = AttentionChain(
            nodes=tuple(graph.producer[n.output[0]] for n in chain) + (index,),
            q=scores.input[0], k_transposed=scores.input[1], v=v, mask=mask_name,
            segments=block_masks.get(mask_name), scale=scale, dropout=ratio)
    return chains


def attention_scale(scale: float | None, head_dim: int) -> float | None:
    """``scale``, or None when it is the default ``1/√d`` rounded to FP32 (the graph's
    constant): SDPA then derives the scale itself, exactly as for the fused ``Attention`` op,
    which has no scale attribute — passing the rounded value would differ in the last bit."""
    if scale is None or scale == float(np.float32(1.0 / math.sqrt(head_dim))):
        return None
    return scale


def dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """``softmax(q kᵀ · scale + mask) v`` over ``[B, heads, S, d]``: the explicit chain as the
    ``Attention`` converter runs the fused op."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                          scale=attention_scale(scale, q.shape[-1]))


# -- running it ----------------------------------------------------------------------------------


def dense_block_mask(segments: Tensor, dtype: torch.dtype) -> Tensor:
    """The graph's additive mask ``[B, 1, S, S]`` (0 keep, -10000 drop) from ``segments``."""
    same = segments[:, :, None] == segments[:, None, :]
    allowed = same & (segments[:, None, :] > 0)
    return ((1.0 - allowed.to(dtype)) * -10000.0)[:, None]


def _packed_runs(segments: Tensor) -> tuple[list[int], list[int]] | None:
    """(start in the flattened ``[B·S]`` tokens, length) of every sequence, or None when some
    row is not in the packer's layout (each sequence one run, numbered upwards)."""
    rows, width = segments.shape
    flat = segments.reshape(-1).to("cpu", torch.int64)
    change = torch.ones_like(flat, dtype=torch.bool)
    change[1:] = flat[1:] != flat[:-1]
    change[::width] = True
    starts = change.nonzero().squeeze(1)
    ids = flat[starts]
    lengths = torch.diff(starts, append=torch.tensor([flat.numel()]))
    real = ids > 0
    starts, ids, lengths = starts[real], ids[real], lengths[real]
    same_row = (starts[1:] // width) == (starts[:-1] // width)
    if bool((same_row & (ids[1:] <= ids[:-1])).any()):
        return None  # an id repeats in a row after another: the dense mask links the runs
    return starts.tolist(), lengths.tolist()


@dataclass(frozen=True)
class Bucket:
    index: Tensor  # [n, L] token of each slot in the flattened [B·S] tokens (0 on padding)
    valid: Tensor  # [n, L] the slot holds a real token of its sequence


@dataclass(frozen=True)
class BucketPlan:
    buckets: list[Bucket]
    positions: Tensor  # the real slots' tokens, bucket after bucket (where outputs go back)


def bucket_plan(segments: Tensor) -> BucketPlan | None:
    """The sequences grouped by length rounded up to BUCKET; None when the dense attention is
    the better (or the only exact) choice."""
    runs = _packed_runs(segments)
    if runs is None:
        return None
    width = segments.shape[1]
    starts, lengths = runs
    groups: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        groups.setdefault(min(-(-length // BUCKET) * BUCKET, width), []).append(i)
    work = sum(len(members) * size * size for size, members in groups.items())
    if work > MAX_WORK_FRACTION * segments.shape[0] * width * width:
        return None  # too little to save: the dense masked attention is as fast
    buckets = []
    for size, members in sorted(groups.items()):
        start = torch.tensor([starts[i] for i in members])
        length = torch.tensor([lengths[i] for i in members])
        offset = torch.arange(size)
        valid = offset[None, :] < length[:, None]
        index = torch.where(valid, start[:, None] + offset[None, :], 0)
        buckets.append(Bucket(index.to(segments.device), valid.to(segments.device)))
    positions = torch.cat([b.index[b.valid] for b in buckets])
    return BucketPlan(buckets, positions)


class _PlanCache(threading.local):
    """The last plan of this thread: every layer of one forward reads the same
    ``sequence_index`` tensor, so the plan is built once per forward (pipeline stages run in
    threads of their own, hence one slot per thread)."""

    segments: Tensor | None = None
    version: int = -1
    plan: BucketPlan | None = None

    def get(self, segments: Tensor) -> BucketPlan | None:
        if self.segments is not segments or self.version != segments._version:
            self.segments, self.version = segments, segments._version
            self.plan = bucket_plan(segments)
        return self.plan


_PLANS = _PlanCache()


class BlockDiagonalAttention(nn.Module):
    """Softmax attention of ``[B, heads, S, d]`` q, k, v within each packed sequence.

    ``varlen=False`` (or a compiled call, rows not in the packer's layout, or rows so full that
    little is saved: :data:`MAX_WORK_FRACTION`) computes the dense masked attention instead;
    both give the same real-token outputs.
    """

    def __init__(self, scale: float | None, dropout: float = 0.0) -> None:
        super().__init__()
        self.scale = scale
        self.dropout = float(dropout)
        self.varlen = True

    def extra_repr(self) -> str:
        return f"scale={self.scale}, dropout={self.dropout}, varlen={self.varlen}"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, segments: Tensor) -> Tensor:
        scale = attention_scale(self.scale, q.shape[-1]) or 1.0 / math.sqrt(q.shape[-1])
        p = self.dropout if self.training else 0.0
        plan = None
        if self.varlen and not torch.compiler.is_compiling():
            plan = _PLANS.get(segments)
        if plan is None:
            return self._dense(q, k, v, segments, scale, p)
        return self._per_sequence(q, k, v, plan, scale, p)

    @staticmethod
    def _dense(q: Tensor, k: Tensor, v: Tensor, segments: Tensor, scale: float,
               p: float) -> Tensor:
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        probs = torch.softmax(scores + dense_block_mask(segments, scores.dtype), dim=-1)
        if p:
            probs = dropout(probs, p)
        return torch.matmul(probs, v)

    @staticmethod
    def _per_sequence(q: Tensor, k: Tensor, v: Tensor, plan: BucketPlan, scale: float,
                      p: float) -> Tensor:
        rows, heads, width, _ = q.shape
        # [B, h, S, d] → one row per token [B·S, h, d] (a view when q is a head-split of
        # [B, S, h·d], as the graph makes it).
        tokens = [t.transpose(1, 2).reshape(rows * width, heads, t.shape[-1]) for t in (q, k, v)]
        outputs = []
        for bucket in plan.buckets:
            qb, kb, vb = (t[bucket.index].transpose(1, 2) for t in tokens)  # [n, h, L, d]
            out = F.scaled_dot_product_attention(qb, kb, vb, dropout_p=p, scale=scale,
                                                 attn_mask=bucket.valid[:, None, None, :])
            outputs.append(out.transpose(1, 2)[bucket.valid])  # [real tokens, h, d]
        flat = q.new_zeros(rows * width, heads, v.shape[-1])
        flat = flat.index_copy(0, plan.positions, torch.cat(outputs))
        return flat.view(rows, width, heads, -1).transpose(1, 2)


def emit_attention_chain(ctx: NodeContext, chain: AttentionChain,
                         nodes: Sequence[onnx.NodeProto]) -> Any:
    """Lower an explicit attention chain (``ctx`` is its output MatMul) as one call: a
    :class:`BlockDiagonalAttention` over a block-diagonal mask, else :func:`dense_attention`;
    the fx node's meta names the chain."""
    ctx.meta["fused"] = [{"op_type": nodes[i].op_type, "name": nodes[i].name,
                          "outputs": list(nodes[i].output)} for i in chain.nodes[:-1]]
    k = ctx.call(torch.transpose, ctx.lookup(chain.k_transposed), -1, -2)
    q, v = ctx.lookup(chain.q), ctx.lookup(chain.v)
    if chain.segments is None:
        return ctx.call(dense_attention, q, k, v, ctx.lookup(chain.mask), chain.scale)
    module = BlockDiagonalAttention(chain.scale, chain.dropout)
    return ctx.call_module(module, q, k, v, ctx.lookup(chain.segments))
