"""Lower an (annotated) ONNX ``ModelProto`` to a ``torch.fx.GraphModule``, once.

The annotated ONNX graph is popbert's program; the torch backend runs it by translating every
ONNX node into plain torch calls ahead of time (no interpretation of the proto per step), so the
result trains with autograd and is ``torch.compile``-friendly.

Conventions of the lowered :class:`OnnxGraphModule`:

* ``forward(*inputs)`` takes one positional tensor per graph input (graph order; initializers
  listed as inputs are treated as initializers) and returns a tuple of the graph outputs.
  ``input_names`` / ``output_names`` hold the ONNX names, ``run(feeds)`` maps names to tensors.
* Float initializers are ``nn.Parameter`` s registered on the module under their ONNX names
  (``Layer0/Attention/QKV/W``): ``dict(module.named_parameters())`` has exactly the initializer
  names as keys. Module attribute names cannot contain ``.``, so a name is escaped by
  :func:`escape_param_name` (``%`` -> ``%25``, ``.`` -> ``%2E``; a name that clashes with a
  module attribute such as ``training`` gets a ``%%`` prefix) and :func:`unescape_param_name`
  inverts it. Names without ``.``/``%`` that do not clash are unchanged.
* Non-float initializers, ``Constant`` outputs and everything folded at lowering time are
  buffers (int initializers persistent under their escaped ONNX name, the rest non-persistent)
  or python scalars. Shape-like inputs (Reshape shape, Split sizes, axes, Slice bounds, Expand
  shape, Dropout ratio) are folded into python constants. A float initializer read only in such
  a position keeps its parameter but with ``requires_grad=False`` (listed in
  ``frozen_initializers``): its value is baked in at lowering time.
* Every fx node emitted for an ONNX node carries ``node.meta["onnx"] = {"op_type", "name",
  "domain", "attributes", "inputs", "outputs"}`` where ``attributes`` holds the ``__``
  annotations (``__ipu_number``, ``__pipeline_stage``, ...) as python values; the node bound to
  an ONNX tensor also has ``node.meta["onnx_value"]`` = that tensor's name. Nodes fused from
  several ONNX nodes (MatMul + Add -> ``F.linear``) list the others in ``meta["onnx"]["fused"]``.
* Dropout is an :class:`~popbert.lowering.ops.OnnxDropout` submodule: it follows
  ``module.train()`` / ``module.eval()`` (identity in eval, or when ``training_mode`` is a
  constant False).
"""

from __future__ import annotations

import copy
import keyword
import logging
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
import torch.fx as fx
from onnx import numpy_helper
from torch import nn

from popbert.lowering.ops import CONVERTERS, Converter

logger = logging.getLogger(__name__)

__all__ = [
    "LoweringError",
    "NodeContext",
    "OnnxGraphModule",
    "UnsupportedOpError",
    "escape_param_name",
    "lower_to_fx",
    "onnx_dtype_to_torch",
    "unescape_param_name",
]

_ONNX_TO_TORCH: dict[int, torch.dtype] = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.UINT16: torch.uint16,
    onnx.TensorProto.UINT32: torch.uint32,
    onnx.TensorProto.UINT64: torch.uint64,
    onnx.TensorProto.BOOL: torch.bool,
}

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_STANDARD_DOMAINS = ("", "ai.onnx")


class UnsupportedOpError(NotImplementedError):
    """An ONNX op (or an op variant) that the torch lowering has no converter for."""


class LoweringError(RuntimeError):
    """A converter failed on a node; the message names the node and its op type."""


def onnx_dtype_to_torch(elem_type: int) -> torch.dtype:
    """Map an ONNX ``TensorProto`` element type to the torch dtype."""
    try:
        return _ONNX_TO_TORCH[elem_type]
    except KeyError:
        name = onnx.TensorProto.DataType.Name(elem_type)
        raise UnsupportedOpError(f"ONNX element type {name} has no torch equivalent") from None


_RESERVED = frozenset(dir(fx.GraphModule))


def escape_param_name(name: str) -> str:
    """Reversibly turn an ONNX tensor name into a legal module attribute name.

    Only ``%`` and ``.`` are rewritten (``%25``, ``%2E``); names that would shadow a module
    attribute get a ``%%`` prefix (unambiguous: escaped names never contain ``%%``).
    """
    escaped = name.replace("%", "%25").replace(".", "%2E")
    if escaped in _RESERVED or not escaped:
        escaped = "%%" + escaped
    return escaped


def unescape_param_name(name: str) -> str:
    """Inverse of :func:`escape_param_name`: module attribute name -> ONNX tensor name."""
    if name.startswith("%%"):
        name = name[2:]
    return name.replace("%2E", ".").replace("%25", "%")


def _tensor_from_numpy(arr: np.ndarray) -> torch.Tensor:
    if arr.dtype.name == "bfloat16":  # ml_dtypes bfloat16, which torch cannot import directly
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16).copy()).view(
            torch.bfloat16
        )
    if arr.dtype.kind in "OUS":
        raise UnsupportedOpError("string tensors are not supported by the torch lowering")
    return torch.from_numpy(np.array(arr, copy=True))


@dataclass(frozen=True)
class ParamRef:
    """A float initializer, materialised as a ``get_attr`` node by each ONNX node using it."""

    name: str
    attr: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Scalar:
    """A one-element constant that a converter allows to be passed as a python number."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


_ValueInfo = tuple[tuple[int | None, ...] | None, torch.dtype | None]


class NodeContext:
    """What a converter sees of one ONNX node, and how it emits torch calls.

    Values are ``fx.Node`` (computed at run time), :class:`ParamRef` (a parameter) or
    ``torch.Tensor`` (a constant known at lowering time). ``call`` folds calls whose arguments
    are all constants and otherwise appends an fx node tagged with this node's annotations.
    """

    def __init__(self, lowerer: _Lowerer, node: onnx.NodeProto, index: int) -> None:
        self._low = lowerer
        self.node = node
        self.index = index
        self.op_type = node.op_type
        self.domain = "" if node.domain in _STANDARD_DOMAINS else node.domain
        self.name = node.name or f"{node.op_type}_{index}"
        self.opset = lowerer.opsets.get(self.domain, lowerer.opsets.get("", 23))
        self.static_shapes = lowerer.static_shapes
        self.attrs: dict[str, Any] = {}
        self.annotations: dict[str, Any] = {}
        for attr in node.attribute:
            value = onnx.helper.get_attribute_value(attr)
            if isinstance(value, bytes):
                value = value.decode()
            elif isinstance(value, list) and value and isinstance(value[0], bytes):
                value = [v.decode() for v in value]
            if attr.name.startswith("__"):
                self.annotations[attr.name] = value
            else:
                self.attrs[attr.name] = value
        self.inputs: list[Any] = [lowerer.lookup(n, self.name) if n else None for n in node.input]
        self.num_outputs = len(node.output)
        self.created: list[fx.Node] = []
        self._attr_nodes: dict[str, fx.Node] = {}
        self.meta: dict[str, Any] = {
            "op_type": node.op_type,
            "name": node.name,
            "domain": node.domain,
            "attributes": dict(self.annotations),
            "inputs": list(node.input),
            "outputs": list(node.output),
        }

    # -- inputs and static information ---------------------------------------------------------
    def has_input(self, i: int) -> bool:
        """Whether optional input ``i`` is present (ONNX marks absent inputs with '')."""
        return i < len(self.node.input) and bool(self.node.input[i])

    def input_or_none(self, i: int) -> Any:
        return self.inputs[i] if self.has_input(i) else None

    def output_used(self, i: int) -> bool:
        """Whether output ``i`` exists and is consumed (by a node or as a graph output)."""
        if i >= self.num_outputs or not self.node.output[i]:
            return False
        return self._low.use_count.get(self.node.output[i], 0) > 0

    def is_const(self, i: int) -> bool:
        """Input ``i`` is a lowering-time constant tensor (not a parameter, not a node)."""
        return self.has_input(i) and isinstance(self.inputs[i], torch.Tensor)

    def is_static(self, i: int) -> bool:
        """Input ``i`` has a value at lowering time (constant or initial parameter value)."""
        return self.has_input(i) and isinstance(self.inputs[i], torch.Tensor | ParamRef)

    def is_node(self, i: int) -> bool:
        """Input ``i`` is computed at run time (graph input, node output or parameter)."""
        return self.has_input(i) and isinstance(self.inputs[i], fx.Node | ParamRef)

    def is_param(self, i: int) -> bool:
        return self.has_input(i) and isinstance(self.inputs[i], ParamRef)

    def const_value(self, i: int, what: str | None = None) -> torch.Tensor:
        """The lowering-time value of input ``i``; a clear error if it is computed at run time."""
        v = self.inputs[i] if self.has_input(i) else None
        if isinstance(v, torch.Tensor):
            return v
        if isinstance(v, ParamRef):
            self._low.folded_params.add(v.name)
            return self._low.params[v.name].detach()
        label = what or f"input {i}"
        raise UnsupportedOpError(
            f"{self.op_type} node {self.name!r}: {label} ({self.node.input[i]!r}) must be a "
            "constant (initializer or Constant node) for the torch lowering"
        )

    def const_ints(self, i: int, what: str | None = None) -> list[int]:
        return [int(x) for x in self.const_value(i, what).reshape(-1).tolist()]

    def const_scalar(self, i: int) -> Any:
        return self.const_value(i).reshape(-1)[0].item()

    def _info(self, i: int) -> _ValueInfo:
        if not self.has_input(i):
            return None, None
        v = self.inputs[i]
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), v.dtype
        if isinstance(v, ParamRef):
            return v.shape, v.dtype
        shape, dtype = self._low.value_info.get(self.node.input[i], (None, None))
        if shape is not None and not self.static_shapes:
            shape = (None,) * len(shape)  # only the rank is trusted
        return shape, dtype

    def shape(self, i: int) -> tuple[int | None, ...] | None:
        """Static shape of input ``i`` (None for unknown dims), or None if the rank is unknown."""
        return self._info(i)[0]

    def rank(self, i: int) -> int | None:
        s = self.shape(i)
        return None if s is None else len(s)

    def dtype(self, i: int) -> torch.dtype | None:
        return self._info(i)[1]

    def scalarish(self, i: int, *others: int) -> Any:
        """Input ``i``, marked as passable as a python number if it is a one-element constant
        whose broadcast cannot change the result's rank (compared with inputs ``others``)."""
        v = self.inputs[i]
        if not isinstance(v, torch.Tensor) or v.numel() != 1:
            return v
        if v.dim() > 0:
            ranks = [self.rank(o) for o in others if self.has_input(o)]
            if not ranks or any(r is None or r < v.dim() for r in ranks):
                return v
        return _Scalar(v)

    # -- helpers for converters ----------------------------------------------------------------
    @staticmethod
    def torch_dtype(elem_type: int) -> torch.dtype:
        return onnx_dtype_to_torch(elem_type)

    @staticmethod
    def tensor_from_numpy(arr: Any) -> torch.Tensor:
        if isinstance(arr, onnx.TensorProto):
            arr = numpy_helper.to_array(arr)
        return _tensor_from_numpy(np.asarray(arr))

    def constant_attribute_value(self) -> torch.Tensor:
        """The value of a ``Constant`` node, from whichever ``value*`` attribute it uses."""
        a = self.attrs
        if "value" in a:
            return self.tensor_from_numpy(a["value"])
        if "value_float" in a:
            return torch.tensor(float(a["value_float"]), dtype=torch.float32)
        if "value_floats" in a:
            return torch.tensor([float(x) for x in a["value_floats"]], dtype=torch.float32)
        if "value_int" in a:
            return torch.tensor(int(a["value_int"]), dtype=torch.int64)
        if "value_ints" in a:
            return torch.tensor([int(x) for x in a["value_ints"]], dtype=torch.int64)
        raise UnsupportedOpError(
            f"Constant node {self.name!r}: attribute {sorted(a)} is not supported"
        )

    # -- emitting ------------------------------------------------------------------------------
    def _tag(self, node: fx.Node) -> fx.Node:
        node.meta["onnx"] = {**self.meta, "attributes": dict(self.meta["attributes"])}
        self.created.append(node)
        return node

    def _get_attr(self, target: str) -> fx.Node:
        node = self._attr_nodes.get(target)
        if node is None:
            node = self._tag(self._low.graph.get_attr(target))
            self._attr_nodes[target] = node
        return node

    def _to_arg(self, v: Any) -> Any:
        if isinstance(v, _Scalar):
            return v.tensor.item()
        if isinstance(v, ParamRef):
            self._low.used_params.add(v.name)
            return self._get_attr(v.attr)
        if isinstance(v, torch.Tensor):
            return self._get_attr(self._low.buffer_for(v))
        return v

    @staticmethod
    def _is_runtime(args: Any) -> bool:
        found = False

        def visit(a: Any) -> Any:
            nonlocal found
            if isinstance(a, fx.Node | ParamRef):
                found = True
            return a

        fx.node.map_aggregate(args, visit)
        return found

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Emit ``fn(*args, **kwargs)``; evaluated now if no argument is a run-time value."""
        if not self._is_runtime((args, kwargs)):

            def unwrap(a: Any) -> Any:
                return a.tensor if isinstance(a, _Scalar) else a

            with torch.no_grad():
                return fn(
                    *fx.node.map_aggregate(args, unwrap), **fx.node.map_aggregate(kwargs, unwrap)
                )
        node = self._low.graph.call_function(
            fn,
            fx.node.map_aggregate(args, self._to_arg),
            fx.node.map_aggregate(kwargs, self._to_arg),
        )
        return self._tag(node)

    def call_module(self, module: nn.Module, *args: Any) -> fx.Node:
        """Register ``module`` on the lowered module and emit a call to it."""
        target = self._low.add_module(module, self.op_type)
        node = self._low.graph.call_module(target, fx.node.map_aggregate(args, self._to_arg))
        return self._tag(node)

    def item(self, value: Any, i: int) -> Any:
        """Element ``i`` of a multi-output value (a node, or a folded tuple)."""
        if isinstance(value, fx.Node):
            return self._tag(self._low.graph.call_function(operator.getitem, (value, i)))
        return value[i]


class _Lowerer:
    """Holds the state of one lowering: the fx graph, the module under construction, values."""

    def __init__(
        self, model: onnx.ModelProto, *, trainable: bool, static_shapes: bool, fuse_linear: bool
    ) -> None:
        self.model = model
        self.trainable = trainable
        self.static_shapes = static_shapes
        self.fuse_linear = fuse_linear
        self.opsets: dict[str, int] = {}
        for imp in model.opset_import:
            domain = "" if imp.domain in _STANDARD_DOMAINS else imp.domain
            self.opsets[domain] = int(imp.version)
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.env: dict[str, Any] = {}
        self.params: dict[str, nn.Parameter] = {}
        self.param_attr: dict[str, str] = {}
        self.persistent_buffers: set[str] = set()
        self.used_params: set[str] = set()
        self.folded_params: set[str] = set()
        self._buffers_by_id: dict[int, str] = {}
        self._const_names: dict[int, str] = {}
        self._n_modules = 0
        self._n_consts = 0
        self.use_count: dict[str, int] = {}
        self.value_info: dict[str, _ValueInfo] = {}

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

    def _fusable_linears(self) -> dict[int, int]:
        """Map Add-node index -> MatMul-node index for MatMul(x, W) + b pairs to fuse."""
        if not self.fuse_linear:
            return {}
        nodes = list(self.model.graph.node)
        producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
        pairs: dict[int, int] = {}
        for j, add in enumerate(nodes):
            if add.op_type != "Add" or add.domain not in _STANDARD_DOMAINS or len(add.input) != 2:
                continue
            for mm_pos in (0, 1):
                mm_out, bias = add.input[mm_pos], add.input[1 - mm_pos]
                i = producer.get(mm_out)
                if i is None or self.use_count.get(mm_out, 0) != 1:
                    continue
                mm = nodes[i]
                if mm.op_type != "MatMul" or mm.domain not in _STANDARD_DOMAINS:
                    continue
                # W: a 2-D parameter, or any 2-D value of known shape (e.g. the tied MLM
                # projection's Transpose of the embedding); b: a 1-D parameter.
                b = self.params.get(bias)
                w = self.params.get(mm.input[1])
                w_shape, w_dtype = (
                    (tuple(w.shape), w.dtype)
                    if w is not None
                    else self.value_info.get(mm.input[1], (None, None))
                )
                if b is None or b.dim() != 1 or w_shape is None or len(w_shape) != 2:
                    continue
                if w_shape[1] != b.shape[0] or w_dtype != b.dtype:
                    continue
                ann = sorted((a.name, a.SerializeToString()) for a in mm.attribute)
                ann_add = sorted((a.name, a.SerializeToString()) for a in add.attribute)
                if ann != ann_add:
                    continue
                pairs[j] = i
                break
        return pairs

    # -- main ----------------------------------------------------------------------------------
    def lower(self) -> OnnxGraphModule:
        g = self.model.graph
        self._count_uses()
        self.value_info = _infer_value_info(self.model)

        init_names: set[str] = set()
        for init in g.initializer:
            init_names.add(init.name)
            value = _tensor_from_numpy(numpy_helper.to_array(init))
            if value.dtype in _FLOAT_DTYPES:
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

        fused = self._fusable_linears()
        skipped = set(fused.values())
        nodes = list(g.node)
        for index, node in enumerate(nodes):
            if index in skipped:
                continue
            key = ("" if node.domain in _STANDARD_DOMAINS else node.domain, node.op_type)
            converter = CONVERTERS.get(key)
            if converter is None:
                raise UnsupportedOpError(
                    f"no torch lowering for ONNX op {node.domain or 'ai.onnx'}::{node.op_type} "
                    f"(node {node.name!r}, outputs {list(node.output)})"
                )
            if index in fused:  # the MatMul's output only exists inside the fused F.linear
                self.env[nodes[fused[index]].output[0]] = None
            ctx = NodeContext(self, node, index)
            if index in fused:
                outs = [_lower_fused_linear(ctx, nodes[fused[index]], self)]
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

        frozen = sorted(self.folded_params - self.used_params)
        for name in frozen:
            self.params[name].requires_grad_(False)
        gm = OnnxGraphModule(
            self.root,
            self.graph,
            input_names=input_names,
            output_names=output_names,
            param_order=[self.param_attr[n] for n in self.params],
            opset=self.opsets.get("", 0),
            frozen_initializers=frozen,
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


def _lower_fused_linear(ctx: NodeContext, matmul: onnx.NodeProto, low: _Lowerer) -> Any:
    from popbert.lowering.ops import emit_fused_linear

    mm_pos = 0 if ctx.node.input[0] == matmul.output[0] else 1
    bias = ctx.inputs[1 - mm_pos]
    x = low.lookup(matmul.input[0], ctx.name)
    weight = low.lookup(matmul.input[1], ctx.name)
    ctx.meta["fused"] = [
        {"op_type": matmul.op_type, "name": matmul.name, "outputs": list(matmul.output)}
    ]
    return emit_fused_linear(ctx, x, weight, bias)


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


def _infer_value_info(model: onnx.ModelProto) -> dict[str, _ValueInfo]:
    """Static shapes/dtypes from ONNX shape inference, on a weight-free copy of the graph.

    Float initializers become typed graph inputs (so BERT-Large's weights are never copied),
    small integer initializers stay (shape inference propagates their values) and the ``__``
    annotations are dropped. Failures only cost lowering-time information, never correctness.
    """
    g = model.graph
    light = onnx.GraphProto(name=g.name)
    light.input.extend(g.input)
    known_inputs = {i.name for i in g.input}
    for init in g.initializer:
        small_int = (
            init.data_type
            not in (
                onnx.TensorProto.FLOAT,
                onnx.TensorProto.FLOAT16,
                onnx.TensorProto.BFLOAT16,
                onnx.TensorProto.DOUBLE,
            )
            and int(np.prod(init.dims)) <= 4096
        )
        if small_int:
            light.initializer.append(init)
        elif init.name not in known_inputs:
            light.input.append(
                onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
            )
    for node in g.node:
        n = light.node.add()
        n.CopyFrom(node)
        keep = [a for a in n.attribute if not a.name.startswith("__")]
        del n.attribute[:]
        n.attribute.extend(keep)
    light.output.extend(g.output)
    light.value_info.extend(g.value_info)
    m = onnx.helper.make_model(light, opset_imports=list(model.opset_import))
    m.ir_version = model.ir_version
    m.functions.extend(model.functions)
    try:
        inferred = onnx.shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - inference is best effort
        logger.warning("ONNX shape inference failed (%s); lowering without static shapes", exc)
        inferred = m
    info: dict[str, _ValueInfo] = {}
    ig = inferred.graph
    for vi in list(ig.input) + list(ig.value_info) + list(ig.output):
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            continue
        dtype = _ONNX_TO_TORCH.get(tt.elem_type)
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
    name-keyed convenience. ``graph_module`` returns ``self`` so code written for a wrapper
    works too.
    """

    _EXTRA_ATTRS = ("input_names", "output_names", "opset", "frozen_initializers")

    def __init__(
        self,
        root: nn.Module,
        graph: fx.Graph,
        *,
        input_names: Sequence[str],
        output_names: Sequence[str],
        param_order: Sequence[str] = (),
        opset: int = 0,
        frozen_initializers: Sequence[str] = (),
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
        self._non_persistent_buffers_set = {
            n for n in root._non_persistent_buffers_set if n in self._buffers
        }
        self.input_names: list[str] = list(input_names)
        self.output_names: list[str] = list(output_names)
        self.opset = opset
        self.frozen_initializers: list[str] = list(frozen_initializers)

    @property
    def graph_module(self) -> OnnxGraphModule:
        return self

    def onnx_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters keyed by their ONNX initializer names (escaping undone)."""
        return {unescape_param_name(n): p for n, p in self.named_parameters()}

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
        res._non_persistent_buffers_set = set(self._non_persistent_buffers_set)
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
