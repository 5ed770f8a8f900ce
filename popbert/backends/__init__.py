"""Backends that run a popbert ONNX graph; ``torch`` lowers it to ``torch.fx`` once."""

from popbert.backends.torch_lowering import (
    LoweringError,
    OnnxGraphModule,
    UnsupportedOpError,
    escape_param_name,
    lower_to_fx,
    unescape_param_name,
)
from popbert.backends.torch_ops import CONVERTERS, register_converter

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
