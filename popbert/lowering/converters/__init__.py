"""The per-op converters, one module per op family; importing this package registers them all.

Each converter turns one ONNX node into torch calls and is registered under ``(domain, op_type)``.
The converter contract and the op families: docs/design.md, section
"popbert.lowering.converters".
"""

from popbert.lowering.context import CONVERTERS
from popbert.lowering.converters import elementwise, graphcore, nn, reduction, shape

__all__ = ["CONVERTERS", "elementwise", "graphcore", "nn", "reduction", "shape"]
