"""PopART's graph annotations: the one place their names and values are defined and read.

Every node the Builder emits may carry PopART's own attributes: the device (`__ipu_number`), the
pipeline stage (`__pipeline_stage`), recomputation (`__recompute_output_in_backward_pass`, on the
Identity node `checkpointOutput` adds: 1 = keep for the backward pass, 2 = recompute), and
memory/serialisation hints. A graph from `popbert.Builder` or `popart.Builder` therefore means the
same to both backends. The lowering copies them onto fx nodes (``node.meta["onnx"]``), where the
runtime reads them back with :func:`annotation` to split stages and recompute regions.

The model's metadata lists the initializers that are constants (shape vectors, scales, position
ids) under :data:`CONSTANTS_KEY`: sessions never train them, exports keep them. A training
graph's metadata may say what its loss is the mean over (:data:`LOSS_MEAN_KEY`, `LossMean`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx
from onnx import TensorProto

# PopART's node attribute names (REFERENCE.md); every one starts with ANNOTATION_PREFIX.
ANNOTATION_PREFIX = "__"
IPU_NUMBER = "__ipu_number"
PIPELINE_STAGE = "__pipeline_stage"
RECOMPUTE = "__recompute_output_in_backward_pass"
AVAILABLE_MEMORY = "__available_memory"
SERIALIZE_MODE = "__serialize_matmul_mode"
SERIALIZE_FACTOR = "__serialize_matmul_factor"
SERIALIZE_PRECISION = "__serialize_matmul_precision"
ANNOTATIONS = (IPU_NUMBER, PIPELINE_STAGE, RECOMPUTE, AVAILABLE_MEMORY, SERIALIZE_MODE,
               SERIALIZE_FACTOR, SERIALIZE_PRECISION)

# popbert's keys in the model's metadata_props (the exports record their task settings there).
METADATA_PREFIX = "popbert."
# Model metadata key listing the initializers that are constants, not weights.
CONSTANTS_KEY = f"{METADATA_PREFIX}constants"
_LEGACY_CONSTANTS_KEY = "popbert.frozen"  # graphs saved before 0.2 (checkpoints' model.onnx)
# Model metadata key saying what a training graph's loss is the mean over (`LossMean`).
LOSS_MEAN_KEY = f"{METADATA_PREFIX}loss_mean"


@dataclass(frozen=True)
class LossMean:
    """What a training graph's loss (and each of its scalar outputs) is the mean over: its
    rows (`input` None), or the entries of the input `input` that are not `ignore` (labelled
    tokens). A session that runs a micro-batch in parts weights each part's loss by its share
    of these (`popbert.runtime.groups`)."""

    input: str | None = None
    ignore: int = 0

    def text(self) -> str:
        return "rows" if self.input is None else f"{self.input}!={self.ignore}"

    @classmethod
    def parse(cls, text: str) -> LossMean:
        if text == "rows":
            return cls()
        name, _, ignore = text.partition("!=")
        return cls(name, int(ignore))


def loss_mean(model: onnx.ModelProto) -> LossMean | None:
    """What `model`'s loss is the mean over, when its builder said (None: unknown)."""
    for prop in model.metadata_props:
        if prop.key == LOSS_MEAN_KEY:
            return LossMean.parse(prop.value)
    return None


class RecomputeType:
    """PopART's `popart.RecomputeType` values."""

    Undefined = 0
    Checkpoint = 1
    Recompute = 2
    Recomputed = 3


def annotation(node: Any, key: str) -> Any:
    """The annotation ``key`` of a lowered fx node (``node.meta["onnx"]``), or None."""
    meta = node.meta.get("onnx") or {}
    return (meta.get("attributes") or {}).get(key)


def node_annotation(node: onnx.NodeProto, key: str) -> Any:
    """The annotation ``key`` of an ONNX node, as a python value, or None."""
    for attr in node.attribute:
        if attr.name == key:
            return onnx.helper.get_attribute_value(attr)
    return None


def is_checkpoint(node: Any) -> bool:
    """Whether a lowered node's output is a recomputation checkpoint (kept for backward)."""
    value = annotation(node, RECOMPUTE)
    return value is not None and int(value) == RecomputeType.Checkpoint


def constant_initializers(model: onnx.ModelProto) -> set[str]:
    """Names of the initializers a session must treat as constants, not trainable weights."""
    for prop in model.metadata_props:
        if prop.key in (CONSTANTS_KEY, _LEGACY_CONSTANTS_KEY):
            return {name for name in prop.value.split(",") if name}
    return set()


def trainable_initializers(model: onnx.ModelProto) -> list[str]:
    """Floating-point initializers that are weights, in graph order."""
    constants = constant_initializers(model)
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
    return [t.name for t in model.graph.initializer
            if t.data_type in floats and t.name not in constants]


def strip_annotations(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy without PopART's `__` attributes and popbert metadata.

    ONNX Runtime's graph fusions copy node attributes into fused ops and then reject the
    unknown `__ipu_number`, so anything headed for ORT goes through here.
    """
    clean = onnx.ModelProto()
    clean.CopyFrom(model)
    for node in clean.graph.node:
        kept = [a for a in node.attribute if not a.name.startswith(ANNOTATION_PREFIX)]
        del node.attribute[:]
        node.attribute.extend(kept)
    kept_props = [p for p in clean.metadata_props
                  if p.key not in (CONSTANTS_KEY, _LEGACY_CONSTANTS_KEY, LOSS_MEAN_KEY)]
    del clean.metadata_props[:]
    clean.metadata_props.extend(kept_props)
    return clean
