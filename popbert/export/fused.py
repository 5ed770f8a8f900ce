"""ONNX Runtime's fused BERT kernels for an inference export (`popbert export --optimize`).

ONNX Runtime's transformer optimizer matches the graphs `torch.onnx` writes for Hugging Face
models; it does not recognise the opset-23 `Attention` popbert's builder emits, so it fused
nothing. popbert knows exactly what its own builder emits, so this module rewrites that graph
into ONNX Runtime's `com.microsoft` contrib operators itself:

- `EmbedLayerNormalization`: word + position + segment lookups, their sum and its LayerNorm;
- `Attention`: the packed QKV projection, its bias, the split and the attention itself, with
  the raw [B, S] 0/1 mask (the additive mask chain goes away);
- `SkipLayerNormalization`: residual add (+ the dense layer's bias) + LayerNorm; in pre-norm
  layers (GroupBERT) the un-normalised sum feeds the next residual through its fourth output;
- `BiasGelu`: the dense layer's bias + exact (erf) GELU.

Every rewrite is a pattern the builder's layers produce; anything else is left as it was, and
the export check (ONNX Runtime on the fused file against the torch backend on the standard
graph) proves each file that leaves `popbert.export.inference`.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

log = logging.getLogger(__name__)

CONTRIB = "com.microsoft"
# The additive mask chain's ops, from `builders.layers.attention_mask` (0/1 → 0/-10000).
_MASK_CHAIN_OPS = {"Cast", "Sub", "Mul", "Unsqueeze", "Shape", "Concat", "Expand"}


class _Graph:
    """Producers, consumers and initializers of a graph, and the edits a rewrite makes."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.nodes = list(model.graph.node)
        self.position = {id(node): index for index, node in enumerate(self.nodes)}
        self.initializers = {t.name: t for t in model.graph.initializer}
        self.inputs = {i.name for i in model.graph.input}
        self.outputs = {o.name for o in model.graph.output}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.nodes:
            for name in node.output:
                self.producer[name] = node
            for name in node.input:
                self.consumers[name].append(node)
        self.removed: set[int] = set()
        # Replacement nodes, placed where the last node of their pattern stood (so each one's
        # inputs are computed before it) or, with key -1, before every node.
        self.added: dict[int, list[onnx.NodeProto]] = defaultdict(list)
        self.fused: Counter[str] = Counter()
        shapes = onnx.shape_inference.infer_shapes(model)
        self.shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                       for v in [*shapes.graph.value_info, *shapes.graph.input,
                                 *shapes.graph.output]}

    def made_by(self, name: str, op_type: str) -> onnx.NodeProto | None:
        """The live node of `op_type` (standard domain) that produces `name`, if any."""
        node = self.producer.get(name)
        if (node is None or id(node) in self.removed or node.op_type != op_type
                or node.domain not in ("", "ai.onnx")):
            return None
        return node

    def only_feeds(self, name: str, node: onnx.NodeProto) -> bool:
        """`name` is read by `node` alone and is not a graph output (so it may disappear)."""
        readers = [n for n in self.consumers[name] if id(n) not in self.removed]
        return name not in self.outputs and readers == [node]

    def vector(self, name: str) -> np.ndarray | None:
        """The initializer `name` as an array if it is one (a weight or a constant)."""
        tensor = self.initializers.get(name)
        if tensor is None:
            producer = self.producer.get(name)
            if producer is not None and producer.op_type == "Constant":
                return numpy_helper.to_array(producer.attribute[0].t)
            return None
        return numpy_helper.to_array(tensor)

    def replace(self, old: Iterable[onnx.NodeProto], new: onnx.NodeProto, kind: str) -> None:
        old = list(old)
        self.added[max(self.position[id(n)] for n in old)].append(new)
        self.removed.update(id(n) for n in old)
        self.fused[kind] += 1

    def cast_input(self, name: str, to: int, suffix: str) -> str:
        """A Cast of graph input `name`, emitted once before every node."""
        cast = f"{name}_{suffix}"
        if cast not in self.producer:
            node = helper.make_node("Cast", [name], [cast], name=f"Fused/{cast}", to=to)
            self.added[-1].append(node)
            self.producer[cast] = node
        return cast

    def finish(self) -> onnx.ModelProto:
        """The graph with the rewrites applied and nodes nobody reads any more dropped."""
        ordered = list(self.added[-1])
        for index, node in enumerate(self.nodes):
            if id(node) not in self.removed:
                ordered.append(node)
            ordered.extend(self.added.get(index, ()))
        needed = set(self.outputs)
        kept: list[onnx.NodeProto] = []
        for node in reversed(ordered):  # dead-code elimination, outputs first
            if any(o in needed for o in node.output if o):
                kept.append(node)
                needed.update(i for i in node.input if i)
        del self.model.graph.node[:]
        self.model.graph.node.extend(reversed(kept))
        unused = [t for t in self.model.graph.initializer if t.name not in needed]
        for tensor in unused:
            self.model.graph.initializer.remove(tensor)
        del self.model.graph.value_info[:]
        if not any(o.domain == CONTRIB for o in self.model.opset_import):
            self.model.opset_import.append(helper.make_opsetid(CONTRIB, 1))
        return self.model


def _attribute(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


def _dense_output(g: _Graph, name: str) -> tuple[onnx.NodeProto, onnx.NodeProto, str] | None:
    """(MatMul, bias Add, bias name) if `name` is `x @ W + B` with a 1-D initializer B."""
    add = g.made_by(name, "Add")
    if add is None:
        return None
    for product, bias in (add.input, reversed(add.input)):
        matmul = g.made_by(product, "MatMul")
        vector = g.vector(bias)
        if matmul is not None and vector is not None and vector.ndim == 1 \
                and g.only_feeds(product, add):
            return matmul, add, bias
    return None


def _raw_mask(g: _Graph, additive: str) -> tuple[str, float] | None:
    """The graph input behind the additive attention mask `additive` and the value it adds for
    a masked key, if `additive` is `builders.layers.attention_mask`'s chain of one 0/1 input."""
    frontier, sources, scale = [additive], set(), None
    while frontier:
        name = frontier.pop()
        if name in g.inputs:
            sources.add(name)
            continue
        if name in g.initializers:
            continue
        node = g.producer.get(name)
        if node is None or node.op_type not in _MASK_CHAIN_OPS | {"Constant"}:
            return None
        if node.op_type == "Mul":
            for operand in node.input:
                value = g.vector(operand)
                if value is not None and value.size == 1:
                    scale = float(value.reshape(()))
        frontier.extend(node.input)
    if len(sources) != 1 or scale is None:
        return None
    return sources.pop(), scale


def _fuse_attention(g: _Graph, heads_hint: int) -> None:
    for node in g.nodes:
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx") \
                or id(node) in g.removed or len(node.input) < 4:
            continue
        split = g.made_by(node.input[0], "Split")
        if split is None or list(split.output) != list(node.input[:3]):
            continue
        dense = _dense_output(g, split.input[0])
        mask = _raw_mask(g, node.input[3])
        heads = _attribute(node, "q_num_heads", heads_hint)
        if dense is None or mask is None or _attribute(node, "kv_num_heads", heads) != heads \
                or _attribute(node, "is_causal", 0) or _attribute(node, "scale") is not None \
                or len(node.output) > 1 and any(node.output[1:]):
            continue
        matmul, bias_add, bias = dense
        weight = g.vector(matmul.input[1])
        if weight is None or weight.ndim != 2 or weight.shape[1] % 3 \
                or not g.only_feeds(bias_add.output[0], split):
            continue
        mask_input, filter_value = mask
        mask_index = g.cast_input(mask_input, TensorProto.INT32, "int32")
        fused = helper.make_node(
            "Attention", [matmul.input[0], matmul.input[1], bias, mask_index],
            [node.output[0]], name=f"{node.name or node.output[0]}/Fused", domain=CONTRIB,
            num_heads=int(heads), mask_filter_value=filter_value)
        g.replace([matmul, bias_add, split, node], fused, "Attention")


def _first_positions(g: _Graph, name: str) -> onnx.NodeProto | None:
    """The node that makes `name` the first rows of a table, position 0 on: a `Slice` from 0
    (a symbolic sequence axis) or a `Gather` of the constant 0..S-1 (a fixed one)."""
    node = g.made_by(name, "Slice")
    if node is not None:
        starts = g.vector(node.input[1])
        return node if starts is not None and not starts.any() else None
    node = g.made_by(name, "Gather")
    if node is not None:
        indices = g.vector(node.input[1])
        if indices is not None and indices.ndim == 1 and \
                np.array_equal(indices, np.arange(len(indices))):
            return node
    return None


def _fuse_embeddings(g: _Graph) -> None:
    for norm in g.nodes:
        if norm.op_type != "LayerNormalization" or id(norm) in g.removed \
                or _attribute(norm, "axis", -1) != -1 or len(norm.input) < 3:
            continue
        outer = g.made_by(norm.input[0], "Add")
        if outer is None or not g.only_feeds(norm.input[0], norm):
            continue
        found = None
        for inner_name, segments_name in (outer.input, reversed(outer.input)):
            inner, segments = g.made_by(inner_name, "Add"), g.made_by(segments_name, "Gather")
            if inner is not None and segments is not None and g.only_feeds(inner_name, outer):
                found = inner, segments
                break
        if found is None:
            continue
        inner, segments = found
        words = positions = None
        for words_name, positions_name in (inner.input, reversed(inner.input)):
            words = g.made_by(words_name, "Gather")
            positions = _first_positions(g, positions_name)
            if words is not None and words.input[1] in g.inputs and positions is not None:
                break
        if words is None or positions is None:
            continue
        ids, types = words.input[1], segments.input[1]
        if not (ids in g.inputs and types in g.inputs and words.input[0] in g.initializers
                and segments.input[0] in g.initializers
                and positions.input[0] in g.initializers
                and all(g.only_feeds(n.output[0], m) for n, m in
                        ((words, inner), (positions, inner), (segments, outer)))):
            continue
        fused = helper.make_node(
            "EmbedLayerNormalization",
            [g.cast_input(ids, TensorProto.INT32, "int32"),
             g.cast_input(types, TensorProto.INT32, "int32"),
             words.input[0], positions.input[0], segments.input[0], norm.input[1],
             norm.input[2]],
            [norm.output[0], f"{norm.output[0]}/mask_index"],
            name=f"{norm.name or norm.output[0]}/Fused", domain=CONTRIB,
            epsilon=float(_attribute(norm, "epsilon", 1e-5)))
        g.replace([words, positions, segments, inner, outer, norm], fused,
                  "EmbedLayerNormalization")


def _fuse_skip_norms(g: _Graph) -> None:
    for norm in g.nodes:
        if norm.op_type != "LayerNormalization" or id(norm) in g.removed \
                or _attribute(norm, "axis", -1) != -1 or len(norm.input) < 3 \
                or len(norm.output) > 1 and any(norm.output[1:]):
            continue
        residual = g.made_by(norm.input[0], "Add")
        if residual is None:
            continue
        a, b = residual.input
        old = [residual, norm]
        inputs = None
        for skip, branch in ((a, b), (b, a)):
            dense = _dense_output(g, branch)
            # A residual adds two [B, S, H] tensors; a dense layer's output is [B, S, H] when
            # its input is 3-D (shape inference loses it behind the grouped FFN's reshapes).
            if dense is not None and g.only_feeds(branch, residual) \
                    and len(g.shapes.get(skip) or ()) == 3 \
                    and len(g.shapes.get(dense[0].input[0]) or ()) in (0, 3):
                matmul, bias_add, bias = dense
                inputs = [matmul.output[0], skip, norm.input[1], norm.input[2], bias]
                old.append(bias_add)
                break
        if inputs is None:
            shape_a, shape_b = g.shapes.get(a), g.shapes.get(b)
            if not shape_a or shape_a != shape_b or len(shape_a) != 3:
                continue  # a broadcast add is not a residual
            inputs = [b, a, norm.input[1], norm.input[2]]
        outputs = [norm.output[0]]
        if not g.only_feeds(residual.output[0], norm):  # pre-norm: the sum is read on
            outputs += ["", "", residual.output[0]]
        fused = helper.make_node(
            "SkipLayerNormalization", inputs, outputs,
            name=f"{norm.name or norm.output[0]}/Fused", domain=CONTRIB,
            epsilon=float(_attribute(norm, "epsilon", 1e-5)))
        g.replace(old, fused, "SkipLayerNormalization")


def _fuse_bias_gelu(g: _Graph) -> None:
    for gelu in g.nodes:
        if gelu.op_type != "Gelu" or gelu.domain not in ("", "ai.onnx") \
                or id(gelu) in g.removed or _attribute(gelu, "approximate", "none") != "none":
            continue
        dense = _dense_output(g, gelu.input[0])
        if dense is None or not g.only_feeds(gelu.input[0], gelu):
            continue
        matmul, bias_add, bias = dense
        fused = helper.make_node("BiasGelu", [matmul.output[0], bias], [gelu.output[0]],
                                 name=f"{gelu.name or gelu.output[0]}/Fused", domain=CONTRIB)
        g.replace([bias_add, gelu], fused, "BiasGelu")


# Each fused operator and its rewrite, in the order they run (attention first: it takes the
# QKV bias that would otherwise look like a dense layer's).
REWRITES = {"Attention": _fuse_attention, "EmbedLayerNormalization": _fuse_embeddings,
            "SkipLayerNormalization": _fuse_skip_norms, "BiasGelu": _fuse_bias_gelu}


ALL_FUSIONS = tuple(REWRITES)
# The fused operators that pay on ONNX Runtime's CPU provider, measured on AVX-512 VNNI/AMX
# Xeons (benchmarks/RESULTS_inference.md): QAttention and the embedding kernel help INT8;
# SkipLayerNormalization's CPU kernel is slower than Add + LayerNormalization, and BiasGelu
# gains nothing once ORT has folded the bias into the (quantized) MatMul.
CPU_FUSIONS = ("Attention", "EmbedLayerNormalization")


def fuse_for_ort(model: onnx.ModelProto, num_heads: int,
                 fusions: Collection[str] = ALL_FUSIONS
                 ) -> tuple[onnx.ModelProto, dict[str, int]]:
    """A copy of popbert's FP32 inference graph `model` with ONNX Runtime's fused BERT contrib
    operators named in `fusions` (all by default), and how many of each it now has.
    Without SkipLayerNormalization the residual additions are kept apart from their
    LayerNorm (`residuals_apart`), or ORT would fuse them itself when it loads the file.
    `num_heads` is used where the graph's `Attention` does not say."""
    unknown = set(fusions) - set(REWRITES)
    if unknown:
        raise ValueError(f"unknown fusions {sorted(unknown)}; known: {', '.join(REWRITES)}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = _Graph(out)
    for name, rewrite in REWRITES.items():
        if name in fusions:
            rewrite(g, num_heads) if name == "Attention" else rewrite(g)
    fused = dict(sorted(g.fused.items()))
    result = g.finish()
    if "SkipLayerNormalization" not in fusions:
        result, apart = residuals_apart(result)
        if apart:
            fused["Sum"] = apart
    log.info("fused for ONNX Runtime: %s", ", ".join(f"{count} {op}" for op, count in
                                                     fused.items()) or "nothing")
    return result, fused


def residuals_apart(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of `model` whose residual additions before a LayerNormalization are `Sum` nodes
    (the same arithmetic), and how many: ONNX Runtime then cannot fuse them into its
    `SkipLayerNormalization` CPU kernel, which measured slower than `Add` + `LayerNormalization`
    (20-25% of a whole INT8 MiniLM call; benchmarks/RESULTS_inference.md)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    producer = {name: node for node in out.graph.node for name in node.output}
    changed = 0
    for node in out.graph.node:
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx"):
            residual = producer.get(node.input[0])
            if residual is not None and residual.op_type == "Add" \
                    and residual.domain in ("", "ai.onnx") \
                    and not any(i in {t.name for t in out.graph.initializer}
                                for i in residual.input):
                residual.op_type = "Sum"
                changed += 1
    return out, changed


__all__ = ["ALL_FUSIONS", "CONTRIB", "CPU_FUSIONS", "REWRITES", "fuse_for_ort", "residuals_apart"]
