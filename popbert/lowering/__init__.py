"""ONNX → torch.fx: the graph lowered once into a module whose parameters are its initializers.

* :mod:`~popbert.lowering.context`: what converters see of a node, the converter registry,
  errors, parameter name escaping, dtypes (the shared vocabulary; imports no other module here).
* :mod:`~popbert.lowering.functional`: the python the lowered graph calls at run time.
* :mod:`~popbert.lowering.converters`: one converter per ONNX op, by op family.
* :mod:`~popbert.lowering.fusion`: the MatMul + Add -> ``F.linear`` pass.
* :mod:`~popbert.lowering.lower`: :func:`lower_to_fx` and :class:`OnnxGraphModule`.
"""

from popbert.lowering.context import (
    CONVERTERS,
    LoweringError,
    UnsupportedOpError,
    escape_param_name,
    register_converter,
    unescape_param_name,
)
from popbert.lowering.lower import OnnxGraphModule, lower_to_fx

__all__ = [
    "CONVERTERS",
    "LoweringError",
    "OnnxGraphModule",
    "UnsupportedOpError",
    "escape_param_name",
    "lower_to_fx",
    "register_converter",
    "unescape_param_name",
]
