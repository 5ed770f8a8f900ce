"""What a session checks of a batch before running it, read once from the graph's inputs.

A batch that does not fit the graph would otherwise fail deep inside the lowered graph (on CUDA,
a device-side assert that poisons the process); here it is one :class:`~popbert.errors.InputError`
line naming the input. What is checked, and why batches keep their integer dtype: docs/design.md,
section "popbert.runtime.inputs".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import torch

from popbert.errors import InputError

__all__ = ["TRIM_MULTIPLE", "InputChecker", "InputSpec", "PaddingTrimmer", "input_specs",
           "trimmed_width"]

Dim = int | str | None  # static size, symbolic name, or unknown
# Ops that pass their first input's values through unchanged (only the layout may change).
_VALUE_PRESERVING = {"Identity", "Cast", "Reshape", "Flatten", "Squeeze", "Unsqueeze",
                     "Transpose"}
_INTEGER_TYPES = {onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32,
                  onnx.TensorProto.INT64, onnx.TensorProto.UINT8, onnx.TensorProto.UINT16,
                  onnx.TensorProto.UINT32, onnx.TensorProto.UINT64}
# The values a narrower-than-int64 input type holds (int64 batches may exceed them).
_TYPE_RANGES = {onnx.TensorProto.UINT32: (0, 2**32 - 1),
                onnx.TensorProto.INT32: (-2**31, 2**31 - 1)}
#: Trimmed micro-batches are cut to a multiple of this many tokens (and MLM slots): few distinct
#: shapes, so compiled graphs and GEMM kernels see the same ones again.
TRIM_MULTIPLE = 8


@dataclass(frozen=True)
class InputSpec:
    """One graph input: its declared dims and, for an index input, the rows it may address."""

    name: str
    dims: tuple[Dim, ...] | None  # None: the graph declares no shape
    integer: bool
    bound: int | None = None  # values must lie in 0 .. bound - 1
    table: str | None = None  # the initializer the values index
    elem_type: int | None = None  # the declared onnx.TensorProto type

    def shape_text(self) -> str:
        dims = self.dims or ()
        inner = ", ".join("?" if d is None else str(d) for d in dims)
        return f"({inner},)" if len(dims) == 1 else f"({inner})"


def input_specs(proto: onnx.ModelProto, names: Sequence[str]) -> list[InputSpec]:
    """The specs of the graph inputs ``names`` (in that order)."""
    declared = {i.name: i for i in proto.graph.input}
    bounds = _index_bounds(proto)
    specs = []
    for name in names:
        info = declared.get(name)
        dims: tuple[Dim, ...] | None = None
        integer = False
        elem_type = None
        if info is not None and info.type.HasField("tensor_type"):
            tensor = info.type.tensor_type
            elem_type = tensor.elem_type
            integer = elem_type in _INTEGER_TYPES
            if tensor.HasField("shape"):
                dims = tuple(d.dim_value if d.HasField("dim_value")
                             else (d.dim_param or None) for d in tensor.shape.dim)
        bound, table = bounds.get(name, (None, None)) if integer else (None, None)
        specs.append(InputSpec(name, dims, integer, bound, table, elem_type))
    return specs


def _index_bounds(proto: onnx.ModelProto) -> dict[str, tuple[int, str]]:
    """For each graph input whose values (through layout-only ops) are ``Gather`` indices
    into an initializer: (rows on the gather axis, initializer name); the smallest if several."""
    initializers = {t.name: tuple(t.dims) for t in proto.graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in proto.graph.node:
        for value in node.input:
            consumers.setdefault(value, []).append(node)
    bounds: dict[str, tuple[int, str]] = {}
    for graph_input in proto.graph.input:
        if graph_input.name in initializers:
            continue
        frontier, seen = [graph_input.name], set()
        while frontier:
            value = frontier.pop()
            if value in seen:
                continue
            seen.add(value)
            for node in consumers.get(value, []):
                if node.op_type in _VALUE_PRESERVING and node.input[0] == value:
                    frontier.extend(node.output)
                elif (node.op_type == "Gather" and len(node.input) > 1
                      and node.input[1] == value and node.input[0] in initializers):
                    shape = initializers[node.input[0]]
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    rows = shape[axis % len(shape)] if shape else 0
                    known = bounds.get(graph_input.name)
                    if known is None or rows < known[0]:
                        bounds[graph_input.name] = (int(rows), node.input[0])
    return bounds


class InputChecker:
    """Checks batches against a graph's inputs (what is checked: docs/design.md,
    "popbert.runtime.inputs")."""

    def __init__(self, proto: onnx.ModelProto, names: Sequence[str]):
        self.names = list(names)
        self.specs = input_specs(proto, self.names)

    def check(self, batch: Mapping[str, torch.Tensor | np.ndarray], micro_batches: int = 1,
              per_run: str = "") -> dict[str, torch.Tensor]:
        """The graph's inputs of ``batch`` as tensors, or an InputError.

        ``micro_batches``: the leading dimension holds that many micro-batches back to back
        (a training run), each of which must fit the graph; ``per_run`` says where the count
        comes from, for the messages.
        """
        missing = [n for n in self.names if n not in batch]
        if missing:
            raise InputError(f"batch is missing graph input(s) {', '.join(map(repr, missing))}; "
                             f"the graph's inputs are {', '.join(self.names)}")
        tensors = {n: torch.as_tensor(batch[n]) for n in self.names}
        bound_dims: dict[str, tuple[int, str]] = {}  # symbolic name -> (size, first input)
        for spec in self.specs:
            tensor = tensors[spec.name]
            if spec.dims is not None:
                self._check_shape(spec, tuple(tensor.shape), micro_batches, per_run, bound_dims)
            declared = _TYPE_RANGES.get(spec.elem_type)
            if (spec.bound is None and declared is None) or not tensor.numel() \
                    or tensor.dtype == torch.bool:
                continue
            if tensor.dtype in (torch.uint16, torch.uint32, torch.uint64):
                tensor = tensor.long()  # torch has no aminmax for these (checked copy only)
            low, high = (int(v) for v in torch.aminmax(tensor.detach()))
            if spec.bound is not None:
                if low < 0 or high >= spec.bound:
                    value = low if low < 0 else high
                    if spec.name == "input_ids":
                        what = f"the vocabulary size {spec.bound} (ids 0..{spec.bound - 1})"
                    else:
                        what = (f"0..{spec.bound - 1} (the {spec.bound} rows of "
                                f"{spec.table!r} it indexes)")
                    raise InputError(f"input {spec.name!r} holds {value}, outside {what}")
            if declared is not None and (low < declared[0] or high > declared[1]):
                value = low if low < declared[0] else high
                kind = onnx.TensorProto.DataType.Name(spec.elem_type)
                raise InputError(f"input {spec.name!r} holds {value}, outside the graph's "
                                 f"{kind} range {declared[0]}..{declared[1]}")
        return tensors

    @staticmethod
    def _check_shape(spec: InputSpec, shape: tuple[int, ...], micro_batches: int, per_run: str,
                     bound_dims: dict[str, tuple[int, str]]) -> None:
        dims = spec.dims or ()
        per_micro = f" per micro-batch, {micro_batches} micro-batches per run{per_run}" \
            if micro_batches > 1 else ""
        if len(shape) != len(dims):
            raise InputError(f"input {spec.name!r} has shape {shape} but the graph takes "
                             f"{spec.shape_text()}{per_micro}")
        for axis, (size, dim) in enumerate(zip(shape, dims)):
            if axis == 0 and micro_batches > 1:
                if size % micro_batches:
                    raise InputError(f"input {spec.name!r} has {size} rows, which do not divide "
                                     f"into {micro_batches} micro-batches per run{per_run}")
                checked = size // micro_batches
            else:
                checked = size
            if isinstance(dim, int) and checked != dim:
                raise InputError(f"input {spec.name!r} has shape {shape} but the graph takes "
                                 f"{spec.shape_text()}{per_micro}")
            if isinstance(dim, str):
                known = bound_dims.setdefault(dim, (size, spec.name))
                if known[0] != size:
                    raise InputError(f"input {spec.name!r} has {size} as its {dim} (dimension "
                                     f"{axis}, shape {shape}) but input {known[1]!r} has "
                                     f"{known[0]}: every input holds the same {dim}")


class PaddingTrimmer:
    """Cuts a micro-batch of unpacked rows to its longest row, so the padding past it is never
    computed (the GEMMs skip it too, not only attention), and the MLM prediction slots to the
    most any row uses.

    Exact: padded keys get an exact zero after softmax, padded tokens never mix into real ones,
    and unused slots are ignored by the loss; only the GEMMs' summation order may differ. Needs
    a graph whose `input_mask` has a symbolic sequence axis (`build_bert(...,
    dynamic_sequence=True)`); every input declared with that symbol is cut along it, and every
    input sharing `masked_lm_ids`'s symbolic slot axis is cut to the slots in use.
    """

    def __init__(self, specs: Sequence[InputSpec], mask: str = "input_mask",
                 slot_labels: str = "masked_lm_ids", multiple: int = TRIM_MULTIPLE):
        by_name = {s.name: s for s in specs}
        mask_dims = by_name[mask].dims if mask in by_name else None
        if not mask_dims or len(mask_dims) < 2 or not isinstance(mask_dims[-1], str):
            raise ValueError(f"trimming padding needs a graph input {mask!r} of shape [batch, "
                             f"(texts,) sequence] with a symbolic sequence axis (build_bert(..., "
                             f"dynamic_sequence=True)); the graph declares "
                             f"{by_name[mask].shape_text() if mask in by_name else 'none'}")
        self.mask, self.slot_labels, self.multiple = mask, slot_labels, multiple
        self.sequence_inputs = _inputs_with_axis(specs, mask_dims[-1])
        label_dims = by_name[slot_labels].dims if slot_labels in by_name else None
        self.slot_inputs = (_inputs_with_axis(specs, label_dims[-1])
                            if label_dims and len(label_dims) == 2
                            and isinstance(label_dims[-1], str) else [])

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        trimmed = dict(batch)
        width = self._width(batch[self.mask])
        for name in self.sequence_inputs:
            trimmed[name] = batch[name][..., :width]
        if self.slot_inputs:
            slots = self._width(batch[self.slot_labels])
            for name in self.slot_inputs:
                trimmed[name] = batch[name][..., :slots]
        return trimmed

    def _width(self, marks: torch.Tensor) -> int:
        return trimmed_width(marks, self.multiple)


def trimmed_width(marks: torch.Tensor, multiple: int = TRIM_MULTIPLE) -> int:
    """One past the last nonzero column (last axis) of any row of `marks`, rounded up to
    `multiple` (at least `multiple`, at most the full width)."""
    full = marks.shape[-1]
    used = marks.reshape(-1, full).ne(0).any(dim=0).nonzero()
    last = int(used[-1]) + 1 if used.numel() else 1
    return min(full, -(-last // multiple) * multiple)


def _inputs_with_axis(specs: Sequence[InputSpec], symbol: str) -> list[str]:
    """The inputs whose last axis is the symbolic dimension `symbol` ([batch, sequence], or
    [batch, texts, sequence] for rows of several texts)."""
    return [s.name for s in specs if s.dims and len(s.dims) > 1 and s.dims[-1] == symbol]
