"""The per-op converters, one module per op family; importing this package registers them all.

Each converter is a small function ``converter(ctx) -> list[value]`` registered under
``(domain, op_type)`` in :data:`~popbert.lowering.context.CONVERTERS` by
:func:`~popbert.lowering.context.register_converter`. It reads its inputs and attributes from
the :class:`~popbert.lowering.context.NodeContext` and emits torch calls through ``ctx.call``;
when every argument of a call is a lowering-time constant the call is evaluated immediately
(constant folding), so shape arithmetic never reaches the generated code.

* :mod:`.elementwise`: unary/binary/variadic math, comparisons, logic, Where, Clip, casts.
* :mod:`.shape`: Reshape, Transpose, (Un)Squeeze, Concat, Split, Slice, Gather*, Shape, Expand,
  Constant, ConstantOfShape, Range.
* :mod:`.reduction`: Reduce{Sum,Mean,Max,Min}, ArgMax.
* :mod:`.nn`: MatMul, Gemm, (Log)Softmax, LayerNormalization, Attention, Dropout, losses, Conv.
* :mod:`.graphcore`: PopART's ``ai.graphcore`` ops (Gelu, GeluErf, Detach, Scale,
  GroupNormalization, Nll).
"""

from popbert.lowering.context import CONVERTERS
from popbert.lowering.converters import elementwise, graphcore, nn, reduction, shape

__all__ = ["CONVERTERS", "elementwise", "graphcore", "nn", "reduction", "shape"]
