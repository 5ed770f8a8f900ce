"""Lower an (annotated) ONNX ``ModelProto`` to a ``torch.fx.GraphModule``, once.

The annotated ONNX graph is popbert's program; the torch backend runs it by translating every
ONNX node into plain torch calls ahead of time (no interpretation of the proto per step), so the
result trains with autograd and is ``torch.compile``-friendly. The steps of :func:`lower_to_fx`
and the conventions of the lowered :class:`OnnxGraphModule` (parameter names, buffers, node
metadata, dropout): docs/design.md, section "popbert.lowering.lower".
"""

from __future__ import annotations

import copy
import keyword
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import torch
import torch.fx as fx
from torch import nn

from popbert.graph.shapes import weight_free_copy
from popbert.lowering.block_attention import (
    emit_attention_chain,
    find_attention_chains,
    find_block_diagonal_masks,
)
from popbert.lowering.context import (
    FLOAT_DTYPES,
    ONNX_TO_TORCH,
    Converter,
    LoweringError,
    NodeContext,
    ParamRef,
    UnsupportedOpError,
    ValueInfo,
    escape_param_name,
    normalize_domain,
    tensor_from_numpy,
)
from popbert.lowering.converters import CONVERTERS
from popbert.lowering.fusion import emit_fused_linear, find_linear_fusions

logger = logging.getLogger(__name__)

# Initializers of at most this many elements are read at lowering time by the pattern matchers
# (scales, mask constants, axes); weights are never copied for it.
_SMALL_CONSTANT = 16

__all__ = ["OnnxGraphModule", "lower_to_fx"]


class _Lowerer:
    """Holds the state of one lowering: the fx graph, the module under construction, values.

    It is the :class:`~popbert.lowering.context.LoweringState` that each node's
    :class:`~popbert.lowering.context.NodeContext` emits into.
    """

    def __init__(
        self, model: onnx.ModelProto, *, trainable: bool, static_shapes: bool, fuse_linear: bool
    ) -> None:
        self.model = model
        self.trainable = trainable
        self.static_shapes = static_shapes
        self.fuse_linear = fuse_linear
        self.opsets: dict[str, int] = {}
        for imp in model.opset_import:
            self.opsets[normalize_domain(imp.domain)] = int(imp.version)
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.env: dict[str, Any] = {}
        self.params: dict[str, nn.Parameter] = {}
        self.param_attr: dict[str, str] = {}
        self.persistent_buffers: set[str] = set()
        self.non_persistent_buffers: set[str] = set()
        self.used_params: set[str] = set()
        self.folded_params: set[str] = set()
        self._buffers_by_id: dict[int, str] = {}
        self._const_names: dict[int, str] = {}
        self._n_modules = 0
        self._n_consts = 0
        self.use_count: dict[str, int] = {}
        self.value_info: dict[str, ValueInfo] = {}
        self.block_masks: dict[str, str] = {}

    # -- values --------------------------------------------------------------------------------
    def lookup(self, name: str, consumer: str) -> Any:
        try:
            return self.env[name]
        except KeyError:
            raise LoweringError(
                f"node {consumer!r} reads tensor {name!r}, which no graph input, initializer or "
                "earlier node produces (is the graph topologically sorted?)"
            ) from None

    def buffer_for(self, tensor: torch.Tensor) -> str:
        """Module attribute holding constant ``tensor`` (registered once, reused)."""
        key = id(tensor)
        if key in self._buffers_by_id:
            return self._buffers_by_id[key]
        onnx_name = self._const_names.get(key)
        if onnx_name is not None:
            attr = escape_param_name(onnx_name)
        else:
            attr = f"_onnx_const_{self._n_consts}"
            self._n_consts += 1
        while hasattr(self.root, attr):
            attr += "_"
        persistent = onnx_name is not None and onnx_name in self.persistent_buffers
        self.root.register_buffer(attr, tensor, persistent=persistent)
        if not persistent:
            self.non_persistent_buffers.add(attr)
        self._buffers_by_id[key] = attr
        return attr

    def add_module(self, module: nn.Module, kind: str) -> str:
        name = f"onnx_{kind.lower()}_{self._n_modules}"
        self._n_modules += 1
        self.root.add_module(name, module)
        return name

    def bind(self, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self._const_names.setdefault(id(value), name)
        elif isinstance(value, fx.Node):
            value.meta.setdefault("onnx_value", name)
        self.env[name] = value

    # -- analysis ------------------------------------------------------------------------------
    def _count_uses(self) -> None:
        for node in self.model.graph.node:
            for name in node.input:
                if name:
                    self.use_count[name] = self.use_count.get(name, 0) + 1
        for out in self.model.graph.output:
            self.use_count[out.name] = self.use_count.get(out.name, 0) + 1

    # -- main ----------------------------------------------------------------------------------
    def lower(self) -> OnnxGraphModule:
        g = self.model.graph
        self._count_uses()
        self.value_info = _infer_value_info(self.model)

        init_names: set[str] = set()
        for init in g.initializer:
            init_names.add(init.name)
            value = tensor_from_numpy(init)
            if value.dtype in FLOAT_DTYPES:
                attr = escape_param_name(init.name)
                param = nn.Parameter(value, requires_grad=self.trainable)
                self.root.register_parameter(attr, param)
                self.params[init.name] = param
                self.param_attr[init.name] = attr
                self.env[init.name] = ParamRef(init.name, attr, tuple(value.shape), value.dtype)
            else:
                self.persistent_buffers.add(init.name)
                self.bind(init.name, value)
        if g.sparse_initializer:
            raise UnsupportedOpError("sparse initializers are not supported by the torch lowering")

        input_names = [i.name for i in g.input if i.name not in init_names]
        arg_names = _sanitize_all(input_names)
        for name, arg in zip(input_names, arg_names, strict=True):
            node = self.graph.placeholder(arg)
            node.meta["onnx_value"] = name
            self.env[name] = node

        nodes = list(g.node)
        fused = (
            find_linear_fusions(
                nodes, use_count=self.use_count, params=self.params, value_info=self.value_info
            )
            if self.fuse_linear
            else {}
        )
        small = {i.name: onnx.numpy_helper.to_array(i) for i in g.initializer
                 if int(np.prod(i.dims)) <= _SMALL_CONSTANT}
        self.block_masks = find_block_diagonal_masks(nodes, small, self.use_count)
        chains = find_attention_chains(nodes, small, self.use_count, self.block_masks)
        skipped = set(fused.values())
        skipped.update(i for chain in chains.values() for i in chain.nodes[:-1])
        for index, node in enumerate(nodes):
            if index in skipped:
                continue
            if index in chains:  # the chain's inner tensors only exist inside the fused call
                for inner in chains[index].nodes[:-1]:
                    self.env.update(dict.fromkeys(nodes[inner].output))
                ctx = NodeContext(self, node, index)
                self.bind(node.output[0], emit_attention_chain(ctx, chains[index], nodes))
                continue
            converter = CONVERTERS.get((normalize_domain(node.domain), node.op_type))
            if converter is None:
                raise UnsupportedOpError(
                    f"no torch lowering for ONNX op {node.domain or 'ai.onnx'}::{node.op_type} "
                    f"(node {node.name!r}, outputs {list(node.output)})"
                )
            if index in fused:  # the MatMul's output only exists inside the fused F.linear
                self.env[nodes[fused[index]].output[0]] = None
            ctx = NodeContext(self, node, index)
            if index in fused:
                outs = [emit_fused_linear(ctx, nodes[fused[index]])]
            else:
                outs = _run_converter(converter, ctx)
            for name, value in zip(node.output, outs, strict=False):
                if name:
                    self.bind(name, value)

        output_names = [o.name for o in g.output]
        results = []
        for name in output_names:
            value = self.lookup(name, "graph output")
            if isinstance(value, ParamRef):
                self.used_params.add(value.name)
                value = self.graph.get_attr(value.attr)
            elif isinstance(value, torch.Tensor):
                value = self.graph.get_attr(self.buffer_for(value))
            results.append(value)
        self.graph.output(tuple(results))

        folded = sorted(self.folded_params - self.used_params)
        for name in folded:
            self.params[name].requires_grad_(False)
        gm = OnnxGraphModule(
            self.root,
            self.graph,
            input_names=input_names,
            output_names=output_names,
            param_order=[self.param_attr[n] for n in self.params],
            opset=self.opsets.get("", 0),
            folded_initializers=folded,
            non_persistent_buffers=self.non_persistent_buffers,
        )
        # Dead ONNX branches (and converter by-products) cost nothing at run time.
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
        logger.debug(
            "lowered ONNX graph: %d nodes -> %d fx nodes, %d parameters, %d fused linears",
            len(nodes),
            len(self.graph.nodes),
            len(self.params),
            len(fused),
        )
        return gm


def _run_converter(converter: Converter, ctx: NodeContext) -> list[Any]:
    try:
        return converter(ctx)
    except (NotImplementedError, LoweringError):
        raise
    except Exception as exc:  # add which node failed; the original stays as __cause__
        raise LoweringError(
            f"lowering {ctx.op_type} node {ctx.name!r} (outputs {list(ctx.node.output)}) "
            f"failed: {exc}"
        ) from exc


def _sanitize_all(names: Sequence[str]) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    for name in names:
        s = re.sub(r"\W", "_", name) or "input"
        if s[0].isdigit():
            s = "_" + s
        if keyword.iskeyword(s) or s == "self":
            s += "_"
        base, k = s, 1
        while s in seen:
            s = f"{base}_{k}"
            k += 1
        seen.add(s)
        out.append(s)
    return out


def _infer_value_info(model: onnx.ModelProto) -> dict[str, ValueInfo]:
    """Static shapes/dtypes from ONNX shape inference, on a weight-free copy of the graph
    (`popbert.graph.shapes`). Failures only cost lowering-time information, never correctness."""
    m = weight_free_copy(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - inference is best effort
        logger.warning("ONNX shape inference failed (%s); lowering without static shapes", exc)
        inferred = m
    info: dict[str, ValueInfo] = {}
    ig = inferred.graph
    for vi in list(ig.input) + list(ig.value_info) + list(ig.output):
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            continue
        dtype = ONNX_TO_TORCH.get(tt.elem_type)
        shape: tuple[int | None, ...] | None = None
        if tt.HasField("shape"):
            shape = tuple(
                int(d.dim_value) if d.HasField("dim_value") else None for d in tt.shape.dim
            )
        info[vi.name] = (shape, dtype)
    return info


class OnnxGraphModule(fx.GraphModule):
    """The lowered ONNX graph: an ``fx.GraphModule`` with ONNX names attached.

    ``forward(*inputs)`` returns a tuple in ``output_names`` order; :meth:`run` is the
    name-keyed convenience.
    """

    _EXTRA_ATTRS = ("input_names", "output_names", "opset", "folded_initializers")

    def __init__(
        self,
        root: nn.Module,
        graph: fx.Graph,
        *,
        input_names: Sequence[str],
        output_names: Sequence[str],
        param_order: Sequence[str] = (),
        opset: int = 0,
        folded_initializers: Sequence[str] = (),
        non_persistent_buffers: Iterable[str] = (),
    ) -> None:
        super().__init__(root, graph, class_name="OnnxGraphModule")
        # Parameters no node reads (folded or dead) are still part of the model's state.
        for name, param in root.named_parameters(recurse=False):
            if name not in self._parameters:
                self.register_parameter(name, param)
        ordered = {n: self._parameters[n] for n in param_order if n in self._parameters}
        ordered.update(self._parameters)
        self._parameters.clear()
        self._parameters.update(ordered)
        # fx copies the root's buffers as persistent ones; restore the lowering's choice.
        self._non_persistent_buffers_set = {n for n in non_persistent_buffers if n in self._buffers}
        self.input_names: list[str] = list(input_names)
        self.output_names: list[str] = list(output_names)
        self.opset = opset
        # Float initializers whose value was baked in at lowering time (requires_grad=False).
        self.folded_initializers: list[str] = list(folded_initializers)

    def non_persistent_buffers(self) -> set[str]:
        """Names of the buffers left out of ``state_dict`` (constants made at lowering time)."""
        return set(self._non_persistent_buffers_set)

    def run(self, feeds: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Run with inputs keyed by ONNX name; returns outputs keyed by ONNX name.

        Non-tensor feeds (numpy arrays, lists) are converted with ``torch.as_tensor``.
        """
        missing = [n for n in self.input_names if n not in feeds]
        unknown = sorted(set(feeds) - set(self.input_names))
        if missing or unknown:
            raise KeyError(
                f"feeds do not match the graph inputs: missing {missing}, unknown {unknown}; "
                f"expected {self.input_names}"
            )
        args = [
            v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v))
            for v in (feeds[n] for n in self.input_names)
        ]
        outs = self(*args)
        return dict(zip(self.output_names, outs, strict=True))

    def __deepcopy__(self, memo: dict[int, Any]) -> OnnxGraphModule:
        res = super().__deepcopy__(memo)
        for attr in self._EXTRA_ATTRS:
            setattr(res, attr, copy.deepcopy(getattr(self, attr), memo))
        copied = dict(res.named_buffers(recurse=False))
        for name in self.non_persistent_buffers() & copied.keys():
            res.register_buffer(name, copied[name], persistent=False)
        return res  # type: ignore[return-value]


def lower_to_fx(
    model: onnx.ModelProto,
    *,
    trainable: bool = True,
    static_shapes: bool = True,
    fuse_linear: bool = True,
) -> OnnxGraphModule:
    """Lower ``model`` once into an :class:`OnnxGraphModule` that trains with autograd.

    Args:
        model: the (possibly annotated) ONNX model; annotations are kept in node meta.
        trainable: whether float initializers get ``requires_grad=True``.
        static_shapes: trust the dims that the graph declares or ONNX shape inference
            derives: ``Shape`` folds to a constant, Reshape's 0s and Expand resolve at lowering
            time (the declared shapes are then a contract, as in ORT). With False only ranks
            are used, so the module also runs on sizes other than the declared ones (at the
            cost of a little python shape work per step).
        fuse_linear: lower ``MatMul(x, W) + b`` with parameter ``W``/``b`` and matching
            annotations to one ``F.linear`` (the fused node's meta names both ONNX nodes).

    Raises:
        UnsupportedOpError: for an op without converter (names op type and node).
        LoweringError: when a converter fails on a node.
    """
    return _Lowerer(
        model, trainable=trainable, static_shapes=static_shapes, fuse_linear=fuse_linear
    ).lower()
