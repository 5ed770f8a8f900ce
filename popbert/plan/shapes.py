"""Static shapes of every tensor of an annotated graph at a given batch size, without weights.

The plan never runs the graph: what it knows about activations and matmuls comes from ONNX
shape inference. Inference on the full model would copy every weight (1.3 GB for BERT-Large)
just to read their shapes, so it runs on a light copy in which the trainable initializers are
graph inputs of the same type and shape; the constant initializers (shape vectors, axes, the
position ids) stay, because Reshape/Expand shapes are inferred from their values. The builder's
own value_info is kept, so ops shape inference does not know (PopART's ``ai.graphcore`` Gelu,
GroupNormalization, Nll) still have shapes.

A symbolic batch dimension (``batch_size``, the first axis of the graph inputs) is replaced by
the batch asked for wherever it appears, so a graph saved with a dynamic batch (a run's
``model.onnx``) plans the same as one built at the micro-batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from popbert.graph.shapes import weight_free_copy

__all__ = ["TensorShape", "infer_tensor_shapes"]

# Bytes per element of the ONNX element types a BERT graph holds.
_ITEM_BYTES = {
    TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2,
    TensorProto.DOUBLE: 8, TensorProto.INT64: 8, TensorProto.INT32: 4, TensorProto.UINT32: 4,
    TensorProto.INT16: 2, TensorProto.UINT16: 2, TensorProto.INT8: 1, TensorProto.UINT8: 1,
    TensorProto.BOOL: 1,
}


@dataclass(frozen=True)
class TensorShape:
    """One tensor's static shape and element type (``shape`` None: unknown rank or a dim)."""

    shape: tuple[int, ...] | None
    elem_type: int

    @property
    def numel(self) -> int | None:
        """Elements, or None when the shape is not fully known."""
        return None if self.shape is None else int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int | None:
        """Bytes at the element type's width, or None when the shape is not fully known."""
        numel = self.numel
        return None if numel is None else numel * _ITEM_BYTES.get(self.elem_type, 4)


def infer_tensor_shapes(model: onnx.ModelProto, batch: int) -> dict[str, TensorShape]:
    """Every tensor's shape at batch size ``batch``: graph inputs, initializers, node outputs.

    Tensors whose shape cannot be inferred map to a ``TensorShape`` with ``shape=None``.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    shapes: dict[str, TensorShape] = {
        init.name: TensorShape(tuple(int(d) for d in init.dims), init.data_type)
        for init in model.graph.initializer}
    light_model = weight_free_copy(model, batch)
    inferred = onnx.shape_inference.infer_shapes(light_model, strict_mode=False, data_prop=True)
    ig = inferred.graph
    for vi in [*ig.input, *ig.value_info, *ig.output]:
        if not vi.type.HasField("tensor_type") or vi.name in shapes:
            continue
        tt = vi.type.tensor_type
        shape = None
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            shape = tuple(int(d.dim_value) for d in tt.shape.dim)
        shapes[vi.name] = TensorShape(shape, tt.elem_type)
    return shapes
