"""A weight-free copy of a graph for ONNX shape inference: what the lowering and the plan read.

Shape inference on the real model would copy every weight (BERT-Large: 1.3 GB) and trips over
PopART's `__` annotations. The copy turns float weights into typed graph inputs, keeps the small
integer initializers and the graph's constants (shape vectors, axes, position ids: inference
propagates their values), drops the annotations, and can fix a symbolic batch dimension.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from popbert.graph.annotations import ANNOTATION_PREFIX, constant_initializers

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
# Integer initializers up to this many elements stay values in the copy.
SMALL_INITIALIZER = 4096


def _numel(init: onnx.TensorProto) -> int:
    count = 1
    for d in init.dims:
        count *= int(d)
    return count


def batch_names(graph: onnx.GraphProto) -> set[str]:
    """The symbolic names of the graph inputs' leading (batch) dimension."""
    names = set()
    for vi in graph.input:
        dims = vi.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_param"):
            names.add(dims[0].dim_param)
    return names


def _concrete(vi: onnx.ValueInfoProto, names: set[str], batch: int | None
              ) -> onnx.ValueInfoProto:
    if batch is None:
        return vi
    out = onnx.ValueInfoProto()
    out.CopyFrom(vi)
    if out.type.HasField("tensor_type") and out.type.tensor_type.HasField("shape"):
        for dim in out.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in names:
                dim.dim_value = batch  # assigning the value clears the oneof's dim_param
    return out


def weight_free_copy(model: onnx.ModelProto, batch: int | None = None) -> onnx.ModelProto:
    """The graph without its weights' values and annotations; ``batch`` fixes a symbolic batch
    dimension of the inputs, outputs and value infos."""
    g = model.graph
    names = batch_names(g)
    constants = constant_initializers(model)
    light = onnx.GraphProto(name=g.name)
    light.input.extend(_concrete(vi, names, batch) for vi in g.input)
    known = {vi.name for vi in g.input}
    for init in g.initializer:
        small_int = init.data_type not in _FLOATS and _numel(init) <= SMALL_INITIALIZER
        if init.name in constants or small_int:
            light.initializer.append(init)
        elif init.name not in known:
            light.input.append(helper.make_tensor_value_info(init.name, init.data_type,
                                                             list(init.dims)))
    for node in g.node:
        copy = light.node.add()
        copy.CopyFrom(node)
        kept = [a for a in copy.attribute if not a.name.startswith(ANNOTATION_PREFIX)]
        del copy.attribute[:]
        copy.attribute.extend(kept)
    light.output.extend(_concrete(vi, names, batch) for vi in g.output)
    light.value_info.extend(_concrete(vi, names, batch) for vi in g.value_info)
    copy_model = helper.make_model(light, opset_imports=list(model.opset_import))
    copy_model.ir_version = model.ir_version
    copy_model.functions.extend(model.functions)
    return copy_model


__all__ = ["SMALL_INITIALIZER", "batch_names", "weight_free_copy"]
