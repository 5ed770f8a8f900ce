"""ONNX → torch.fx: the graph lowered once into a module whose parameters are its initializers."""

from popbert.lowering.lower import (
    LoweringError,
    OnnxGraphModule,
    UnsupportedOpError,
    escape_param_name,
    lower_to_fx,
    unescape_param_name,
)
from popbert.lowering.ops import CONVERTERS, register_converter

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
