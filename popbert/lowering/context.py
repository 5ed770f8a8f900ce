"""The vocabulary every part of the lowering shares, so that none of them imports another's.

The converters (:mod:`popbert.lowering.converters`) and the fusion pass
(:mod:`popbert.lowering.fusion`) need to read an ONNX node and emit torch calls; the lowerer
(:mod:`popbert.lowering.lower`) needs the converters. Everything both sides speak lives here, below
both: :class:`NodeContext` (one node's inputs and attributes, and ``call`` that emits or folds a
torch call), :class:`ParamRef`, the converter registry, the errors, parameter name escaping and the
ONNX -> torch dtype map. The lowerer itself is seen only through the :class:`LoweringState`
protocol, so this module never imports it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import onnx
import torch
import torch.fx as fx
from onnx import numpy_helper
from torch import nn

from popbert.graph.annotations import ANNOTATION_PREFIX
from popbert.graph.builder import GRAPHCORE_DOMAIN

__all__ = [
    "ANNOTATION_PREFIX",
    "CONVERTERS",
    "FLOAT_DTYPES",
    "GRAPHCORE_DOMAINS",
    "ONNX_TO_TORCH",
    "STANDARD_DOMAINS",
    "Converter",
    "LoweringError",
    "LoweringState",
    "NodeContext",
    "ParamRef",
    "UnsupportedOpError",
    "ValueInfo",
    "escape_param_name",
    "normalize_domain",
    "onnx_dtype_to_torch",
    "register_converter",
    "tensor_from_numpy",
    "unescape_param_name",
]

#: Spellings of the default ONNX domain; the lowering normalises both to ``""``.
STANDARD_DOMAINS = ("", "ai.onnx")
#: Spellings of PopART's op domain: the Builder's ``ai.graphcore`` and the older ``com.graphcore``.
GRAPHCORE_DOMAINS = (GRAPHCORE_DOMAIN, "com.graphcore")
# Node attributes starting with ANNOTATION_PREFIX (popbert.graph.annotations) are PopART's
# annotations: kept in ``node.meta["onnx"]["attributes"]``, never passed to a converter.

ONNX_TO_TORCH: dict[int, torch.dtype] = {
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

#: Initializers of these dtypes become parameters; the others become buffers.
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class UnsupportedOpError(NotImplementedError):
    """An ONNX op (or an op variant) that the torch lowering has no converter for."""


class LoweringError(RuntimeError):
    """A converter failed on a node; the message names the node and its op type."""


def normalize_domain(domain: str) -> str:
    """The registry's spelling of an op domain: ``""`` for the default ONNX domain."""
    return "" if domain in STANDARD_DOMAINS else domain


def onnx_dtype_to_torch(elem_type: int) -> torch.dtype:
    """Map an ONNX ``TensorProto`` element type to the torch dtype."""
    try:
        return ONNX_TO_TORCH[elem_type]
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


def tensor_from_numpy(arr: np.ndarray | onnx.TensorProto) -> torch.Tensor:
    """A torch copy of an ONNX tensor or numpy array (bfloat16 included, strings refused)."""
    if isinstance(arr, onnx.TensorProto):
        arr = numpy_helper.to_array(arr)
    arr = np.asarray(arr)
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


#: What the lowering knows statically of a tensor: (shape with None for unknown dims, or None
#: when even the rank is unknown; dtype or None).
ValueInfo = tuple[tuple[int | None, ...] | None, torch.dtype | None]


class LoweringState(Protocol):
    """What a :class:`NodeContext` needs of the lowering in progress (the lowerer provides it)."""

    graph: fx.Graph
    opsets: dict[str, int]
    static_shapes: bool
    use_count: dict[str, int]
    value_info: dict[str, ValueInfo]
    params: dict[str, nn.Parameter]
    used_params: set[str]
    folded_params: set[str]
    # Additive block-diagonal attention masks -> the sequence_index they are made of
    # (:func:`popbert.lowering.block_attention.find_block_diagonal_masks`).
    block_masks: dict[str, str]

    def lookup(self, name: str, consumer: str) -> Any:
        """The value bound to ONNX tensor ``name`` (``consumer`` names the reader in errors)."""
        ...

    def buffer_for(self, tensor: torch.Tensor) -> str:
        """The module attribute holding constant ``tensor``."""
        ...

    def add_module(self, module: nn.Module, kind: str) -> str:
        """Register ``module`` on the lowered module; returns its attribute name."""
        ...


class NodeContext:
    """What a converter sees of one ONNX node, and how it emits torch calls.

    Values are ``fx.Node`` (computed at run time), :class:`ParamRef` (a parameter) or
    ``torch.Tensor`` (a constant known at lowering time). ``call`` folds calls whose arguments
    are all constants and otherwise appends an fx node tagged with this node's annotations.
    """

    def __init__(self, lowerer: LoweringState, node: onnx.NodeProto, index: int) -> None:
        self._low = lowerer
        self.node = node
        self.index = index
        self.op_type = node.op_type
        self.domain = normalize_domain(node.domain)
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
            if attr.name.startswith(ANNOTATION_PREFIX):
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

    def lookup(self, name: str) -> Any:
        """The lowered value of any ONNX tensor ``name`` (e.g. an input of a fused neighbour)."""
        return self._low.lookup(name, self.name)

    def block_segments(self, i: int) -> Any:
        """When input ``i`` is a packed rows' block-diagonal attention mask, the lowered
        ``sequence_index`` it is made of (attention can then run per sequence); else None."""
        segments = self._low.block_masks.get(self.node.input[i]) if self.has_input(i) else None
        return None if segments is None else self.lookup(segments)

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
        """The lowering-time value of input ``i``; a clear error if it is computed at run time.

        Reading a parameter here folds its current value into the lowered graph (the lowerer
        lists it in ``OnnxGraphModule.folded_initializers`` unless a node also reads it).
        """
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

    def _info(self, i: int) -> ValueInfo:
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
    def str_attr(self, name: str, default: str) -> str:
        """String attribute ``name`` (already decoded from bytes), or ``default`` if absent."""
        value = self.attrs.get(name)
        return default if value is None else str(value)

    @staticmethod
    def torch_dtype(elem_type: int) -> torch.dtype:
        return onnx_dtype_to_torch(elem_type)

    @staticmethod
    def tensor_from_numpy(arr: Any) -> torch.Tensor:
        return tensor_from_numpy(arr)

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


# ---------------------------------------------------------------------------------------------
# The converter registry
# ---------------------------------------------------------------------------------------------

#: A converter lowers one ONNX node: it reads the node through the context, emits torch calls
#: with ``ctx.call`` and returns one value per ONNX output.
Converter = Callable[[NodeContext], list[Any]]

#: ``(domain, op_type) -> converter``. The standard domain is ``""``; ``"ai.onnx"`` is
#: normalised to ``""`` by the lowering. Graphcore ops are registered under each spelling in
#: :data:`GRAPHCORE_DOMAINS`. :mod:`popbert.lowering.converters` fills it when imported.
CONVERTERS: dict[tuple[str, str], Converter] = {}


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
