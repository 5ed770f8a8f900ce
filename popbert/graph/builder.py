"""A PopART-compatible graph builder that emits an annotated ONNX model op by op.

Model code written against `popart.Builder` (``builder.aiOnnx.matmul([a, b])``, ``with
builder.virtualGraph(1):``, ``builder.checkpointOutput([t])`` ...) runs unchanged against
`popbert.Builder`. Every node carries PopART's own annotation attributes (``__ipu_number``,
``__pipeline_stage``, ...), so the same proto means the same thing to the torch and PopART
backends. Each node is checked when it is added (op exists, input count, attributes, tensors
known, shapes broadcast) so mistakes surface at build time with the op's name, not later inside
ONNX Runtime or torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from popbert.graph.annotations import (
    ANNOTATIONS,
    AVAILABLE_MEMORY,
    CONSTANTS_KEY,
    IPU_NUMBER,
    PIPELINE_STAGE,
    RECOMPUTE,
    SERIALIZE_FACTOR,
    SERIALIZE_MODE,
    SERIALIZE_PRECISION,
    RecomputeType,
)


class BuilderError(ValueError):
    """Misuse of the Builder, raised at build time with the op, tensor or key named."""


GRAPHCORE_DOMAIN = "ai.graphcore"
# ONNX IR version that ONNX Runtime 1.20+ accepts with opset 23 (the onnx package defaults to a
# newer IR that current ORT releases reject).
IR_VERSION = 11
DIALECT_OPSETS = {"onnx": 23, "popart": 11}

_DTYPES = {
    "FLOAT": TensorProto.FLOAT, "FLOAT32": TensorProto.FLOAT, "FLOAT16": TensorProto.FLOAT16,
    "BFLOAT16": TensorProto.BFLOAT16, "DOUBLE": TensorProto.DOUBLE, "FLOAT64": TensorProto.DOUBLE,
    "INT32": TensorProto.INT32, "INT64": TensorProto.INT64, "UINT8": TensorProto.UINT8,
    "UINT32": TensorProto.UINT32,
    "INT8": TensorProto.INT8, "BOOL": TensorProto.BOOL,
}


@dataclass(frozen=True)
class TensorInfo:
    """Mirror of `popart.TensorInfo(dtype, shape)`; dims may be ints or symbolic names."""

    dtype: str
    shape: Sequence[int | str]

    def elem_type(self) -> int:
        key = str(self.dtype).upper()
        if key not in _DTYPES:
            raise BuilderError(f"TensorInfo: unknown dtype {self.dtype!r}; "
                               f"expected one of {sorted(_DTYPES)}")
        return _DTYPES[key]


def _schema_table(domain: str, opset: int) -> dict[str, onnx.defs.OpSchema]:
    """Lower-case op name -> schema at `opset`, the way PopART names its op methods."""
    table: dict[str, onnx.defs.OpSchema] = {}
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain != domain or schema.since_version > opset:
            continue
        key = schema.name.lower()
        if key not in table or table[key].since_version < schema.since_version:
            table[key] = schema
    return table


class _GraphcoreOp:
    """Schema-like description of an `ai.graphcore` op (not in onnx.defs)."""

    def __init__(self, name: str, min_inputs: int, max_inputs: int, n_outputs: int,
                 attributes: Sequence[str], infer):
        self.name = name
        self.min_input = min_inputs
        self.max_input = max_inputs
        self.n_outputs = n_outputs
        self.attributes = set(attributes)
        self.infer = infer


def _same_as_input(inputs: list[onnx.TypeProto], attrs: dict) -> list[onnx.TypeProto]:
    return [inputs[0]]


def _groupnorm_outputs(inputs: list[onnx.TypeProto], attrs: dict) -> list[onnx.TypeProto]:
    x = inputs[0].tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in x.shape.dim]
    stat = helper.make_tensor_type_proto(x.elem_type, [dims[0] if dims else None])
    return [inputs[0], stat, stat]


def _nll_outputs(inputs: list[onnx.TypeProto], attrs: dict) -> list[onnx.TypeProto]:
    x = inputs[0].tensor_type
    if attrs.get("reduction", 0) == 2:  # popart.ReductionType.NoReduction
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in x.shape.dim]
        return [helper.make_tensor_type_proto(x.elem_type, dims[:-1])]
    return [helper.make_tensor_type_proto(x.elem_type, [])]


def _gathered_outputs(inputs: list[onnx.TypeProto], attrs: dict) -> list[onnx.TypeProto]:
    """[rows, ...] → [every replica's rows, ...]: the first axis becomes a new symbol."""
    x = inputs[0].tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in x.shape.dim]
    return [helper.make_tensor_type_proto(x.elem_type, ["replicas_rows", *dims[1:]])]


# The ai.graphcore ops BERT needs in the popart dialect (PopART's own op set, version 1), with
# their input/output counts, attributes and shape inference: onnx knows no schema for them, so
# the Builder infers their outputs itself and writes them to the graph's value_info.
# `Gelu` is poplibs' tanh approximation, `GeluErf` the exact erf form.
GRAPHCORE_OPS = {
    "gelu": _GraphcoreOp("Gelu", 1, 1, 1, [], _same_as_input),
    "geluerf": _GraphcoreOp("GeluErf", 1, 1, 1, [], _same_as_input),
    "detach": _GraphcoreOp("Detach", 1, 1, 1, [], _same_as_input),
    "groupnormalization": _GraphcoreOp("GroupNormalization", 3, 3, 3, ["num_groups", "epsilon"],
                                       _groupnorm_outputs),
    "nllloss": _GraphcoreOp("Nll", 2, 2, 1, ["reduction", "ignoreIndex", "inputIsLogProbability"],
                            _nll_outputs),
    # Every replica's rows concatenated along the first axis, keeping the gradient (in-batch
    # negatives across replicas; `popbert.distributed.gather`).
    "replicatedallgather": _GraphcoreOp("ReplicatedAllGather", 1, 1, 1, [], _gathered_outputs),
}


class _OpSet:
    """`builder.aiOnnx` / `builder.aiGraphcore`: attribute access emits an op by name."""

    def __init__(self, builder: Builder, domain: str):
        self._builder = builder
        self._domain = domain

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        key = name.lower()
        if key.startswith("opset") and key[5:].isdigit():  # builder.aiOnnxOpset11 style
            return self
        self._builder.op_schema(self._domain, key)  # raises BuilderError for unknown ops

        def emit(args: Sequence[str], debugContext: str = "", **attributes: Any):
            return self._builder.add_node(self._domain, key, list(args), attributes,
                                           debugContext)

        emit.__name__ = name
        return emit


class Builder:
    """Build an annotated ONNX graph with `popart.Builder`'s API.

    ``dialect="onnx"`` emits the standard opset 23 (what ONNX Runtime and the torch backend run
    fastest); ``dialect="popart"`` emits ai.onnx opset 11 plus ``ai.graphcore`` ops (what PopART
    accepts). Model code asks ``builder.dialect`` where the two differ.
    """

    def __init__(self, dialect: str = "onnx", opset: int | None = None,
                 graph_name: str = "popbert"):
        if dialect not in DIALECT_OPSETS:
            raise BuilderError(f"Builder: unknown dialect {dialect!r}; expected one of "
                               f"{', '.join(map(repr, DIALECT_OPSETS))}")
        self.dialect = dialect
        self.opset = opset or DIALECT_OPSETS[dialect]
        self.graph_name = graph_name
        self._schemas = _schema_table("", self.opset)
        self._nodes: list[onnx.NodeProto] = []
        self._producer: dict[str, onnx.NodeProto] = {}  # tensor -> the node that makes it
        self._types: dict[str, onnx.TypeProto] = {}
        self._constants: dict[str, np.ndarray] = {}
        self._inputs: list[str] = []
        self._initializers: dict[str, onnx.TensorProto] = {}
        self._outputs: list[str] = []
        self._names: set[str] = set()
        self._scopes: list[str] = []
        self._virtual_graph: list[int] = []
        self._pipeline_stage: list[int] = []
        self._stage_of_tensor: dict[str, int] = {}
        self.aiOnnx = _OpSet(self, "")
        self.aiGraphcore = _OpSet(self, GRAPHCORE_DOMAIN)

    # ------------------------------------------------------------------ tensors
    def addInputTensor(self, tensorInfo: TensorInfo | str, shape_or_debug: Any = "",
                       debugContext: str = "") -> str:
        """Add a graph input: ``addInputTensor(TensorInfo("INT64", ["B", 128]), "input_ids")``.

        The popart-style ``addInputTensor("FLOAT", [2, 3], "x")`` form is accepted too.
        """
        if isinstance(tensorInfo, str):
            info, name = TensorInfo(tensorInfo, shape_or_debug), debugContext
        else:
            info, name = tensorInfo, shape_or_debug or debugContext
        name = self._unique(self._scoped(name or "input"))
        if self.dialect == "popart" and any(
                isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in info.shape):
            # PopART compiles for fixed shapes (the micro batch included).
            raise BuilderError(f"addInputTensor({name!r}): the popart dialect needs static "
                               f"shapes, got {list(info.shape)}")
        self._types[name] = helper.make_tensor_type_proto(info.elem_type(), list(info.shape))
        self._inputs.append(name)
        return name

    def addInitializedInputTensor(self, value: np.ndarray, debugContext: str = "") -> str:
        """Add a weight (an ONNX initializer); the name carries the current name scope."""
        array = np.asarray(value)
        if array.dtype == np.float64:
            raise BuilderError(f"addInitializedInputTensor({debugContext!r}): float64 weights are "
                               "not supported; pass float32/float16")
        name = self._unique(self._scoped(debugContext or "weight"))
        tensor = numpy_helper.from_array(array, name)
        self._initializers[name] = tensor
        self._types[name] = helper.make_tensor_type_proto(tensor.data_type, list(array.shape))
        return name

    def addConstant(self, value: np.ndarray, debugContext: str = "const") -> str:
        """A constant the sessions never train (shape vectors, scales, position ids).

        Stored as an initializer listed in the model's ``popbert.constants`` metadata rather than as
        a `Constant` node: a Constant carrying placement attributes is misread by both
        onnx's shape inference and ONNX Runtime, and every node must carry its placement.
        """
        array = np.asarray(value)
        name = self._unique(self._scoped(debugContext))
        self._constants[name] = array
        self._types[name] = helper.make_tensor_type_proto(
            helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape))
        return name

    def addOutputTensor(self, name: str) -> None:
        self._require([name], "addOutputTensor")
        if name not in self._outputs:
            self._outputs.append(name)

    def getInputTensorIds(self) -> list[str]:
        return list(self._inputs)

    def getOutputTensorIds(self) -> list[str]:
        return list(self._outputs)

    def getTensorShape(self, name: str) -> list[int | str]:
        self._require([name], "getTensorShape")
        dims = self._types[name].tensor_type.shape.dim
        return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]

    def getTensorDtypeString(self, name: str) -> str:
        self._require([name], "getTensorDtypeString")
        return TensorProto.DataType.Name(self._types[name].tensor_type.elem_type).lower()

    def hasTensor(self, name: str) -> bool:
        return name in self._types

    @property
    def constants(self) -> list[str]:
        return list(self._constants)

    @property
    def weights(self) -> list[str]:
        """Trainable initializer names, in creation order."""
        return list(self._initializers)

    # ------------------------------------------------------------------ contexts
    @contextlib.contextmanager
    def nameScope(self, name: str) -> Iterator[None]:
        """Prefix tensor and node names: ``Layer3/Attention/QKV``."""
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()

    def virtualGraph(self, value_or_tensor: int | str, value: int | None = None):
        """``with builder.virtualGraph(1):`` or ``builder.virtualGraph(tensor, 1)``."""
        if isinstance(value_or_tensor, str):
            self._set_node_attribute(value_or_tensor, IPU_NUMBER, int(value), "virtualGraph")
            return None
        return self._stack_context(self._virtual_graph, int(value_or_tensor), "virtualGraph")

    def pipelineStage(self, value_or_tensor: int | str, value: int | None = None):
        """``with builder.pipelineStage(2):`` or ``builder.pipelineStage(tensor, 2)``."""
        if isinstance(value_or_tensor, str):
            self._set_node_attribute(value_or_tensor, PIPELINE_STAGE, int(value), "pipelineStage")
            return None
        return self._stack_context(self._pipeline_stage, int(value_or_tensor), "pipelineStage")

    @contextlib.contextmanager
    def _stack_context(self, stack: list[int], value: int, what: str) -> Iterator[None]:
        if value < 0:
            raise BuilderError(f"{what}({value}): expected a value >= 0")
        stack.append(value)
        try:
            yield
        finally:
            stack.pop()

    # ------------------------------------------------------------------ annotations
    def checkpointOutput(self, tensors: Sequence[str]) -> list[str]:
        """Mark activations to keep for the backward pass (PopART: an Identity per tensor)."""
        self._require(list(tensors), "checkpointOutput")
        outputs = []
        for tensor in tensors:
            out = self.add_node("", "identity", [tensor], {}, "checkpoint")
            self._producer[out].attribute.append(helper.make_attribute(RECOMPUTE,
                                                                       RecomputeType.Checkpoint))
            outputs.append(out)
        return outputs

    def recomputeOutputInBackwardPass(self, tensors: str | Sequence[str],
                                      value: int = RecomputeType.Recompute) -> None:
        for tensor in [tensors] if isinstance(tensors, str) else tensors:
            self._set_node_attribute(tensor, RECOMPUTE, int(value),
                                     "recomputeOutputInBackwardPass")

    def setAvailableMemoryProportion(self, tensor: str, proportion: float) -> None:
        if not 0.0 < proportion <= 1.0:
            raise BuilderError(f"setAvailableMemoryProportion({tensor!r}): proportion must be in "
                               f"(0, 1], got {proportion}")
        self._set_node_attribute(tensor, AVAILABLE_MEMORY, float(proportion),
                                 "setAvailableMemoryProportion")

    def setSerializeMatMul(self, tensors: Sequence[str] | set[str], mode: str,
                           factor: int = 0, keep_precision: bool = False) -> None:
        modes = ("input_channels", "reducing_dim", "output_channels", "none")
        if mode not in modes:
            raise BuilderError(f"setSerializeMatMul: mode must be one of {modes}, got {mode!r}")
        for tensor in tensors:
            node = self._node_of(tensor, "setSerializeMatMul")
            if node.op_type != "MatMul":
                raise BuilderError(f"setSerializeMatMul: {tensor!r} is produced by "
                                   f"{node.op_type}, not MatMul")
            self._set_node_attribute(tensor, SERIALIZE_MODE, mode, "setSerializeMatMul")
            self._set_node_attribute(tensor, SERIALIZE_FACTOR, int(factor), "setSerializeMatMul")
            self._set_node_attribute(tensor, SERIALIZE_PRECISION, int(keep_precision),
                                     "setSerializeMatMul")

    # ------------------------------------------------------------------ output
    def getModel(self) -> onnx.ModelProto:
        """The graph as an `onnx.ModelProto` (popbert extension; PopART returns bytes only)."""
        if not self._outputs:
            raise BuilderError("getModelProto: the graph has no outputs; call addOutputTensor")
        initializers = list(self._initializers.values()) + [
            numpy_helper.from_array(v, k) for k, v in self._constants.items()]
        value_info = [helper.make_value_info(n, t) for n, t in self._types.items()
                      if n not in self._inputs and n not in self._outputs
                      and n not in self._initializers and n not in self._constants]
        graph = helper.make_graph(
            list(self._nodes), self.graph_name,
            [helper.make_value_info(n, self._types[n]) for n in self._inputs],
            [helper.make_value_info(n, self._types[n]) for n in self._outputs],
            initializer=initializers, value_info=value_info)
        opsets = [helper.make_opsetid("", self.opset)]
        if any(n.domain == GRAPHCORE_DOMAIN for n in self._nodes):
            opsets.append(helper.make_opsetid(GRAPHCORE_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION,
                                  producer_name="popbert")
        helper.set_model_props(model, {CONSTANTS_KEY: ",".join(self._constants)})
        return model

    def getModelProto(self) -> bytes:
        """The serialized ModelProto, exactly as `popart.Builder.getModelProto()` returns it."""
        return self.getModel().SerializeToString()

    # ------------------------------------------------------------------ internals
    def _scoped(self, name: str) -> str:
        return "/".join([*self._scopes, name]) if self._scopes else name

    def _unique(self, name: str) -> str:
        candidate, i = name, 0
        while candidate in self._names:
            i += 1
            candidate = f"{name}:{i}"
        self._names.add(candidate)
        return candidate

    def _require(self, tensors: Sequence[str], what: str) -> None:
        for tensor in tensors:
            if not isinstance(tensor, str):
                raise BuilderError(f"{what}: expected tensor names (str), got {tensor!r}")
            if tensor and tensor not in self._types:
                raise BuilderError(f"{what}: tensor {tensor!r} is not in the graph")

    def _node_of(self, tensor: str, what: str) -> onnx.NodeProto:
        self._require([tensor], what)
        if tensor not in self._producer:
            raise BuilderError(f"{what}: tensor {tensor!r} is a graph input or weight, "
                               "not the output of an op")
        return self._producer[tensor]

    def _set_node_attribute(self, tensor: str, key: str, value: Any, what: str) -> None:
        node = self._node_of(tensor, what)
        kept = [a for a in node.attribute if a.name != key]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute(key, value)])

    def op_schema(self, domain: str, key: str) -> Any:
        """The schema of op `key` (lower case) in `domain`; BuilderError for an unknown op."""
        if domain == GRAPHCORE_DOMAIN:
            if key not in GRAPHCORE_OPS:
                raise BuilderError(f"aiGraphcore.{key}: unknown op; known: {sorted(GRAPHCORE_OPS)}")
            return GRAPHCORE_OPS[key]
        if key not in self._schemas:
            raise BuilderError(f"aiOnnx.{key}: no such op in ai.onnx opset {self.opset}")
        return self._schemas[key]

    def _annotations(self) -> dict[str, int]:
        attrs = {}
        if self._virtual_graph:
            attrs[IPU_NUMBER] = self._virtual_graph[-1]
        if self._pipeline_stage:
            attrs[PIPELINE_STAGE] = self._pipeline_stage[-1]
        return attrs

    def add_node(self, domain: str, key: str, inputs: list[str], attributes: dict[str, Any],
                 debug: str) -> str | list[str]:
        """Check and append one node (what `aiOnnx.<op>` / `aiGraphcore.<op>` call); returns its
        output name(s)."""
        schema = self.op_schema(domain, key)
        op_type = schema.name
        where = f"{'aiGraphcore' if domain else 'aiOnnx'}.{key}({debug or op_type})"
        self._require(inputs, where)
        if not schema.min_input <= len(inputs) <= schema.max_input:
            raise BuilderError(f"{where}: expected {schema.min_input}..{schema.max_input} inputs, "
                               f"got {len(inputs)}")
        attributes = {k: v for k, v in attributes.items() if v is not None}
        known = set(schema.attributes) | set(ANNOTATIONS)
        unknown = sorted(set(attributes) - known)
        if unknown:
            raise BuilderError(f"{where}: unknown attribute(s) {unknown}; "
                               f"{op_type} accepts {sorted(schema.attributes)}")
        self._check_stage_order(inputs, where)
        n_outputs = self._output_count(schema, attributes, where)
        base = self._scoped(debug or op_type)
        outputs = [self._unique(base if n_outputs == 1 else f"{base}:out{i}")
                   for i in range(n_outputs)]
        node = helper.make_node(op_type, inputs, outputs, name=self._unique(f"{base}/node"),
                                domain=domain, **attributes, **self._annotations())
        for out, type_proto in zip(outputs, self._infer(schema, node, inputs, attributes, where)):
            self._types[out] = type_proto
        self._nodes.append(node)
        for out in outputs:
            self._producer[out] = node
            if self._pipeline_stage:
                self._stage_of_tensor[out] = self._pipeline_stage[-1]
        return outputs[0] if n_outputs == 1 else outputs

    def _output_count(self, schema, attributes: dict, where: str) -> int:
        if isinstance(schema, _GraphcoreOp):
            return schema.n_outputs
        if schema.name == "Split":
            if "num_outputs" in attributes:
                return int(attributes["num_outputs"])
            if "split" in attributes:  # opset < 13: the sizes are an attribute
                return len(attributes["split"])
            raise BuilderError(f"{where}: Split needs num_outputs= (or split= before opset 13)")
        if schema.name in ("Dropout", "LayerNormalization", "SoftmaxCrossEntropyLoss",
                           "Attention", "BatchNormalization", "MaxPool"):
            return 1  # optional extra outputs are not requested
        return schema.max_output if schema.max_output < 8 else schema.min_output

    def _check_stage_order(self, inputs: list[str], where: str) -> None:
        """A pipeline stage may consume earlier stages' tensors, never later ones."""
        if not self._pipeline_stage:
            return
        stage = self._pipeline_stage[-1]
        for tensor in inputs:
            producer_stage = self._stage_of_tensor.get(tensor)
            if producer_stage is not None and producer_stage > stage:
                raise BuilderError(
                    f"{where}: pipeline stage goes backwards: input {tensor!r} comes from stage "
                    f"{producer_stage} but this op is in stage {stage}")

    def _infer(self, schema, node: onnx.NodeProto, inputs: list[str], attributes: dict,
               where: str) -> list[onnx.TypeProto]:
        input_types = [self._types[name] for name in inputs if name]
        if isinstance(schema, _GraphcoreOp):
            return schema.infer(input_types, attributes)
        input_types_by_name = {name: self._types[name] for name in inputs if name}
        input_data = {}
        for name in inputs:
            if name in self._constants:
                input_data[name] = numpy_helper.from_array(self._constants[name], name)
            elif name in self._initializers and self._initializers[name].data_type in (
                    TensorProto.INT64, TensorProto.INT32):
                input_data[name] = self._initializers[name]
        try:
            inferred = shape_inference.infer_node_outputs(
                schema, node, input_types_by_name, input_data)
        except Exception as error:  # onnx raises InferenceError / ValidationError
            detail = str(error).strip().splitlines()[-1]
            shapes = {n: self.getTensorShape(n) for n in inputs if n}
            raise BuilderError(f"{where}: {detail} (input shapes {shapes})") from None
        result = []
        for out in node.output:
            if out in inferred:
                result.append(inferred[out])
            else:  # shape unknown (data-dependent): keep at least the element type
                result.append(helper.make_tensor_type_proto(
                    input_types[0].tensor_type.elem_type if input_types else TensorProto.FLOAT,
                    None))
        return result
